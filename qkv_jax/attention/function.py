"""`dot_product_attention`: its checks, its static options, and the call of one path."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qkv_jax.attention.chunked import chunked_attention
from qkv_jax.attention.dispatch import accelerator_block_sizes, call_features, check_call, choose
from qkv_jax.attention.jax_nn import jax_nn_attention, matmul_precision_name
from qkv_jax.attention.options import CallOptions, PrecisionLike, check_soft_cap, is_number
from qkv_jax.attention.pallas import pallas_attention
from qkv_jax.attention.reference import reference_attention
from qkv_jax.attention.splash import splash_attention
from qkv_jax.attention.visibility import (
    KeyVisibility,
    check_length_values,
    is_int,
    lift,
    visible_keys,
    warn_alignment,
    window_pair,
)

Array = jax.Array

__all__ = ["dot_product_attention"]


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


def _implementation(options: CallOptions, query, key, value, bias, mask, traced: _Traced) -> str:
    """The path that runs: the one asked for, or the rule's; raises if it cannot compute the call."""
    arrays = dict(
        bias=bias,
        mask=mask,
        query_offset=traced.offset,
        query_segment_ids=traced.query_segments,
        key_segment_ids=traced.key_segments,
        sinks=traced.sinks,
    )
    features = call_features(options, arrays)
    if options.implementation is None:
        return choose(query, key, value, features, platform=jax.default_backend())
    check_call(options.implementation, query, key, value, features)
    return options.implementation


def _pallas_precision(precision: PrecisionLike) -> str | None:
    """The call's precision as "pallas" takes it: 'highest' (None too), 'high' or 'default';
    a `DotAlgorithmPreset` runs as 'highest'."""
    name = matmul_precision_name(precision)
    return name if name in (None, "highest", "high", "default") else "highest"


def _run(implementation: str, query, key, value, bias, keys: KeyVisibility, traced, options, scale):
    """`(output, residual, weights)` of one path (the weights from "reference" only), with
    `bias` and `keys.mask` of the logits' rank."""
    if implementation == "reference":
        allowed, rng = visible_keys(keys, query.shape[-3], key.shape[-3], query.ndim), traced.dropout_rng
        return reference_attention(
            query, key, value, bias, allowed, traced.sinks, scale=scale, options=options, dropout_rng=rng
        )
    if implementation == "splash":
        output = splash_attention(query, key, value, keys, traced.sinks, scale=scale, options=options)
        return output, None, None
    if implementation == "chunked":
        platform = jax.default_backend()
        blocks = (None, None) if platform == "cpu" else accelerator_block_sizes(query, key, platform)
        output, residual = chunked_attention(
            query,
            key,
            value,
            bias,
            keys.mask,
            **keys.keywords(lengths=True),
            scale=scale,
            logits_soft_cap=options.soft_cap,
            sinks=traced.sinks,
            return_residual=True,
            block_q=blocks[0],
            block_k=blocks[1],
            precision=options.precision,
        )
        return output, residual, None
    if implementation == "pallas":
        output, residual = pallas_attention(
            query,
            key,
            value,
            **keys.keywords(lengths=True),
            scale=scale,
            logits_soft_cap=options.soft_cap,
            sinks=traced.sinks,
            return_residual=True,
            precision=_pallas_precision(options.precision),
        )
        return output, residual, None
    output, residual = jax_nn_attention(
        query,
        key,
        value,
        bias,
        keys,
        cudnn=implementation == "cudnn",
        scale=scale,
        precision=matmul_precision_name(options.precision),
        return_residual=options.return_residual,
    )
    return output, residual, None


def _attention(query, key, value, bias, mask, traced: _Traced, *, options: CallOptions, shared: bool = False):
    """`dot_product_attention` under `jax.jit`. `shared`: the caller passed one array as key and
    value (here given once, as `key`), so that the paths inside see one array and can tell
    (`chunked_attention`)."""
    query, key = jnp.asarray(query), jnp.asarray(key)
    value = key if shared else jnp.asarray(value)
    bias, mask = (None if x is None else jnp.asarray(x) for x in (bias, mask))
    traced = _Traced(*(None if x is None else jnp.asarray(x) for x in traced))
    _validate(query, key, value, bias, mask, traced, options.dropout_rate)
    bias, mask = (
        None if x is None else lift(x, query.ndim) for x in (bias, mask)
    )  # (batch...|1, N|1, T|1, S|1)
    implementation = _implementation(options, query, key, value, bias, mask, traced)
    scale = options.scale if options.scale is not None else traced.scale
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    segments = None if traced.query_segments is None else (traced.query_segments, traced.key_segments)
    keys = KeyVisibility(
        is_causal=options.is_causal,
        query_offset=traced.offset if traced.offset is not None else options.offset,
        window=options.window,
        segment_ids=segments,
        mask=mask,
        query_lengths=traced.query_lengths,
        key_lengths=traced.key_lengths,
    )
    output, residual, weights = _run(implementation, query, key, value, bias, keys, traced, options, scale)
    if not (options.return_residual or options.return_weights):
        return output
    return (
        output,
        *((residual,) if options.return_residual else ()),
        *((weights,) if options.return_weights else ()),
    )


_jitted_attention = jax.jit(_attention, static_argnames=("options", "shared"))


def _call_jitted(query, key, value, *rest, options: CallOptions):
    """`_jitted_attention`; jit gives two arguments two tracers, so one array given as both key
    and value is passed once."""
    if value is key:
        return _jitted_attention(query, key, None, *rest, options=options, shared=True)
    return _jitted_attention(query, key, value, *rest, options=options)


def _static_offset(query_offset: Any, is_causal: bool, query: Any, key: Any) -> tuple[int | None, Any]:
    """`(static offset, traced offset)`: an int is static, an array traced; None is a static 0,
    with the FutureWarning where it changed meaning (is_causal with T != S)."""
    if query_offset is None:
        if is_causal and np.ndim(query) >= 3 and np.ndim(key) >= 3:  # else _validate names the rank
            T, S = np.shape(query)[-3], np.shape(key)[-3]
            if T != S:
                warn_alignment(T, S, "dot_product_attention", stacklevel=4)
        return 0, None
    if is_int(query_offset):
        return int(query_offset), None
    return None, query_offset


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
        "chunked": `qkv_jax.attention.chunked_attention`, blocked online
          softmax with memory O(T x block), skipping the tiles that causality,
          a window, lengths or segment ids rule out.
        "pallas": `qkv_jax.attention.pallas.pallas_attention`, fused Pallas
          kernels (forward and backward, memory linear in T): Triton on a
          GPU, Pallas' interpret mode elsewhere (slow: for tests). No bias
          or mask (the rules above instead), not float64. Its float32 dots
          run in IEEE float32 unless `precision` says 'high' (three TF32
          passes) or 'default' (one).
          None chooses it on a GPU once benchmarks/gpu_check.sh has passed it there.
        "splash": jax's splash attention (Pallas, Mosaic TPU; interpreted
          elsewhere): causal, a window, a static offset, segment ids, lengths,
          soft cap, sinks; float32 and bfloat16; no mask, bias, residual or
          precision. Only when asked for: no TPU run has checked it yet.
        None: `select_implementation`'s rule (see there): "cudnn" on a GPU
          where it applies; on CPU "chunked" from `CHUNKED_MIN_KEYS` keys and
          "reference" below; on accelerators "xla" (else "reference") where
          the logits fit in memory, "chunked" with the device's tiles beyond.
        What each path takes is `qkv_jax.attention.SUPPORTED` ("xla" and
        "cudnn" have no soft cap and no sinks: jax.nn has neither); asking for
        a path that cannot compute the call raises ValueError.
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
        the two); cuDNN's kernel ignores it (bf16/fp16 inputs). "pallas" runs
        float32 dots in float32 for None and 'highest', as three TF32 passes
        for 'high' and one for 'default'.

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
    if is_number(scale):
        static_scale, scale = float(scale), None
    for name, lengths, x, limit_name in (
        ("query_seq_lengths", query_seq_lengths, query, "T"),
        ("key_value_seq_lengths", key_value_seq_lengths, key, "S"),
    ):
        if np.ndim(x) >= 3:  # else _validate names the bad rank
            check_length_values("dot_product_attention", name, lengths, limit_name, np.shape(x)[-3])
    static_offset, traced_offset = _static_offset(query_offset, is_causal, query, key)
    if isinstance(precision, list):
        precision = tuple(precision)
    options = CallOptions(
        is_causal=bool(is_causal),
        scale=static_scale,
        window=window_pair(local_window_size, "dot_product_attention"),
        offset=static_offset,
        soft_cap=check_soft_cap("dot_product_attention", logits_soft_cap),
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
    return _call_jitted(query, key, value, bias, mask, traced, options=options)
