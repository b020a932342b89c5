"""Placing a checkpoint's tensors onto devices, block by block.

  sharding_of   the sharding a parameter gets: its `qkv_jax.sharding` rule on a mesh, or the
                default device without one
  place         one tensor as a global jax.Array of that sharding: each distinct block the
                process's devices hold is read once (only its bytes, for a `StoredTensor`),
                put on those devices in the stored order and converted there (transpose,
                heads split, cast) by one program for all devices and processes, so no
                process holds more of the tensor than its blocks

Converting on the device replaces numpy's copies of transposed arrays, which were most of a
one-device load's time.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from qkv_jax import sharding as rules
from qkv_jax.pretrained.families.common import LAYOUTS, StoredTensor

__all__ = ["sharding_of", "place", "ON_DEVICE_BYTES"]

# Blocks of at least this many bytes are converted on their device (one small compiled program
# per tensor shape); smaller ones by numpy, on the host.
ON_DEVICE_BYTES = 1 << 20


def sharding_of(path: str, shape: tuple[int, ...], mesh: Mesh | None) -> Sharding:
    """The parameter at `path` ("block_0/mlp_in/kernel") on `mesh` by `qkv_jax.sharding`'s
    rules; the default device without a mesh."""
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(mesh, rules.partition_spec(path, shape, dict(mesh.shape)))


@functools.partial(jax.jit, static_argnames=("layout", "heads", "dtype"))
def _convert(block: jax.Array, layout: str, heads: int, dtype: Any) -> jax.Array:
    """A stored-order block in the linen layout and `dtype`, computed where `block` lives."""
    load: Any = LAYOUTS[layout].load  # written for numpy; the same methods on a jax.Array
    return load(block, heads).astype(dtype)


def _read(value: Any, index: tuple[slice, ...]) -> tuple[np.ndarray, str, int]:
    """(the stored block, its layout, its heads) of the linen block `index` of `value`."""
    if isinstance(value, StoredTensor):
        block, heads = value.stored_block(index)
        return block, value.layout, heads
    return np.ascontiguousarray(np.asarray(value)[index]), "copy", 0


def _convert_stacked(
    stacked: jax.Array, layout: str, heads: int, dtype: Any, mesh: Mesh, spec: P
) -> jax.Array:
    """Every device's stored-order block (`stacked`: `[devices, *block]`, one row per device of
    `mesh`) in the linen layout and `dtype`, as the global array of `spec`."""
    load: Any = LAYOUTS[layout].load

    def convert(local: jax.Array) -> jax.Array:  # (1, *block) -> the device's linen block
        return load(local[0], heads).astype(dtype)

    every = P(tuple(mesh.axis_names))  # row i on the i-th device of the mesh, in its order
    return jax.shard_map(convert, mesh=mesh, in_specs=every, out_specs=spec, check_vma=False)(stacked)


def _convert_on_mesh(
    stacked: jax.Array, layout: str, heads: int, dtype: Any, sharding: NamedSharding
) -> jax.Array:
    """`_convert_stacked` as one program for all devices and processes, compiled once per tensor
    shape, its result of exactly `sharding` (its spec as written)."""
    program = jax.jit(_convert_stacked, static_argnums=(1, 2, 3, 4, 5), out_shardings=sharding)
    return program(stacked, layout, heads, dtype, sharding.mesh, sharding.spec)


def _blocks(
    shape: tuple[int, ...], sharding: Sharding
) -> dict[tuple[tuple[int, int], ...], list[jax.Device]]:
    """Each distinct block (start, stop per axis) this process's devices hold -> those devices."""
    blocks: dict[tuple[tuple[int, int], ...], list[jax.Device]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        whole = index or tuple(slice(None) for _ in shape)
        bounds = tuple(s.indices(size)[:2] for s, size in zip(whole, shape, strict=True))
        blocks.setdefault(bounds, []).append(device)
    return blocks


def place(value: Any, sharding: Sharding, dtype: np.dtype) -> jax.Array:
    """`value` (a `StoredTensor` or an array, in the linen layout) as a jax.Array of `sharding`
    and `dtype`; each distinct block this process's devices hold is read once. Returns at
    once: the transfers and conversions run on while the caller reads the next tensor."""
    shape = tuple(value.shape)
    on_mesh = isinstance(sharding, NamedSharding)
    arrays, convert = [], None  # convert: (layout, heads), alike for every block of a tensor
    for bounds, devices in _blocks(shape, sharding).items():
        block, layout, heads = _read(value, tuple(slice(start, stop) for start, stop in bounds))
        if block.nbytes < ON_DEVICE_BYTES:  # small: numpy's copy costs less than compiling
            block = np.ascontiguousarray(LAYOUTS[layout].load(block, heads)).astype(dtype, copy=False)
            layout = "copy"
        if layout != "copy" or block.dtype != dtype:
            convert = (layout, heads)
            block = block[None] if on_mesh else block  # (1, *block): its row of the stack
        for device in devices:  # a CPU keeps an aligned block without a copy
            arrays.append(jax.device_put(block, device, may_alias=True))
        del block  # the transfers hold it until they are done
    if convert is not None and isinstance(sharding, NamedSharding):
        every = NamedSharding(sharding.mesh, P(tuple(sharding.mesh.axis_names)))
        stacked_shape = (sharding.mesh.size, *arrays[0].shape[1:])
        stacked = jax.make_array_from_single_device_arrays(stacked_shape, every, arrays)
        return _convert_on_mesh(stacked, convert[0], convert[1], np.dtype(dtype), sharding)
    if convert is not None:
        return _convert(arrays[0], layout=convert[0], heads=convert[1], dtype=np.dtype(dtype))
    if isinstance(sharding, SingleDeviceSharding):
        return arrays[0]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
