"""Reading a finished run or sweep: pictures, head diagnostics, attention maps, explorer pages.

report_run(workdir)      loss.png, the experiment's attention pictures of the
                         newest checkpoint, report.json (evaluation metrics
                         with per-head diagnostics), head_ablation.png when the
                         task measures it (eval_head_ablation), and report.html,
                         the explorer page (qkv_jax/training/explore.py)
report_sweep(workdir)    loss_curves.png (mean over seeds per cell), the
                         sweep's table plots, each cell's report.html (its
                         first seed) and results.html linking to them
inspect_run(workdir, text)  attention_maps.png: every layer and head of the
                         newest checkpoint on one input
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qkv_jax.training.checkpoints import Checkpoints, NoCheckpointError, checkpoint_tree, load_train_state
from qkv_jax.training.explore import run_page_data
from qkv_jax.training.loop import init_train_state, make_optimizer, seed_keys
from qkv_jax.training.task import Setup, build_setup, to_dict
from qkv_jax.training.validate import ConfigError
from qkv_jax.training.workdir import read_metrics, write_json

__all__ = ["load_checkpoint", "load_run", "report_run", "report_sweep", "inspect_run", "is_sweep"]


def is_sweep(workdir: str | pathlib.Path) -> bool:
    return (pathlib.Path(workdir) / "sweep.json").exists()


def _template(config: dict, setup: Setup) -> Any:
    """A freshly initialised TrainState of the run (the untrained parameters, and the structure,
    shapes and shardings checkpoints restore into), on this process's devices."""
    tx = make_optimizer(config["train"])
    return jax.jit(lambda key: init_train_state(setup, tx, key))(seed_keys(config["seed"])["init"])


def _restore(workdir: str | pathlib.Path, config: dict, setup: Setup) -> tuple[int, Any]:
    """(step, TrainState) of the newest usable checkpoint, on this process's devices."""
    return load_train_state(workdir, _template(config, setup))


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


def report_run(workdir: str | pathlib.Path, prompt: str | None = None) -> dict:
    """Pictures, head diagnostics and the explorer page of a run (`prompt`: one more input the
    page shows, for tasks that read text); returns report.json's content."""
    from qkv_jax.plots import plot_head_ablation, plot_loss_curves

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
    if "head_ablation" in metrics:
        plot_head_ablation(
            metrics["head_ablation"],
            workdir / "head_ablation.png",
            title=f"validation loss increase with each head zeroed\n(checkpoint step {step})",
        )
    write_json(workdir / "report.json", report)
    if setup.inspect is not None and setup.report_inputs is not None:
        template = _template(config, setup)
        report["page"] = write_explorer_page(workdir, config, setup, template, lambda p: p, metrics, prompt)
    return report


def write_explorer_page(
    workdir: pathlib.Path,
    config: dict,
    setup: Setup,
    template: Any,
    params_of: Any,
    metrics: dict,
    prompt: str | None = None,
) -> dict:
    """workdir/report.html for the untrained parameters (`params_of(template.params)`) and the
    checkpoints in workdir/checkpoints; returns the page's data."""
    from qkv_jax.training.explore import saved_params
    from qkv_jax.training.explorer import write_run_page

    frames, saved = saved_params(workdir / "checkpoints", template, params_of)
    frames = [(0, params_of(template.params))] + [f for f in frames if f[0] != 0]
    notes = [f"the untrained parameters and {len(frames) - 1} of the {saved} checkpoints kept"]
    keep = config["train"].get("keep_checkpoints", 3)
    if keep and saved >= keep:  # older checkpoints may have been deleted
        notes.append(
            f"the run kept its newest {keep} checkpoints; train with "
            "--config.train.keep_checkpoints=0 to keep every one and follow the whole training here"
        )
    data = run_page_data(config, setup, frames, metrics, workdir, prompt, notes)
    write_run_page(workdir / "report.html", data)
    return data


def report_sweep(workdir: str | pathlib.Path, prompt: str | None = None) -> dict:
    """loss_curves.png (geometric mean over seeds, one line per cell), the table plots, each
    trained cell's explorer page (its first seed, cells/<cell>/report.html) and results.html."""
    from qkv_jax.plots import plot_loss_curves
    from qkv_jax.training.sweep import cell_name, write_results

    workdir = pathlib.Path(workdir)
    results = json.loads((workdir / "results.json").read_text())
    sweep = json.loads((workdir / "sweep.json").read_text())
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
    write_results(workdir, results["rows"], results["metric"])
    return {"cells": len(results["rows"]), "plotted": len(curves), "pages": pages}


def _cell_page(directory: pathlib.Path, sweep: dict, cell: dict, prompt: str | None) -> bool:
    """Writes a sweep cell's report.html from its checkpoints (the first seed's parameters);
    False when the task has nothing to explore or the cell kept no checkpoint."""
    from qkv_jax.training.sweep import apply_overrides

    config = apply_overrides(sweep["config"], cell)
    setup = build_setup(config)
    if setup.inspect is None or setup.report_inputs is None or not (directory / "checkpoints").is_dir():
        return False
    tx = make_optimizer(config["train"])
    keys = jax.vmap(seed_keys)(jnp.asarray(sweep["seeds"]))
    template = jax.jit(jax.vmap(lambda key: init_train_state(setup, tx, key)))(keys["init"])
    first_seed = lambda params: jax.tree.map(lambda x: x[0], params)
    saved = Checkpoints(directory / "checkpoints").all_steps()
    if not saved:
        return False
    restored = Checkpoints(directory / "checkpoints").restore(saved[-1], checkpoint_tree(template))
    params = first_seed(restored["params"]) if restored is not None else first_seed(template.params)
    metrics, _ = jax.device_get(
        jax.jit(setup.evaluate)(params, jax.tree.map(lambda k: k[0], keys["eval"]), setup.data)
    )
    config = {**config, "seed": sweep["seeds"][0]}
    write_explorer_page(directory, config, setup, template, first_seed, metrics, prompt)
    return True


def inspect_run(workdir: str | pathlib.Path, text: str | None = None) -> pathlib.Path:
    """attention_maps.png: each layer's heads on one input, from the newest checkpoint."""
    from qkv_jax.plots import plot_attention_maps

    workdir = pathlib.Path(workdir)
    config, setup, params, step = load_run(workdir)
    if setup.inspect is None:
        raise ConfigError(
            f"task.name={config['task']['name']!r}: this experiment has no attention maps to inspect"
        )
    view = setup.inspect(params, text)
    return plot_attention_maps(
        {layer: np.asarray(w) for layer, w in view.maps.items()},
        view.query_labels,
        view.key_labels,
        workdir / "attention_maps.png",
        title=f"{config.get('experiment', '')}, checkpoint step {step}",
    )
