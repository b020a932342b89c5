"""Where each TransformerLM parameter lives on a ("data", "model") mesh: one table of partition
rules that the trainer and the pretrained loader both read.

  PARTITION_RULES   (scope, leaf, rank) -> a logical name per array axis
  LOGICAL_AXES      logical name -> mesh axis ("heads", "kv_heads", "mlp", "vocab" -> "model";
                    "embed" -> "data")
  partition_spec    the PartitionSpec of one parameter by its path and shape on a mesh
  param_shardings   NamedShardings of a whole parameter tree
  check_mesh        a mesh a model of a config can be split over, else one ValueError line
  cache_spec        the PartitionSpec of one leaf of a decode cache (`qkv_jax.lm.init_cache`)
  cache_shardings   NamedShardings of a whole decode cache

Every parameter is matched by its last two path names and its rank (so the optimizer state's
leaves, which repeat the parameter's path under Adam's `mu` and `nu`, match as well):

  | parameter                          | shape        | split over                          |
  |------------------------------------|--------------|-------------------------------------|
  | `token_embedding/embedding`        | `[V, D]`     | V over model, D over data           |
  | `attention/query/kernel`           | `[D, N, H]`  | D over data, N over model           |
  | `attention/{key,value}/kernel`     | `[D, K, H]`  | D over data, K over model           |
  | `attention/{query,key,value}/bias` | `[N, H]`     | heads over model                    |
  | `attention/out/kernel`             | `[N, H, D]`  | N over model, D over data           |
  | `mlp_in/kernel`, `mlp_gate/kernel` | `[D, F]`     | D over data, F over model           |
  | `mlp_in/bias`, `mlp_gate/bias`     | `[F]`        | F over model                        |
  | `mlp_out/kernel`                   | `[F, D]`     | F over model, D over data           |
  | `head/kernel`                      | `[D, V]`     | D over data, V over model           |
  | `head/bias`                        | `[V]`        | V over model                        |
  | anything else (norms, positions,   |              | replicated                          |
  | LoRA adapters, other biases)       |              |                                     |

An axis the mesh axis does not divide stays whole (replicated across that mesh axis): K/V heads
fewer than the model axis are replicated, as grouped-query tensor parallelism does.

A decode cache follows its K/V weights: the cached keys and values `[B, S, K, H]` are split with
the batch over "data" and the K/V heads over "model" (each where it divides, so replicated
where the K/V weights are), MLA's cached latents `[B, S, r]` over "data" only, and the
`cache_index` counters are replicated. With
`fsdp=False` (the trainer's default) nothing is split over "data": each data-parallel replica
holds the whole model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "PARTITION_RULES",
    "LOGICAL_AXES",
    "partition_spec",
    "param_shardings",
    "check_mesh",
    "cache_spec",
    "cache_shardings",
]

# (scope name, leaf name, rank) -> the logical name of each axis (None: never split).
PARTITION_RULES: dict[tuple[str, str, int], tuple[str | None, ...]] = {
    ("token_embedding", "embedding", 2): ("vocab", "embed"),
    ("query", "kernel", 3): ("embed", "heads", None),
    ("key", "kernel", 3): ("embed", "kv_heads", None),
    ("value", "kernel", 3): ("embed", "kv_heads", None),
    ("query", "bias", 2): ("heads", None),
    ("key", "bias", 2): ("kv_heads", None),
    ("value", "bias", 2): ("kv_heads", None),
    ("out", "kernel", 3): ("heads", None, "embed"),
    ("mlp_in", "kernel", 2): ("embed", "mlp"),
    ("mlp_gate", "kernel", 2): ("embed", "mlp"),
    ("mlp_in", "bias", 1): ("mlp",),
    ("mlp_gate", "bias", 1): ("mlp",),
    ("mlp_out", "kernel", 2): ("mlp", "embed"),
    ("head", "kernel", 2): ("embed", "vocab"),
    ("head", "bias", 1): ("vocab",),
}
# Logical axis -> the mesh axis it is split over.
LOGICAL_AXES = {"heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model", "embed": "data"}


def _names(path: Any) -> list[str]:
    """The names along a tree path (dict keys, attribute names) or a "a/b/c" string."""
    if isinstance(path, str):
        return path.split("/")
    names = []
    for entry in path:
        for attribute in ("key", "name"):
            if hasattr(entry, attribute):
                names.append(str(getattr(entry, attribute)))
                break
    return names


def partition_spec(path: Any, shape: tuple[int, ...], axis_sizes: Mapping[str, int], fsdp: bool = True) -> P:
    """The PartitionSpec of the parameter at `path` (a tree path or "block_0/mlp_in/kernel") of
    `shape` on a mesh of `axis_sizes` ({"data": 4, "model": 2}); `fsdp=False` never splits over
    "data". An axis its mesh axis does not divide is not split."""
    names = _names(path)
    logical = PARTITION_RULES.get((names[-2], names[-1], len(shape))) if len(names) >= 2 else None
    if logical is None:
        return P()
    spec: list[str | None] = []
    for size, name in zip(shape, logical, strict=True):
        mesh_axis = LOGICAL_AXES.get(name) if name else None
        parts = axis_sizes.get(mesh_axis, 1) if mesh_axis and (fsdp or mesh_axis != "data") else 1
        spec.append(mesh_axis if parts > 1 and size % parts == 0 else None)
    return P(*spec) if any(spec) else P()


def param_shardings(tree: Any, mesh: Mesh, *, fsdp: bool = True, lead: int = 0) -> Any:
    """NamedShardings for every leaf of a params-like tree (arrays or ShapeDtypeStructs); `lead`
    leading axes of every leaf (a vmapped seed axis) are never split."""
    sizes = dict(mesh.shape)

    def sharding(path: Any, leaf: Any) -> NamedSharding:
        spec = partition_spec(path, tuple(np.shape(leaf))[lead:], sizes, fsdp)
        return NamedSharding(mesh, P(*([None] * lead), *spec))

    return jax.tree_util.tree_map_with_path(sharding, tree)


# The decode cache's leaves by name -> the mesh axis of each array axis (None: never split).
CACHE_RULES: dict[tuple[str, int], tuple[str | None, ...]] = {
    ("cached_key", 4): ("data", None, "model", None),
    ("cached_value", 4): ("data", None, "model", None),
    ("cached_latent", 3): ("data", None, None),
}


def cache_spec(path: Any, shape: tuple[int, ...], axis_sizes: Mapping[str, int]) -> P:
    """The PartitionSpec of the decode-cache leaf at `path` of `shape` on a mesh of `axis_sizes`:
    batch over "data", K/V heads over "model", each where it divides; anything else whole."""
    # The last "cached_*" name on the path: linen's cache ends there, nnx's State one step below.
    name = next((n for n in reversed(_names(path)) if n.startswith("cached_")), None)
    axes = CACHE_RULES.get((name, len(shape))) if name else None
    if axes is None:
        return P()
    spec = [
        axis if axis and axis_sizes.get(axis, 1) > 1 and size % axis_sizes[axis] == 0 else None
        for axis, size in zip(axes, shape, strict=True)
    ]
    return P(*spec) if any(spec) else P()


def cache_shardings(cache: Any, mesh: Mesh) -> Any:
    """NamedShardings for every leaf of a decode cache (arrays or ShapeDtypeStructs) on `mesh`."""
    sizes = dict(mesh.shape)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, cache_spec(path, tuple(np.shape(leaf)), sizes)), cache
    )


def check_mesh(mesh: Any, config: Any) -> None:
    """ValueError (one line) unless `mesh` is a jax Mesh with axes "data" and "model" whose
    model axis divides the query heads of `config` (a `TransformerConfig`) and either divides
    its K/V heads or is a multiple of them (the K/V heads then replicated), and whose devices
    this run's processes hold."""
    num_heads, num_kv_heads = config.num_heads, config.num_kv_heads or config.num_heads
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh={mesh!r}: must be a jax.sharding.Mesh with axes ('data', 'model')")
    if set(mesh.axis_names) != {"data", "model"}:
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)!r}: must be ('data', 'model')")
    model = mesh.shape["model"]
    if num_heads % model or (num_kv_heads % model and model % num_kv_heads):
        raise ValueError(
            f"mesh model axis={model}: must divide num_heads={num_heads} and divide (or be a "
            f"multiple of) num_kv_heads={num_kv_heads}"
        )
    devices = list(mesh.devices.flat)
    processes = {device.process_index for device in devices}
    if jax.process_index() not in processes:
        raise ValueError(
            f"mesh of {len(devices)} devices: holds none of process {jax.process_index()}'s devices"
        )
    if len(processes) > 1 and len(devices) != jax.device_count():
        raise ValueError(
            f"mesh of {len(devices)} devices over {len(processes)} processes: a mesh across processes "
            f"must hold all {jax.device_count()} devices of the {jax.process_count()} processes"
        )
