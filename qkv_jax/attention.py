"""Scaled dot-product attention as a pure function, and the masks it takes.

The whole mechanism of the seeds is one line,

    attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V,

and `dot_product_attention` below is that line with the details a research
codebase needs: any leading batch dims, grouped K/V heads, boolean masks,
padding by sequence lengths, additive bias, dropout on the attention weights,
a matmul precision, and a softmax that stays finite for fully masked rows and
low-precision inputs.

Layout (jax.nn's):
  query  [batch..., T, N, H]    T query positions, N query heads, depth H
  key    [batch..., S, K, H]    S key positions, K key/value heads (K divides N)
  value  [batch..., S, K, Hv]
  output [batch..., T, N, Hv]
  attention weights [batch..., N, T, S]
A mask is boolean, True = may attend, broadcastable to [batch..., N, T, S].

Three implementations compute the same thing (`implementation=`): "reference",
the explicit einsum/softmax below (the one to read, and the only one that
returns weights or applies dropout); "xla", `jax.nn.dot_product_attention`
(cuDNN's fused kernel on a GPU); "chunked", `qkv_jax.chunked.chunked_attention`,
a blocked online softmax whose memory grows as O(T x block). By default
`select_implementation` picks one by a written rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qkv_jax.chunked import chunked_attention, flatten_batch

Array = jax.Array
# flax's spelling: None (JAX's default), a string ('default', 'high', 'highest', ...),
# a `jax.lax.Precision`, or a pair of either (one per operand).
PrecisionLike = None | str | lax.Precision | tuple[str, str] | tuple[lax.Precision, lax.Precision]

__all__ = [
    "dot_product_attention",
    "select_implementation",
    "IMPLEMENTATIONS",
    "CHUNKED_MIN_KEYS",
    "PrecisionLike",
    "causal_mask",
    "padding_mask",
    "combine_masks",
]

IMPLEMENTATIONS = ("reference", "xla", "chunked")
# From this many keys on, "chunked"; below, "reference" on CPU (forward-mode differentiable)
# and "xla" on accelerators. See select_implementation.
CHUNKED_MIN_KEYS = 64


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


def _check_length_values(owner: str, name: str, lengths: Any, limit_name: str, limit: int) -> None:
    """Raises unless concrete `lengths` lie in [0, limit] (traced ones cannot be checked)."""
    if lengths is None or isinstance(lengths, jax.core.Tracer):
        return
    values = np.asarray(lengths)
    if values.size and ((values < 0) | (values > limit)).any():
        raise ValueError(
            f"{owner}: {name} must lie in [0, {limit_name}={limit}], "
            f"got min {values.min()} and max {values.max()}"
        )


def padding_mask(lengths: Any, max_len: int) -> Array:
    """Key-padding mask `[batch..., 1, 1, max_len]` from per-sequence lengths.

    Position s of a sequence with length L may be attended to iff s < L. The two
    singleton axes broadcast over heads and query positions, so the result can
    be passed straight to `dot_product_attention` or `MultiHeadAttention`.

    With `dot_product_attention` itself, pass the lengths instead:
    `dot_product_attention(q, k, v, key_value_seq_lengths=lengths)` (and
    `query_seq_lengths=` for padded queries) gives the same result, and on a
    GPU in bf16/fp16 it reaches cuDNN's padded kernel, which skips the padding,
    where a mask becomes a `[batch, 1, T, S]` bias.
    """
    if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len <= 0:
        raise ValueError(f"padding_mask: max_len must be a positive int, got {max_len!r}")
    lengths = jnp.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"padding_mask: lengths must be integers, got dtype {lengths.dtype}")
    _check_length_values("padding_mask", "lengths", lengths, "max_len", max_len)
    positions = jnp.arange(max_len)  # (S,)
    mask = positions < lengths[..., None]  # (batch..., S)
    return mask[..., None, None, :]  # (batch..., 1, 1, S)


def combine_masks(*masks: Any) -> Array | None:
    """Logical AND of boolean masks with broadcasting; `None` entries are skipped.

    Masks of shapes broadcastable together (e.g. `[T, S]`, `[batch..., 1, 1, S]`
    and `[batch..., N, T, S]`) give one mask of their broadcast shape. Returns
    None when every mask is None.
    """
    present = [jnp.asarray(m) for m in masks if m is not None]
    for i, m in enumerate(present):
        if m.dtype != jnp.bool_:
            raise TypeError(
                f"combine_masks: masks must be boolean (True = may attend), mask {i} has dtype {m.dtype}"
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


def _lengths_masks(query_seq_lengths, key_value_seq_lengths, T: int, S: int):
    """Masks `[batch..., 1, T, 1]` (queries t < length) and `[batch..., 1, 1, S]` (keys s < length);
    None for lengths not given."""
    query_valid = key_valid = None
    if query_seq_lengths is not None:
        query_valid = (jnp.arange(T) < query_seq_lengths[..., None])[..., None, :, None]
    if key_value_seq_lengths is not None:
        key_valid = (jnp.arange(S) < key_value_seq_lengths[..., None])[..., None, None, :]
    return query_valid, key_valid


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


def _validate_lengths(name: str, lengths: Array | None, batch: tuple[int, ...]) -> None:
    if lengths is None:
        return
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"dot_product_attention: {name} must be integers, got dtype {lengths.dtype}")
    try:
        fits = lengths.ndim <= len(batch) and jnp.broadcast_shapes(lengths.shape, batch) == batch
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"dot_product_attention: {name} of shape {lengths.shape} does not broadcast to the "
            f"batch dims {batch}"
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
            f"dot_product_attention: kv heads K={num_kv_heads} must divide query heads N={num_heads}"
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


def _reference_attention(
    query, key, value, mask, bias, is_causal, scale, dropout_rate, dropout_rng, return_weights, precision
):
    """The explicit path: the whole `[batch..., N, T, S]` logits, softmax, dropout.

    Arguments as `dot_product_attention` (validated, `scale` resolved, the
    lengths folded into `mask`). Handles non-finite keys and values itself.
    """
    *batch, T, N, H = query.shape
    S, K = key.shape[-3], key.shape[-2]
    G = N // K  # query heads per kv head
    out_dtype = jnp.result_type(query, key, value)
    compute_dtype = jnp.promote_types(out_dtype, jnp.float32)
    # A non-finite key is zeroed for the matmul and marked as nan in the logits:
    # masking then removes it where it is not allowed, with finite gradients.
    key_finite = jnp.all(jnp.isfinite(key), axis=-1)  # (..., S, K)
    key = jnp.where(jnp.isfinite(key), key, 0)
    grouped_query = query.reshape(*batch, T, K, G, H)  # (..., T, K, G, H)
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

    output = _contract_values(
        blended.reshape(*batch, K, G, T, S),
        value.astype(compute_dtype),
        logits.reshape(*batch, K, G, T, S),
        precision,
    )  # (..., T, K, G, Hv)
    output = output.reshape(*batch, T, N, value.shape[-1]).astype(out_dtype)
    if return_weights:
        return output, weights.astype(out_dtype)
    return output


# ----------------------------------------------------------------------------- the "xla" path


def _matmul_precision_name(precision: PrecisionLike) -> str | None:
    """`precision` as a `jax_default_matmul_precision` value (jax.nn takes no precision argument).

    A pair of different precisions applies the higher one to both operands.
    """
    if precision is None:
        return None
    if isinstance(precision, (tuple, list)):
        return max((lax.Precision(p) for p in precision), key=lambda p: p.value).name.lower()
    if isinstance(precision, lax.Precision):
        return precision.name.lower()
    try:
        return lax.Precision(precision).name.lower()  # 'float32' -> 'highest', ...
    except ValueError:
        return str(getattr(precision, "name", precision))  # a `jax.lax.DotAlgorithmPreset` (name)


def _masked_logit(dtype) -> float:
    """The additive bias that stands for a False mask entry on the "xla" path.

    jax's own cuDNN wrapper uses -2**15 (float16) and -2**41 (bfloat16) rather
    than the dtype's lowest value, to avoid a cuDNN fault when two such values
    are subtracted; float32 biases (the non-cuDNN kernel) use -2**41 as well.
    """
    return -(2.0**15) if jnp.dtype(dtype) == jnp.float16 else -(2.0**41)


def _fold_into_bias(allowed, bias, dtype, full_shape: tuple[int, int] | None) -> Array | None:
    """`allowed` (boolean) and `bias` (additive) `[B|1, N|1, T|1, S|1]` as one additive bias in `dtype`.

    Entries a query may not attend to get `_masked_logit(dtype)`; user bias
    values are clipped at half of it, so `folded > _masked_logit(dtype)` is
    exactly the allowed set. cuDNN wants the full `[., ., T, S]` (`full_shape`).
    """
    if allowed is None and bias is None:
        return None
    masked = _masked_logit(dtype)
    folded = jnp.zeros((), dtype) if bias is None else jnp.maximum(bias, masked / 2)
    if allowed is not None:
        folded = jnp.where(allowed, folded, masked)
    folded = folded.astype(dtype)
    if full_shape is not None:
        folded = jnp.broadcast_to(folded, (*folded.shape[:2], *full_shape))  # (B|1, N|1, T, S)
    return folded


def _rows_without_keys(allowed, causal_square: bool, lengths, T: int, S: int) -> Array | None:
    """`[B|1, T|1, N|1, 1]`: the (unpadded) query rows that may attend to no key, or None if
    none can be. jax.nn (and cuDNN) give such a row the mean of the values; this module zeros
    it. Padded queries (t >= query length) need nothing: both kernels already zero them."""
    query_lengths, key_lengths = lengths
    if allowed is None and key_lengths is None:
        return None
    if allowed is None:
        empty = (key_lengths == 0)[:, None, None]  # (B, 1, 1)
    else:
        attended = allowed & causal_mask(T, S) if causal_square else allowed
        if key_lengths is not None:
            attended = attended & (jnp.arange(S) < key_lengths[:, None, None, None])  # (B, N|1, T|1, S)
        empty = ~jnp.any(attended, axis=-1)  # (B|1, N|1, T|1)
    if query_lengths is not None:
        empty = empty & (jnp.arange(T) < query_lengths[:, None])[:, None, :]  # (B, N|1, T)
    return jnp.swapaxes(empty, -1, -2)[..., None]  # (B|1, T|1, N|1, 1)


def _jax_nn_attention(query, key, value, bias, lengths, *, is_causal, scale, cudnn, precision):
    """One `jax.nn.dot_product_attention` call: `[B, T, N, H]`, `[B, S, K, H]`, `[B, S, K, H]`,
    an additive bias `[B|1, N|1, T|1, S|1]` or None, int32 lengths `([B] | None, [B] | None)`.

    `precision` (a `jax_default_matmul_precision` value or None) is set around the
    call, which traces every dot of jax.nn's "xla" kernel, and their transposes,
    with it; cuDNN's kernel runs at its own (bf16/fp16 inputs, float32 softmax).
    """
    query_lengths, key_lengths = lengths
    context = contextlib.nullcontext() if precision is None else jax.default_matmul_precision(precision)
    with context:
        return jax.nn.dot_product_attention(
            query,
            key,
            value,
            bias=bias,
            scale=scale,
            is_causal=is_causal,
            query_seq_lengths=query_lengths,
            key_value_seq_lengths=key_lengths,
            implementation="cudnn" if cudnn else "xla",
        )  # (B, T, N, H)


def _nothing_to_fix(key, value, empty_rows) -> Array:
    """True when the kernel's own answer is already this module's: every key and value is
    finite and every unpadded query row has a key. One fused read of K and V."""
    fine = jnp.all(jnp.isfinite(key)) & jnp.all(jnp.isfinite(value))
    return fine if empty_rows is None else fine & ~jnp.any(empty_rows)


def _exact_attention(attend, query, key, value, bias, lengths, empty_rows):
    """`attend` with the reference path's rules for NaN/inf and for rows with no key.

    Non-finite keys and values are zeroed before `attend`, so where they are
    masked out they reach neither the output nor the gradients. Where they may
    be attended to, the output is NaN as in the reference: the whole row for a
    non-finite key, the channel for a non-finite value. One more call of
    `attend` finds those entries: with zero queries and a 0 / masked bias every
    allowed key gets the same weight, so blending a 0/1 indicator of bad
    entries is positive exactly where one is attended (that call runs only when
    a bad entry exists). Rows with no allowed key (`empty_rows`) are zeros.
    Gradients through NaN outputs are zero, not NaN; and a bad key that only a
    -inf bias hides stays hidden, where the reference path's row turns NaN.
    """
    key_finite, value_finite = jnp.isfinite(key), jnp.isfinite(value)
    key = jnp.where(key_finite, key, 0)
    output = attend(query, key, jnp.where(value_finite, value, 0), bias, lengths)

    def reached():  # (B, T, N, Hv): True where an allowed key or value is bad
        bad_key = ~jnp.all(key_finite, axis=-1, keepdims=True)  # (B, S, K, 1)
        bad = (bad_key | ~value_finite).astype(value.dtype)  # (B, S, K, Hv)
        allowed = None
        if bias is not None:
            masked = _masked_logit(bias.dtype)
            allowed = jnp.where(lax.stop_gradient(bias) > masked, 0, masked).astype(bias.dtype)
        return attend(jnp.zeros_like(query), lax.stop_gradient(key), bad, allowed, lengths) > 0

    all_finite = jnp.all(key_finite) & jnp.all(value_finite)
    nan_entries = lax.cond(all_finite, lambda: jnp.zeros(output.shape, jnp.bool_), reached)
    output = jnp.where(nan_entries, jnp.nan, output)
    return output if empty_rows is None else jnp.where(empty_rows, 0, output)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fast_when_finite(attend, query, key, value, bias, lengths, empty_rows):
    """`_exact_attention`, at the cost of one read of K and V when there is nothing to fix.

    `attend` runs on the inputs as they are when `_nothing_to_fix` (then its
    answer is the exact one), else `_exact_attention` runs (`lax.cond`: one
    branch executes; under `vmap` both do). The backward pass takes the same
    branch: `attend`'s own gradient (cuDNN's backward kernel), or the exact
    path's, recomputed. Nothing else touches Q, K or V, so where `attend` is
    cuDNN the common case costs the kernel, one fused reduction over K and V,
    and a conditional in each direction; under differentiation the forward
    conditional also copies the output once (XLA gives a conditional its own
    output buffer, and the kernel's output is kept for its backward pass).
    tests/test_dispatch.py checks that the finite branch is jax.nn's program alone.
    """
    fast = _nothing_to_fix(key, value, empty_rows)
    return lax.cond(
        fast,
        lambda: attend(query, key, value, bias, lengths),
        lambda: _exact_attention(attend, query, key, value, bias, lengths, empty_rows),
    )


def _fast_when_finite_fwd(attend, query, key, value, bias, lengths, empty_rows):
    fast = _nothing_to_fix(key, value, empty_rows)
    output, attend_vjp = jax.vjp(lambda q, k, v, b: attend(q, k, v, b, lengths), query, key, value, bias)
    exact = functools.partial(_exact_attention, attend, query, key, value, bias, lengths, empty_rows)
    output = lax.cond(fast, lambda: output, exact)
    return output, (fast, attend_vjp, (query, key, value, bias, lengths, empty_rows))


def _fast_when_finite_bwd(attend, residuals, output_grad):
    fast, attend_vjp, (query, key, value, bias, lengths, empty_rows) = residuals

    def exact_grads():
        def exact(q, k, v, b):
            return _exact_attention(attend, q, k, v, b, lengths, empty_rows)

        return jax.vjp(exact, query, key, value, bias)[1](output_grad)

    grads = lax.cond(fast, lambda: attend_vjp(output_grad), exact_grads)
    return (*grads, None, None)  # lengths and empty rows: no gradient


_fast_when_finite.defvjp(_fast_when_finite_fwd, _fast_when_finite_bwd)


def _flat_lengths(lengths, batch: tuple[int, ...], limit: int) -> Array | None:
    """Lengths `[batch...]` (or broadcastable) as int32 `[B]`, clipped to [0, limit]."""
    if lengths is None:
        return None
    return jnp.clip(jnp.broadcast_to(lengths, batch).reshape(-1), 0, limit).astype(jnp.int32)


def _xla_attention(query, key, value, mask, bias, lengths, *, is_causal, scale, precision):
    """`jax.nn.dot_product_attention` with this module's conventions.

    jax.nn wants one dtype, one batch axis and a static scale, aligns its causal
    triangle top-left, and gives a row with no allowed key the mean of the
    values. So: inputs are cast to their result dtype and the batch dims
    flattened (reshapes of contiguous arrays: no copies); a traced scale is
    multiplied into the queries; the causal triangle goes to jax.nn only when
    T == S (where top-left is bottom-right), otherwise into the mask; the mask
    and bias (its -inf entries included) become one additive bias
    (`_fold_into_bias`); rows with no key and non-finite keys and values are
    handled by `_fast_when_finite`. Lengths go to jax.nn as they are. On a GPU,
    cuDNN's fused kernel runs when `_cudnn_applies`.
    """
    *batch, T, N, _ = query.shape
    S, Hv = key.shape[-3], value.shape[-1]
    batch = tuple(batch)
    dtype = jnp.result_type(query, key, value)
    has_bias = mask is not None or bias is not None
    cudnn = _cudnn_applies(query, key, value, has_bias, is_causal, jax.default_backend())
    query, key, value = (x.astype(dtype).reshape(-1, *x.shape[-3:]) for x in (query, key, value))
    if not isinstance(scale, (int, float)):  # traced: cuDNN takes a static scale
        query, scale = (query * scale).astype(dtype), 1.0
    lengths = tuple(_flat_lengths(n, batch, limit) for n, limit in zip(lengths, (T, S), strict=True))
    finite_bias = None if bias is None else bias > -jnp.inf
    allowed = combine_masks(mask, causal_mask(T, S) if is_causal and T != S else None, finite_bias)
    allowed = None if allowed is None else flatten_batch(allowed, batch)  # (B|1, N|1, T|1, S|1)
    bias = None if bias is None else flatten_batch(bias, batch)  # (B|1, N|1, T|1, S|1)
    bias_dtype = dtype if cudnn else jnp.promote_types(dtype, jnp.float32)
    folded = _fold_into_bias(allowed, bias, bias_dtype, (T, S) if cudnn else None)
    empty_rows = _rows_without_keys(allowed, is_causal and T == S, lengths, T, S)
    attend = functools.partial(
        _jax_nn_attention,
        is_causal=is_causal and T == S,
        scale=float(scale),
        cudnn=cudnn,
        precision=_matmul_precision_name(precision),
    )
    output = _fast_when_finite(attend, query, key, value, folded, lengths, empty_rows)  # (B, T, N, Hv)
    return output.reshape(*batch, T, N, Hv)


def _cudnn_applies(query, key, value, has_bias: bool, is_causal: bool, platform: str) -> bool:
    """Whether the "xla" path runs cuDNN's fused kernel for these inputs (jax's cuDNN checks).

    On a GPU, for bf16/fp16 with H = Hv a multiple of 8 up to 128 (cuDNN takes
    256 from Hopper on; 128 holds everywhere). A mask, a bias and a causal
    triangle with T != S reach cuDNN as one additive bias `[B|1, N|1, T, S]`,
    and cuDNN's backward pass with a bias needs even T and S.
    """
    T, S = query.shape[-3], key.shape[-3]
    H, Hv = key.shape[-1], value.shape[-1]
    has_bias = has_bias or (is_causal and T != S)
    return (
        platform == "gpu"
        and jnp.result_type(query, key, value) in (jnp.bfloat16, jnp.float16)
        and H == Hv
        and H % 8 == 0
        and H <= 128
        and not (has_bias and (T % 2 or S % 2))
    )


# ----------------------------------------------------------------------------- dispatch


def _ineligibility(implementation, query, key, value, dropout_rate, return_weights, platform) -> str | None:
    """Why `implementation` cannot compute this call exactly on `platform`, or None if it can."""
    if implementation == "reference":
        return None
    if return_weights:
        return "cannot return attention weights (only 'reference' can)"
    if dropout_rate > 0.0:
        return f"does not implement dropout (dropout_rate={dropout_rate}; only 'reference' does)"
    if implementation == "xla":
        H, Hv = key.shape[-1], value.shape[-1]
        if H != Hv:
            return f"needs value depth Hv equal to key depth H (jax.nn), got Hv={Hv} and H={H}"
        dtype = jnp.result_type(query, key, value)
        if dtype == jnp.float64:
            return "computes the softmax in float32 (jax.nn), so it cannot serve float64 inputs"
        if dtype == jnp.float16 and platform == "cpu":
            return "cannot compile float16 on CPU (jax.nn asks for an F16_F16_F32 dot)"
    return None


def select_implementation(
    query: Any,
    key: Any,
    value: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    is_causal: bool = False,
    dropout_rate: float = 0.0,
    return_weights: bool = False,
    platform: str | None = None,
) -> str:
    """The path `dot_product_attention(..., implementation=None)` takes.

    Arguments as for `dot_product_attention`; arrays need only `.shape` and
    `.dtype` (`jax.ShapeDtypeStruct` will do), and of `mask` and `bias` only
    whether they are given matters (sequence lengths and `precision` do not
    change the path). `platform` defaults to `jax.default_backend()`. The rule:

    1. `return_weights` or `dropout_rate > 0`: "reference", the only path that
       does either.
    2. On a GPU where cuDNN's fused kernel applies: "xla", which hands the call
       to cuDNN. That is bf16/fp16 with H = Hv a multiple of 8 up to 128, with
       or without causal masking and lengths; a mask, a bias or causal with
       T != S (all passed to cuDNN as one additive bias `[batch, N|1, T, S]`,
       the causal triangle aligned bottom-right as everywhere here) need even
       T and S. Padding given as lengths costs no bias.
    3. At least `CHUNKED_MIN_KEYS` keys: "chunked". On CPU it is the fastest
       path from there on, forward and backward, and its tiles keep every
       buffer a call allocates small, under glibc's mmap threshold, where
       pages do not fault in afresh on every call
       (`python benchmarks/attention.py --library-user`,
       benchmarks/results/attention_library_user.json).
    4. Fewer keys: "reference" on CPU, the one path that is also
       forward-mode differentiable ("chunked" is faster from 16 keys on, by
       under 0.5 ms forward and 2 ms forward+backward at batch 8 x 8 heads);
       "xla" on accelerators when eligible (H = Hv, not float64), else
       "reference".

    Steps 2 and 4 follow the GPU measurements of issue 19 (cuDNN 10-20x faster
    than "chunked" on an H200, masked or not); benchmarks/gpu.sh measures them
    and benchmarks/gpu_check.sh checks every case of step 2 against the
    reference on the GPU.
    """
    if return_weights or dropout_rate > 0.0:
        return "reference"
    platform = jax.default_backend() if platform is None else platform
    if _cudnn_applies(query, key, value, mask is not None or bias is not None, is_causal, platform):
        return "xla"
    if key.shape[-3] >= CHUNKED_MIN_KEYS:
        return "chunked"
    if platform != "cpu" and _ineligibility("xla", query, key, value, 0.0, False, platform) is None:
        return "xla"
    return "reference"


@dataclasses.dataclass(frozen=True)
class _Static:
    """The arguments of `dot_product_attention` that shape the program (jit-static)."""

    is_causal: bool
    scale: float | None  # a Python-number scale, compiled in (cuDNN takes no traced one)
    dropout_rate: float
    return_weights: bool
    implementation: str | None
    precision: Any


def _checked_implementation(static: _Static, query, key, value, mask, bias) -> str:
    """The path that runs: the one asked for, or the rule's; raises if it cannot compute the call."""
    implementation = static.implementation
    if implementation is None:
        implementation = select_implementation(
            query,
            key,
            value,
            mask=mask,
            bias=bias,
            is_causal=static.is_causal,
            dropout_rate=static.dropout_rate,
            return_weights=static.return_weights,
        )
    elif implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"dot_product_attention: implementation must be None or one of {IMPLEMENTATIONS}, "
            f"got {implementation!r}"
        )
    platform = jax.default_backend()
    reason = _ineligibility(
        implementation, query, key, value, static.dropout_rate, static.return_weights, platform
    )
    if reason is not None:
        raise ValueError(f"dot_product_attention: implementation={implementation!r} {reason}")
    return implementation


def _attention(query, key, value, mask, bias, scale, lengths, dropout_rng, *, static: _Static):
    """`dot_product_attention` under `jax.jit`: `lengths` is (query lengths, key lengths)."""
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    mask, bias, query_lengths, key_lengths = (
        None if x is None else jnp.asarray(x) for x in (mask, bias, *lengths)
    )
    _validate(query, key, value, mask, bias, static.dropout_rate, dropout_rng)
    _validate_lengths("query_seq_lengths", query_lengths, query.shape[:-3])
    _validate_lengths("key_value_seq_lengths", key_lengths, query.shape[:-3])
    implementation = _checked_implementation(static, query, key, value, mask, bias)
    if static.scale is not None:
        scale = static.scale
    elif scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if implementation == "reference":
        mask = combine_masks(
            mask, *_lengths_masks(query_lengths, key_lengths, query.shape[-3], key.shape[-3])
        )
        arguments = (static.is_causal, scale, static.dropout_rate, dropout_rng, static.return_weights)
        return _reference_attention(query, key, value, mask, bias, *arguments, static.precision)
    if implementation == "chunked":
        return chunked_attention(
            query,
            key,
            value,
            mask=mask,
            bias=bias,
            is_causal=static.is_causal,
            scale=scale,
            query_seq_lengths=query_lengths,
            key_value_seq_lengths=key_lengths,
            precision=static.precision,
        )
    options = dict(is_causal=static.is_causal, scale=scale, precision=static.precision)
    return _xla_attention(query, key, value, mask, bias, (query_lengths, key_lengths), **options)


_jitted_attention = jax.jit(_attention, static_argnames=("static",))


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    is_causal: bool = False,
    scale: Any = None,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    dropout_rate: float = 0.0,
    dropout_rng: Any = None,
    return_weights: bool = False,
    implementation: str | None = None,
    precision: PrecisionLike = None,
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
        A Python number is compiled in (as cuDNN needs); an array is traced,
        and differentiable.
      query_seq_lengths: optional integer lengths `[batch...]` (jax.nn's name):
        queries t >= length are padding, with zero output and no gradient.
      key_value_seq_lengths: optional integer lengths `[batch...]`: keys
        s >= length are never attended, as with
        `mask=padding_mask(lengths, S)`. Prefer lengths to a padding mask: on a
        GPU cuDNN then skips the padding instead of reading a `[T, S]` bias.
        Lengths must lie in [0, T] and [0, S] (checked when concrete).
      dropout_rate: inverted dropout on the attention weights (needs dropout_rng).
      dropout_rng: a PRNG key, used only when dropout_rate > 0.
      return_weights: also return the attention weights `[batch..., N, T, S]`,
        taken after the softmax and before dropout.
      implementation: which computation runs; all give the same result up to
        rounding, in outputs and gradients.
        "reference": the explicit einsum/softmax over the whole logits; the
          only one that returns weights or applies dropout.
        "xla": `jax.nn.dot_product_attention` (cuDNN on a GPU when it
          applies, masks and bias included); needs Hv == H, not float64, not
          float16 on CPU. Reverse-mode differentiable only, as is "chunked".
        "chunked": `qkv_jax.chunked.chunked_attention`, blocked online
          softmax with memory O(T x block).
        None: `select_implementation`'s rule (see there): "reference" for
          weights or dropout; "xla" on a GPU where cuDNN applies; "chunked"
          from `CHUNKED_MIN_KEYS` keys; below that "reference" on CPU, "xla"
          (when eligible) on accelerators.
        Asking for a path that cannot compute the call raises ValueError.
      precision: matmul precision of every dot, forward and backward, as flax
        spells it: None (JAX's default, i.e. `jax_default_matmul_precision`),
        'default' / 'high' / 'highest' (or 'bfloat16' / 'tensorfloat32' /
        'float32'), a `jax.lax.Precision`, or a pair of them. On Ampere and
        newer GPUs JAX's default runs float32 matmuls in TF32; 'highest' keeps
        them float32. jax.nn has no precision argument, so the "xla" path sets
        `jax.default_matmul_precision` around its call (a pair: the higher of
        the two); cuDNN's kernel ignores it (bf16/fp16 inputs).

    Returns:
      `[batch..., T, N, Hv]` in the inputs' dtype, and the weights if asked.
      A query row with no allowed key gets zero weights and zero output. The
      logits and softmax are computed in at least float32. A NaN or inf in a
      key or value that is masked out never reaches the output.

    The function is jit-compiled (`is_causal`, a numeric `scale`,
    `dropout_rate`, `return_weights`, `implementation` and `precision` are
    static), so eager calls compile once per shape.
    """
    static_scale = None
    if _is_number(scale):
        static_scale, scale = float(scale), None
    for name, lengths, x, limit_name in (
        ("query_seq_lengths", query_seq_lengths, query, "T"),
        ("key_value_seq_lengths", key_value_seq_lengths, key, "S"),
    ):
        if np.ndim(x) >= 3:  # else _validate names the bad rank
            _check_length_values("dot_product_attention", name, lengths, limit_name, np.shape(x)[-3])
    if isinstance(precision, list):
        precision = tuple(precision)
    static = _Static(is_causal, static_scale, dropout_rate, return_weights, implementation, precision)
    lengths = (query_seq_lengths, key_value_seq_lengths)
    return _jitted_attention(query, key, value, mask, bias, scale, lengths, dropout_rng, static=static)
