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

Three implementations compute the same thing (`implementation=`): "reference",
the explicit einsum/softmax below (the one to read, and the only one that
returns weights or applies dropout); "xla", `jax.nn.dot_product_attention`
(cuDNN on a GPU); "chunked", `qkv_jax.chunked.chunked_attention`, a blocked
online softmax whose memory grows as O(T x block). By default
`select_implementation` picks one by a written rule.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qkv_jax.chunked import chunked_attention, flatten_batch

Array = jax.Array

__all__ = [
    "dot_product_attention",
    "select_implementation",
    "IMPLEMENTATIONS",
    "CHUNKED_MIN_KEYS",
    "causal_mask",
    "padding_mask",
    "combine_masks",
]

IMPLEMENTATIONS = ("reference", "xla", "chunked")
# From this many keys on, "chunked" is faster than "reference" on CPU, forward
# and backward (python benchmarks/attention.py --lengths 32,64,128; fewer keys
# favour the reference's backward). See select_implementation.
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


def _contract_values(weights: Array, value: Array, logits: Array) -> Array:
    """Blend values: `weights` [..., K, G, T, S] times `value` [..., S, K, Hv].

    A non-finite value at a position a query may not attend to must not reach
    that query's output (0 * nan is nan in IEEE arithmetic), while one at an
    allowed position (logit > -inf, `logits` [..., K, G, T, S]) must still
    poison it. Values are blended with non-finite entries zeroed; the outputs
    to poison are found, outside differentiation, only when some value is
    non-finite.
    """
    finite = jnp.isfinite(value)
    output = jnp.einsum("...kgts,...skh->...tkgh", weights, jnp.where(finite, value, 0))  # (..., T, K, G, Hv)

    def poisoned():
        allowed = (lax.stop_gradient(logits) > -jnp.inf).astype(weights.dtype)
        bad = (~finite).astype(weights.dtype)
        return jnp.einsum("...kgts,...skh->...tkgh", allowed, bad) > 0  # (..., T, K, G, Hv)

    poison = lax.cond(jnp.all(finite), lambda: jnp.zeros(output.shape, jnp.bool_), poisoned)
    return jnp.where(poison, jnp.nan, output)


def _reference_attention(
    query, key, value, mask, bias, is_causal, scale, dropout_rate, dropout_rng, return_weights
):
    """The explicit path: the whole `[batch..., N, T, S]` logits, softmax, dropout.

    Arguments as `dot_product_attention` (validated, `scale` resolved). Handles
    non-finite keys and values itself.
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

    output = _contract_values(
        blended.reshape(*batch, K, G, T, S),
        value.astype(compute_dtype),
        logits.reshape(*batch, K, G, T, S),
    )  # (..., T, K, G, Hv)
    output = output.reshape(*batch, T, N, value.shape[-1]).astype(out_dtype)
    if return_weights:
        return output, weights.astype(out_dtype)
    return output


def _xla_attention(query, key, value, mask, bias, scale, *, is_causal):
    """`jax.nn.dot_product_attention` with this module's conventions, for finite keys and values.

    jax.nn aligns the causal triangle top-left, gives a row with no allowed key
    equal weight on every key (or NaN when its bias is all -inf), and wants one
    dtype and one batch axis. So: the bottom-right triangle goes into the mask
    when T != S, -inf bias entries become False mask entries, rows with no
    allowed key are set to zero, inputs are cast to their result dtype and the
    batch dims flattened. On a GPU, cuDNN's fused kernel is used when it
    applies (`_cudnn_applies`).
    """
    *batch, T, N, _ = query.shape
    S = key.shape[-3]
    dtype = jnp.result_type(query, key, value)
    query, key, value = (x.astype(dtype).reshape(-1, *x.shape[-3:]) for x in (query, key, value))
    allowed = combine_masks(mask, causal_mask(T, S) if is_causal and T != S else None)
    if bias is not None:
        finite = bias > -jnp.inf
        allowed = combine_masks(allowed, finite)
        bias = flatten_batch(jnp.where(finite, bias, 0), tuple(batch))  # (B|1, N|1, T|1, S|1)
    allowed = None if allowed is None else flatten_batch(allowed, tuple(batch))
    platform = jax.default_backend()
    cudnn = _cudnn_applies(query, key, value, allowed, bias, False, platform)
    backend: Literal["cudnn", "xla"] = "cudnn" if cudnn else "xla"
    if backend == "cudnn":  # cuDNN takes a static scale: scale the queries instead
        query, scale = (query * scale).astype(dtype), 1.0
    output = jax.nn.dot_product_attention(
        query,
        key,
        value,
        bias=bias,
        mask=allowed,
        scale=scale,
        is_causal=is_causal and T == S,
        implementation=backend,
    )  # (B, T, N, Hv)
    if allowed is not None:
        attended = allowed & causal_mask(T, S) if is_causal and T == S else allowed
        has_key = jnp.any(attended, axis=-1)  # (B|1, N|1, T|1)
        output = jnp.where(jnp.swapaxes(has_key, -1, -2)[..., None], output, 0)
    return output.reshape(*batch, T, N, value.shape[-1])


def _cudnn_applies(query, key, value, mask, bias, is_causal, platform) -> bool:
    """Whether the "xla" path runs cuDNN's fused kernel for these inputs.

    On a GPU, for bf16/fp16 with H = Hv a multiple of 8 up to 128, no mask or
    bias, and a causal triangle only when T == S (cuDNN's is top-left aligned).
    """
    H, Hv = key.shape[-1], value.shape[-1]
    return (
        platform == "gpu"
        and jnp.result_type(query, key, value) in (jnp.bfloat16, jnp.float16)
        and H == Hv
        and H % 8 == 0
        and H <= 128
        and mask is None
        and bias is None
        and not (is_causal and query.shape[-3] != key.shape[-3])
    )


def _with_non_finite_semantics(attend, query, key, value, mask, bias, scale):
    """Runs `attend(query, key, value, mask, bias, scale)`, exact for finite keys
    and values, with the reference path's NaN/inf rules.

    Non-finite keys and values are zeroed before `attend`, so where they are
    masked out they reach neither the output nor the gradients. Where they may
    be attended to, the output is NaN as in the reference: the whole row for a
    non-finite key, the channel for a non-finite value. One more call of
    `attend` finds those entries: with scale 0 and no bias every allowed key
    gets the same weight, so blending a 0/1 indicator of bad entries is
    positive exactly where one is attended. It runs only when a bad entry
    exists (`lax.cond`; under `vmap`, where the condition is batched, it always
    runs). Gradients through NaN outputs are zero, not NaN; and a bad key that
    only a -inf bias (no mask) hides stays hidden, where the reference path's
    row turns NaN.
    """
    key_finite, value_finite = jnp.isfinite(key), jnp.isfinite(value)
    key = jnp.where(key_finite, key, 0)
    output = attend(query, key, jnp.where(value_finite, value, 0), mask, bias, scale)

    def reached():  # (..., T, N, Hv): True where an allowed key or value is bad
        bad_key = ~jnp.all(key_finite, axis=-1, keepdims=True)  # (..., S, K, 1)
        bad = (bad_key | ~value_finite).astype(jnp.float32)  # (..., S, K, Hv)
        allowed = mask if bias is None else combine_masks(mask, bias > -jnp.inf)
        query_, key_ = lax.stop_gradient(query), lax.stop_gradient(key)
        return attend(query_, key_, bad, allowed, None, 0.0) > 0

    all_finite = jnp.all(key_finite) & jnp.all(value_finite)
    nan_entries = lax.cond(all_finite, lambda: jnp.zeros(output.shape, jnp.bool_), reached)
    return jnp.where(nan_entries, jnp.nan, output)


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
    whether they are given matters. `platform` defaults to
    `jax.default_backend()`. The rule:

    1. `return_weights` or `dropout_rate > 0`: "reference", the only path that
       does either.
    2. On a GPU where cuDNN's fused kernel applies (bf16/fp16, H = Hv a
       multiple of 8 up to 128, no mask or bias, causal only with T == S):
       "xla", which hands the call to cuDNN.
    3. At least `CHUNKED_MIN_KEYS` keys: "chunked". On CPU it is the fastest
       path from there on, forward and backward, and its memory does not grow
       with T x S (benchmarks/results/attention.json).
    4. Fewer keys: "reference" on CPU, which there is about as fast forward
       and faster backward; "xla" on accelerators when eligible (H = Hv, not
       float64), else "reference".

    Steps 2 and 4 for accelerators follow jax.nn's and cuDNN's purpose, not a
    measurement on this project's machines; benchmarks/gpu.sh measures them.
    """
    if return_weights or dropout_rate > 0.0:
        return "reference"
    platform = jax.default_backend() if platform is None else platform
    if _cudnn_applies(query, key, value, mask, bias, is_causal, platform):
        return "xla"
    if key.shape[-3] >= CHUNKED_MIN_KEYS:
        return "chunked"
    if platform != "cpu" and _ineligibility("xla", query, key, value, 0.0, False, platform) is None:
        return "xla"
    return "reference"


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
    implementation: str | None = None,
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
      implementation: which computation runs; all give the same result up to
        rounding, in outputs and gradients.
        "reference": the explicit einsum/softmax over the whole logits; the
          only one that returns weights or applies dropout.
        "xla": `jax.nn.dot_product_attention` (cuDNN on a GPU when it
          applies); needs Hv == H, not float64, not float16 on CPU.
        "chunked": `qkv_jax.chunked.chunked_attention`, blocked online
          softmax with memory O(T x block).
        None: `select_implementation`'s rule (see there): "reference" for
          weights or dropout; "xla" on a GPU where cuDNN applies; "chunked"
          from `CHUNKED_MIN_KEYS` keys; below that "reference" on CPU, "xla"
          (when eligible) on accelerators.
        Asking for a path that cannot compute the call raises ValueError.

    Returns:
      `[batch..., T, N, Hv]` in the inputs' dtype, and the weights if asked.
      A query row with no allowed key gets zero weights and zero output. The
      logits and softmax are computed in at least float32. A NaN or inf in a
      key or value that is masked out never reaches the output.

    The function is jit-compiled (`is_causal`, `dropout_rate`, `return_weights`
    and `implementation` are static), so eager calls compile once per shape.
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    mask = None if mask is None else jnp.asarray(mask)
    bias = None if bias is None else jnp.asarray(bias)
    _validate(query, key, value, mask, bias, dropout_rate, dropout_rng)
    if implementation is None:
        implementation = select_implementation(
            query,
            key,
            value,
            mask=mask,
            bias=bias,
            is_causal=is_causal,
            dropout_rate=dropout_rate,
            return_weights=return_weights,
        )
    elif implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"dot_product_attention: implementation must be None or one of {IMPLEMENTATIONS}, "
            f"got {implementation!r}"
        )
    reason = _ineligibility(
        implementation, query, key, value, dropout_rate, return_weights, jax.default_backend()
    )
    if reason is not None:
        raise ValueError(f"dot_product_attention: implementation={implementation!r} {reason}")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if implementation == "reference":
        return _reference_attention(
            query, key, value, mask, bias, is_causal, scale, dropout_rate, dropout_rng, return_weights
        )
    if implementation == "chunked":
        return chunked_attention(query, key, value, mask=mask, bias=bias, is_causal=is_causal, scale=scale)
    return _with_non_finite_semantics(
        functools.partial(_xla_attention, is_causal=is_causal), query, key, value, mask, bias, scale
    )


dot_product_attention = jax.jit(
    _dot_product_attention,
    static_argnames=("is_causal", "dropout_rate", "return_weights", "implementation"),
)
