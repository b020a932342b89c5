"""Orbax checkpoints that are verified whenever they are read, and the one way to read a run.

Each checkpoint holds the train state (`checkpoint_tree`: `step`, `params`,
`opt_state`) and a small JSON record with the shape, dtype and a SHA-256 digest
of every leaf. Whatever reads a checkpoint checks the restored bytes against
the record, and against the model it restores into when one is given (a shape
or dtype change is an error, where orbax alone would convert silently); a
checkpoint that fails to read or verify is skipped with a `CheckpointWarning`
and the next older one is tried.

Two functions read a run from outside the trainer (fine-tuning's
`train.init_from`, the report and its explorer page, generation, the tasks):

  read_params(path, like=None)       the parameters of a run's newest usable checkpoint
  read_train_state(path, like=None)  its whole train state

`path` names a run's workdir, its `checkpoints/` directory or one checkpoint
step directory (`W/checkpoints/300`, that step only). They open the directory
read-only (orbax's `read_only` manager: nothing is created, cleaned up or
written), so a run can be read while it trains and a source run is never
touched. The trainer saves and resumes through `Checkpoints` itself.

Saves are synchronous: orbax writes into a temporary directory and renames it
when complete, so a process killed mid-save leaves the previous checkpoints
as they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging as std_logging
import pathlib
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from qkv_jax.training.sharding import gather

__all__ = [
    "CheckpointMismatchError",
    "CheckpointWarning",
    "Checkpoints",
    "NoCheckpointError",
    "RunLocation",
    "Saved",
    "checkpoint_tree",
    "locate_run",
    "read_params",
    "read_train_state",
    "tree_digest",
]


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped because it could not be read or verified."""


class NoCheckpointError(ValueError):
    """A path holds no usable checkpoint to read."""


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


def _dtype(x: Any) -> np.dtype:
    """dtype of an array, a ShapeDtypeStruct, or a Python scalar (as JAX would store it)."""
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.dtype(jnp.asarray(x).dtype)


def _abstract_records(tree: Any, prefix: str = "") -> dict[str, tuple[list[int], str]]:
    return {
        prefix + jax.tree_util.keystr(path): (list(np.shape(leaf)), str(_dtype(leaf)))
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


@contextlib.contextmanager
def _without_read_only_notes() -> Iterator[None]:
    """Drops the notes orbax logs when a manager is read-only on purpose."""

    def keep(record: std_logging.LogRecord) -> bool:
        message = record.getMessage()
        return "read only" not in message and "read_only=True" not in message

    logger = std_logging.getLogger("absl")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _abandoned_read(record: std_logging.LogRecord) -> bool:
    """False for asyncio's report of an orbax shard read whose failure nobody retrieved.

    A reader racing the trainer's deletion of an old checkpoint fails several shard reads at
    once: `_read` catches the first (a CheckpointWarning, then an older checkpoint), and
    asyncio, when it collects the others, logged "Task exception was never retrieved" with a
    traceback from orbax's `_read_array_index_and_device_put`, which a reader's output must
    not show. Only that report is dropped; asyncio's others pass."""
    message = record.getMessage()
    return not ("exception was never retrieved" in message and "_read_array_index_and_device_put" in message)


std_logging.getLogger("asyncio").addFilter(_abandoned_read)


class Checkpoints:
    """Saves and restores train states under `directory`, verifying every read.

    `max_to_keep`: the newest this many are kept (None: every one). `read_only`: open
    an existing directory without creating or changing anything (saving then
    raises).
    """

    def __init__(
        self, directory: str | pathlib.Path, *, max_to_keep: int | None = None, read_only: bool = False
    ):
        self.directory = pathlib.Path(directory).absolute()
        with _without_read_only_notes():  # the options log them too, where they are made
            options = ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                enable_async_checkpointing=False,
                cleanup_tmp_directories=not read_only,
                create=not read_only,
                read_only=read_only,
            )
            self._manager = self._open(options, retries=5 if read_only else 0)

    def _open(self, options: Any, retries: int) -> Any:
        """orbax's manager, reopened when a step it listed vanished before it read the step's time.

        A reader opening a run that is training at that moment lists the step directories,
        then stats each one; the trainer may delete an old step in between (max_to_keep), and
        orbax then raises FileNotFoundError for a step nobody asked for. The listing is simply
        taken again.
        """
        for attempt in range(retries + 1):
            try:
                return ocp.CheckpointManager(self.directory, options=options, item_names=("state", "record"))
            except FileNotFoundError:
                if attempt == retries or not self.directory.is_dir():
                    raise
        raise AssertionError("unreachable")

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

    def _warn(self, step: int, problem: str) -> None:
        warnings.warn(
            f"checkpoint step {step} in {self.directory} {problem}; trying an older one",
            CheckpointWarning,
            stacklevel=4,
        )

    def _read(self, step: int, **item: Any) -> Any:
        """The one item (`record` or `state`) of checkpoint `step`, or None with a warning
        when it cannot be read (any failure: a torn file, a missing commit marker, ...)."""
        ((name, args),) = item.items()
        try:
            with _without_read_only_notes():
                return self._manager.restore(step, args=ocp.args.Composite(**{name: args}))[name]
        except Exception as error:  # noqa: BLE001 - any read failure means skip it
            self._warn(step, f"is unreadable ({type(error).__name__}: {error})")
            return None

    def _check_fits(self, step: int, record: dict, target: Any, prefix: str) -> None:
        """CheckpointMismatchError unless the record's leaves under `prefix` are `target`'s."""
        expected = _abstract_records(target, prefix)
        stored = {
            name: (r["shape"], r["dtype"]) for name, r in record["leaves"].items() if name.startswith(prefix)
        }
        missing, extra = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
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

    def _host_target(self, step: int) -> Any | None:
        """The tree checkpoint `step` holds as ShapeDtypeStructs on this process's first CPU
        device, so that it restores whole here whatever mesh and processes saved it; None (with
        a CheckpointWarning) when its metadata cannot be read."""
        cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
        try:
            with _without_read_only_notes():
                folder = epath.Path(self.directory / str(step) / "state")
                metadata = ocp.StandardCheckpointHandler().metadata(folder)
        except Exception as error:  # noqa: BLE001 - any read failure means skip it
            self._warn(step, f"is unreadable ({type(error).__name__}: {error})")
            return None
        return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=cpu), metadata)

    def restore(self, step: int, target: Any = None, *, params_only: bool = False) -> Any | None:
        """Checkpoint `step`, verified against its record; None (with a CheckpointWarning) when it
        does not read back or fails its checksum.

        With `target` (arrays or `jax.ShapeDtypeStruct`s of the train state, or of the
        parameters alone with `params_only`), the arrays take its structure, shapes, dtypes and
        shardings, and a checkpoint that does not fit is a CheckpointMismatchError. Without
        one, the tree as saved, as arrays on this process's CPU (host memory), whatever mesh
        and processes saved it. `params_only` returns (and verifies) just the
        parameters.
        """
        record_path = self.directory / str(step) / "record"
        if (self.directory / str(step)).is_dir() and not record_path.exists():
            self._warn(step, f"has no digest record ({record_path} is missing), so it cannot be verified")
            return None
        record = self._read(step, record=ocp.args.JsonRestore())
        if record is None:
            return None
        if target is not None:
            self._check_fits(step, record, target, "['params']" if params_only else "")
        if target is not None and not params_only:
            abstract = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype(x), sharding=getattr(x, "sharding", None)),
                target,
            )
            state = self._read(step, state=ocp.args.StandardRestore(abstract))
        else:
            abstract = self._host_target(step)
            if abstract is None:
                return None
            state = self._read(step, state=ocp.args.StandardRestore(abstract))
        if state is None:
            return None
        tree = state["params"] if params_only else state
        # Compared as a multiset: restored without a target, orbax may rebuild containers (an
        # optax NamedTuple as a dict), which renames paths but not bytes.
        prefix = "['params']" if params_only else ""
        saved = sorted(r["sha256"] for name, r in record["leaves"].items() if name.startswith(prefix))
        if sorted(r["sha256"] for r in _leaf_records(tree).values()) != saved:
            self._warn(step, "fails its checksum")
            return None
        if target is not None and params_only:
            tree = jax.tree.map(
                lambda x, like: jax.device_put(x, getattr(like, "sharding", None)), tree, target
            )
        return tree

    def restore_latest(self, target: Any = None, *, params_only: bool = False) -> tuple[int, Any] | None:
        """`(step, tree)` of the newest checkpoint that reads back and verifies (see `restore`),
        or None when there is none. Restored into `target`, arrays take its shardings (so a run
        saved on 8 devices restores onto 1, or onto 4)."""
        for step in reversed(self.all_steps()):
            tree = self.restore(step, target, params_only=params_only)
            if tree is not None:
                return step, tree
        return None

    def close(self) -> None:
        self._manager.close()


def checkpoint_tree(state: Any) -> dict:
    """What a checkpoint holds of a flax TrainState: `{"step", "params", "opt_state"}`."""
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state}


@dataclasses.dataclass(frozen=True)
class RunLocation:
    """Where a path points: the checkpoints directory, the one step it names (or None for the
    newest), and the run's workdir (its config.json and other files)."""

    checkpoints: pathlib.Path
    step: int | None
    workdir: pathlib.Path


def locate_run(path: str | pathlib.Path) -> RunLocation:
    """The run behind `path`: a workdir, its `checkpoints/` directory or one checkpoint step
    directory. NoCheckpointError when it is none of those."""
    path = pathlib.Path(path).expanduser().absolute()
    if (path / "checkpoints").is_dir():
        return RunLocation(path / "checkpoints", None, path)
    if path.is_dir() and path.name.isdigit() and (path / "state").is_dir():
        return RunLocation(path.parent, int(path.name), path.parent.parent)
    if path.is_dir() and any(p.name.isdigit() for p in path.iterdir()):
        return RunLocation(path, None, path.parent)
    raise NoCheckpointError(
        f"{str(path)!r} is not a run's workdir, its checkpoints/ directory or a checkpoint step directory"
    )


@dataclasses.dataclass(frozen=True)
class Saved:
    """What `read_params` / `read_train_state` read: the tree, its step, and where it came from."""

    tree: Any
    step: int
    location: RunLocation


def _read(path: str | pathlib.Path, like: Any, params_only: bool) -> Saved:
    location = locate_run(path)
    checkpoints = Checkpoints(location.checkpoints, max_to_keep=None, read_only=True)
    try:
        steps = [location.step] if location.step is not None else list(reversed(checkpoints.all_steps()))
        for step in steps:
            tree = checkpoints.restore(step, like, params_only=params_only)
            if tree is not None:
                return Saved(tree, step, location)
    finally:
        checkpoints.close()
    raise NoCheckpointError(f"no usable checkpoint in {location.checkpoints}")


def read_params(path: str | pathlib.Path, like: Any = None) -> Saved:
    """The parameters of the newest usable checkpoint of the run at `path` (or of the one step
    it names), verified, read without writing anything there.

    `like`: the parameters of the model they are for (arrays or ShapeDtypeStructs); then a
    checkpoint that does not fit is a CheckpointMismatchError and the arrays take `like`'s
    shardings. Without it, host arrays as saved (a sweep cell's carry a leading seed axis).
    NoCheckpointError when no checkpoint reads back and verifies.
    """
    return _read(path, like, params_only=True)


def read_train_state(path: str | pathlib.Path, like: Any = None) -> Saved:
    """The whole train state `{"step", "params", "opt_state"}` of the newest usable checkpoint
    (or the named step), as `read_params` reads the parameters. `like`: a checkpoint tree
    (`checkpoint_tree(state)`) to restore into, with its shardings."""
    return _read(path, like, params_only=False)
