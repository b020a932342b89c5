"""Data- and head-parallel layouts on JAX's own sharding runtime.

A 2-D `jax.sharding.Mesh` with axes ("data", "model"):
  * batches are split over "data" (each device, and so each process, only
    draws its own share: with `jax_threefry_partitionable` the random batch
    generation is partitioned like its output);
  * with a "model" axis > 1, the parameters are split over it by the one table of
    `qkv_jax.sharding.PARTITION_RULES` (the pretrained loader reads it too): attention
    heads (query, key and value kernels `[D, heads, H]` along heads, `out`
    `[heads, Hv, D]` along its head axis), the MLP's hidden units and the vocabulary.
    Everything else, and any dimension the axis does not divide (one kv head under
    multi-query attention, say), is replicated; nothing is split over "data";
  * the optimizer state follows the parameter it belongs to.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from qkv_jax import sharding as sharding_rules
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


def partition_spec(path, shape: tuple[int, ...], model_size: int) -> P:
    """The PartitionSpec of one parameter (or optimizer-state leaf) by its path: the rules of
    `qkv_jax.sharding.PARTITION_RULES` over "model" (nothing is split over "data")."""
    return sharding_rules.partition_spec(path, shape, {"model": model_size}, fsdp=False)


def state_shardings(abstract_state: Any, mesh: Mesh, seed_axis: bool = False) -> Any:
    """NamedShardings for every leaf of a train state (or any params-like tree); with
    `seed_axis`, every leaf has a leading seed axis (vmapped seeds), which is not split."""
    return sharding_rules.param_shardings(abstract_state, mesh, fsdp=False, lead=int(seed_axis))


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
