"""Sweeps: a grid of config overrides, each cell trained over several seeds.

A sweep workdir holds:
  sweep.json             the base config, the cells and the seeds (a re-run with
                         other settings is refused unless `overwrite`)
  cells/<cell>/          the cell's run (its seeds vmapped; checkpointed, resumable)
  cells/<cell>.json      the cell's row once it is finished: done, skipped or failed
  cells/<cell>.traceback.txt   the traceback of a cell that failed
  results.json / .csv    a row per cell: overrides, status and reason, per-seed
                         final loss and metrics, mean/std/min/max, wall time
  results.md / .html     the table
  <metric>_vs_<field>.png, <metric>_heatmap.png

A cell whose config the checks refuse (a ConfigError: heads that do not
divide the width, say) is "skipped" with the reason; a cell that raises
anything else (a task's build, its model's init or compile, a loss that stops
being finite, too little memory) is "failed" with a one-line reason and its
traceback kept, and the sweep goes on to the next cell. Once the launch has
tried its cells it writes the results (when every cell has a row) and raises
`CellsFailed` naming the failed ones; the same command retries the failed and
unfinished cells and skips the rest. A signal (SIGTERM/SIGINT) stops the sweep
as it stops a run: the running cell checkpoints and `Preempted` is raised; a
second SIGINT (KeyboardInterrupt) or a full disk stops it at once.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from qkv_jax.training.preemption import Preempted, StopSignals
from qkv_jax.training.run import train_seeds
from qkv_jax.training.setup import TaskError, build_setup, to_dict
from qkv_jax.training.validate import ConfigError
from qkv_jax.training.workdir import (
    DiskFullError,
    WorkdirBusyError,
    WorkdirError,
    WorkdirLock,
    prepare_workdir,
    read_json,
    write_atomic,
    write_json,
)
from studies.grid import apply_overrides, cell_name, grid
from studies.results import write_sweep_results

__all__ = ["LOSS_THRESHOLD", "CellsFailed", "SweepStopped", "run_sweep", "summarize"]

LOSS_THRESHOLD = 1e-2  # "converged" for the steps-to-threshold column
SWEEP_OUTPUTS = ("sweep.json", "cells", "results.json", "results.csv", "results.md")


class CellsFailed(RuntimeError):
    """Cells of a sweep failed while the others trained. `failed`: their rows (status "failed",
    a one-line reason, their traceback file); `rows`: every finished cell's row."""

    def __init__(self, failed: list[dict], rows: list[dict], total: int, workdir: pathlib.Path):
        named = [f"{cell_name(row['cell'])} ({row['reason']})" for row in failed[:3]]
        more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        super().__init__(
            f"{len(failed)} of {total} cells failed: {'; '.join(named)}{more}; the tracebacks are in "
            f"{workdir / 'cells'}; run the same command to retry them"
        )
        self.failed = failed
        self.rows = rows


class SweepStopped(Preempted):
    """A signal arrived between two cells: the sweep stops before the next one."""

    def __init__(self, signal_name: str, workdir: pathlib.Path):
        Exception.__init__(
            self,
            f"stopped by {signal_name} between cells: the finished ones are kept in {workdir}; "
            "run the same command to resume",
        )
        self.step = 0
        self.signal_name = signal_name


def _stats(values: Iterable[float]) -> dict[str, float]:
    array = np.asarray(list(values), dtype=float)
    return {
        "mean": float(np.mean(array)),
        "std": float(np.std(array)),
        "min": float(np.min(array)),
        "max": float(np.max(array)),
    }


def _steps_to_threshold(steps: list[int], curve: list[float], threshold: float) -> float:
    for step, loss in zip(steps, curve, strict=False):
        if loss < threshold:
            return float(step)
    return math.nan


def summarize(cell: dict[str, Any], summary: dict) -> dict[str, Any]:
    """The results row of a finished cell, from its `train_seeds` summary."""
    row: dict[str, Any] = {"cell": cell, "status": "done", "seeds": summary["seeds"]}
    row["final_loss"] = summary["final_loss"]
    row["final_loss_stats"] = _stats(summary["final_loss"])
    for name, values in summary.items():
        if name.startswith("eval_") and np.ndim(values) == 1:  # one scalar per seed
            row[name] = values
            row[f"{name}_stats"] = _stats(values)
    for name, values in summary["untrained"].items():
        if np.ndim(values) == 1:
            row[f"untrained_{name}_stats"] = _stats(values)
    reached = [
        _steps_to_threshold(summary["curve_steps"], curve, LOSS_THRESHOLD) for curve in summary["curves"]
    ]
    row["steps_to_loss_below_1e-2"] = reached
    row["steps_to_loss_below_1e-2_stats"] = _stats(reached)
    row["curve_steps"] = summary["curve_steps"]
    row["curves"] = summary["curves"]
    if "probes" in summary:
        row["probes"] = summary["probes"]
    row["diverged"] = summary["diverged"]
    row["wall_time_s"] = summary["wall_time_s"]
    row["compile_s"] = summary["timings"]["compile_s"]
    row["train_s"] = summary["timings"]["train_loop_s"]
    return row


def run_sweep(
    config: Any,
    workdir: str | pathlib.Path,
    sweep: dict[str, Sequence[Any]] | Sequence[dict[str, Any]],
    seeds: Sequence[int],
    *,
    metric: str = "final_loss",
    overwrite: bool = False,
    shard: tuple[int, int] | None = None,
    probe_for: Callable[[Any], Callable[[Any], dict]] | None = None,
    log: Any = print,
) -> list[dict]:
    """Trains every cell of `sweep` over `seeds` (with `shard` = (i, n), only the cells whose
    index is i mod n); skips cells already finished, and cells another live process is
    training (each cell trains in cells/<name>/, which the trainer locks).

    Cells the config check refuses are rows with status "skipped" and the reason; cells
    that raise anything else are rows with status "failed", a one-line reason and their
    traceback in cells/<name>.traceback.txt, and the next cell trains. `probe_for(setup)`,
    when given, makes each cell's probe (see `train_seeds`); its values go into the row's
    "probes". Once every cell has a row, whichever process finishes last writes the results
    files. Returns the rows of the finished cells; raises CellsFailed (after the results are
    written) when any of this launch's cells failed, Preempted when a signal stopped it.
    """
    base = to_dict(config)
    cells = grid(sweep)
    workdir = pathlib.Path(workdir)
    # Cells may be added to a sweep later; the base config and the seeds may not change.
    prepare_workdir(
        workdir,
        {"config": base, "seeds": list(seeds)},
        overwrite=overwrite,
        config_name="sweep.json",
        resumable=(),
        outputs=SWEEP_OUTPUTS,
    )
    cell_dir = workdir / "cells"
    cell_dir.mkdir(exist_ok=True)
    mine = [i for i in range(len(cells)) if shard is None or i % shard[1] == shard[0]]
    stop = StopSignals().install()  # SIGTERM/SIGINT: the running cell checkpoints and the sweep stops
    try:
        runner = _Cells(base, seeds, cell_dir, metric, stop, log, probe_for)
        for i in mine:
            if stop.received is not None:
                raise SweepStopped(stop.received, workdir)
            runner.run(cells[i], f"[{i + 1}/{len(cells)}]")
    finally:
        stop.restore()
    rows = _collect_results(workdir, cells, metric, log)
    names = {cell_name(cells[i]) for i in mine}
    failed = [row for row in rows if row["status"] == "failed" and cell_name(row["cell"]) in names]
    if failed:
        raise CellsFailed(failed, rows, len(cells), workdir)
    return rows


@dataclasses.dataclass
class _Cells:
    """How the cells of one sweep launch are trained."""

    base: dict
    seeds: Sequence[int]
    directory: pathlib.Path  # the sweep's cells/
    metric: str
    stop: StopSignals
    log: Any
    probe_for: Callable[[Any], Callable[[Any], dict]] | None = None

    def run(self, cell: dict, tag: str) -> None:
        """Trains `cell` into cells/<name>/ (resuming from its checkpoint) and writes its row to
        cells/<name>.json, unless it is finished (done or skipped) or another live process holds
        its lock. A cell that failed before is tried again."""
        name = cell_name(cell)
        path = self.directory / f"{name}.json"
        previous = _read_row(path)
        if previous is not None and previous["status"] != "failed":
            self.log(f"{tag} {name}: done before, skipped")
            return
        if previous is not None:
            self.log(f"{tag} {name}: failed before ({previous['reason']}), trying again")
        try:
            row = self.row(cell, tag)
        except WorkdirBusyError:  # the trainer holds each cell's workdir lock
            self.log(f"{tag} {name}: being trained by another process, left to it")
            return
        if row["status"] != "failed":
            (self.directory / f"{name}.traceback.txt").unlink(missing_ok=True)
        write_json(path, row)

    def row(self, cell: dict, tag: str) -> dict:
        """The results row of a cell: trained over the seeds, skipped with the config check's
        reason, or failed with what it raised (its traceback written beside the row)."""
        name, stop = cell_name(cell), self.stop
        try:
            cell_config = apply_overrides(self.base, cell)
            setup = build_setup(cell_config)
            probe = None if self.probe_for is None else self.probe_for(setup)
            result = train_seeds(
                cell_config, self.seeds, setup=setup, workdir=self.directory / name, stop=stop, probe=probe
            )
        except (Preempted, DiskFullError, WorkdirBusyError):
            raise  # a signal, a full disk, another process: the sweep stops or leaves the cell
        except ConfigError as error:
            if not isinstance(error, (TaskError, WorkdirError)):
                self.log(f"{tag} {name}: skipped ({error})")
                return {"cell": cell, "status": "skipped", "reason": str(error)}
            return self.failed(cell, tag, error)
        except Exception as error:  # noqa: BLE001 - one cell's failure is its row; the sweep goes on
            return self.failed(cell, tag, error)
        row = summarize(cell, result)
        value = row.get(f"{self.metric}_stats", row["final_loss_stats"])["mean"]
        seconds = row["wall_time_s"]
        self.log(
            f"{tag} {name}: {self.metric} {value:.4g} (mean of {len(self.seeds)} seeds), {seconds:.1f} s"
        )
        return row

    def failed(self, cell: dict, tag: str, error: Exception) -> dict:
        """The row of a cell that raised `error`; its traceback goes to cells/<name>.traceback.txt."""
        name = cell_name(cell)
        if isinstance(error, ConfigError):  # a TaskError or WorkdirError: it names the task or the file
            reason = " ".join(str(error).split())
        else:
            lines = str(error).strip().splitlines()
            reason = type(error).__name__ + (f": {lines[0]}" if lines else "")
        path = self.directory / f"{name}.traceback.txt"
        text = "".join(traceback.format_exception(error))
        write_atomic(path, lambda f: f.write(text))
        self.log(f"{tag} {name}: failed ({reason}); traceback in {path}")
        return {"cell": cell, "status": "failed", "reason": reason, "traceback": str(path)}


def _read_row(path: pathlib.Path) -> dict | None:
    """A finished cell's row, or None when there is none (or it is damaged: the cell is run again,
    its checkpoints make that quick)."""
    try:
        row = read_json(path)
    except WorkdirError:
        return None
    return row if isinstance(row, dict) and "status" in row and "cell" in row else None


def _collect_results(workdir: pathlib.Path, cells: list[dict], metric: str, log: Any) -> list[dict]:
    """The finished cells' rows; the results files once all are finished (one writer at a time)."""
    paths = [workdir / "cells" / f"{cell_name(cell)}.json" for cell in cells]
    rows = [row for row in map(_read_row, paths) if row is not None]
    if len(rows) < len(cells):
        log(f"{len(cells) - len(rows)} of {len(cells)} cells not finished yet; results when they are")
        return rows
    lock = WorkdirLock(workdir)
    try:
        lock.acquire()
    except WorkdirBusyError:
        log("another process is writing the results")
        return rows
    try:
        write_sweep_results(workdir, rows, metric)
    finally:
        lock.release()
    return rows
