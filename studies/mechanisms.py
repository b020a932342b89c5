"""Two studies that follow the learned attention through training.

  thermostat(base, workdir, seeds)  why the logits are scaled by 1/sqrt(d_k): per d_k,
                                    with and without it, the gradient norm reaching W_q and
                                    W_k and the attention rows' entropy and largest weight,
                                    at initialisation and every few steps of training.
  induction(base, workdir, seeds)   a small LM on the repeat task (a segment of random
                                    length, repeated): every head's induction score and
                                    previous-token weight through training, when the
                                    induction heads form and which layer holds the
                                    previous-token heads they compose with.

Both train through the sweep launcher (`run_sweep`: seeds vmapped, cells checkpointed
and resumable) with a `probe` measured before training and after every compiled chunk.
`STUDIES` holds each study's entry for the launcher (experiments/study.py).
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qkv_jax.diagnostics import (
    head_diagnostics,
    induction_scores,
    repeated_sequence,
)
from qkv_jax.lm import TransformerLM
from qkv_jax.tasks.transformer import layer_attention
from qkv_jax.training.setup import Setup, build_setup
from qkv_jax.training.validate import ConfigError
from studies.grid import apply_overrides
from studies.results import Study
from studies.stats import format_interval, mean_interval
from studies.sweep import run_sweep

__all__ = ["THERMOSTAT_CELLS", "thermostat", "induction", "STUDIES"]

THERMOSTAT_CELLS = [
    {"model.d_k": d_k, "model.scaled": scaled} for d_k in (8, 64, 256, 1024) for scaled in (True, False)
]
PROBE_BATCHES = 8  # training batches (fixed) the thermostat's gradients are averaged over
INDUCTION_SEQUENCES = 32  # repeated random sequences the induction scores are measured on
FORMED = 0.5  # an induction head has "formed" once its score passes this


def projection_norm(grads: Any, names: tuple[str, ...]) -> jax.Array:
    """L2 norm of the gradient of every kernel whose module is named one of `names`."""
    squares = [
        jnp.sum(leaf**2)
        for path, leaf in jax.tree_util.tree_leaves_with_path(grads)
        if len(path) >= 2 and path[-1].key == "kernel" and path[-2].key in names
    ]
    return jnp.sqrt(sum(squares))


def thermostat_probe(setup: Setup) -> Any:
    """probe(params) -> the norm of the loss gradient at W_q and at W_k (on fixed training
    batches), the W_q gradient divided by the logits' scale (what the softmax passes back to
    the logits, the scale's own factor taken out: logits = scale q.k, so dL/dW_q carries it
    once), and the evaluation's attention entropy and mean largest weight."""
    reader = setup.model
    head_dim = reader.d_k // reader.num_heads if reader.kind == "multihead" else reader.d_k
    scale = head_dim**-0.5 if reader.scaled else 1.0
    keys = jax.random.split(jax.random.PRNGKey(20260001), PROBE_BATCHES)
    batches = jax.vmap(setup.sample_batch, in_axes=(0, None))(keys, setup.data)
    key = jax.random.PRNGKey(20260002)

    def mean_loss(params: Any) -> jax.Array:
        return jax.vmap(lambda batch: setup.loss(params, batch, key)[0])(batches).mean()

    def probe(params: Any) -> dict:
        grads = jax.grad(mean_loss)(params)
        metrics, _ = setup.evaluate(params, key, setup.data)
        return {
            "grad_query": projection_norm(grads, ("W_query", "query")),
            "grad_query_per_scale": projection_norm(grads, ("W_query", "query")) / scale,
            "grad_key": projection_norm(grads, ("W_key", "key")),
            "entropy": metrics["entropy"],
            "max_weight": metrics["head_max_weight"].mean(),
        }

    return probe


def thermostat(base: dict, workdir: pathlib.Path, seeds: list[int]) -> dict:
    """The flag task's learned-query model at each d_k with and without the scale; the probe
    every compiled chunk."""
    rows = run_sweep(base, workdir / "sweep", THERMOSTAT_CELLS, seeds, probe_for=thermostat_probe)
    results = []
    for row in rows:
        probes = row["probes"]  # {"step": [...], name: [step][seed]}
        at_start = {name: mean_interval(values[0]) for name, values in probes.items() if name != "step"}
        results.append(
            {
                "d_k": row["cell"]["model.d_k"],
                "scaled": row["cell"]["model.scaled"],
                "seeds": row["seeds"],
                "steps": probes["step"],
                "probes": {name: values for name, values in probes.items() if name != "step"},
                "at_init": at_start,
                "steps_to_loss_below_1e-2": mean_interval(row["steps_to_loss_below_1e-2"]),
                "final_accuracy": mean_interval(row["eval_accuracy"]),
            }
        )
    return {"study": "thermostat", "rows": results}


def induction_probe(setup: Setup) -> Any:
    """probe(params) -> every head's induction score and previous-token weight `[L, N]`, on
    fixed repeated random sequences of half the model's length (`qkv_jax.diagnostics`)."""
    model = setup.model
    if not isinstance(model, TransformerLM):
        raise ConfigError(f"the induction study needs a TransformerLM task, got {type(model).__name__}")
    config = model.config
    length = config.max_len // 2
    sequences = repeated_sequence(
        jax.random.PRNGKey(20260003), INDUCTION_SEQUENCES, length, config.vocab_size
    )

    def probe(params: Any) -> dict:
        layers = layer_attention(model, params, sequences)  # [(B, N, T, T) per block]
        return {
            "induction": jnp.stack([induction_scores(w, length) for w in layers]),  # (L, N)
            "previous_token": jnp.stack([head_diagnostics(w)["previous_token"] for w in layers]),  # (L, N)
        }

    return probe


def induction(base: dict, workdir: pathlib.Path, seeds: list[int]) -> dict:
    """The repeat task's LM over `seeds`; per seed, its strongest induction head, the step it
    formed (its score first above FORMED) and the strongest previous-token head."""
    build_setup(base)  # a bad config fails here, before any training
    (row,) = run_sweep(base, workdir / "sweep", [{}], seeds, probe_for=induction_probe)
    steps = row["probes"]["step"]
    induction_scores_ = np.asarray(row["probes"]["induction"])  # (steps, seeds, L, N)
    previous = np.asarray(row["probes"]["previous_token"])  # (steps, seeds, L, N)
    per_seed = []
    for i, seed in enumerate(row["seeds"]):
        final = induction_scores_[-1, i]
        layer, head = np.unravel_index(int(np.argmax(final)), final.shape)
        curve = induction_scores_[:, i, layer, head]
        formed = next((steps[t] for t in range(len(steps)) if curve[t] > FORMED), None)
        prev_layer, prev_head = np.unravel_index(int(np.argmax(previous[-1, i])), previous.shape[2:])
        per_seed.append(
            {
                "seed": seed,
                "induction_head": [int(layer), int(head)],
                "induction_score": float(final[layer, head]),
                "formed_at_step": formed,
                "previous_token_head": [int(prev_layer), int(prev_head)],
                "previous_token_score": float(previous[-1, i, prev_layer, prev_head]),
            }
        )
    formed_steps = [s["formed_at_step"] for s in per_seed if s["formed_at_step"] is not None]
    return {
        "study": "induction",
        "rows": per_seed,
        "steps": steps,
        "induction": induction_scores_.tolist(),
        "previous_token": previous.tolist(),
        "loss_steps": row["curve_steps"],
        "losses": row["curves"],
        "formed_at_step": mean_interval(formed_steps) if formed_steps else None,
        "accuracy": mean_interval(row["eval_accuracy"]),
        "cell_page": str(pathlib.Path("sweep") / "cells" / "base" / "report.html"),
        "base": apply_overrides(base, {}),
    }


def _thermostat_table(results: dict) -> list[str]:
    names = ("grad_query", "grad_key", "grad_query_per_scale", "entropy", "max_weight")
    lines = [
        "| d_k | scale | gradient norm at W_q | at W_k | W_q gradient / scale | row entropy (nats) "
        "| largest weight | steps to loss < 1e-2 | final accuracy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        cells = [format_interval(r["at_init"][name]) for name in names]
        lines.append(
            f"| {r['d_k']} | {'1/sqrt(d_k)' if r['scaled'] else 'none'} | "
            + " | ".join(cells)
            + f" | {format_interval(r['steps_to_loss_below_1e-2'])} "
            + f"| {format_interval(r['final_accuracy'])} |"
        )
    return ["At initialisation (mean [95% CI] over seeds):", "", *lines]


def _thermostat_plot(results: dict, axes: Any) -> None:
    colors = {d_k: f"C{i}" for i, d_k in enumerate(sorted({r["d_k"] for r in results["rows"]}))}
    for r in results["rows"]:
        style = "-" if r["scaled"] else "--"
        label = f"d_k={r['d_k']}, {'scaled' if r['scaled'] else 'unscaled'}"
        for ax, name in zip(axes, ("grad_query_per_scale", "entropy"), strict=True):
            mean = np.asarray(r["probes"][name]).mean(axis=1)  # over seeds
            ax.plot(r["steps"], mean, style, color=colors[r["d_k"]], label=label)
    axes[0].set(
        yscale="log", xlabel="step", ylabel="|dL/dW_q| (mean over seeds)", title="gradient reaching W_q"
    )
    axes[1].set(xlabel="step", ylabel="attention row entropy (nats)", title="how peaked the rows are")
    axes[0].legend(fontsize=6, ncol=2)


def _induction_table(results: dict) -> list[str]:
    lines = [
        "| seed | strongest induction head (layer, head) | its final score | formed at step (score > "
        f"{FORMED}) | strongest previous-token head | its weight on the previous token |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        formed = r["formed_at_step"] if r["formed_at_step"] is not None else "never"
        lines.append(
            f"| {r['seed']} | {tuple(r['induction_head'])} | {r['induction_score']:.3f} | {formed} "
            f"| {tuple(r['previous_token_head'])} | {r['previous_token_score']:.3f} |"
        )
    return lines


def _induction_plot(results: dict, axes: Any) -> None:
    scores = np.asarray(results["induction"])  # (steps, seeds, L, N)
    previous = np.asarray(results["previous_token"])
    for seed in range(scores.shape[1]):
        for layer, head in np.ndindex(scores.shape[2:]):
            alpha = 1.0 if seed == 0 else 0.25
            label = f"layer {layer} head {head}" if seed == 0 else None
            color = f"C{layer * scores.shape[3] + head}"
            axes[0].plot(
                results["steps"], scores[:, seed, layer, head], color=color, alpha=alpha, label=label
            )
            axes[1].plot(results["steps"], previous[:, seed, layer, head], color=color, alpha=alpha)
    axes[0].axhline(FORMED, color="gray", ls=":")
    loss_axis = axes[0].twinx()
    loss_axis.plot(results["loss_steps"], np.mean(results["losses"], axis=0), color="black", ls="--", lw=1)
    loss_axis.set(ylabel="training loss, mean over seeds (dashed)")
    axes[0].set(xlabel="step", ylabel="induction score", title="induction score per head (seed 0 solid)")
    axes[1].set(xlabel="step", ylabel="weight on the previous token", title="previous-token attention")
    axes[0].legend(fontsize=6)


STUDIES = {
    "thermostat": Study(
        "The thermostat's mechanism: gradients through a near one-hot softmax",
        lambda base, workdir, options: thermostat(base, workdir, options["seeds"]),
        _thermostat_table,
        _thermostat_plot,
    ),
    "induction": Study(
        "Induction heads forming",
        lambda base, workdir, options: induction(base, workdir, options["seeds"]),
        _induction_table,
        _induction_plot,
    ),
}
