"""Positions in the char LM: RoPE, learned and none, trained at one length, read at longer ones.

  positions_lm   the char LM (configs/char_lm.py:study, model.max_len raised so a learned
                 table has a row for every evaluated position) with each position signal:
                 held-out bits/char on the second half of windows of the trained
                 length and of 2x and 4x it (positions never trained), and the
                 strongest head's induction score on repeated random characters through
                 training (when it passes FORMED), each paired against RoPE.

The repeat task's `positions` study (studies/variants.py) asks the same of a
synthetic task; here the text is real, so the longer windows hold the same kind of
text as the trained ones and only the distances are new.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qkv_jax import text
from qkv_jax.diagnostics import induction_scores, repeated_sequence
from qkv_jax.lm import TransformerLM
from qkv_jax.tasks.transformer import layer_attention, token_cross_entropy
from qkv_jax.training.setup import Setup
from qkv_jax.training.validate import ConfigError
from studies.grid import cell_name
from studies.mechanisms import FORMED
from studies.results import Study
from studies.stats import pair_with_reference
from studies.sweep import run_sweep
from studies.variants import (
    POSITION_CELLS,
    POSITION_REFERENCE,
    induction_measures,
    plot_positions,
    positions_table,
)

__all__ = ["positions_lm_probe", "positions_lm"]

EVAL_WINDOWS = 16  # held-out windows (fixed) per evaluated length
INDUCTION_SEQUENCES = 16  # repeated random character sequences of the trained length
POSITIONS_LM_KEY = 20260008


def _lengths(base: dict) -> tuple[int, ...]:
    """(trained, 2x, 4x): task.seq_len and its multiples; ConfigError naming model.max_len when a
    learned table could not hold the longest."""
    if base["task"].get("name") != "char_lm":
        raise ConfigError("the positions_lm study needs the char LM: --config configs/char_lm.py:study")
    trained = base["task"]["seq_len"]
    lengths = (trained, 2 * trained, 4 * trained)
    if base["model"]["max_len"] < lengths[-1]:
        raise ConfigError(
            f"model.max_len={base['model']['max_len']}: the positions_lm study reads windows of up to "
            f"{lengths[-1]} characters; learned positions need a table that long "
            f"(--config.model.max_len={lengths[-1]})"
        )
    return lengths


def _first_read(length: int) -> int:
    """The first position a window of `length` is scored from: its second half, so that every
    scored position has at least `length // 2` characters of context and, in a window longer than
    the trained ones, lies past every position training reached."""
    return length // 2


def positions_lm_probe(setup: Setup, lengths: tuple[int, ...]) -> Any:
    """probe(params) -> held-out bits/char on EVAL_WINDOWS fixed windows of each length in
    `lengths` (the second half of each: `_first_read`), and
    the strongest head's induction score on INDUCTION_SEQUENCES repeated random character
    sequences of the trained length (`lengths[0]`)."""
    model = setup.model
    if not isinstance(model, TransformerLM) or "validation" not in setup.data:
        raise ConfigError(f"the positions_lm study needs the char LM task, got {type(model).__name__}")
    keys = jax.random.split(jax.random.PRNGKey(POSITIONS_LM_KEY), len(lengths) + 1)
    trained = lengths[0]
    induction_tokens = repeated_sequence(keys[0], INDUCTION_SEQUENCES, trained // 2, model.config.vocab_size)
    windows = {
        n: text.random_windows(key, setup.data["validation"], EVAL_WINDOWS, n + 1)  # (W, n + 1)
        for n, key in zip(lengths, keys[1:], strict=True)
    }

    def probe(params: Any) -> dict:
        layers = layer_attention(model, params, induction_tokens)  # [(B, N, T, T) per block]
        scores = jnp.stack([induction_scores(w, trained // 2) for w in layers])  # (L, N)
        measured = {"induction": scores.max()}
        for n, chunk in windows.items():
            logits = jnp.asarray(model.apply({"params": params}, chunk[:, :-1]))  # (W, n, V)
            nats = token_cross_entropy(logits, chunk[:, 1:])[:, _first_read(n) :].mean()
            measured[f"bits_per_char_{n}"] = nats / math.log(2.0)
        return measured

    return probe


def _arm(row: dict, lengths: tuple[int, ...], budget: int) -> dict:
    """One arm's per-seed measures: the step its strongest induction score first exceeds FORMED
    (never = the budget, a lower bound), the final score and bits/char at each length."""
    measures = induction_measures(row, budget)
    for n in lengths:
        bits = np.asarray(row["probes"][f"bits_per_char_{n}"])  # (probes, seeds)
        measures[f"bits_per_char_{n}"] = bits[-1].tolist()
        measures[f"bits_per_char_{n}_curve"] = bits.mean(axis=1).tolist()
    return measures


def positions_lm(base: dict, workdir: pathlib.Path, seeds: list[int]) -> dict:
    """POSITION_CELLS on the char LM over `seeds` (each arm's seeds trained together on the same
    batches): per arm `_arm`'s measures with 95% intervals, each paired against RoPE."""
    lengths = _lengths(base)
    rows = run_sweep(
        base,
        workdir / "sweep",
        POSITION_CELLS,
        seeds,
        metric="eval_val_bits_per_char",
        probe_for=lambda setup: positions_lm_probe(setup, lengths),
    )
    done = [row for row in rows if row["status"] == "done"]
    if len(done) < len(rows):
        failed = ", ".join(f"{cell_name(row['cell'])} ({row['status']})" for row in rows if row not in done)
        raise ConfigError(f"the positions_lm study compares every arm; these did not finish: {failed}")
    results = [_arm(row, lengths, base["train"]["steps"]) for row in done]
    names = ["formed_at_step", "final_induction", *(f"bits_per_char_{n}" for n in lengths)]
    reference = next(r for r in results if r["arm"] == POSITION_REFERENCE)
    pair_with_reference(results, names, lambda _: reference)
    return {
        "study": "positions_lm",
        "lengths": list(lengths),
        "threshold": FORMED,
        "reference": POSITION_REFERENCE,
        "measures": names,
        "train_steps": base["train"]["steps"],
        "max_len": base["model"]["max_len"],
        "eval_windows": EVAL_WINDOWS,
        "rows": results,
        "wall_time_s": sum(row["wall_time_s"] for row in done),
    }


def _header(length: int) -> str:
    return f"bits/char, positions {_first_read(length)}-{length - 1} of {length}"


def _positions_lm_table(results: dict) -> list[str]:
    lengths = results["lengths"]
    note = (
        f"Mean [95% CI] over seeds; trained on {lengths[0]}-character windows. Formed: the strongest "
        f"head's induction score first > {results['threshold']:g} (never = the budget, a lower bound). "
        f"Bits/char on the second half of {results['eval_windows']} fixed held-out windows of each length "
        "(in the longer windows: positions training never reached)."
    )
    return positions_table(results, note, [_header(n) for n in lengths])


def _positions_lm_plot(results: dict, axes: Any) -> None:
    plot_positions(
        results,
        axes,
        "bits_per_char",
        ylabel="held-out bits/char (95% CI)",
        xlabel="window (characters; dotted: trained)",
    )


STUDIES = {
    "positions_lm": Study(
        "Positions in the char LM: RoPE, learned and none, read at 2x and 4x the trained length",
        lambda base, workdir, options: positions_lm(base, workdir, options["seeds"]),
        _positions_lm_table,
        _positions_lm_plot,
    ),
}
