"""The fused Pallas kernels ("pallas") in interpret mode against float64 references.

Each case combines options (causal with a query offset at T != S, windows on
one or both sides, segment ids, lengths, a soft cap, sinks, grouped kv heads,
a query/key width unequal to the value's, float32, bfloat16 and float16) at tiny
shapes with blocks of 8, so that there are several blocks, padded ones and
blocks the loops skip, and rows that see no key. Outputs and residuals are
compared with tests/numpy_reference.py, gradients (query, key, value, sinks,
an array scale) with the reference path's in float64. Interpret mode compiles
slowly: each case compiles one function that gives outputs and gradients.
The kernels are also lowered for a GPU from this machine (Triton's lowering
rules run without one), forward and backward.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest

from qkv_jax import dot_product_attention
from qkv_jax.attention import pallas
from qkv_jax.attention.pallas import pallas_attention

# Blocks of 8 in interpret mode (off a GPU); on a GPU the kernels run through Triton with its
# default tiles (at least 16), against the same references.
BLOCKS_OF_8 = (8, 8, 8, 8) if jax.default_backend() != "gpu" else None
# name: (dtype, batch, T, S, N, K, H, Hv, options); "segments" and "lengths" are made by `make_case`.
CASES = {
    "f32 gqa mla: causal offsets T<S, window, segments, lengths, soft cap, sinks": (
        np.float32,
        (2,),
        20,
        27,
        4,
        2,
        12,
        8,
        dict(
            is_causal=True,
            query_offset=np.array([3, 7]),
            local_window_size=(6, 2),
            logits_soft_cap=3.0,
            segments=True,
            lengths=True,
            sinks=(4,),
        ),
    ),
    "bf16 2-d batch mqa: causal window, lengths, sinks [B, N], soft cap": (
        jnp.bfloat16,
        (1, 2),
        32,
        32,
        4,
        1,
        16,
        16,
        dict(is_causal=True, local_window_size=(20, 0), lengths=True, sinks=(1, 2, 4), logits_soft_cap=5.0),
    ),
    "f16 gqa: causal, offsets per example T>S, query lengths, sinks": (
        jnp.float16,
        (2,),
        24,
        17,
        4,
        2,
        8,
        8,
        dict(is_causal=True, query_offset=np.array([-3, 2]), lengths=True, sinks=(4,)),
    ),
    "f32 unbatched, two-sided window, static offset, segment runs, array scale": (
        np.float32,
        (),
        28,
        40,
        2,
        2,
        8,
        8,
        dict(
            local_window_size=(10, 12),
            query_offset=-14,
            segments=([0] * 16 + [1] * 12, [1] * 12 + [2] * 28),  # rows 0..15 see no key
            scale=0.4,
        ),
    ),
}
FAST = "f32 gqa mla: causal offsets T<S, window, segments, lengths, soft cap, sinks"
TOLERANCE = {
    np.float32: dict(atol=2e-5, rtol=1e-4),
    jnp.bfloat16: dict(atol=3e-2, rtol=3e-2),
    jnp.float16: dict(atol=4e-3, rtol=4e-3),
}


def make_case(name, seed=0):
    """(query, key, value, sinks or None, scale or None, keywords of everything else)."""
    dtype, batch, T, S, N, K, H, Hv, options = CASES[name]
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(*batch, T, N, H))
    key = rng.normal(size=(*batch, S, K, H))
    value = rng.normal(size=(*batch, S, K, Hv))
    query, key, value = (np.asarray(jnp.asarray(x, dtype)) for x in (query, key, value))  # rounded
    keywords = {k: v for k, v in options.items() if k not in ("segments", "lengths", "sinks", "scale")}
    segments = options.get("segments")
    if segments is True:  # packed rows; query id 3 has no key
        segments = (np.minimum(np.arange(T) * 4 // T, 3), np.minimum(np.arange(S) * 3 // S, 2))
    if segments:
        keywords["query_segment_ids"] = np.broadcast_to(np.asarray(segments[0]), (*batch, T))
        keywords["key_segment_ids"] = np.broadcast_to(np.asarray(segments[1]), (*batch, S))
    if options.get("lengths"):  # the last example's last 5 rows and the first's last 6 keys padded
        query_lengths, key_lengths = np.full(batch, T), np.full(batch, S)
        query_lengths.reshape(-1)[-1], key_lengths.reshape(-1)[0] = T - 5, S - 6
        keywords.update(query_seq_lengths=query_lengths, key_value_seq_lengths=key_lengths)
    sinks = None if "sinks" not in options else rng.normal(size=options["sinks"]).astype(np.float32)
    scale = None if "scale" not in options else np.float32(options["scale"])
    return query, key, value, sinks, scale, keywords


def numpy_answer(query, key, value, sinks, scale, keywords):
    """float64 (output, residual, allowed pairs)."""
    *batch, T, N, _ = query.shape
    S = key.shape[-3]
    allowed = ref.allowed_pairs(
        tuple(batch),
        N,
        T,
        S,
        is_causal=keywords.get("is_causal", False),
        window=keywords.get("local_window_size"),
        query_offset=keywords.get("query_offset", 0),
        query_lengths=keywords.get("query_seq_lengths"),
        key_lengths=keywords.get("key_value_seq_lengths"),
        query_segments=keywords.get("query_segment_ids"),
        key_segments=keywords.get("key_segment_ids"),
    )
    sinks = None if sinks is None else np.asarray(sinks, np.float64)
    output, _, residual = ref.attention_full(
        query,
        key,
        value,
        allowed=allowed,
        scale=None if scale is None else float(scale),
        soft_cap=keywords.get("logits_soft_cap"),
        sinks=sinks,
    )
    return output, residual, allowed


def _loss_and_outputs(attend, query, key, value, sinks, scale, cotangent):
    """A scalar loss with uneven weights on every output entry, and (output, residual)."""
    output, residual = attend(query, key, value, sinks, scale)
    return jnp.sum(output.astype(jnp.float32) * cotangent), (output, residual)


@functools.cache
def results(name, implementation):
    """(output, residual, gradients wrt query, key, value, sinks and scale) of one case, on
    "pallas" (the case's dtype; blocks of 8 through pallas_attention, the default blocks
    through dot_product_attention for the bf16 case) or "reference" (float64)."""
    query, key, value, sinks, scale, keywords = make_case(name)
    wide = implementation == "reference"
    cotangent = np.random.default_rng(1).normal(size=(*query.shape[:-1], value.shape[-1]))
    argnums = (0, 1, 2) + ((3,) if sinks is not None else ()) + ((4,) if scale is not None else ())

    def attend(q, k, v, s, c):
        common = dict(keywords, sinks=s, scale=c, return_residual=True)
        if wide or query.dtype != np.float32:
            return dot_product_attention(q, k, v, implementation=implementation, **common)
        return pallas_attention(q, k, v, block_sizes=BLOCKS_OF_8, **common)

    loss = jax.value_and_grad(functools.partial(_loss_and_outputs, attend), argnums, has_aux=True)
    with jax.enable_x64(wide):
        args = [query, key, value, sinks, scale, cotangent.astype(np.float32)]
        if wide:
            args = [None if x is None else np.asarray(x, np.float64) for x in args]
        (_, (output, residual)), grads = jax.jit(loss)(*args)
        return (
            np.asarray(output, np.float64),
            np.asarray(residual, np.float64),
            [np.asarray(g) for g in grads],
        )


def check_case(name):
    dtype = CASES[name][0]
    query, key, value, sinks, scale, keywords = make_case(name)
    want, want_residual, allowed = numpy_answer(query, key, value, sinks, scale, keywords)
    assert not allowed.any(-1).all() and allowed.any(-1).any()  # some rows see no key
    output, residual, grads = results(name, "pallas")
    tolerance = TOLERANCE[dtype]
    np.testing.assert_allclose(output, want, **tolerance)
    np.testing.assert_allclose(residual, want_residual, **tolerance)
    *_, expected = results(name, "reference")
    for index, (got, wanted) in enumerate(zip(grads, expected, strict=True)):
        assert got.shape == wanted.shape and np.isfinite(got).all(), index
        scale_of = max(1.0, np.abs(wanted).max())  # 16-bit gradients: relative to their size
        np.testing.assert_allclose(got, wanted, **dict(tolerance, atol=tolerance["atol"] * scale_of))


def test_combined_options_float32():
    check_case(FAST)


@pytest.mark.slow  # interpret mode compiles each case for a few seconds; the fast tier has one
@pytest.mark.parametrize("name", [name for name in CASES if name != FAST])
def test_more_options(name):
    check_case(name)


def reached_blocks(bounds, config, blocks, limits, other_blocks, block):
    """Boolean `[blocks, other blocks]`: which blocks the loop of each block runs over, by
    `bounds` (one of pallas' `_key_blocks`, `_query_blocks`, `_whole_...`)."""
    lo, hi = jax.jit(bounds, static_argnums=(0, 3, 4))(config, blocks, limits, block, block)
    return (other_blocks >= np.asarray(lo)[:, None]) & (other_blocks < np.asarray(hi)[:, None])


@pytest.mark.parametrize("is_causal,window", [(True, (20, 3)), (False, (13, 19))])
def test_loops_reach_every_visible_pair_and_skip_the_band_outside(is_causal, window):
    """The block bounds of both passes hold every pair the rules allow and skip most blocks;
    the blocks they run without a mask are exactly those whose every pair is allowed."""
    T, S, block, offset = 88, 96, 8, 5
    config = pallas._Config(
        T=T,
        S=S,
        G=1,
        blocks=pallas.BlockSizes(block, block, block, block),
        scale=1.0,
        is_causal=is_causal,
        window=window,
        soft_cap=None,
        segments=False,
        query_lengths=True,
        limit_keys=True,
        interpret=True,
        precision="highest",
        num_warps=4,
        num_stages=2,
    )
    limits = pallas._Limits(jnp.int32(offset), jnp.int32(T - 3), jnp.int32(S - 2))
    rules = dict(
        is_causal=is_causal, window=window, query_offset=offset, query_lengths=T - 3, key_lengths=S - 2
    )
    allowed = ref.allowed_pairs((), 1, T, S, **rules)[0].reshape(T // block, block, S // block, block)
    visible, whole = allowed.any(axis=(1, 3)), allowed.all(axis=(1, 3))  # (query blocks, key blocks)
    query_blocks, key_blocks = np.arange(T // block, dtype=np.int32), np.arange(S // block, dtype=np.int32)
    forward = reached_blocks(pallas._key_blocks, config, query_blocks, limits, key_blocks, block)
    backward = reached_blocks(pallas._query_blocks, config, key_blocks, limits, query_blocks, block).T
    for reached in (forward, backward):
        assert (reached >= visible).all()
        assert reached.sum() <= visible.sum() + T // block  # at most one block more per row of blocks
        assert reached.sum() < visible.size / 2
    assert whole.any()
    unmasked = reached_blocks(pallas._whole_key_blocks, config, query_blocks, limits, key_blocks, block)
    np.testing.assert_array_equal(unmasked, whole)  # exact: the rules here make a band
    unmasked = reached_blocks(pallas._whole_query_blocks, config, key_blocks, limits, query_blocks, block)
    np.testing.assert_array_equal(unmasked.T, whole)


segment_reach = jax.jit(pallas._segment_reach, static_argnums=(2, 3))


def test_segment_reach_holds_every_block_pair_sharing_an_id_and_skips_the_rest():
    """Packed rows (ids rising along the sequence): the blocks a block reaches by segment ids
    are exactly those sharing an id with it, and those it reaches without a mask those whose
    ids all equal its own one id, both ways round."""
    row_ids = np.repeat([[0, 1, 1, 2, 4, 4, 4, 4]], 8, axis=1)  # (1, 64): blocks of 8, 16
    key_ids = np.repeat([[0, 0, 1, 2, 2, 3, 4, 4]], 8, axis=1)  # (1, 64)
    for ids, other, block, other_block in ((row_ids, key_ids, 8, 16), (key_ids, row_ids, 16, 8)):
        reach = np.asarray(segment_reach(ids, other, block, other.shape[1] // other_block))  # (1, blocks, 4)
        blocks = ids[0].reshape(-1, block)[:, :, None, None]  # (blocks, block, 1, 1)
        other_blocks = other[0].reshape(-1, other_block)[None, None]  # (1, 1, other blocks, block)
        shares = (blocks == other_blocks).any(axis=(1, 3))  # (blocks, other blocks)
        one_id = (blocks == other_blocks).all(axis=(1, 3))
        assert one_id.any() and not (one_id == shares).all()
        positions = np.arange(shares.shape[1])
        for at, want in ((0, shares), (2, one_id)):
            reached = (positions >= reach[0, :, at : at + 1]) & (positions < reach[0, :, at + 1 : at + 2])
            np.testing.assert_array_equal(reached, want)


def test_refusals_in_one_line():
    query = np.ones((2, 8, 2, 4), np.float32)
    with pytest.raises(ValueError, match=r"^dot_product_attention: implementation='pallas' has no mask"):
        dot_product_attention(query, query, query, mask=np.ones((8, 8), bool), implementation="pallas")
    with pytest.raises(ValueError, match="block_sizes must be four powers of two >= 16"):
        pallas_attention(query, query, query, block_sizes=(8, 8, 8, 8), interpret=False)
    with jax.enable_x64(True), pytest.raises(ValueError, match="cannot serve float64"):
        dot_product_attention(query.astype(np.float64), query, query, implementation="pallas")


@pytest.mark.skipif(pallas.triton_compiler_params() is None, reason="this jax has no Pallas Triton backend")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=pytest.mark.slow)])
def test_kernels_lower_through_triton_for_a_gpu(dtype):
    """Lowered for CUDA from this machine, forward and backward become three Triton kernels:
    every primitive has a Triton lowering rule and every loaded block is a power of two."""
    B, T, S, N, K, H, Hv = 2, 100, 300, 4, 2, 24, 40

    def loss(query, key, value, sinks, ids, offsets):
        output = pallas_attention(
            query,
            key,
            value,
            is_causal=True,
            query_offset=offsets,
            local_window_size=(70, 3),
            logits_soft_cap=20.0,
            query_segment_ids=ids[:, :T],
            key_segment_ids=ids,
            key_value_seq_lengths=offsets + 250,
            query_seq_lengths=offsets + 90,
            sinks=sinks,
            interpret=False,
        )
        return jnp.sum(output.astype(jnp.float32))

    shapes = [(B, T, N, H), (B, S, K, H), (B, S, K, Hv), (N,), (B, S), (B,)]
    dtypes = [dtype, dtype, dtype, jnp.float32, jnp.int32, jnp.int32]
    args = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in zip(shapes, dtypes, strict=True)]
    gradients = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    text = gradients.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3
    for name in ("qkv_attention_forward", "qkv_attention_query_grad", "qkv_attention_key_grads"):
        assert f'name = "{name}"' in text


@pytest.mark.skipif(pallas.triton_compiler_params() is None, reason="this jax has no Pallas Triton backend")
def test_float32_precisions_lower_for_a_gpu():
    """Each precision of float32 dots lowers through Triton, to a different kernel."""
    query = jax.ShapeDtypeStruct((1, 64, 2, 32), jnp.float32)
    texts = set()
    for precision in ("highest", "high", "default"):
        attend = jax.jit(
            functools.partial(pallas_attention, is_causal=True, precision=precision, interpret=False)
        )
        text = attend.trace(query, query, query).lower(lowering_platforms=("cuda",)).as_text()
        texts.add(text[text.index("__gpu$xla.gpu.triton") :])
    assert len(texts) == 3
    with pytest.raises(ValueError, match="precision must be None, 'highest', 'high' or 'default'"):
        pallas_attention(query, query, query, precision="fp8")
