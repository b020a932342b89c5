"""What sweeps and studies write: results files, tables, plots and explorer pages.

A sweep's workdir (see `studies.sweep`) gets results.json, .csv, .md and
.html (`write_sweep_results`), with `<metric>_vs_<field>.png` and a heatmap;
`report_sweep` adds loss_curves.png and an explorer page per cell. A study
writes results.json, results.md and `<study>.png` (`write_study_results`),
each table and plot from the study's own `Study` entry.
"""

from __future__ import annotations

import csv
import dataclasses
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from qkv_jax.report.explorer import format_value, swept_fields, write_sweep_page
from qkv_jax.report.run import write_explorer_page
from qkv_jax.training.checkpoints import NoCheckpointError, read_params
from qkv_jax.training.compiled import run_compiled
from qkv_jax.training.loop import seed_keys
from qkv_jax.training.setup import build_setup
from qkv_jax.training.validate import ConfigError
from qkv_jax.training.workdir import read_json, write_atomic, write_json
from studies.grid import apply_overrides, cell_name

__all__ = [
    "Study",
    "write_study_results",
    "write_sweep_results",
    "results_table",
    "plot_results",
    "report_sweep",
]


@dataclasses.dataclass(frozen=True)
class Study:
    """One study: how it runs and how its results are shown.

    `run(base, workdir, options) -> results` trains and measures (`base`, a config
    as a plain dict; `options`, the launcher's: seeds, pretrained, cells) and
    returns plain data with a "study" key; `table(results)` gives markdown lines
    and `plot(results, axes)` draws on two matplotlib axes. With `uses_cells`, the
    study trains the cells of the config file's `get_sweep` (`options["cells"]`);
    the others get None there and run on any variant of the config file.
    """

    title: str
    run: Callable[[dict, pathlib.Path, dict], dict]
    table: Callable[[dict], list[str]]
    plot: Callable[[dict, Any], None]
    uses_cells: bool = False


def write_study_results(workdir: pathlib.Path, results: dict, command: str, study: Study) -> dict:
    """Writes results.json, results.md and <study>.png into `workdir`; returns the
    record written to results.json (plain data: rows, markdown table, command)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = {**results, "command": command, "table": study.table(results)}
    workdir = pathlib.Path(workdir)
    write_json(workdir / "results.json", record)
    markdown = [f"# {study.title}", "", f"Regenerate: `{command}`", "", *record["table"]]
    write_atomic(workdir / "results.md", lambda f: f.write("\n".join(markdown) + "\n"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    study.plot(results, axes)
    fig.tight_layout()
    fig.savefig(workdir / f"{results['study']}.png", dpi=100)
    plt.close(fig)
    return record


def write_sweep_results(workdir: pathlib.Path, rows: list[dict], metric: str) -> None:
    """results.json, results.csv, results.md, results.html (each cell linking to its
    cells/<cell>/report.html when `experiments.report` has written one) and the plots. Each
    row has a status (done, skipped or failed) and, unless done, the reason."""
    write_json(workdir / "results.json", {"metric": metric, "rows": rows})

    def page(cell: dict) -> str | None:
        link = f"cells/{cell_name(cell)}/report.html"
        return link if (workdir / link).exists() else None

    write_sweep_page(workdir / "results.html", rows, metric, page)
    fields = swept_fields(rows)
    metrics = sorted({k[: -len("_stats")] for row in rows for k in row if k.endswith("_stats")})
    header = fields + ["status", "reason", "num_seeds", "wall_time_s"]
    header += [f"{m}_{s}" for m in metrics for s in ("mean", "std", "min", "max")]
    header += [f"{metric}_per_seed"]

    def write_csv(file: Any) -> None:
        writer = csv.writer(file)
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

    write_atomic(workdir / "results.csv", write_csv)
    write_atomic(workdir / "results.md", lambda f: f.write(results_table(rows, metric) + "\n"))
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
            cells += [f"{row['status']}: {row['reason']}"] + [""] * (len(columns) + 1)
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


def report_sweep(workdir: str | pathlib.Path, prompt: str | None = None) -> dict:
    """loss_curves.png (geometric mean over seeds, one line per cell), the table plots, each
    trained cell's explorer page (its first seed, cells/<cell>/report.html) and results.html."""
    from qkv_jax.plots import plot_loss_curves

    workdir = pathlib.Path(workdir)
    results = read_json(workdir / "results.json")
    if results is None:
        raise ConfigError(
            f"workdir={str(workdir)!r}: no results.json yet (the sweep writes it once every cell is "
            "finished); run the sweep's command to finish it"
        )
    sweep = read_json(workdir / "sweep.json")
    curves, pages = {}, 0
    for row in results["rows"]:
        if row["status"] == "done":
            losses = np.maximum(np.asarray(row["curves"], dtype=float), 1e-30)
            curves[cell_name(row["cell"])] = (
                row["curve_steps"],
                np.exp(np.log(losses).mean(axis=0)).tolist(),
            )
            pages += _cell_page(workdir / "cells" / cell_name(row["cell"]), sweep, row["cell"], prompt)
    plot_loss_curves(curves, workdir / "loss_curves.png", title="training loss, geometric mean over seeds")
    write_sweep_results(workdir, results["rows"], results["metric"])
    return {"cells": len(results["rows"]), "plotted": len(curves), "pages": pages}


def _cell_page(directory: pathlib.Path, sweep: dict, cell: dict, prompt: str | None) -> bool:
    """Writes a sweep cell's report.html from its checkpoints (the first seed's parameters);
    False when the task has nothing to explore or the cell kept no usable checkpoint."""
    config = {**apply_overrides(sweep["config"], cell), "seed": sweep["seeds"][0]}
    setup = build_setup(config)
    if setup.inspect is None or setup.explorer_inputs is None:
        return False
    try:
        saved = read_params(directory)
    except NoCheckpointError:
        return False
    first_seed = lambda params: jax.tree.map(lambda x: x[0], params)
    keys = seed_keys(config["seed"])
    # Compiled as the trainer compiles its evaluation (qkv_jax.training.compiled).
    params = first_seed(saved.tree)
    metrics, _ = jax.device_get(run_compiled(setup.evaluate, params, keys["eval"], setup.data, config=config))
    untrained = jax.jit(setup.init)(keys["init"])
    write_explorer_page(directory, config, setup, untrained, first_seed, metrics, prompt)
    return True
