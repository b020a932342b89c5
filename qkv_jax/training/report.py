"""Reading a finished run or sweep: pictures, head diagnostics, attention maps.

report_run(workdir)      loss.png, the experiment's attention pictures of the
                         newest checkpoint, report.json (evaluation metrics
                         with per-head diagnostics)
report_sweep(workdir)    loss_curves.png (mean over seeds per cell) and the
                         sweep's table plots
inspect_run(workdir, text)  attention_maps.png: every layer and head of the
                         newest checkpoint on one input
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import numpy as np

from qkv_jax.training.checkpoints import NoCheckpointError, checkpoint_tree, load_train_state
from qkv_jax.training.loop import init_train_state, make_optimizer, seed_keys
from qkv_jax.training.task import Setup, build_setup, to_dict
from qkv_jax.training.validate import ConfigError
from qkv_jax.training.workdir import read_metrics, write_json

__all__ = ["load_checkpoint", "load_run", "report_run", "report_sweep", "inspect_run", "is_sweep"]


def is_sweep(workdir: str | pathlib.Path) -> bool:
    return (pathlib.Path(workdir) / "sweep.json").exists()


def _restore(workdir: str | pathlib.Path, config: dict, setup: Setup) -> tuple[int, Any]:
    """(step, TrainState) of the newest usable checkpoint, on this process's devices."""
    tx = make_optimizer(config["train"])
    template = jax.jit(lambda key: init_train_state(setup, tx, key))(seed_keys(config["seed"])["init"])
    return load_train_state(workdir, template)


def load_checkpoint(workdir: str | pathlib.Path, config: Any) -> tuple[int, dict] | None:
    """The newest usable checkpoint of `workdir`, restored for `config`'s model on
    this process's devices: `(step, {"step", "params", "opt_state"})`, or None."""
    config = to_dict(config)
    setup = build_setup(config)
    try:
        step, state = _restore(workdir, config, setup)
    except NoCheckpointError:
        return None
    return step, checkpoint_tree(state)


def load_run(workdir: str | pathlib.Path) -> tuple[dict, Setup, Any, int]:
    """(config, setup, trained params, step) of the newest checkpoint in `workdir`."""
    workdir = pathlib.Path(workdir)
    if not (workdir / "config.json").exists():
        raise ConfigError(f"workdir={str(workdir)!r}: no config.json; is it a run's workdir?")
    config = json.loads((workdir / "config.json").read_text())
    setup = build_setup(config)
    try:
        step, state = _restore(workdir, config, setup)
    except NoCheckpointError as error:
        raise ConfigError(str(error)) from None
    return config, setup, state.params, int(step)


def _json(value: Any) -> Any:
    array = np.asarray(value)
    return array.item() if array.ndim == 0 else array.tolist()


def report_run(workdir: str | pathlib.Path) -> dict:
    """Pictures and head diagnostics of a run's newest checkpoint; returns report.json's content."""
    from qkv_jax.plots import plot_loss_curves

    workdir = pathlib.Path(workdir)
    config, setup, params, step = load_run(workdir)
    keys = seed_keys(config["seed"])
    metrics, examples = jax.device_get(jax.jit(setup.evaluate)(params, keys["eval"], setup.data))
    if setup.report is not None:
        setup.report(workdir, "after", examples)
    records = read_metrics(workdir / "metrics.jsonl")
    plot_loss_curves(
        {"training loss": ([r["step"] for r in records], [r["loss"] for r in records])},
        workdir / "loss.png",
        title=f"{config.get('experiment', '')} (checkpoint step {step})",
    )
    report = {"step": step, **{f"eval_{name}": _json(value) for name, value in metrics.items()}}
    write_json(workdir / "report.json", report)
    return report


def report_sweep(workdir: str | pathlib.Path) -> dict:
    """loss_curves.png (geometric mean over seeds, one line per cell) and the table plots."""
    from qkv_jax.plots import plot_loss_curves
    from qkv_jax.training.sweep import cell_name, write_results

    workdir = pathlib.Path(workdir)
    results = json.loads((workdir / "results.json").read_text())
    curves = {}
    for row in results["rows"]:
        if row["status"] == "done":
            losses = np.maximum(np.asarray(row["curves"], dtype=float), 1e-30)
            curves[cell_name(row["cell"])] = (
                row["curve_steps"],
                np.exp(np.log(losses).mean(axis=0)).tolist(),
            )
    plot_loss_curves(curves, workdir / "loss_curves.png", title="training loss, geometric mean over seeds")
    write_results(workdir, results["rows"], results["metric"])
    return {"cells": len(results["rows"]), "plotted": len(curves)}


def inspect_run(workdir: str | pathlib.Path, text: str | None = None) -> pathlib.Path:
    """attention_maps.png: each layer's heads on one input, from the newest checkpoint."""
    from qkv_jax.plots import plot_attention_maps

    workdir = pathlib.Path(workdir)
    config, setup, params, step = load_run(workdir)
    if setup.inspect is None:
        raise ConfigError(
            f"task.name={config['task']['name']!r}: this experiment has no attention maps to inspect"
        )
    maps, query_labels, key_labels = setup.inspect(params, text)
    return plot_attention_maps(
        {layer: np.asarray(w) for layer, w in maps.items()},
        query_labels,
        key_labels,
        workdir / "attention_maps.png",
        title=f"{config.get('experiment', '')}, checkpoint step {step}",
    )
