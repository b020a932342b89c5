"""Scaled dot-product attention as a pure function, and the masks it takes.

The whole mechanism is one line,

    attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V,

and `dot_product_attention` below is that line with the details a research
codebase needs. It is a drop-in for `jax.nn.dot_product_attention` (the same
positional order, argument names and meanings: bias, mask, scale, is_causal,
sequence lengths, local_window_size, implementation, return_residual), and
adds: any number of leading batch dims, a query offset (a KV cache, chunked
prefill), segment ids for packed sequences, a logits soft cap, attention
sinks, dropout on the weights, returned weights, a matmul precision, and a
softmax that stays finite for fully masked rows and low-precision inputs.
docs/compatibility.md lists every difference from jax.nn.

Layout (jax.nn's):
  query  [batch..., T, N, H]    T query positions, N query heads, depth H
  key    [batch..., S, K, H]    S key positions, K key/value heads (K divides N)
  value  [batch..., S, K, Hv]
  output [batch..., T, N, Hv]
  attention weights [batch..., N, T, S]; residual (log-sum-exp) [batch..., T, N]
A mask is boolean, True = may attend, broadcastable to [batch..., N, T, S].

Query t sits at key position t + query_offset: `is_causal` lets it attend
keys s <= t + query_offset and `local_window_size=(left, right)` keys within
[t + query_offset - left, t + query_offset + right]. The default offset 0 is
jax.nn's top-left alignment; `query_offset=S - T` puts the queries at the end
of the keys (bottom-right), as when decoding from a cache of S keys.

Four implementations compute the same thing (`implementation=`): "reference",
the explicit einsum/softmax below (the one to read, and the only one that
returns weights or applies dropout); "xla", jax.nn's XLA path; "cudnn",
jax.nn's cuDNN path (GPU only); "chunked", `qkv_jax.chunked.chunked_attention`,
a blocked online softmax whose memory grows as O(T x block) and which skips
the tiles that causality, a window or segment ids rule out. By default
`select_implementation` picks one by a written rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qkv_jax.chunked import chunked_attention, flatten_batch, per_example, window_pair

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

IMPLEMENTATIONS = ("reference", "xla", "cudnn", "chunked")
# From this many keys on, "chunked"; below, "reference" on CPU (forward-mode differentiable)
# and "xla" on accelerators. See select_implementation.
CHUNKED_MIN_KEYS = 64

_alignment_warned = False


def _warn_alignment(T: int, S: int, owner: str, stacklevel: int) -> None:
    """The one FutureWarning per process about causal masks with T != S changing alignment;
    `stacklevel` counts from this function to the user's call."""
    global _alignment_warned
    if _alignment_warned:
        return
    _alignment_warned = True
    warnings.warn(
        f"{owner}: a causal mask with T={T} queries and S={S} keys is now aligned top-left, as "
        f"jax.nn's (query t sees keys 0..t); it used to be aligned bottom-right (the queries as "
        f"the last T of the S positions). Pass query_offset=S - T (here {S - T}) for the old "
        f"alignment, or query_offset=0 to keep the new one without this warning.",
        FutureWarning,
        stacklevel=stacklevel,
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def causal_mask(T: int, S: int | None = None, *, query_offset: int | None = None) -> Array:
    """Boolean `[T, S]` mask, True where query t may attend key s: `s <= t + query_offset`.

    `query_offset` is the key position of query 0: 0 is jax.nn's top-left
    triangle (with S = T the usual lower triangle); `S - T` makes the T queries
    the last T of the S positions (decoding with a cache of S keys). Left out
    with T != S, it is 0 and a FutureWarning (once per process) says that this
    used to mean `S - T`.
    """
    S = T if S is None else S
    for name, n in (("T", T), ("S", S)):
        if not _is_int(n) or n <= 0:
            raise ValueError(f"causal_mask: {name} must be a positive int, got {n!r}")
    if query_offset is None:
        if T != S:
            _warn_alignment(T, S, "causal_mask", stacklevel=3)
        query_offset = 0
    if not _is_int(query_offset):
        raise ValueError(f"causal_mask: query_offset must be an int, got {query_offset!r}")
    query_pos = jnp.arange(T)[:, None] + query_offset  # (T, 1) key positions of the queries
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
    `query_seq_lengths=` for padded queries) gives the same result, skips the
    padding on the "chunked" path, and on a GPU in bf16/fp16 reaches cuDNN's
    padded kernel, where a mask becomes a `[batch, 1, T, S]` bias.
    """
    if not _is_int(max_len) or max_len <= 0:
        raise ValueError(f"padding_mask: max_len must be a positive int, got {max_len!r}")
    lengths = jnp.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"padding_mask: lengths must be integers, got dtype {lengths.dtype}")
    _check_length_values("padding_mask", "lengths", lengths, "max_len", max_len)
    positions = _lift(jnp.arange(max_len), lengths.ndim + 1)  # (1..., S)
    mask = positions < lengths[..., None]  # (batch..., S)
    return mask[..., None, None, :]  # (batch..., 1, 1, S)


def _lift(x: Array, rank: int) -> Array:
    """`x` with leading size-1 axes up to `rank` (explicit broadcasting, no rank promotion)."""
    return x.reshape((1,) * (rank - x.ndim) + x.shape)


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
    combined = jnp.broadcast_to(present[0], shape)
    for m in present[1:]:
        combined = combined & _lift(m, len(shape))
    return combined


class _Positions(NamedTuple):
    """Which (query, key) pairs the arguments other than `mask` and `bias` allow."""

    is_causal: bool
    window: tuple[int, int] | None  # (left, right)
    offset: int | Array  # key position of query 0: a static int, or ints [batch...]
    query_lengths: Array | None  # [batch...]
    key_lengths: Array | None  # [batch...]
    query_segments: Array | None  # [batch..., T]
    key_segments: Array | None  # [batch..., S]


def _per_batch(x: Any, rank: int) -> Any:
    """Per-example values broadcastable to `[batch...]` as `[batch...|1, 1, 1, 1]` (of `rank`
    = len(batch) + 3), to compare with positions; a Python int is returned as it is."""
    if _is_int(x):
        return x
    x = _lift(x, rank - 3)
    return x.reshape(*x.shape, 1, 1, 1)


def _position_masks(T: int, S: int, rank: int, positions: _Positions) -> list[Array]:
    """The boolean masks `positions` stands for, each of `rank` = len(batch) + 3 and
    broadcastable to `[batch..., 1, T, S]`."""
    constraints = (positions.window, positions.query_lengths, positions.key_lengths, positions.query_segments)
    if not positions.is_causal and all(c is None for c in constraints):
        return []
    lead = (1,) * (rank - 2)
    query_pos = jnp.arange(T).reshape(*lead, T, 1)  # (1..., T, 1)
    key_pos = jnp.arange(S).reshape(*lead, 1, S)  # (1..., 1, S)
    masks = []
    if positions.is_causal or positions.window is not None:
        at = query_pos + _per_batch(positions.offset, rank)  # (batch...|1, 1, T, 1) key positions
        if positions.is_causal:
            masks.append(key_pos <= at)
        if positions.window is not None:
            left, right = positions.window
            masks.append((key_pos >= at - left) & (key_pos <= at + right))
    if positions.query_lengths is not None:
        masks.append(query_pos < _per_batch(positions.query_lengths, rank))  # (batch..., 1, T, 1)
    if positions.key_lengths is not None:
        masks.append(key_pos < _per_batch(positions.key_lengths, rank))  # (batch..., 1, 1, S)
    if positions.query_segments is not None and positions.key_segments is not None:
        query_ids = _lift(positions.query_segments, rank - 2)[..., None, :, None]  # (batch..., 1, T, 1)
        key_ids = _lift(positions.key_segments, rank - 2)[..., None, None, :]  # (batch..., 1, 1, S)
        masks.append(query_ids == key_ids)
    return masks


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


def _validate_per_example(
    name: str, x: Array | None, target: tuple[int, ...], target_name: str, floating: bool = False
):
    """`x` (if given) must be integers (floating point with `floating`) broadcastable to
    `target`, e.g. the batch dims `[batch...]` or `[batch..., T]` (`target_name`)."""
    if x is None:
        return
    kind, right_kind = (
        ("floating point", _is_floating(x))
        if floating
        else (
            "integers",
            jnp.issubdtype(x.dtype, jnp.integer),
        )
    )
    if not right_kind:
        raise TypeError(f"dot_product_attention: {name} must be {kind}, got dtype {x.dtype}")
    try:
        fits = x.ndim <= len(target) and jnp.broadcast_shapes(x.shape, target) == target
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"dot_product_attention: {name} of shape {x.shape} does not broadcast to {target_name} {target}"
        )


def _validate_arrays(query, key, value) -> None:
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


class _Traced(NamedTuple):
    """The array arguments of `dot_product_attention` besides Q, K, V, bias and mask."""

    scale: Array | None  # an array scale (a Python number is static)
    query_lengths: Array | None
    key_lengths: Array | None
    offset: Array | None  # an array query_offset (an int is static)
    query_segments: Array | None
    key_segments: Array | None
    sinks: Array | None
    dropout_rng: Array | None


def _validate(query, key, value, bias, mask, traced: _Traced, dropout_rate: float) -> None:
    _validate_arrays(query, key, value)
    *batch, T, N, _ = query.shape
    S = key.shape[-3]
    batch = tuple(batch)
    if mask is not None:
        if mask.dtype != jnp.bool_:
            raise TypeError(
                f"dot_product_attention: mask must be boolean (True = may attend), got dtype "
                f"{mask.dtype}; pass an additive float mask as `bias` instead"
            )
        _check_broadcastable("mask", mask.shape, (*batch, N, T, S))
    if bias is not None:
        _check_broadcastable("bias", bias.shape, (*batch, N, T, S))
    for name, x in (
        ("query_seq_lengths", traced.query_lengths),
        ("key_value_seq_lengths", traced.key_lengths),
        ("query_offset", traced.offset),
    ):
        _validate_per_example(name, x, batch, "the batch dims")
    if (traced.query_segments is None) != (traced.key_segments is None):
        raise ValueError(
            "dot_product_attention: query_segment_ids and key_segment_ids must be given together, "
            f"got {'None' if traced.query_segments is None else 'an array'} and "
            f"{'None' if traced.key_segments is None else 'an array'}"
        )
    _validate_per_example("query_segment_ids", traced.query_segments, (*batch, T), "[batch..., T] =")
    _validate_per_example("key_segment_ids", traced.key_segments, (*batch, S), "[batch..., S] =")
    _validate_per_example("sinks", traced.sinks, (*batch, N), "[batch..., N] =", floating=True)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dot_product_attention: dropout_rate must be in [0, 1), got {dropout_rate}")
    if dropout_rate > 0.0 and traced.dropout_rng is None:
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


def _reference_attention(query, key, value, bias, allowed, sinks, options: dict):
    """The explicit path: the whole `[batch..., N, T, S]` logits, softmax, dropout.

    `allowed` is the boolean mask of every constraint (rank of the logits) or
    None, `sinks` `[batch...|1, N]` or None; `options` holds scale, soft_cap,
    dropout_rate, dropout_rng and precision. Returns the output
    `[batch..., T, N, Hv]`, the residual `[batch..., T, N]` and the weights.
    Handles non-finite keys and values itself.
    """
    *batch, T, N, _ = query.shape
    S, K = key.shape[-3], key.shape[-2]
    out_dtype = jnp.result_type(query, key, value)
    logits = _logits(query, key, bias, options["scale"], options["soft_cap"], options["precision"])
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    sink = None if sinks is None else sinks[..., None, None].astype(logits.dtype)  # (..., N, 1, 1)
    # Softmax that gives exact zeros for rows with no allowed key (and no sink).
    row_max = jnp.max(logits, axis=-1, keepdims=True)  # (..., N, T, 1)
    if sink is not None:
        row_max = jnp.maximum(row_max, sink)
    row_max = lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    unnormalized = jnp.exp(logits - row_max)
    denominator = jnp.sum(unnormalized, axis=-1, keepdims=True)
    if sink is not None:
        denominator = denominator + jnp.exp(sink - row_max)
    weights = unnormalized / jnp.where(denominator > 0, denominator, 1.0)  # (..., N, T, S)
    residual = jnp.where(denominator > 0, row_max + jnp.log(denominator), -jnp.inf)[..., 0]  # (..., N, T)

    blended = weights
    if options["dropout_rate"] > 0.0:
        keep = jax.random.bernoulli(options["dropout_rng"], 1.0 - options["dropout_rate"], weights.shape)
        blended = jnp.where(keep, weights / (1.0 - options["dropout_rate"]), 0.0)

    output = _contract_values(
        blended.reshape(*batch, K, N // K, T, S),
        value.astype(logits.dtype),
        logits.reshape(*batch, K, N // K, T, S),
        options["precision"],
    )  # (..., T, K, G, Hv)
    output = output.reshape(*batch, T, N, value.shape[-1]).astype(out_dtype)
    residual = lax.stop_gradient(jnp.swapaxes(residual, -1, -2)).astype(out_dtype)  # (..., T, N)
    return output, residual, weights.astype(out_dtype)


# ----------------------------------------------------------------------------- the jax.nn paths


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
    """The additive bias that stands for a False mask entry on the jax.nn paths.

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
    folded = jnp.zeros((1, 1, 1, 1), dtype) if bias is None else jnp.maximum(bias, masked / 2)
    if allowed is not None:
        folded = jnp.where(allowed, folded, masked)
    folded = folded.astype(dtype)
    if full_shape is not None:
        folded = jnp.broadcast_to(folded, (*folded.shape[:2], *full_shape))  # (B|1, N|1, T, S)
    return folded


def _jax_nn_call(query, key, value, bias, lengths, *, options: dict):
    """One `jax.nn.dot_product_attention` call: `[B, T, N, H]`, `[B, S, K, H]`, `[B, S, K, H]`,
    an additive bias `[B|1, N|1, T|1, S|1]` or None, int32 lengths `([B] | None, [B] | None)`.

    Returns `(output, residual or None)`. `options`: is_causal, window, scale,
    cudnn, return_residual and precision (a `jax_default_matmul_precision`
    value or None), set around the call, which traces every dot of jax.nn's
    "xla" kernel, and their transposes, with it; cuDNN's kernel runs at its own
    (bf16/fp16 inputs, float32 softmax).
    """
    query_lengths, key_lengths = lengths
    precision = options["precision"]
    context = contextlib.nullcontext() if precision is None else jax.default_matmul_precision(precision)
    with context:
        result = jax.nn.dot_product_attention(
            query,
            key,
            value,
            bias=bias,
            scale=options["scale"],
            is_causal=options["is_causal"],
            query_seq_lengths=query_lengths,
            key_value_seq_lengths=key_lengths,
            local_window_size=options["window"],
            implementation="cudnn" if options["cudnn"] else "xla",
            return_residual=options["return_residual"],
        )  # (B, T, N, H) [, (B, T, N)]
    return result if options["return_residual"] else (result, None)


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
    Returns `(output, residual or None)`, as `attend`.
    """
    key_finite, value_finite = jnp.isfinite(key), jnp.isfinite(value)
    key = jnp.where(key_finite, key, 0)
    output, residual = attend(query, key, jnp.where(value_finite, value, 0), bias, lengths)

    def reached():  # (B, T, N, Hv): True where an allowed key or value is bad
        bad_key = ~jnp.all(key_finite, axis=-1, keepdims=True)  # (B, S, K, 1)
        bad = (bad_key | ~value_finite).astype(value.dtype)  # (B, S, K, Hv)
        allowed = None
        if bias is not None:
            masked = _masked_logit(bias.dtype)
            allowed = jnp.where(lax.stop_gradient(bias) > masked, 0, masked).astype(bias.dtype)
        return attend(jnp.zeros_like(query), lax.stop_gradient(key), bad, allowed, lengths)[0] > 0

    all_finite = jnp.all(key_finite) & jnp.all(value_finite)
    nan_entries = lax.cond(all_finite, lambda: jnp.zeros(output.shape, jnp.bool_), reached)
    output = jnp.where(nan_entries, jnp.nan, output)
    return (output if empty_rows is None else jnp.where(empty_rows, 0, output)), residual


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
    flat = jnp.broadcast_to(per_example(lengths, batch), (math.prod(batch),))  # (B,)
    return jnp.clip(flat, 0, limit).astype(jnp.int32)


def _native(positions: _Positions, cudnn: bool) -> tuple[bool, tuple[int, int] | None]:
    """The causal flag and window handed to jax.nn itself: those of a static zero offset (jax.nn's
    alignment); for cuDNN a window only as jax.nn passes one on (a left window, or one with a
    causal mask and no lengths). Everything else is folded into the bias."""
    if not (_is_int(positions.offset) and positions.offset == 0):
        return False, None
    window = positions.window
    if cudnn and window is not None:
        left, right = window
        padded = positions.query_lengths is not None or positions.key_lengths is not None
        if left < 0 or not (right == 0 or (positions.is_causal and not padded)):
            window = None
    return positions.is_causal, window


def _rows_without_keys(T, S, rank, allowed, positions: _Positions, native, batch) -> Array | None:
    """`[B|1, T|1, N|1, 1]`: the unpadded query rows that may attend to no key, or None if
    none can be. jax.nn (and cuDNN) give such a row the mean of the values; this module zeros
    it. Padded queries (t >= query length) need nothing: both kernels already zero them.
    `allowed` holds what is folded into the bias (the mask, the bias's -inf entries, folded
    positions), `native` the causal flag and window jax.nn applies itself; key lengths too
    can leave a row without keys (a causal mask at a static zero offset cannot)."""
    if allowed is None and positions.key_lengths is None and native[1] is None:
        return None
    applied = _Positions(native[0], native[1], 0, None, positions.key_lengths, None, None)
    attended = combine_masks(allowed, *_position_masks(T, S, rank, applied))
    if attended is None:  # only a causal mask jax.nn applies: every row has key 0
        return None
    empty = ~jnp.any(attended, axis=-1)  # (batch...|1, N|1, T|1)
    if positions.query_lengths is not None:
        padding = _Positions(False, None, 0, positions.query_lengths, None, None, None)
        empty = empty & _position_masks(T, 1, rank, padding)[0][..., 0]  # (batch..., N|1, T)
    empty = flatten_batch(empty[..., None], batch)[..., 0]  # (B|1, N|1, T|1)
    return jnp.swapaxes(empty, -1, -2)[..., None]  # (B|1, T|1, N|1, 1)


def _xla_attention(query, key, value, bias, mask, positions: _Positions, options: dict):
    """`jax.nn.dot_product_attention` ("xla" or, with `options["cudnn"]`, "cudnn") with this
    module's conventions; returns `(output, residual or None)`.

    jax.nn wants one dtype, one batch axis and a static scale, and gives a row
    with no allowed key the mean of the values. So: inputs are cast to their
    result dtype and the batch dims flattened (reshapes of contiguous arrays:
    no copies); a traced scale is multiplied into the queries; the causal mask
    and the window go to jax.nn as they are when the offset is a static 0
    (`_native`), else into the mask; offsets, segment ids, the mask and the
    bias (its -inf entries included) become one additive bias
    (`_fold_into_bias`); rows with no key and non-finite keys and values are
    handled by `_fast_when_finite`. Lengths go to jax.nn as they are. The
    residual of a row that attends nothing is -inf.
    """
    *batch, T, N, _ = query.shape
    S, Hv = key.shape[-3], value.shape[-1]
    batch, rank = tuple(batch), len(batch) + 3
    cudnn = options["cudnn"]
    out_dtype = jnp.result_type(query, key, value)
    dtype = _jax_nn_dtype(out_dtype, cudnn)
    query, key, value = (x.astype(dtype).reshape(-1, *x.shape[-3:]) for x in (query, key, value))
    scale = options["scale"]
    if not isinstance(scale, (int, float)):  # traced: jax.nn takes a static scale
        query, scale = (query * scale).astype(dtype), 1.0
    native = _native(positions, cudnn)
    folded = positions._replace(
        is_causal=positions.is_causal and not native[0],
        window=None if native[1] is not None else positions.window,
        query_lengths=None,
        key_lengths=None,
    )
    allowed = combine_masks(
        mask, *_position_masks(T, S, rank, folded), None if bias is None else bias > -jnp.inf
    )
    empty_rows = _rows_without_keys(T, S, rank, allowed, positions, native, batch)
    allowed = None if allowed is None else flatten_batch(allowed, batch)  # (B|1, N|1, T|1, S|1)
    bias = None if bias is None else flatten_batch(bias, batch)  # (B|1, N|1, T|1, S|1)
    bias_dtype = dtype if cudnn else jnp.promote_types(dtype, jnp.float32)
    folded_bias = _fold_into_bias(allowed, bias, bias_dtype, (T, S) if cudnn else None)
    lengths = tuple(
        _flat_lengths(n, batch, limit)
        for n, limit in ((positions.query_lengths, T), (positions.key_lengths, S))
    )
    call_options = dict(options, is_causal=native[0], window=native[1], scale=float(scale))
    attend = functools.partial(_jax_nn_call, options=call_options)
    output, residual = _fast_when_finite(attend, query, key, value, folded_bias, lengths, empty_rows)
    output = output.reshape(*batch, T, N, Hv).astype(out_dtype)  # (batch..., T, N, Hv)
    if residual is None:
        return output, None
    return output, _residual_where_attended(residual, empty_rows, lengths[0], batch).astype(out_dtype)


def _jax_nn_dtype(dtype, cudnn: bool):
    """The dtype jax.nn computes in: the inputs', except float16 on a CPU for "xla", which
    runs in float32. jax.nn asks for an F16_F16_F32 dot there that XLA:CPU cannot compile;
    called eagerly it catches that and falls back to a float32-accumulating dot, but inside
    `jax.jit` (as here) the failure comes when the program is compiled, too late to catch."""
    if dtype == jnp.float16 and not cudnn and jax.default_backend() == "cpu":
        return jnp.float32
    return dtype


def _residual_where_attended(residual: Array, empty_rows, query_lengths, batch) -> Array:
    """jax.nn's residual `[B, T, N]` with -inf where a row attends nothing (jax.nn's large
    negative logits give those rows a finite log-sum-exp), as `[batch..., T, N]`."""
    B, T, N = residual.shape
    nothing = jnp.zeros((1, 1, 1), jnp.bool_)
    if empty_rows is not None:
        nothing = nothing | empty_rows[..., 0]  # (B|1, T|1, N|1)
    if query_lengths is not None:
        nothing = nothing | (jnp.arange(T)[None, :] >= query_lengths[:, None])[..., None]  # (B, T, 1)
    residual = jnp.where(nothing, -jnp.inf, residual)
    return residual.reshape(*batch, T, N)


def _cudnn_applies(query, key, value, has_bias: bool, platform: str) -> bool:
    """Whether jax.nn's cuDNN kernel takes these inputs (jax's cuDNN checks).

    On a GPU, for bf16/fp16 with H = Hv a multiple of 8 up to 128 (cuDNN takes
    256 from Hopper on; 128 holds everywhere). A mask, a bias and a causal
    mask with an offset reach cuDNN as one additive bias `[B|1, N|1, T, S]`,
    and cuDNN's backward pass with a bias needs even T and S.
    """
    T, S = query.shape[-3], key.shape[-3]
    H, Hv = key.shape[-1], value.shape[-1]
    return (
        platform == "gpu"
        and jnp.result_type(query, key, value) in (jnp.bfloat16, jnp.float16)
        and H == Hv
        and H % 8 == 0
        and H <= 128
        and not (has_bias and (T % 2 or S % 2))
    )


# ----------------------------------------------------------------------------- dispatch


def _ineligibility(implementation, query, key, value, features: dict) -> str | None:
    """Why `implementation` cannot compute this call exactly, or None if it can.

    `features`: dropout_rate, return_weights, soft_cap and has_sinks of the call.
    """
    if implementation == "reference":
        return None
    if features["return_weights"]:
        return "cannot return attention weights (only 'reference' can)"
    if features["dropout_rate"] > 0.0:
        return f"does not implement dropout (dropout_rate={features['dropout_rate']}; only 'reference' does)"
    if implementation == "chunked":
        return None
    if features["soft_cap"] is not None:
        return (
            f"has no logits_soft_cap (jax.nn has none; got {features['soft_cap']}): "
            "use 'reference' or 'chunked'"
        )
    if features["has_sinks"]:
        return "has no sinks (jax.nn has none): use 'reference' or 'chunked'"
    if implementation == "xla":
        H, Hv = key.shape[-1], value.shape[-1]
        if H != Hv:
            return f"needs value depth Hv equal to key depth H (jax.nn), got Hv={Hv} and H={H}"
        if jnp.result_type(query, key, value) == jnp.float64:
            return "computes the softmax in float32 (jax.nn), so it cannot serve float64 inputs"
    return None


def select_implementation(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    is_causal: bool = False,
    local_window_size: Any = None,
    query_offset: Any = None,
    query_segment_ids: Any = None,
    key_segment_ids: Any = None,
    logits_soft_cap: Any = None,
    sinks: Any = None,
    dropout_rate: float = 0.0,
    return_weights: bool = False,
    platform: str | None = None,
) -> str:
    """The path `dot_product_attention(..., implementation=None)` takes.

    Arguments as for `dot_product_attention`; arrays need only `.shape` and
    `.dtype` (`jax.ShapeDtypeStruct` will do), and of the optional ones only
    whether they are given matters (and of `query_offset` whether it is a
    static 0; sequence lengths, `scale`, `return_residual` and `precision` do
    not change the path). `platform` defaults to `jax.default_backend()`. The rule:

    1. `return_weights` or `dropout_rate > 0`: "reference", the only path that
       does either.
    2. On a GPU where cuDNN's fused kernel applies: "cudnn". That is bf16/fp16
       with H = Hv a multiple of 8 up to 128, with or without causal masking
       and lengths; a mask, a bias or causal with a query offset (all passed
       to cuDNN as one additive bias `[batch, N|1, T, S]`) need even T and S.
       Padding given as lengths costs no bias. Not with a soft cap or sinks
       (jax.nn has neither), nor with a local window or segment ids: cuDNN
       takes a window and could take segments as a bias, but that its window
       and its top-left alignment for T != S mean the same as here has not
       been checked on a GPU (benchmarks/gpu_check.sh compares both with the
       reference, to be run before this rule sends them there); they go on.
    3. At least `CHUNKED_MIN_KEYS` keys: "chunked". On CPU it is the fastest
       path from there on, forward and backward, and its tiles keep every
       buffer a call allocates small, under glibc's mmap threshold, where
       pages do not fault in afresh on every call
       (`python benchmarks/attention.py --library-user`,
       benchmarks/results/attention_library_user.json); with a window or
       segment ids it skips the tiles they rule out
       (`python benchmarks/attention.py --window`).
    4. Fewer keys: "reference" on CPU, the one path that is also
       forward-mode differentiable ("chunked" is faster from 16 keys on, by
       under 0.5 ms forward and 2 ms forward+backward at batch 8 x 8 heads);
       "xla" on accelerators when eligible (H = Hv, not float64, no soft cap
       or sinks), else "reference".

    Steps 2 and 4 follow GPU measurements (cuDNN 10-20x faster than "chunked"
    on an H200, masked or not); benchmarks/gpu.sh measures them and
    benchmarks/gpu_check.sh checks every case of step 2 against the reference
    on the GPU.
    """
    if return_weights or dropout_rate > 0.0:
        return "reference"
    platform = jax.default_backend() if platform is None else platform
    jax_nn_can = logits_soft_cap is None and sinks is None
    unchecked_on_cudnn = (
        local_window_size is not None or query_segment_ids is not None or key_segment_ids is not None
    )
    offset_folded = is_causal and not (query_offset is None or (_is_int(query_offset) and query_offset == 0))
    has_bias = mask is not None or bias is not None or offset_folded
    if jax_nn_can and not unchecked_on_cudnn and _cudnn_applies(query, key, value, has_bias, platform):
        return "cudnn"
    if key.shape[-3] >= CHUNKED_MIN_KEYS:
        return "chunked"
    features = dict(
        dropout_rate=0.0, return_weights=False, soft_cap=logits_soft_cap, has_sinks=sinks is not None
    )
    if platform != "cpu" and _ineligibility("xla", query, key, value, features) is None:
        return "xla"
    return "reference"


@dataclasses.dataclass(frozen=True)
class _Static:
    """The arguments of `dot_product_attention` that shape the program (jit-static)."""

    is_causal: bool
    scale: float | None  # a Python-number scale, compiled in (cuDNN takes no traced one)
    window: tuple[int, int] | None
    offset: int | None  # a static query offset; None when it is an array (traced)
    soft_cap: float | None
    dropout_rate: float
    return_residual: bool
    return_weights: bool
    implementation: str | None
    precision: Any


def _checked_implementation(static: _Static, query, key, value, bias, mask, traced: _Traced) -> str:
    """The path that runs: the one asked for, or the rule's; raises if it cannot compute the call."""
    implementation = static.implementation
    if implementation is None:
        implementation = select_implementation(
            query,
            key,
            value,
            bias,
            mask,
            is_causal=static.is_causal,
            local_window_size=static.window,
            query_offset=static.offset if traced.offset is None else traced.offset,
            query_segment_ids=traced.query_segments,
            key_segment_ids=traced.key_segments,
            logits_soft_cap=static.soft_cap,
            sinks=traced.sinks,
            dropout_rate=static.dropout_rate,
            return_weights=static.return_weights,
        )
    elif implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"dot_product_attention: implementation must be None or one of {IMPLEMENTATIONS}, "
            f"got {implementation!r}"
        )
    features = dict(
        dropout_rate=static.dropout_rate,
        return_weights=static.return_weights,
        soft_cap=static.soft_cap,
        has_sinks=traced.sinks is not None,
    )
    reason = _ineligibility(implementation, query, key, value, features)
    if reason is not None:
        raise ValueError(f"dot_product_attention: implementation={implementation!r} {reason}")
    return implementation


def _run(implementation: str, query, key, value, bias, mask, traced: _Traced, static: _Static, scale):
    """`(output, residual, weights)` of one path (the weights from "reference" only), with
    `bias` and `mask` of the logits' rank."""
    positions = _Positions(
        static.is_causal,
        static.window,
        traced.offset if traced.offset is not None else (static.offset or 0),
        traced.query_lengths,
        traced.key_lengths,
        traced.query_segments,
        traced.key_segments,
    )
    if implementation == "reference":
        rank = query.ndim
        allowed = combine_masks(mask, *_position_masks(query.shape[-3], key.shape[-3], rank, positions))
        sinks = None if traced.sinks is None else _lift(traced.sinks, rank - 2)  # (batch...|1, N)
        options = dict(
            scale=scale,
            soft_cap=static.soft_cap,
            dropout_rate=static.dropout_rate,
            dropout_rng=traced.dropout_rng,
            precision=static.precision,
        )
        return _reference_attention(query, key, value, bias, allowed, sinks, options)
    if implementation == "chunked":
        output, residual = chunked_attention(
            query,
            key,
            value,
            bias,
            mask,
            is_causal=static.is_causal,
            scale=scale,
            query_seq_lengths=positions.query_lengths,
            key_value_seq_lengths=positions.key_lengths,
            local_window_size=static.window,
            query_offset=positions.offset,
            query_segment_ids=positions.query_segments,
            key_segment_ids=positions.key_segments,
            logits_soft_cap=static.soft_cap,
            sinks=traced.sinks,
            return_residual=True,
            precision=static.precision,
        )
        return output, residual, None
    options = dict(
        cudnn=implementation == "cudnn",
        scale=scale,
        precision=_matmul_precision_name(static.precision),
        return_residual=static.return_residual,
    )
    return (*_xla_attention(query, key, value, bias, mask, positions, options), None)


def _attention(query, key, value, bias, mask, traced: _Traced, *, static: _Static):
    """`dot_product_attention` under `jax.jit`."""
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    bias, mask = (None if x is None else jnp.asarray(x) for x in (bias, mask))
    traced = _Traced(*(None if x is None else jnp.asarray(x) for x in traced))
    _validate(query, key, value, bias, mask, traced, static.dropout_rate)
    bias, mask = (
        None if x is None else _lift(x, query.ndim) for x in (bias, mask)
    )  # (batch...|1, N|1, T|1, S|1)
    implementation = _checked_implementation(static, query, key, value, bias, mask, traced)
    scale = static.scale if static.scale is not None else traced.scale
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    output, residual, weights = _run(implementation, query, key, value, bias, mask, traced, static, scale)
    if not (static.return_residual or static.return_weights):
        return output
    return (
        output,
        *((residual,) if static.return_residual else ()),
        *((weights,) if static.return_weights else ()),
    )


_jitted_attention = jax.jit(_attention, static_argnames=("static",))


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _static_offset(query_offset: Any, is_causal: bool, query: Any, key: Any) -> tuple[int | None, Any]:
    """`(static offset, traced offset)`: an int is static, an array traced; None is a static 0,
    with the FutureWarning where it changed meaning (is_causal with T != S)."""
    if query_offset is None:
        if is_causal and np.ndim(query) >= 3 and np.ndim(key) >= 3:  # else _validate names the rank
            T, S = np.shape(query)[-3], np.shape(key)[-3]
            if T != S:
                _warn_alignment(T, S, "dot_product_attention", stacklevel=4)
        return 0, None
    if _is_int(query_offset):
        return int(query_offset), None
    return None, query_offset


def _static_soft_cap(logits_soft_cap: Any) -> float | None:
    if logits_soft_cap is None:
        return None
    if not _is_number(logits_soft_cap) or not logits_soft_cap > 0:
        raise ValueError(
            "dot_product_attention: logits_soft_cap must be None or a positive number, "
            f"got {logits_soft_cap!r}"
        )
    return float(logits_soft_cap)


def dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    scale: Any = None,
    is_causal: bool = False,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    query_offset: Any = None,
    query_segment_ids: Any = None,
    key_segment_ids: Any = None,
    logits_soft_cap: float | None = None,
    sinks: Any = None,
    dropout_rate: float = 0.0,
    dropout_rng: Any = None,
    return_weights: bool = False,
    precision: PrecisionLike = None,
):
    """softmax(Q K^T * scale + bias, masked) V for query heads sharing kv heads.

    jax.nn.dot_product_attention's arguments, in its order and with its meanings:

      query: `[batch..., T, N, H]` (any number of batch dims, none included).
      key: `[batch..., S, K, H]`; K must divide N. Query head n reads kv head
        `n // (N // K)` (grouped-query attention; K = 1 is multi-query).
      value: `[batch..., S, K, Hv]`.
      bias: optional additive logits bias broadcastable to `[batch..., N, T, S]`;
        `-inf` entries act like a False mask.
      mask: optional boolean, True = may attend, broadcastable to
        `[batch..., N, T, S]`.
      scale: multiplies the logits; defaults to `1/sqrt(H)`. A Python number
        is compiled in (as cuDNN needs); an array is traced, and differentiable.
      is_causal: query t may attend key s only when `s <= t + query_offset`:
        jax.nn's top-left triangle (offset 0). A call with T != S that leaves
        `query_offset` out gets a FutureWarning (once per process): this used
        to mean the bottom-right triangle, now `query_offset=S - T`.
      query_seq_lengths: optional integer lengths `[batch...]`: queries
        t >= length are padding, with zero output and no gradient.
      key_value_seq_lengths: optional integer lengths `[batch...]`: keys
        s >= length are never attended. Prefer lengths to a padding mask: the
        chunked path skips the padding, and cuDNN on a GPU. Both must lie in
        [0, T] and [0, S] (checked when concrete).
      local_window_size: None, an int w (= (w, w)) or (left, right): query t
        may attend key s only when
        `t + query_offset - left <= s <= t + query_offset + right`.
      implementation: which computation runs; all give the same result up to
        rounding, in outputs and gradients.
        "reference": the explicit einsum/softmax over the whole logits; the
          only one that returns weights or applies dropout.
        "xla": jax.nn's "xla" path (never cuDNN); needs Hv == H, not float64.
        "cudnn": jax.nn's "cudnn" path (a GPU with cuDNN; elsewhere it raises
          what jax.nn raises).
        "chunked": `qkv_jax.chunked.chunked_attention`, blocked online
          softmax with memory O(T x block), skipping the tiles that causality,
          a window, lengths or segment ids rule out.
        None: `select_implementation`'s rule (see there): "reference" for
          weights or dropout; "cudnn" on a GPU where it applies; "chunked"
          from `CHUNKED_MIN_KEYS` keys; below that "reference" on CPU, "xla"
          (when eligible) on accelerators.
        "xla" and "cudnn" have no soft cap and no sinks (jax.nn has neither);
        asking for a path that cannot compute the call raises ValueError.
        Reverse-mode differentiable everywhere; forward mode on "reference".
      return_residual: also return the residual, the log-sum-exp of each row's
        logits (the log of the softmax's normaliser, sinks included)
        `[batch..., T, N]`, as jax.nn does; -inf for a row that attends no key
        and has no sink (with a sink: the sink's logit). It passes no gradient.

    qkv_jax's own (keyword-only):

      query_offset: the key position of query 0, shifting `is_causal` and
        `local_window_size`: a Python int (static), or integers broadcastable
        to `[batch...]` (traced, e.g. a KV cache's fill index). None means 0.
        `S - T` aligns the queries bottom-right (the last T of S positions).
      query_segment_ids, key_segment_ids: optional integers `[batch..., T]` and
        `[batch..., S]`, given together: query t may attend key s only when
        their ids are equal (packed sequences).
      logits_soft_cap: optional positive c: the scaled, biased logits become
        `c * tanh(logits / c)` before masking (differentiable through tanh).
      sinks: optional float logits `[N]` or `[batch..., N]` (broadcastable),
        one per query head, added to the softmax's normaliser: a sink takes
        weight from the keys and contributes no value. A row with no allowed
        key but a sink has zero output and all its weight on the sink.
        Differentiable.
      dropout_rate: inverted dropout on the attention weights (needs dropout_rng).
      dropout_rng: a PRNG key, used only when dropout_rate > 0.
      return_weights: also return the attention weights `[batch..., N, T, S]`
        of the real keys, taken after the softmax and before dropout (a row's
        weights sum to 1 minus its sink's weight, 0 where it attends nothing).
      precision: matmul precision of every dot, forward and backward, as flax
        spells it: None (JAX's default, i.e. `jax_default_matmul_precision`),
        'default' / 'high' / 'highest' (or 'bfloat16' / 'tensorfloat32' /
        'float32'), a `jax.lax.Precision`, or a pair of them. On Ampere and
        newer GPUs JAX's default runs float32 matmuls in TF32; 'highest' keeps
        them float32. jax.nn has no precision argument, so its paths set
        `jax.default_matmul_precision` around the call (a pair: the higher of
        the two); cuDNN's kernel ignores it (bf16/fp16 inputs).

    Returns:
      `[batch..., T, N, Hv]` in the inputs' dtype; with `return_residual` and/or
      `return_weights`, a tuple `(output, residual, weights)` of those asked
      for, in that order. A query row with no allowed key gets zero output and
      zero weights (jax.nn gives it the mean of the values). The logits and
      softmax are computed in at least float32. A NaN or inf in a key or value
      that is masked out never reaches the output.

    The function is jit-compiled (`is_causal`, a numeric `scale`, the window,
    an int offset, the soft cap, `dropout_rate`, `return_residual`,
    `return_weights`, `implementation` and `precision` are static), so eager
    calls compile once per shape.
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
    static_offset, traced_offset = _static_offset(query_offset, is_causal, query, key)
    if isinstance(precision, list):
        precision = tuple(precision)
    static = _Static(
        is_causal=bool(is_causal),
        scale=static_scale,
        window=window_pair(local_window_size, "dot_product_attention"),
        offset=static_offset,
        soft_cap=_static_soft_cap(logits_soft_cap),
        dropout_rate=dropout_rate,
        return_residual=bool(return_residual),
        return_weights=bool(return_weights),
        implementation=implementation,
        precision=precision,
    )
    traced = _Traced(
        scale,
        query_seq_lengths,
        key_value_seq_lengths,
        traced_offset,
        query_segment_ids,
        key_segment_ids,
        sinks,
        dropout_rng,
    )
    return _jitted_attention(query, key, value, bias, mask, traced, static=static)
