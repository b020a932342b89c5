"""Confidence intervals over seeds, for the studies' tables.

Seeds are few (4 to 8), so intervals use Student's t distribution (scipy's,
which JAX itself depends on). A comparison of two variants trained on the
same seeds is paired: seed s of both sees the same batches (and the
parameters the two share start equal), so the difference per seed removes
most of the seed-to-seed noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["format_interval", "mean_interval", "paired_difference"]


def _t(level: float, df: int) -> float:
    from scipy import stats

    return float(stats.t.ppf(0.5 + level / 2, df))


def mean_interval(values: Sequence[float] | Any, level: float = 0.95) -> dict:
    """{"mean", "low", "high", "n"}: the mean and its `level` confidence interval."""
    array = np.asarray(values, dtype=float)
    n = len(array)
    mean = float(array.mean())
    if n < 2:
        return {"mean": mean, "low": math.nan, "high": math.nan, "n": n}
    half = _t(level, n - 1) * float(array.std(ddof=1)) / math.sqrt(n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n}


def paired_difference(
    a: Sequence[float], b: Sequence[float], level: float = 0.95, power: float = 0.8
) -> dict:
    """Mean of `a - b` over paired seeds with its `level` interval, the two-sided p-value of a
    paired t-test, whether the interval excludes 0 (`significant`), and `detectable`: the
    smallest true difference this many seeds would find with probability `power` (at the
    observed spread)."""
    from scipy import stats

    difference = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    n = len(difference)
    result = mean_interval(difference, level)
    if n < 2:
        return {**result, "p": math.nan, "significant": False, "detectable": math.nan}
    error = float(difference.std(ddof=1)) / math.sqrt(n)
    p = float(stats.ttest_1samp(difference, 0.0).pvalue) if error > 0 else (0.0 if result["mean"] else 1.0)
    detectable = (_t(level, n - 1) + float(stats.t.ppf(power, n - 1))) * error
    return {
        **result,
        "p": p,
        "significant": not result["low"] <= 0.0 <= result["high"],
        "detectable": detectable,
    }


def format_interval(stats: dict | None, digits: int = 3, signed: bool = False) -> str:
    """'mean [low, high]' of a `mean_interval`/`paired_difference` record for a table, `digits`
    significant digits (a leading sign with `signed`); the mean alone without an interval (one
    value), '-' for None."""
    if stats is None:
        return "-"
    form = f"{'+' if signed else ''}.{digits}g"
    if stats.get("n", 2) < 2 or math.isnan(stats["low"]):
        return f"{stats['mean']:{form}}"
    return f"{stats['mean']:{form}} [{stats['low']:{form}}, {stats['high']:{form}}]"


def pair_with_reference(
    results: list[dict], measures: Sequence[str], reference_of: Callable[[dict], dict | None]
) -> None:
    """Adds to each of `results` (dicts of per-seed lists) `intervals`, each measure's
    `mean_interval`, and `minus_reference`, each measure's `paired_difference` from
    `reference_of(result)` (None for the reference itself, or when its run is missing)."""
    for result in results:
        reference = reference_of(result)
        result["intervals"] = {name: mean_interval(result[name]) for name in measures}
        result["minus_reference"] = (
            None
            if reference is None or reference is result
            else {name: paired_difference(result[name], reference[name]) for name in measures}
        )


def interval_errors(records: Sequence[dict]) -> list[list[float]]:
    """matplotlib's `yerr` of `mean_interval` records: [below, above] each mean; 0 for a record
    without an interval (one value)."""
    spans = [s.get("n", 2) >= 2 and not math.isnan(s["low"]) for s in records]
    return [
        [s["mean"] - s["low"] if span else 0.0 for s, span in zip(records, spans, strict=True)],
        [s["high"] - s["mean"] if span else 0.0 for s, span in zip(records, spans, strict=True)],
    ]
