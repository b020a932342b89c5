"""The files of a run's workdir: config.json, metrics.jsonl, summary.json, and its lock.

Writes are atomic (a temporary file in the same directory, renamed over the
target) so a killed run never leaves a half-written JSON file and a reader
sees the old file or the new one; metrics lines are flushed one by one. Every
file is created with mode 0666 less the user's umask, as any other program's
(0644 under the usual 0022), so a colleague can read a shared workdir.

Whether a workdir can take a run is checked without writing anything
(`check_workdir_path`, `saved_config`, `differences`), so a refused launch
leaves an existing workdir as it was. One process trains in a workdir at a
time (`WorkdirLock`); a write that finds the disk full becomes a
`DiskFullError` naming what was being written and what is kept.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pathlib
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, Any

import numpy as np
from absl import logging

from qkv_jax.lm import RENAMED_FIELDS
from qkv_jax.training.tensorboard import EventWriter
from qkv_jax.training.validate import ConfigError

__all__ = [
    "RESUMABLE_FIELDS",
    "RUN_OUTPUTS",
    "DiskFullError",
    "WorkdirBusyError",
    "WorkdirError",
    "WorkdirLock",
    "check_workdir_path",
    "differences",
    "disk_full_guard",
    "make_workdir",
    "move_aside",
    "newest_checkpoint_step",
    "prepare_workdir",
    "saved_config",
    "write_atomic",
    "write_json",
    "read_json",
    "plain",
    "read_metrics",
    "missing_steps",
    "MetricsWriter",
    "flatten",
]

# Fields that may change between a run and its resumption (how long, how often).
RESUMABLE_FIELDS = (
    "train.steps",
    "train.log_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.overwrite",
    "train.cpu_optimization_level",  # how XLA:CPU compiles the same programs
    "eval.",
    "mesh.",  # a run may resume on another device layout
)
# Outputs every run owns (a task adds its own, `Setup.outputs`), as names or glob patterns
# (summary-<steps>.json: the summary of an earlier end of a run that was continued); with
# train.overwrite=True they are moved aside, not deleted.
RUN_OUTPUTS = (
    "config.json",
    "metrics.jsonl",
    "probes.jsonl",
    "summary.json",
    "summary-*.json",
    "checkpoints",
    "tensorboard",
    "report.json",
    "report.html",
)


LOCK_FILE = ".lock"


class WorkdirError(ConfigError):
    """A workdir's files cannot be used as they are; the message names the file and what to do."""


class WorkdirBusyError(RuntimeError):
    """Another live process is training in the workdir."""


class DiskFullError(OSError):
    """A write into the workdir found no space left; the message says what is kept."""


class WorkdirLock:
    """One training process per workdir: a POSIX record lock (`fcntl.lockf`) on `<workdir>/.lock`.

    The kernel (or NFS's lock manager) releases the lock when its process dies,
    however it dies, so a lock left by a killed run is free to take; the file
    names the holder (host, pid, start time, command) for the message to the
    next launch. Written here rather than taken from a library: `filelock`
    uses `flock`, which NFS clients do not share across hosts, and it keeps no
    holder to name.
    """

    def __init__(self, workdir: str | pathlib.Path):
        self.path = pathlib.Path(workdir) / LOCK_FILE
        self._file: Any = None

    def acquire(self) -> dict | None:
        """Takes the lock; returns the previous holder's record when a dead process left
        one (None otherwise). WorkdirBusyError names a live holder; WorkdirError says what
        to do about a lock file that cannot be opened."""
        try:
            # held open while the lock is; a damaged holder record reads as text all the same
            file = open(self.path, "a+", encoding="utf-8", errors="replace")  # noqa: SIM115
        except OSError as error:
            raise WorkdirError(
                f"{self.path}: cannot open the workdir's lock file ({error.strerror or error}); "
                + (
                    "it is not a regular file: remove it and run again"
                    if self.path.exists() and not self.path.is_file()
                    else "it belongs to another user: train in a workdir of your own"
                )
            ) from None
        try:
            fcntl.lockf(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            file.close()
            if error.errno not in (errno.EACCES, errno.EAGAIN):
                return None  # a filesystem without locks: train unguarded rather than not at all
            raise WorkdirBusyError(self._busy_message()) from None
        file.seek(0)
        previous = _parse_holder(file.read())
        self._file = file
        try:
            file.seek(0)
            file.truncate()
            json.dump(_this_process(), file)
            file.flush()
        except OSError:
            self.release()
            raise
        return previous

    def _busy_message(self) -> str:
        holder = _parse_holder(self.path.read_text(errors="replace"))
        if holder is None:  # a holder that has not written its record yet, or a damaged one
            return (
                f"workdir={str(self.path.parent)!r} is in use: another process holds {self.path} "
                "(its holder record is unreadable); wait for it, stop it, or use another workdir"
            )
        return (
            f"workdir={str(self.path.parent)!r} is in use: pid {holder.get('pid', '?')} on host "
            f"{holder.get('host', '?')} (started {holder.get('started', '?')}) is training there; "
            "wait for it, stop it, or use another workdir"
        )

    def release(self) -> None:
        if self._file is not None:
            self._file.seek(0)
            self._file.truncate()  # a clean exit leaves no holder behind
            self._file.close()  # closing releases the lock
            self._file = None


def _this_process() -> dict:
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": started, "command": sys.argv}


def _parse_holder(text: str) -> dict | None:
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return None
    return holder if isinstance(holder, dict) else None


@contextlib.contextmanager
def disk_full_guard(what: str, kept: str) -> Iterator[None]:
    """Turns a full disk (ENOSPC, EDQUOT) while writing `what` into one DiskFullError:
    "no space left on the device writing <what>; <kept>; free space and run the same
    command to resume"."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as error:  # orbax and tensorstore wrap OS errors in their own types
        if not _is_disk_full(error):
            raise
        raise DiskFullError(
            f"no space left on the device writing {what}; {kept}; free space and resume"
        ) from None


def _is_disk_full(error: BaseException | None) -> bool:
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(error) or "Disk quota exceeded" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}."""
    if isinstance(tree, dict):
        flat = {}
        for key, value in tree.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: tree}


def write_atomic(path: str | pathlib.Path, write: Callable[[IO[str]], Any]) -> None:
    """Writes `path` through `write(file)` atomically: a reader sees the old file or the new
    one. The file gets mode 0666 less the umask (the temporary file is created with that
    mode, as `open` would create the target; `tempfile` would make it 0600)."""
    path = pathlib.Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_json(path: str | pathlib.Path, data: Any) -> None:
    """Writes JSON atomically (`write_atomic`)."""

    def dump(file: IO[str]) -> None:
        json.dump(data, file, indent=2, sort_keys=True)
        file.write("\n")

    write_atomic(path, dump)


def read_json(path: str | pathlib.Path, advice: str = "move it aside or delete it") -> Any:
    """The JSON in `path`, or None when there is no such file; a WorkdirError naming the file
    and `advice` (what to do) when it cannot be read or is not valid JSON."""
    path = pathlib.Path(path)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        reason = f"not valid JSON, truncated or damaged ({error})"
    except OSError as error:
        reason = f"unreadable ({error.strerror or error})"
    raise WorkdirError(f"{path}: {reason}; {advice}") from None


def plain(tree: Any) -> Any:
    """Arrays (and numpy scalars) in `tree` as Python numbers and nested lists, for JSON."""
    if isinstance(tree, dict):
        return {name: plain(value) for name, value in tree.items()}
    array = np.asarray(tree)
    return array.item() if array.ndim == 0 else array.tolist()


def differences(saved: dict, current: dict, ignored: Sequence[str] = ()) -> list[str]:
    """'field=<current> here but <saved> in the workdir' for each field that differs, except the
    `ignored` ones (a name, or a prefix ending in '.' for a whole section). A field the workdir's
    config lacks matches an unset (None) one here: the run was saved before the field existed,
    and an unset optional field means what its absence meant (so a release that adds an
    optional field still resumes the runs written before it). A workdir written before a model
    field was renamed (`qkv_jax.lm.RENAMED_FIELDS`) has its value under the new name."""
    saved_flat, current_flat = _renamed(flatten(saved)), flatten(current)
    changed = []
    for field in sorted(set(saved_flat) | set(current_flat)):
        if any(field == f or (f.endswith(".") and field.startswith(f)) for f in ignored):
            continue
        if field not in saved_flat and current_flat[field] is None:
            continue
        if saved_flat.get(field, "<absent>") != current_flat.get(field, "<absent>"):
            changed.append(
                f"{field}={current_flat.get(field, '<absent>')!r} here but "
                f"{saved_flat.get(field, '<absent>')!r} in the workdir"
            )
    return changed


def _renamed(flat: dict) -> dict:
    """`flat` with each old `model.<field>` of RENAMED_FIELDS under its new name, where the
    config lacks the new one (a run saved before the rename)."""
    flat = dict(flat)
    for old, new in RENAMED_FIELDS.items():
        if f"model.{old}" in flat and f"model.{new}" not in flat:
            flat[f"model.{new}"] = flat.pop(f"model.{old}")
    return flat


def check_workdir_path(workdir: str | pathlib.Path) -> None:
    """ConfigError naming `workdir` when a run could not create or write it: it (or a directory
    above it) is a file, it is not writable by this user, or it is on a read-only filesystem.
    Writes nothing."""
    workdir = pathlib.Path(workdir)
    existing = workdir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "is a file" if existing == workdir else f"is under {str(existing)!r}, a file"
        raise ConfigError(f"workdir={str(workdir)!r}: {where}, not a directory")
    if os.access(existing, os.W_OK | os.X_OK):
        return
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise ConfigError(f"workdir={str(workdir)!r}: {str(existing)!r} is on a read-only filesystem")
    raise ConfigError(f"workdir={str(workdir)!r}: {str(existing)!r} is not writable by this user")


def make_workdir(workdir: str | pathlib.Path) -> pathlib.Path:
    """Creates `workdir` (and the directories above it); ConfigError naming it when it cannot."""
    workdir = pathlib.Path(workdir)
    check_workdir_path(workdir)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        if _is_disk_full(error):
            raise
        raise ConfigError(f"workdir={str(workdir)!r}: cannot create it ({error.strerror or error})") from None
    return workdir


def saved_config(workdir: str | pathlib.Path, config_name: str = "config.json") -> dict | None:
    """The config a workdir's run was started with (None for a new workdir); a WorkdirError
    saying what to do when the file is damaged."""
    path = pathlib.Path(workdir) / config_name
    saved = read_json(
        path,
        f"it records the config of the run in {path.parent}: if this command is that run's, "
        f"delete {config_name} and run the command again (it is rewritten); otherwise use another "
        "workdir or --config.train.overwrite=True to move the old run aside",
    )
    if saved is not None and not isinstance(saved, dict):
        raise WorkdirError(
            f"{path}: holds {type(saved).__name__}, not a config; delete it or use another workdir"
        )
    return saved


def newest_checkpoint_step(workdir: str | pathlib.Path) -> int | None:
    """The step of the newest committed checkpoint in `workdir/checkpoints` (orbax names a
    checkpoint by its step once its save is complete), or None. Reads the listing only."""
    directory = pathlib.Path(workdir) / "checkpoints"
    if not directory.is_dir():
        return None
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir()]
    return max(steps, default=None)


def move_aside(workdir: pathlib.Path, outputs: Iterable[str]) -> pathlib.Path:
    """Moves `outputs` (names or glob patterns) and the pictures of `workdir` into a new
    `replaced-<time>/` inside it; returns that directory."""
    archive = workdir / time.strftime("replaced-%Y%m%d-%H%M%S")
    archive.mkdir()
    for pattern in (*outputs, "*.png"):
        for path in sorted(workdir.glob(pattern)):
            shutil.move(str(path), str(archive / path.name))
    return archive


def prepare_workdir(
    workdir: str | pathlib.Path,
    config: dict,
    overwrite: bool,
    *,
    config_name: str = "config.json",
    resumable: tuple[str, ...] = RESUMABLE_FIELDS,
    outputs: tuple[str, ...] = RUN_OUTPUTS,
) -> pathlib.Path:
    """Creates the workdir, or checks that the run in it is this config's.

    A workdir whose `config_name` differs from `config` in a field not in
    `resumable` is refused (ConfigError naming the first differing fields,
    before anything is written) unless `overwrite`, in which case the old
    `outputs` (and pictures) are moved to `replaced-<time>/` inside the workdir.
    Writes `config_name`.
    """
    workdir = pathlib.Path(workdir)
    check_workdir_path(workdir)
    saved = saved_config(workdir, config_name)
    changed = [] if saved is None else differences(saved, config, resumable)
    if changed and not overwrite:
        raise ConfigError(
            f"workdir={str(workdir)!r} holds a run of a different config ("
            + "; ".join(changed[:3])
            + "); use another workdir or --config.train.overwrite=True"
        )
    make_workdir(workdir)
    if changed:
        move_aside(workdir, outputs)
    write_json(workdir / config_name, config)
    return workdir


def _read_records(path: pathlib.Path) -> list[dict]:
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line (a killed writer), or a damaged one
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def read_metrics(path: str | pathlib.Path) -> list[dict]:
    """The records of a metrics.jsonl; lines that do not read back as a record (a torn last
    line from a killed writer, a damaged or truncated file) are left out."""
    path = pathlib.Path(path)
    return _read_records(path) if path.exists() else []


def missing_steps(records: Sequence[dict], end: int, log_every: int) -> list[int]:
    """The steps on the `log_every` grid below `end` that `records` hold no record of."""
    have = {record["step"] for record in records}
    return [step for step in range(0, end, log_every) if step not in have]


class MetricsWriter:
    """Appends one JSON object per line, and the same scalars to TensorBoard.

    TensorBoard event files go to `<workdir>/tensorboard/`
    (`qkv_jax.training.tensorboard`, TensorBoard's own writer without
    TensorFlow; view them with `tensorboard --logdir <workdir>/tensorboard`).

    On resume from `start_step` it keeps the earlier records on the `log_every`
    grid, and that of `final_step` (the run's last step, logged off the grid),
    and drops the rest (records a killed run wrote past its checkpoint, and
    the final-step record of a run that is now extended), so a resumed run's
    file equals an uninterrupted run's; a damaged file is rewritten with the
    records that read back. `records` holds every record of the run
    (kept and new); with `path` None (a run without a workdir) or `enabled`
    False (not process 0) nothing is written.
    """

    def __init__(
        self,
        path: str | pathlib.Path | None,
        start_step: int,
        log_every: int,
        enabled: bool = True,
        tensorboard: bool = True,
        final_step: int | None = None,
    ):
        self.path = None if path is None else pathlib.Path(path)
        self.enabled = enabled and self.path is not None
        self.records = [
            r
            for r in (read_metrics(self.path) if self.path is not None else [])
            if r["step"] < start_step and (r["step"] % log_every == 0 or r["step"] == final_step)
        ]
        self.last_step = start_step - 1  # of the last record written
        self._tensorboard: EventWriter | None = None
        if not self.enabled or self.path is None:
            return
        self._write_all(self.records)
        self._file = open(self.path, "a")  # noqa: SIM115 - open for the run, closed by close()
        if not tensorboard:
            return
        try:
            self._tensorboard = EventWriter(self.path.parent / "tensorboard", purge_step=start_step)
        except ImportError:  # an environment without the `tensorboard` package: metrics.jsonl only
            logging.warning(
                "tensorboard is not installed: no TensorBoard event files in %s", self.path.parent
            )

    def _write_all(self, records: Iterable[dict]) -> None:
        assert self.path is not None
        write_atomic(self.path, lambda f: f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in records))

    def write(self, record: dict) -> None:
        self.last_step = record["step"]
        self.records.append(record)
        if not self.enabled:
            return
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            for name, value in record.items():
                if name != "step" and isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(f"train/{name}", value, record["step"])
            self._tensorboard.flush()

    def write_scalars(self, prefix: str, values: dict, step: int) -> None:
        """Scalar entries of `values` (evaluation metrics, say) to TensorBoard only."""
        if self._tensorboard is not None:
            for name, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tensorboard.add_scalar(f"{prefix}/{name}", value, step)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._tensorboard is not None:
                self._tensorboard.close()
