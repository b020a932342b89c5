"""The files of a Hugging Face model directory, read and nothing else.

  PretrainedError  a file that is not what it should be: one line naming the file (and the tensor)
  read_json        a JSON object from a file (config.json, model.safetensors.index.json)
  TensorSource     the tensors of `model.safetensors`, or of the shards that
                   `model.safetensors.index.json` names, read one at a time by name
  aligned_buffer   memory that XLA's CPU client keeps without a copy

A tensor's header is read with the `safetensors` package (`safe_open`), its bytes with `os.preadv`
into memory of its own, or, for a loader that copies it into another layout at once, through a
mapping of the file that ends with the view; no mapped file stays resident, so a loader that
converts each tensor and drops it holds one tensor beside the model at any moment. Nothing
here writes to the directory. bfloat16 tensors come as `ml_dtypes.bfloat16` numpy arrays.
"""

from __future__ import annotations

import json
import mmap
import os
import pathlib
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open

__all__ = ["INDEX", "SINGLE", "DTYPES", "PretrainedError", "read_json", "TensorSource", "aligned_buffer"]

# The weight files of a Hugging Face directory: one file, or shards listed by an index.
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# The alignment of the buffers tensors are read into: what XLA's CPU client needs to use host
# memory in place.
ALIGNMENT = 64
# Tensors read into buffers of at least this many bytes use transparent huge pages.
HUGE_PAGE_BYTES = 2 << 20
# safetensors' dtype names -> numpy dtypes (bfloat16 through ml_dtypes, which JAX uses).
DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


class PretrainedError(ValueError):
    """A Hugging Face directory's file is missing, unreadable or does not fit the model: the
    message is one line naming the file, and the tensor where one is concerned."""


def read_json(path: pathlib.Path) -> dict[str, Any]:
    """The JSON object in `path`; PretrainedError naming the file when it is missing, unreadable,
    not JSON or not an object."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PretrainedError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise PretrainedError(f"{path}: cannot be read ({err})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise PretrainedError(
            f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"
        ) from None
    if not isinstance(value, dict):
        raise PretrainedError(f"{path}: holds a JSON {type(value).__name__}, not an object")
    return value


def _open(path: pathlib.Path) -> Any:
    """`safe_open` of one safetensors file; PretrainedError naming it when it is missing,
    truncated or its header is corrupt (safetensors checks that the header parses and that its
    tensors cover the file exactly)."""
    try:
        return safe_open(str(path), framework="numpy", backend="pread")
    except FileNotFoundError:
        raise PretrainedError(f"{path}: no such file") from None
    except Exception as err:  # safetensors raises SafetensorError, OSError and others
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise PretrainedError(f"{path}: not a readable safetensors file ({message})") from None


def _header(path: pathlib.Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor's (shape, safetensors dtype) in the header of `path`, read without its data."""
    with _open(path) as handle:
        specs = {}
        for name in handle.keys():
            piece = handle.get_slice(name)
            specs[name] = (tuple(piece.get_shape()), piece.get_dtype())
    return specs


class TensorSource:
    """The tensors of a Hugging Face directory, read one at a time.

    `TensorSource(directory)` reads `model.safetensors`, else the shards that
    `model.safetensors.index.json` names (the index checked against every shard's
    header before anything is read); a missing, truncated or corrupt file is a
    `PretrainedError` naming it. A family's `from_hf` reads through:

      get(name, shape=None)  the tensor as a numpy array in its stored dtype; a name the
                             checkpoint lacks, or (with `shape`) a tensor of another shape, is
                             a PretrainedError naming the file and the tensor
      has(name), names       whether the checkpoint holds a tensor; all the names it holds
      mark_read(name), read_slice(name, index)
                             a tensor counted as read, then read block by block (only the
                             bytes of each block: a process reads only its devices' slices)
      skip(name)             marks a stored tensor as deliberately unused (a buffer such as
                             GPT-2's `attn.bias` or a tied head's copy) without reading it

    `unread()` names the tensors neither read nor skipped, which the loader refuses.
    Use it as a context manager: leaving closes the files.
    """

    def __init__(self, directory: pathlib.Path):
        self.directory = directory
        single, index = directory / SINGLE, directory / INDEX
        self._specs: dict[str, tuple[tuple[int, ...], str]] = {}
        if single.is_file():
            self.listing = single
            self._specs = _header(single)
            self._file = {name: single for name in self._specs}
        elif index.is_file():
            self.listing = index
            self._file = self._read_index(index)
        else:
            raise PretrainedError(
                f"{directory}: holds neither {SINGLE} nor {INDEX}"
                + (
                    " (PyTorch .bin weights are not read; save them as safetensors)"
                    if _has_bin(directory)
                    else ""
                )
            )
        self._handles: dict[pathlib.Path, Any] = {}
        self._offsets: dict[pathlib.Path, dict[str, int]] = {}
        self._read: set[str] = set()
        self._skipped: set[str] = set()
        self.recent: list[str] = []  # the tensors read since the loader last cleared it

    def _read_index(self, index: pathlib.Path) -> dict[str, pathlib.Path]:
        """The index's weight_map, checked: every shard present and readable, holding exactly the
        tensors the index assigns to it."""
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise PretrainedError(f"{index}: has no weight_map object of tensor names to shard files")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if pathlib.PurePath(shard).name != shard:
                raise PretrainedError(f"{index}: names shard {shard!r}, which is not a file in the directory")
            if not (self.directory / shard).is_file():
                raise PretrainedError(f"{index}: names shard {shard!r}, which is missing")
        for shard in shards:
            held = _header(self.directory / shard)
            listed = {name for name, file in weight_map.items() if file == shard}
            if listed - set(held):
                name = sorted(listed - set(held))[0]
                raise PretrainedError(f"{index}: assigns tensor {name!r} to {shard}, which does not hold it")
            if set(held) - listed:
                name = sorted(set(held) - listed)[0]
                raise PretrainedError(
                    f"{self.directory / shard}: holds tensor {name!r}, which {INDEX} does not list"
                )
            self._specs.update(held)
        return {name: self.directory / file for name, file in weight_map.items()}

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._file)

    def has(self, name: str) -> bool:
        return name in self._file

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor `name` (from the header; nothing is read)."""
        self._where(name)
        return self._specs[name][0]

    def dtype(self, name: str) -> np.dtype:
        """The stored numpy dtype of tensor `name` (from the header)."""
        self._where(name)
        kind = self._specs[name][1]
        if kind not in DTYPES:
            raise PretrainedError(
                f"{self._file[name]}: tensor {name!r} has dtype {kind}, which qkv_jax does not read"
            )
        return DTYPES[kind]

    def file_of(self, name: str) -> pathlib.Path:
        """The file holding tensor `name` (the index for a name no shard holds)."""
        return self._file.get(name, self.listing)

    def _where(self, name: str) -> pathlib.Path:
        if name not in self._file:
            raise PretrainedError(f"{self.listing}: has no tensor {name!r}")
        return self._file[name]

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Tensor `name` read from its file; with `shape`, PretrainedError unless it has that shape."""
        path = self._where(name)
        stored = self._specs[name][0]
        if shape is not None and tuple(shape) != stored:
            raise PretrainedError(
                f"{path}: tensor {name!r} has shape {stored}, the config gives {tuple(shape)}"
            )
        self.dtype(name)  # refuses a dtype numpy cannot hold
        if path not in self._handles:
            self._handles[path] = _open(path).__enter__()
        try:
            value = self._handles[path].get_tensor(name)
        except Exception as err:
            raise PretrainedError(f"{path}: tensor {name!r} cannot be read ({err})") from None
        self._read.add(name)
        self.recent.append(name)
        return value

    def mark_read(self, name: str) -> None:
        """Counts tensor `name` as read (its slices are read later, by `read_slice`)."""
        self._where(name)
        self.dtype(name)  # refuses a dtype numpy cannot hold
        self._read.add(name)
        self.recent.append(name)

    def read_slice(self, name: str, index: tuple[slice, ...], *, mapped: bool = False) -> np.ndarray:
        """The block `index` (one slice per axis) of tensor `name`: a block of whole rows (the
        whole tensor included) is one range of the file, read into memory aligned for JAX to
        use without another copy (`read_rows`); any other block is read as the whole rows it
        spans (one range, no page faults of a memory map) and its columns copied out. With
        `mapped`, a read-only view of those rows in a mapping of the file (`map_rows`): for a
        caller that copies the block into a layout of its own, reading it only once."""
        stored = self.shape(name)
        if mapped:
            rows = index[0].indices(stored[0])[:2]
            return self.map_rows(name, *rows)[(slice(None), *index[1:])]
        if all(
            (s.start or 0) == 0 and s.stop in (None, n) for s, n in zip(index[1:], stored[1:], strict=True)
        ):
            rows = index[0].indices(stored[0])[:2] if stored else (0, 1)
            return self.read_rows(name, *rows)
        spanned = self.read_rows(name, *index[0].indices(stored[0])[:2])  # whole rows: one range
        part = spanned[(slice(None), *index[1:])]  # (rows, the block's columns)
        block = aligned_buffer(part.nbytes).view(part.dtype).reshape(part.shape)
        block[...] = part
        return block

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows `start:stop` of tensor `name` (a 0-d tensor: 0, 1), read with `os.preadv` into a
        64-byte-aligned buffer (so `jax.device_put(..., may_alias=True)` can keep it on a CPU)."""
        path, dtype, offset, nbytes, shape = self._rows(name, start, stop)
        block = aligned_buffer(nbytes)
        with open(path, "rb", buffering=0) as file:
            done = 0
            while done < nbytes:  # one call reads at most about 2 GiB
                read = os.preadv(file.fileno(), [block.data[done:]], offset + done)
                if read <= 0:
                    raise PretrainedError(f"{path}: tensor {name!r} cannot be read (the file ends early)")
                done += read
        return block.view(dtype).reshape(shape)

    def map_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows `start:stop` of tensor `name` as a read-only view of a mapping of its file: nothing
        is copied, the pages are read when first touched, and the mapping ends with the view (no
        mapped file stays resident); where the file system cannot map it, the rows are read
        (`read_rows`). A file shorter than its header says is refused here, before a page past
        its end could be touched."""
        path, dtype, offset, nbytes, shape = self._rows(name, start, stop)
        with open(path, "rb") as file:
            if os.fstat(file.fileno()).st_size < offset + nbytes:
                raise PretrainedError(f"{path}: tensor {name!r} cannot be read (the file ends early)")
            if nbytes == 0:
                return np.empty(shape, dtype)
            begin = offset - offset % mmap.ALLOCATIONGRANULARITY
            try:
                mapping = mmap.mmap(
                    file.fileno(), offset + nbytes - begin, offset=begin, access=mmap.ACCESS_READ
                )
            except OSError:  # a file system that cannot map files (some network ones): a copy
                return self.read_rows(name, start, stop)
        if hasattr(mmap, "MADV_WILLNEED"):  # from a cold cache: read ahead, not page by page
            mapping.madvise(mmap.MADV_WILLNEED)
        return np.frombuffer(mapping, dtype, nbytes // dtype.itemsize, offset - begin).reshape(shape)

    def _rows(self, name: str, start: int, stop: int) -> tuple[pathlib.Path, np.dtype, int, int, tuple]:
        """(file, dtype, byte offset, byte count, shape) of rows `start:stop` of tensor `name` (a 0-d
        tensor: rows 0:1, shape ())."""
        path, stored, dtype = self._where(name), self.shape(name), self.dtype(name)
        row_bytes = int(np.prod(stored[1:], dtype=np.int64)) * dtype.itemsize
        offset, nbytes = self._data_offset(path, name) + start * row_bytes, (stop - start) * row_bytes
        return path, dtype, offset, nbytes, (stop - start, *stored[1:]) if stored else ()

    def _data_offset(self, path: pathlib.Path, name: str) -> int:
        """Where tensor `name`'s bytes begin in `path` (from its header)."""
        if path not in self._offsets:
            with open(path, "rb") as file:
                length = int.from_bytes(file.read(8), "little")
                header = json.loads(file.read(length))
            self._offsets[path] = {
                key: 8 + length + entry["data_offsets"][0]
                for key, entry in header.items()
                if key != "__metadata__"
            }
        return self._offsets[path][name]

    def skip(self, name: str) -> None:
        """Marks stored tensor `name` as deliberately unused; PretrainedError if it is not stored."""
        self._where(name)
        self._skipped.add(name)

    def unread(self) -> list[str]:
        """The stored tensors neither read nor skipped, sorted."""
        return sorted(set(self._file) - self._read - self._skipped)

    def stored_bytes(self) -> dict[np.dtype, int]:
        """Bytes stored per dtype, over every tensor (from the headers)."""
        totals: dict[np.dtype, int] = {}
        for shape, kind in self._specs.values():
            if kind in DTYPES:
                dtype = DTYPES[kind]
                totals[dtype] = totals.get(dtype, 0) + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return totals


def aligned_buffer(nbytes: int) -> np.ndarray:
    """`nbytes` of uint8 at an ALIGNMENT-aligned address. A large one is an anonymous mapping
    of its own that asks for transparent huge pages; being shared memory, it gets them only
    where the kernel's `shmem_enabled` allows, else 4 KiB pages. (Private memory asking for
    them, as numpy's large arrays do, took 0.29 s on some runs and 4 to 5 s on others to write
    2.47 GB on one machine, the kernel compacting memory first; 4 KiB pages 0.8 to 1 s.)"""
    if nbytes >= max(HUGE_PAGE_BYTES, 1) and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping = mmap.mmap(-1, nbytes)  # page-aligned
        mapping.madvise(mmap.MADV_HUGEPAGE)
        return np.frombuffer(mapping, np.uint8)
    buffer = np.empty(nbytes + ALIGNMENT, np.uint8)
    skip = -buffer.ctypes.data % ALIGNMENT
    return buffer[skip : skip + nbytes]


def _has_bin(directory: pathlib.Path) -> bool:
    return any(directory.glob("*.bin"))
