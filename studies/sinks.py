"""Where a char LM's attention goes spare: the first token, a learned sink, or a soft-capped logit.

  sinks   the char LM (configs/char_lm.py:study) with and without learned sinks
          (`model.sinks`) and a soft cap on the attention logits
          (`model.attn_logits_soft_cap`): each head's share of attention on the
          first position of its window, its attention entropy and the weight its
          sink takes, through training, and validation bits/char; each arm paired
          against plain softmax attention over the same seeds and batches.

A query that has nothing useful to read must still put its softmax weight
somewhere; trained transformers put it on the first token (an "attention
sink"). A learned sink logit per head gives the weight a place that writes
nothing; a soft cap c * tanh(logits / c) bounds how sharply any key can be
preferred. Both are measured here on the same held-out windows.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qkv_jax.tasks.transformer import layer_attention
from qkv_jax.training.setup import Setup
from qkv_jax.training.validate import ConfigError
from studies.circuits import held_out_windows
from studies.grid import cell_name
from studies.results import Study
from studies.stats import format_interval, mean_interval, paired_difference
from studies.sweep import run_sweep

__all__ = ["SINK_CELLS", "SOFT_CAP", "sink_probe", "sinks"]

SOFT_CAP = 5.0  # the soft-capped arms' c (the logit_scale study's too)
SINK_CELLS: list[dict[str, Any]] = [
    {"model.sinks": False, "model.attn_logits_soft_cap": None},
    {"model.sinks": True, "model.attn_logits_soft_cap": None},
    {"model.sinks": False, "model.attn_logits_soft_cap": SOFT_CAP},
    {"model.sinks": True, "model.attn_logits_soft_cap": SOFT_CAP},
]
WINDOWS = 8  # held-out windows the attention is measured on
FIRST_QUERY = 8  # queries before this position are left out: early queries see only a few keys
MEASURES = ("first_token", "entropy", "sink_mass")


def arm_label(cell: dict) -> str:
    parts = [
        "sinks" if cell["model.sinks"] else "",
        f"soft cap {SOFT_CAP:g}" if cell["model.attn_logits_soft_cap"] else "",
    ]
    return " + ".join(p for p in parts if p) or "softmax"


def head_measures(weights: jax.Array) -> dict[str, jax.Array]:
    """Per head `[N]`, over queries t >= FIRST_QUERY of `weights` `[B, N, T, S]`: the mean weight
    on key 0 (`first_token`), the mean entropy of the rows in nats (`entropy`), and the mean
    weight that went to the sink (`sink_mass`, 1 - the row's sum; 0 without sinks)."""
    rows = weights[:, :, FIRST_QUERY:]  # (B, N, T', S)
    entropy = -jnp.sum(jnp.where(rows > 0, rows * jnp.log(jnp.where(rows > 0, rows, 1.0)), 0.0), axis=-1)
    return {
        "first_token": rows[..., 0].mean(axis=(0, 2)),
        "entropy": entropy.mean(axis=(0, 2)),
        "sink_mass": (1.0 - rows.sum(axis=-1)).mean(axis=(0, 2)),
    }


def sink_probe(setup: Setup) -> Any:
    """probe(params) -> `head_measures` per layer (`first_token`, ... `[L, N]`) on the first
    WINDOWS windows of a fixed batch cut from the char LM's held-out text."""
    model, windows = held_out_windows(setup, "the sinks study", 20260006, WINDOWS)  # (W, T)

    def probe(params: Any) -> dict:
        layers = [head_measures(w) for w in layer_attention(model, params, windows)]
        return {name: jnp.stack([layer[name] for layer in layers]) for name in MEASURES}  # (L, N)

    return probe


def _arm(row: dict) -> dict:
    """One arm's per-seed numbers: each measure's head mean before and after training, its
    curve through training (mean over seeds and heads), and validation bits/char."""
    probes = {name: np.asarray(row["probes"][name]) for name in MEASURES}  # (steps, seeds, L, N)
    per_seed = {name: values.mean(axis=(-2, -1)) for name, values in probes.items()}  # (steps, seeds)
    first = probes["first_token"][-1]  # (seeds, L, N)
    return {
        "arm": arm_label(row["cell"]),
        "cell": row["cell"],
        "seeds": row["seeds"],
        "steps": row["probes"]["step"],
        **{name: per_seed[name][-1].tolist() for name in MEASURES},
        **{f"{name}_before": per_seed[name][0].tolist() for name in MEASURES},
        "curves": {name: per_seed[name].mean(axis=1).tolist() for name in MEASURES},
        "largest_first_token": first.max(axis=(-2, -1)).tolist(),  # per seed, its most first-token head
        "val_bits_per_char": row["eval_val_bits_per_char"],
    }


def sinks(base: dict, workdir: pathlib.Path, seeds: list[int]) -> dict:
    """SINK_CELLS over `seeds` (each cell's seeds trained together): `_arm`'s numbers with 95%
    intervals, and each arm minus plain softmax attention, paired by seed."""
    rows = run_sweep(
        base, workdir / "sweep", SINK_CELLS, seeds, metric="eval_val_bits_per_char", probe_for=sink_probe
    )
    done = [row for row in rows if row["status"] == "done"]
    if len(done) < len(rows):
        failed = ", ".join(f"{cell_name(row['cell'])} ({row['status']})" for row in rows if row not in done)
        raise ConfigError(
            f"the sinks study compares every arm; these did not finish: {failed} (run it again)"
        )
    arms = [_arm(row) for row in done]
    plain = next((a for a in arms if a["arm"] == "softmax"), None)
    if plain is None:
        raise ConfigError("the sinks study compares with plain softmax attention, whose cell did not finish")
    names = (*MEASURES, "largest_first_token", "val_bits_per_char")
    for arm in arms:
        arm["intervals"] = {name: mean_interval(arm[name]) for name in names}
        arm["intervals"]["first_token_before"] = mean_interval(arm["first_token_before"])
        arm["minus_softmax"] = {name: paired_difference(arm[name], plain[name]) for name in names}
    return {
        "study": "sinks",
        "soft_cap": SOFT_CAP,
        "windows": WINDOWS,
        "first_query": FIRST_QUERY,
        "train_steps": base["train"]["steps"],
        "rows": arms,
        "wall_time_s": sum(row["wall_time_s"] for row in done),
    }


def _sinks_table(results: dict) -> list[str]:
    lines = [
        "| arm | val bits/char | first-token share (before -> after) | most first-token head "
        "| entropy (nats) | sink mass | minus softmax: bits/char, first-token share, entropy |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        i, d = r["intervals"], r["minus_softmax"]
        lines.append(
            f"| {r['arm']} | {format_interval(i['val_bits_per_char'], 4)} "
            f"| {format_interval(i['first_token_before'])} -> {format_interval(i['first_token'])} "
            f"| {format_interval(i['largest_first_token'])} | {format_interval(i['entropy'])} "
            f"| {format_interval(i['sink_mass'])} "
            f"| {format_interval(d['val_bits_per_char'], 3, True)}, "
            f"{format_interval(d['first_token'], 3, True)}, "
            f"{format_interval(d['entropy'], 3, True)} |"
        )
    return lines + [
        "",
        f"Mean [95% CI] over seeds of the head mean (queries at position {results['first_query']} and "
        f"later, {results['windows']} held-out windows); most first-token head: each seed's largest "
        "first-token share over its heads. Differences are paired by seed against plain softmax.",
    ]


def _sinks_plot(results: dict, axes: Any) -> None:
    for i, r in enumerate(results["rows"]):
        axes[0].plot(r["steps"], r["curves"]["first_token"], color=f"C{i}", label=r["arm"])
        axes[1].plot(r["steps"], r["curves"]["sink_mass"], color=f"C{i}", label=r["arm"])
    axes[0].set(xlabel="step", ylabel="attention on the first position", title="first-token share")
    axes[1].set(xlabel="step", ylabel="weight on the sink", title="sink mass")
    axes[0].legend(fontsize=7)


STUDIES = {
    "sinks": Study(
        "Learned sinks and soft-capped logits against the first-token sink",
        lambda base, workdir, options: sinks(base, workdir, options["seeds"]),
        _sinks_table,
        _sinks_plot,
    ),
}
