"""jax.nn's paths, "xla" and "cudnn": `jax.nn.dot_product_attention` with this package's rules.

jax.nn wants one dtype, one batch axis and a static scale, gives a row with no
allowed key the mean of the values, and lets a non-finite key or value that is
masked out reach the output. So the inputs are cast and flattened, a traced
scale is multiplied into the queries, the causal mask and the window go to
jax.nn as they are where it means the same by them (a static zero offset;
`native`), everything else the `KeyVisibility` holds becomes one additive bias
with the mask and the bias, and rows with no key and non-finite keys and
values are handled around the kernel (`_fast_when_finite`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from qkv_jax.attention.chunked import flatten_batch, per_example
from qkv_jax.attention.options import PrecisionLike
from qkv_jax.attention.visibility import KeyVisibility, and_masks, is_int, visible_keys

Array = jax.Array

__all__ = ["jax_nn_attention", "native", "cudnn_applies"]


def matmul_precision_name(precision: PrecisionLike) -> str | None:
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


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """What one `jax.nn.dot_product_attention` call gets besides its arrays."""

    cudnn: bool
    is_causal: bool
    window: tuple[int, int] | None
    scale: float
    return_residual: bool
    precision: str | None  # a `jax_default_matmul_precision` value, set around the call


def _jax_nn_call(kernel: _Kernel, query, key, value, bias, lengths):
    """One `jax.nn.dot_product_attention` call: `[B, T, N, H]`, `[B, S, K, H]`, `[B, S, K, H]`,
    an additive bias `[B|1, N|1, T|1, S|1]` or None, int32 lengths `([B] | None, [B] | None)`.

    Returns `(output, residual or None)`. The precision is set around the call,
    which traces every dot of jax.nn's "xla" kernel, and their transposes, with
    it; cuDNN's kernel runs at its own (bf16/fp16 inputs, float32 softmax).
    """
    query_lengths, key_lengths = lengths
    precision = kernel.precision
    context = contextlib.nullcontext() if precision is None else jax.default_matmul_precision(precision)
    attend: Any = jax.nn.dot_product_attention  # looked up per call (tests stand in for cuDNN)
    with context:
        result = attend(
            query,
            key,
            value,
            bias=bias,
            scale=kernel.scale,
            is_causal=kernel.is_causal,
            query_seq_lengths=query_lengths,
            key_value_seq_lengths=key_lengths,
            local_window_size=kernel.window,
            implementation="cudnn" if kernel.cudnn else "xla",
            return_residual=kernel.return_residual,
        )  # (B, T, N, H) [, (B, T, N)]
    return result if kernel.return_residual else (result, None)


def _nothing_to_fix(key, value, empty_rows) -> Array:
    """True when the kernel's own answer is already this package's: every key and value is
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
    tests/attention/test_dispatch.py checks that the finite branch is jax.nn's program alone.
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


def native(keys: KeyVisibility, cudnn: bool) -> tuple[bool, tuple[int, int] | None]:
    """The causal flag and window handed to jax.nn itself; the rest of `keys` is folded into
    the bias. Only at a static zero offset (jax.nn's alignment). For cuDNN a window only as
    jax.nn passes one on: non-negative bounds, a right bound of 0 or a causal mask, and no
    lengths with a right bound. cuDNN enforces a window's right bound only through its causal
    mask (without one, a window (left, 0) attends future keys), so a window (left, 0) goes
    with `is_causal=True`: the same keys, as causality adds nothing to it."""
    offset = keys.query_offset
    if not (offset is None or (is_int(offset) and offset == 0)):
        return False, None
    window = keys.window
    if not cudnn or window is None:
        return keys.is_causal, window
    left, right = window
    padded = keys.query_lengths is not None or keys.key_lengths is not None
    if left < 0 or right < 0 or not (right == 0 or (keys.is_causal and not padded)):
        return keys.is_causal, None
    return True, window


def _rows_without_keys(T, S, rank, allowed, keys: KeyVisibility, applied, batch) -> Array | None:
    """`[B|1, T|1, N|1, 1]`: the unpadded query rows that may attend to no key, or None if
    none can be. jax.nn (and cuDNN) give such a row the mean of the values; this package
    zeros it. Padded queries (t >= query length) need nothing: both kernels already zero
    them. `allowed` holds what is folded into the bias (the mask, the bias's -inf entries,
    folded positions), `applied` the causal flag and window jax.nn applies itself; key
    lengths too can leave a row without keys (a causal mask at a static zero offset cannot)."""
    if allowed is None and keys.key_lengths is None and applied[1] is None:
        return None
    seen = KeyVisibility(applied[0], 0, applied[1], mask=allowed, key_lengths=keys.key_lengths)
    attended = visible_keys(seen, T, S, rank)
    if attended is None:  # nothing folded and nothing applied: every row has every key
        return None
    empty = ~jnp.any(attended, axis=-1)  # (batch...|1, N|1, T|1)
    if keys.query_lengths is not None:
        unpadded = visible_keys(KeyVisibility(query_lengths=keys.query_lengths), T, 1, rank)
        assert unpadded is not None  # lengths always give a mask
        empty = empty & unpadded[..., 0]  # (batch..., N|1, T)
    empty = flatten_batch(empty[..., None], batch)[..., 0]  # (B|1, N|1, T|1)
    return jnp.swapaxes(empty, -1, -2)[..., None]  # (B|1, T|1, N|1, 1)


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


def jax_nn_attention(
    query, key, value, bias, keys: KeyVisibility, *, cudnn: bool, scale: Any, precision, return_residual
):
    """`jax.nn.dot_product_attention` ("xla", or "cudnn" with `cudnn`) with this package's
    conventions (module docstring); `bias` of the logits' rank or None, `keys` which keys
    each query sees (its mask of the logits' rank). Returns `(output, residual or None)`;
    the residual of a row that attends nothing is -inf."""
    *batch, T, N, _ = query.shape
    S, Hv = key.shape[-3], value.shape[-1]
    batch, rank = tuple(batch), len(batch) + 3
    out_dtype = jnp.result_type(query, key, value)
    dtype = _jax_nn_dtype(out_dtype, cudnn)
    query, key, value = (x.astype(dtype).reshape(-1, *x.shape[-3:]) for x in (query, key, value))
    if not isinstance(scale, (int, float)):  # traced: jax.nn takes a static scale
        query, scale = (query * scale).astype(dtype), 1.0
    applied = native(keys, cudnn)
    folded = keys.replace(
        is_causal=keys.is_causal and not applied[0],
        window=None if applied[1] is not None else keys.window,
        query_lengths=None,
        key_lengths=None,
    )
    allowed = and_masks(visible_keys(folded, T, S, rank), None if bias is None else bias > -jnp.inf)
    empty_rows = _rows_without_keys(T, S, rank, allowed, keys, applied, batch)
    allowed = None if allowed is None else flatten_batch(allowed, batch)  # (B|1, N|1, T|1, S|1)
    bias = None if bias is None else flatten_batch(bias, batch)  # (B|1, N|1, T|1, S|1)
    bias_dtype = dtype if cudnn else jnp.promote_types(dtype, jnp.float32)
    folded_bias = _fold_into_bias(allowed, bias, bias_dtype, (T, S) if cudnn else None)
    lengths = tuple(
        _flat_lengths(n, batch, limit) for n, limit in ((keys.query_lengths, T), (keys.key_lengths, S))
    )
    kernel = _Kernel(cudnn, applied[0], applied[1], float(scale), return_residual, precision)
    attend = functools.partial(_jax_nn_call, kernel)
    output, residual = _fast_when_finite(attend, query, key, value, folded_bias, lengths, empty_rows)
    output = output.reshape(*batch, T, N, Hv).astype(out_dtype)  # (batch..., T, N, Hv)
    if residual is None:
        return output, None
    return output, _residual_where_attended(residual, empty_rows, lengths[0], batch).astype(out_dtype)


def cudnn_applies(query, key, value, has_bias: bool, platform: str) -> bool:
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
