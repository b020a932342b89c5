"""Blocked online-softmax attention (flash-style) with a recomputing backward pass.

`chunked_attention` computes the same `softmax(Q K^T * scale + bias, masked) V`
as `qkv_jax.dot_product_attention`, one tile of `block_q` query positions by
`block_k` keys at a time: each query block keeps a running row maximum, softmax
normaliser and output accumulator, rescaled as key blocks arrive (Milakov &
Gimelshein 2018; Dao et al. 2022). The forward pass saves only the output and
the row log-sum-exp; the backward pass recomputes each tile of attention
weights from them (when one tile covers all of T and S, its weights are
saved instead). Memory therefore grows as O(T x block), not O(T x S) (a
mask or bias passed in at full size is the caller's and is only sliced). With
`is_causal`, the loops stop at the diagonal: key blocks above it are never
computed.

Layout of the public function as in `qkv_jax.attention`: query
`[batch..., T, N, H]`, key `[batch..., S, K, H]`, value `[batch..., S, K, Hv]`.
Inside, each kv head gets one matrix of query rows, `[B, K, T*G, H]` with
`B` the flattened batch, `G = N // K` query heads per kv head and row
`t * G + g`; a block of `block_q` positions is then `block_q * G` contiguous
rows and every dot has the single batch `(B, K)` with 2-D operands, which XLA
runs at the CPU's matmul speed. Every dot, forward and backward, takes the
call's `precision`. Sequence lengths mask each tile as it is computed (no
`[T, S]` mask is built).

Non-finite keys and values behave as in the reference path: they are zeroed
for the matmuls, so where masked out they reach neither output nor gradients;
an attended bad key turns its query's row NaN (a NaN is added to its logit
column) and an attended bad value the channel it is in (an extra product with
an indicator of bad values, run only for key blocks that hold one).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

__all__ = ["chunked_attention", "flatten_batch", "DEFAULT_BLOCK_Q", "DEFAULT_BLOCK_K"]

# Tile sizes, from `python benchmarks/attention.py --tune-blocks` on 2 AVX-512 cores
# (benchmarks/results/attention_blocks.json): larger tiles suit non-causal
# attention, smaller ones causal; 512 x 512 is close to the best of both, and a
# float32 tile of batch 8 x 8 heads stays at 64 MiB.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


class _BadEntries(NamedTuple):
    """Where keys and values were non-finite (they are zeroed before the kernel)."""

    key_nan: Array  # (B, K, Sp): NaN for a key with a non-finite entry, else 0
    values: Array  # (B, K, Sp, Hv) bool: the non-finite value entries
    blocks: Array  # (nk,) bool: key blocks holding one


class _Masking(NamedTuple):
    """What may be attended besides causality: a tiled mask and per-sequence lengths."""

    mask: Array | None  # (B|1, K|1, Tp|1, G|1, Sp|1) bool
    query_lengths: Array | None  # (B,) int: rows t >= length are padding
    key_lengths: Array | None  # (B,) int: keys s >= length are never attended


@dataclasses.dataclass(frozen=True)
class _Tiling:
    """Static facts of one call: real lengths, block sizes, grouping, dtype."""

    T: int
    S: int
    G: int  # query heads per kv head
    block_q: int
    block_k: int
    is_causal: bool
    dtype: jnp.dtype  # of logits, softmax and accumulators
    precision: Any = None  # of every dot (flax's PrecisionLike)

    @property
    def num_query_blocks(self) -> int:
        return -(-self.T // self.block_q)

    @property
    def num_key_blocks(self) -> int:
        return -(-self.S // self.block_k)

    @property
    def block_rows(self) -> int:
        return self.block_q * self.G

    @property
    def single_tile(self) -> bool:
        return self.num_query_blocks == 1 and self.num_key_blocks == 1

    def key_blocks_for(self, i: Array) -> Array | int:
        """How many key blocks query block i reads: all, or up to the diagonal."""
        if not self.is_causal:
            return self.num_key_blocks
        last_key = (i + 1) * self.block_q - 1 + (self.S - self.T)  # last row's last allowed key
        return jnp.clip(last_key // self.block_k + 1, 0, self.num_key_blocks)

    def first_query_block_for(self, j: Array) -> Array | int:
        """The first query block that reads key block j (0 unless causal)."""
        if not self.is_causal:
            return 0
        first_row = j * self.block_k - (self.S - self.T)  # first position allowed key j*block_k
        return jnp.clip(first_row // self.block_q, 0, self.num_query_blocks)


def _slice(x: Array, axis: int, index: Array, size: int) -> Array:
    """Block `index` of `size` along `axis`; a size-1 (broadcast) axis is kept whole."""
    if x.shape[axis] == 1:
        return x
    return lax.dynamic_slice_in_dim(x, index * size, size, axis=axis)


def _rows(x: Array, i: Array, tiling: _Tiling) -> Array:
    """The query rows of block i, along axis 2 of `[B, K, Tp*G, ...]`."""
    return _slice(x, 2, i, tiling.block_rows)


def _mask_tile(x: Array | None, i: Array, j: Array, tiling: _Tiling) -> Array | None:
    """Tile (i, j) of a `[B|1, K|1, Tp|1, G|1, Sp|1]` mask or bias, as `[B|1, K|1, rows, bk|1]`.

    rows is 1 when the array is broadcast over queries and heads, otherwise
    `block_q * G` (broadcasting whichever of the two is size 1 within the tile).
    """
    if x is None:
        return None
    x = _slice(_slice(x, 2, i, tiling.block_q), 4, j, tiling.block_k)  # (., ., bq|1, G|1, bk|1)
    B, K, positions, heads, keys = x.shape
    if positions > 1 or heads > 1:
        x = jnp.broadcast_to(x, (B, K, tiling.block_q, tiling.G, keys))  # (., ., bq, G, bk|1)
    return x.reshape(B, K, -1, keys)  # (B|1, K|1, bq*G|1, bk|1)


def _and(a: Array | None, b: Array) -> Array:
    return b if a is None else a & b


def _logits(query_rows, key_block, key_nan, masking: _Masking, bias, scale, i, j, tiling: _Tiling) -> Array:
    """Scaled, biased, masked logits of tile (i, j): `[B, K, bq*G, bk]`.

    `key_nan` `[B, K, Sp]` is NaN for keys that had a non-finite entry, else 0.
    Forbidden entries are -inf: the mask, the causal triangle, keys and query
    rows beyond their sequence's length, and the keys that pad S to whole blocks.
    """
    logits = jnp.einsum(
        "bkrh,bkch->bkrc",
        query_rows,
        key_block,
        preferred_element_type=tiling.dtype,
        precision=tiling.precision,
    )  # (B, K, bq*G, bk)
    logits = logits * scale + _slice(key_nan, 2, j, tiling.block_k)[:, :, None, :]
    if bias is not None:
        logits = logits + _mask_tile(bias, i, j, tiling)
    allowed = _mask_tile(masking.mask, i, j, tiling)
    key_pos = j * tiling.block_k + jnp.arange(tiling.block_k)  # (bk,)
    row_pos = i * tiling.block_q + jnp.arange(tiling.block_rows) // tiling.G  # (bq*G,)
    if tiling.is_causal:
        allowed = _and(allowed, key_pos[None, :] <= row_pos[:, None] + (tiling.S - tiling.T))  # (bq*G, bk)
    if masking.key_lengths is not None:
        key_valid = key_pos[None, :] < masking.key_lengths[:, None]  # (B, bk)
        allowed = _and(allowed, key_valid[:, None, None, :])  # (B, 1, 1, bk)
    if masking.query_lengths is not None:
        row_valid = row_pos[None, :] < masking.query_lengths[:, None]  # (B, bq*G)
        allowed = _and(allowed, row_valid[:, None, :, None])  # (B, 1, bq*G, 1)
    if tiling.S % tiling.block_k:
        allowed = _and(allowed, key_pos < tiling.S)  # (bk,)
    if allowed is None:
        return logits
    return jnp.where(allowed, logits, -jnp.inf)


def _softmax_step(logits, value_block, row_max, normaliser, accumulator, *, precision):
    """Folds one key block into a query block's running softmax.

    logits `[B, K, rows, bk]`, value_block `[B, K, bk, Hv]`; the state is the
    row maximum and normaliser `[B, K, rows]` and the output accumulator
    `[B, K, rows, Hv]`, all relative to the row maximum. Returns the new state
    and the block's weights relative to the new maximum. `precision`: of the dot.
    """
    new_max = jnp.maximum(row_max, jnp.max(logits, axis=-1))  # (B, K, rows)
    shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)  # finite, for all-masked rows
    weights = jnp.exp(logits - shift[..., None])  # (B, K, rows, bk)
    rescale = jnp.exp(row_max - shift)  # (B, K, rows)
    normaliser = normaliser * rescale + jnp.sum(weights, axis=-1)
    blended = jnp.einsum("bkrc,bkch->bkrh", weights, value_block, precision=precision)  # (B, K, rows, Hv)
    return (new_max, normaliser, accumulator * rescale[..., None] + blended), weights


def _initial_state(B: int, K: int, rows: int, Hv: int, dtype):
    return (
        jnp.full((B, K, rows), -jnp.inf, dtype),
        jnp.zeros((B, K, rows), dtype),
        jnp.zeros((B, K, rows, Hv), dtype),
    )


def _finish(row_max, normaliser, accumulator):
    """Output `[B, K, rows, Hv]` and log-sum-exp `[B, K, rows]` of a finished softmax.

    A row with no allowed key gets output 0 and log-sum-exp 0 (its logits are
    all -inf, so the backward pass recomputes zero weights for it).
    """
    has_keys = normaliser > 0
    output = accumulator / jnp.where(has_keys, normaliser, 1.0)[..., None]
    return output, jnp.where(has_keys, row_max + jnp.log(normaliser), 0.0)


def _poison_step(poison, logits, bad_values, has_bad, precision):
    """Marks the (row, channel) pairs of `poison` `[B, K, rows, Hv]` that attend a bad value.

    `bad_values` `[B, K, bk, Hv]` flags non-finite values; an entry is attended
    where its logit is above -inf (a NaN logit, from a bad key, is not: its row
    is NaN anyway). Runs only when the block `has_bad` one.
    """

    def mark(poison):
        allowed = (logits > -jnp.inf).astype(logits.dtype)  # (B, K, rows, bk)
        bad = bad_values.astype(logits.dtype)  # (B, K, bk, Hv)
        reached = jnp.einsum("bkrc,bkch->bkrh", allowed, bad, precision=precision)  # (B, K, rows, Hv)
        return poison | (reached > 0)

    return lax.cond(has_bad, mark, lambda poison: poison, poison)


def _forward(tiling: _Tiling, query, key, value, bad, masking, bias, scale):
    """Output `[B, K, Tp*G, Hv]`, row log-sum-exp `[B, K, Tp*G]` and the poisoned
    (row, channel) pairs `[B, K, Tp*G, Hv]`."""
    B, K, _, _ = query.shape
    Hv = value.shape[-1]

    def query_block(i):
        query_i = _rows(query, i, tiling)  # (B, K, bq*G, H)

        def key_step(j, state):
            softmax_state, poison = state
            key_j = _slice(key, 2, j, tiling.block_k)  # (B, K, bk, H)
            value_j = _slice(value, 2, j, tiling.block_k).astype(tiling.dtype)  # (B, K, bk, Hv)
            logits = _logits(
                query_i, key_j, bad.key_nan, masking, bias, scale, i, j, tiling
            )  # (B, K, bq*G, bk)
            softmax_state, _ = _softmax_step(logits, value_j, *softmax_state, precision=tiling.precision)
            bad_j = _slice(bad.values, 2, j, tiling.block_k)  # (B, K, bk, Hv)
            return softmax_state, _poison_step(poison, logits, bad_j, bad.blocks[j], tiling.precision)

        init = (
            _initial_state(B, K, tiling.block_rows, Hv, tiling.dtype),
            jnp.zeros((B, K, tiling.block_rows, Hv), jnp.bool_),
        )
        softmax_state, poison = lax.fori_loop(0, tiling.key_blocks_for(i), key_step, init)
        return (*_finish(*softmax_state), poison)

    output, log_sum_exp, poison = lax.map(query_block, jnp.arange(tiling.num_query_blocks))
    # output, poison: (nq, B, K, bq*G, Hv); log_sum_exp: (nq, B, K, bq*G)
    output = jnp.moveaxis(output, 0, 2).reshape(B, K, -1, Hv)  # (B, K, Tp*G, Hv)
    poison = jnp.moveaxis(poison, 0, 2).reshape(B, K, -1, Hv)  # (B, K, Tp*G, Hv)
    log_sum_exp = jnp.moveaxis(log_sum_exp, 0, 2).reshape(B, K, -1)  # (B, K, Tp*G)
    return output, log_sum_exp, poison


def _single_tile_forward(tiling: _Tiling, query, key, value, bad, masking, bias, scale):
    """Output, attention weights `[B, K, T*G, S]` and poisoned pairs when one tile is all.

    The weights are then O(T x block) too, and saving them spares the backward
    pass a recomputation.
    """
    B, K, _, _ = query.shape
    Hv = value.shape[-1]
    logits = _logits(query, key, bad.key_nan, masking, bias, scale, 0, 0, tiling)  # (B, K, T*G, S)
    init = _initial_state(B, K, query.shape[2], Hv, tiling.dtype)
    state, weights = _softmax_step(logits, value.astype(tiling.dtype), *init, precision=tiling.precision)
    normaliser = state[1]
    weights = weights / jnp.where(normaliser > 0, normaliser, 1.0)[..., None]  # (B, K, T*G, S)
    poison = _poison_step(
        jnp.zeros(state[2].shape, jnp.bool_), logits, bad.values, bad.blocks[0], tiling.precision
    )
    return _finish(*state)[0], weights, poison


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(tiling: _Tiling, query, key, value, bad, masking, bias, scale):
    """(output `[B, K, Tp*G, Hv]` with bad values zeroed, poisoned pairs `[B, K, Tp*G, Hv]`)."""
    output, _, poison = _forward(tiling, query, key, value, bad, masking, bias, scale)
    return output, poison


def _attention_fwd(tiling: _Tiling, query, key, value, bad, masking, bias, scale):
    """Saves the row log-sum-exp, or for a single tile the weights themselves."""
    forward = _single_tile_forward if tiling.single_tile else _forward
    inputs = (query, key, value, bad, masking, bias, scale)
    output, softmax_residual, poison = forward(tiling, *inputs)
    return (output, poison), (query, key, value, bad.key_nan, masking, bias, scale, output, softmax_residual)


def _add_bias_grad(bias_grad: Array, logits_grad: Array, i, j, tiling: _Tiling) -> Array:
    """Adds tile (i, j) of dS `[B, K, bq*G, bk]` into `[B|1, K|1, Tp|1, G|1, Sp|1]`,
    summed over the axes along which the bias was broadcast."""
    B, K, _, keys = logits_grad.shape
    tile = logits_grad.reshape(B, K, tiling.block_q, tiling.G, keys)  # (B, K, bq, G, bk)
    broadcast = tuple(a for a in range(5) if bias_grad.shape[a] == 1 and tile.shape[a] > 1)
    tile = jnp.sum(tile, axis=broadcast, keepdims=True)  # (B|1, K|1, bq|1, G|1, bk|1)
    start = (
        0,
        0,
        i * tiling.block_q if bias_grad.shape[2] > 1 else 0,
        0,
        j * tiling.block_k if bias_grad.shape[4] > 1 else 0,
    )
    current = lax.dynamic_slice(bias_grad, start, tile.shape)
    return lax.dynamic_update_slice(bias_grad, current + tile, start)


def _attention_bwd(tiling: _Tiling, residuals, cotangents):
    """Recomputes each tile's weights from the saved log-sum-exp (FlashAttention-2).

    (A single tile's weights were saved instead.)

    For key block j (outer scan) and each query block i that reads it (inner
    loop): P = exp(logits - lse), dV_j += P^T dO_i, dS = P * (dO_i V_j^T - D_i)
    with D = rowsum(dO * O), dQ_i += dS K_j * scale, dK_j += dS^T Q_i * scale,
    dBias_ij = dS. dK and dV are accumulated transposed, `[B, K, H, bk]`:
    XLA runs `Q^T dS` as a faster CPU dot than `dS^T Q`.
    """
    query, key, value, key_nan, masking, bias, scale, output, softmax_residual = residuals
    output_grad, _ = cotangents  # the poisoned pairs are boolean: no cotangent
    dtype = tiling.dtype
    B, K, _, H = query.shape
    Hv = value.shape[-1]
    output_grad = output_grad.astype(dtype)  # (B, K, Tp*G, Hv)
    dot = functools.partial(jnp.einsum, precision=tiling.precision)  # dQ, dK unscaled until the end
    row_dot = jnp.sum(output_grad * output, axis=-1, keepdims=True)  # D: (B, K, Tp*G, 1)

    def tile_weights(query_i, key_j, i, j):  # (B, K, bq*G, bk)
        if tiling.single_tile:
            return softmax_residual  # the saved weights
        log_sum_exp = _rows(softmax_residual, i, tiling)[..., None]  # (B, K, bq*G, 1)
        return jnp.exp(_logits(query_i, key_j, key_nan, masking, bias, scale, i, j, tiling) - log_sum_exp)

    def key_block(carry, j):
        key_j = _slice(key, 2, j, tiling.block_k)  # (B, K, bk, H)
        value_j = _slice(value, 2, j, tiling.block_k).astype(dtype)  # (B, K, bk, Hv)

        def query_step(i, grads):
            query_grad, bias_grad, key_grad_t, value_grad_t = grads
            query_i = _rows(query, i, tiling)  # (B, K, bq*G, H)
            output_grad_i = _rows(output_grad, i, tiling)  # (B, K, bq*G, Hv)
            weights = tile_weights(query_i, key_j, i, j)  # (B, K, bq*G, bk)
            value_grad_t += dot("bkrh,bkrc->bkhc", output_grad_i, weights)  # (B, K, Hv, bk)
            weights_grad = dot("bkrh,bkch->bkrc", output_grad_i, value_j)  # (B, K, bq*G, bk)
            logits_grad = weights * (weights_grad - _rows(row_dot, i, tiling))  # (B, K, bq*G, bk)
            query_grad_i = dot("bkrc,bkch->bkrh", logits_grad, key_j.astype(dtype))  # (B, K, bq*G, H), dS K
            query_grad = lax.dynamic_update_slice_in_dim(
                query_grad, _rows(query_grad, i, tiling) + query_grad_i, i * tiling.block_rows, axis=2
            )  # (B, K, Tp*G, H)
            key_grad_t += dot("bkrh,bkrc->bkhc", query_i.astype(dtype), logits_grad)  # (B, K, H, bk), Q^T dS
            if bias is not None:
                bias_grad = _add_bias_grad(bias_grad, logits_grad, i, j, tiling)
            return query_grad, bias_grad, key_grad_t, value_grad_t

        query_grad, bias_grad = carry
        init = (
            query_grad,
            bias_grad,
            jnp.zeros((B, K, H, tiling.block_k), dtype),
            jnp.zeros((B, K, Hv, tiling.block_k), dtype),
        )
        query_grad, bias_grad, key_grad_t, value_grad_t = lax.fori_loop(
            tiling.first_query_block_for(j), tiling.num_query_blocks, query_step, init
        )
        return (query_grad, bias_grad), (key_grad_t, value_grad_t)

    init = (jnp.zeros(query.shape, dtype), None if bias is None else jnp.zeros(bias.shape, dtype))
    (query_grad, bias_grad), (key_grad_t, value_grad_t) = lax.scan(
        key_block, init, jnp.arange(tiling.num_key_blocks)
    )  # key_grad_t: (nk, B, K, H, bk), value_grad_t: (nk, B, K, Hv, bk)
    scale_grad = jnp.sum(query_grad * query.astype(dtype))  # sum(dS * Q K^T)
    key_grad = jnp.transpose(key_grad_t, (1, 2, 0, 4, 3)).reshape(key.shape)  # (B, K, Sp, H)
    value_grad = jnp.transpose(value_grad_t, (1, 2, 0, 4, 3)).reshape(value.shape)  # (B, K, Sp, Hv)
    return (
        (query_grad * scale).astype(query.dtype),
        (key_grad * scale).astype(key.dtype),
        value_grad.astype(value.dtype),
        None,  # `bad` and the masking: no gradient
        None,
        None if bias is None or bias_grad is None else bias_grad.astype(bias.dtype),
        scale_grad.astype(scale.dtype),
    )


_attention.defvjp(_attention_fwd, _attention_bwd)


def _pad_axis(x: Array, axis: int, length: int, value=0) -> Array:
    """Pads axis `axis` of `x` at the end to `length` (no-op for size-1 axes)."""
    if x.shape[axis] in (1, length):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def flatten_batch(x: Array, batch: tuple[int, ...]) -> Array:
    """An array broadcastable to `[batch..., N, T, S]` as `[B|1, N|1, T|1, S|1]`.

    The batch dims become one (of size 1 when `x` is broadcast over all of
    them); the other axes keep their broadcast size 1.
    """
    x = jnp.reshape(x, (1,) * (len(batch) + 3 - x.ndim) + x.shape)  # rank of (batch..., N, T, S)
    *x_batch, heads, positions, keys = x.shape
    if all(n == 1 for n in x_batch):
        return x.reshape(1, heads, positions, keys)  # (1, N|1, T|1, S|1)
    return jnp.broadcast_to(x, (*batch, heads, positions, keys)).reshape(-1, heads, positions, keys)


def _to_tiles(x: Array | None, batch: tuple[int, ...], K: int, Tp: int, Sp: int, fill) -> Array | None:
    """A mask or bias broadcastable to `[batch..., N, T, S]` as `[B|1, K|1, Tp|1, G|1, Sp|1]`.

    Broadcast (size-1) axes stay size 1; T and S are padded with `fill`.
    """
    if x is None:
        return None
    x = flatten_batch(x, batch)  # (B|1, N|1, T|1, S|1)
    B, heads, positions, keys = x.shape
    if heads > 1:
        x = x.reshape(B, K, heads // K, positions, keys)  # (B|1, K, G, T|1, S|1)
        x = jnp.swapaxes(x, 2, 3)  # (B|1, K, T|1, G, S|1)
    else:
        x = x[:, :, :, None, :]  # (B|1, 1, T|1, 1, S|1)
    return _pad_axis(_pad_axis(x, 2, Tp, fill), 4, Sp, fill)


def _bad_entries(key_finite: Array, value_finite: Array, tiling: _Tiling) -> _BadEntries:
    """`_BadEntries` from where keys `[batch..., S, K, H]` and values `[..., S, K, Hv]` are finite."""
    *_, S, K, Hv = value_finite.shape
    Sp = tiling.num_key_blocks * tiling.block_k
    key_nan = jnp.where(jnp.all(key_finite, axis=-1), 0.0, jnp.nan).astype(tiling.dtype)  # (..., S, K)
    key_nan = _pad_axis(jnp.swapaxes(key_nan.reshape(-1, S, K), 1, 2), 2, Sp)  # (B, K, Sp)
    bad_values = jnp.swapaxes(~value_finite.reshape(-1, S, K, Hv), 1, 2)  # (B, K, S, Hv)
    bad_values = _pad_axis(bad_values, 2, Sp, False)  # (B, K, Sp, Hv)
    bad_blocks = jnp.any(
        bad_values.reshape(*bad_values.shape[:2], -1, tiling.block_k, Hv), axis=(0, 1, 3, 4)
    )  # (nk,)
    return _BadEntries(key_nan, bad_values, bad_blocks)


def chunked_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | None = None,
    bias: Array | None = None,
    is_causal: bool = False,
    scale: float | Array | None = None,
    query_seq_lengths: Array | None = None,
    key_value_seq_lengths: Array | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    precision: Any = None,
) -> Array:
    """Attention in `[block_q, block_k]` tiles with O(T x block) memory.

    Args:
      query: `[batch..., T, N, H]`.
      key: `[batch..., S, K, H]`; K divides N (query head n reads kv head
        `n // (N // K)`).
      value: `[batch..., S, K, Hv]`.
      mask: optional boolean (True = may attend) broadcastable to
        `[batch..., N, T, S]`.
      bias: optional additive bias broadcastable to `[batch..., N, T, S]`;
        -inf entries forbid like a False mask. Differentiable, as is `scale`.
      is_causal: the T queries are the last T of S positions; key blocks above
        the diagonal are skipped.
      scale: logits multiplier, default `1/sqrt(H)`.
      query_seq_lengths: optional integer lengths `[batch...]`: query rows
        t >= length are padding (zero output, no gradient).
      key_value_seq_lengths: optional integer lengths `[batch...]`: keys
        s >= length are never attended. Both act tile by tile, with no
        `[T, S]` mask in memory.
      block_q, block_k: tile sizes, clipped to T and S; T and S are padded to
        whole blocks.
      precision: of every dot, forward and backward (flax's spelling: None,
        a string, a `jax.lax.Precision` or a pair); None is JAX's default.

    Returns:
      `[batch..., T, N, Hv]` in the inputs' result dtype. Logits, softmax and
      accumulators are float32 (float64 for float64 inputs); a row with no
      allowed key gives zeros, with finite gradients. NaN/inf in keys and
      values as in `dot_product_attention`'s reference path (module docstring).
    """
    *batch, T, N, H = query.shape
    S, K, Hv = key.shape[-3], key.shape[-2], value.shape[-1]
    G = N // K
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"chunked_attention: {name} must be a positive int, got {size!r}")
    out_dtype = jnp.result_type(query, key, value)
    compute_dtype = jnp.promote_types(out_dtype, jnp.float32)
    tiling = _Tiling(
        T=T,
        S=S,
        G=G,
        block_q=min(block_q, T),
        block_k=min(block_k, S),
        is_causal=is_causal,
        dtype=compute_dtype,
        precision=precision,
    )
    Tp = tiling.num_query_blocks * tiling.block_q  # T padded to whole blocks
    Sp = tiling.num_key_blocks * tiling.block_k
    key_finite, value_finite = jnp.isfinite(key), jnp.isfinite(value)
    bad = _bad_entries(key_finite, value_finite, tiling)
    query = jnp.swapaxes(query.reshape(-1, T, K, G, H), 1, 2)  # (B, K, T, G, H)
    query = _pad_axis(query, 2, Tp).reshape(-1, K, Tp * G, H)  # (B, K, Tp*G, H)
    key = jnp.where(key_finite, key, 0).reshape(-1, S, K, H)  # (B, S, K, H)
    key = _pad_axis(jnp.swapaxes(key, 1, 2), 2, Sp)  # (B, K, Sp, H)
    value = jnp.where(value_finite, value, 0).reshape(-1, S, K, Hv)  # (B, S, K, Hv)
    value = _pad_axis(jnp.swapaxes(value, 1, 2), 2, Sp)  # (B, K, Sp, Hv)
    masking = _Masking(
        _to_tiles(mask, tuple(batch), K, Tp, Sp, False),  # (B|1, K|1, Tp|1, G|1, Sp|1)
        *(
            None if n is None else jnp.broadcast_to(n, tuple(batch)).reshape(-1)  # (B,)
            for n in (query_seq_lengths, key_value_seq_lengths)
        ),
    )
    if bias is not None:
        bias = _to_tiles(bias.astype(compute_dtype), tuple(batch), K, Tp, Sp, 0)
    scale = jnp.asarray(1.0 / math.sqrt(H) if scale is None else scale, compute_dtype)
    output, poison = _attention(tiling, query, key, value, bad, masking, bias, scale)  # (B, K, Tp*G, Hv) both
    output = jnp.where(poison, jnp.nan, output).reshape(-1, K, Tp, G, Hv)[:, :, :T]  # (B, K, T, G, Hv)
    return jnp.swapaxes(output, 1, 2).reshape(*batch, T, N, Hv).astype(out_dtype)
