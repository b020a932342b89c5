"""The "splash" path: jax's splash attention (Pallas, Mosaic TPU) for `dot_product_attention`.

Splash computes one example at a time, `[N, T, H]` queries against `[K, S, H]` keys, with a
static mask built from the causal triangle and the window (`LocalMask`, `CausalMask`,
`FullMask` with the same offset), segment ids, a soft cap and per-head sinks, through its own
custom VJP. Here the batch dims are flattened and vmapped, the scale is multiplied into the
queries, T and S are padded to its blocks (the padded keys get a segment id no query has), key
lengths become segment ids the same way, and query lengths zero the padded queries' rows.

Splash gives a row that sees no key the mean of the masked values its blocks hold (and 0/0
where it skips every block of the row); here every call carries
a sink (`NO_SINK` where the caller gave none), whose weight 1 such a row keeps alone: output 0,
no gradient, as on the other paths. On a TPU the kernels are compiled, elsewhere interpreted
(Pallas' interpret mode: slow, for tests).
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from qkv_jax.attention.chunked import per_example
from qkv_jax.attention.options import CallOptions
from qkv_jax.attention.visibility import KeyVisibility, is_int

if TYPE_CHECKING:
    from jax.experimental.pallas.ops.tpu import splash_attention as splash_types

Array = jax.Array

__all__ = ["splash_attention", "splash_refusal", "BLOCKS", "NO_SINK"]

# Block widths tried for T and S padded to the smallest (splash's default, its lane width 128):
# the widest that divides the padded length.
BLOCKS = (512, 256, 128)
# The logit of the sink a call without sinks carries: exp(NO_SINK - m) is 0 in float32 beside
# any real logit m, and splash's masked logit (-0.7 x float32's max) weighs 0 beside it.
NO_SINK = -1e30


def _splash() -> ModuleType:
    """jax's splash attention, imported on first use (importing qkv_jax does not need it)."""
    try:
        from jax.experimental.pallas.ops.tpu import splash_attention
    except ImportError as error:
        raise ValueError(
            f"dot_product_attention: implementation='splash' needs jax's splash attention, which "
            f"jax {jax.__version__} lacks ({error})"
        ) from None
    return splash_attention


def splash_refusal(query, key, value, keys: KeyVisibility, options: CallOptions) -> str | None:
    """Why splash cannot compute the call (beyond `SUPPORTED`), or None."""
    dtype = jnp.result_type(query, key, value)
    if dtype not in (jnp.float32, jnp.bfloat16):
        return f"computes float32 and bfloat16 only, got {dtype}"
    if not (keys.query_offset is None or is_int(keys.query_offset)):
        return "takes a static query_offset only (a Python int), got an array"
    if options.return_residual:
        return "does not return the residual (splash's kernel cannot differentiate it)"
    if options.precision is not None:
        return f"takes no matmul precision (its kernels set their own), got precision={options.precision!r}"
    return None


@jax.custom_vjp
def _float32_cotangent(sinks: Array) -> Array:
    """`sinks` (float32), whose cotangent splash returns in the queries' dtype, cast back."""
    return sinks


_float32_cotangent.defvjp(lambda sinks: (sinks, None), lambda _, g: (g.astype(jnp.float32),))


def _padded(length: int) -> tuple[int, int]:
    """`(padded length, block)`: `length` rounded up to a multiple of `BLOCKS[-1]`, and the widest
    of `BLOCKS` dividing it."""
    padded = -(-length // BLOCKS[-1]) * BLOCKS[-1]
    return padded, next(block for block in BLOCKS if padded % block == 0)


def _static_mask(keys: KeyVisibility, num_heads: int, shape: tuple[int, int]) -> splash_types.MultiHeadMask:
    """Splash's mask of the causal triangle and the window, `[N, T, S]` (padded lengths)."""
    splash = _splash()
    offset = int(keys.query_offset or 0)
    mask: splash_types.Mask
    if keys.window is not None:
        left, right = keys.window
        right = min(right, 0) if keys.is_causal else right  # the triangle cuts the window's right
        mask = splash.LocalMask(shape, window_size=(left, right), offset=offset)
    elif keys.is_causal:
        mask = splash.CausalMask(shape, offset=offset)
    else:
        mask = splash.FullMask(shape)
    return splash.MultiHeadMask([mask] * num_heads)


def _kernel(keys: KeyVisibility, num_heads: int, T: int, S: int, soft_cap: float | None):
    """The splash kernel for padded lengths T and S (interpreted off a TPU), as a function of one
    example's `(q [N, T, H], k [K, S, H], v [K, S, Hv], sinks [N], segment ids or None)`; its
    backward pass is splash's fused kernel (dq with dk and dv: one kernel fewer to run)."""
    splash = _splash()
    (_, block_q), (_, block_kv) = _padded(T), _padded(S)
    blocks = splash.BlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_q_dkv=block_q,
        block_kv_dkv=block_kv,
        use_fused_bwd_kernel=True,
    )
    kernel = splash.make_splash_mha(
        _static_mask(keys, num_heads, (T, S)),
        block_sizes=blocks,
        attn_logits_soft_cap=soft_cap,
        head_shards=1,
        q_seq_shards=1,
        interpret=jax.default_backend() != "tpu",
    )

    def one_example(q, k, v, sinks, segments):
        return kernel(q, k, v, None if segments is None else splash.SegmentIds(*segments), sinks)

    return one_example


def _absent_id(query_ids: Array) -> Array:
    """The least id >= 0 that no query of one example has `[]` (one of 0..T is free)."""
    T = query_ids.shape[-1]
    slots = jnp.where((query_ids >= 0) & (query_ids <= T), query_ids, T + 1)  # (T,)
    taken = jnp.zeros(T + 2, bool).at[slots].set(True)  # (T + 2,)
    return jnp.argmin(taken[: T + 1]).astype(jnp.int32)


def _segment_ids(keys: KeyVisibility, batch: tuple[int, ...], T: int, S: int, padded: tuple[int, int]):
    """`(query ids [B, Tp], key ids [B, Sp])` for splash, or None: the caller's segment ids, with
    the padded keys and the keys beyond `key_lengths` given an id that no query has."""
    if keys.segment_ids is None and keys.key_lengths is None and padded[1] == S:
        return None
    B = math.prod(batch)
    if keys.segment_ids is None:
        query_ids, key_ids = jnp.zeros((B, T), jnp.int32), jnp.zeros((B, S), jnp.int32)
    else:
        query_ids, key_ids = (
            jnp.broadcast_to(per_example(ids, batch, (n,)), (B, n)).astype(jnp.int32)
            for ids, n in zip(keys.segment_ids, (T, S), strict=True)
        )  # (B, T), (B, S)
    query_ids = jnp.pad(query_ids, ((0, 0), (0, padded[0] - T)))  # (B, Tp)
    key_ids = jnp.pad(key_ids, ((0, 0), (0, padded[1] - S)))  # (B, Sp)
    limit = S if keys.key_lengths is None else jnp.minimum(_lengths(keys.key_lengths, batch), S)
    valid = jnp.arange(padded[1])[None, :] < jnp.reshape(limit, (-1, 1))  # (B|1, Sp)
    absent = jax.vmap(_absent_id)(query_ids)  # (B,)
    return query_ids, jnp.where(valid, key_ids, absent[:, None])  # (B, Tp), (B, Sp)


def _lengths(lengths: Any, batch: tuple[int, ...]) -> Array:
    """Lengths broadcastable to `[batch...]` as `[B]`."""
    return jnp.broadcast_to(per_example(lengths, batch), (math.prod(batch),))


def _heads_first(x: Array, batch: tuple[int, ...], padded_length: int) -> Array:
    """`[batch..., L, heads, depth]` as `[B, heads, Lp, depth]`, padded with zeros to Lp."""
    *_, length, heads, depth = x.shape
    x = jnp.swapaxes(x.reshape(math.prod(batch), length, heads, depth), 1, 2)  # (B, heads, L, depth)
    return jnp.pad(x, ((0, 0), (0, 0), (0, padded_length - length), (0, 0)))  # (B, heads, Lp, depth)


def splash_attention(query, key, value, keys: KeyVisibility, sinks, *, scale, options: CallOptions) -> Array:
    """`dot_product_attention`'s output `[batch..., T, N, Hv]` through splash; `keys` without a
    mask, a static offset, no residual (`splash_refusal`)."""
    reason = splash_refusal(query, key, value, keys, options)
    if reason is not None:
        raise ValueError(f"dot_product_attention: implementation='splash' {reason}")
    *batch_list, T, N, _ = query.shape
    batch, S = tuple(batch_list), key.shape[-3]
    dtype = jnp.result_type(query, key, value)
    padded = (_padded(T)[0], _padded(S)[0])
    query = query * jnp.asarray(scale, jnp.float32)  # splash takes no scale
    q = _heads_first(query.astype(dtype), batch, padded[0])  # (B, N, Tp, H)
    k = _heads_first(key.astype(dtype), batch, padded[1])  # (B, K, Sp, H)
    v = _heads_first(value.astype(dtype), batch, padded[1])  # (B, K, Sp, Hv)
    sinks = (
        jnp.full((N,), NO_SINK, jnp.float32)
        if sinks is None
        else _float32_cotangent(sinks.astype(jnp.float32))
    )
    sinks = jnp.broadcast_to(per_example(sinks, batch, (N,)), (math.prod(batch), N))  # (B, N)
    segments = _segment_ids(keys, batch, T, S, padded)
    kernel = _kernel(keys, N, *padded, options.soft_cap)
    out = jax.vmap(kernel)(q, k, v, sinks, segments)[:, :, :T]  # (B, N, T, Hv)
    out = jnp.swapaxes(out, 1, 2)  # (B, T, N, Hv)
    if keys.query_lengths is not None:
        padding = jnp.arange(T)[None, :] >= _lengths(keys.query_lengths, batch)[:, None]  # (B, T)
        out = jnp.where(padding[:, :, None, None], jnp.zeros((), out.dtype), out)
    return out.reshape(*batch, T, N, out.shape[-1])  # (batch..., T, N, Hv)
