"""Writing a TransformerLM as a Hugging Face directory that transformers loads.

  save_pretrained(directory, config, params, *, model_type=None, max_shard_size="50GB",
                  overwrite=False)

config.json comes from the family's `hf_config`, the tensors from its `to_hf`, written one at
a time in the safetensors format (the package's writers take every tensor of a file at once;
this writes each tensor's bytes as it comes, so the process holds the model plus about one
tensor). Above `max_shard_size` the tensors go into shards listed by
model.safetensors.index.json, as transformers writes them.

The directory is written atomically: everything goes into a temporary directory beside it,
which is renamed into place when complete. A failure removes the temporary directory and
leaves whatever was at `directory` as it was. An existing non-empty directory (such as the
one a model was loaded from) is refused unless `overwrite=True`; then it is replaced whole,
after the new one is complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import secrets
import shutil
from collections.abc import Iterable, Iterator, Mapping
from types import ModuleType
from typing import Any

import jax
import numpy as np

from qkv_jax.lm import TransformerConfig, layer_windows
from qkv_jax.pretrained.checkpoint import DTYPES, INDEX, SINGLE
from qkv_jax.pretrained.io import family_of
from qkv_jax.pretrained.schema import HFConfig

__all__ = ["RUNTIME_FIELDS", "save_pretrained", "shard_bytes", "pick_family"]

# TransformerConfig fields that say how to compute, not what: a config.json does not hold them,
# so a saved config reads back with the loader's (or the defaults') values for them.
RUNTIME_FIELDS = (
    "dtype",
    "param_dtype",
    "precision",
    "attention_implementation",
    "sow_weights",
    "dropout_rate",
    "residual_dropout_rate",
    "attention_dropout_rate",
)
_SAFETENSORS_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def shard_bytes(size: int | str) -> int:
    """`max_shard_size` in bytes: an int, or transformers' spelling "500MB", "5GB", "2GiB"."""
    number: float
    if isinstance(size, int) and not isinstance(size, bool):
        number, unit = size, ""
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
        if not match or match.group(2) not in _UNITS:
            raise ValueError(f"save_pretrained: max_shard_size={size!r} must be bytes (an int) or like '5GB'")
        number, unit = float(match.group(1)), match.group(2)
    total = int(number * _UNITS[unit])
    if total < 1:
        raise ValueError(f"save_pretrained: max_shard_size={size!r} must be positive")
    return total


def _canonical(config: TransformerConfig, name: str) -> Any:
    """Field `name` of `config` in one spelling of what it computes: the window pattern over
    the layers, the key/value heads and the head width as numbers (None: their defaults)."""
    if name == "window":
        return layer_windows(config)
    if name == "num_kv_heads":
        return config.num_kv_heads or config.num_heads
    if name == "head_dim":
        return getattr(config, "head_dim", None) or config.d_model // config.num_heads
    return getattr(config, name)


def _differences(config: TransformerConfig, readback: TransformerConfig) -> list[str]:
    """The fields (but RUNTIME_FIELDS) where `readback` computes otherwise than `config`, as
    "field=readback's (not config's)"."""
    return [
        f"{field.name}={getattr(readback, field.name)!r} (not {getattr(config, field.name)!r})"
        for field in dataclasses.fields(config)
        if field.name not in RUNTIME_FIELDS
        and _canonical(readback, field.name) != _canonical(config, field.name)
    ]


def pick_family(config: TransformerConfig, model_type: str | None) -> tuple[ModuleType, dict[str, Any]]:
    """(family, config.json dict) of the first family (`model_type`'s, else each in FAMILIES'
    order) whose config.json reads back, every field read, to `config` (but RUNTIME_FIELDS);
    ValueError naming what each family refused or reads back differently."""
    from qkv_jax.pretrained.families import FAMILIES

    if getattr(config, "lora_rank", 0):
        raise ValueError(
            f"save_pretrained: lora_rank={config.lora_rank}: merge the adapters into the kernels first "
            "(qkv_jax.lora.merge_lora) and save the merged model"
        )
    candidates = [(model_type, family_of(model_type))] if model_type is not None else list(FAMILIES.items())
    refusals = []
    for name, family in dict(candidates).items():
        try:
            fields = family.hf_config(config)
            written = HFConfig({"model_type": name, **fields})
            readback = family.to_config(written)
            written.check_all_read()  # the loader would refuse a field the family does not read back
        except ValueError as err:
            refusals.append(f"{name}: {err}")
            continue
        differences = _differences(config, readback)
        if not differences:
            return family, {"model_type": name, **fields}
        refusals.append(f"{name}: its config.json reads back with {', '.join(differences)}")
    raise ValueError(f"save_pretrained: no family writes this config exactly; {'; '.join(refusals)}")


def _check_target(target: pathlib.Path, overwrite: bool) -> None:
    """ValueError before any work unless `target` is absent, an empty directory, or (with
    `overwrite`) a directory."""
    if target.exists() and not target.is_dir():
        raise ValueError(f"save_pretrained: {target} is a file, not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        held = ", ".join(sorted(p.name for p in target.iterdir())[:4])
        raise ValueError(
            f"save_pretrained: {target} is not empty ({held}); pass overwrite=True to replace it whole, "
            "or save into a new directory"
        )


def _extra_files(files: Iterable[str | pathlib.Path]) -> list[pathlib.Path]:
    """`files` as paths, ValueError before any work when one is not a readable file or its name
    is one that save_pretrained writes itself."""
    paths = [pathlib.Path(f) for f in files]
    for path in paths:
        if not path.is_file():
            raise ValueError(f"save_pretrained: files= names {path}, which is not a file")
        if path.name in ("config.json", INDEX) or path.name.startswith("model"):
            raise ValueError(
                f"save_pretrained: files= names {path}; save_pretrained writes {path.name} itself"
            )
    return paths


def _header(records: list[tuple[str, tuple[int, ...], np.dtype, int]]) -> bytes:
    """A safetensors header (8-byte little-endian length, then JSON padded with spaces so the
    data starts 8-aligned) for tensors written in `records`' order."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype, size in records:
        entries[name] = {
            "dtype": _SAFETENSORS_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _records(arrays: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, np.ndarray]]:
    """Each (name, array) as a C-contiguous little-endian numpy array of a safetensors dtype."""
    for name, value in arrays:
        array = np.ascontiguousarray(np.asarray(value))
        if array.dtype not in _SAFETENSORS_NAMES:
            raise ValueError(
                f"save_pretrained: tensor {name!r} has dtype {array.dtype}, which safetensors lacks"
            )
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        yield name, array


def _plan(family: ModuleType, config: TransformerConfig, params: Mapping[str, Any], limit: int) -> list[list]:
    """The shards: lists of (name, shape, dtype, bytes) in `to_hf`'s order, each shard at most
    `limit` bytes unless one tensor alone is larger. A first pass over to_hf, each array
    dropped once measured."""
    shards: list[list] = [[]]
    seen: set[str] = set()
    size = 0
    for name, array in _records(family.to_hf(config, params)):
        if name in seen:
            raise ValueError(f"save_pretrained: the family gives tensor {name!r} twice")
        seen.add(name)
        if shards[-1] and size + array.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, array.shape, array.dtype, array.nbytes))
        size += array.nbytes
    return shards


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _write_file(path: pathlib.Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _write_tensors(
    folder: pathlib.Path, family: ModuleType, config: TransformerConfig, params: Any, shards: list[list]
) -> dict[str, str]:
    """Writes the shards into `folder` from a second pass over to_hf, each tensor's bytes as it
    comes; returns the weight map (tensor name -> shard file)."""
    weight_map: dict[str, str] = {}
    arrays = _records(family.to_hf(config, params))
    for shard_name, shard in zip(_shard_names(len(shards)), shards, strict=True):
        with open(folder / shard_name, "wb") as file:
            file.write(_header(shard))
            for record in shard:
                name, array = next(arrays, (None, None))
                if array is None or (name, array.shape, array.dtype, array.nbytes) != record:
                    raise RuntimeError(
                        f"save_pretrained: the family's to_hf gave {record[0]!r} differently on a second pass"
                    )
                file.write(array.reshape(-1).view(np.uint8).data)
                weight_map[record[0]] = shard_name
                del array
            file.flush()
            os.fsync(file.fileno())
    if next(arrays, None) is not None:
        raise RuntimeError("save_pretrained: the family's to_hf gave more tensors on a second pass")
    return weight_map


def _stored_dtype(shards: list[list]) -> str:
    """The name of the floating dtype holding most of the bytes (config.json's `dtype`)."""
    sizes: dict[np.dtype, int] = {}
    for _, _, dtype, size in (record for shard in shards for record in shard):
        if np.issubdtype(dtype, np.floating) or dtype == DTYPES["BF16"]:
            sizes[dtype] = sizes.get(dtype, 0) + size
    return max(sizes, key=lambda d: sizes[d]).name if sizes else "float32"


def _sync_directory(path: pathlib.Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _move_into_place(temporary: pathlib.Path, target: pathlib.Path) -> None:
    """Renames `temporary` to `target`; an existing `target` is moved aside first and deleted
    only once the new one is in place (and moved back if that rename fails)."""
    if target.is_dir() and any(target.iterdir()):
        aside = target.with_name(f".{target.name}.replaced-{secrets.token_hex(4)}")
        os.rename(target, aside)
        try:
            os.rename(temporary, target)
        except BaseException:
            os.rename(aside, target)
            raise
        shutil.rmtree(aside)
    else:
        os.replace(temporary, target)  # absent, or an empty directory
    _sync_directory(target.parent)


def save_pretrained(
    directory: str | pathlib.Path,
    config: TransformerConfig,
    params: Mapping[str, Any],
    *,
    model_type: str | None = None,
    max_shard_size: int | str = "50GB",
    overwrite: bool = False,
    files: Iterable[str | pathlib.Path] = (),
) -> pathlib.Path:
    """Writes `params` (a linen TransformerLM's) and `config` as a Hugging Face directory that
    `transformers.AutoModelForCausalLM.from_pretrained` loads; returns its path.

    `model_type` picks the family; None: the first family whose config.json reads back to
    `config` exactly (fields of RUNTIME_FIELDS aside). The weights are stored in the params'
    dtype; `max_shard_size` (bytes, or "500MB", "5GB" as transformers spells it) splits them
    into shards with a model.safetensors.index.json. `files` (a tokenizer.json, say) are copied
    in beside them under their own names, inside the same atomic write, so the directory never
    exists without them. Written atomically (see the module docstring); a non-empty
    `directory` is refused unless `overwrite`. `params` may be global arrays split over a
    mesh: each tensor is gathered whole on its own, one at a time (under `jax.distributed`,
    every process calls this; process 0's directory is the one moved into place).
    """
    target = pathlib.Path(directory).absolute()
    limit = shard_bytes(max_shard_size)
    _check_target(target, overwrite)
    extra = _extra_files(files)
    family, fields = pick_family(config, model_type)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.partial-{secrets.token_hex(4)}")
    temporary.mkdir()
    try:
        shards = _plan(family, config, params, limit)
        weight_map = _write_tensors(temporary, family, config, params, shards)
        config_json = {"dtype": _stored_dtype(shards), **fields}
        _write_file(temporary / "config.json", (json.dumps(config_json, indent=2) + "\n").encode())
        if len(shards) > 1:
            total = sum(record[3] for shard in shards for record in shard)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            _write_file(temporary / INDEX, (json.dumps(index, indent=2) + "\n").encode())
        for path in extra:
            _write_file(temporary / path.name, path.read_bytes())
        _sync_directory(temporary)
        if jax.process_index() == 0:
            _move_into_place(temporary, target)
        else:  # the others gathered every tensor with process 0; its copy is the one kept
            shutil.rmtree(temporary)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return target
