"""`train.init_from`: a run that starts from another run's trained parameters.

`--config.train.init_from=SOURCE` names a run's workdir, its `checkpoints/`
directory or one checkpoint step directory in it (`W/checkpoints/300`). When
the run's own workdir has no checkpoint yet, `run.restore_or_init` takes the
parameters of the source's newest usable checkpoint (or of the named step)
and starts from them at step 0 with a fresh optimizer state; once the run has
checkpoints of its own it resumes from those and reads the source no more.

The source is opened read-only (orbax's `read_only` manager: no directory
created, no temporary directory cleaned up, nothing written) and verified as
any restore is: each parameter against the SHA-256 digest, shape and dtype its
checkpoint recorded; a checkpoint that does not read back or verify is skipped
with a `CheckpointWarning` for the next older one. The parameters then go
through `qkv_jax.finetune.fit_params`: shapes checked (a ConfigError naming the
first parameter that does not fit, with both shapes), the model's LoRA adapters
kept as initialised, the source's adapters merged when this model has none
(with the source's `model.lora_alpha` from its config.json), and with
`train.convert_kv_heads=True` the source's K/V heads mean-pooled into this
model's `model.num_kv_heads` groups (MHA -> GQA/MQA uptraining).

`train.init_from` is not a resumable field: the same workdir started from
another source is another run (`prepare_workdir` refuses it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging as std_logging
import pathlib
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from qkv_jax.finetune import fit_params
from qkv_jax.training.checkpoints import CheckpointWarning
from qkv_jax.training.validate import ConfigError

__all__ = [
    "Source",
    "source_location",
    "read_source",
    "source_tokenizer_path",
    "fitted_params",
    "initial_params",
]


@dataclasses.dataclass(frozen=True)
class Source:
    """A source run's parameters (host arrays), its checkpoint step, and its config (or None)."""

    params: Any
    step: int
    directory: pathlib.Path
    config: dict | None


def source_location(init_from: str) -> tuple[pathlib.Path, int | None, pathlib.Path]:
    """(checkpoints directory, the one step named or None, the source's workdir) of
    `train.init_from`; ConfigError when it names none of a workdir, a checkpoints
    directory or a checkpoint step directory."""
    path = pathlib.Path(init_from).expanduser().absolute()
    if (path / "checkpoints").is_dir():
        return path / "checkpoints", None, path
    if path.is_dir() and path.name.isdigit() and (path / "state").is_dir():
        return path.parent, int(path.name), path.parent.parent
    if path.is_dir() and any(p.name.isdigit() for p in path.iterdir()):
        return path, None, path.parent
    raise ConfigError(
        f"train.init_from={init_from!r}: not a run's workdir, its checkpoints/ directory or one "
        "checkpoint step directory"
    )


def source_tokenizer_path(init_from: str, name: str) -> pathlib.Path | None:
    """The file `name` (e.g. tokenizer.json) in the source's workdir, if there is one (found
    from the path alone: a resumed fine-tune reads it even if the source kept no checkpoint)."""
    path = pathlib.Path(init_from).expanduser().absolute()
    if not ((path / "config.json").is_file() or (path / "checkpoints").is_dir()):
        path = path.parent.parent if path.name.isdigit() else path.parent
    return path / name if (path / name).is_file() else None


@contextlib.contextmanager
def _without_read_only_notes() -> Iterator[None]:
    """Drops the two warnings orbax logs for a read-only manager ("is read only"), read-only
    on purpose here."""

    def keep(record: std_logging.LogRecord) -> bool:
        message = record.getMessage()
        return "read only" not in message and "read_only=True" not in message

    logger = std_logging.getLogger("absl")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _verified_params(restored: dict, record: dict) -> Any | None:
    """The restored parameters when each matches its recorded shape, dtype and digest, else None."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(restored["params"]):
        expected = record["leaves"].get("['params']" + jax.tree_util.keystr(path))
        array = np.asarray(leaf)
        digest = hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()
        if expected is None or (list(array.shape), str(array.dtype), digest) != (
            expected["shape"],
            expected["dtype"],
            expected["sha256"],
        ):
            return None
    return restored["params"]


def _read_step(manager: ocp.CheckpointManager, directory: pathlib.Path, step: int) -> Any | None:
    """Checkpoint `step`'s verified parameters, or None with a CheckpointWarning."""
    try:
        items = manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(), record=ocp.args.JsonRestore())
        )
        params = _verified_params(items["state"], items["record"])
        problem = "fails its checksum" if params is None else None
    except Exception as error:  # noqa: BLE001 - any read failure means skip it
        params, problem = None, f"is unreadable ({type(error).__name__}: {error})"
    if problem is not None:
        warnings.warn(f"checkpoint step {step} in {directory} {problem}", CheckpointWarning, stacklevel=3)
    return params


def read_source(init_from: str) -> Source:
    """The parameters of the newest usable checkpoint of `train.init_from` (or the one step it
    names), read without writing anything there. ConfigError when none reads back and verifies."""
    directory, step, workdir = source_location(init_from)
    with _without_read_only_notes():
        options = ocp.CheckpointManagerOptions(
            read_only=True, create=False, cleanup_tmp_directories=False, enable_async_checkpointing=False
        )
        manager = ocp.CheckpointManager(directory, options=options, item_names=("state", "record"))
    try:
        steps = [step] if step is not None else sorted(manager.all_steps(), reverse=True)
        for candidate in steps:
            params = _read_step(manager, directory, candidate)
            if params is not None:
                config_path = workdir / "config.json"
                config = json.loads(config_path.read_text()) if config_path.is_file() else None
                return Source(params, candidate, directory, config)
    finally:
        manager.close()
    raise ConfigError(f"train.init_from={init_from!r}: no usable checkpoint in {directory}")


def fitted_params(config: dict, source: Source, target: Any) -> Any:
    """`target` (freshly initialised parameters) filled from `source` as `train.init_from` and
    `train.convert_kv_heads` ask (`qkv_jax.finetune.fit_params`); ConfigError when they do not
    fit. Pure, so it also runs under `jax.vmap` over a seed axis of `target` (each seed keeps
    its own fresh adapters)."""
    train, model = config["train"], config.get("model", {})
    num_kv_heads = None
    if train.get("convert_kv_heads"):
        num_kv_heads = model.get("num_kv_heads") or model.get("num_heads")
        if num_kv_heads is None:
            raise ConfigError("train.convert_kv_heads=True: the model has no model.num_heads to convert to")
    try:
        return fit_params(
            source.params,
            target,
            source_lora_alpha=((source.config or {}).get("model") or {}).get("lora_alpha"),
            num_kv_heads=num_kv_heads,
        )
    except ValueError as error:  # ParamMismatchError, or a conversion that cannot pool
        hint = ""
        if model.get("num_kv_heads") is not None and not train.get("convert_kv_heads"):
            hint = " (train.convert_kv_heads=True mean-pools the source's K/V heads into model.num_kv_heads)"
        raise ConfigError(f"train.init_from={train['init_from']!r}: {error}{hint}") from None


def initial_params(config: dict, target: Any) -> tuple[Any, Source]:
    """`target` (the run's freshly initialised parameters) filled from `train.init_from`'s
    newest usable checkpoint (see the module docstring), placed as `target` is; ConfigError
    when they do not fit."""
    source = read_source(config["train"]["init_from"])
    params = fitted_params(config, source, target)
    params = jax.tree.map(lambda new, old: jax.device_put(new, old.sharding), params, target)
    logging.info("%s", f"starting from the parameters of step {source.step} in {source.directory}")
    return params, source
