"""Loading a Hugging Face directory into qkv_jax's TransformerLM, tensor by tensor.

  load_pretrained(directory, *, dtype=None, mesh=None)      -> (TransformerConfig, linen params)
  load_pretrained_nnx(directory, *, dtype=None, mesh=None)  -> qkv_jax.nnx.TransformerLM
  family_of(model_type)                          the family file reading that config.json

Order of work: config.json (its family, then every field refused that the family does not
read), then the weight files' headers (every shard present and readable), then the tensors,
one at a time: each is checked against the model's parameter shape (from the header), then
read block by block (the blocks this process's devices hold, on a mesh), each block put on its
devices in the stored order and converted there (layout and dtype), and dropped, so at any
moment the process holds its share of the model plus about one tensor's block. Every tensor
the family does not read is refused as unexpected. Nothing is written to `directory`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import pathlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from qkv_jax.lm import TransformerConfig, TransformerLM
from qkv_jax.pretrained.checkpoint import INDEX, SINGLE, PretrainedError, TensorSource, read_json
from qkv_jax.pretrained.placement import place, sharding_of
from qkv_jax.pretrained.schema import HFConfig
from qkv_jax.sharding import check_mesh

__all__ = [
    "MIXTURES_OF_EXPERTS",
    "family_of",
    "read_config",
    "is_pretrained_directory",
    "load_config",
    "load_pretrained",
    "load_pretrained_nnx",
]

# model_types of mixture-of-experts models: TransformerLM has one MLP per block, not experts.
MIXTURES_OF_EXPERTS = (
    "dbrx",
    "deepseek_v2",
    "deepseek_v3",
    "granitemoe",
    "gpt_oss",
    "jamba",
    "jetmoe",
    "mixtral",
    "olmoe",
    "phimoe",
    "qwen2_moe",
    "qwen3_moe",
)


def family_of(model_type: str) -> ModuleType:
    """The family file for `model_type` (`qkv_jax.pretrained.families.FAMILIES`); a ValueError
    naming model_type and the supported ones for any other."""
    from qkv_jax.pretrained.families import FAMILIES

    if model_type in FAMILIES:
        return FAMILIES[model_type]
    why = (
        " (a mixture of experts, which TransformerLM does not compute)"
        if model_type in MIXTURES_OF_EXPERTS
        else ""
    )
    raise ValueError(
        f"config.json: model_type={model_type!r} has no qkv_jax family{why}; "
        f"supported: {', '.join(sorted(FAMILIES))}"
    )


def read_config(directory: str | pathlib.Path) -> HFConfig:
    """The HFConfig of `directory`/config.json; PretrainedError naming the file when it is
    missing, not JSON, or without a model_type."""
    path = pathlib.Path(directory)
    if not path.is_dir():
        raise PretrainedError(f"{path}: not a directory (a Hugging Face model directory holds config.json)")
    fields = read_json(path / "config.json")
    if not isinstance(fields.get("model_type"), str):
        raise PretrainedError(f"{path / 'config.json'}: has no model_type string")
    return HFConfig(fields, source=str(path / "config.json"))


def is_pretrained_directory(directory: str | pathlib.Path) -> bool:
    """Whether `directory` looks like a Hugging Face model directory: a config.json beside a
    model.safetensors or a model.safetensors.index.json (nothing is read or checked)."""
    path = pathlib.Path(directory)
    return (path / "config.json").is_file() and ((path / SINGLE).is_file() or (path / INDEX).is_file())


def load_config(directory: str | pathlib.Path) -> tuple[TransformerConfig, str]:
    """(TransformerConfig, model_type) of `directory`/config.json, every field checked as
    `load_pretrained` checks it, without reading a tensor. The config's dtypes are
    TransformerConfig's defaults (float32): the checkpoint's own come from its tensors."""
    hf = read_config(directory)
    config = family_of(hf.model_type).to_config(hf)
    hf.check_all_read()
    return config, hf.model_type


def _param_dtype(tensors: TensorSource, dtype: Any) -> np.dtype:
    """`dtype` when given (a floating dtype), else the floating dtype holding most of the
    checkpoint's bytes (bfloat16 stays bfloat16)."""
    if dtype is not None:
        chosen = np.dtype(jnp.dtype(dtype))
        if not jnp.issubdtype(chosen, jnp.floating):
            raise ValueError(f"load_pretrained: dtype={dtype!r} must be a floating dtype (or None)")
        return chosen
    floating = {d: size for d, size in tensors.stored_bytes().items() if jnp.issubdtype(d, jnp.floating)}
    if not floating:
        raise PretrainedError(f"{tensors.listing}: holds no floating-point tensors")
    return max(floating, key=lambda d: floating[d])


# Tensors read, transferred and converted at once, each in a thread of its own: one is read
# (os.preadv and numpy's copies release the GIL) while another converts.
IN_FLIGHT = 2


def parameter_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """{"block_0/attention/query/kernel": shape, ...} of a TransformerLM of `config`, traced
    without computing (or allocating) anything."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    shapes = jax.eval_shape(TransformerLM(config).init, jax.random.PRNGKey(0), tokens)["params"]
    return {
        "/".join(str(getattr(key, "key", key)) for key in path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(shapes)
    }


def _source_of(tensors: TensorSource) -> str:
    """The tensors read since the last yield, with their files and stored shapes."""
    named = [f"{tensors.file_of(n)}: tensor {n!r} of shape {tensors.shape(n)}" for n in tensors.recent]
    return "; ".join(named) if named else f"{tensors.listing}"


def _family_arrays(
    family: ModuleType, config: TransformerConfig, tensors: TensorSource
) -> Iterator[tuple[str, Any]]:
    """The family's (linen path, array) pairs; an error inside its conversion (a reshape that does
    not fit) becomes a PretrainedError naming the tensor it was converting."""
    arrays = family.from_hf(config, tensors)
    while True:
        tensors.recent.clear()
        try:
            item = next(arrays)
        except StopIteration:
            return
        except PretrainedError:
            raise
        except (ValueError, TypeError, IndexError) as err:
            raise PretrainedError(f"{_source_of(tensors)}: does not convert ({err})") from None
        yield item


def _place(params: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split("/")
    node = params
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def read_params(
    family: ModuleType,
    config: TransformerConfig,
    tensors: TensorSource,
    dtype: np.dtype,
    mesh: Mesh | None = None,
) -> dict[str, Any]:
    """The linen params of `config` from `tensors` through `family.from_hf`, each array checked
    against the model's shape, then placed (`placement.place`: on the default device, or split
    over `mesh` by `qkv_jax.sharding`'s rules) in `dtype`, `IN_FLIGHT` tensors at once."""
    expected = parameter_shapes(config)
    params: dict[str, Any] = {}
    placed: set[str] = set()
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        in_flight: dict[concurrent.futures.Future, str] = {}  # a placement -> its path
        for path, array in _family_arrays(family, config, tensors):
            _check_shape(tensors, expected, placed, path, tuple(array.shape))
            _place(params, path, None)  # its place in the tree, in the checkpoint's order
            placing = pool.submit(place, array, sharding_of(path, tuple(array.shape), mesh), dtype)
            in_flight[placing] = path
            placed.add(path)
            del array
            # the next tensor is read as soon as any placement is done: one large tensor
            # (an embedding) does not hold up the small ones behind it
            if len(in_flight) >= IN_FLIGHT:
                concurrent.futures.wait(in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
            for done in [placing for placing in in_flight if placing.done()]:
                _settle(params, in_flight.pop(done), done)
        for placing in list(in_flight):
            _settle(params, in_flight.pop(placing), placing)
    _check_complete(family, config, tensors, expected, placed)
    return params


def _settle(params: dict[str, Any], path: str, placing: concurrent.futures.Future) -> None:
    """A placement's array, once its transfers and conversion are done, into `params`."""
    _place(params, path, placing.result().block_until_ready())


def _check_shape(
    tensors: TensorSource, expected: dict[str, tuple[int, ...]], placed: set[str], path: str, shape: tuple
) -> None:
    """PretrainedError unless the family's `path` is a new parameter of the model's shape."""
    if path in placed:
        raise PretrainedError(f"{_source_of(tensors)}: gives {path} a second time")
    if path not in expected:
        raise PretrainedError(f"{_source_of(tensors)}: gives {path}, which the config's model does not have")
    if shape != expected[path]:
        raise PretrainedError(
            f"{_source_of(tensors)}: gives {path} of shape {shape}; the config "
            f"({tensors.directory / 'config.json'}) gives {expected[path]}"
        )


def _check_complete(
    family: ModuleType, config: TransformerConfig, tensors: TensorSource, expected: dict, placed: set[str]
) -> None:
    """PretrainedError naming the model's parameters no tensor gave, or the tensors left unread."""
    missing = sorted(set(expected) - placed)
    if missing:
        raise PretrainedError(
            f"{tensors.listing}: gives no value for {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more parameters" if len(missing) > 5 else "")
        )
    unread = tensors.unread()
    if unread:
        first = unread[0]
        raise PretrainedError(
            f"{tensors.file_of(first)}: unexpected tensor {first!r}"
            + (f" (and {len(unread) - 1} more)" if len(unread) > 1 else "")
            + f", which the {config_name(family)} mapping does not read"
        )


def config_name(family: ModuleType) -> str:
    """The model_type a family file is named by (its first MODEL_TYPES entry)."""
    return family.MODEL_TYPES[0] if getattr(family, "MODEL_TYPES", ()) else family.__name__


def load_pretrained(
    directory: str | pathlib.Path, *, dtype: Any = None, mesh: Mesh | None = None
) -> tuple[TransformerConfig, dict[str, Any]]:
    """(TransformerConfig, params) of the Hugging Face model in `directory`, for the linen
    `qkv_jax.TransformerLM`: `TransformerLM(config).apply({"params": params}, tokens)`.

    `directory` holds config.json and model.safetensors, or the shards that
    model.safetensors.index.json names. `dtype` (None: the checkpoint's own, so bfloat16
    stays bfloat16) is the parameters' dtype and the config's `param_dtype` and `dtype`.
    With `mesh` (a `jax.sharding.Mesh` with axes "data" and "model") the parameters are global
    jax.Arrays split by `qkv_jax.sharding.PARTITION_RULES`: each process reads only the rows
    its devices' blocks span, two tensors at a time (under `jax.distributed` too).

    Raises ValueError naming the field and its value for a config.json field qkv_jax does not
    compute (a model_type without a family, a mixture of experts, an unread field, a RoPE
    scaling it lacks), and `PretrainedError` (a ValueError) naming the file and the tensor for
    a missing config.json, invalid JSON, a missing, truncated or corrupt safetensors file, a
    shard the index names that is absent, a missing, unexpected or misshapen tensor; a
    ValueError (before any tensor is read) for a mesh without the two axes, a model axis that
    divides neither the heads nor the K/V heads, or one this run's processes do not match.
    """
    path = pathlib.Path(directory)
    config, model_type = load_config(path)
    family = family_of(model_type)
    if mesh is not None:
        check_mesh(mesh, config)
    with TensorSource(path) as tensors:
        param_dtype = _param_dtype(tensors, dtype)
        config = dataclasses.replace(config, param_dtype=param_dtype, dtype=param_dtype)
        params = read_params(family, config, tensors, param_dtype, mesh)
    return config, params


def load_pretrained_nnx(
    directory: str | pathlib.Path, *, dtype: Any = None, seed: int = 0, mesh: Mesh | None = None
) -> Any:
    """The `qkv_jax.nnx.TransformerLM` of the Hugging Face model in `directory` (see
    `load_pretrained`, whose parameters it holds without another copy, split over `mesh` when
    given); `seed` seeds its dropout streams."""
    config, params = load_pretrained(directory, dtype=dtype, mesh=mesh)
    return nnx_model(config, params, seed=seed)


def nnx_model(config: TransformerConfig, params: dict[str, Any], *, seed: int = 0) -> Any:
    """An nnx TransformerLM of `config` holding the linen `params` (the same arrays): built
    abstractly, so no random parameters are ever allocated beside them."""
    from flax import nnx

    from qkv_jax.nnx.lm import TransformerLM as NNXTransformerLM

    def build() -> Any:
        return NNXTransformerLM(config, rngs=nnx.Rngs(seed))

    abstract = nnx.eval_shape(build)
    graphdef, param_state = nnx.graphdef(abstract), nnx.state(abstract, nnx.Param)
    # The other state (dropout rng keys and counts) is computed for real; the parameters'
    # initializers are dead code in this program, which XLA drops.
    rest = jax.jit(lambda: nnx.state(build(), nnx.Not(nnx.Param)))()
    nnx.replace_by_pure_dict(param_state, params)
    return nnx.merge(graphdef, param_state, rest)
