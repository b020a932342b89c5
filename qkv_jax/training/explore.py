"""The data of a run's explorer page (report.html): its attention at every saved checkpoint.

`run_page_data` gathers, for the inputs the task proposes (`Setup.report_inputs`:
for the flag task fresh examples with the flag marked, for the char LM a
prompt and validation text), every layer's and head's attention weights
(`Setup.inspect`) at the untrained parameters and at each saved checkpoint,
with the head diagnostics of the newest, the loss curves and the config, in
the schema `qkv_jax.training.explorer.write_run_page` renders.

At most `MAX_CHECKPOINTS` checkpoints are shown (the first, the last and
evenly spaced ones between); the page says so when it leaves any out.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from qkv_jax.training.checkpoints import Checkpoints, checkpoint_tree
from qkv_jax.training.task import Setup
from qkv_jax.training.workdir import read_metrics

__all__ = ["MAX_CHECKPOINTS", "saved_params", "run_page_data"]

MAX_CHECKPOINTS = 12


def _spread(steps: Sequence[int], most: int) -> list[int]:
    """At most `most` of `steps`: the first, the last and evenly spaced ones between."""
    if len(steps) <= most:
        return list(steps)
    picked = np.unique(np.linspace(0, len(steps) - 1, most).round().astype(int))
    return [steps[i] for i in picked]


def saved_params(
    directory: str | pathlib.Path, template: Any, params_of: Callable[[Any], Any]
) -> tuple[list[tuple[int, Any]], int]:
    """([(step, params)] of up to MAX_CHECKPOINTS checkpoints in `directory`, oldest first, the
    number saved). `template` is the train state they restore into; `params_of(state)` picks
    the parameters to show (for a sweep cell's vmapped seeds, the first seed's)."""
    checkpoints = Checkpoints(directory, max_to_keep=None)
    try:
        steps = checkpoints.all_steps()
        frames = []
        for step in _spread(steps, MAX_CHECKPOINTS):
            state = checkpoints.restore(step, checkpoint_tree(template))
            if state is not None:
                frames.append((step, params_of(state["params"])))
    finally:
        checkpoints.close()
    return frames, len(steps)


def _curves(workdir: pathlib.Path) -> dict:
    """The training loss of a run's metrics.jsonl, or per seed of a sweep cell's curves.jsonl."""
    if (workdir / "metrics.jsonl").exists():
        return {"training loss": [[r["step"], r["loss"]] for r in read_metrics(workdir / "metrics.jsonl")]}
    records = read_metrics(workdir / "curves.jsonl")  # {"step", "loss": [per seed]}
    seeds = len(records[0]["loss"]) if records else 0
    return {f"training loss, seed #{i}": [[r["step"], r["loss"][i]] for r in records] for i in range(seeds)}


def _diagnostics(metrics: dict) -> dict:
    """The table of per-head statistics (`head_*` metrics: `[N]` or `[layers, N]`)."""
    columns = sorted(name[len("head_") :] for name in metrics if name.startswith("head_"))
    rows: list[dict] = []
    for name in columns:
        values = np.atleast_2d(np.asarray(metrics[f"head_{name}"], dtype=float))  # (L, N)
        for layer, head in np.ndindex(values.shape):
            if len(rows) <= layer * values.shape[1] + head:
                rows.append({"layer": layer, "head": head})
            rows[layer * values.shape[1] + head][name] = float(values[layer, head])
    return {"columns": columns, "rows": rows}


def run_page_data(
    config: dict,
    setup: Setup,
    frames: list[tuple[int, Any]],
    metrics: dict,
    workdir: str | pathlib.Path,
    prompt: str | None = None,
    notes: Sequence[str] = (),
) -> dict:
    """The explorer page's data (see `qkv_jax.training.explorer`) for `frames` [(step, params)]
    (the untrained parameters first), the newest checkpoint's evaluation `metrics`, and the
    curves of `workdir`'s metrics.jsonl (or a sweep cell's curves.jsonl)."""
    if setup.inspect is None or setup.report_inputs is None:
        raise ValueError(f"task.module={config['task']['module']!r}: the task has no attention to explore")
    inputs = setup.report_inputs(setup.data, prompt)
    checkpoints, views = [], []
    for step, params in frames:
        views = [setup.inspect(params, text) for _, text in inputs]
        attention = [np.stack([np.asarray(w) for w in view.maps.values()]) for view in views]  # [L, N, T, S]
        checkpoints.append({"step": int(step), "attention": attention})
    workdir = pathlib.Path(workdir)
    return {
        "title": str(config.get("experiment", config["task"]["name"])),
        "subtitle": f"{workdir.name}: checkpoint step {frames[-1][0]}",
        "config": config,
        "curves": _curves(workdir),
        "layers": list(views[0].maps),
        "num_heads": int(np.asarray(next(iter(views[0].maps.values()))).shape[0]),
        "examples": [
            {
                "name": name,
                "query_tokens": view.query_labels,
                "key_tokens": view.key_labels,
                "marks": view.marks,
            }
            for (name, _), view in zip(inputs, views, strict=True)
        ],
        "checkpoints": checkpoints,
        "diagnostics": _diagnostics(jax.device_get(metrics)),
        "notes": list(notes),
    }
