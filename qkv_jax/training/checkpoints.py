"""Orbax checkpoints that are verified on restore.

Each checkpoint holds the train state (`checkpoint_tree`: `step`, `params`,
`opt_state`; `restore_train_state` puts them back into a TrainState) and a
small JSON record with the shape, dtype and a SHA-256 digest of every leaf.
On restore the record is checked against the model being restored into (a
shape or dtype change is an error, where orbax alone would convert silently)
and the restored bytes against the digest; a checkpoint that fails to read or
verify is skipped with a warning and the next older one is tried.

Saves are synchronous: orbax writes into a temporary directory and renames it
when complete, so a process killed mid-save leaves the previous checkpoints
as they were.
"""

from __future__ import annotations

import hashlib
import pathlib
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from qkv_jax.training.sharding import gather

__all__ = [
    "CheckpointMismatchError",
    "CheckpointWarning",
    "Checkpoints",
    "NoCheckpointError",
    "checkpoint_tree",
    "load_train_state",
    "restore_train_state",
    "tree_digest",
]


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped because it could not be read or verified."""


class NoCheckpointError(ValueError):
    """A workdir has no usable checkpoint to restore."""


class CheckpointMismatchError(ValueError):
    """The checkpoint's arrays do not fit the model being restored into."""


def _leaf_records(tree: Any) -> dict[str, dict]:
    records = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        array = gather(leaf)
        records[jax.tree_util.keystr(path)] = {
            "shape": list(array.shape),
            "dtype": str(array.dtype),
            "sha256": hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest(),
        }
    return records


def tree_digest(tree: Any) -> str:
    """SHA-256 over every leaf's path, dtype, shape and bytes."""
    digest = hashlib.sha256()
    for name, record in sorted(_leaf_records(tree).items()):
        digest.update(f"{name}:{record['dtype']}:{record['shape']}:{record['sha256']}".encode())
    return digest.hexdigest()


class Checkpoints:
    """Save and restore train states under `directory` (kept: the newest `max_to_keep`; None: all)."""

    def __init__(self, directory: str | pathlib.Path, max_to_keep: int | None = 3):
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=False,
            cleanup_tmp_directories=True,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "record"))

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any) -> None:
        """Saves `state` (a pytree) as checkpoint `step`, replacing one of that step."""
        if step in self._manager.all_steps():
            self._manager.delete(step)
        record = {"leaves": _leaf_records(state), "digest": tree_digest(state)}
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)),
            force=True,
        )
        self._manager.wait_until_finished()

    def _check_fits(self, step: int, record: dict, target: Any) -> None:
        expected = {name: (r["shape"], r["dtype"]) for name, r in _abstract_records(target).items()}
        stored = {name: (r["shape"], r["dtype"]) for name, r in record["leaves"].items()}
        missing = sorted(set(expected) - set(stored))
        extra = sorted(set(stored) - set(expected))
        if missing or extra:
            raise CheckpointMismatchError(
                f"checkpoint step {step} in {self.directory} has a different structure: "
                f"missing {missing[:3]}, unexpected {extra[:3]}"
            )
        for name, (shape, dtype) in expected.items():
            if stored[name] != (shape, dtype):
                raise CheckpointMismatchError(
                    f"checkpoint step {step} in {self.directory}: {name} is "
                    f"{stored[name][1]}{stored[name][0]} but the model expects {dtype}{shape}"
                )

    def _read(self, step: int, **item: Any) -> Any:
        """The one item (`record` or `state`) of checkpoint `step`, or None with a warning
        when it cannot be read (any failure: a torn file, a missing commit marker, ...)."""
        ((name, args),) = item.items()
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**{name: args}))[name]
        except Exception as error:  # noqa: BLE001 - any read failure means skip it
            warnings.warn(
                f"checkpoint step {step} in {self.directory} is unreadable "
                f"({type(error).__name__}: {error}); trying an older one",
                CheckpointWarning,
                stacklevel=3,
            )
            return None

    def restore(self, step: int, target: Any) -> Any | None:
        """Checkpoint `step` restored into `target`'s structure, shapes, dtypes and shardings
        (`target`: arrays or `jax.ShapeDtypeStruct`s), or None with a CheckpointWarning when it
        does not read back or fails its checksum. CheckpointMismatchError when it does not fit."""
        record = self._read(step, record=ocp.args.JsonRestore())
        if record is None:
            return None
        self._check_fits(step, record, target)
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype(x), sharding=getattr(x, "sharding", None)),
            target,
        )
        state = self._read(step, state=ocp.args.StandardRestore(abstract))
        if state is None:
            return None
        if tree_digest(state) != record["digest"]:
            warnings.warn(
                f"checkpoint step {step} in {self.directory} fails its checksum; trying an older one",
                CheckpointWarning,
                stacklevel=2,
            )
            return None
        return state

    def restore_latest(self, target: Any) -> tuple[int, Any] | None:
        """Restores the newest checkpoint that reads back and verifies (see `restore`).

        Restored arrays take `target`'s shardings (so a run saved on 8 devices
        restores onto 1, or onto 4). Returns `(step, state)`, or None when there
        is no usable checkpoint. Raises CheckpointMismatchError when the newest
        readable checkpoint does not fit `target`.
        """
        for step in reversed(self.all_steps()):
            state = self.restore(step, target)
            if state is not None:
                return step, state
        return None

    def close(self) -> None:
        self._manager.close()


def checkpoint_tree(state: Any) -> dict:
    """What a checkpoint holds of a flax TrainState: `{"step", "params", "opt_state"}`."""
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state}


def restore_train_state(checkpoints: Checkpoints, state: Any) -> tuple[int, Any] | None:
    """`(step, state)` from the newest usable checkpoint, restored into `state`'s
    structure, shapes, dtypes and shardings (its values are not used); None when
    there is none. Raises CheckpointMismatchError as `Checkpoints.restore_latest`."""
    restored = checkpoints.restore_latest(checkpoint_tree(state))
    if restored is None:
        return None
    step, tree = restored
    return step, state.replace(step=tree["step"], params=tree["params"], opt_state=tree["opt_state"])


def load_train_state(workdir: str | pathlib.Path, template: Any) -> tuple[int, Any]:
    """`(step, state)` of the newest usable checkpoint in `workdir`/checkpoints, restored
    into `template` (a TrainState) as `restore_train_state` does. NoCheckpointError
    when there is none."""
    directory = pathlib.Path(workdir) / "checkpoints"
    if not directory.is_dir():
        raise NoCheckpointError(f"workdir={str(workdir)!r}: no checkpoints/ yet")
    checkpoints = Checkpoints(directory)
    try:
        restored = restore_train_state(checkpoints, template)
    finally:
        checkpoints.close()
    if restored is None:
        raise NoCheckpointError(f"workdir={str(workdir)!r}: no usable checkpoint in checkpoints/")
    return restored


def _dtype(x: Any) -> np.dtype:
    """dtype of an array, a ShapeDtypeStruct, or a Python scalar (as JAX would store it)."""
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.dtype(jnp.asarray(x).dtype)


def _abstract_records(tree: Any) -> dict[str, dict]:
    return {
        jax.tree_util.keystr(path): {"shape": list(np.shape(leaf)), "dtype": str(_dtype(leaf))}
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }
