"""Studies of the attention variants the modules add beside flax's fields.

  logit_scale(base, workdir, cells, seeds)  the flag task's one MultiHeadAttention head at each
                                            d_k, with each way of keeping the logits in range
                                            (no scale, 1/sqrt(d_k), QK-norm without and with
                                            the scale, a soft cap): steps until the evaluation
                                            accuracy first reaches CONVERGED, attention entropy
                                            and the gradient reaching W_q at initialisation and
                                            through training, each arm against 1/sqrt(d_k) on
                                            the same seeds (paired 95% intervals).
  logit_scale_lm(base, workdir, seeds)      the same arms in the char LM (configs/char_lm.py:
                                            study) at d_k 128 (1 head) and 16 (8 heads):
                                            validation bits/char, held-out bits/char through
                                            training, attention entropy and the gradient at
                                            W_q, paired against 1/sqrt(d_k).
  positions(base, workdir, seeds)           the repeat task's LM with RoPE, learned or no
                                            positions, trained at one length: when the
                                            strongest induction score passes FORMED, and the
                                            loss and accuracy on the repeated half at the
                                            trained length and at 2x and 4x it, against RoPE.

All train through the sweep launcher (`run_sweep`: seeds vmapped, cells resumable) with a
probe measured before training and after every compiled chunk (logit_scale: the thermostat
study's, plus the evaluation accuracy). `STUDIES` holds their entries for the launcher
(experiments/study.py).
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qkv_jax.diagnostics import induction_scores, repeated_sequence
from qkv_jax.lm import TransformerLM
from qkv_jax.tasks.sequences import answer_metrics, repeat_batch
from qkv_jax.tasks.transformer import layer_attention
from qkv_jax.training.setup import Setup
from qkv_jax.training.validate import ConfigError
from studies.grid import apply_overrides, grid
from studies.mechanisms import FORMED, PROBE_BATCHES, projection_norm, thermostat_probe
from studies.results import Study
from studies.sinks import FIRST_QUERY, SOFT_CAP, head_measures
from studies.stats import format_interval, interval_errors, pair_with_reference
from studies.sweep import run_sweep

__all__ = [
    "CONVERGED",
    "REFERENCE",
    "POSITION_CELLS",
    "POSITION_REFERENCE",
    "logit_scale_arm",
    "logit_scale_probe",
    "logit_scale",
    "LM_CELLS",
    "logit_scale_lm_probe",
    "logit_scale_lm",
    "induction_measures",
    "plot_positions",
    "positions_table",
    "positions_probe",
    "positions",
    "STUDIES",
]

CONVERGED = 0.95  # "converged": the evaluation accuracy (top-attended = flagged) first reaches this
REFERENCE = "1/sqrt(d_k)"  # the arm every other one is compared with, at the same d_k
# Per-seed measures compared with the reference arm (paired over seeds).
MEASURES = (
    "steps_to_converge",
    "entropy_init",
    "entropy_end",
    "log10_grad_query_init",
    "log10_grad_query_training",
    "final_accuracy",
)
PROBE_KEY = 20260002  # thermostat_probe's evaluation key: the same examples


def logit_scale_arm(model: dict) -> str:
    """The arm's name from a flag config's model section: 'no scale', '1/sqrt(d_k)', 'QK-norm
    (rms)', 'QK-norm (rms) + 1/sqrt(d_k)', 'soft cap 5' (+ 1/sqrt(d_k) when scaled)."""
    scaled = " + 1/sqrt(d_k)" if model["scaled"] else ""
    norm, cap = model.get("normalize_qk", "none"), model.get("attn_logits_soft_cap")
    if norm != "none":
        return f"QK-norm ({norm}){scaled}"
    if cap is not None:
        return f"soft cap {cap:g}{scaled}"
    return REFERENCE if model["scaled"] else "no scale"


def logit_scale_probe(setup: Setup) -> Any:
    """probe(params) -> the thermostat study's probe (the gradient at W_q and W_k on fixed training
    batches, the attention entropy and largest weight) plus the evaluation accuracy on the same
    examples."""
    thermostat = thermostat_probe(setup)
    key = jax.random.PRNGKey(PROBE_KEY)

    def probe(params: Any) -> dict:
        metrics, _ = setup.evaluate(params, key, setup.data)
        return {**thermostat(params), "accuracy": metrics["accuracy"]}

    return probe


def _first_reached(steps: list[int], curve: Any, threshold: float) -> int | None:
    return next((steps[t] for t in range(len(steps)) if curve[t] >= threshold), None)


def _cell_measures(config: dict, row: dict) -> dict:
    """One cell's per-seed measures (lists in seed order). A seed that never reaches CONVERGED
    counts as the step budget (a lower bound) in steps_to_converge; `reached` says which did."""
    probes, budget = row["probes"], config["train"]["steps"]
    steps = probes["step"]
    accuracy = np.asarray(probes["accuracy"])  # (probes, seeds)
    grad = np.asarray(probes["grad_query"])
    entropy = np.asarray(probes["entropy"])
    reached = [_first_reached(steps, accuracy[:, s], CONVERGED) for s in range(accuracy.shape[1])]
    return {
        "d_k": config["model"]["d_k"],
        "arm": logit_scale_arm(config["model"]),
        "seeds": row["seeds"],
        "steps": steps,
        "budget": budget,
        "reached": [r is not None for r in reached],
        "steps_to_converge": [float(budget if r is None else r) for r in reached],
        "entropy_init": entropy[0].tolist(),
        "entropy_end": entropy[-1].tolist(),
        "log10_grad_query_init": np.log10(grad[0]).tolist(),
        # the mean over every probe, init included (the last ones can underflow to 0 once converged)
        "log10_grad_query_training": np.log10(grad.mean(axis=0)).tolist(),
        "final_accuracy": list(row["eval_accuracy"]),
        "accuracy_curve": accuracy.mean(axis=1).tolist(),
        "grad_query_curve": np.exp(np.log(grad).mean(axis=1)).tolist(),  # geometric mean over seeds
        "entropy_curve": entropy.mean(axis=1).tolist(),
    }


def _cell_key(cell: dict) -> tuple:
    return tuple(sorted(cell.items(), key=lambda item: item[0]))


def _reference_at_d_k(results: list[dict], result: dict) -> dict | None:
    """The 1/sqrt(d_k) arm at `result`'s d_k (None if its cell did not finish)."""
    return next((r for r in results if r["d_k"] == result["d_k"] and r["arm"] == REFERENCE), None)


def logit_scale(base: dict, workdir: pathlib.Path, cells: Any, seeds: list[int]) -> dict:
    """The flag task's one-head MultiHeadAttention at each cell (configs/flag_retrieval.py:
    logit_scale's sweep: d_k x arm), seeds trained together; per cell the measures with 95%
    intervals and, at each d_k, the paired difference from the 1/sqrt(d_k) arm."""
    if not cells:
        raise ConfigError(
            "the logit_scale study needs cells: use --config configs/flag_retrieval.py:logit_scale"
        )
    cells = grid(cells)
    configs = [apply_overrides(base, cell) for cell in cells]
    if any(c["model"]["kind"] != "multihead" for c in configs):
        raise ConfigError(
            "the logit_scale study needs model.kind='multihead' (configs/flag_retrieval.py:logit_scale)"
        )
    rows = run_sweep(
        base, workdir / "sweep", cells, seeds, metric="eval_accuracy", probe_for=logit_scale_probe
    )
    done = {_cell_key(r["cell"]): r for r in rows if r["status"] == "done"}  # rows come back key-sorted
    results = []
    for cell, config in zip(cells, configs, strict=True):
        row = done.get(_cell_key(cell))
        if row is not None:
            results.append(_cell_measures(config, row))
    pair_with_reference(results, MEASURES, lambda result: _reference_at_d_k(results, result))
    return {
        "study": "logit_scale",
        "threshold": CONVERGED,
        "reference": REFERENCE,
        "rows": results,
        "wall_time_s": sum(r.get("wall_time_s", 0.0) for r in rows),
    }


# --- Tables and plots -------------------------------------------------------------------------


def _logit_scale_table(results: dict) -> list[str]:
    lines = [
        f"Mean [95% CI] over seeds. Converged: the evaluation accuracy first >= {results['threshold']:g} "
        "(a seed that never does counts as the step budget, a lower bound). Gradient: |dL/dW_q|.",
        "",
        "| d_k | arm | seeds converged | steps to converge | entropy at init (nats) | entropy at end "
        "| log10 gradient at W_q, init | log10 of its mean through training | final accuracy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        i = r["intervals"]
        lines.append(
            f"| {r['d_k']} | {r['arm']} | {sum(r['reached'])}/{len(r['reached'])} | "
            + " | ".join(format_interval(i[name]) for name in MEASURES)
            + " |"
        )
    lines += [
        "",
        f"Each arm minus {results['reference']} at the same d_k, paired over seeds (mean [95% CI]; * the "
        "interval excludes 0):",
        "",
        "| d_k | arm | steps to converge | entropy at init | entropy at end | log10 gradient ratio, init "
        "| log10 gradient ratio, mean through training | final accuracy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        if r["minus_reference"] is None:
            continue
        cells = [_change(r["minus_reference"][name]) for name in MEASURES]
        lines.append(f"| {r['d_k']} | {r['arm']} | " + " | ".join(cells) + " |")
    return lines


def _change(stats: dict, digits: int = 3) -> str:
    return format_interval(stats, digits, signed=True) + (" *" if stats["significant"] else "")


def _logit_scale_plot(results: dict, axes: Any) -> None:
    arms = list(dict.fromkeys(r["arm"] for r in results["rows"]))
    largest = max(r["d_k"] for r in results["rows"])
    for i, arm in enumerate(arms):
        mine = sorted((r for r in results["rows"] if r["arm"] == arm), key=lambda r: r["d_k"])
        means = [r["intervals"]["steps_to_converge"] for r in mine]
        axes[0].errorbar(
            [r["d_k"] for r in mine],
            [m["mean"] for m in means],
            yerr=interval_errors(means),
            marker="o",
            ms=3,
            capsize=2,
            color=f"C{i}",
            label=arm,
        )
        for r in mine:
            if r["d_k"] == largest:
                axes[1].plot(r["steps"], r["accuracy_curve"], color=f"C{i}", label=arm)
    axes[0].set(
        xscale="log",
        xlabel="d_k",
        ylabel=f"steps to accuracy >= {results['threshold']:g} (95% CI)",
        title="steps to converge (the budget = not reached)",
    )
    axes[1].axhline(results["threshold"], color="gray", ls=":")
    axes[1].set(xlabel="step", ylabel="evaluation accuracy (mean over seeds)", title=f"d_k = {largest}")
    axes[0].legend(fontsize=6)


# --- positions: RoPE, learned, none; trained at one length, evaluated at longer ones ------------

POSITION_CELLS = [{"model.positions": kind} for kind in ("rope", "learned", "none")]
POSITION_REFERENCE = "rope"  # the arm every other one is compared with
EVAL_SEQUENCES = 64  # repeat-task sequences (fixed) per evaluated length
INDUCTION_SEQUENCES = 16  # repeated random sequences of the trained length for the induction score
POSITION_KEY = 20260006


def positions_probe(setup: Setup, lengths: tuple[int, ...]) -> Any:
    """probe(params) -> the strongest head's induction score on repeated random sequences of the
    trained length (`lengths[0]`, the task's 2 task.length) and, at each length in `lengths`, the loss
    (nats) and accuracy on the repeat task's answers (the repeated half) of fixed sequences."""
    model = setup.model
    if not isinstance(model, TransformerLM):
        raise ConfigError(
            f"the positions study needs the repeat task's TransformerLM, got {type(model).__name__}"
        )
    vocab_size, trained = model.config.vocab_size, lengths[0]
    keys = jax.random.split(jax.random.PRNGKey(POSITION_KEY), len(lengths) + 1)
    induction_tokens = repeated_sequence(keys[0], INDUCTION_SEQUENCES, trained // 2, vocab_size)
    batches = {
        n: repeat_batch(k, EVAL_SEQUENCES, n // 2, vocab_size) for n, k in zip(lengths, keys[1:], strict=True)
    }

    def probe(params: Any) -> dict:
        layers = layer_attention(model, params, induction_tokens)  # [(B, N, T, T) per block]
        scores = jnp.stack([induction_scores(w, trained // 2) for w in layers])  # (L, N)
        measured = {"induction": scores.max()}
        for n, batch in batches.items():
            metrics = answer_metrics(jnp.asarray(model.apply({"params": params}, batch["inputs"])), batch)
            measured |= {f"loss_{n}": metrics["loss"], f"accuracy_{n}": metrics["accuracy"]}
        return measured

    return probe


def _position_lengths(base: dict, lengths: tuple[int, ...] | None) -> tuple[int, ...]:
    """(trained, then each longer length): the repeat task's 2 task.length first; ConfigError when
    the task is not the repeat task or model.max_len cannot hold the longest."""
    if base["task"].get("name") != "repeat":
        raise ConfigError("the positions study needs the repeat task: --config configs/sequences.py:repeat")
    trained = 2 * base["task"]["length"]
    lengths = (trained, 2 * trained, 4 * trained) if lengths is None else (trained, *lengths)
    if max(lengths) > base["model"]["max_len"]:
        raise ConfigError(
            f"model.max_len={base['model']['max_len']}: the positions study evaluates up to {max(lengths)} "
            "tokens; learned positions need a table that long (its untrained rows are the point)"
        )
    return lengths


def induction_measures(row: dict, budget: int) -> dict[str, Any]:
    """A positions arm's induction measures from its sweep row: per seed the step its strongest
    induction score first exceeds FORMED (`formed_at_step`; never = `budget`, a lower bound) and
    the final score, the mean curve, and the arm's name, seeds and probe steps."""
    steps, induction = row["probes"]["step"], np.asarray(row["probes"]["induction"])  # (probes, seeds)
    formed = [
        next((steps[t] for t in range(len(steps)) if induction[t, s] > FORMED), None)
        for s in range(induction.shape[1])
    ]
    return {
        "arm": row["cell"]["model.positions"],
        "seeds": row["seeds"],
        "steps": steps,
        "budget": budget,
        "formed": [f is not None for f in formed],
        "formed_at_step": [float(budget if f is None else f) for f in formed],
        "final_induction": induction[-1].tolist(),
        "induction_curve": induction.mean(axis=1).tolist(),
    }


def _position_measures(row: dict, lengths: tuple[int, ...], budget: int) -> dict:
    """One arm's per-seed measures: the step its strongest induction score first exceeds FORMED
    (never = the budget, a lower bound) and the final loss and accuracy at each length."""
    measures = induction_measures(row, budget)
    probes = row["probes"]
    for n in lengths:
        measures[f"loss_{n}"] = np.asarray(probes[f"loss_{n}"])[-1].tolist()
        measures[f"accuracy_{n}"] = np.asarray(probes[f"accuracy_{n}"])[-1].tolist()
        measures[f"accuracy_{n}_curve"] = np.asarray(probes[f"accuracy_{n}"]).mean(axis=1).tolist()
    return measures


def positions(
    base: dict, workdir: pathlib.Path, seeds: list[int], lengths: tuple[int, ...] | None = None
) -> dict:
    """RoPE, learned and no positions (POSITION_CELLS) on the repeat task at its length, seeds
    trained together; per arm the induction score's formation step and the answers' loss and
    accuracy at the trained length and at `lengths` (default 2x and 4x), paired against RoPE."""
    lengths = _position_lengths(base, lengths)
    rows = run_sweep(
        base,
        workdir / "sweep",
        POSITION_CELLS,
        seeds,
        metric="eval_accuracy",
        probe_for=lambda setup: positions_probe(setup, lengths),
    )
    results = [_position_measures(r, lengths, base["train"]["steps"]) for r in rows if r["status"] == "done"]
    names = ["formed_at_step", "final_induction"] + [
        f"{m}_{n}" for n in lengths for m in ("loss", "accuracy")
    ]
    reference = next((r for r in results if r["arm"] == POSITION_REFERENCE), None)
    pair_with_reference(results, names, lambda _: reference)
    return {
        "study": "positions",
        "lengths": list(lengths),
        "threshold": FORMED,
        "reference": POSITION_REFERENCE,
        "measures": names,
        "rows": results,
        "wall_time_s": sum(r.get("wall_time_s", 0.0) for r in rows),
    }


def positions_table(results: dict, note: str, length_columns: list[str]) -> list[str]:
    """A positions study's two tables: each arm's measures (`results["measures"]`, after the
    formation step and final induction score one column per entry of `length_columns`), then
    each arm minus the reference, paired; `note` above them."""
    columns = "| positions | formed at step | final induction score | " + " | ".join(length_columns) + " |"
    lines = [
        note,
        "",
        columns.replace("| positions |", "| positions | seeds formed |", 1),
        "|---|---|---|---|" + "---|" * len(length_columns),
    ]
    for r in results["rows"]:
        cells = [format_interval(r["intervals"][name], 4) for name in results["measures"]]
        lines.append(f"| {r['arm']} | {sum(r['formed'])}/{len(r['formed'])} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Each arm minus {results['reference']}, paired over seeds (mean [95% CI]; * the interval "
        "excludes 0):",
        "",
        columns,
        "|---|---|---|" + "---|" * len(length_columns),
    ]
    for r in results["rows"]:
        if r["minus_reference"] is not None:
            cells = [_change(r["minus_reference"][name], 4) for name in results["measures"]]
            lines.append(f"| {r['arm']} | " + " | ".join(cells) + " |")
    return lines


def _positions_table(results: dict) -> list[str]:
    lengths = results["lengths"]
    note = (
        f"Mean [95% CI] over seeds; trained at {lengths[0]} tokens. Formed: the strongest head's "
        f"induction score first > {results['threshold']:g} (never = the budget, a lower bound). Loss "
        "(nats) and accuracy on the repeated half's answers."
    )
    return positions_table(results, note, [f"{m} at {n}" for n in lengths for m in ("loss", "accuracy")])


def plot_positions(results: dict, axes: Any, measure: str, ylabel: str, xlabel: str) -> None:
    """A positions study's figure: the strongest induction score through training per arm, and
    `measure` (`{measure}_{length}` intervals) against the evaluated length."""
    lengths = results["lengths"]
    for i, r in enumerate(results["rows"]):
        axes[0].plot(r["steps"], r["induction_curve"], color=f"C{i}", label=r["arm"])
        means = [r["intervals"][f"{measure}_{n}"] for n in lengths]
        axes[1].errorbar(
            lengths,
            [m["mean"] for m in means],
            yerr=interval_errors(means),
            marker="o",
            capsize=2,
            color=f"C{i}",
            label=r["arm"],
        )
    axes[0].axhline(results["threshold"], color="gray", ls=":")
    axes[0].set(
        xlabel="step", ylabel="strongest induction score (mean over seeds)", title="induction forming"
    )
    axes[1].axvline(lengths[0], color="gray", ls=":")
    axes[1].set(xscale="log", xlabel=xlabel, ylabel=ylabel, title="length generalisation")
    axes[0].legend(fontsize=7)


def _positions_plot(results: dict, axes: Any) -> None:
    plot_positions(
        results,
        axes,
        "accuracy",
        ylabel="accuracy on the repeated half (95% CI)",
        xlabel="evaluated length (tokens; dotted: trained)",
    )


# --- logit_scale_lm: the same arms in the char LM ----------------------------------------------

# (attention_scale, normalize_qk, attn_logits_soft_cap) per arm, in logit_scale's order.
LM_ARMS: list[dict[str, Any]] = [
    {"model.attention_scale": 1.0, "model.normalize_qk": "none", "model.attn_logits_soft_cap": None},
    {"model.attention_scale": None, "model.normalize_qk": "none", "model.attn_logits_soft_cap": None},
    {"model.attention_scale": 1.0, "model.normalize_qk": "rms", "model.attn_logits_soft_cap": None},
    {"model.attention_scale": None, "model.normalize_qk": "rms", "model.attn_logits_soft_cap": None},
    {"model.attention_scale": 1.0, "model.normalize_qk": "none", "model.attn_logits_soft_cap": SOFT_CAP},
]
# Heads at d_model 128: 1 head of d_k = 128 first (where the arms differ most), then 8 of 16.
LM_HEADS = (1, 8)
LM_CELLS = [{"model.num_heads": heads, **arm} for heads in LM_HEADS for arm in LM_ARMS]
LM_WINDOWS = 8  # held-out windows the attention entropy is measured on
LM_MEASURES = (
    "val_bits_per_char",
    "mean_probe_bits_per_char",
    "entropy_init",
    "entropy_end",
    "log10_grad_query_init",
    "log10_grad_query_training",
)


def logit_scale_lm_arm(model: dict) -> str:
    """The arm's name from a char LM config's model section (logit_scale_arm's names)."""
    return logit_scale_arm({**model, "scaled": model.get("attention_scale") is None})


def logit_scale_lm_probe(setup: Setup) -> Any:
    """probe(params) -> the norm of the loss gradient at every W_q (on PROBE_BATCHES fixed
    training batches), bits/char on a fixed held-out batch, and the attention entropy (nats,
    mean over heads and layers; sinks' `head_measures`) on LM_WINDOWS of its windows."""
    model = setup.model
    if not isinstance(model, TransformerLM) or "validation" not in setup.data:
        raise ConfigError(
            f"the logit_scale_lm study needs the char LM task, got model {type(model).__name__}"
        )
    keys = jax.random.split(jax.random.PRNGKey(20260001), PROBE_BATCHES)
    batches = jax.vmap(setup.sample_batch, in_axes=(0, None))(keys, setup.data)
    held_out = setup.sample_batch(
        jax.random.PRNGKey(20260007), {**setup.data, "train": setup.data["validation"]}
    )
    key = jax.random.PRNGKey(0)  # dropout's, unused at rate 0

    def mean_loss(params: Any) -> jax.Array:
        return jax.vmap(lambda batch: setup.loss(params, batch, key)[0])(batches).mean()

    def probe(params: Any) -> dict:
        layers = layer_attention(model, params, held_out["inputs"][:LM_WINDOWS])
        entropy = jnp.stack([head_measures(w)["entropy"] for w in layers])  # (L, N)
        return {
            "grad_query": projection_norm(jax.grad(mean_loss)(params), ("query",)),
            "bits_per_char": setup.loss(params, held_out, key)[0] / jnp.log(2.0),
            "entropy": entropy.mean(),
        }

    return probe


def _lm_cell_measures(config: dict, row: dict) -> dict:
    """One char LM cell's per-seed measures (lists in seed order) and its curves."""
    probes = row["probes"]
    grad = np.asarray(probes["grad_query"])  # (probes, seeds)
    entropy = np.asarray(probes["entropy"])
    bits = np.asarray(probes["bits_per_char"])
    model = config["model"]
    return {
        "d_k": model["d_model"] // model["num_heads"],
        "num_heads": model["num_heads"],
        "arm": logit_scale_lm_arm(model),
        "seeds": row["seeds"],
        "steps": probes["step"],
        "val_bits_per_char": list(row["eval_val_bits_per_char"]),
        # the mean over the probes after step 0: lower is faster learning as well as a lower end
        "mean_probe_bits_per_char": bits[1:].mean(axis=0).tolist(),
        "entropy_init": entropy[0].tolist(),
        "entropy_end": entropy[-1].tolist(),
        "log10_grad_query_init": np.log10(grad[0]).tolist(),
        "log10_grad_query_training": np.log10(grad.mean(axis=0)).tolist(),
        "bits_curve": bits.mean(axis=1).tolist(),
        "entropy_curve": entropy.mean(axis=1).tolist(),
    }


def logit_scale_lm(
    base: dict, workdir: pathlib.Path, seeds: list[int], cells: list[dict] | None = None
) -> dict:
    """`cells` (default LM_CELLS) over `seeds` (each cell's seeds trained together, on the same
    batches from the same initial values of the shared parameters): per cell the measures with
    95% intervals and, at each d_k, the paired difference from the 1/sqrt(d_k) arm. Cells that
    did not finish are left out (run again to finish them)."""
    cells = LM_CELLS if cells is None else cells
    rows = run_sweep(
        base, workdir / "sweep", cells, seeds, metric="eval_val_bits_per_char", probe_for=logit_scale_lm_probe
    )
    done = {_cell_key(r["cell"]): r for r in rows if r["status"] == "done"}
    results = [
        _lm_cell_measures(apply_overrides(base, cell), done[_cell_key(cell)])
        for cell in cells
        if _cell_key(cell) in done
    ]
    if not results:
        raise ConfigError(f"the logit_scale_lm study: no cell finished; the first: {rows[0]['status']}")
    pair_with_reference(results, LM_MEASURES, lambda result: _reference_at_d_k(results, result))
    return {
        "study": "logit_scale_lm",
        "reference": REFERENCE,
        "train_steps": base["train"]["steps"],
        "seq_len": base["task"]["seq_len"],
        "d_model": base["model"]["d_model"],
        "eval_windows": base["eval"]["num_examples"],
        "cells": len(cells),
        "rows": results,
        "wall_time_s": sum(r.get("wall_time_s", 0.0) for r in rows),
    }


def _logit_scale_lm_table(results: dict) -> list[str]:
    lines = [
        "| d_k (heads) | arm | val bits/char | mean held-out bits/char over training | entropy at init "
        "(nats) | entropy at end | log10 gradient at W_q, init | log10 of its mean through training |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        i = r["intervals"]
        lines.append(
            f"| {r['d_k']} ({r['num_heads']}) | {r['arm']} | "
            + " | ".join(format_interval(i[name], 4 if "bits" in name else 3) for name in LM_MEASURES)
            + " |"
        )
    lines += [
        "",
        f"Each arm minus {results['reference']} at the same d_k, paired over seeds (mean [95% CI]; * the "
        "interval excludes 0):",
        "",
        "| d_k | arm | val bits/char | mean held-out bits/char | entropy at init | entropy at end "
        "| log10 gradient ratio, init | log10 gradient ratio, mean through training |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        if r["minus_reference"] is not None:
            cells = [_change(r["minus_reference"][name], 4 if "bits" in name else 3) for name in LM_MEASURES]
            lines.append(f"| {r['d_k']} | {r['arm']} | " + " | ".join(cells) + " |")
    return lines + [
        "",
        f"Mean [95% CI] over seeds. Val bits/char: the final evaluation ({results['eval_windows']} "
        "held-out windows); mean held-out bits/char: one fixed held-out batch at every probe after step "
        "0, averaged (lower = learned faster as well as further); entropy: the attention rows of "
        f"queries at position {FIRST_QUERY} and later on {LM_WINDOWS} held-out windows, mean over heads "
        f"and layers; gradient: |dL/dW_q| over every layer on {PROBE_BATCHES} fixed training batches.",
    ]


def _logit_scale_lm_plot(results: dict, axes: Any) -> None:
    largest = max(r["d_k"] for r in results["rows"])
    for i, arm in enumerate(dict.fromkeys(r["arm"] for r in results["rows"])):
        for r in results["rows"]:
            if r["arm"] == arm and r["d_k"] == largest:
                axes[0].plot(r["steps"][1:], r["bits_curve"][1:], color=f"C{i}", label=arm)
                axes[1].plot(r["steps"], r["entropy_curve"], color=f"C{i}", label=arm)
    axes[0].set(xlabel="step", ylabel="held-out bits/char", title=f"d_k = {largest}")
    axes[1].set(xlabel="step", ylabel="attention entropy (nats)", title=f"d_k = {largest}")
    axes[0].legend(fontsize=6)


STUDIES = {
    "logit_scale": Study(
        "Keeping the attention logits in range: 1/sqrt(d_k), QK-norm, a soft cap",
        lambda base, workdir, options: logit_scale(base, workdir, options["cells"], options["seeds"]),
        _logit_scale_table,
        _logit_scale_plot,
        uses_cells=True,
    ),
    "logit_scale_lm": Study(
        "Keeping a char LM's attention logits in range: 1/sqrt(d_k), QK-norm, a soft cap",
        lambda base, workdir, options: logit_scale_lm(base, workdir, options["seeds"]),
        _logit_scale_lm_table,
        _logit_scale_lm_plot,
    ),
    "positions": Study(
        "Positions: RoPE, learned and none, trained at one length and evaluated at longer ones",
        lambda base, workdir, options: positions(base, workdir, options["seeds"]),
        _positions_table,
        _positions_plot,
    ),
}
