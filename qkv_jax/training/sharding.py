"""Data- and head-parallel layouts on JAX's own sharding runtime.

A 2-D `jax.sharding.Mesh` with axes ("data", "model"):
  * batches are split over "data" (each device, and so each process, only
    draws its own share: with `jax_threefry_partitionable` the random batch
    generation is partitioned like its output);
  * with a "model" axis > 1, attention heads are split over it (query, key and
    value kernels `[D, heads, H]` along heads, `out` `[heads, Hv, D]` along its
    head axis) and so are the MLP's hidden units (`mlp_in` columns, `mlp_out`
    rows). Everything else, and any dimension the axis does not divide (one
    kv head under multi-query attention, say), is replicated;
  * the optimizer state follows the parameter it belongs to.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qkv_jax.training.validate import ConfigError

__all__ = [
    "make_mesh",
    "mesh_shape",
    "state_shardings",
    "partition_spec",
    "to_host",
    "gather",
    "is_primary",
]

# (scope name, leaf name, rank) -> the axis of the array that holds heads / hidden units.
_SHARDED_AXIS = {
    ("query", "kernel", 3): 1,
    ("key", "kernel", 3): 1,
    ("value", "kernel", 3): 1,
    ("query", "bias", 2): 0,
    ("key", "bias", 2): 0,
    ("value", "bias", 2): 0,
    ("out", "kernel", 3): 0,
    ("mlp_in", "kernel", 2): 1,
    ("mlp_in", "bias", 1): 0,
    ("mlp_out", "kernel", 2): 0,
}


def mesh_shape(config: dict, num_devices: int | None = None) -> tuple[int, int]:
    """(data, model) from `config['mesh']` (-1 = all remaining devices), validated."""
    num_devices = jax.device_count() if num_devices is None else num_devices
    mesh = config.get("mesh") or {}
    data, model = mesh.get("data", -1), mesh.get("model", 1)
    for name, value in (("mesh.data", data), ("mesh.model", model)):
        if isinstance(value, bool) or not isinstance(value, int) or (value <= 0 and value != -1):
            raise ConfigError(f"{name}={value!r}: must be a positive integer or -1 (all remaining devices)")
    if data == -1 and model == -1:
        raise ConfigError("mesh.data=-1 and mesh.model=-1: at most one axis can take the remaining devices")
    requested = (data, model)
    if model == -1:
        model = num_devices // data
    if data == -1:
        data = num_devices // model
    if data < 1 or model < 1 or data * model > num_devices:
        raise ConfigError(
            f"mesh.data={requested[0]} x mesh.model={requested[1]}: asks for more devices than the "
            f"{num_devices} that exist"
        )
    batch = config["train"]["batch_size"]
    if batch % data:
        raise ConfigError(f"train.batch_size={batch} is not divisible by the data axis (mesh.data={data})")
    heads = config.get("model", {}).get("num_heads", 1)  # unset: a pretrained model's (its task checks)
    if heads is not None and heads % model:
        raise ConfigError(f"model.num_heads={heads} is not divisible by the model axis (mesh.model={model})")
    return data, model


def make_mesh(data: int, model: int) -> Mesh:
    """A ("data", "model") mesh over the first data * model devices."""
    devices = np.asarray(jax.devices()[: data * model]).reshape(data, model)
    return Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def _names(path) -> list[str]:
    names = []
    for entry in path:
        for attribute in ("key", "name"):
            if hasattr(entry, attribute):
                names.append(str(getattr(entry, attribute)))
                break
    return names


def partition_spec(path, shape: tuple[int, ...], model_size: int) -> P:
    """The PartitionSpec of one parameter (or optimizer-state leaf) by its path."""
    names = _names(path)
    if len(names) < 2 or model_size == 1:
        return P()
    axis = _SHARDED_AXIS.get((names[-2], names[-1], len(shape)))
    if axis is None or shape[axis] % model_size:
        return P()
    spec: list[str | None] = [None] * len(shape)
    spec[axis] = "model"
    return P(*spec)


def state_shardings(abstract_state: Any, mesh: Mesh, seed_axis: bool = False) -> Any:
    """NamedShardings for every leaf of a train state (or any params-like tree); with
    `seed_axis`, every leaf has a leading seed axis (vmapped seeds), which is not split."""
    model_size, lead = mesh.shape["model"], int(seed_axis)

    def sharding(path, leaf):
        spec = partition_spec(path, np.shape(leaf)[lead:], model_size)
        return NamedSharding(mesh, P(*([None] * lead), *spec))

    return jax.tree_util.tree_map_with_path(sharding, abstract_state)


def gather(x: Any) -> np.ndarray:
    """The whole value of a (possibly sharded, possibly multi-process) array, on the host."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def to_host(tree: Any) -> Any:
    """`jax.device_get` that also works for replicated arrays of a multi-process run."""

    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if x.sharding.is_fully_replicated:
                return np.asarray(x.addressable_data(0))
            return gather(x)
        return jax.device_get(x)

    return jax.tree.map(get, tree)


def is_primary() -> bool:
    """Process 0 writes metrics, summaries and pictures."""
    return jax.process_index() == 0
