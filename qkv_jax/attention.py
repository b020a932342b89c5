"""Scaled dot-product attention as a pure function, and the masks it takes.

The whole mechanism of the seeds is one line,

    attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V,

and `dot_product_attention` below is that line with the details a research
codebase needs: any leading batch dims, grouped K/V heads, boolean masks,
additive bias, dropout on the attention weights, and a softmax that stays
finite for fully masked rows and low-precision inputs.

Layout (jax.nn's):
  query  [batch..., T, N, H]    T query positions, N query heads, depth H
  key    [batch..., S, K, H]    S key positions, K key/value heads (K divides N)
  value  [batch..., S, K, Hv]
  output [batch..., T, N, Hv]
  attention weights [batch..., N, T, S]
A mask is boolean, True = may attend, broadcastable to [batch..., N, T, S].
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array

__all__ = [
    "dot_product_attention",
    "causal_mask",
    "padding_mask",
    "combine_masks",
]


def causal_mask(T: int, S: int | None = None) -> Array:
    """Boolean `[T, S]` mask, True where query t may attend to key s.

    The T queries are the *last* T of the S positions (as when decoding with a
    cache of S keys), so query t sees keys `0 .. t + S - T`. With S = T this is
    the usual lower triangle.
    """
    S = T if S is None else S
    for name, n in (("T", T), ("S", S)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0:
            raise ValueError(f"causal_mask: {name} must be a positive int, got {n!r}")
    query_pos = jnp.arange(T)[:, None] + (S - T)  # (T, 1) absolute positions
    key_pos = jnp.arange(S)[None, :]  # (1, S)
    return key_pos <= query_pos  # (T, S)


def padding_mask(lengths: Any, max_len: int) -> Array:
    """Key-padding mask `[batch..., 1, 1, max_len]` from per-sequence lengths.

    Position s of a sequence with length L may be attended to iff s < L. The two
    singleton axes broadcast over heads and query positions, so the result can
    be passed straight to `dot_product_attention` or `MultiHeadAttention`.
    """
    if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len <= 0:
        raise ValueError(f"padding_mask: max_len must be a positive int, got {max_len!r}")
    lengths = jnp.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"padding_mask: lengths must be integers, got dtype {lengths.dtype}")
    if not isinstance(lengths, jax.core.Tracer):
        bad = np.asarray(lengths)
        if ((bad < 0) | (bad > max_len)).any():
            raise ValueError(
                f"padding_mask: lengths must lie in [0, max_len={max_len}], "
                f"got min {bad.min()} and max {bad.max()}"
            )
    positions = jnp.arange(max_len)  # (S,)
    mask = positions < lengths[..., None]  # (batch..., S)
    return mask[..., None, None, :]  # (batch..., 1, 1, S)


def combine_masks(*masks: Any) -> Array | None:
    """Logical AND of boolean masks with broadcasting; `None` entries are skipped.

    Returns None when every mask is None.
    """
    present = [jnp.asarray(m) for m in masks if m is not None]
    for i, m in enumerate(present):
        if m.dtype != jnp.bool_:
            raise TypeError(
                f"combine_masks: masks must be boolean (True = may attend), "
                f"mask {i} has dtype {m.dtype}"
            )
    if not present:
        return None
    try:
        shape = jnp.broadcast_shapes(*(m.shape for m in present))
    except ValueError:
        shapes = ", ".join(str(m.shape) for m in present)
        raise ValueError(f"combine_masks: mask shapes {shapes} do not broadcast") from None
    combined = jnp.ones(shape, jnp.bool_)
    for m in present:
        combined = jnp.logical_and(combined, m)
    return combined


def _is_floating(x: Array) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _check_broadcastable(name: str, shape: tuple[int, ...], target: tuple[int, ...]) -> None:
    ok = len(shape) <= len(target)
    if ok:
        try:
            ok = jnp.broadcast_shapes(shape, target) == target
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(
            f"dot_product_attention: {name} of shape {shape} does not broadcast to "
            f"the attention shape [batch..., N, T, S] = {target}"
        )


def _validate(query, key, value, mask, bias, dropout_rate, dropout_rng) -> None:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim < 3:
            raise ValueError(
                f"dot_product_attention: {name} must have rank >= 3 "
                f"([batch..., length, heads, depth]), got shape {x.shape}"
            )
        if not _is_floating(x):
            raise TypeError(f"dot_product_attention: {name} must be floating point, got {x.dtype}")
    if not query.ndim == key.ndim == value.ndim:
        raise ValueError(
            "dot_product_attention: query, key and value must have the same rank, got shapes "
            f"{query.shape}, {key.shape}, {value.shape}"
        )
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        raise ValueError(
            "dot_product_attention: batch dims differ: query "
            f"{query.shape[:-3]}, key {key.shape[:-3]}, value {value.shape[:-3]}"
        )
    if key.shape[-3:-1] != value.shape[-3:-1]:
        raise ValueError(
            "dot_product_attention: key and value must agree in length S and kv heads K, got "
            f"key {key.shape} and value {value.shape}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"dot_product_attention: query depth {query.shape[-1]} != key depth {key.shape[-1]} "
            f"(query {query.shape}, key {key.shape})"
        )
    num_heads, num_kv_heads = query.shape[-2], key.shape[-2]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"dot_product_attention: kv heads K={num_kv_heads} must divide query heads "
            f"N={num_heads}"
        )
    *batch, T, N, _ = query.shape
    S = key.shape[-3]
    target = (*batch, N, T, S)
    if mask is not None:
        if mask.dtype != jnp.bool_:
            raise TypeError(
                f"dot_product_attention: mask must be boolean (True = may attend), got dtype "
                f"{mask.dtype}; pass an additive float mask as `bias` instead"
            )
        _check_broadcastable("mask", mask.shape, target)
    if bias is not None:
        _check_broadcastable("bias", bias.shape, target)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dot_product_attention: dropout_rate must be in [0, 1), got {dropout_rate}")
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError("dot_product_attention: dropout_rate > 0 needs a dropout_rng")


def _contract_values(weights: Array, value: Array, allowed: Array) -> Array:
    """Blend values: `weights` [..., K, G, T, S] times `value` [..., S, K, Hv].

    A non-finite value at a position a query may not attend to must not reach
    that query's output (0 * nan is nan in IEEE arithmetic), while one at an
    allowed position must still poison it. The guarded branch only runs when
    some value is non-finite.
    """

    def blend(v):
        return jnp.einsum("...kgts,...skh->...tkgh", weights, v)  # (..., T, K, G, Hv)

    finite = jnp.isfinite(value)

    def guarded():
        out = blend(jnp.where(finite, value, 0))
        poison = jnp.einsum(
            "...kgts,...skh->...tkgh", allowed.astype(weights.dtype), (~finite).astype(weights.dtype)
        )
        return jnp.where(poison > 0, jnp.nan, out)

    return lax.cond(jnp.all(finite), lambda: blend(value), guarded)


def _dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Any = None,
    return_weights: bool = False,
):
    """softmax(Q K^T * scale + bias, masked) V for query heads sharing kv heads.

    Args:
      query: `[batch..., T, N, H]`.
      key: `[batch..., S, K, H]`; K must divide N. Query head n reads kv head
        `n // (N // K)` (grouped-query attention; K = 1 is multi-query).
      value: `[batch..., S, K, Hv]`.
      mask: optional boolean, True = may attend, broadcastable to
        `[batch..., N, T, S]`.
      bias: optional additive logits bias broadcastable to `[batch..., N, T, S]`;
        `-inf` entries act like a False mask.
      is_causal: also apply `causal_mask(T, S)` (queries are the last T of S).
      scale: multiplies the logits; defaults to `1/sqrt(H)` (the "thermostat").
      dropout_rate: inverted dropout on the attention weights (needs dropout_rng).
      dropout_rng: a PRNG key, used only when dropout_rate > 0.
      return_weights: also return the attention weights `[batch..., N, T, S]`,
        taken after the softmax and before dropout.

    Returns:
      `[batch..., T, N, Hv]` in the inputs' dtype, and the weights if asked.
      A query row with no allowed key gets zero weights and zero output. The
      logits and softmax are computed in at least float32.

    The function is jit-compiled (`is_causal`, `dropout_rate` and
    `return_weights` are static), so eager calls compile once per shape.
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    mask = None if mask is None else jnp.asarray(mask)
    bias = None if bias is None else jnp.asarray(bias)
    _validate(query, key, value, mask, bias, dropout_rate, dropout_rng)

    *batch, T, N, H = query.shape
    S, K = key.shape[-3], key.shape[-2]
    G = N // K  # query heads per kv head
    out_dtype = jnp.result_type(query, key, value)
    compute_dtype = jnp.promote_types(out_dtype, jnp.float32)
    if scale is None:
        scale = 1.0 / math.sqrt(H)

    # A non-finite key is zeroed for the matmul and marked as nan in the logits:
    # masking then removes it where it is not allowed, with finite gradients.
    key_finite = jnp.all(jnp.isfinite(key), axis=-1)  # (..., S, K)
    key = jnp.where(jnp.isfinite(key), key, 0)
    grouped_query = query.reshape(*batch, T, K, G, H)  # (..., T, K, G, H)
    logits = jnp.einsum(
        "...tkgh,...skh->...kgts", grouped_query, key, preferred_element_type=compute_dtype
    )  # (..., K, G, T, S)
    key_finite = jnp.swapaxes(key_finite, -1, -2)[..., :, None, None, :]  # (..., K, 1, 1, S)
    logits = jnp.where(key_finite, logits * jnp.asarray(scale, compute_dtype), jnp.nan)
    logits = logits.reshape(*batch, N, T, S)  # (..., N, T, S)
    if bias is not None:
        logits = logits + bias.astype(compute_dtype)
    if is_causal:
        mask = combine_masks(mask, causal_mask(T, S))
    if mask is not None:
        logits = jnp.where(mask, logits, -jnp.inf)

    # Softmax that gives exact zeros for rows with no allowed key.
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    unnormalized = jnp.exp(logits - row_max)
    denominator = jnp.sum(unnormalized, axis=-1, keepdims=True)
    weights = unnormalized / jnp.where(denominator > 0, denominator, 1.0)  # (..., N, T, S)

    blended = weights
    if dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        blended = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)

    allowed = logits > -jnp.inf
    output = _contract_values(
        blended.reshape(*batch, K, G, T, S),
        value.astype(compute_dtype),
        allowed.reshape(*batch, K, G, T, S),
    )  # (..., T, K, G, Hv)
    output = output.reshape(*batch, T, N, value.shape[-1]).astype(out_dtype)
    if return_weights:
        return output, weights.astype(out_dtype)
    return output


dot_product_attention = jax.jit(
    _dot_product_attention, static_argnames=("is_causal", "dropout_rate", "return_weights")
)
