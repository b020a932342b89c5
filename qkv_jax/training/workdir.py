"""The files of a run's workdir: config.json, metrics.jsonl, summary.json, and its lock.

Writes are atomic (temporary file + rename) so a killed run never leaves a
half-written JSON file; metrics lines are flushed one by one. One process
trains in a workdir at a time (`WorkdirLock`); a write that finds the disk
full becomes a `DiskFullError` naming what was being written and what is kept.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pathlib
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from absl import logging

from qkv_jax.training.tensorboard import EventWriter
from qkv_jax.training.validate import ConfigError

__all__ = [
    "RESUMABLE_FIELDS",
    "RUN_OUTPUTS",
    "DiskFullError",
    "WorkdirBusyError",
    "WorkdirLock",
    "check_writable",
    "disk_full_guard",
    "prepare_workdir",
    "write_json",
    "read_json",
    "plain",
    "read_metrics",
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
    "eval.",
    "mesh.",  # a run may resume on another device layout
)
# Outputs every run owns (a task adds its own, `Setup.outputs`); with
# train.overwrite=True they are moved aside, not deleted.
RUN_OUTPUTS = ("config.json", "metrics.jsonl", "summary.json", "checkpoints", "tensorboard", "report.json")


LOCK_FILE = ".lock"


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
        one (None otherwise). WorkdirBusyError names a live holder."""
        file = open(self.path, "a+")
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
        holder = _parse_holder(self.path.read_text()) or {}
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


def write_json(path: str | pathlib.Path, data: Any) -> None:
    """Writes JSON atomically: a reader sees the old file or the new one."""
    path = pathlib.Path(path)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(f.name, path)


def read_json(path: str | pathlib.Path) -> Any:
    """The JSON in `path`, or None when there is no such file; a ConfigError naming the file
    when it is not valid JSON."""
    path = pathlib.Path(path)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: not valid JSON ({error}); move it aside or delete it") from None


def plain(tree: Any) -> Any:
    """Arrays (and numpy scalars) in `tree` as Python numbers and nested lists, for JSON."""
    if isinstance(tree, dict):
        return {name: plain(value) for name, value in tree.items()}
    array = np.asarray(tree)
    return array.item() if array.ndim == 0 else array.tolist()


def _differences(saved: dict, current: dict, resumable: tuple[str, ...]) -> list[str]:
    saved_flat, current_flat = flatten(saved), flatten(current)
    changed = []
    for field in sorted(set(saved_flat) | set(current_flat)):
        if any(field == f or (f.endswith(".") and field.startswith(f)) for f in resumable):
            continue
        if saved_flat.get(field, "<absent>") != current_flat.get(field, "<absent>"):
            changed.append(
                f"{field}={current_flat.get(field, '<absent>')!r} here but "
                f"{saved_flat.get(field, '<absent>')!r} in the workdir"
            )
    return changed


def check_writable(workdir: pathlib.Path) -> None:
    """Creates `workdir`; ConfigError naming it when it cannot be written."""
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=workdir):
            pass
    except OSError as error:
        raise ConfigError(
            f"workdir={str(workdir)!r}: cannot write there ({error.strerror or error})"
        ) from None


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
    `resumable` is refused (ConfigError naming the first differing fields)
    unless `overwrite`, in which case the old `outputs` (and pictures) are
    moved to `replaced-<time>/` inside the workdir. Writes `config_name`.
    """
    workdir = pathlib.Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"workdir={str(workdir)!r}: exists and is not a directory")
    check_writable(workdir)
    saved_path = workdir / config_name
    if saved_path.exists():
        try:
            saved = json.loads(saved_path.read_text())
        except json.JSONDecodeError:
            saved = {f"<unreadable {config_name}>": True}
        changed = _differences(saved, config, resumable)
        if changed and not overwrite:
            raise ConfigError(
                f"workdir={str(workdir)!r} holds a run of a different config ("
                + "; ".join(changed[:3])
                + "); use another workdir or --config.train.overwrite=True"
            )
        if changed:
            archive = workdir / time.strftime("replaced-%Y%m%d-%H%M%S")
            archive.mkdir()
            for name in outputs + tuple(p.name for p in workdir.glob("*.png")):
                if (workdir / name).exists():
                    shutil.move(str(workdir / name), str(archive / name))
    write_json(saved_path, config)
    return workdir


def read_metrics(path: str | pathlib.Path) -> list[dict]:
    """The records of a metrics.jsonl; a torn last line (a killed writer) is dropped."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


class MetricsWriter:
    """Appends one JSON object per line, and the same scalars to TensorBoard.

    TensorBoard event files go to `<workdir>/tensorboard/`
    (`qkv_jax.training.tensorboard`, TensorBoard's own writer without
    TensorFlow; view them with `tensorboard --logdir <workdir>/tensorboard`).

    On resume from `start_step` it keeps the earlier records on the `log_every`
    grid and drops the rest (records a killed run wrote past its checkpoint, and
    the final-step record of a run that is now extended), so a resumed run's
    file equals an uninterrupted run's. `records` holds every record of the run
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
    ):
        self.path = None if path is None else pathlib.Path(path)
        self.enabled = enabled and self.path is not None
        self.records = [
            r
            for r in (read_metrics(self.path) if self.path is not None else [])
            if r.get("step", 0) < start_step and r.get("step", 0) % log_every == 0
        ]
        self.last_step = start_step - 1  # of the last record written
        self._tensorboard: EventWriter | None = None
        if not self.enabled:
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
        with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
            for record in records:
                f.write(json.dumps(record, sort_keys=True) + "\n")
        os.replace(f.name, self.path)

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
