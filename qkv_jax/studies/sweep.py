"""Sweeps: a grid of config overrides, each cell trained over several seeds.

A sweep workdir holds:
  sweep.json             the base config, the cells and the seeds (a re-run with
                         other settings is refused unless `overwrite`)
  cells/<cell>.json      one finished cell; a re-run skips it
  results.json / .csv    a row per cell: overrides, per-seed final loss and
                         metrics, mean/std/min/max, wall time (or the reason a
                         cell was skipped)
  results.md             the table
  <metric>_vs_<field>.png, <metric>_heatmap.png
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from qkv_jax.studies.grid import apply_overrides, cell_name, grid
from qkv_jax.studies.results import write_sweep_results
from qkv_jax.training.preemption import StopSignals
from qkv_jax.training.run import train_seeds
from qkv_jax.training.setup import build_setup, to_dict
from qkv_jax.training.validate import ConfigError
from qkv_jax.training.workdir import WorkdirBusyError, WorkdirLock, prepare_workdir, write_json

__all__ = ["LOSS_THRESHOLD", "run_sweep", "summarize"]

LOSS_THRESHOLD = 1e-2  # "converged" for the steps-to-threshold column
SWEEP_OUTPUTS = ("sweep.json", "cells", "results.json", "results.csv", "results.md")


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

    Invalid cells (the config check fails) are rows with status "skipped" and
    the reason. `probe_for(setup)`, when given, makes each cell's probe (see
    `train_seeds`); its values go into the row's "probes". Once every cell is
    finished, whichever process finishes last writes the results files.
    Returns the rows of the finished cells.
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
            runner.run(cells[i], f"[{i + 1}/{len(cells)}]")
    finally:
        stop.restore()
    return _collect_results(workdir, cells, metric, log)


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
        cells/<name>.json, unless it is finished or another live process holds its lock."""
        name = cell_name(cell)
        path = self.directory / f"{name}.json"
        if path.exists():
            self.log(f"{tag} {name}: done before, skipped")
            return
        try:
            row = self.row(cell, tag)
        except WorkdirBusyError:  # the trainer holds each cell's workdir lock
            self.log(f"{tag} {name}: being trained by another process, left to it")
            return
        write_json(path, row)

    def row(self, cell: dict, tag: str) -> dict:
        """The results row of a cell: trained over the seeds, or skipped with the config check's reason."""
        name = cell_name(cell)
        try:
            cell_config = apply_overrides(self.base, cell)
            setup = build_setup(cell_config)
        except ConfigError as error:
            self.log(f"{tag} {name}: skipped ({error})")
            return {"cell": cell, "status": "skipped", "reason": str(error)}
        probe = None if self.probe_for is None else self.probe_for(setup)
        directory = self.directory / name
        result = train_seeds(
            cell_config, self.seeds, setup=setup, workdir=directory, stop=self.stop, probe=probe
        )
        row = summarize(cell, result)
        value = row.get(f"{self.metric}_stats", row["final_loss_stats"])["mean"]
        seconds = row["wall_time_s"]
        self.log(
            f"{tag} {name}: {self.metric} {value:.4g} (mean of {len(self.seeds)} seeds), {seconds:.1f} s"
        )
        return row


def _collect_results(workdir: pathlib.Path, cells: list[dict], metric: str, log: Any) -> list[dict]:
    """The finished cells' rows; the results files once all are finished (one writer at a time)."""
    paths = [workdir / "cells" / f"{cell_name(cell)}.json" for cell in cells]
    rows = [json.loads(path.read_text()) for path in paths if path.exists()]
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
