"""Reading a finished run: report.json, pictures and report.html, the attention explorer.

report_run(workdir)         loss.png, the experiment's pictures of the newest
                            checkpoint, report.json (evaluation metrics with
                            per-head diagnostics), head_ablation.png when the task
                            measures it (eval_head_ablation), and report.html, the
                            explorer page (`write_explorer_page`)
inspect_run(workdir, text)  attention_maps.png: every layer and head of the
                            newest checkpoint on one input
page_data(source, inputs, frames, metrics)
                            the explorer page's data for any model (`PageSource`):
                            a run's (`run_page_data`) or a Hugging Face checkpoint's
                            (`qkv_jax.report.pretrained`)

The explorer page shows the task's inputs (`Setup.explorer_inputs`: for the
flag task fresh examples with the flag marked, for the char LM a prompt and
validation text) with every layer's and head's attention (`Setup.inspect`) at
the untrained parameters and at each kept checkpoint (at most
`MAX_CHECKPOINTS`: the first, the last and evenly spaced ones between; the page
says so when it leaves any out), the head diagnostics of the newest, the loss
curves, the config and the circuits view (`qkv_jax.report.circuits`: each head's
W_QK and W_OV spectra at the same checkpoints, composition scores, and a patching
heat map for a clean and a corrupted prompt), in the schema
`qkv_jax.report.explorer.write_run_page` renders. Checkpoints are read with
`qkv_jax.training.read_params` (read-only, verified), so a run can be reported
while it trains. A language model with sliding windows or sinks adds columns to
the diagnostics table: each layer's window ("full" for a global layer) and each
head's sink mass.
"""

from __future__ import annotations

import dataclasses
import pathlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from qkv_jax.diagnostics import sink_mass
from qkv_jax.lm import TransformerConfig, TransformerLM, layer_windows
from qkv_jax.report.circuits import PromptReader, circuit_data, patching_data, run_prompts
from qkv_jax.report.explorer import write_run_page
from qkv_jax.training.checkpoints import Checkpoints, NoCheckpointError, read_params
from qkv_jax.training.compiled import run_compiled
from qkv_jax.training.loop import seed_keys
from qkv_jax.training.setup import AttentionView, Setup, build_setup
from qkv_jax.training.validate import ConfigError
from qkv_jax.training.workdir import check_workdir_path, plain, read_json, read_metrics, write_json

__all__ = [
    "MAX_CHECKPOINTS",
    "PageSource",
    "load_run",
    "page_data",
    "report_run",
    "write_explorer_page",
    "inspect_run",
    "is_sweep",
]

MAX_CHECKPOINTS = 12


def is_sweep(workdir: str | pathlib.Path) -> bool:
    return (pathlib.Path(workdir) / "sweep.json").exists()


def load_run(workdir: str | pathlib.Path) -> tuple[dict, Setup, Any, int]:
    """(config, setup, trained params, step) of the newest usable checkpoint in `workdir`."""
    workdir = pathlib.Path(workdir)
    config = read_json(workdir / "config.json")
    if config is None:
        raise ConfigError(f"workdir={str(workdir)!r}: no config.json; is it a run's workdir?")
    setup = build_setup(config)
    untrained = jax.eval_shape(setup.init, seed_keys(config["seed"])["init"])
    try:
        saved = read_params(workdir, like=untrained)
    except NoCheckpointError as error:
        raise ConfigError(f"workdir={str(workdir)!r}: {error}") from None
    return config, setup, saved.tree, saved.step


def report_run(
    workdir: str | pathlib.Path, prompt: str | None = None, patching: tuple[str, str] | None = None
) -> dict:
    """Pictures, head diagnostics and the explorer page of a run (`prompt`: one more input the
    page shows, for tasks that read text; `patching`: (clean, corrupted) prompts for the page's
    patching heat map, see `qkv_jax.report.circuits.patching_data`); returns report.json's
    content."""
    from qkv_jax.plots import plot_head_ablation, plot_loss_curves

    workdir = pathlib.Path(workdir)
    config, setup, params, step = load_run(workdir)
    check_workdir_path(workdir)  # the report is written beside the run: a colleague's may be read-only
    keys = seed_keys(config["seed"])
    # Compiled as the trainer compiled the run's evaluation (on CPU at its
    # train.cpu_optimization_level: see qkv_jax.training.compiled), so the report's metrics are the
    # trainer's.
    metrics, examples = jax.device_get(
        run_compiled(setup.evaluate, params, keys["eval"], setup.data, config=config)
    )
    if setup.save_examples is not None:
        setup.save_examples(workdir, "after", examples)
    records = read_metrics(workdir / "metrics.jsonl")
    plot_loss_curves(
        {"training loss": ([r["step"] for r in records], [r["loss"] for r in records])},
        workdir / "loss.png",
        title=f"{config.get('experiment', '')} (checkpoint step {step})",
    )
    report = {"step": step, **{f"eval_{name}": value for name, value in plain(metrics).items()}}
    if "head_ablation" in metrics:
        plot_head_ablation(
            metrics["head_ablation"],
            workdir / "head_ablation.png",
            title=f"validation loss increase with each head zeroed\n(checkpoint step {step})",
        )
    write_json(workdir / "report.json", report)
    if setup.inspect is not None and setup.explorer_inputs is not None:
        untrained = jax.jit(setup.init)(keys["init"])
        report["page"] = write_explorer_page(
            workdir, config, setup, untrained, lambda p: p, metrics, prompt, patching
        )
    return report


def _spread(steps: Sequence[int], most: int) -> list[int]:
    """At most `most` of `steps`: the first, the last and evenly spaced ones between."""
    if len(steps) <= most:
        return list(steps)
    picked = np.unique(np.linspace(0, len(steps) - 1, most).round().astype(int))
    return [steps[i] for i in picked]


def checkpoint_frames(
    directory: pathlib.Path, params_of: Callable[[Any], Any]
) -> tuple[list[tuple[int, Any]], int]:
    """([(step, params)] of up to MAX_CHECKPOINTS checkpoints in `directory`, oldest first, the
    number saved). `params_of(params)` picks the parameters to show (for a sweep cell's
    vmapped seeds, the first seed's). A checkpoint that a run training at the same time
    deletes while it is read is left out without a warning."""
    if not directory.is_dir():
        return [], 0
    checkpoints = Checkpoints(directory, max_to_keep=None, read_only=True)
    try:
        steps = checkpoints.all_steps()
        frames = []
        for step in _spread(steps, MAX_CHECKPOINTS):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                tree = checkpoints.restore(step, params_only=True)
            if tree is None and not (directory / str(step)).exists():
                continue  # a run training now deleted it (train.keep_checkpoints) while it was read
            for warning in caught:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
            if tree is not None:
                frames.append((step, params_of(tree)))
    finally:
        checkpoints.close()
    return frames, len(steps)


def write_explorer_page(
    workdir: pathlib.Path,
    config: dict,
    setup: Setup,
    untrained: Any,
    params_of: Callable[[Any], Any],
    metrics: dict,
    prompt: str | None = None,
    patching: tuple[str, str] | None = None,
) -> dict:
    """workdir/report.html for the `untrained` parameters and the checkpoints in
    workdir/checkpoints (`params_of` picks what to show of each: the first seed's, say), with a
    patching heat map of the newest for `patching` = (clean, corrupted) prompts; returns the
    page's data."""
    frames, saved = checkpoint_frames(workdir / "checkpoints", params_of)
    if frames:
        # Placed as the restored checkpoints are (on the run's mesh), so that the inspection
        # compiled for them serves the untrained frame too: jit keys on the inputs' placement,
        # and a single-device tree compiled it once more for each input shape.
        place = lambda leaf, restored: jax.device_put(leaf, restored.sharding)
        untrained = jax.tree.map(place, untrained, frames[-1][1])
    frames = [(0, untrained)] + [f for f in frames if f[0] != 0]
    notes = [f"the untrained parameters and {len(frames) - 1} of the {saved} checkpoints kept"]
    keep = config["train"]["keep_checkpoints"]
    if keep and saved >= keep:  # older checkpoints may have been deleted
        notes.append(
            f"the run kept its newest {keep} checkpoints; train with "
            "--config.train.keep_checkpoints=0 to keep every one and follow the whole training here"
        )
    data = run_page_data(config, setup, frames, metrics, workdir, prompt, notes, patching)
    write_run_page(workdir / "report.html", data)
    return data


def _curves(workdir: pathlib.Path) -> dict:
    """The training loss in a run's metrics.jsonl: one curve, or one per seed when the run
    trained several seeds together (a sweep cell: a list of losses per step)."""
    records = read_metrics(workdir / "metrics.jsonl")
    if not records or not isinstance(records[0]["loss"], list):
        return {"training loss": [[r["step"], r["loss"]] for r in records]}
    seeds = len(records[0]["loss"])
    return {f"training loss, seed #{i}": [[r["step"], r["loss"][i]] for r in records] for i in range(seeds)}


def _diagnostics(metrics: dict, variants: dict[str, np.ndarray]) -> dict:
    """The table of per-head statistics (`head_*` metrics: `[N]` or `[layers, N]`), with the
    `variants` columns (`_variant_columns`: each `[layers, N]`, NaN shown as the label "full")."""
    tables = {name[len("head_") :]: metrics[name] for name in metrics if name.startswith("head_")}
    tables = {**tables, **{name: values for name, values in variants.items() if name not in tables}}
    columns = sorted(tables)
    rows: list[dict] = []
    for name in columns:
        values = np.atleast_2d(np.asarray(tables[name], dtype=float))  # (L, N)
        for layer, head in np.ndindex(values.shape):
            if len(rows) <= layer * values.shape[1] + head:
                rows.append({"layer": layer, "head": head})
            value = float(values[layer, head])
            rows[layer * values.shape[1] + head][name] = value if np.isfinite(value) else None
    labels = {"window": "full"} if "window" in variants else {}
    return {"columns": columns, "rows": rows, "labels": labels}


def _variant_columns(model: Any, views: Sequence[Any]) -> dict[str, np.ndarray]:
    """Columns `[layers, N]` a TransformerLM's attention variants add to the diagnostics: with a
    sliding window, each layer's `window` (keys each query sees; NaN for a global layer), and
    with sinks each head's `sink_mass` on the explorer's inputs at the newest checkpoint."""
    config = getattr(model, "config", None)
    if not isinstance(config, TransformerConfig):
        return {}
    columns = {}
    heads = (config.num_layers, config.num_heads)
    windows = layer_windows(config)
    if any(w is not None for w in windows):
        per_layer = np.array([np.nan if w is None else w for w in windows], dtype=float)  # (L,)
        columns["window"] = np.broadcast_to(per_layer[:, None], heads)
    if config.use_sinks:
        per_view = [[sink_mass(np.asarray(w)) for w in view.maps.values()] for view in views]  # [E][L][N]
        columns["sink_mass"] = np.mean(np.asarray(per_view, dtype=float), axis=0)  # (L, N)
    return columns


def run_page_data(
    config: dict,
    setup: Setup,
    frames: list[tuple[int, Any]],
    metrics: dict,
    workdir: str | pathlib.Path,
    prompt: str | None = None,
    notes: Sequence[str] = (),
    patching: tuple[str, str] | None = None,
) -> dict:
    """The explorer page's data (see `qkv_jax.report.explorer`) for `frames` [(step, params)]
    (the untrained parameters first), the newest checkpoint's evaluation `metrics`, the
    curves of `workdir`'s metrics.jsonl (or a sweep cell's curves.jsonl), and the circuits
    view (`qkv_jax.report.circuits`), with a patching heat map of the newest checkpoint for
    `patching` = (clean, corrupted) prompts."""
    if setup.inspect is None or setup.explorer_inputs is None:
        raise ValueError(f"task.module={config['task']['module']!r}: the task has no attention to explore")
    workdir = pathlib.Path(workdir)
    reader = run_prompts(setup.model, workdir) if isinstance(setup.model, TransformerLM) else None
    return page_data(
        PageSource(
            title=str(config.get("experiment", config["task"]["name"])),
            subtitle=f"{workdir.name}: checkpoint step {frames[-1][0]}",
            config=config,
            model=setup.model,
            inspect=setup.inspect,
            curves=_curves(workdir),
            prompts=reader,
        ),
        setup.explorer_inputs(setup.data, prompt),
        frames,
        metrics,
        notes,
        patching,
    )


@dataclasses.dataclass(frozen=True)
class PageSource:
    """What the explorer page shows of one model besides its inputs and parameters: the page's
    `title`, `subtitle` and `config`, the `model` (for the circuits view), `inspect(params,
    text) -> AttentionView`, the loss `curves` ({} for none) and how patching prompts are read
    (`prompts`, None where the model reads no text)."""

    title: str
    subtitle: str
    config: dict
    model: Any
    inspect: Callable[[Any, str | None], AttentionView]
    curves: dict
    prompts: PromptReader | None


def page_data(
    source: PageSource,
    inputs: Sequence[tuple[str, str]],
    frames: list[tuple[int, Any]],
    metrics: dict,
    notes: Sequence[str] = (),
    patching: tuple[str, str] | None = None,
) -> dict:
    """The explorer page's data for `source` on `inputs` [(name, text)] at `frames` [(step,
    params)] (oldest first), with the head diagnostics in `metrics` (`head_*` entries) and a
    patching heat map of the newest frame for `patching` = (clean, corrupted) prompts."""
    checkpoints, views = [], []
    for step, params in frames:
        views = [source.inspect(params, text) for _, text in inputs]
        attention = [np.stack([np.asarray(w) for w in view.maps.values()]) for view in views]  # [L, N, T, S]
        checkpoints.append({"step": int(step), "attention": attention})
    return {
        "title": source.title,
        "subtitle": source.subtitle,
        "config": source.config,
        "curves": source.curves,
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
        "diagnostics": _diagnostics(jax.device_get(metrics), _variant_columns(source.model, views)),
        "notes": list(notes),
        "circuits": {
            **circuit_data(source.model, frames),
            **patching_data(source.model, frames[-1], patching, source.prompts),
        },
    }


def inspect_run(workdir: str | pathlib.Path, text: str | None = None) -> pathlib.Path:
    """attention_maps.png: each layer's heads on one input, from the newest checkpoint."""
    from qkv_jax.plots import plot_attention_maps

    workdir = pathlib.Path(workdir)
    config, setup, params, step = load_run(workdir)
    check_workdir_path(workdir)
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
