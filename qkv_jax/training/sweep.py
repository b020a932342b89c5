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

import copy
import csv
import dataclasses
import itertools
import json
import math
import pathlib
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from qkv_jax.training.preemption import StopSignals
from qkv_jax.training.seeds import train_seeds
from qkv_jax.training.task import build_setup, to_dict
from qkv_jax.training.validate import ConfigError, get_field
from qkv_jax.training.workdir import WorkdirBusyError, WorkdirLock, prepare_workdir, write_json

__all__ = [
    "grid",
    "cell_name",
    "apply_overrides",
    "parse_sweep_arg",
    "parse_shard",
    "run_sweep",
    "summarize",
    "swept_fields",
    "format_value",
]

LOSS_THRESHOLD = 1e-2  # "converged" for the steps-to-threshold column
SWEEP_OUTPUTS = ("sweep.json", "cells", "results.json", "results.csv", "results.md")


def grid(sweep: dict[str, Sequence[Any]] | Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cells of a sweep: the cartesian product of {field: values}, or an explicit list."""
    if isinstance(sweep, dict):
        fields = list(sweep)
        return [dict(zip(fields, values, strict=True)) for values in itertools.product(*sweep.values())]
    return [dict(cell) for cell in sweep]


def cell_name(cell: dict[str, Any]) -> str:
    """'model.d_k=4,model.num_heads=2' made safe as a file name."""
    text = ",".join(f"{field}={value}" for field, value in cell.items())
    return re.sub(r"[^A-Za-z0-9_.,=+-]", "_", text) or "base"


def apply_overrides(config: dict, cell: dict[str, Any]) -> dict:
    """A copy of `config` with `cell`'s fields set; unknown fields are a ConfigError."""
    config = copy.deepcopy(config)
    for field, value in cell.items():
        *parents, leaf = field.split(".")
        section = config
        for part in parents:
            if not isinstance(section.get(part), dict):
                raise ConfigError(f"{field}: no such config field")
            section = section[part]
        if leaf not in section:
            raise ConfigError(f"{field}: no such config field")
        section[leaf] = value
    return config


def parse_sweep_arg(text: str, config: dict) -> tuple[str, list[Any]]:
    """'model.d_k=2,4,8' -> ('model.d_k', [2, 4, 8]), typed like the config field."""
    if "=" not in text:
        raise ConfigError(f"--sweep {text!r}: expected field=value1,value2,...")
    field, values = text.split("=", 1)
    current = get_field(config, field)
    kind = type(current)

    def convert(raw: str) -> Any:
        raw = raw.strip()
        try:
            if kind is bool:
                if raw.lower() not in ("true", "false"):
                    raise ValueError
                return raw.lower() == "true"
            if kind is int:
                return int(raw)
            if kind is float:
                return float(raw)
        except ValueError:
            raise ConfigError(f"--sweep {field}={raw!r}: not a {kind.__name__}") from None
        if current is None:  # a placeholder field: guess int, then float, then string
            for parse in (int, float):
                try:
                    return parse(raw)
                except ValueError:
                    pass
        return raw

    parsed = [convert(v) for v in values.split(",") if v.strip()]
    if not parsed:
        raise ConfigError(f"--sweep {text!r}: no values")
    return field, parsed


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """'I/N' -> (I, N), with 0 <= I < N; None stays None."""
    if text is None:
        return None
    index, _, count = text.partition("/")
    try:
        shard = int(index), int(count)
    except ValueError:
        raise ConfigError(f"--shard={text!r}: expected I/N, e.g. 0/4") from None
    if not 0 <= shard[0] < shard[1]:
        raise ConfigError(f"--shard={text!r}: needs 0 <= I < N")
    return shard


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


def summarize(cell: dict[str, Any], result: dict) -> dict[str, Any]:
    """The results row of a finished cell."""
    row: dict[str, Any] = {"cell": cell, "status": "done", "seeds": result["seeds"]}
    row["final_loss"] = result["final_loss"]
    row["final_loss_stats"] = _stats(result["final_loss"])
    for name, values in result["metrics"].items():
        if np.ndim(values) == 1:  # one scalar per seed
            row[f"eval_{name}"] = values
            row[f"eval_{name}_stats"] = _stats(values)
    for name, values in result["untrained_metrics"].items():
        if np.ndim(values) == 1:
            row[f"untrained_eval_{name}_stats"] = _stats(values)
    reached = [
        _steps_to_threshold(result["curve_steps"], curve, LOSS_THRESHOLD) for curve in result["curves"]
    ]
    row["steps_to_loss_below_1e-2"] = reached
    row["steps_to_loss_below_1e-2_stats"] = _stats(reached)
    row["curve_steps"] = result["curve_steps"]
    row["curves"] = result["curves"]
    if "probes" in result:
        row["probes"] = result["probes"]
    row["diverged"] = result["diverged"]
    row["wall_time_s"] = result["wall_time_s"]
    row["compile_s"] = result["compile_s"]
    row["train_s"] = result["train_s"]
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
    training (each cell is claimed with a `WorkdirLock` on cells/<name>/).

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
        (self.directory / name).mkdir(exist_ok=True)
        lock = WorkdirLock(self.directory / name)
        try:
            lock.acquire()
        except WorkdirBusyError:
            self.log(f"{tag} {name}: being trained by another process, left to it")
            return
        try:
            path = self.directory / f"{name}.json"
            if path.exists():
                self.log(f"{tag} {name}: done before, skipped")
                return
            write_json(path, self.row(cell, tag))
        finally:
            lock.release()

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
        write_results(workdir, rows, metric)
    finally:
        lock.release()
    return rows


def swept_fields(rows: list[dict]) -> list[str]:
    """The fields the rows' cells set, in first-seen order."""
    fields: list[str] = []
    for row in rows:
        fields += [f for f in row["cell"] if f not in fields]
    return fields


def format_value(value: Any) -> str:
    """A table entry: floats to 4 significant digits."""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def write_results(workdir: pathlib.Path, rows: list[dict], metric: str) -> None:
    """results.json, results.csv, results.md, results.html (each cell linking to its
    cells/<cell>/report.html when `experiments.report` has written one) and the plots."""
    from qkv_jax.training.explorer import write_sweep_page

    write_json(workdir / "results.json", {"metric": metric, "rows": rows})
    pages = {cell_name(row["cell"]): f"cells/{cell_name(row['cell'])}/report.html" for row in rows}
    write_sweep_page(
        workdir / "results.html", rows, metric, {k: v for k, v in pages.items() if (workdir / v).exists()}
    )
    fields = swept_fields(rows)
    metrics = sorted({k[: -len("_stats")] for row in rows for k in row if k.endswith("_stats")})
    header = fields + ["status", "reason", "num_seeds", "wall_time_s"]
    header += [f"{m}_{s}" for m in metrics for s in ("mean", "std", "min", "max")]
    header += [f"{metric}_per_seed"]
    with open(workdir / "results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for row in rows:
            stats = [
                row.get(f"{m}_stats", {}).get(s, "") for m in metrics for s in ("mean", "std", "min", "max")
            ]
            per_seed = ";".join(format_value(v) for v in row.get(metric, []))
            writer.writerow(
                [row["cell"].get(f, "") for f in fields]
                + [
                    row["status"],
                    row.get("reason", ""),
                    len(row.get("seeds", [])),
                    row.get("wall_time_s", ""),
                ]
                + stats
                + [per_seed]
            )
    (workdir / "results.md").write_text(results_table(rows, metric) + "\n")
    plot_results(workdir, rows, metric)


def results_table(rows: list[dict], metric: str, extra: Sequence[str] = ()) -> str:
    """A markdown table: one row per cell, `metric` mean +- std [min, max] and extras."""
    fields = swept_fields(rows)
    columns = [metric, *extra]
    lines = [
        "| "
        + " | ".join(fields + [f"{c} mean ± std [min, max]" for c in columns] + ["seeds", "time (s)"])
        + " |",
        "|" + "---|" * (len(fields) + len(columns) + 2),
    ]
    for row in rows:
        cells = [format_value(row["cell"].get(f, "")) for f in fields]
        if row["status"] != "done":
            cells += [f"skipped: {row['reason']}"] + [""] * (len(columns) + 1)
        else:
            for column in columns:
                s = row.get(f"{column}_stats")
                cells.append(
                    "-"
                    if s is None
                    else f"{format_value(s['mean'])} ± {format_value(s['std'])} "
                    f"[{format_value(s['min'])}, {format_value(s['max'])}]"
                )
            cells += [str(len(row["seeds"])), f"{row['wall_time_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_results(workdir: pathlib.Path, rows: list[dict], metric: str) -> list[pathlib.Path]:
    """`metric` against the first swept field (a line per value of the second) and,
    with two or more fields, a heatmap over the first two."""
    from qkv_jax.plots import plot_sweep_heatmap, plot_sweep_lines

    fields = swept_fields(rows)
    done = [r for r in rows if r["status"] == "done"]
    if not fields or not done:
        return []

    def value(row):
        return row.get(f"{metric}_stats", row["final_loss_stats"])

    x_field = fields[0]
    series_field = fields[1] if len(fields) > 1 else None
    paths = [
        plot_sweep_lines(
            [
                (r["cell"][x_field], r["cell"].get(series_field) if series_field else None, value(r))
                for r in done
            ],
            x_field,
            series_field,
            metric,
            workdir / f"{metric}_vs_{x_field.split('.')[-1]}.png",
        )
    ]
    if series_field:
        cells = {(r["cell"][x_field], r["cell"][series_field]): value(r)["mean"] for r in done}
        xs = sorted({r["cell"][x_field] for r in rows}, key=_sort_key)
        ys = sorted({r["cell"][series_field] for r in rows}, key=_sort_key)
        grid_values = np.array([[cells.get((x, y), np.nan) for x in xs] for y in ys], dtype=float)
        paths.append(
            plot_sweep_heatmap(
                grid_values, xs, ys, x_field, series_field, metric, workdir / f"{metric}_heatmap.png"
            )
        )
    return paths


def _sort_key(value: Any) -> tuple:
    return (0, value, "") if isinstance(value, (int, float)) else (1, 0, str(value))
