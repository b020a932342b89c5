"""Blocked online-softmax attention (flash-style) with a recomputing backward pass.

`chunked_attention` computes the same `softmax(Q K^T * scale + bias, masked) V`
as `qkv_jax.dot_product_attention`, one tile of `block_q` query positions by
`block_k` keys at a time: each query block keeps a running row maximum, softmax
normaliser and output accumulator, rescaled as key blocks arrive (Milakov &
Gimelshein 2018; Dao et al. 2022). The forward pass saves only the output and
the row log-sum-exp; the backward pass recomputes each tile of attention
weights from them. With `is_causal`, the loops stop at the diagonal: key
blocks above it are never computed.

Memory is what makes this fast on a CPU. Every buffer a tile needs (logits,
weights, the tile's copies of Q, K, V) is O(batch x heads x block_q x block_k),
a few MiB by default (`block_sizes`), so tiles stay in cache and a call
allocates no `[T, S]` buffer and no transposed copy of K or V: with glibc's
malloc an allocation of 32 MiB or more is a fresh mmap whose pages fault in on
first touch, on every call (XLA:CPU allocates a program's temporaries as one
block per call), and with 64 MiB tiles that cost more than the arithmetic.
Nothing is padded: a last block that would run past T (or S) starts earlier
instead and overlaps its predecessor; the rows (keys) it repeats are masked
where they would be counted twice.

Layout of the public function as in `qkv_jax.attention`: query
`[batch..., T, N, H]`, key `[batch..., S, K, H]`, value `[batch..., S, K, Hv]`,
with `B` the flattened batch and `G = N // K` query heads per kv head. Inside,
each kv head has `T * G` query rows, row `t * G + g` (so a query block's rows
are contiguous), and a tile's logits are `[B, K, bq*G, bk]`: dots with the
single batch `(B, K)` and 2-D operands, which XLA runs at the CPU's matmul
speed. A dot on a slice of `[B, S, K, H]` needs a transposing copy of that
slice anyway, so K and V are copied tile by tile from the caller's layout,
never as a whole; the backward pass copies each key block once (it is the
outer loop) and the output gradient once for all. Every dot, forward and
backward, takes the call's `precision`. Sequence lengths mask each tile as it
is computed. The kernel runs inside `shard_map` (its loop carries take the
mesh axes the inputs vary along): on a CPU that is how a program with several
CPU devices (`jax_num_cpu_devices`) runs attention on all its cores at once,
split over heads or batch.

Non-finite keys and values behave as in the reference path. A key with a
non-finite entry becomes NaN before the matmul, so its logit column is NaN
exactly where it may be attended (masking replaces the rest with -inf), and
zero where the backward pass multiplies by it. Non-finite values are zeroed,
so where masked out they reach neither output nor gradients; an attended one
turns its (row, channel) NaN (a product of the allowed pairs with an
indicator of bad values, run only when some value is non-finite). Gradients
through NaN outputs are zero.
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

__all__ = [
    "chunked_attention",
    "flatten_batch",
    "block_sizes",
    "TILE_ELEMENTS",
    "KEY_BLOCK",
    "BACKWARD_KEY_BLOCK",
]

# Logits per tile, summed over batch and heads, that the default tile sizes aim at: 2**20 is
# 4 MiB in float32, which stays in cache and below glibc's 32 MiB mmap threshold. Key blocks
# of 64 forward keep the per-tile copies of K and V small next to the tile's work; the
# backward pass, whose dK and dV accumulate over every query block, runs faster with 128
# (python benchmarks/attention.py --tune-blocks; benchmarks/results/attention_blocks.json).
TILE_ELEMENTS = 2**20
KEY_BLOCK = 64
BACKWARD_KEY_BLOCK = 128
MIN_BLOCK, MAX_BLOCK = 32, 512


def _power_of_two_at_most(x: float) -> int:
    return 1 << max(0, int(math.floor(math.log2(max(x, 1.0)))))


def block_sizes(batch_heads: int, T: int, S: int, *, backward: bool = False) -> tuple[int, int]:
    """Default `(block_q, block_k)` for `batch_heads` = batch x query heads.

    `KEY_BLOCK` keys (`BACKWARD_KEY_BLOCK` for the backward pass) by as many
    queries (a power of two in [`MIN_BLOCK`, `MAX_BLOCK`]) as make about
    `TILE_ELEMENTS` logits over the batch and heads; when the queries run out
    (T) or reach `MAX_BLOCK`, the key block grows into what is left of the
    budget. Both are clipped to T and S. A problem of at most `2 * TILE_ELEMENTS` logits in all
    is one tile in both passes: the loops' overhead then costs more than the
    cache misses (at 8 MiB of logits: 0.83x the time of the tiled backward).
    """
    if batch_heads * T * S <= 2 * TILE_ELEMENTS:
        return T, S
    elements = TILE_ELEMENTS / max(batch_heads, 1)
    block_k = min(BACKWARD_KEY_BLOCK if backward else KEY_BLOCK, S)
    block_q = min(max(_power_of_two_at_most(elements / block_k), MIN_BLOCK), MAX_BLOCK, T)
    if block_q in (T, MAX_BLOCK):
        block_k = min(max(_power_of_two_at_most(elements / block_q), block_k), MAX_BLOCK, S)
    return block_q, block_k


class _Masking(NamedTuple):
    """What may be attended besides causality: a mask tiled as the logits, and lengths."""

    mask: Array | None  # (B|1, K|1, T|1, G|1, S|1) bool
    query_lengths: Array | None  # (B,) int: rows t >= length are padding
    key_lengths: Array | None  # (B,) int: keys s >= length are never attended


@dataclasses.dataclass(frozen=True)
class _Tiling:
    """Static facts of one call: lengths, heads, block sizes, dtype, precision."""

    T: int
    S: int
    K: int  # kv heads
    G: int  # query heads per kv head
    block_q: int
    block_k: int
    is_causal: bool
    dtype: jnp.dtype  # of logits, softmax, accumulators and every dot's operands
    precision: Any = None  # of every dot (flax's PrecisionLike)
    backward_blocks: tuple[int, int] | None = None  # (block_q, block_k) of the backward pass

    def for_backward(self) -> _Tiling:
        """The tiling of the backward pass (the log-sum-exp is per row: any tiles will do)."""
        if self.backward_blocks is None:
            return self
        block_q, block_k = self.backward_blocks
        return dataclasses.replace(self, block_q=block_q, block_k=block_k, backward_blocks=None)

    @property
    def num_query_blocks(self) -> int:
        return -(-self.T // self.block_q)

    @property
    def num_key_blocks(self) -> int:
        return -(-self.S // self.block_k)

    def query_start(self, i: Array) -> Array:
        """First row of query block i; the last block ends at T (it may overlap block i - 1)."""
        return jnp.minimum(i * self.block_q, self.T - self.block_q)

    def key_start(self, j: Array) -> Array:
        """First key of key block j; the last block ends at S (it may overlap block j - 1)."""
        return jnp.minimum(j * self.block_k, self.S - self.block_k)

    def key_blocks_for(self, i: Array) -> Array | int:
        """How many key blocks query block i reads: all, or up to the diagonal."""
        if not self.is_causal:
            return self.num_key_blocks
        last_key = self.query_start(i) + self.block_q - 1 + (self.S - self.T)  # its last row's last key
        return jnp.clip(last_key // self.block_k + 1, 0, self.num_key_blocks)

    def first_query_block_for(self, j: Array) -> Array | int:
        """The first query block that reads key block j (0 unless causal)."""
        if not self.is_causal:
            return 0
        first_row = j * self.block_k - (self.S - self.T)  # the first row allowed key j * block_k
        return jnp.clip(first_row // self.block_q, 0, self.num_query_blocks)


def _block(x: Array, axis: int, start: Array, size: int) -> Array:
    """`size` entries of `x` from `start` along `axis`; a size-1 (broadcast) axis is kept whole."""
    if x.shape[axis] == 1:
        return x
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _to_rows(x: Array, tiling: _Tiling, dtype) -> Array:
    """`[B, P, N, D]` as the kernel's rows `[B, K, P * G, D]` (row p * G + g) in `dtype`."""
    B, positions, _, depth = x.shape
    x = x.astype(dtype).reshape(B, positions, tiling.K, tiling.G, depth)
    return jnp.swapaxes(x, 1, 2).reshape(B, tiling.K, -1, depth)  # (B, K, P*G, D)


def _from_rows(x: Array, tiling: _Tiling) -> Array:
    """The kernel's rows `[B, K, P * G, D]` as `[B, P, N, D]`."""
    B, _, rows, depth = x.shape
    x = x.reshape(B, tiling.K, rows // tiling.G, tiling.G, depth)  # (B, K, P, G, D)
    return jnp.swapaxes(x, 1, 2).reshape(B, rows // tiling.G, tiling.K * tiling.G, depth)


def _rows_of(x: Array, tiling: _Tiling, start: Array) -> Array:
    """The rows `[B, K, bq*G, ...]` of the query block at `start` in `[B, K, T*G, ...]`."""
    return lax.dynamic_slice_in_dim(x, start * tiling.G, tiling.block_q * tiling.G, axis=2)


def _row_positions(tiling: _Tiling, start: Array) -> Array:
    """The query position of each of a block's `bq * G` rows, `(bq*G,)`."""
    return start + jnp.arange(tiling.block_q * tiling.G) // tiling.G


def _tile_of(x: Array, tiling: _Tiling, start: Array, key_start: Array) -> Array:
    """Tile (start, key_start) of a `[B|1, K|1, T|1, G|1, S|1]` mask or bias as
    `[B|1, K|1, bq*G|1, bk|1]` (the rows axis is 1 when `x` is broadcast over queries and heads)."""
    x = _block(_block(x, 2, start, tiling.block_q), 4, key_start, tiling.block_k)  # (., ., bq|1, G|1, bk|1)
    B, K, positions, heads, keys = x.shape
    if heads > 1 or positions > 1:
        x = jnp.broadcast_to(x, (B, K, tiling.block_q, tiling.G, keys))
    return x.reshape(B, K, -1, keys)


def _add_at(x: Array, update: Array, start: Array, axis: int) -> Array:
    """`x` with `update` added to the block that starts at `start` along `axis`."""
    current = lax.dynamic_slice_in_dim(x, start, update.shape[axis], axis=axis)
    return lax.dynamic_update_slice_in_dim(x, current + update, start, axis=axis)


def _and(a: Array | None, b: Array) -> Array:
    return b if a is None else a & b


def _carry_zero(dtype, *arrays: Any) -> Array:
    """A scalar 0 in `dtype` that varies along every mesh axis any of `arrays` (or their
    leaves) varies along inside `shard_map`: added to a loop's initial carries, it gives them
    the type the loop body computes. Outside `shard_map` it is a constant 0."""
    zero = jnp.zeros((), dtype)
    for leaf in jax.tree.leaves(arrays):
        zero = zero + jnp.zeros_like(leaf, shape=()).astype(dtype)
    return zero


def _allowed(tiling: _Tiling, masking: _Masking, start: Array, key_start: Array, i, j, backward: bool):
    """Which entries of tile (i, j) may be attended, broadcastable to `[B, K, bq*G, bk]`, or None.

    The tile's queries start at `start`, its keys at `key_start`. Forbidden:
    the mask, the causal triangle, padding by lengths, and the keys a last key
    block repeats from its predecessor; in the backward pass also the repeated
    rows of a last query block (the forward pass recomputes them to the same
    values).
    """
    rows = _row_positions(tiling, start)  # (bq*G,)
    keys = key_start + jnp.arange(tiling.block_k)  # (bk,)
    allowed = None if masking.mask is None else _tile_of(masking.mask, tiling, start, key_start)
    if tiling.is_causal:
        allowed = _and(allowed, keys[None, :] <= rows[:, None] + (tiling.S - tiling.T))  # (bq*G, bk)
    if masking.key_lengths is not None:
        key_valid = keys[None, :] < masking.key_lengths[:, None]  # (B, bk)
        allowed = _and(allowed, key_valid[:, None, None, :])
    if masking.query_lengths is not None:
        row_valid = rows[None, :] < masking.query_lengths[:, None]  # (B, bq*G)
        allowed = _and(allowed, row_valid[:, None, :, None])
    if tiling.S % tiling.block_k:
        allowed = _and(allowed, keys >= j * tiling.block_k)  # (bk,)
    if backward and tiling.T % tiling.block_q:
        allowed = _and(allowed, rows[:, None] >= i * tiling.block_q)  # (bq*G, 1)
    return allowed


def _tile_logits(tiling: _Tiling, query_rows, key_block, masking, bias, scale, i, j, backward=False):
    """Biased, masked logits `[B, K, bq*G, bk]` of tile (i, j), times `scale` when given.

    query_rows `[B, K, bq*G, H]`, key_block `[B, K, bk, H]`; -inf where not allowed.
    """
    logits = jnp.einsum(
        "bkrh,bkch->bkrc", query_rows, key_block, precision=tiling.precision
    )  # (B, K, bq*G, bk)
    if scale is not None:
        logits = logits * scale
    start, key_start = tiling.query_start(i), tiling.key_start(j)
    if bias is not None:
        logits = logits + _tile_of(bias, tiling, start, key_start)
    allowed = _allowed(tiling, masking, start, key_start, i, j, backward)
    return logits if allowed is None else jnp.where(allowed, logits, -jnp.inf)


def _poisoned(output_rows, tiling: _Tiling, value, finite_values, masking, bias, i, zero):
    """Query block i's output rows `[B, K, bq*G, Hv]`, NaN where a row attends a non-finite value.

    `value` is the caller's `[B, S, K, Hv]`, `finite_values` whether all of it
    is finite (then nothing runs), `zero` the loops' `_carry_zero`. A (row, key) pair is attended where
    the masking and the bias allow it; a bad value there makes the row's
    channel NaN. Each key block costs a product of the allowed pairs with an
    indicator of bad values.
    """
    B, K, rows, Hv = output_rows.shape

    def key_step(j, reached):
        key_start = tiling.key_start(j)
        allowed = _allowed(tiling, masking, tiling.query_start(i), key_start, i, j, backward=False)
        allowed = jnp.ones((), jnp.bool_) if allowed is None else allowed
        if bias is not None:
            allowed = allowed & (_tile_of(bias, tiling, tiling.query_start(i), key_start) > -jnp.inf)
        allowed = jnp.broadcast_to(allowed, (B, K, rows, tiling.block_k)).astype(tiling.dtype)
        bad = ~jnp.isfinite(lax.dynamic_slice_in_dim(value, key_start, tiling.block_k, axis=1))
        bad = jnp.swapaxes(bad, 1, 2).astype(tiling.dtype)  # (B, K, bk, Hv)
        return reached + jnp.einsum("bkrc,bkch->bkrh", allowed, bad, precision=tiling.precision)

    def mark(output_rows):
        reached = lax.fori_loop(
            0, tiling.key_blocks_for(i), key_step, jnp.zeros(output_rows.shape, tiling.dtype) + zero
        )
        return jnp.where(reached > 0, jnp.nan, output_rows)

    return lax.cond(finite_values, lambda rows: rows, mark, output_rows)


def _key_block(key: Array, value: Array, key_start: Array, tiling: _Tiling, zero_keys: bool = False):
    """Keys and values `[B, K, bk, H]` from `key_start` of `[B, S, K, H]`, in the compute dtype.

    Non-finite key entries become NaN (or 0 with `zero_keys`), values 0. The
    transposing copy is the one a dot on a slice would make anyway.
    """
    key_j = jnp.swapaxes(lax.dynamic_slice_in_dim(key, key_start, tiling.block_k, axis=1), 1, 2)
    value_j = jnp.swapaxes(lax.dynamic_slice_in_dim(value, key_start, tiling.block_k, axis=1), 1, 2)
    bad_key = 0 if zero_keys else jnp.nan
    return (
        jnp.where(jnp.isfinite(key_j), key_j, bad_key).astype(tiling.dtype),  # (B, K, bk, H)
        jnp.where(jnp.isfinite(value_j), value_j, 0).astype(tiling.dtype),  # (B, K, bk, Hv)
    )


def _forward(tiling: _Tiling, query, key, value, masking, bias, scale):
    """Output `[B, T, N, Hv]` (NaN where a bad value is attended) and log-sum-exp `[B, K, T*G]`.

    For query block i (outer loop) and each key block j it reads (inner loop):
    logits, then the running maximum m, normaliser l and accumulator o become
    m' = max(m, rowmax), l' = l e^(m - m') + rowsum(P), o' = o e^(m - m') + P V_j
    with P = exp(logits - m'); the block's output is o / l.
    """
    B, T, N, _ = query.shape
    Hv = value.shape[-1]
    K, G, bq, dtype = tiling.K, tiling.G, tiling.block_q, tiling.dtype
    rows = G * bq
    zero = _carry_zero(dtype, query, key, value, masking, bias, scale)
    finite_values = jnp.max(jnp.abs(value)) < jnp.inf  # a NaN max is not; fuses, unlike jnp.all(isfinite)

    def query_block(i, carry):
        output, log_sum_exp = carry
        start = tiling.query_start(i)
        query_i = lax.dynamic_slice_in_dim(query, start, bq, axis=1)  # (B, bq, N, H)
        query_rows = _to_rows(query_i, tiling, dtype) * scale  # (B, K, bq*G, H), scaled

        def key_step(j, state):
            row_max, normaliser, accumulator = state
            key_j, value_j = _key_block(key, value, tiling.key_start(j), tiling)  # (B, K, bk, H|Hv)
            logits = _tile_logits(tiling, query_rows, key_j, masking, bias, None, i, j)  # (B, K, bq*G, bk)
            new_max = jnp.maximum(row_max, jnp.max(logits, axis=-1))  # (B, K, bq*G)
            shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)  # finite, for all-masked rows
            weights = jnp.exp(logits - shift[..., None])  # (B, K, bq*G, bk)
            rescale = jnp.exp(row_max - shift)  # (B, K, bq*G)
            blended = jnp.einsum(
                "bkrc,bkch->bkrh", weights, value_j, precision=tiling.precision
            )  # (B, K, bq*G, Hv)
            return (
                new_max,
                normaliser * rescale + jnp.sum(weights, axis=-1),
                accumulator * rescale[..., None] + blended,
            )

        init = (
            jnp.full((B, K, rows), -jnp.inf, dtype) + zero,
            jnp.zeros((B, K, rows), dtype) + zero,
            jnp.zeros((B, K, rows, Hv), dtype) + zero,
        )
        row_max, normaliser, accumulator = lax.fori_loop(0, tiling.key_blocks_for(i), key_step, init)
        has_keys = normaliser > 0
        output_i = accumulator / jnp.where(has_keys, normaliser, 1.0)[..., None]  # (B, K, bq*G, Hv)
        output_i = _from_rows(
            _poisoned(output_i, tiling, value, finite_values, masking, bias, i, zero), tiling
        )  # (B, bq, N, Hv)
        log_sum_exp_i = jnp.where(has_keys, row_max + jnp.log(normaliser), 0.0)  # 0 for rows with no key
        return (
            lax.dynamic_update_slice_in_dim(output, output_i, start, axis=1),
            lax.dynamic_update_slice_in_dim(log_sum_exp, log_sum_exp_i, start * G, axis=2),
        )

    init = (jnp.zeros((B, T, N, Hv), dtype) + zero, jnp.zeros((B, K, T * G), dtype) + zero)
    return lax.fori_loop(0, tiling.num_query_blocks, query_block, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(tiling: _Tiling, query, key, value, masking, bias, scale):
    """Output `[B, T, N, Hv]` in `tiling.dtype`."""
    return _forward(tiling, query, key, value, masking, bias, scale)[0]


def _attention_fwd(tiling: _Tiling, query, key, value, masking, bias, scale):
    output, log_sum_exp = _forward(tiling, query, key, value, masking, bias, scale)
    return output, (query, key, value, masking, bias, scale, output, log_sum_exp)


def _bias_grad_add(bias_grad: Array, logits_grad: Array, start: Array, key_start: Array, tiling: _Tiling):
    """Adds tile dS `[B, K, bq*G, bk]` into `[B|1, K|1, T|1, G|1, S|1]` at (start, key_start),
    summed over the axes along which the bias was broadcast."""
    B, K, _, keys = logits_grad.shape
    logits_grad = logits_grad.reshape(B, K, tiling.block_q, tiling.G, keys)  # (B, K, bq, G, bk)
    broadcast = tuple(a for a in range(5) if bias_grad.shape[a] == 1 and logits_grad.shape[a] > 1)
    tile = jnp.sum(logits_grad, axis=broadcast, keepdims=True)  # (B|1, K|1, bq|1, G|1, bk|1)
    corner = (0, 0, start if bias_grad.shape[2] > 1 else 0, 0, key_start if bias_grad.shape[4] > 1 else 0)
    current = lax.dynamic_slice(bias_grad, corner, tile.shape)
    return lax.dynamic_update_slice(bias_grad, current + tile, corner)


def _row_dot(output_grad: Array, output: Array) -> Array:
    """D = rowsum(dO * O) `[B, T, N, 1]` over the entries that are not NaN.

    The plain product reads dO and O once, with nothing materialised; only
    when some row comes out NaN (an attended bad value) is it summed again
    with the NaN entries left out.
    """
    row_dot = jnp.sum(output_grad * output, axis=-1, keepdims=True)
    return lax.cond(
        jnp.any(jnp.isnan(row_dot)),
        lambda: jnp.sum(jnp.where(jnp.isnan(output), 0.0, output_grad * output), axis=-1, keepdims=True),
        lambda: row_dot,
    )


def _attention_bwd(tiling: _Tiling, residuals, output_grad):
    """Recomputes each tile's weights from the saved log-sum-exp (FlashAttention-2).

    For key block j (outer loop) and each query block i that reads it (inner
    loop): P = exp(logits - lse), dV_j += P^T dO_i, dS = P * (dO_i V_j^T - D_i)
    with D = rowsum(dO * O), dQ_i += dS K_j scale, dK_j += dS^T Q_i scale,
    dBias_ij = dS. dK_j and dV_j accumulate transposed, `[B, K, H, bk]`: XLA runs
    Q^T dS as a faster CPU dot than dS^T Q. An output entry that is NaN passes
    no gradient.
    """
    query, key, value, masking, bias, scale, output, log_sum_exp = residuals
    tiling = tiling.for_backward()
    dtype, precision = tiling.dtype, tiling.precision
    B, T, _, H = query.shape
    K, bq, bk = tiling.K, tiling.block_q, tiling.block_k
    Hv = value.shape[-1]
    output_grad = output_grad.astype(dtype)
    row_dot = _to_rows(_row_dot(output_grad, output), tiling, dtype)  # D: (B, K, T*G, 1)
    output_grad = jnp.where(jnp.isnan(output), 0.0, output_grad)  # (B, T, N, Hv), fused into the copy
    output_grad_rows = _to_rows(output_grad, tiling, dtype)  # (B, K, T*G, Hv)
    dot = functools.partial(jnp.einsum, precision=precision)
    zero = _carry_zero(dtype, residuals, output_grad)

    def key_block(j, carry):
        query_grad, key_grad, value_grad, bias_grad, scale_grad = carry
        key_start = tiling.key_start(j)
        key_nan_j, value_j = _key_block(key, value, key_start, tiling)  # (B, K, bk, H|Hv)
        key_zero_j, _ = _key_block(key, value, key_start, tiling, zero_keys=True)

        def query_step(i, grads):
            query_grad, bias_grad, key_grad_j, value_grad_j, scale_grad = grads
            start = tiling.query_start(i)
            query_i = _to_rows(lax.dynamic_slice_in_dim(query, start, bq, axis=1), tiling, dtype)
            output_grad_i = _rows_of(output_grad_rows, tiling, start)  # (B, K, bq*G, Hv)
            logits = _tile_logits(tiling, query_i, key_nan_j, masking, bias, scale, i, j, backward=True)
            weights = jnp.exp(logits - _rows_of(log_sum_exp, tiling, start)[..., None])  # (B, K, bq*G, bk)
            value_grad_j += dot("bkrh,bkrc->bkhc", output_grad_i, weights)  # (B, K, Hv, bk)
            weights_grad = dot("bkrh,bkch->bkrc", output_grad_i, value_j)  # (B, K, bq*G, bk)
            logits_grad = weights * (weights_grad - _rows_of(row_dot, tiling, start))  # dS: (B, K, bq*G, bk)
            query_grad_i = dot("bkrc,bkch->bkrh", logits_grad, key_zero_j)  # (B, K, bq*G, H), dS K
            scale_grad += jnp.sum(query_grad_i * query_i)  # sum(dS * Q K^T); dropped when unused
            query_grad = _add_at(query_grad, _from_rows(query_grad_i * scale, tiling), start, axis=1)
            key_grad_j += dot("bkrh,bkrc->bkhc", query_i, logits_grad)  # (B, K, H, bk)
            if bias is not None:
                bias_grad = _bias_grad_add(bias_grad, logits_grad, start, key_start, tiling)
            return query_grad, bias_grad, key_grad_j, value_grad_j, scale_grad

        init = (
            query_grad,
            bias_grad,
            jnp.zeros((B, K, H, bk), dtype) + zero,
            jnp.zeros((B, K, Hv, bk), dtype) + zero,
            scale_grad,
        )
        query_grad, bias_grad, key_grad_j, value_grad_j, scale_grad = lax.fori_loop(
            tiling.first_query_block_for(j), tiling.num_query_blocks, query_step, init
        )
        key_grad = _add_at(key_grad, jnp.transpose(key_grad_j * scale, (0, 3, 1, 2)), key_start, axis=1)
        value_grad = _add_at(value_grad, jnp.transpose(value_grad_j, (0, 3, 1, 2)), key_start, axis=1)
        return query_grad, key_grad, value_grad, bias_grad, scale_grad

    init = (
        jnp.zeros(query.shape, dtype) + zero,
        jnp.zeros(key.shape, dtype) + zero,
        jnp.zeros(value.shape, dtype) + zero,
        None if bias is None else jnp.zeros(bias.shape, dtype) + zero,
        zero,
    )
    query_grad, key_grad, value_grad, bias_grad, scale_grad = lax.fori_loop(
        0, tiling.num_key_blocks, key_block, init
    )
    return (
        query_grad.astype(query.dtype),
        key_grad.astype(key.dtype),
        value_grad.astype(value.dtype),
        None,  # the masking: no gradient
        None if bias is None else bias_grad.astype(bias.dtype),
        scale_grad.astype(scale.dtype),
    )


_attention.defvjp(_attention_fwd, _attention_bwd)


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


def _to_tiles(x: Array | None, batch: tuple[int, ...], K: int) -> Array | None:
    """A mask or bias broadcastable to `[batch..., N, T, S]` as `[B|1, K|1, T|1, G|1, S|1]`,
    the order of the kernel's rows (a copy only when it varies over both heads and queries)."""
    if x is None:
        return None
    x = flatten_batch(x, batch)  # (B|1, N|1, T|1, S|1)
    B, heads, positions, keys = x.shape
    if heads == 1:
        return x[:, :, :, None, :]  # (B|1, 1, T|1, 1, S|1)
    return jnp.swapaxes(x.reshape(B, K, heads // K, positions, keys), 2, 3)  # (B|1, K, T|1, G, S|1)


def _check_blocks(block_q: Any, block_k: Any) -> None:
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
            raise ValueError(f"chunked_attention: {name} must be a positive int or None, got {size!r}")


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
    block_q: int | None = None,
    block_k: int | None = None,
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
      block_q, block_k: tile sizes of both passes, clipped to T and S; None:
        `block_sizes`'s, about `TILE_ELEMENTS` logits per tile over the batch
        and heads (half that backward).
      precision: of every dot, forward and backward (flax's spelling: None,
        a string, a `jax.lax.Precision` or a pair); None is JAX's default.

    Returns:
      `[batch..., T, N, Hv]` in the inputs' result dtype. Inputs are cast to
      float32 (float64 for float64 inputs) for every dot, the softmax and the
      accumulators; a row with no allowed key gives zeros, with finite
      gradients. NaN/inf in keys and values as in `dot_product_attention`'s
      reference path (module docstring).
    """
    *batch, T, N, H = query.shape
    S, K, Hv = key.shape[-3], key.shape[-2], value.shape[-1]
    _check_blocks(block_q, block_k)
    B = math.prod(batch)
    default_q, default_k = block_sizes(B * N, T, S)
    backward_blocks = None if block_q or block_k else block_sizes(B * N, T, S, backward=True)
    out_dtype = jnp.result_type(query, key, value)
    compute_dtype = jnp.promote_types(out_dtype, jnp.float32)
    tiling = _Tiling(
        T=T,
        S=S,
        K=K,
        G=N // K,
        block_q=min(block_q or default_q, T),
        block_k=min(block_k or default_k, S),
        is_causal=is_causal,
        dtype=compute_dtype,
        precision=precision,
        backward_blocks=backward_blocks,
    )
    masking = _Masking(
        _to_tiles(mask, tuple(batch), K),
        *(
            None if n is None else jnp.broadcast_to(n, tuple(batch)).reshape(-1)  # (B,)
            for n in (query_seq_lengths, key_value_seq_lengths)
        ),
    )
    if bias is not None:
        bias = _to_tiles(bias.astype(compute_dtype), tuple(batch), K)
    scale = jnp.asarray(1.0 / math.sqrt(H) if scale is None else scale, compute_dtype)
    # Inside shard_map every differentiable input takes the mesh axes any input varies along
    # (the custom VJP's cotangents must have its arguments' types); elsewhere XLA drops the + 0.
    zero = _carry_zero(compute_dtype, query, key, value, masking, bias, scale)
    query, key, value = (x + zero.astype(x.dtype) for x in (query, key, value))
    bias = None if bias is None else bias + zero
    output = _attention(
        tiling,
        query.reshape(-1, T, N, H),
        key.reshape(-1, S, K, H),
        value.reshape(-1, S, K, Hv),
        masking,
        bias,
        scale + zero,
    )  # (B, T, N, Hv)
    return output.reshape(*batch, T, N, Hv).astype(out_dtype)
