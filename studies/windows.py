"""What a sliding window costs a char LM and what it saves at decode time.

  windows   the char LM (configs/char_lm.py:study) with every layer global, every
            layer local at 16, 32 or 64 keys, and local (16) and global layers
            alternating: validation bits/char with 95% intervals over seeds and the
            paired difference from all-global, against the decode cache's bytes
            (a local layer keeps a ring buffer of its window) and decode tokens/s.

The cache and the speed are properties of the model's shape, measured on freshly
initialised parameters; the quality is measured on the trained ones.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import numpy as np

from qkv_jax.lm import TransformerLM, kv_cache_bytes
from qkv_jax.tasks.transformer import make_model
from qkv_jax.training.validate import ConfigError
from studies.grid import apply_overrides, cell_name
from studies.language_model import DECODE_BATCHES, decode_tokens_per_second
from studies.results import Study
from studies.stats import format_interval, mean_interval, paired_difference
from studies.sweep import run_sweep

__all__ = ["WINDOW_CELLS", "windows"]

WINDOW_CELLS: list[dict[str, Any]] = [
    {"model.window": "full"},
    {"model.window": "64"},
    {"model.window": "32"},
    {"model.window": "16"},
    {"model.window": "16,full"},
]


def _label(window: str) -> str:
    if window == "full":
        return "all global"
    if "," in window:
        return "alternating " + " / ".join(window.split(","))
    return f"all local {window}"


def _model(base: dict, cell: dict) -> TransformerLM:
    config = apply_overrides(base, cell)
    return make_model(config["model"], config["data"]["max_vocab_size"])


def windows(base: dict, workdir: pathlib.Path, seeds: list[int]) -> dict:
    """WINDOW_CELLS over `seeds` (each cell's seeds trained together): per arm validation
    bits/char with its interval and the paired difference from all-global, the decode cache's
    bytes for one sequence of max_len tokens, and decode tokens/s at DECODE_BATCHES."""
    rows = run_sweep(base, workdir / "sweep", WINDOW_CELLS, seeds, metric="eval_val_bits_per_char")
    done = [row for row in rows if row["status"] == "done"]
    if len(done) < len(rows):
        failed = ", ".join(f"{cell_name(row['cell'])} ({row['status']})" for row in rows if row not in done)
        raise ConfigError(
            f"the windows study compares every arm; these did not finish: {failed} (run it again)"
        )
    full = next((r for r in done if r["cell"]["model.window"] == "full"), None)
    if full is None:
        raise ConfigError("the windows study compares with all-global layers, whose cell did not finish")
    results = []
    for row in done:
        model = _model(base, row["cell"])
        params = jax.jit(model.init)(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"]
        results.append(
            {
                "arm": _label(row["cell"]["model.window"]),
                "window": row["cell"]["model.window"],
                "seeds": row["seeds"],
                "val_bits_per_char_per_seed": row["eval_val_bits_per_char"],
                "val_bits_per_char": mean_interval(row["eval_val_bits_per_char"]),
                "minus_global": paired_difference(
                    row["eval_val_bits_per_char"], full["eval_val_bits_per_char"]
                ),
                "cache_bytes": kv_cache_bytes(model),
                **{
                    f"decode_tokens_per_s_batch{b}": decode_tokens_per_second(model, params, b)
                    for b in DECODE_BATCHES
                },
            }
        )
    return {
        "study": "windows",
        "max_len": base["model"]["max_len"],
        "train_steps": base["train"]["steps"],
        "batches": list(DECODE_BATCHES),
        "rows": results,
        "wall_time_s": sum(row["wall_time_s"] for row in done),
    }


def _windows_table(results: dict) -> list[str]:
    batches = results["batches"]
    lines = [
        "| arm | val bits/char | minus all global (paired) | decode cache, one sequence (bytes) "
        + "".join(f"| decode tokens/s, batch {b} " for b in batches)
        + "|",
        "|---|---|---|---|" + "---|" * len(batches),
    ]
    for r in results["rows"]:
        speeds = "".join(f"| {r[f'decode_tokens_per_s_batch{b}']:.0f} " for b in batches)
        lines.append(
            f"| {r['arm']} | {format_interval(r['val_bits_per_char'], 4)} | "
            f"{format_interval(r['minus_global'], 3, True)} "
            f"| {r['cache_bytes']:,} {speeds}|"
        )
    return lines + [
        "",
        f"Mean [95% CI] over seeds; the cache holds {results['max_len']} positions (a local layer its "
        "window's ring buffer); decode speed: `generate` from a one-token prompt to max_len, "
        "median of 3 after compiling.",
    ]


def _windows_plot(results: dict, axes: Any) -> None:
    for r in results["rows"]:
        quality = r["val_bits_per_char"]
        axes[0].errorbar(
            r["cache_bytes"],
            quality["mean"],
            yerr=[[quality["mean"] - quality["low"]], [quality["high"] - quality["mean"]]],
            fmt="o",
        )
        axes[0].annotate(r["arm"], (r["cache_bytes"], quality["mean"]), fontsize=7)
    axes[0].set(
        xlabel="decode cache bytes (one sequence)", ylabel="val bits/char", title="quality against cache"
    )
    batch = results["batches"][-1]
    axes[1].bar(
        [r["arm"] for r in results["rows"]], [r[f"decode_tokens_per_s_batch{batch}"] for r in results["rows"]]
    )
    axes[1].set(ylabel="tokens/s", title=f"decode speed, batch {batch}")
    axes[1].tick_params(axis="x", labelsize=6, rotation=20)


STUDIES = {
    "windows": Study(
        "Sliding windows: bits/char against the decode cache and speed",
        lambda base, workdir, options: windows(base, workdir, options["seeds"]),
        _windows_table,
        _windows_plot,
    ),
}
