"""Blocked online-softmax attention (flash-style) with a recomputing backward pass.

`chunked_attention` computes the same `softmax(Q K^T * scale + bias, masked) V`
as `qkv_jax.dot_product_attention`, one tile of `block_q` query positions by
`block_k` keys at a time: each query block keeps a running row maximum, softmax
normaliser and output accumulator, rescaled as key blocks arrive (Milakov &
Gimelshein 2018; Dao et al. 2022). The forward pass saves only the output and
the row log-sum-exp; the backward pass recomputes each tile of attention
weights from them.

Tiles that no query of a block may attend are never computed, forward or
backward: the loops of both passes run over the key blocks (query blocks)
that the causal triangle and a local window, both shifted by the query
offset, leave within reach, and that the sequence lengths do not pad out.
With a window of w keys the cost grows as T x (w + block), not T x S. With
segment ids, a tile whose query block and key block share no segment id is
skipped by a conditional (its blocks' ranges of ids do not overlap).

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

Which keys each query sees is the package's `KeyVisibility`, held in the
kernel's layout (batch flattened, the mask tiled as the rows); each tile's
mask comes from `masks_at` and the tiles a block can reach from its
`key_bounds` and `query_bounds`.

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
backward, takes the call's `precision`. Sequence lengths, offsets and segment
ids mask each tile as it is computed. The kernel runs inside `shard_map` (its
loop carries take the mesh axes the inputs vary along): on a CPU that is how a
program with several CPU devices (`jax_num_cpu_devices`) runs attention on all
its cores at once, split over heads or batch.

Sinks (one logit per head that takes softmax mass and has no value) start each
row's running maximum and normaliser, so a row that sees no key ends with all
its mass on the sink. A soft cap `c * tanh(logits / c)` is applied to each
tile's biased logits before masking, and its slope recomputed backward.

Non-finite keys and values behave as in the reference path. A key with a
non-finite entry becomes NaN before the matmul, so its logit column is NaN
exactly where it may be attended (masking replaces the rest with -inf), and
zero where the backward pass multiplies by it. Non-finite values are zeroed,
so where masked out they reach neither output nor gradients; an attended one
turns its (row, channel) NaN (a product of the allowed pairs with an
indicator of bad values, run only when some value is non-finite). Gradients
through NaN outputs are zero. One array passed as both key and value (MLA's
absorbed decoding passes its latents so) skips the check of the values: a
non-finite entry there has already made the logit, and with it the whole row,
NaN wherever it may be attended. In a decode step that check, a conditional
over the whole cache, made XLA copy the latent cache three times per layer
(a 2-layer model's step at batch 32 took 1.6x as long).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qkv_jax.attention.options import check_soft_cap
from qkv_jax.attention.visibility import KeyVisibility, and_masks, masks_at, window_pair

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


def block_sizes(
    batch_heads: int,
    T: int,
    S: int,
    *,
    backward: bool = False,
    key_span: int | None = None,
    key_width: int | None = None,
) -> tuple[int, int]:
    """Default `(block_q, block_k)` for `batch_heads` = batch x query heads.

    `KEY_BLOCK` keys (`BACKWARD_KEY_BLOCK` for the backward pass) by as many
    queries (a power of two in [`MIN_BLOCK`, `MAX_BLOCK`]) as make about
    `TILE_ELEMENTS` logits over the batch and heads; when the queries run out
    (T) or reach `MAX_BLOCK`, the key block grows into what is left of the
    budget. Both are clipped to T and S. A problem of at most `2 * TILE_ELEMENTS` logits in all
    is one tile in both passes: the loops' overhead then costs more than the
    cache misses (at 8 MiB of logits: 0.83x the time of the tiled backward).
    That needs as well that a tile's copies of the keys and values, `key_width`
    (batch x kv heads x (H + Hv)) elements per key, hold at most `4 * TILE_ELEMENTS`
    (16 MiB in float32, half glibc's mmap threshold): a decode step's one query
    makes few logits, but the copies of a long cache then make the call's
    temporaries a fresh mapping whose pages fault in on every call (at B8 N14 K2
    H64, one query over 4096 keys, 32 MiB of copies: one tile takes about 2x
    the time of key blocks of 512; below 16 MiB one tile is as fast or faster;
    inside a whole decode step, whose temporaries are one larger block anyway,
    the two take the same time; python benchmarks/decode_attention.py).

    `key_span`, the most keys one query may see (a local window's width), caps
    both blocks at half of it (a power of two, at least `MIN_BLOCK`): a query
    block then reads about `key_span / block_k + 2` key blocks, so a tile mostly
    holds pairs the window allows.
    """
    copies = 0 if key_width is None else key_width * S
    if batch_heads * T * S <= 2 * TILE_ELEMENTS and copies <= 4 * TILE_ELEMENTS:
        return T, S
    elements = TILE_ELEMENTS / max(batch_heads, 1)
    cap = MAX_BLOCK
    if key_span is not None and key_span < S:
        cap = min(MAX_BLOCK, max(MIN_BLOCK, _power_of_two_at_most(key_span / 2)))
    block_k = min(BACKWARD_KEY_BLOCK if backward else KEY_BLOCK, S, cap)
    block_q = min(max(_power_of_two_at_most(elements / block_k), MIN_BLOCK), cap, T)
    if block_q in (T, cap):
        block_k = min(max(_power_of_two_at_most(elements / block_q), block_k), cap, S)
    return block_q, block_k


class _Reach(NamedTuple):
    """Scalars that bound the tiles any batch element needs (from the kernel's `KeyVisibility`)."""

    offset_min: Array
    offset_max: Array
    query_end: Array  # rows from here on are padding in every batch element
    key_end: Array  # keys from here on are padding in every batch element


@dataclasses.dataclass(frozen=True)
class _Tiling:
    """Static facts of one call: lengths, heads, block sizes, what masks, dtype, precision."""

    T: int
    S: int
    K: int  # kv heads
    G: int  # query heads per kv head
    block_q: int
    block_k: int
    soft_cap: float | None
    dtype: jnp.dtype  # of logits, softmax, accumulators and every dot's operands
    precision: Any = None  # of every dot (flax's PrecisionLike)
    values_are_keys: bool = False  # the call passed one array as key and value
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
        return jnp.minimum(i * self.block_q, self.T - self.block_q).astype(jnp.int32)

    def key_start(self, j: Array) -> Array:
        """First key of key block j; the last block ends at S (it may overlap block j - 1)."""
        return jnp.minimum(j * self.block_k, self.S - self.block_k).astype(jnp.int32)

    def key_block_range(self, i: Array, keys: KeyVisibility, reach: _Reach) -> tuple[Array, Array]:
        """Key blocks `[lo, hi)` that query block i reads (forward): those holding a key that
        some row of the block may see under the causal triangle, the window and the lengths.
        Key block j holds keys `j * block_k` up to the next block's first."""
        start = self.query_start(i)
        end = start + self.block_q - 1  # the block's last row
        first, last = keys.key_bounds(start + reach.offset_min, end + reach.offset_max)
        first_key = jnp.zeros((), jnp.int32) if first is None else first
        last_key = reach.key_end - 1 if last is None else jnp.minimum(reach.key_end - 1, last)
        last_key = jnp.where(start < reach.query_end, last_key, -1)  # a block of padding reads none
        lo = jnp.clip(first_key // self.block_k, 0, self.num_key_blocks).astype(jnp.int32)
        return lo, jnp.clip(last_key // self.block_k + 1, lo, self.num_key_blocks).astype(jnp.int32)

    def query_block_range(self, j: Array, keys: KeyVisibility, reach: _Reach) -> tuple[Array, Array]:
        """Query blocks `[lo, hi)` that read key block j (backward, where query block i holds
        rows `i * block_q` up to the next block's first)."""
        first_key = j * self.block_k
        last_key = jnp.minimum(first_key + self.block_k, self.S) - 1
        first, last = keys.query_bounds(first_key, last_key)  # key positions of those queries
        first_row = jnp.zeros((), jnp.int32) if first is None else first - reach.offset_max
        last_row = reach.query_end - 1
        if last is not None:
            last_row = jnp.minimum(last_row, last - reach.offset_min)
        last_row = jnp.where(first_key < reach.key_end, last_row, -1)  # a block of padding: none
        lo = jnp.clip(first_row // self.block_q, 0, self.num_query_blocks).astype(jnp.int32)
        return lo, jnp.clip(last_row // self.block_q + 1, lo, self.num_query_blocks).astype(jnp.int32)


def _reach(tiling: _Tiling, keys: KeyVisibility) -> _Reach:
    def most(lengths, limit):
        return jnp.asarray(limit, jnp.int32) if lengths is None else jnp.max(lengths).astype(jnp.int32)

    return _Reach(
        jnp.min(keys.query_offset),
        jnp.max(keys.query_offset),
        most(keys.query_lengths, tiling.T),
        most(keys.key_lengths, tiling.S),
    )


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


def _carry_zero(dtype, *arrays: Any) -> Array:
    """A scalar 0 in `dtype` that varies along every mesh axis any of `arrays` (or their
    leaves) varies along inside `shard_map`: added to a loop's initial carries, it gives them
    the type the loop body computes. Outside `shard_map` it is a constant 0."""
    zero = jnp.zeros((), dtype)
    for leaf in jax.tree.leaves(arrays):
        zero = zero + jnp.zeros_like(leaf, shape=()).astype(dtype)
    return zero


def _tile_keys(keys: KeyVisibility, tiling: _Tiling, start: Array, key_start: Array) -> KeyVisibility:
    """The kernel's `keys` on the tile at (start, key_start), laid out for `masks_at` on rows
    `[1, 1, bq*G, 1]` and keys `[1, 1, 1, bk]`: offsets and lengths `[B|1, 1, 1, 1]`, segment
    ids `[B, 1, bq*G, 1]` and `[B, 1, 1, bk]`, the mask `[B|1, K|1, bq*G|1, bk|1]`."""

    def per_example(x):
        return None if x is None else x[:, None, None, None]  # (B|1, 1, 1, 1)

    segments = None
    if keys.segment_ids is not None:
        query_ids, key_ids = keys.segment_ids
        row_ids = lax.dynamic_slice_in_dim(query_ids, start, tiling.block_q, axis=1)  # (B, bq)
        row_ids = jnp.repeat(row_ids, tiling.G, axis=1)  # (B, bq*G)
        key_ids = lax.dynamic_slice_in_dim(key_ids, key_start, tiling.block_k, axis=1)  # (B, bk)
        segments = (row_ids[:, None, :, None], key_ids[:, None, None, :])
    return keys.replace(
        query_offset=per_example(keys.query_offset),
        segment_ids=segments,
        mask=None if keys.mask is None else _tile_of(keys.mask, tiling, start, key_start),
        query_lengths=per_example(keys.query_lengths),
        key_lengths=per_example(keys.key_lengths),
    )


def _allowed(tiling: _Tiling, keys: KeyVisibility, start: Array, key_start: Array, i, j, backward: bool):
    """Which entries of tile (i, j) may be attended, `[B|1, K|1, bq*G|1, bk|1]`, or None.

    The tile's queries start at `start`, its keys at `key_start`. Forbidden:
    what `keys` rules out (the mask, the causal triangle, the window, segment
    ids that differ, padding by lengths), and the keys a last key block repeats
    from its predecessor; in the backward pass also the repeated rows of a last
    query block (the forward pass recomputes them to the same values).
    """
    rows = _row_positions(tiling, start)[None, None, :, None]  # (1, 1, bq*G, 1)
    key_index = (key_start + jnp.arange(tiling.block_k))[None, None, None, :]  # (1, 1, 1, bk)
    masks = masks_at(_tile_keys(keys, tiling, start, key_start), rows, key_index)
    if tiling.S % tiling.block_k:
        masks.append(key_index >= j * tiling.block_k)  # (1, 1, 1, bk)
    if backward and tiling.T % tiling.block_q:
        masks.append(rows >= i * tiling.block_q)  # (1, 1, bq*G, 1)
    return and_masks(*masks)


def _shares_a_segment(segments: tuple[Array, Array], tiling: _Tiling, start: Array, key_start: Array):
    """Whether the query block at `start` and the key block at `key_start` may hold equal
    segment ids in some batch element: their ranges of ids overlap. Exact for ids that
    do not decrease along the sequence (packed sequences); never False where ids match."""
    query_ids = lax.dynamic_slice_in_dim(segments[0], start, tiling.block_q, axis=1)  # (B, bq)
    key_ids = lax.dynamic_slice_in_dim(segments[1], key_start, tiling.block_k, axis=1)  # (B, bk)
    overlap = (jnp.min(query_ids, axis=1) <= jnp.max(key_ids, axis=1)) & (
        jnp.min(key_ids, axis=1) <= jnp.max(query_ids, axis=1)
    )  # (B,)
    return jnp.any(overlap)


def _unless_segments_differ(keys: KeyVisibility, tiling: _Tiling, i: Array, j: Array, tile, state):
    """`tile(state)`, or `state` unchanged where tile (i, j) shares no segment id (lax.cond)."""
    if keys.segment_ids is None:
        return tile(state)
    shares = _shares_a_segment(keys.segment_ids, tiling, tiling.query_start(i), tiling.key_start(j))
    return lax.cond(shares, tile, lambda state: state, state)


def _tile_logits(
    tiling: _Tiling, query_rows, key_block, masking: KeyVisibility, bias, scale, i, j, backward=False
):
    """Biased, soft-capped, masked logits `[B, K, bq*G, bk]` of tile (i, j), times `scale`
    when given, and the soft cap's slope there (zero where masked; None without a cap).

    query_rows `[B, K, bq*G, H]`, key_block `[B, K, bk, H]`; -inf where not allowed.
    """
    if backward:
        logits = jnp.einsum("bkrh,bkch->bkrc", query_rows, key_block, precision=tiling.precision)
    else:  # against keys [B, K, H, bk]: the transpose joins the tile's copy (see `_forward`)
        key_columns = jnp.swapaxes(key_block, 2, 3)
        logits = jnp.einsum("bkrh,bkhc->bkrc", query_rows, key_columns, precision=tiling.precision)
    if scale is not None:
        logits = logits * scale
    start, key_start = tiling.query_start(i), tiling.key_start(j)
    if bias is not None:
        logits = logits + _tile_of(bias, tiling, start, key_start)
    slope = None
    if tiling.soft_cap is not None:
        capped = jnp.tanh(logits / tiling.soft_cap)
        logits, slope = tiling.soft_cap * capped, 1.0 - capped * capped
    allowed = _allowed(tiling, masking, start, key_start, i, j, backward)
    if allowed is None:
        return logits, slope
    return jnp.where(allowed, logits, -jnp.inf), None if slope is None else jnp.where(allowed, slope, 0.0)


def _poisoned(output_rows, tiling: _Tiling, value, finite_values, masking, bias, i, key_range, zero):
    """Query block i's output rows `[B, K, bq*G, Hv]`, NaN where a row attends a non-finite value.

    `value` is the caller's `[B, S, K, Hv]`, `finite_values` whether all of it
    is finite (then nothing runs), `key_range` the key blocks the block reads,
    `zero` the loops' `_carry_zero`. A (row, key) pair is attended where the
    masking and the bias allow it; a bad value there makes the row's channel
    NaN. Each key block costs a product of the allowed pairs with an indicator
    of bad values.
    """
    B, K, rows, Hv = output_rows.shape

    def key_step(j, reached):
        key_start = tiling.key_start(j)
        allowed = _allowed(tiling, masking, tiling.query_start(i), key_start, i, j, backward=False)
        allowed = jnp.ones((1, 1, 1, 1), jnp.bool_) if allowed is None else allowed
        if bias is not None:
            allowed = allowed & (_tile_of(bias, tiling, tiling.query_start(i), key_start) > -jnp.inf)
        allowed = jnp.broadcast_to(allowed, (B, K, rows, tiling.block_k)).astype(tiling.dtype)
        bad = ~jnp.isfinite(lax.dynamic_slice_in_dim(value, key_start, tiling.block_k, axis=1))
        bad = jnp.swapaxes(bad, 1, 2).astype(tiling.dtype)  # (B, K, bk, Hv)
        return reached + jnp.einsum("bkrc,bkch->bkrh", allowed, bad, precision=tiling.precision)

    def mark(output_rows):
        first, last = key_range
        reached = lax.fori_loop(first, last, key_step, jnp.zeros(output_rows.shape, tiling.dtype) + zero)
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


def _sink_rows(sinks: Array | None, tiling: _Tiling, rows: int) -> Array | None:
    """Sinks `[B|1, K, G]` as the logit of each of `rows` kernel rows, `[B|1, K, rows]`."""
    if sinks is None:
        return None
    return jnp.tile(sinks, (1, 1, rows // tiling.G))  # row t * G + g has sink g


def _initial_state(sink_rows: Array | None, shape: tuple[int, ...], Hv: int, dtype, zero):
    """A query block's running (maximum, normaliser, accumulator) before any key block:
    -inf, 0, 0; with sinks, the sink's logit and exp(0) = 1 (0 for a -inf sink)."""
    if sink_rows is None:
        row_max, normaliser = jnp.full(shape, -jnp.inf, dtype), jnp.zeros(shape, dtype)
    else:
        row_max = jnp.broadcast_to(sink_rows, shape).astype(dtype)
        normaliser = (row_max > -jnp.inf).astype(dtype)
    return row_max + zero, normaliser + zero, jnp.zeros((*shape, Hv), dtype) + zero


def _forward(tiling: _Tiling, query, key, value, masking, bias, sinks, scale):
    """Output `[B, T, N, Hv]` (NaN where a bad value is attended) and log-sum-exp `[B, K, T*G]`
    (-inf for a row that attends nothing, the sink included).

    For query block i (outer loop) and each key block j it reads (inner loop):
    logits, then the running maximum m, normaliser l and accumulator o become
    m' = max(m, rowmax), l' = l e^(m - m') + rowsum(P), o' = o e^(m - m') + P V_j
    with P = exp(logits - m'); the block's output is o / l.

    The logits contract the queries with the key block copied as `[B, K, H, bk]`
    (`_tile_logits`): XLA:CPU's (YNNPACK's) batched dot against `[B, K, bk, H]`
    took 2.5x the time of the same-sized value dot at a decode step's shape
    (B 32, 8 query rows, H 64, 128 keys), and the step of a 2-layer model 5%
    longer; at training shapes (T 128 to 2048) either layout is as fast.
    """
    B, T, N, _ = query.shape
    Hv = value.shape[-1]
    K, G, bq, dtype = tiling.K, tiling.G, tiling.block_q, tiling.dtype
    rows = G * bq
    zero = _carry_zero(dtype, query, key, value, masking, bias, sinks, scale)
    # A non-finite value where a row may attend poisons that row's channel. When the values are the
    # keys, that key has already made the row's logit, and with it the whole row, NaN: no check.
    finite_values = (
        None if tiling.values_are_keys else jnp.max(jnp.abs(value)) < jnp.inf
    )  # a NaN max is not finite; it fuses, unlike jnp.all(isfinite)
    reach = _reach(tiling, masking)
    sink_rows = _sink_rows(sinks, tiling, rows)  # (B|1, K, bq*G)

    def query_block(i, carry):
        output, log_sum_exp = carry
        start = tiling.query_start(i)
        query_i = lax.dynamic_slice_in_dim(query, start, bq, axis=1)  # (B, bq, N, H)
        query_rows = _to_rows(query_i, tiling, dtype) * scale  # (B, K, bq*G, H), scaled

        def key_step(j, state):
            def tile(state):
                row_max, normaliser, accumulator = state
                key_j, value_j = _key_block(key, value, tiling.key_start(j), tiling)  # (B, K, bk, H|Hv)
                logits, _ = _tile_logits(tiling, query_rows, key_j, masking, bias, None, i, j)
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

            return _unless_segments_differ(masking, tiling, i, j, tile, state)

        key_range = tiling.key_block_range(i, masking, reach)
        init = _initial_state(sink_rows, (B, K, rows), Hv, dtype, zero)
        row_max, normaliser, accumulator = lax.fori_loop(key_range[0], key_range[1], key_step, init)
        has_mass = normaliser > 0
        output_i = accumulator / jnp.where(has_mass, normaliser, 1.0)[..., None]  # (B, K, bq*G, Hv)
        if finite_values is not None:
            output_i = _poisoned(output_i, tiling, value, finite_values, masking, bias, i, key_range, zero)
        output_i = _from_rows(output_i, tiling)  # (B, bq, N, Hv)
        log_sum_exp_i = jnp.where(has_mass, row_max + jnp.log(normaliser), -jnp.inf)  # (B, K, bq*G)
        return (
            lax.dynamic_update_slice_in_dim(output, output_i, start, axis=1),
            lax.dynamic_update_slice_in_dim(log_sum_exp, log_sum_exp_i, start * G, axis=2),
        )

    init = (jnp.zeros((B, T, N, Hv), dtype) + zero, jnp.zeros((B, K, T * G), dtype) + zero)
    return lax.fori_loop(0, tiling.num_query_blocks, query_block, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(tiling: _Tiling, query, key, value, masking, bias, sinks, scale):
    """Output `[B, T, N, Hv]` and log-sum-exp `[B, K, T*G]` in `tiling.dtype`; the
    log-sum-exp passes no gradient (as jax.nn's residual)."""
    return _forward(tiling, query, key, value, masking, bias, sinks, scale)


def _attention_fwd(tiling: _Tiling, query, key, value, masking, bias, sinks, scale):
    output, log_sum_exp = _forward(tiling, query, key, value, masking, bias, sinks, scale)
    residuals = (query, key, value, masking, bias, sinks, scale, output, log_sum_exp)
    return (output, log_sum_exp), residuals


def _bias_grad_add(bias_grad: Array, logits_grad: Array, start: Array, key_start: Array, tiling: _Tiling):
    """Adds tile dS `[B, K, bq*G, bk]` into `[B|1, K|1, T|1, G|1, S|1]` at (start, key_start),
    summed over the axes along which the bias was broadcast."""
    B, K, _, keys = logits_grad.shape
    logits_grad = logits_grad.reshape(B, K, tiling.block_q, tiling.G, keys)  # (B, K, bq, G, bk)
    broadcast = tuple(a for a in range(5) if bias_grad.shape[a] == 1 and logits_grad.shape[a] > 1)
    tile = jnp.sum(logits_grad, axis=broadcast, keepdims=True)  # (B|1, K|1, bq|1, G|1, bk|1)
    zero = np.int32(0)  # every index int32, as `start` and `key_start`
    corner = (
        zero,
        zero,
        start if bias_grad.shape[2] > 1 else zero,
        zero,
        key_start if bias_grad.shape[4] > 1 else zero,
    )
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


def _sinks_grad(sinks: Array, log_sum_exp: Array, row_dot: Array, tiling: _Tiling) -> Array:
    """d loss / d sinks `[B|1, K, G]`. A sink of weight p = exp(sink - lse) in a row gives
    d out / d sink = -p out (it takes mass from every key alike), so the gradient is
    -sum over the rows of p * D, D = rowsum(dO * O) (`row_dot` `[B, K, T*G, 1]`)."""
    B, K, rows = log_sum_exp.shape
    log_sum_exp = log_sum_exp.reshape(B, K, rows // tiling.G, tiling.G)  # (B, K, T, G)
    sink = sinks[:, :, None, :]  # (B|1, K, 1, G)
    weight = jnp.where(log_sum_exp > -jnp.inf, jnp.exp(sink - log_sum_exp), 0.0)  # (B, K, T, G)
    grad = -jnp.sum(weight * row_dot.reshape(B, K, rows // tiling.G, tiling.G), axis=2)  # (B, K, G)
    return jnp.sum(grad, axis=0, keepdims=True) if sinks.shape[0] == 1 else grad


class _Backward(NamedTuple):
    """What every tile of the backward pass reads: the query, the output's cotangent and D as
    rows, the finite log-sum-exp, the masking, bias and scale, and how far each block reaches."""

    query: Array
    output_grad_rows: Array
    finite_lse: Array
    row_dot: Array
    masking: Any
    bias: Array | None
    scale: Array
    reach: Any
    zero: Array


def _backward_tile(tiling: _Tiling, inputs: _Backward, i, j, key_j, grads):
    """One tile (query block i, key block j) of `_attention_bwd`: adds its share to dQ, the
    bias's gradient, dK_j and dV_j (transposed) and the scale's gradient."""
    query_grad, bias_grad, key_grad_j, value_grad_j, scale_grad = grads
    key_start, key_nan_j, key_zero_j, value_j = key_j
    dtype, bq = tiling.dtype, tiling.block_q
    dot = functools.partial(jnp.einsum, precision=tiling.precision)
    start = tiling.query_start(i)
    query_i = _to_rows(lax.dynamic_slice_in_dim(inputs.query, start, bq, axis=1), tiling, dtype)
    output_grad_i = _rows_of(inputs.output_grad_rows, tiling, start)  # (B, K, bq*G, Hv)
    logits, slope = _tile_logits(
        tiling, query_i, key_nan_j, inputs.masking, inputs.bias, inputs.scale, i, j, backward=True
    )
    weights = jnp.exp(logits - _rows_of(inputs.finite_lse, tiling, start)[..., None])  # (B, K, bq*G, bk)
    value_grad_j += dot("bkrh,bkrc->bkhc", output_grad_i, weights)  # (B, K, Hv, bk)
    weights_grad = dot("bkrh,bkch->bkrc", output_grad_i, value_j)  # (B, K, bq*G, bk)
    logits_grad = weights * (weights_grad - _rows_of(inputs.row_dot, tiling, start))  # (B, K, bq*G, bk)
    if slope is not None:
        logits_grad = logits_grad * slope  # dS through the soft cap
    query_grad_i = dot("bkrc,bkch->bkrh", logits_grad, key_zero_j)  # (B, K, bq*G, H), dS K
    scale_grad += jnp.sum(query_grad_i * query_i)  # sum(dS * Q K^T); dropped when unused
    query_grad = _add_at(query_grad, _from_rows(query_grad_i * inputs.scale, tiling), start, axis=1)
    key_grad_j += dot("bkrh,bkrc->bkhc", query_i, logits_grad)  # (B, K, H, bk)
    if inputs.bias is not None:
        bias_grad = _bias_grad_add(bias_grad, logits_grad, start, key_start, tiling)
    return query_grad, bias_grad, key_grad_j, value_grad_j, scale_grad


def _backward_key_block(tiling: _Tiling, inputs: _Backward, key, value, j, carry):
    """Key block j of `_attention_bwd`: the query blocks that read it, then its dK and dV."""
    query_grad, key_grad, value_grad, bias_grad, scale_grad = carry
    B, _, _, H = inputs.query.shape
    K, bk, Hv, dtype = tiling.K, tiling.block_k, value.shape[-1], tiling.dtype
    key_start = tiling.key_start(j)
    key_nan_j, value_j = _key_block(key, value, key_start, tiling)  # (B, K, bk, H|Hv)
    key_zero_j, _ = _key_block(key, value, key_start, tiling, zero_keys=True)
    key_j = (key_start, key_nan_j, key_zero_j, value_j)

    def query_step(i, grads):
        tile = functools.partial(_backward_tile, tiling, inputs, i, j, key_j)
        return _unless_segments_differ(inputs.masking, tiling, i, j, tile, grads)

    init = (
        query_grad,
        bias_grad,
        jnp.zeros((B, K, H, bk), dtype) + inputs.zero,
        jnp.zeros((B, K, Hv, bk), dtype) + inputs.zero,
        scale_grad,
    )
    first, last = tiling.query_block_range(j, inputs.masking, inputs.reach)
    query_grad, bias_grad, key_grad_j, value_grad_j, scale_grad = lax.fori_loop(first, last, query_step, init)
    key_grad = _add_at(key_grad, jnp.transpose(key_grad_j * inputs.scale, (0, 3, 1, 2)), key_start, axis=1)
    value_grad = _add_at(value_grad, jnp.transpose(value_grad_j, (0, 3, 1, 2)), key_start, axis=1)
    return query_grad, key_grad, value_grad, bias_grad, scale_grad


def _attention_bwd(tiling: _Tiling, residuals, cotangents):
    """Recomputes each tile's weights from the saved log-sum-exp (FlashAttention-2).

    For key block j (outer loop) and each query block i that reads it (inner
    loop): P = exp(logits - lse), dV_j += P^T dO_i, dS = P * (dO_i V_j^T - D_i)
    with D = rowsum(dO * O) (times the soft cap's slope), dQ_i += dS K_j scale,
    dK_j += dS^T Q_i scale, dBias_ij = dS; a sink's gradient comes from lse and
    D alone. dK_j and dV_j accumulate transposed, `[B, K, H, bk]`: XLA runs
    Q^T dS as a faster CPU dot than dS^T Q. An output entry that is NaN passes
    no gradient, and the log-sum-exp's cotangent is ignored.
    """
    query, key, value, masking, bias, sinks, scale, output, log_sum_exp = residuals
    output_grad, _ = cotangents
    tiling = tiling.for_backward()
    dtype = tiling.dtype
    output_grad = output_grad.astype(dtype)
    row_dot = _to_rows(_row_dot(output_grad, output), tiling, dtype)  # D: (B, K, T*G, 1)
    output_grad = jnp.where(jnp.isnan(output), 0.0, output_grad)  # (B, T, N, Hv), fused into the copy
    zero = _carry_zero(dtype, residuals, output_grad)
    inputs = _Backward(
        query=query,
        output_grad_rows=_to_rows(output_grad, tiling, dtype),  # (B, K, T*G, Hv)
        finite_lse=jnp.where(log_sum_exp > -jnp.inf, log_sum_exp, 0.0),  # rows with no mass: weights 0
        row_dot=row_dot,
        masking=masking,
        bias=bias,
        scale=scale,
        reach=_reach(tiling, masking),
        zero=zero,
    )
    init = (
        jnp.zeros(query.shape, dtype) + zero,
        jnp.zeros(key.shape, dtype) + zero,
        jnp.zeros(value.shape, dtype) + zero,
        None if bias is None else jnp.zeros(bias.shape, dtype) + zero,
        zero,
    )
    key_block = functools.partial(_backward_key_block, tiling, inputs, key, value)
    query_grad, key_grad, value_grad, bias_grad, scale_grad = lax.fori_loop(
        0, tiling.num_key_blocks, key_block, init
    )
    return (
        query_grad.astype(query.dtype),
        key_grad.astype(key.dtype),
        value_grad.astype(value.dtype),
        None,  # the masking: no gradient
        None if bias is None else bias_grad.astype(bias.dtype),
        None if sinks is None else _sinks_grad(sinks, log_sum_exp, row_dot, tiling).astype(sinks.dtype),
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


def per_example(x: Any, batch: tuple[int, ...], trailing: tuple[int, ...] = ()) -> Array:
    """An array broadcastable to `[batch..., *trailing]` as `[B|1, *trailing]`: the batch dims
    flattened into one, of size 1 when `x` is the same for every example."""
    x = jnp.asarray(x)
    x = x.reshape((1,) * (len(batch) + len(trailing) - x.ndim) + x.shape)  # (batch...|1, trailing...)
    if all(n == 1 for n in x.shape[: len(batch)]):
        return jnp.broadcast_to(x.reshape(1, *x.shape[len(batch) :]), (1, *trailing))
    return jnp.broadcast_to(x, (*batch, *trailing)).reshape(-1, *trailing)


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


def _check_arguments(block_q: Any, block_k: Any, logits_soft_cap: Any, segments: tuple) -> None:
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
            raise ValueError(f"chunked_attention: {name} must be a positive int or None, got {size!r}")
    check_soft_cap("chunked_attention", logits_soft_cap)
    if (segments[0] is None) != (segments[1] is None):
        raise ValueError(
            "chunked_attention: query_segment_ids and key_segment_ids must be given together, got "
            + " and ".join("None" if s is None else "an array" for s in segments)
        )


def _masking(
    keys: KeyVisibility, mask, lengths, query_offset, segments, batch: tuple[int, ...], T: int, S: int, K: int
) -> KeyVisibility:
    """`keys` (the causal flag and window) with a call's arrays in the kernel's layout: mask
    tiles, `(B,)` lengths, `(B|1,)` int32 offsets, `(B, T|S)` segment ids."""
    B = math.prod(batch)
    query_lengths, key_lengths = (
        None if n is None else jnp.broadcast_to(per_example(n, batch), (B,)) for n in lengths
    )
    query_ids, key_ids = (
        None if ids is None else jnp.broadcast_to(per_example(ids, batch, (n,)), (B, n))
        for ids, n in zip(segments, (T, S), strict=True)
    )
    return keys.replace(
        query_offset=per_example(0 if query_offset is None else query_offset, batch).astype(jnp.int32),
        segment_ids=None if query_ids is None else (query_ids, key_ids),
        mask=_to_tiles(mask, batch, K),
        query_lengths=query_lengths,
        key_lengths=key_lengths,
    )


def _tiling(query, key, value, block_q, block_k, keys: KeyVisibility, logits_soft_cap, precision) -> _Tiling:
    *batch, T, N, H = query.shape
    S, K = key.shape[-3], key.shape[-2]
    sizes = functools.partial(
        block_sizes,
        math.prod(batch) * N,
        T,
        S,
        key_span=keys.key_span(),  # the most keys one query may see
        key_width=math.prod(batch) * K * (H + value.shape[-1]),
    )
    default_q, default_k = sizes()
    backward = None if block_q or block_k else sizes(backward=True)
    return _Tiling(
        T=T,
        S=S,
        K=K,
        G=N // K,
        block_q=min(block_q or default_q, T),
        block_k=min(block_k or default_k, S),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        dtype=jnp.promote_types(jnp.result_type(query, key, value), jnp.float32),
        precision=precision,
        values_are_keys=value is key,
        backward_blocks=backward,
    )


def chunked_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    *,
    is_causal: bool = False,
    scale: float | Array | None = None,
    query_seq_lengths: Array | None = None,
    key_value_seq_lengths: Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    query_offset: int | Array = 0,
    query_segment_ids: Array | None = None,
    key_segment_ids: Array | None = None,
    logits_soft_cap: float | None = None,
    sinks: Array | None = None,
    return_residual: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    precision: Any = None,
) -> Array | tuple[Array, Array]:
    """Attention in `[block_q, block_k]` tiles with O(T x block) memory.

    Args:
      query: `[batch..., T, N, H]`.
      key: `[batch..., S, K, H]`; K divides N (query head n reads kv head
        `n // (N // K)`).
      value: `[batch..., S, K, Hv]`.
      bias: optional additive bias broadcastable to `[batch..., N, T, S]`;
        -inf entries forbid like a False mask. Differentiable, as are `scale`
        and `sinks`.
      mask: optional boolean (True = may attend) broadcastable to
        `[batch..., N, T, S]`.
      is_causal: query t may attend key s only when s <= t + query_offset
        (jax.nn's top-left triangle for offset 0); key blocks beyond it are
        skipped.
      scale: logits multiplier, default `1/sqrt(H)`.
      query_seq_lengths: optional integer lengths `[batch...]`: query rows
        t >= length are padding (zero output, no gradient).
      key_value_seq_lengths: optional integer lengths `[batch...]`: keys
        s >= length are never attended. Both act tile by tile, with no
        `[T, S]` mask in memory, and tiles wholly beyond them are skipped.
      local_window_size: None, w or (left, right): query t may attend key s
        only when `t + query_offset - left <= s <= t + query_offset + right`;
        tiles outside every window are skipped.
      query_offset: the key position of query 0, an int or integers
        broadcastable to `[batch...]`.
      query_segment_ids, key_segment_ids: optional integers `[batch..., T]` and
        `[batch..., S]`, given together: query t may attend key s only when
        its id equals key s's. A tile whose blocks' id ranges do not overlap
        is skipped.
      logits_soft_cap: optional positive c: logits (scaled, biased) become
        `c * tanh(logits / c)` before masking.
      sinks: optional logits broadcastable to `[batch..., N]`, one per head,
        added to each row's softmax normaliser; a sink takes weight and has
        no value.
      return_residual: also return the log-sum-exp of each row's logits,
        sink included, `[batch..., T, N]` (-inf where a row has no key and no
        sink); it passes no gradient.
      block_q, block_k: tile sizes of both passes, clipped to T and S; None:
        `block_sizes`'s, about `TILE_ELEMENTS` logits per tile over the batch
        and heads, capped at half a window's width.
      precision: of every dot, forward and backward (flax's spelling: None,
        a string, a `jax.lax.Precision` or a pair); None is JAX's default.

    Returns:
      `[batch..., T, N, Hv]` in the inputs' result dtype (and the residual).
      Inputs are cast to float32 (float64 for float64 inputs) for every dot,
      the softmax and the accumulators; a row with no allowed key gives zeros,
      with finite gradients. NaN/inf in keys and values as in
      `dot_product_attention`'s reference path (module docstring).
    """
    *batch, T, N, H = query.shape
    S, K, Hv = key.shape[-3], key.shape[-2], value.shape[-1]
    segments = (query_segment_ids, key_segment_ids)
    _check_arguments(block_q, block_k, logits_soft_cap, segments)
    keys = KeyVisibility(bool(is_causal), window=window_pair(local_window_size, "chunked_attention"))
    tiling = _tiling(query, key, value, block_q, block_k, keys, logits_soft_cap, precision)
    dtype = tiling.dtype
    lengths = (query_seq_lengths, key_value_seq_lengths)
    masking = _masking(keys, mask, lengths, query_offset, segments, tuple(batch), T, S, K)
    if bias is not None:
        bias = _to_tiles(jnp.asarray(bias).astype(dtype), tuple(batch), K)
    if sinks is not None:
        sinks = per_example(jnp.asarray(sinks).astype(dtype), tuple(batch), (N,)).reshape(-1, K, N // K)
    scale = jnp.asarray(1.0 / math.sqrt(H) if scale is None else scale, dtype)
    # Inside shard_map every differentiable input takes the mesh axes any input varies along
    # (the custom VJP's cotangents must have its arguments' types); elsewhere XLA drops the + 0.
    zero = _carry_zero(dtype, query, key, value, masking, bias, sinks, scale)
    query, key, value = (x + zero.astype(x.dtype) for x in (query, key, value))
    bias, sinks = (None if x is None else x + zero for x in (bias, sinks))
    flat = (query.reshape(-1, T, N, H), key.reshape(-1, S, K, H), value.reshape(-1, S, K, Hv))
    output, log_sum_exp = _attention(tiling, *flat, masking, bias, sinks, scale + zero)
    out_dtype = jnp.result_type(query, key, value)
    output = output.reshape(*batch, T, N, Hv).astype(out_dtype)  # (batch..., T, N, Hv)
    if not return_residual:
        return output
    residual = jnp.swapaxes(log_sum_exp.reshape(-1, K, T, N // K), 1, 2)  # (B, T, K, G)
    return output, residual.reshape(*batch, T, N).astype(out_dtype)
