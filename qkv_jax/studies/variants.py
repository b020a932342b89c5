"""Studies of the attention variants the modules add beside flax's fields.

  logit_scale(base, workdir, cells, seeds)  the flag task's one MultiHeadAttention head at each
                                            d_k, with each way of keeping the logits in range
                                            (no scale, 1/sqrt(d_k), QK-norm without and with
                                            the scale, a soft cap): steps until the evaluation
                                            accuracy first reaches CONVERGED, attention entropy
                                            and the gradient reaching W_q at initialisation and
                                            through training, each arm against 1/sqrt(d_k) on
                                            the same seeds (paired 95% intervals).

It trains through the sweep launcher (`run_sweep`: seeds vmapped, cells resumable) with the
thermostat study's probe (plus the evaluation accuracy) measured before training and after
every compiled chunk. `STUDIES` holds its entry for the launcher (experiments/study.py).
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

import jax
import numpy as np

from qkv_jax.studies.grid import apply_overrides, grid
from qkv_jax.studies.mechanisms import thermostat_probe
from qkv_jax.studies.results import Study
from qkv_jax.studies.stats import mean_interval, paired_difference
from qkv_jax.studies.sweep import run_sweep
from qkv_jax.training.setup import Setup
from qkv_jax.training.validate import ConfigError

__all__ = ["CONVERGED", "REFERENCE", "logit_scale_arm", "logit_scale_probe", "logit_scale", "STUDIES"]

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
    for result in results:
        reference = next((r for r in results if r["d_k"] == result["d_k"] and r["arm"] == REFERENCE), None)
        result["intervals"] = {name: mean_interval(result[name]) for name in MEASURES}
        result["minus_reference"] = (
            None
            if reference is None or reference is result
            else {name: paired_difference(result[name], reference[name]) for name in MEASURES}
        )
    return {
        "study": "logit_scale",
        "threshold": CONVERGED,
        "reference": REFERENCE,
        "rows": results,
        "wall_time_s": sum(r.get("wall_time_s", 0.0) for r in rows),
    }


# --- Tables and plots -------------------------------------------------------------------------


def _interval(stats: dict | None, digits: int = 3, signed: bool = False) -> str:
    if stats is None:
        return "-"
    form = f"{'+' if signed else ''}.{digits}g"
    if stats["n"] < 2 or math.isnan(stats["low"]):
        return f"{stats['mean']:{form}}"
    return f"{stats['mean']:{form}} [{stats['low']:{form}}, {stats['high']:{form}}]"


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
            + " | ".join(_interval(i[name]) for name in MEASURES)
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


def _change(stats: dict) -> str:
    return _interval(stats, signed=True) + (" *" if stats["significant"] else "")


def _logit_scale_plot(results: dict, axes: Any) -> None:
    arms = list(dict.fromkeys(r["arm"] for r in results["rows"]))
    largest = max(r["d_k"] for r in results["rows"])
    for i, arm in enumerate(arms):
        mine = sorted((r for r in results["rows"] if r["arm"] == arm), key=lambda r: r["d_k"])
        means = [r["intervals"]["steps_to_converge"] for r in mine]
        axes[0].errorbar(
            [r["d_k"] for r in mine],
            [m["mean"] for m in means],
            yerr=[
                [m["mean"] - m["low"] if m["n"] > 1 else 0 for m in means],
                [m["high"] - m["mean"] if m["n"] > 1 else 0 for m in means],
            ],
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


STUDIES = {
    "logit_scale": Study(
        "Keeping the attention logits in range: 1/sqrt(d_k), QK-norm, a soft cap",
        lambda base, workdir, options: logit_scale(base, workdir, options["cells"], options["seeds"]),
        _logit_scale_table,
        _logit_scale_plot,
    ),
}
