"""Two claims about learned attention in a char LM, measured on `train_and_evaluate` runs.

  causal_mask(base, workdir)  the same model trained with and without the causal mask:
                              training loss, honest (causal) validation loss, samples.
  kv_heads(base, workdir, cells, seeds)
                              num_heads=8 with num_kv_heads 8, 4, 2, 1 (MHA, GQA, MQA)
                              and MLA at two latent sizes, trained with the sweep
                              launcher (seeds vmapped): validation loss, KV-cache
                              bytes per token, decode tokens/s.

`base` is a char_lm config as a plain dict; each arm runs in workdir/<arm>/
(re-running resumes). The study functions return plain dicts (rows of
numbers and strings), so a sweep or a docs generator can consume them.
The launcher is experiments/study.py; `STUDIES` holds each study's entry.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pathlib
import time

import jax
import numpy as np

from qkv_jax.lm import TransformerLM, generate, kv_cache_bytes_per_token
from qkv_jax.tasks.transformer import make_model
from qkv_jax.training.run import train_and_evaluate
from qkv_jax.training.validate import ConfigError
from qkv_jax.training.workdir import read_metrics
from studies.grid import apply_overrides
from studies.results import Study
from studies.stats import mean_interval, paired_difference
from studies.sweep import run_sweep

__all__ = [
    "STUDIES",
    "DECODE_BATCHES",
    "causal_mask",
    "kv_heads",
    "decode_tokens_per_second",
]

DECODE_BATCHES = (1, 32)


def train_arm(base: dict, workdir: pathlib.Path, arm: str, model: dict) -> dict:
    """Trains `base` with `model` overrides in workdir/arm; returns its summary."""
    config = copy.deepcopy(base)
    config["model"].update(model)
    return train_and_evaluate(config, workdir / arm)


def decode_tokens_per_second(model, params, batch_size: int, repeats: int = 3) -> float:
    """New tokens per second of `generate` (a one-token prompt, then max_len - 1
    tokens per row; compiled first, median of `repeats`). Speed does not depend
    on the parameters' values, so freshly initialised ones do."""
    prompt = np.ones((batch_size, 1), np.int32)
    new_tokens = model.config.max_len - 1

    def timed(seed):
        started = time.perf_counter()
        generate(model, params, prompt, new_tokens, rng=jax.random.PRNGKey(seed)).block_until_ready()
        return time.perf_counter() - started

    timed(0)  # compiles
    return batch_size * new_tokens / float(np.median([timed(seed) for seed in range(1, repeats + 1)]))


def causal_mask(base: dict, workdir: pathlib.Path) -> dict:
    """Runs both arms; returns the study's rows (plain data) and loss curves."""
    rows, curves = [], {}
    for arm, causal in (("causal", True), ("unmasked", False)):
        summary = train_arm(base, workdir, arm, {"causal": causal})
        rows.append(
            {
                "arm": arm,
                "causal_mask_in_training": causal,
                "final_training_loss_nats": summary["final_loss"],
                "train_bits_per_char": summary["eval_train_bits_per_char"],
                "honest_val_bits_per_char": summary["eval_val_bits_per_char"],
                "unmasked_val_bits_per_char": summary.get("eval_val_unmasked_bits_per_char"),
                "unigram_bits_per_char": summary["eval_unigram_bits_per_char"],
                "sample": summary["samples_after"][0],
            }
        )
        curves[arm] = [[r["step"], r["loss"]] for r in read_metrics(workdir / arm / "metrics.jsonl")]
    return {"study": "causal_mask", "rows": rows, "curves": curves}


def kv_heads(base: dict, workdir: pathlib.Path, cells: list[dict], seeds: list[int]) -> dict:
    """The K/V variants through the sweep launcher in workdir/sweep (the seeds of a cell
    trained together), then per variant: validation bits/char with its 95% interval over
    seeds, the paired difference from MHA (same seeds: same batches, and the parameters
    the variants share start equal), KV-cache bytes per token and decode speed (for MLA
    with and without weight absorption)."""
    rows = run_sweep(base, pathlib.Path(workdir) / "sweep", cells, seeds, metric="eval_val_bits_per_char")
    mha = [r for r in rows if _model(base, r["cell"]).config.num_kv_heads in (None, _heads(base))]
    mha = [r for r in mha if not _model(base, r["cell"]).config.kv_latent_dim]
    results = []
    for row in rows:
        model = _model(base, row["cell"])
        params = jax.jit(model.init)(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"]
        speeds = {
            f"decode_tokens_per_s_batch{b}": decode_tokens_per_second(model, params, b)
            for b in DECODE_BATCHES
        }
        if model.config.kv_latent_dim:  # the same model rebuilding K and V at every step
            explicit = model.clone(config=dataclasses.replace(model.config, absorb_latent=False))
            speeds |= {
                f"decode_tokens_per_s_batch{b}_explicit": decode_tokens_per_second(explicit, params, b)
                for b in DECODE_BATCHES
            }
        results.append(
            {
                "arm": arm_name(model),
                "num_kv_heads": model.config.num_kv_heads,
                "kv_latent_dim": model.config.kv_latent_dim,
                "num_params": int(sum(np.size(x) for x in jax.tree.leaves(params))),
                "seeds": row["seeds"],
                "val_bits_per_char_per_seed": row["eval_val_bits_per_char"],
                "val_bits_per_char": mean_interval(row["eval_val_bits_per_char"]),
                "difference_from_mha": (
                    paired_difference(row["eval_val_bits_per_char"], mha[0]["eval_val_bits_per_char"])
                    if mha
                    else None
                ),
                "train_bits_per_char": mean_interval(row["eval_train_bits_per_char"]),
                "kv_cache_bytes_per_token": kv_cache_bytes_per_token(model),
                **speeds,
            }
        )
    return {"study": "kv_heads", "rows": results}


def _heads(base: dict) -> int:
    return base["model"]["num_heads"]


def _model(base: dict, cell: dict) -> TransformerLM:
    """The TransformerLM of `base` with a sweep cell's overrides."""
    config = apply_overrides(base, cell)
    if config["task"].get("module") != "qkv_jax.tasks.char_lm":
        raise ConfigError(f"task.module={config['task'].get('module')!r}: the K/V study trains the char LM")
    return make_model(config["model"], config["data"]["max_vocab_size"])


def arm_name(model) -> str:
    config = model.config
    if config.kv_latent_dim:
        return f"mla_latent{config.kv_latent_dim}"
    kind = "mha" if config.num_kv_heads == config.num_heads else "mqa" if config.num_kv_heads == 1 else "gqa"
    return f"{kind}_kv{config.num_kv_heads}"


def _causal_mask_table(results: dict) -> list[str]:
    lines = [
        "| arm | final training loss (nats) | train bits/char | honest val bits/char "
        "| val bits/char as trained | unigram bits/char |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        as_trained = r["unmasked_val_bits_per_char"] or r["honest_val_bits_per_char"]
        lines.append(
            f"| {r['arm']} | {r['final_training_loss_nats']:.3f} | {r['train_bits_per_char']:.3f} "
            f"| {r['honest_val_bits_per_char']:.3f} | {as_trained:.3f} | {r['unigram_bits_per_char']:.3f} |"
        )
    for r in results["rows"]:
        lines += [
            "",
            f"Sample from `{r['arm']}` (generated seeing only the past):",
            "",
            "```text",
            r["sample"],
            "```",
        ]
    return lines


def _kv_heads_table(results: dict) -> list[str]:
    speeds = [f"decode tokens/s, batch {b}" for b in DECODE_BATCHES]
    lines = [
        "| arm | kv heads | latent | params | val bits/char, mean [95% CI] | minus MHA, paired [95% CI] "
        "| p | KV cache bytes/token | " + " | ".join(speeds) + " |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(speeds),
    ]
    for r in results["rows"]:
        speed = " | ".join(_speed(r, b) for b in DECODE_BATCHES)
        quality, difference = r["val_bits_per_char"], r["difference_from_mha"]
        versus = (
            "- | -"
            if difference is None
            else f"{difference['mean']:+.4f} [{difference['low']:+.4f}, {difference['high']:+.4f}] "
            f"| {difference['p']:.2g}"
        )
        lines.append(
            f"| {r['arm']} | {r['num_kv_heads']} | {r['kv_latent_dim'] or '-'} | {r['num_params']} "
            f"| {quality['mean']:.4f} [{quality['low']:.4f}, {quality['high']:.4f}] "
            f"| {versus} | {r['kv_cache_bytes_per_token']} | {speed} |"
        )
    return lines


def _speed(row: dict, batch: int) -> str:
    text = f"{row[f'decode_tokens_per_s_batch{batch}']:.0f}"
    explicit = row.get(f"decode_tokens_per_s_batch{batch}_explicit")
    return text if explicit is None else f"{text} (K, V rebuilt: {explicit:.0f})"


def _causal_mask_plot(results: dict, axes) -> None:
    rows = results["rows"]
    for arm, curve in results["curves"].items():
        steps, losses = zip(*curve, strict=True)
        axes[0].plot(steps, [loss / math.log(2) for loss in losses], label=f"{arm}: training loss")
    for ax in axes:
        ax.axhline(rows[0]["unigram_bits_per_char"], color="gray", ls="--", label="unigram baseline")
    axes[0].set(xlabel="step", ylabel="bits per character", title="training loss")
    axes[0].legend()
    axes[1].bar([r["arm"] for r in rows], [r["honest_val_bits_per_char"] for r in rows], color=["C0", "C1"])
    axes[1].set(ylabel="bits per character", title="honest (causal) validation loss")


def _kv_heads_plot(results: dict, axes) -> None:
    rows = results["rows"]
    for r in rows:
        quality = r["val_bits_per_char"]
        axes[0].errorbar(
            r["kv_cache_bytes_per_token"],
            quality["mean"],
            fmt="o",
            yerr=[[quality["mean"] - quality["low"]], [quality["high"] - quality["mean"]]],
        )
        axes[0].annotate(r["arm"], (r["kv_cache_bytes_per_token"], quality["mean"]), fontsize=8)
    axes[0].set(
        xscale="log",
        xlabel="KV-cache bytes per token",
        ylabel="validation bits per character (95% CI)",
        title="quality against cache size",
    )
    batch = DECODE_BATCHES[-1]
    axes[1].bar([r["arm"] for r in rows], [r[f"decode_tokens_per_s_batch{batch}"] for r in rows])
    axes[1].set(ylabel="new tokens per second", title=f"decode speed, batch {batch}")
    axes[1].tick_params(axis="x", rotation=30)


STUDIES = {
    "causal_mask": Study(
        "The causal mask",
        lambda base, workdir, options: causal_mask(base, workdir),
        _causal_mask_table,
        _causal_mask_plot,
    ),
    "kv_heads": Study(
        "Sharing K/V heads: MHA, GQA, MQA, MLA",
        lambda base, workdir, options: kv_heads(base, workdir, options["cells"], options["seeds"]),
        _kv_heads_table,
        _kv_heads_plot,
        uses_cells=True,
    ),
}
