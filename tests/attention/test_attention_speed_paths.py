"""The chunked kernel's CPU speed paths: default tile sizes, overlapping last blocks, memory.

The default tiles differ between the forward and the backward pass, and a last
block that would run past T or S starts earlier and overlaps its predecessor;
both must leave outputs and gradients equal to the reference path's, with
masks, bias, lengths, GQA, causal T != S, fully masked rows, NaN/inf, bf16 and
`precision=`. The program's temporaries must stay tiled: no `[T, S]` buffer
and no whole transposed copy of K or V in the forward pass. The kernel runs inside
`shard_map`, which is how a program with several CPU devices puts them all to work.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkv_jax import dot_product_attention
from qkv_jax.attention.chunked import (
    BACKWARD_KEY_BLOCK,
    KEY_BLOCK,
    MAX_BLOCK,
    TILE_ELEMENTS,
    block_sizes,
    chunked_attention,
)

F32_OUT_ATOL = 1e-5
F32_GRAD_TOL = dict(atol=5e-5, rtol=2e-4)  # sums over 300 keys in a different order
GLIBC_MMAP_THRESHOLD = 32 * 2**20  # glibc's largest dynamic mmap threshold on 64-bit

# batch 8 x 8 query heads: the default forward tiles (256 x 64) differ from the backward's
# (128 x 128), and 300 = 256 + 44 = 2 x 128 + 44 = 4 x 64 + 44 leaves overlapping last blocks.
B, T, S, N, K, H = 8, 300, 300, 8, 2, 8


def test_block_sizes_fill_the_budget_and_clip_to_the_lengths():
    for batch_heads in (16, 64, 256):
        block_q, block_k = block_sizes(batch_heads, 8192, 8192)
        assert block_k == KEY_BLOCK or block_q == MAX_BLOCK  # the key block grows only past the cap
        assert batch_heads * block_q * block_k == TILE_ELEMENTS
        backward_q, backward_k = block_sizes(batch_heads, 8192, 8192, backward=True)
        assert backward_k == BACKWARD_KEY_BLOCK or backward_q == MAX_BLOCK
        assert batch_heads * backward_q * backward_k == TILE_ELEMENTS
    assert block_sizes(64, 100, 700) == (100, 128)  # short queries: the key block takes the rest
    assert block_sizes(1, 8192, 8192) == (MAX_BLOCK, MAX_BLOCK)  # both sides at the cap
    assert block_sizes(64, 3, 5) == (3, 5)
    assert block_sizes(128, 128, 128) == block_sizes(128, 128, 128, backward=True) == (128, 128)  # one tile
    assert block_sizes(B * N, T, S) != block_sizes(B * N, T, S, backward=True)
    # A decode step (B8 N14 K2 H64, one query): few logits, but 32 MiB of copies of 4096 cached
    # keys and values in one tile; a shorter cache (16 MiB of copies or less) stays one tile.
    assert block_sizes(8 * 14, 1, 4096) == (1, 4096)
    assert block_sizes(8 * 14, 1, 4096, key_width=8 * 2 * 128) == (1, MAX_BLOCK)
    assert block_sizes(8 * 14, 1, 2048, key_width=8 * 2 * 128) == (1, 2048)


@pytest.mark.parametrize("name", ["block_q", "block_k"])
@pytest.mark.parametrize("size", [0, -3, 2.0, True])
def test_bad_block_sizes_raise(name, size):
    x = np.ones((1, 4, 2, 8), np.float32)
    with pytest.raises(ValueError, match=f"{name} must be a positive int or None, got {size!r}"):
        chunked_attention(x, x, x, **{name: size})


def inputs(dtype=np.float32, seed=0, masking="mask+bias+lengths"):
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(B, T, N, H)).astype(dtype)
    key = rng.normal(size=(B, S, K, H)).astype(dtype)
    value = rng.normal(size=(B, S, K, H)).astype(dtype)
    extra = {}
    if "mask" in masking:
        mask = rng.random((B, 1, T, S)) < 0.8
        mask[0, 0, 5] = False  # a fully masked row
        extra["mask"] = mask
    if "bias" in masking:
        bias = rng.normal(size=(N, 1, S)).astype(np.float32)  # broadcast over queries
        bias[1, 0, 7] = -np.inf
        extra["bias"] = bias
    if "lengths" in masking:
        extra["query_seq_lengths"] = np.array([T, 250, 1, T, 290, T, 0, 299])
        extra["key_value_seq_lengths"] = np.array([S, 260, S, 1, S, 0, 299, 280])
    return query, key, value, extra


def loss_and_grads(implementation, query, key, value, extra, is_causal):
    """Outputs and the gradients of a fixed scalar loss w.r.t. query, key, value (and bias)."""
    bias = extra.get("bias")
    rest = {k: v for k, v in extra.items() if k != "bias"}

    def loss(q, k, v, b):
        out = dot_product_attention(
            q, k, v, bias=b, is_causal=is_causal, implementation=implementation, **rest
        )
        return jnp.sum(jnp.sin(out.astype(jnp.float32))), out

    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    grad = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))
    grads, out = grad(query, key, value, bias)
    return out, grads


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("masking", ["none", "mask+bias+lengths"])
def test_default_tiles_match_the_reference(is_causal, masking):
    query, key, value, extra = inputs(masking=masking)
    out, grads = loss_and_grads("chunked", query, key, value, extra, is_causal)
    want, want_grads = loss_and_grads("reference", query, key, value, extra, is_causal)
    np.testing.assert_allclose(out, want, atol=F32_OUT_ATOL)
    for name, got, expected in zip(("query", "key", "value", "bias"), grads, want_grads, strict=False):
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, expected, **F32_GRAD_TOL, err_msg=name)


@pytest.mark.parametrize(
    "offset", [pytest.param("top-left", marks=pytest.mark.slow), "bottom-right"]
)  # top-left with T != S on small tiles: also tests/attention/test_attention_variants.py
@pytest.mark.slow
def test_causal_with_fewer_queries_than_keys_and_more(offset):
    """Causal T != S, aligned top-left (jax.nn's) and bottom-right (query_offset = S - T: the
    queries as the last T of S), with overlapping blocks on both sides."""
    rng = np.random.default_rng(1)
    for T_, S_ in ((37, 101), (101, 37)):
        query = rng.normal(size=(2, T_, 4, 8)).astype(np.float32)
        key, value = (rng.normal(size=(2, S_, 1, 8)).astype(np.float32) for _ in range(2))  # MQA
        causal = dict(is_causal=True, query_offset=0 if offset == "top-left" else S_ - T_)
        tiled = functools.partial(chunked_attention, block_q=16, block_k=24, **causal)
        reference = functools.partial(dot_product_attention, implementation="reference", **causal)
        np.testing.assert_allclose(jax.jit(tiled)(query, key, value), reference(query, key, value), atol=1e-5)

        def loss(attend, q, k, v):
            return jnp.sum(jnp.sin(attend(q, k, v)))

        got = jax.jit(jax.grad(functools.partial(loss, tiled), (0, 1, 2)))(query, key, value)
        expected = jax.jit(jax.grad(functools.partial(loss, reference), (0, 1, 2)))(query, key, value)
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_allclose(g, e, **F32_GRAD_TOL)
        if (
            T_ > S_ and offset == "bottom-right"
        ):  # the first T - S queries see no key: zero output and gradient
            np.testing.assert_array_equal(jax.jit(tiled)(query, key, value)[:, : T_ - S_], 0.0)
            np.testing.assert_array_equal(got[0][:, : T_ - S_], 0.0)


@pytest.mark.parametrize("bias_shape", [(2, 1, 1, 23), (4, 19, 1), (1, 1, 19, 23)])
def test_bias_gradients_sum_over_broadcast_axes_with_overlapping_blocks(bias_shape):
    rng = np.random.default_rng(2)
    query = rng.normal(size=(2, 19, 4, 8)).astype(np.float32)
    key, value = (rng.normal(size=(2, 23, 2, 8)).astype(np.float32) for _ in range(2))
    bias = rng.normal(size=bias_shape).astype(np.float32)
    lengths = dict(query_seq_lengths=np.array([19, 11]), key_value_seq_lengths=np.array([23, 17]))

    def loss(attend, b):
        return jnp.sum(jnp.sin(attend(query, key, value, bias=b, **lengths)))

    tiled = functools.partial(chunked_attention, block_q=8, block_k=5)
    reference = functools.partial(dot_product_attention, implementation="reference")
    got = jax.jit(jax.grad(functools.partial(loss, tiled)))(bias)
    expected = jax.grad(functools.partial(loss, reference))(bias)
    assert got.shape == bias.shape
    np.testing.assert_allclose(got, expected, **F32_GRAD_TOL)


def test_non_finite_keys_and_values_with_default_tiles():
    query, key, value, extra = inputs(masking="mask")
    mask = extra["mask"].copy()
    mask[..., 200:] = False  # keys 200.. masked for every query
    key, value = key.copy(), value.copy()
    key[0, 250, 1, 3] = np.nan  # masked: must not leak
    value[3, 280, 0, 2] = np.inf  # masked
    out, grads = loss_and_grads("chunked", query, key, value, {"mask": mask}, True)
    clean_key, clean_value = key.copy(), value.copy()
    clean_key[0, 250], clean_value[3, 280] = 0.0, 0.0
    _, want_grads = loss_and_grads("reference", query, clean_key, clean_value, {"mask": mask}, True)
    assert np.isfinite(out).all()
    for got, expected in zip(grads, want_grads, strict=True):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, expected, **F32_GRAD_TOL)
    value[1, 120, 1, 5] = np.nan  # attended: channel 5 of the rows of kv head 1 that see key 120
    key[2, 90, 0, 0] = np.inf  # attended: whole rows of kv head 0 that see key 90
    attend = functools.partial(dot_product_attention, query, key, value, mask=mask, is_causal=True)
    got, want = attend(implementation="chunked"), attend(implementation="reference")
    assert np.isnan(want).any() and np.isfinite(want).any()
    np.testing.assert_allclose(got, want, atol=F32_OUT_ATOL)  # NaN exactly where the reference has NaN


def test_bfloat16_with_default_tiles_matches_float32():
    query, key, value, extra = inputs(dtype=np.float32)
    low = [jnp.asarray(x, jnp.bfloat16) for x in (query, key, value)]
    rounded = [np.asarray(x, np.float32) for x in low]
    out, grads = loss_and_grads("chunked", *low, extra, True)
    want, want_grads = loss_and_grads("reference", *rounded, extra, True)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2, rtol=2e-2)
    for got, expected in zip(grads, want_grads, strict=False):
        np.testing.assert_allclose(np.asarray(got, np.float32), expected, atol=8e-2, rtol=8e-2)


def test_precision_reaches_every_dot_with_default_tiles():
    query, key, value, extra = inputs(masking="mask+bias")
    attend = functools.partial(dot_product_attention, implementation="chunked", precision="high", **extra)
    loss = lambda q, k, v: jnp.sum(attend(q, k, v))
    text = jax.jit(jax.grad(loss, (0, 1, 2))).lower(query, key, value).as_text()
    dots = text.count("stablehlo.dot_general")
    assert dots >= 8  # forward: logits, blend, bad values; backward: logits, dV, dP, dQ, dK
    assert text.count("precision = [HIGH, HIGH]") == dots


def temp_bytes(function, *shapes) -> int:
    return jax.jit(function).lower(*shapes).compile().memory_analysis().temp_size_in_bytes


def test_the_forward_pass_allocates_only_tiles():
    """At batch 8 x 8 heads and T = S = 2048 the logits alone would take 1 GiB and a
    transposed copy of K 32 MiB; the forward pass's temporaries stay under glibc's mmap
    threshold, whatever T. glibc's threshold is a CPU matter: an accelerator's tiles are sized
    for its own memory (and the dispatch rule sends such calls elsewhere there)."""
    if jax.default_backend() != "cpu":
        pytest.skip("glibc's mmap threshold concerns host memory only")
    for length in (512, 2048, 8192):
        x = jax.ShapeDtypeStruct((8, length, 8, 64), jnp.float32)
        attend = functools.partial(dot_product_attention, is_causal=True, implementation="chunked")
        assert temp_bytes(attend, x, x, x) < GLIBC_MMAP_THRESHOLD, length


def test_the_backward_pass_allocates_no_logits():
    """Forward and backward of a long sequence: temporaries far below one `[T, S]` buffer."""
    x = jax.ShapeDtypeStruct((2, 8192, 2, 16), jnp.float32)

    def gradients(q, k, v):
        out, vjp = jax.vjp(functools.partial(dot_product_attention, is_causal=True), q, k, v)
        return vjp(out)

    logits_bytes = 2 * 2 * 8192 * 8192 * 4
    assert temp_bytes(gradients, x, x, x) < logits_bytes / 16


@pytest.mark.slow
def test_runs_inside_shard_map_with_a_replicated_bias():
    """Inside `shard_map` (here over one CPU device: the types are checked all the same) the
    kernel's loop carries and its custom VJP's cotangents must carry the mesh axes the inputs
    vary along; a bias that does not vary gets its gradient summed over them."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("heads",))
    spec = jax.sharding.PartitionSpec(None, None, "heads")
    rng = np.random.default_rng(3)
    query, key, value = (rng.normal(size=(2, 70, 4, 8)).astype(np.float32) for _ in range(3))
    bias = rng.normal(size=(70, 70)).astype(np.float32)

    def attend(q, k, v, b):
        return dot_product_attention(q, k, v, bias=b, is_causal=True, implementation="chunked")

    sharded = jax.shard_map(
        attend, mesh=mesh, in_specs=(spec, spec, spec, jax.sharding.PartitionSpec()), out_specs=spec
    )

    def loss(f, *args):
        return jnp.sum(jnp.sin(f(*args)))

    np.testing.assert_allclose(
        jax.jit(sharded)(query, key, value, bias), attend(query, key, value, bias), atol=1e-6
    )
    got = jax.jit(jax.grad(functools.partial(loss, sharded), (0, 1, 2, 3)))(query, key, value, bias)
    expected = jax.jit(jax.grad(functools.partial(loss, attend), (0, 1, 2, 3)))(query, key, value, bias)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-6, rtol=1e-6)
