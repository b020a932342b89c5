"""Placing a checkpoint's tensors onto devices, block by block.

  sharding_of   the sharding a parameter gets: its `qkv_jax.sharding` rule on a mesh, or the
                default device without one
  place         one tensor as a global jax.Array of that sharding: each distinct block the
                process's devices hold is read once (only its bytes, for a `StoredTensor`),
                put on those devices in the stored order and converted there (transpose,
                heads split, cast) by one program for all devices and processes, so no
                process holds more of the tensor than its blocks; on CPU devices, a block
                whose layout transposes it is instead copied once, in tiles, from a mapping
                of the file into memory the device keeps
  transposed    a matrix's transpose, copied in tiles into memory a CPU device keeps

Converting on the device replaced numpy's copies of whole transposed arrays (about 0.1 s for a
bfloat16 [8192, 2048] matrix here), which were most of a one-device load's time. On CPU devices
the device is the host, and that path writes new memory twice: the read into a buffer, then
XLA's output. So there a block that is only transposed (its dtype kept, or bfloat16 widened to
float32) is copied once, in tiles, from a mapping of the file into the buffer the device keeps:
Llama 3.2 1B's shape in bfloat16 (`benchmarks/pretrained_load.py`, 3 rounds) loaded in 1.70 s
against 2.44 s, and onto a (2, 4) mesh of two processes in 2.11 s against 4.16 s; Qwen2.5-0.5B's
shape in bfloat16, loaded as float32, in 1.51 to 1.54 s against 1.69 to 1.78 s with the widening
left to XLA (four loads each, alternating).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from qkv_jax import sharding as rules
from qkv_jax.pretrained.checkpoint import aligned_buffer
from qkv_jax.pretrained.families.common import LAYOUTS, LINEN_SHAPES, StoredTensor

__all__ = ["sharding_of", "place", "transposed", "ON_DEVICE_BYTES", "HOST_TRANSPOSES"]

# Blocks of at least this many bytes are converted on their device (one small compiled program
# per tensor shape); smaller ones by numpy, on the host.
ON_DEVICE_BYTES = 1 << 20
# On CPU devices, blocks of the layouts that transpose them are transposed on the host in tiles
# (`transposed`) from a mapping of the file, where the dtype stays or widens (`WIDENINGS`).
HOST_TRANSPOSES = True
TRANSPOSING = frozenset({"linear", "heads_in", "heads_out"})
# (stored dtype, loaded dtype) that the host's copies widen, besides keeping any dtype: bfloat16
# to float32, exact (other casts round, and XLA does them on the device).
WIDENINGS = frozenset({(np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))})
# (rows, columns) of the source a tiled copy moves at a time. A bfloat16 [8192, 2048] matrix
# copied as uint16 into memory already written (best of 5, two runs): 64 x 512 16.7 and 18.8 ms,
# 128 x 512 18.3 and 18.4 ms, 128 x 128 20.5 and 21.6 ms, 64 x 64 33.8 and 37.4 ms; numpy's copy
# of the whole transposed view 103.7 and 109.8 ms.
TILE = (64, 512)


def sharding_of(path: str, shape: tuple[int, ...], mesh: Mesh | None) -> Sharding:
    """The parameter at `path` ("block_0/mlp_in/kernel") on `mesh` by `qkv_jax.sharding`'s
    rules; without a mesh, the first device (where `place` leaves the array uncommitted)."""
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(mesh, rules.partition_spec(path, shape, dict(mesh.shape)))


@functools.partial(jax.jit, static_argnames=("layout", "heads", "dtype"))
def _convert(block: jax.Array, layout: str, heads: int, dtype: Any) -> jax.Array:
    """A stored-order block in the linen layout and `dtype`, computed where `block` lives."""
    load: Any = LAYOUTS[layout].load  # written for numpy; the same methods on a jax.Array
    return load(block, heads).astype(dtype)


def transposed(matrix: np.ndarray, dtype: Any = None) -> np.ndarray:
    """`matrix.T` in `dtype` (None: its own; float32 from bfloat16, a widening), contiguous, in
    memory XLA's CPU client keeps without a copy; copied in `TILE`s so that both sides are read
    and written a cache line at a time. The elements move as unsigned integers of their size
    (ml_dtypes' bfloat16 copies more slowly than uint16), and a bfloat16 becomes the float32 of
    the same value by moving its 16 bits to the top of 32 (exact, NaNs and infinities kept)."""
    dtype = np.dtype(matrix.dtype if dtype is None else dtype)
    rows, columns = matrix.shape
    widen = dtype != matrix.dtype
    if not _copies(matrix.dtype, dtype):
        raise ValueError(f"transposed: {matrix.dtype} -> {dtype} is not a widening it copies")
    result = aligned_buffer(rows * columns * dtype.itemsize).view(dtype).reshape(columns, rows)
    source, target = _bits(matrix), _bits(result)
    step_rows, step_columns = TILE
    for column in range(0, columns, step_columns):
        for row in range(0, rows, step_rows):
            stop_row, stop_column = row + step_rows, column + step_columns
            tile = source[row:stop_row, column:stop_column].T
            if widen:
                np.left_shift(tile, 16, out=target[column:stop_column, row:stop_row], dtype=np.uint32)
            else:
                target[column:stop_column, row:stop_row] = tile
    return result


def _copies(stored: np.dtype, dtype: np.dtype) -> bool:
    """Whether the host's copies turn `stored` into `dtype`: kept, or widened (`WIDENINGS`)."""
    return stored == dtype or (stored, dtype) in WIDENINGS


def _bits(array: np.ndarray) -> np.ndarray:
    """`array` viewed as unsigned integers of its element size (itself where numpy has none)."""
    size = array.dtype.itemsize
    return array.view(np.dtype(f"u{size}")) if size in (1, 2, 4, 8) else array


def _on_host(value: Any, sharding: Sharding, dtype: np.dtype) -> bool:
    """Whether `value`'s blocks are transposed on the host (`HOST_TRANSPOSES`): a stored matrix
    whose layout transposes it, kept in its dtype or widened (`WIDENINGS`), for CPU
    devices only."""
    devices: list[jax.Device] = list(sharding.device_set)
    return (
        HOST_TRANSPOSES
        and isinstance(value, StoredTensor)
        and value.layout in TRANSPOSING
        and len(value.tensors.shape(value.name)) == 2
        and _copies(value.tensors.dtype(value.name), dtype)
        and all(device.platform == "cpu" for device in devices)
    )


def _host_block(value: StoredTensor, index: tuple[slice, ...], dtype: np.dtype) -> np.ndarray:
    """The linen block `index` of `value` in `dtype`, transposed on the host from the mapped file."""
    stored, heads = value.stored_block(index, mapped=True)
    return transposed(stored, dtype).reshape(LINEN_SHAPES[value.layout](stored.shape, heads))


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
    host = _on_host(value, sharding, np.dtype(dtype))
    for bounds, devices in _blocks(shape, sharding).items():
        index = tuple(slice(start, stop) for start, stop in bounds)
        block, layout, heads = (_host_block(value, index, dtype), "copy", 0) if host else _read(value, index)
        if block.nbytes < ON_DEVICE_BYTES and not host:  # small: numpy's copy costs less than compiling
            block = np.ascontiguousarray(LAYOUTS[layout].load(block, heads)).astype(dtype, copy=False)
            layout = "copy"
        if layout != "copy" or block.dtype != dtype:
            convert = (layout, heads)
            block = block[None] if on_mesh else block  # (1, *block): its row of the stack
        for device in devices:  # a CPU keeps an aligned block without a copy
            # without a mesh: uncommitted, on the default device, as jnp's arrays and a model's
            # init are. Committed params make a jitted step's outputs committed, and a step fed
            # its own outputs (optimizer state, adapters) then compiled a second time.
            arrays.append(jax.device_put(block, device if on_mesh else None, may_alias=True))
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
