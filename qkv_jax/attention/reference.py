"""The reference path: the whole `[batch..., N, T, S]` logits, an explicit softmax, dropout.

The one to read: `softmax(Q K^T * scale + bias, masked) V`, with grouped kv heads,
sinks, a soft cap, dropout, and the rules for rows with no key and for
non-finite keys and values that every path follows.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from qkv_jax.attention.options import CallOptions, PrecisionLike
from qkv_jax.attention.visibility import lift

Array = jax.Array

__all__ = ["softmax_with_sinks", "reference_attention"]


def softmax_with_sinks(logits: Array, sinks: Array | None = None) -> tuple[Array, Array]:
    """Softmax over the last axis of `logits` `[..., N, T, S]` with one more logit per head,
    `sinks` (broadcastable to `[..., N]`, aligned at the last axis; None: no sink), in each
    row's denominator: a sink takes weight and has no value.

    Returns `(weights [..., N, T, S], log_sum_exp [..., N, T])`. A row with no finite
    logit and no sink has zero weights and a log-sum-exp of -inf; the row maximum
    passes no gradient.
    """
    sink = None if sinks is None else lift(sinks.astype(logits.dtype), logits.ndim - 2)[..., None, None]
    row_max = jnp.max(logits, axis=-1, keepdims=True)  # (..., N, T, 1)
    if sink is not None:
        row_max = jnp.maximum(row_max, sink)  # sink: (...|1, N, 1, 1)
    row_max = lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    unnormalized = jnp.exp(logits - row_max)  # (..., N, T, S)
    denominator = jnp.sum(unnormalized, axis=-1, keepdims=True)
    if sink is not None:
        denominator = denominator + jnp.exp(sink - row_max)
    weights = unnormalized / jnp.where(denominator > 0, denominator, 1.0)
    log_sum_exp = jnp.where(denominator > 0, row_max + jnp.log(denominator), -jnp.inf)[..., 0]
    return weights, log_sum_exp  # (..., N, T, S), (..., N, T)


def _contract_values(weights: Array, value: Array, logits: Array, precision: PrecisionLike) -> Array:
    """Blend values: `weights` [..., K, G, T, S] times `value` [..., S, K, Hv].

    A non-finite value at a position a query may not attend to must not reach
    that query's output (0 * nan is nan in IEEE arithmetic), while one at an
    allowed position (logit > -inf, `logits` [..., K, G, T, S]) must still
    poison it. Values are blended with non-finite entries zeroed; the outputs
    to poison are found, outside differentiation, only when some value is
    non-finite.
    """
    finite = jnp.isfinite(value)
    output = jnp.einsum(
        "...kgts,...skh->...tkgh", weights, jnp.where(finite, value, 0), precision=precision
    )  # (..., T, K, G, Hv)

    def poisoned():
        allowed = (lax.stop_gradient(logits) > -jnp.inf).astype(weights.dtype)
        bad = (~finite).astype(weights.dtype)
        return (
            jnp.einsum("...kgts,...skh->...tkgh", allowed, bad, precision=precision) > 0
        )  # (..., T, K, G, Hv)

    poison = lax.cond(jnp.all(finite), lambda: jnp.zeros(output.shape, jnp.bool_), poisoned)
    return jnp.where(poison, jnp.nan, output)


def _logits(query, key, bias, scale, soft_cap, precision) -> Array:
    """Scaled, biased, soft-capped logits `[batch..., N, T, S]` in at least float32.

    A non-finite key is zeroed for the matmul and marked as NaN in its logits:
    masking then removes it where it is not allowed, with finite gradients.
    """
    *batch, T, N, H = query.shape
    S, K = key.shape[-3], key.shape[-2]
    compute_dtype = jnp.promote_types(jnp.result_type(query, key), jnp.float32)
    key_finite = jnp.all(jnp.isfinite(key), axis=-1)  # (..., S, K)
    key = jnp.where(jnp.isfinite(key), key, 0)
    grouped_query = query.reshape(*batch, T, K, N // K, H)  # (..., T, K, G, H)
    logits = jnp.einsum(
        "...tkgh,...skh->...kgts",
        grouped_query,
        key,
        preferred_element_type=compute_dtype,
        precision=precision,
    )  # (..., K, G, T, S)
    key_finite = jnp.swapaxes(key_finite, -1, -2)[..., :, None, None, :]  # (..., K, 1, 1, S)
    logits = jnp.where(key_finite, logits * jnp.asarray(scale, compute_dtype), jnp.nan)
    logits = logits.reshape(*batch, N, T, S)  # (..., N, T, S)
    if bias is not None:
        logits = logits + bias.astype(compute_dtype)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    return logits


def reference_attention(
    query, key, value, bias, allowed, sinks, *, scale: Any, options: CallOptions, dropout_rng: Any
):
    """The explicit path: the whole `[batch..., N, T, S]` logits, softmax, dropout.

    `allowed` is the boolean mask of every constraint (rank of the logits) or
    None, `sinks` broadcastable to `[batch..., N]` or None; `options` gives the
    soft cap, the dropout rate and the precision. Returns the output
    `[batch..., T, N, Hv]`, the residual `[batch..., T, N]` and the weights.
    Handles non-finite keys and values itself.
    """
    *batch, T, N, _ = query.shape
    S, K = key.shape[-3], key.shape[-2]
    out_dtype = jnp.result_type(query, key, value)
    logits = _logits(query, key, bias, scale, options.soft_cap, options.precision)
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    weights, residual = softmax_with_sinks(logits, sinks)  # (..., N, T, S), (..., N, T)

    blended = weights
    if options.dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - options.dropout_rate, weights.shape)
        blended = jnp.where(keep, weights / (1.0 - options.dropout_rate), 0.0)

    output = _contract_values(
        blended.reshape(*batch, K, N // K, T, S),
        value.astype(logits.dtype),
        logits.reshape(*batch, K, N // K, T, S),
        options.precision,
    )  # (..., T, K, G, Hv)
    output = output.reshape(*batch, T, N, value.shape[-1]).astype(out_dtype)
    residual = lax.stop_gradient(jnp.swapaxes(residual, -1, -2)).astype(out_dtype)  # (..., T, N)
    return output, residual, weights.astype(out_dtype)
