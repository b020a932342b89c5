"""chex-based checks on attention weights (host-side, on concrete arrays)."""

from __future__ import annotations

from typing import Any

import chex
import jax.numpy as jnp
import numpy as np

__all__ = ["assert_attention_weights", "row_sum_tolerance"]

_ROW_SUM_ATOL = {
    np.dtype(np.float64): 1e-10,
    np.dtype(np.float32): 1e-5,
    np.dtype(jnp.float16): 5e-3,
    np.dtype(jnp.bfloat16): 2e-2,
}


def row_sum_tolerance(dtype: Any) -> float:
    """How far from 1 a softmax row of this dtype may sum (rounding of each weight)."""
    return _ROW_SUM_ATOL.get(np.dtype(dtype), 1e-5)


def assert_attention_weights(weights: Any, mask: Any = None, *, atol: float | None = None) -> None:
    """Asserts that `weights` `[..., T, S]` is a valid attention distribution.

    Checks: every entry finite and non-negative; zero wherever `mask` (boolean,
    True = may attend, broadcastable to `weights.shape`) forbids, so causal
    weights are 0 above the diagonal; each row with at least one allowed key
    sums to 1 within `atol` (default by dtype, see `row_sum_tolerance`); rows
    with no allowed key are all zero.

    Raises AssertionError naming the first offending row.
    """
    if np.ndim(weights) < 1:
        raise AssertionError(f"attention weights need a key axis, got a scalar {weights!r}")
    chex.assert_tree_all_finite(weights)
    dtype = np.dtype(weights.dtype)
    weights = np.asarray(weights, dtype=np.float64)
    atol = row_sum_tolerance(dtype) if atol is None else atol

    if (weights < 0).any():
        index = np.unravel_index(np.argmin(weights), weights.shape)
        raise AssertionError(f"attention weights are negative, e.g. {weights[index]} at {index}")

    if mask is None:
        allowed = np.ones(weights.shape, bool)
    else:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_:
            raise TypeError(f"mask must be boolean (True = may attend), got dtype {mask.dtype}")
        try:
            allowed = np.broadcast_to(mask, weights.shape)
        except ValueError:
            raise AssertionError(
                f"mask of shape {mask.shape} does not broadcast to weights {weights.shape}"
            ) from None
        leaked = np.where(allowed, 0.0, weights)
        if (leaked != 0).any():
            index = np.unravel_index(np.argmax(np.abs(leaked)), weights.shape)
            raise AssertionError(
                f"attention weight {weights[index]} at {index} where the mask forbids attending"
            )

    row_sums = weights.sum(axis=-1)
    has_key = np.asarray(allowed.any(axis=-1))
    error = np.where(has_key, np.abs(row_sums - 1.0), np.abs(row_sums))
    if (error > atol).any():
        index = np.unravel_index(np.argmax(error), error.shape)
        expected = 1.0 if has_key[index] else 0.0
        raise AssertionError(
            f"attention row {index} sums to {row_sums[index]:.8g}, expected {expected} "
            f"(atol {atol:g}, dtype {dtype})"
        )
