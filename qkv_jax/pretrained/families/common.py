"""What the family files share: the readers they are given, activations, windows, RoPE, and the
layouts of Hugging Face tensors against qkv_jax's.

  ConfigReader     what a family reads a config.json through (`qkv_jax.pretrained.schema.HFConfig`)
  TensorSource     what it reads tensors through (one `get(name)` at a time)
  Field, read_fields, write_fields
                   config.json fields that are TransformerConfig fields under another name,
                   one table a family reads and writes
  activation       a Hugging Face activation name -> TransformerConfig.mlp_activation
  windows          per-layer windows from `layer_types` / `sliding_window` -> TransformerConfig.window
  Tensor           one parameter: its linen path, its Hugging Face name and the layout between them
  read_tensors     the tensors of a table, one at a time, in the linen layout
  StoredTensor     one such tensor not yet read: whole, or block by block for a device mesh
  write_tensors    the same table backwards: the Hugging Face tensors of linen parameters
  skip_stored      marks a checkpoint's buffers and a tied head's copy as deliberately unused

Layouts: a torch `nn.Linear` weight is `[out, in]`; qkv_jax's kernels are `[in, out]`, and the
attention's are `[D, N, H]` (query/key/value, `N` heads of `H` dims) and `[N, H, D]` (out). The
head `h` of a projection is the rows h * H ... (h + 1) * H - 1 of the torch weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np
from jax.experimental import multihost_utils

from qkv_jax.lm import TransformerConfig, layer_windows
from qkv_jax.positions import RopeScaling

__all__ = [
    "ConfigReader",
    "TensorSource",
    "Field",
    "REQUIRED",
    "read_fields",
    "write_fields",
    "ACTIVATIONS",
    "activation",
    "hf_activation",
    "windows",
    "layer_types",
    "Tensor",
    "LAYOUTS",
    "read_tensors",
    "StoredTensor",
    "LINEN_SHAPES",
    "write_tensors",
    "array",
    "rope_parameters",
]


class ConfigReader(Protocol):
    """A config.json being read (`qkv_jax.pretrained.schema.HFConfig`): each field read is
    recorded, and the loader refuses the fields nobody read."""

    model_type: str

    def __contains__(self, name: str) -> bool: ...

    def get(self, name: str, default: Any = None) -> Any: ...

    def require(self, name: str) -> Any: ...

    def accept(self, name: str, *values: Any) -> Any: ...

    def refuse(self, name: str, value: Any, why: str) -> Any: ...

    def rope(
        self, kinds: tuple[str, ...] = ("full_attention",), default_base: float = 10000.0
    ) -> Mapping[str, tuple[float, RopeScaling | None]]: ...

    def rope_fraction(self, *legacy_names: str) -> float: ...


class TensorSource(Protocol):
    """The tensors of a checkpoint (`qkv_jax.pretrained.checkpoint.TensorSource`), read one at a
    time by name; `skip` marks a stored tensor as deliberately unused."""

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray: ...

    def has(self, name: str) -> bool: ...

    def skip(self, name: str) -> None: ...


REQUIRED = object()  # a `Field`'s default when config.json must give the field


class Field(NamedTuple):
    """A config.json field that is the TransformerConfig field `ours`, its value unchanged;
    `default`: the family's value when the file leaves it out (`REQUIRED`: it may not)."""

    ours: str
    default: Any = REQUIRED


def read_fields(hf: ConfigReader, fields: Mapping[str, Field]) -> dict[str, Any]:
    """TransformerConfig keywords from the config.json fields of `fields` (their names -> Field)."""
    return {
        field.ours: hf.require(name) if field.default is REQUIRED else hf.get(name, field.default)
        for name, field in fields.items()
    }


def write_fields(config: TransformerConfig, fields: Mapping[str, Field]) -> dict[str, Any]:
    """The config.json fields of `fields` from `config`: `read_fields` backwards."""
    return {name: getattr(config, field.ours) for name, field in fields.items()}


# Hugging Face's activation names (transformers' ACT2FN) -> TransformerConfig.mlp_activation.
ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
}
# The name each family writes for an mlp_activation.
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "silu": "silu", "relu": "relu"}


def activation(hf: ConfigReader, field: str, default: str) -> str:
    """TransformerConfig.mlp_activation of the Hugging Face activation `field` (absent: `default`,
    the family's); ValueError naming the field for one qkv_jax does not compute."""
    return ACTIVATIONS[hf.accept(field, default, *(name for name in ACTIVATIONS if name != default))]


def attention_biases(hf: ConfigReader) -> dict[str, Any]:
    """qkv_bias and out_bias of the families whose `attention_bias` (default False) puts biases on
    all four attention projections."""
    bias = hf.accept("attention_bias", False, True)
    return dict(qkv_bias=bias, out_bias=bias)


def hf_activation(config: TransformerConfig) -> str:
    """The Hugging Face name of `config.mlp_activation`."""
    return HF_ACTIVATIONS[config.mlp_activation]


def windows(types: Iterable[str], sliding_window: int | None) -> int | tuple[int | None, ...] | None:
    """TransformerConfig.window for layers of Hugging Face `types` ("sliding_attention" or
    "full_attention" each; a sliding layer sees `sliding_window` keys, itself included): None
    when no layer is windowed, the int when every layer is, else the tuple over the layers."""
    per_layer = tuple(sliding_window if kind == "sliding_attention" else None for kind in types)
    if all(w is None for w in per_layer):
        return None
    if len(set(per_layer)) == 1:
        return per_layer[0]
    return per_layer


def layer_types(config: TransformerConfig) -> list[str]:
    """Hugging Face's `layer_types` of `config`'s windows."""
    return ["full_attention" if w is None else "sliding_attention" for w in layer_windows(config)]


def sliding_window(config: TransformerConfig) -> int | None:
    """The one window of `config`'s windowed layers (None: none); ValueError when they differ, which
    Hugging Face's configs cannot say."""
    sizes = {w for w in layer_windows(config) if w is not None}
    if len(sizes) > 1:
        raise ValueError(
            f"save_pretrained: window={config.window!r} has windows of {sorted(sizes)} keys; Hugging Face "
            "configs hold one sliding_window"
        )
    return sizes.pop() if sizes else None


def rope_parameters(base: float, scaling: RopeScaling | None, fraction: float = 1.0) -> dict[str, Any]:
    """transformers 5's `rope_parameters` dict of one RoPE (base, scaling, rotary fraction)."""
    parameters: dict[str, Any] = {
        "rope_type": "default" if scaling is None else scaling.kind,
        "rope_theta": base,
    }
    if fraction != 1.0:
        parameters["partial_rotary_factor"] = fraction
    if scaling is None:
        return parameters
    parameters["factor"] = scaling.factor
    if scaling.kind == "llama3":
        parameters["low_freq_factor"] = scaling.low_freq_factor
        parameters["high_freq_factor"] = scaling.high_freq_factor
    if scaling.kind == "yarn":
        parameters["beta_fast"] = scaling.beta_fast
        parameters["beta_slow"] = scaling.beta_slow
        parameters["truncate"] = scaling.truncate
        if scaling.attention_factor is not None:
            parameters["attention_factor"] = scaling.attention_factor
    if scaling.kind != "linear":
        parameters["original_max_position_embeddings"] = scaling.original_max_len
    return parameters


# ---------------------------------------------------------------------------------- tensor layouts


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a Hugging Face tensor becomes a linen parameter (`load`) and back (`save`), given the
    number of heads of the projection (None where no heads are involved)."""

    load: Callable[[np.ndarray, int], np.ndarray]
    save: Callable[[np.ndarray, int], np.ndarray]


def _heads_in(weight: np.ndarray, heads: int) -> np.ndarray:
    """torch `[N*H, D]` -> `[D, N, H]`."""
    return weight.reshape(heads, -1, weight.shape[-1]).transpose(2, 0, 1)  # (D, N, H)


def _heads_in_back(kernel: np.ndarray, heads: int) -> np.ndarray:
    """`[D, N, H]` -> torch `[N*H, D]`."""
    return kernel.reshape(kernel.shape[0], -1).T  # (N*H, D)


def _heads_out(weight: np.ndarray, heads: int) -> np.ndarray:
    """torch `[D, N*H]` -> `[N, H, D]`."""
    return weight.T.reshape(heads, -1, weight.shape[0])  # (N, H, D)


def _heads_out_back(kernel: np.ndarray, heads: int) -> np.ndarray:
    """`[N, H, D]` -> torch `[D, N*H]`."""
    return kernel.reshape(-1, kernel.shape[-1]).T  # (D, N*H)


LAYOUTS = {
    "copy": Layout(lambda x, _: x, lambda x, _: x),  # embeddings, norm gains, MLP/out biases
    "linear": Layout(lambda w, _: w.T, lambda k, _: k.T),  # torch [out, in] <-> kernel [in, out]
    "conv1d": Layout(lambda w, _: w, lambda k, _: k),  # GPT-2's Conv1D: already [in, out]
    "heads_in": Layout(_heads_in, _heads_in_back),  # q/k/v weight [N*H, D] <-> [D, N, H]
    "heads_bias": Layout(lambda b, n: b.reshape(n, -1), lambda b, _: b.reshape(-1)),  # [N*H] <-> [N, H]
    "heads_out": Layout(_heads_out, _heads_out_back),  # o_proj weight [D, N*H] <-> [N, H, D]
    # GPT-2's Conv1D c_proj [N*H, D] <-> [N, H, D]
    "conv1d_heads_out": Layout(
        lambda w, n: w.reshape(n, -1, w.shape[-1]), lambda k, _: k.reshape(-1, k.shape[-1])
    ),
}


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One parameter: its linen path ("block_0/attention/query/kernel"), its Hugging Face tensor
    name, the `LAYOUTS` entry between them and the heads its projection has."""

    path: str
    name: str
    layout: str = "copy"
    heads: int = 0


# The linen shape of a stored tensor of shape `s` in each layout, given its heads `n`.
LINEN_SHAPES: dict[str, Callable[[tuple[int, ...], int], tuple[int, ...]]] = {
    "copy": lambda s, n: s,
    "linear": lambda s, n: s[::-1],
    "conv1d": lambda s, n: s,
    "heads_in": lambda s, n: (s[1], n, s[0] // n),
    "heads_bias": lambda s, n: (n, s[0] // n),
    "heads_out": lambda s, n: (n, s[1] // n, s[0]),
    "conv1d_heads_out": lambda s, n: (n, s[0] // n, s[1]),
}


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """A checkpoint tensor in a linen layout, read only when asked: whole (`np.asarray`) or one
    block of the linen array (`stored_block`), so that a process reads only the slices its
    devices hold and converts the layout block by block (on the device: `LAYOUTS[layout].load`
    works on numpy and JAX arrays alike)."""

    tensors: Any  # qkv_jax.pretrained.checkpoint.TensorSource (`shape`, `read_slice`)
    name: str
    layout: str
    heads: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The linen shape (from the file's header; nothing is read)."""
        return tuple(LINEN_SHAPES[self.layout](tuple(self.tensors.shape(self.name)), self.heads))

    def stored_block(self, index: tuple[slice, ...], *, mapped: bool = False) -> tuple[np.ndarray, int]:
        """(the stored tensor's slice holding the linen block `index` (slices with start and
        stop), its heads) for `LAYOUTS[layout].load`; a heads layout's block holds whole heads.
        `mapped`: a read-only view of the file's mapping, for a caller that copies it at once."""
        shape, layout = self.shape, self.layout
        if layout in ("copy", "conv1d", "linear"):
            stored = index[::-1] if layout == "linear" else index
            return self.tensors.read_slice(self.name, stored, mapped=mapped), self.heads
        heads_axis, width_axis = (1, 2) if layout == "heads_in" else (0, 1)
        heads, within, width = index[heads_axis], index[width_axis], shape[width_axis]
        if (within.start, within.stop) != (0, width):
            raise ValueError(f"{self.name}: a block of part of each head ({within}) cannot be read")
        rows = slice(heads.start * width, heads.stop * width)
        stored = {
            "heads_in": lambda: (rows, index[0]),
            "heads_bias": lambda: (rows,),
            "heads_out": lambda: (index[2], rows),
            "conv1d_heads_out": lambda: (rows, index[2]),
        }[layout]()
        return self.tensors.read_slice(self.name, stored, mapped=mapped), heads.stop - heads.start

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        block, heads = self.stored_block(tuple(slice(0, size) for size in self.shape))
        value = np.ascontiguousarray(LAYOUTS[self.layout].load(block, heads))
        return value if dtype is None else value.astype(dtype)


def read_tensors(table: Iterable[Tensor], tensors: TensorSource) -> Iterator[tuple[str, Any]]:
    """(linen path, the tensor in the linen layout) for each entry of `table`: a `StoredTensor`
    (read when the loader asks for its blocks) where `tensors` reads slices, else the array."""
    mark_read = getattr(tensors, "mark_read", None)  # a source that reads slices
    for entry in table:
        if mark_read is not None:
            mark_read(entry.name)
            yield entry.path, StoredTensor(tensors, entry.name, entry.layout, entry.heads)
        else:
            yield (
                entry.path,
                np.ascontiguousarray(LAYOUTS[entry.layout].load(tensors.get(entry.name), entry.heads)),
            )


def skip_stored(
    tensors: TensorSource, config: TransformerConfig, head: str, buffers: Iterable[str] = ()
) -> None:
    """Marks as deliberately unused the `buffers` the checkpoint stores and, when `config` ties the
    head to the token embedding, the stored copy `head` of the embedding."""
    for name in [*buffers, head] if config.tie_embeddings else buffers:
        if tensors.has(name):
            tensors.skip(name)


def qkv_arrays(params: Mapping[str, Any], block: int, leaf: str) -> list[np.ndarray]:
    """The query's, key's and value's linen parameter `leaf` ("kernel", "bias") of block `block`."""
    return [array(params, f"block_{block}/attention/{name}/{leaf}") for name in ("query", "key", "value")]


def array(params: Mapping[str, Any], path: str) -> np.ndarray:
    """The linen parameter at `path` ("block_0/attention/query/kernel") of a nested params tree,
    whole on the host: a global array split over several processes is gathered (every process
    calls this in the same order), one tensor at a time."""
    node: Any = params
    for key in path.split("/"):
        node = node[key]
    if isinstance(node, jax.Array) and not node.is_fully_addressable:  # split over processes
        return np.asarray(multihost_utils.process_allgather(node, tiled=True))
    return np.asarray(node)


def write_tensors(table: Iterable[Tensor], params: Mapping[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, contiguous array in its layout) for each entry of `table`."""
    for entry in table:
        yield (
            entry.name,
            np.ascontiguousarray(LAYOUTS[entry.layout].save(array(params, entry.path), entry.heads)),
        )


def norm_tensors(path: str, name: str, with_bias: bool) -> list[Tensor]:
    """A norm's gain (`scale` <- `weight`), and its bias."""
    table = [Tensor(f"{path}/scale", f"{name}.weight")]
    return table + [Tensor(f"{path}/bias", f"{name}.bias")] if with_bias else table


def dense_tensors(
    path: str, name: str, with_bias: bool, layout: str = "linear", heads: int = 0
) -> list[Tensor]:
    """A projection's kernel (`kernel` <- `weight` in `layout`) and its bias (in heads for the
    query/key/value projections)."""
    table = [Tensor(f"{path}/kernel", f"{name}.weight", layout, heads)]
    if not with_bias:
        return table
    return table + [
        Tensor(f"{path}/bias", f"{name}.bias", "heads_bias" if layout == "heads_in" else "copy", heads)
    ]


def kv_heads(config: TransformerConfig) -> int:
    """The key/value heads of `config`."""
    return config.num_kv_heads or config.num_heads
