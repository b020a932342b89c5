"""Fused attention as Pallas kernels: forward and backward, memory linear in T.

`pallas_attention` computes `softmax(Q K^T * scale, masked) V` as three
`pl.pallas_call`s written in Pallas' generic API (a grid, `BlockSpec`s, a
`lax.fori_loop` over blocks): on a GPU they lower through Triton, elsewhere
they run in Pallas' interpret mode (how the tests run them on a CPU).

- The forward kernel, one program per (query block, example, query head),
  loops over the key blocks the block can reach, keeping a running row
  maximum, normaliser and output accumulator (an online softmax), and writes
  the output and each row's log-sum-exp (lse).
- The backward pass recomputes each tile's weights `P = exp(logits - lse)`
  (in base 2 inside the kernels: `exp2`) from the saved lse and `D = rowsum(dO * O) - dlse` (the lse's own
  cotangent enters here: d lse / d logits = P). One kernel per (key block,
  example, query head) loops over query blocks for dK and dV; one per
  (query block, example, query head) loops over key blocks for dQ. With
  grouped kv heads the dK and dV of a group's query heads are summed after
  the kernel.

Which keys a query sees is decided inside the kernels from the rules of
`qkv_jax.attention.visibility`: the causal triangle and a window (left, right)
both relative to query t's key position `t + query_offset`, segment ids and
sequence lengths. The loops run only over the blocks the causal triangle, the
window and the lengths leave within reach (where a window's speed comes
from), and, with segment ids, between the first and the last block whose
range of ids overlaps the block's own (exact for packed sequences, whose ids
do not decrease); inside a block the rules mask, except in blocks whose
every pair they allow, which each loop runs apart without a mask. A soft cap
`c * tanh(logits / c)` is applied before masking and its slope recomputed
backward; sinks act after the kernel, `output * sigmoid(lse - sink)`, so they
are differentiable through plain JAX.

Layout as `dot_product_attention`'s, with the batch dims flattened to B: query
`[B, T, N, H]`, key `[B, S, K, H]`, value `[B, S, K, Hv]`; a block reads one
head's `[block, H]` straight from that layout. T and S are padded to whole
blocks and H, Hv to a power of two of at least 16 (Triton's sizes); padded
keys are masked and padded rows dropped. Dots take float32 accumulators; on a
GPU float32 operands run in IEEE float32 by default (`lax.Precision.HIGHEST`,
which the Triton lowering maps to `InputPrecision.IEEE`, not TF32; see
`precision` for TF32), bf16/fp16 ones as they are, with the weights cast to
the value's dtype for `P V`. Not as the reference path: a non-finite key or
value inside a computed block can reach rows of that block that do not
attend it.
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
from jax.experimental import pallas as pl

from qkv_jax.attention.chunked import per_example
from qkv_jax.attention.options import check_soft_cap, is_number
from qkv_jax.attention.visibility import window_pair

Array = jax.Array

__all__ = ["pallas_attention", "BlockSizes", "default_block_sizes"]

# How the dots of float32 operands run on a GPU, by `precision` (16-bit operands run as they
# are): IEEE float32 (the default), three TF32 passes, or one. Interpret mode runs float32.
_LOG2_E = math.log2(math.e)  # the kernels' logits and lse are in base 2 (exp2 is one instruction)
_LN_2 = math.log(2.0)
_FLOAT32_DOTS: dict[str, Any] = {
    "highest": lax.Precision.HIGHEST,  # Triton's InputPrecision.IEEE
    "high": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,  # InputPrecision.TF32x3
    "default": lax.DotAlgorithmPreset.TF32_TF32_F32,  # InputPrecision.TF32
}


class BlockSizes(NamedTuple):
    """Rows and keys per tile: forward `(block_q, block_k)`, backward `(backward_q, backward_k)`.
    Powers of two, at least 16 on a GPU (Triton's dot)."""

    block_q: int
    block_k: int
    backward_q: int
    backward_k: int


def _power_of_two_above(n: int, least: int) -> int:
    return max(least, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def default_block_sizes(T: int, S: int, head_dim: int, dtype: Any, *, interpret: bool) -> BlockSizes:
    """The tiles for T queries and S keys of (padded) width `head_dim` in `dtype`.

    In interpret mode (a CPU) a quarter of the length, from 8 to 64, so that
    tiny shapes still have several blocks. On a GPU conservative Triton tiles:
    forward 128 x 64 up to 128 wide in 16-bit (64 x 32 in float32 or wider),
    backward 32 x 64 (32 x 32); never above the padded length, never below 16.
    """
    if interpret:
        q, k = (min(64, max(8, _power_of_two_above(n, 1) // 4)) for n in (T, S))
        return BlockSizes(q, k, q, k)
    wide = head_dim > 128 or jnp.dtype(dtype).itemsize > 2
    forward = (64, 32) if wide else (128, 64)
    backward = (32, 32) if wide else (32, 64)
    q_cap, k_cap = _power_of_two_above(T, 16), _power_of_two_above(S, 16)
    return BlockSizes(
        min(forward[0], q_cap), min(forward[1], k_cap), min(backward[0], q_cap), min(backward[1], k_cap)
    )


@dataclasses.dataclass(frozen=True)
class _Config:
    """The static facts of one call (hashable: the custom VJP's non-differentiable argument)."""

    T: int  # real lengths (the arrays are padded past them)
    S: int
    G: int  # query heads per kv head
    blocks: BlockSizes
    scale: float
    is_causal: bool
    window: tuple[int, int] | None
    soft_cap: float | None
    segments: bool
    query_lengths: bool  # rows at or past a query length see nothing
    limit_keys: bool  # keys at or past the key length (S, or the lengths) are masked
    interpret: bool
    precision: str  # of float32 dots on a GPU: a key of `_FLOAT32_DOTS`
    num_warps: int
    num_stages: int


class _Limits(NamedTuple):
    """One example's scalars, read from its row of the table: offset, query and key lengths."""

    offset: Array
    query_length: Array
    key_length: Array


def _limits(table_ref) -> _Limits:
    return _Limits(table_ref[0], table_ref[1], table_ref[2])


def _iota(n: int) -> Array:
    return lax.iota(jnp.int32, n)


def _ceil_div(x: Array, n: int) -> Array:
    """ceil(x / n) for x >= 0 (lax.div truncates, as Triton's integer division does)."""
    return lax.div(x + (n - 1), jnp.int32(n))


def _key_blocks(
    config: _Config, i: Array, limits: _Limits, block_q: int, block_k: int
) -> tuple[Array, Array]:
    """Key blocks `[lo, hi)` that query block i (rows `i * block_q` on) may reach."""
    first_row = i * block_q
    last_row = first_row + (block_q - 1)
    first_key, last_key = jnp.int32(0), limits.key_length - 1
    if config.is_causal:
        last_key = jnp.minimum(last_key, last_row + limits.offset)
    if config.window is not None:
        left, right = config.window
        first_key = jnp.maximum(first_key, first_row + limits.offset - left)
        last_key = jnp.minimum(last_key, last_row + limits.offset + right)
    if config.query_lengths:
        last_key = jnp.where(first_row < limits.query_length, last_key, -1)
    lo = lax.div(first_key, jnp.int32(block_k))
    hi = _ceil_div(jnp.maximum(last_key + 1, 0), block_k)
    return lo, jnp.maximum(lo, hi)


def _query_blocks(
    config: _Config, j: Array, limits: _Limits, block_q: int, block_k: int
) -> tuple[Array, Array]:
    """Query blocks `[lo, hi)` that may reach key block j (keys `j * block_k` on)."""
    first_key = j * block_k
    last_key = first_key + (block_k - 1)
    first_row, last_row = jnp.int32(0), limits.query_length - 1
    if config.is_causal:
        first_row = jnp.maximum(first_row, first_key - limits.offset)
    if config.window is not None:
        left, right = config.window
        first_row = jnp.maximum(first_row, first_key - limits.offset - right)
        last_row = jnp.minimum(last_row, last_key - limits.offset + left)
    last_row = jnp.where(first_key < limits.key_length, last_row, -1)
    lo = lax.div(first_row, jnp.int32(block_q))
    hi = _ceil_div(jnp.maximum(last_row + 1, 0), block_q)
    return lo, jnp.maximum(lo, hi)


def _whole_key_blocks(
    config: _Config, i: Array, limits: _Limits, block_q: int, block_k: int
) -> tuple[Array, Array]:
    """Key blocks `[lo, hi)` whose every key every row of query block i may see by the band
    and the lengths (segment ids: `_within_segments`)."""
    first_row = i * block_q
    last_row = first_row + (block_q - 1)
    lo, hi = jnp.int32(0), lax.div(jnp.maximum(limits.key_length, 0), jnp.int32(block_k))
    if config.is_causal:  # the block's last key at most the first row's position
        hi = jnp.minimum(hi, lax.div(jnp.maximum(first_row + limits.offset + 1, 0), jnp.int32(block_k)))
    if config.window is not None:
        left, right = config.window
        hi = jnp.minimum(
            hi, lax.div(jnp.maximum(first_row + limits.offset + right + 1, 0), jnp.int32(block_k))
        )
        lo = _ceil_div(jnp.maximum(last_row + limits.offset - left, 0), block_k)
    if config.query_lengths:
        hi = jnp.where(last_row < limits.query_length, hi, 0)
    return lo, hi


def _whole_query_blocks(
    config: _Config, j: Array, limits: _Limits, block_q: int, block_k: int
) -> tuple[Array, Array]:
    """Query blocks `[lo, hi)` whose every row may see every key of key block j by the band and
    the lengths (segment ids: `_within_segments`)."""
    first_key = j * block_k
    last_key = first_key + (block_k - 1)
    lo, hi = jnp.int32(0), lax.div(jnp.maximum(limits.query_length, 0), jnp.int32(block_q))
    hi = jnp.where(last_key < limits.key_length, hi, 0)
    if config.is_causal:  # the block's first row at or past the last key's position
        lo = _ceil_div(jnp.maximum(last_key - limits.offset, 0), block_q)
    if config.window is not None:
        left, right = config.window
        lo = jnp.maximum(lo, _ceil_div(jnp.maximum(last_key - limits.offset - right, 0), block_q))
        hi = jnp.minimum(
            hi, lax.div(jnp.maximum(first_key - limits.offset + left + 1, 0), jnp.int32(block_q))
        )
    return lo, hi


def _split_loop(lo: Array, hi: Array, whole: tuple[Array, Array], step, init):
    """`lax.fori_loop(lo, hi, step(masked), init)` as three loops: `step(False)` (no mask) over
    the blocks of `whole` within `[lo, hi)`, `step(True)` over those before and after."""
    first = jnp.clip(whole[0], lo, hi)
    end = jnp.clip(whole[1], first, hi)
    carry = lax.fori_loop(lo, first, step(True), init)
    carry = lax.fori_loop(first, end, step(False), carry)
    return lax.fori_loop(end, hi, step(True), carry)


def _within_segments(lo: Array, hi: Array, reach_ref, whole: bool = False) -> tuple[Array, Array]:
    """`[lo, hi)` narrowed to the blocks that share a segment id with this one, or with
    `whole`, to those whose ids all equal this block's one id (`reach_ref` `[4]`, from
    `_segment_reach`; None without segment ids)."""
    if reach_ref is None:
        return lo, hi
    at = 2 if whole else 0
    lo = jnp.maximum(lo, reach_ref[at])
    return lo, jnp.maximum(lo, jnp.minimum(hi, reach_ref[at + 1]))


def _allowed(config: _Config, rows, keys, limits: _Limits, row_ids, key_ids) -> Array | None:
    """Which (row, key) pairs of a tile may attend, broadcastable to `[bq, bk]` (None: all).
    `rows` `(bq,)` and `keys` `(bk,)` are positions, `row_ids`/`key_ids` their segment ids."""
    rows, keys = rows[:, None], keys[None, :]  # (bq, 1), (1, bk)
    masks = []
    at = rows + limits.offset  # each row's key position
    if config.is_causal:
        masks.append(keys <= at)
    if config.window is not None:
        left, right = config.window
        masks += [keys >= at - left, keys <= at + right]
    if config.limit_keys:
        masks.append(keys < limits.key_length)
    if config.query_lengths:
        masks.append(rows < limits.query_length)
    if config.segments:
        masks.append(row_ids[:, None] == key_ids[None, :])
    if not masks:
        return None
    return functools.reduce(jnp.logical_and, masks)


def _dot(config: _Config, a: Array, b: Array, contract: tuple[int, int]) -> Array:
    """2-D `a . b` contracting axis `contract[0]` of a with `contract[1]` of b, in float32, at
    the call's precision where both operands are float32 (on a GPU)."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    precision = lax.Precision.HIGHEST
    if not config.interpret and a.dtype == b.dtype == jnp.float32:
        precision = _FLOAT32_DOTS[config.precision]
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _tile_logits(config: _Config, query, key, allowed):
    """Scaled, soft-capped, masked logits `[bq, bk]` of query `[bq, H]` and key `[bk, H]` in
    base 2 (times log2 e, for `exp2`; -inf where not allowed), and the soft cap's slope (0
    where masked; None without a cap)."""
    logits = _dot(config, query, key, (1, 1))  # (bq, bk)
    slope = None
    if config.soft_cap is None:
        logits = logits * (config.scale * _LOG2_E)
    else:
        capped = jnp.tanh(logits * (config.scale / config.soft_cap))
        logits, slope = capped * (config.soft_cap * _LOG2_E), 1.0 - capped * capped
    if allowed is None:
        return logits, slope
    logits = jnp.where(allowed, logits, -jnp.inf)
    return logits, None if slope is None else jnp.where(allowed, slope, 0.0)


def _forward_kernel(
    table_ref, q_ref, k_ref, v_ref, row_ids_ref, key_ids_ref, reach_ref, out_ref, lse_ref, *, config
):
    """One query block of one head: the online softmax over the key blocks it reaches.

    q_ref `[bq, H]`, k_ref `[S, H]`, v_ref `[S, Hv]`, out_ref `[bq, Hv]`, lse_ref `[bq]`;
    the segment-id refs `[bq]` and `[S]`, and the key blocks sharing an id `[2]` (None
    without segments)."""
    block_q, block_k = config.blocks.block_q, config.blocks.block_k
    i = pl.program_id(0)
    limits = _limits(table_ref)
    query = q_ref[...]  # (bq, H)
    rows = i * block_q + _iota(block_q)
    row_ids = None if row_ids_ref is None else row_ids_ref[...]

    def key_step(masked, j, carry):
        row_max, normaliser, accumulator = carry
        start = pl.multiple_of(j * block_k, block_k)
        allowed = None
        if masked:
            key_ids = None if key_ids_ref is None else key_ids_ref[pl.ds(start, block_k)]
            allowed = _allowed(config, rows, start + _iota(block_k), limits, row_ids, key_ids)
        logits, _ = _tile_logits(config, query, k_ref[pl.ds(start, block_k), :], allowed)  # (bq, bk)
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))  # (bq,)
        shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)  # finite for rows with nothing yet
        weights = jnp.exp2(logits - shift[:, None])  # (bq, bk)
        rescale = jnp.exp2(row_max - shift)  # (bq,)
        value = v_ref[pl.ds(start, block_k), :]  # (bk, Hv)
        blended = _dot(config, weights.astype(value.dtype), value, (1, 0))  # (bq, Hv)
        return (
            new_max,
            normaliser * rescale + jnp.sum(weights, axis=1),
            accumulator * rescale[:, None] + blended,
        )

    lo, hi = _within_segments(*_key_blocks(config, i, limits, block_q, block_k), reach_ref)
    init = (
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
        jnp.zeros((block_q, out_ref.shape[-1]), jnp.float32),
    )
    whole = _within_segments(*_whole_key_blocks(config, i, limits, block_q, block_k), reach_ref, whole=True)
    row_max, normaliser, accumulator = _split_loop(
        lo, hi, whole, lambda masked: functools.partial(key_step, masked), init
    )
    has_mass = normaliser > 0
    out_ref[...] = (accumulator / jnp.where(has_mass, normaliser, 1.0)[:, None]).astype(out_ref.dtype)
    log_normaliser = jnp.log(jnp.where(has_mass, normaliser, 1.0)) * _LOG2_E
    lse_ref[...] = jnp.where(has_mass, row_max + log_normaliser, -jnp.inf)  # in base 2


def _logits_grad(config: _Config, query, key, value, out_grad, lse, delta, allowed):
    """A tile's weights `P` `[bq, bk]` and the gradient of its scaled logits (through the soft
    cap): `dS = P * (dO V^T - D)`, with `lse` in base 2 and finite (0 for rows that attend
    nothing)."""
    logits, slope = _tile_logits(config, query, key, allowed)
    weights = jnp.exp2(logits - lse[:, None])  # (bq, bk)
    weights_grad = _dot(config, out_grad, value, (1, 1))  # (bq, bk)
    logits_grad = weights * (weights_grad - delta[:, None])
    if slope is not None:
        logits_grad = logits_grad * slope
    return weights, logits_grad


def _key_grads_kernel(
    table_ref,
    q_ref,
    k_ref,
    v_ref,
    row_ids_ref,
    key_ids_ref,
    reach_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    config,
):
    """dK and dV of one key block for one query head, over the query blocks that reach it.

    q_ref `[T, H]`, do_ref `[T, Hv]`, lse_ref and delta_ref `[T]` (whole); k_ref `[bk, H]`,
    v_ref `[bk, Hv]`, dk_ref and dv_ref alike; segment ids `[T]` and `[bk]`, the query blocks
    sharing one `[2]`."""
    block_q, block_k = config.blocks.backward_q, config.blocks.backward_k
    j = pl.program_id(0)
    limits = _limits(table_ref)
    key, value = k_ref[...], v_ref[...]  # (bk, H), (bk, Hv)
    keys = j * block_k + _iota(block_k)
    key_ids = None if key_ids_ref is None else key_ids_ref[...]

    def query_step(masked, i, carry):
        key_grad, value_grad = carry
        start = pl.multiple_of(i * block_q, block_q)
        rows = pl.ds(start, block_q)
        allowed = None
        if masked:
            row_ids = None if row_ids_ref is None else row_ids_ref[rows]
            allowed = _allowed(config, start + _iota(block_q), keys, limits, row_ids, key_ids)
        query, out_grad = q_ref[rows, :], do_ref[rows, :]  # (bq, H), (bq, Hv)
        weights, logits_grad = _logits_grad(
            config, query, key, value, out_grad, lse_ref[rows], delta_ref[rows], allowed
        )
        value_grad += _dot(config, weights.astype(out_grad.dtype), out_grad, (0, 0))  # (bk, Hv)
        key_grad += _dot(config, logits_grad.astype(query.dtype), query, (0, 0))  # (bk, H)
        return key_grad, value_grad

    lo, hi = _within_segments(*_query_blocks(config, j, limits, block_q, block_k), reach_ref)
    init = (jnp.zeros(dk_ref.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
    whole = _within_segments(*_whole_query_blocks(config, j, limits, block_q, block_k), reach_ref, whole=True)
    key_grad, value_grad = _split_loop(
        lo, hi, whole, lambda masked: functools.partial(query_step, masked), init
    )
    dk_ref[...] = (key_grad * config.scale).astype(dk_ref.dtype)
    dv_ref[...] = value_grad.astype(dv_ref.dtype)


def _query_grad_kernel(
    table_ref,
    q_ref,
    k_ref,
    v_ref,
    row_ids_ref,
    key_ids_ref,
    reach_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    *,
    config,
):
    """dQ of one query block of one head, over the key blocks it reaches.

    q_ref and dq_ref `[bq, H]`, do_ref `[bq, Hv]`, lse_ref and delta_ref `[bq]`; k_ref
    `[S, H]` and v_ref `[S, Hv]` (whole); segment ids `[bq]` and `[S]`, the key blocks sharing
    one `[2]`."""
    block_q, block_k = config.blocks.backward_q, config.blocks.backward_k
    i = pl.program_id(0)
    limits = _limits(table_ref)
    query, out_grad = q_ref[...], do_ref[...]  # (bq, H), (bq, Hv)
    lse, delta = lse_ref[...], delta_ref[...]  # (bq,)
    rows = i * block_q + _iota(block_q)
    row_ids = None if row_ids_ref is None else row_ids_ref[...]

    def key_step(masked, j, query_grad):
        start = pl.multiple_of(j * block_k, block_k)
        span = pl.ds(start, block_k)
        allowed = None
        if masked:
            key_ids = None if key_ids_ref is None else key_ids_ref[span]
            allowed = _allowed(config, rows, start + _iota(block_k), limits, row_ids, key_ids)
        key = k_ref[span, :]  # (bk, H)
        _, logits_grad = _logits_grad(config, query, key, v_ref[span, :], out_grad, lse, delta, allowed)
        return query_grad + _dot(config, logits_grad.astype(key.dtype), key, (1, 0))  # (bq, H)

    lo, hi = _within_segments(*_key_blocks(config, i, limits, block_q, block_k), reach_ref)
    whole = _within_segments(*_whole_key_blocks(config, i, limits, block_q, block_k), reach_ref, whole=True)
    init = jnp.zeros(dq_ref.shape, jnp.float32)
    query_grad = _split_loop(lo, hi, whole, lambda masked: functools.partial(key_step, masked), init)
    dq_ref[...] = (query_grad * config.scale).astype(dq_ref.dtype)


@functools.cache
def triton_compiler_params() -> Any:
    """The Triton backend's `CompilerParams` class (its name has moved between jax versions),
    or None where this jax has no Triton backend. Imported on first use, not with qkv_jax."""
    try:
        from jax.experimental.pallas import triton
    except Exception:  # noqa: BLE001 - a jax without it (or that refuses it) runs interpret mode only
        return None
    return getattr(triton, "CompilerParams", None) or getattr(triton, "TritonCompilerParams", None)


def _compiler_params(config: _Config) -> Any:
    """Triton's launch parameters on a GPU; None in interpret mode."""
    if config.interpret:
        return None
    params = triton_compiler_params()
    if params is None:
        raise ValueError(
            "pallas_attention: this jax has no Pallas Triton backend (jax.experimental.pallas.triton); "
            "use another implementation"
        )
    return params(num_warps=config.num_warps, num_stages=config.num_stages)


def _operand_specs(config: _Config, shape: tuple[int, ...], along_queries: bool, block: int) -> list:
    """BlockSpecs of (table, q, k, v, row ids, key ids, reach, dO, lse, delta) for a grid
    `(blocks, B, N)` whose first axis runs over query blocks of `block` rows (`along_queries`;
    keys whole) or key blocks of `block` keys (queries whole). `shape`: (Tp, Sp, H, Hv)."""
    T, S, H, Hv = shape
    G = np.int32(config.G)
    rows, keys = (block, S) if along_queries else (T, block)

    def at_rows(blk):
        return blk if along_queries else 0

    def at_keys(blk):
        return 0 if along_queries else blk

    segment_specs: list[Any] = [None, None, None]
    if config.segments:
        segment_specs = [
            pl.BlockSpec((None, rows), lambda blk, b, n: (b, at_rows(blk))),
            pl.BlockSpec((None, keys), lambda blk, b, n: (b, at_keys(blk))),
            pl.BlockSpec((None, None, 4), lambda blk, b, n: (b, blk, 0)),
        ]
    return [
        pl.BlockSpec((None, 4), lambda blk, b, n: (b, 0)),
        pl.BlockSpec((None, rows, None, H), lambda blk, b, n: (b, at_rows(blk), n, 0)),
        pl.BlockSpec((None, keys, None, H), lambda blk, b, n: (b, at_keys(blk), lax.div(n, G), 0)),
        pl.BlockSpec((None, keys, None, Hv), lambda blk, b, n: (b, at_keys(blk), lax.div(n, G), 0)),
        *segment_specs,
        pl.BlockSpec((None, rows, None, Hv), lambda blk, b, n: (b, at_rows(blk), n, 0)),
        pl.BlockSpec((None, None, rows), lambda blk, b, n: (b, n, at_rows(blk))),
        pl.BlockSpec((None, None, rows), lambda blk, b, n: (b, n, at_rows(blk))),
    ]


def _first_and_end(chosen: Array, contiguous: bool = False) -> Array:
    """`[first, last + 1]` of the True entries along the last axis of `chosen` `[..., n]`, int32
    `[..., 2]`; `[0, 0]` where there are none (with `contiguous`, also where they have gaps)."""
    n = chosen.shape[-1]
    first = jnp.argmax(chosen, axis=-1)
    end = n - jnp.argmax(chosen[..., ::-1], axis=-1)
    keep = chosen.any(-1)
    if contiguous:
        keep &= chosen.sum(-1) == end - first
    return jnp.where(keep[..., None], jnp.stack((first, end), axis=-1), 0).astype(jnp.int32)


def _segment_reach(ids: Array | None, other_ids: Array | None, block: int, other_blocks: int):
    """For each block of `block` positions of `ids` `[B, P]`, int32 `[B, P // block, 4]`: the
    blocks `[lo, hi)` of `other_ids` `[B, Q]` (cut into `other_blocks`) whose range of ids
    overlaps its own (those outside share no id with it), then the blocks whose ids all
    equal its own single id (a run without gaps, else none). None without ids."""
    if ids is None or other_ids is None:
        return None
    B = ids.shape[0]
    blocks = ids.reshape(B, -1, block)  # (B, P/block, block)
    others = other_ids.reshape(B, other_blocks, -1)  # (B, Q/other_block, other_block)
    low, high = blocks.min(-1)[:, :, None], blocks.max(-1)[:, :, None]  # (B, P/block, 1)
    other_low, other_high = others.min(-1)[:, None, :], others.max(-1)[:, None, :]  # (B, 1, Q/ob)
    overlap = (other_low <= high) & (other_high >= low)  # (B, P/block, Q/other_block)
    same = (low == high) & (other_low == other_high) & (other_low == low)
    return jnp.concatenate((_first_and_end(overlap), _first_and_end(same, contiguous=True)), axis=-1)


def _forward_call(config: _Config, table, query, key, value, row_ids, key_ids):
    """The forward kernel over padded arrays: output `[B, Tp, N, Hv]`, lse `[B, N, Tp]` in
    base 2."""
    B, T, N, H = query.shape
    S, Hv = key.shape[1], value.shape[-1]
    block_q, block_k = config.blocks.block_q, config.blocks.block_k
    reach = _segment_reach(row_ids, key_ids, block_q, S // block_k)
    specs = _operand_specs(config, (T, S, H, Hv), True, block_q)
    return pl.pallas_call(
        functools.partial(_forward_kernel, config=config),
        out_shape=(
            jax.ShapeDtypeStruct((B, T, N, Hv), query.dtype),
            jax.ShapeDtypeStruct((B, N, T), jnp.float32),
        ),
        grid=(T // block_q, B, N),
        in_specs=specs[:7],
        out_specs=(specs[7], specs[8]),
        interpret=config.interpret,
        compiler_params=_compiler_params(config),
        name="qkv_attention_forward",
    )(table, query, key, value, row_ids, key_ids, reach)


def _backward_calls(config: _Config, operands: tuple, out_grad, lse, delta):
    """dQ `[B, Tp, N, H]` and, per query head, dK and dV `[B, Sp, N, H|Hv]` in float32."""
    table, query, key, value, row_ids, key_ids = operands
    B, T, N, H = query.shape
    S, Hv = key.shape[1], value.shape[-1]
    block_q, block_k = config.blocks.backward_q, config.blocks.backward_k
    shape = (T, S, H, Hv)
    common = dict(interpret=config.interpret, compiler_params=_compiler_params(config))
    reach = _segment_reach(row_ids, key_ids, block_q, S // block_k)
    arguments = (*operands, reach, out_grad, lse, delta)
    query_specs = _operand_specs(config, shape, True, block_q)
    query_grad = pl.pallas_call(
        functools.partial(_query_grad_kernel, config=config),
        out_shape=jax.ShapeDtypeStruct(query.shape, query.dtype),
        grid=(T // block_q, B, N),
        in_specs=query_specs,
        out_specs=query_specs[1],
        name="qkv_attention_query_grad",
        **common,
    )(*arguments)
    reach = _segment_reach(key_ids, row_ids, block_k, T // block_q)
    arguments = (*operands, reach, out_grad, lse, delta)
    key_specs = _operand_specs(config, shape, False, block_k)
    per_head = pl.BlockSpec((None, block_k, None, H), lambda blk, b, n: (b, blk, n, 0))
    per_head_value = pl.BlockSpec((None, block_k, None, Hv), lambda blk, b, n: (b, blk, n, 0))
    key_grad, value_grad = pl.pallas_call(
        functools.partial(_key_grads_kernel, config=config),
        out_shape=(
            jax.ShapeDtypeStruct((B, S, N, H), jnp.float32),
            jax.ShapeDtypeStruct((B, S, N, Hv), jnp.float32),
        ),
        grid=(S // block_k, B, N),
        in_specs=key_specs,
        out_specs=(per_head, per_head_value),
        name="qkv_attention_key_grads",
        **common,
    )(*arguments)
    return query_grad, key_grad, value_grad


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(config: _Config, table, query, key, value, row_ids, key_ids):
    """`(output [B, Tp, N, Hv], lse [B, N, Tp])` of padded arrays (the lse in the natural
    log); differentiable in the query, key and value, through both results."""
    output, lse = _forward_call(config, table, query, key, value, row_ids, key_ids)
    return output, lse * _LN_2


def _fused_forward(config: _Config, table, query, key, value, row_ids, key_ids):
    output, lse = _forward_call(config, table, query, key, value, row_ids, key_ids)  # lse in base 2
    return (output, lse * _LN_2), ((table, query, key, value, row_ids, key_ids), output, lse)


def _fused_backward(config: _Config, residuals, cotangents):
    """D = rowsum(dO * O) - dlse (natural log: dS = P (dP - D) is the same in either base); the
    kernels; dK, dV summed over each kv head's query heads."""
    operands, output, lse = residuals
    out_grad, lse_grad = cotangents
    _, query, key, value, _, _ = operands
    B, S, K, H = key.shape
    delta = jnp.sum(output.astype(jnp.float32) * out_grad.astype(jnp.float32), axis=-1)  # (B, Tp, N)
    delta = jnp.swapaxes(delta, 1, 2) - lse_grad  # (B, N, Tp)
    finite_lse = jnp.where(lse == -jnp.inf, 0.0, lse)  # rows that attend nothing: weights 0
    query_grad, key_grad, value_grad = _backward_calls(
        config, operands, out_grad.astype(value.dtype), finite_lse, delta
    )
    key_grad = key_grad.reshape(B, S, K, config.G, H).sum(axis=3)  # (B, Sp, K, H)
    value_grad = value_grad.reshape(B, S, K, config.G, value.shape[-1]).sum(axis=3)  # (B, Sp, K, Hv)
    return None, query_grad, key_grad.astype(key.dtype), value_grad.astype(value.dtype), None, None


_fused.defvjp(_fused_forward, _fused_backward)


def _check_blocks(blocks: Any, interpret: bool) -> BlockSizes:
    """`blocks` as `BlockSizes`; ValueError unless four powers of two (>= 16 on a GPU)."""
    least = 1 if interpret else 16
    sizes = tuple(blocks) if isinstance(blocks, (tuple, list)) else ()
    if len(sizes) != 4 or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= least and n & (n - 1) == 0 for n in sizes
    ):
        raise ValueError(
            f"pallas_attention: block_sizes must be four powers of two >= {least} "
            f"(block_q, block_k, backward_q, backward_k), got {blocks!r}"
        )
    return BlockSizes(*sizes)


def _pad_to(x: Array, axis: int, size: int) -> Array:
    """`x` padded with zeros along `axis` up to `size`."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _table(batch: tuple[int, ...], query_offset, query_lengths, key_lengths, T: int, S: int) -> Array:
    """Each example's (offset, query length, key length, 0) as int32 `[B, 4]`."""
    B = math.prod(batch)

    def column(x, default):
        x = jnp.asarray(default if x is None else x).astype(jnp.int32)
        return jnp.broadcast_to(per_example(x, batch), (B,))

    columns = (column(query_offset, 0), column(query_lengths, T), column(key_lengths, S))
    return jnp.stack((*columns, jnp.zeros((B,), jnp.int32)), axis=1)  # (B, 4)


def _segment_rows(ids, batch: tuple[int, ...], length: int, padded: int) -> Array | None:
    """Segment ids broadcastable to `[batch..., length]` as int32 `[B, padded]`."""
    if ids is None:
        return None
    ids = jnp.broadcast_to(per_example(jnp.asarray(ids), batch, (length,)), (math.prod(batch), length))
    return jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, padded - length)), mode="edge")  # (B, padded)


def _with_sinks(output: Array, lse: Array, sinks: Any, batch: tuple[int, ...]) -> tuple[Array, Array]:
    """Output `[B, T, N, Hv]` and lse `[B, T, N]` with one more logit per head in each row's
    normaliser: the output scaled by `sigmoid(lse - sink)`, the lse `logaddexp(lse, sink)`."""
    N = output.shape[2]
    sink = per_example(jnp.asarray(sinks).astype(jnp.float32), batch, (N,))[:, None, :]  # (B|1, 1, N)
    difference = lse - sink
    difference = jnp.where(jnp.isnan(difference), -jnp.inf, difference)  # no key and a -inf sink
    kept = jax.nn.sigmoid(difference)  # (B, T, N): the keys' share of the mass
    output = (output.astype(jnp.float32) * kept[..., None]).astype(output.dtype)
    return output, jnp.logaddexp(lse, sink)


def _scaled(query: Array, scale: Any, depth: int, dtype) -> tuple[Array, float]:
    """The query and the static scale the kernels apply: a number (None: `1/sqrt(depth)`) is
    compiled in; an array scale multiplies the query first (in float32 or wider), so that
    plain JAX differentiates it."""
    if scale is None:
        return query, 1.0 / math.sqrt(depth)
    if is_number(scale):
        return query, float(scale)
    wide = jnp.promote_types(dtype, jnp.float32)
    return (query.astype(wide) * jnp.asarray(scale, wide)).astype(dtype), 1.0


def _precision_name(precision: str | None) -> str:
    """`precision` as a key of `_FLOAT32_DOTS` (None: "highest"); ValueError otherwise."""
    name = "highest" if precision is None else str(precision).lower()
    name = {"float32": "highest", "tensorfloat32": "default", "bfloat16": "default"}.get(name, name)
    if name not in _FLOAT32_DOTS:
        raise ValueError(
            f"pallas_attention: precision must be None, 'highest', 'high' or 'default', got {precision!r}"
        )
    return name


def _padded_length(n: int, *blocks: int) -> int:
    block = max(blocks)
    return -(-n // block) * block


def _unpadded(output: Array, lse: Array, sinks: Array | None, batch: tuple[int, ...], sizes):
    """The kernels' padded `output` `[B, Tp, N, Hvp]` and `lse` `[B, N, Tp]` as
    `[batch..., T, N, Hv]` and `[batch..., T, N]`, with `sinks` applied."""
    T, N, Hv = sizes
    output, lse = output[:, :T, :, :Hv], jnp.swapaxes(lse[:, :, :T], 1, 2)  # (B, T, N, Hv), (B, T, N)
    if sinks is not None:
        output, lse = _with_sinks(output, lse, sinks, batch)
    return output.reshape(*batch, T, N, Hv), lse.reshape(*batch, T, N)


def _call_config(sizes, blocks, static_scale, interpret, **options) -> _Config:
    """The kernels' static configuration of one call: `sizes` = (T, S, G, the padded head width)
    and `options` (pallas_attention's, by name: is_causal, local_window_size, logits_soft_cap,
    precision, and whether segment ids, query lengths and a key limit apply)."""
    T, S, G, width = sizes
    return _Config(
        T=T,
        S=S,
        G=G,
        blocks=blocks,
        scale=static_scale,
        is_causal=bool(options["is_causal"]),
        window=window_pair(options["local_window_size"], "pallas_attention"),
        soft_cap=check_soft_cap("pallas_attention", options["logits_soft_cap"]),
        segments=options["segments"],
        query_lengths=options["query_lengths"],
        limit_keys=options["limit_keys"],
        interpret=interpret,
        precision=_precision_name(options["precision"]),
        num_warps=4 if width <= 64 else 8,
        num_stages=2,
    )


def pallas_attention(
    query: Array,
    key: Array,
    value: Array,
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
    precision: str | None = None,
    block_sizes: BlockSizes | tuple[int, int, int, int] | None = None,
    interpret: bool | None = None,
) -> Array | tuple[Array, Array]:
    """Fused attention (module docstring): `chunked_attention`'s arguments and meanings, less
    the bias and the mask.

    query `[batch..., T, N, H]`, key `[batch..., S, K, H]` (K divides N), value
    `[batch..., S, K, Hv]`; returns `[batch..., T, N, Hv]` in the inputs' result dtype (and,
    with `return_residual`, the log-sum-exp `[batch..., T, N]`, sinks included, -inf for a
    row with no key and no sink; it passes no gradient). A row that attends no key gives
    zeros. Differentiable in query, key, value, an array `scale` and `sinks`.

    precision: how dots of float32 operands run on a GPU: None or "highest" in IEEE float32,
      "high" as three TF32 passes (about float32's accuracy on tensor cores), "default" as
      one TF32 pass. 16-bit operands run as they are, accumulating in float32; interpret
      mode computes in float32.
    block_sizes: `BlockSizes` (powers of two, >= 16 on a GPU); None: `default_block_sizes`.
    interpret: run in Pallas' interpret mode; None: unless the default backend is a GPU.
    """
    *batch_dims, T, N, H = query.shape
    (S, K, Hv), batch = (key.shape[-3], key.shape[-2], value.shape[-1]), tuple(batch_dims)
    if (query_segment_ids is None) != (key_segment_ids is None):
        raise ValueError("pallas_attention: query_segment_ids and key_segment_ids must be given together")
    interpret = jax.default_backend() != "gpu" if interpret is None else bool(interpret)
    dtype = jnp.result_type(query, key, value)
    query, static_scale = _scaled(query, scale, H, dtype)
    depth, value_depth = _power_of_two_above(H, 16), _power_of_two_above(Hv, 16)
    blocks = block_sizes or default_block_sizes(T, S, max(depth, value_depth), dtype, interpret=interpret)
    blocks = _check_blocks(blocks, interpret)
    T_pad = _padded_length(T, blocks.block_q, blocks.backward_q)
    S_pad = _padded_length(S, blocks.block_k, blocks.backward_k)
    config = _call_config(
        (T, S, N // K, max(depth, value_depth)),
        blocks,
        static_scale,
        interpret,
        is_causal=is_causal,
        local_window_size=local_window_size,
        logits_soft_cap=logits_soft_cap,
        segments=query_segment_ids is not None,
        query_lengths=query_seq_lengths is not None,
        limit_keys=key_value_seq_lengths is not None or S_pad != S,
        precision=precision,
    )

    def flat(x, length, width):  # (B, length, heads, width), zero-padded
        return _pad_to(_pad_to(x.astype(dtype).reshape(-1, *x.shape[-3:]), 1, length), 3, width)

    output, lse = _fused(
        config,
        _table(batch, query_offset, query_seq_lengths, key_value_seq_lengths, T, S),
        flat(query, T_pad, depth),
        flat(key, S_pad, depth),
        flat(value, S_pad, value_depth),
        _segment_rows(query_segment_ids, batch, T, T_pad),
        _segment_rows(key_segment_ids, batch, S, S_pad),
    )  # (B, Tp, N, Hvp), (B, N, Tp)
    output, lse = _unpadded(output, lse, sinks, batch, (T, N, Hv))
    return (output, lax.stop_gradient(lse).astype(dtype)) if return_residual else output
