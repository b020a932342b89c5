"""qkv_jax.dot_product_attention against independent references."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
from jax.test_util import check_grads

import qkv_jax
from qkv_jax import causal_mask, combine_masks, dot_product_attention, padding_mask
from qkv_jax.checks import assert_attention_weights

# (batch, T, S, N, K, H, Hv): T != S, H != Hv, and GQA with N = 8, K in 1, 2, 4, 8.
SHAPES = [
    ((), 3, 3, 1, 1, 4, 4),
    ((2,), 4, 6, 8, 1, 4, 3),
    ((2,), 5, 3, 8, 2, 3, 5),
    ((1, 2), 4, 4, 8, 4, 2, 2),
    ((2,), 3, 7, 8, 8, 4, 6),
]
MASKINGS = ["none", "mask", "causal", "bias", "mask+bias+causal"]


def random_qkv(seed, batch, T, S, N, K, H, Hv, dtype=np.float64):
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(*batch, T, N, H))
    key = rng.normal(size=(*batch, S, K, H))
    value = rng.normal(size=(*batch, S, K, Hv))
    return [x.astype(dtype) for x in (query, key, value)]


def random_masking(seed, masking, batch, T, S, N):
    """Returns (mask, bias, is_causal) with masks of several broadcast shapes."""
    rng = np.random.default_rng(seed + 100)
    mask = bias = None
    if "mask" in masking:
        mask = rng.random((*batch, 1, T, S)) < 0.7  # broadcast over heads
    if "bias" in masking:
        bias = rng.normal(size=(N, T, S))  # broadcast over batch
    return mask, bias, "causal" in masking


def expected_mask(mask, is_causal, T, S):
    return combine_masks(mask, ref.causal(T, S) if is_causal else None)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("masking", MASKINGS)
def test_matches_float64_numpy_reference(shape, masking):
    batch, T, S, N, K, H, Hv = shape
    query, key, value = random_qkv(0, *shape)
    mask, bias, is_causal = random_masking(0, masking, batch, T, S, N)
    want_out, want_weights = ref.attention(
        query, key, value, mask=expected_mask(mask, is_causal, T, S), bias=bias
    )
    with jax.enable_x64(True):
        out, weights = dot_product_attention(
            query, key, value, mask=mask, bias=bias, is_causal=is_causal, return_weights=True
        )
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(out, want_out, atol=1e-12)
        np.testing.assert_allclose(weights, want_weights, atol=1e-12)
    # float32 inputs against the same float64 answer.
    out32, weights32 = dot_product_attention(
        *(x.astype(np.float32) for x in (query, key, value)),
        mask=mask,
        bias=None if bias is None else bias.astype(np.float32),
        is_causal=is_causal,
        return_weights=True,
    )
    assert out32.dtype == jnp.float32 and out32.shape == (*batch, T, N, Hv)
    assert weights32.shape == (*batch, N, T, S)
    np.testing.assert_allclose(out32, want_out, atol=1e-5)
    full_mask = expected_mask(mask, is_causal, T, S)
    assert_attention_weights(weights32, None if full_mask is None else np.asarray(full_mask))


def test_gqa_equals_repeated_kv_heads():
    query, key, value = random_qkv(1, (2,), 5, 6, 8, 2, 4, 4, np.float32)
    grouped = dot_product_attention(query, key, value)
    repeated = dot_product_attention(query, np.repeat(key, 4, axis=-2), np.repeat(value, 4, axis=-2))
    np.testing.assert_allclose(grouped, repeated, atol=1e-6)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("is_causal", [False, True])
def test_agrees_with_jax_nn(num_kv_heads, is_causal):
    query, key, value = random_qkv(2, (2,), 6, 6, 4, num_kv_heads, 8, 8, np.float32)
    mask = np.random.default_rng(2).random((2, 1, 6, 6)) < 0.8
    bias = np.random.default_rng(3).normal(size=(1, 4, 6, 6)).astype(np.float32)
    want = jax.nn.dot_product_attention(query, key, value, bias=bias, mask=mask, is_causal=is_causal)
    got = dot_product_attention(query, key, value, bias=bias, mask=mask, is_causal=is_causal)
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_agrees_with_flax_dot_product_attention():
    query, key, value = random_qkv(4, (3,), 5, 7, 2, 2, 4, 3, np.float32)
    mask = np.random.default_rng(4).random((3, 2, 5, 7)) < 0.8
    mask[..., 0] = True  # flax gives a uniform row, not zeros, when a row is fully masked
    bias = np.random.default_rng(5).normal(size=(3, 2, 5, 7)).astype(np.float32)
    want = nn.dot_product_attention(query, key, value, bias=bias, mask=mask)
    got = dot_product_attention(query, key, value, bias=bias, mask=mask)
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_scale_reproduces_thermostat_example(walkthrough):
    """The walkthrough's x8 example: a bigger scale makes the softmax peaky."""
    scores = np.asarray(walkthrough["softmax_thermostat"]["scores"], np.float32)
    # Scores as logits of one query against five keys: q = 1, k_s = score_s, H = 1.
    query = np.ones((1, 1, 1), np.float32)
    key = scores.reshape(5, 1, 1)
    value = np.eye(5, dtype=np.float32).reshape(5, 1, 5)
    for factor, name in ((1.0, "softmax"), (8.0, "softmax_times_8")):
        _, weights = dot_product_attention(query, key, value, scale=factor, return_weights=True)
        np.testing.assert_allclose(weights[0, 0], walkthrough["softmax_thermostat"][name], atol=1e-6)


@pytest.mark.slow
def test_gradients_float64():
    query, key, value = random_qkv(6, (2,), 3, 4, 4, 2, 3, 2)
    mask = np.random.default_rng(6).random((2, 1, 3, 4)) < 0.7
    mask[0, 0, 1, :] = False  # a fully masked row must keep finite, exact gradients
    bias = np.random.default_rng(7).normal(size=(4, 3, 4))

    def f(q, k, v, b):
        return dot_product_attention(q, k, v, mask=mask, bias=b, is_causal=True)

    with jax.enable_x64(True):
        check_grads(f, (query, key, value, bias), order=2, modes=["fwd", "rev"], eps=1e-4)


def test_causal_receptive_field_through_gradients():
    """Output t depends on inputs 0..t only: the Jacobian is block lower triangular."""
    T, D = 6, 8
    model = qkv_jax.MultiHeadAttention(num_heads=2, is_causal=True)
    x = jax.random.normal(jax.random.PRNGKey(0), (T, D))
    params = model.init(jax.random.PRNGKey(1), x)
    jacobian = jax.jacrev(lambda inputs: model.apply(params, inputs))(x)  # (T, D, T, D)
    dependence = np.abs(np.asarray(jacobian)).sum(axis=(1, 3))  # (T_out, T_in)
    future = np.triu(np.ones((T, T), bool), k=1)
    assert (dependence[future] == 0).all()
    assert (dependence[~future] > 0).all()


def test_causal_mask_semantics():
    np.testing.assert_array_equal(causal_mask(3), np.tril(np.ones((3, 3), bool)))
    # jax.nn's top-left alignment: query t sees keys 0..t, whatever S.
    np.testing.assert_array_equal(causal_mask(2, 5, query_offset=0), [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    # Decoding: with query_offset = S - T the 2 queries are the last 2 of 5 positions.
    np.testing.assert_array_equal(causal_mask(2, 5, query_offset=3), [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(causal_mask(4, 3, query_offset=-1), ref.causal(4, 3, query_offset=-1))


def test_causal_alignment_change_warns_once_per_process(monkeypatch):
    """is_causal / causal_mask with T != S and no query_offset used to mean bottom-right: one
    FutureWarning per process (for both) says so and names the offset that restores it."""
    monkeypatch.setattr(qkv_jax.attention.visibility, "_alignment_warned", False)
    query, key, value = random_qkv(14, (), 2, 5, 1, 1, 4, 4, np.float32)
    with pytest.warns(FutureWarning, match=r"query_offset=S - T \(here 3\)") as record:
        top_left = dot_product_attention(query, key, value, is_causal=True)
        dot_product_attention(query, key, value, is_causal=True)
        causal_mask(2, 5)
    assert len(record) == 1
    np.testing.assert_allclose(
        top_left, dot_product_attention(query, key, value, mask=ref.causal(2, 5)), atol=1e-6
    )
    monkeypatch.setattr(qkv_jax.attention.visibility, "_alignment_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit offset, or T == S, changed nothing: no warning
        dot_product_attention(query, key, value, is_causal=True, query_offset=0)
        dot_product_attention(query, key[:2], value[:2], is_causal=True)
        causal_mask(2, 5, query_offset=3)
    with pytest.warns(FutureWarning, match="causal_mask: a causal mask with T=2 queries and S=5 keys"):
        np.testing.assert_array_equal(causal_mask(2, 5), causal_mask(2, 5, query_offset=0))


def test_padding_and_combined_masks():
    mask = padding_mask(jnp.array([2, 4]), 4)
    assert mask.shape == (2, 1, 1, 4)
    np.testing.assert_array_equal(mask[:, 0, 0], [[1, 1, 0, 0], [1, 1, 1, 1]])
    combined = combine_masks(mask, causal_mask(4), None)
    assert combined.shape == (2, 1, 4, 4)
    np.testing.assert_array_equal(combined[0, 0, 3], [1, 1, 0, 0])
    np.testing.assert_array_equal(combined[1, 0, 1], [1, 1, 0, 0])
    assert combine_masks(None, None) is None


def test_padding_mask_in_attention_ignores_padded_keys():
    query, key, value = random_qkv(8, (2,), 3, 5, 2, 2, 4, 4, np.float32)
    lengths = np.array([3, 5])
    out = dot_product_attention(query, key, value, mask=padding_mask(lengths, 5))
    truncated = dot_product_attention(query[:1], key[:1, :3], value[:1, :3])
    np.testing.assert_allclose(out[:1], truncated, atol=1e-6)


@pytest.mark.slow
def test_dropout_replays_its_rng_and_is_unbiased():
    query, key, value = random_qkv(9, (), 4, 5, 2, 1, 3, 3, np.float32)
    rng = jax.random.PRNGKey(3)
    rate = 0.5
    out = dot_product_attention(query, key, value, dropout_rate=rate, dropout_rng=rng)
    _, weights = ref.attention(query, key, value)
    keep = np.asarray(jax.random.bernoulli(rng, 1 - rate, weights.shape))
    dropped = np.where(keep, weights / (1 - rate), 0.0)  # (N, T, S)
    want = np.einsum("nts,sh->tnh", dropped, value[:, 0, :])
    np.testing.assert_allclose(out, want, atol=1e-5)

    keys = jax.random.split(jax.random.PRNGKey(4), 4000)
    many = jax.vmap(lambda r: dot_product_attention(query, key, value, dropout_rate=rate, dropout_rng=r))(
        keys
    )
    plain = dot_product_attention(query, key, value)
    np.testing.assert_allclose(many.mean(axis=0), plain, atol=0.06)
    assert not np.allclose(many[0], plain, atol=1e-3)


@pytest.mark.reliability(
    "Attention inputs",
    "fully masked query rows and a -inf bias, in float32, bfloat16 and float16",
    "zero output and zero weights for those rows, finite gradients (PyTorch gives nan on some paths)",
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_fully_masked_rows_and_neg_inf_bias_are_finite(dtype):
    query, key, value = (jnp.asarray(x, dtype) for x in random_qkv(10, (2,), 4, 5, 2, 1, 4, 4))
    mask = np.ones((2, 1, 4, 5), bool)
    mask[0, :, 2, :] = False  # fully masked row
    bias = np.zeros((2, 1, 4, 5), np.float32)
    bias[1, :, 3, :] = -np.inf  # fully -inf row
    bias[1, :, 0, 1] = -np.inf  # one forbidden key

    def loss(q, k, v):
        out = dot_product_attention(q, k, v, mask=mask, bias=bias)
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    (value_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(query, key, value)
    assert out.dtype == dtype
    assert np.isfinite(np.asarray(out, np.float32)).all()
    for g in grads:
        assert np.isfinite(np.asarray(g, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(out[0, 2], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(out[1, 3], np.float32), 0.0)
    _, weights = dot_product_attention(query, key, value, mask=mask, bias=bias, return_weights=True)
    assert_attention_weights(weights, mask & (bias > -np.inf))


@pytest.mark.reliability(
    "Attention inputs",
    "bfloat16/float16 inputs with logits in the hundreds",
    "softmax in float32: finite outputs and gradients, equal to float32 within the dtype's tolerance",
)
@pytest.mark.parametrize("dtype,tolerance", [(jnp.bfloat16, 3e-2), (jnp.float16, 5e-3)])
def test_low_precision_large_logits_match_float32(dtype, tolerance):
    query, key, value = random_qkv(11, (2,), 6, 6, 2, 2, 8, 8, np.float32)
    query = query * 30.0  # logits in the hundreds: overflow in fp16 if not upcast
    low = [jnp.asarray(x, dtype) for x in (query, key, value)]
    out = dot_product_attention(*low, is_causal=True)
    want = dot_product_attention(*(np.asarray(x, np.float32) for x in low), is_causal=True)
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=tolerance * 4, rtol=tolerance)
    grads = jax.grad(lambda q: jnp.sum(dot_product_attention(q, *low[1:], is_causal=True)))(low[0])
    assert np.isfinite(np.asarray(grads, np.float32)).all()


@pytest.mark.reliability(
    "Attention inputs",
    "nan/inf in keys and values at masked-out positions (padding, causal future)",
    "output and gradients stay finite; a non-finite value at an allowed position still gives nan",
)
def test_non_finite_masked_keys_and_values_do_not_leak():
    query, key, value = random_qkv(12, (), 3, 4, 1, 1, 4, 4, np.float32)
    key[3] = np.nan
    value[3] = np.inf
    value[2, 0, 1] = np.nan
    mask = np.array([True, True, False, False])  # keys 2, 3 masked for every query
    out = dot_product_attention(query, key, value, mask=mask)
    want = dot_product_attention(query[:, :, :], key[:2], value[:2])
    np.testing.assert_allclose(out, want, atol=1e-6)
    grads = jax.grad(lambda q, k, v: dot_product_attention(q, k, v, mask=mask).sum(), (0, 1, 2))(
        query, key, value
    )
    for g in grads:
        assert np.isfinite(np.asarray(g)[:2]).all()
    # Causal: a NaN key and an inf value at the last position poison only the last query.
    query, key, value = random_qkv(12, (), 4, 4, 1, 1, 4, 4, np.float32)
    key[3], value[3] = np.nan, np.inf
    causal_out = np.asarray(dot_product_attention(query, key, value, is_causal=True))
    assert np.isfinite(causal_out[:3]).all()
    assert np.isnan(causal_out[3]).all()


def test_vmap_jit_and_no_retrace():
    import chex

    query, key, value = random_qkv(13, (3,), 4, 5, 4, 2, 4, 2, np.float32)
    batched = dot_product_attention(query, key, value, is_causal=True)
    mapped = jax.vmap(lambda q, k, v: dot_product_attention(q, k, v, is_causal=True))(query, key, value)
    np.testing.assert_allclose(mapped, batched, atol=1e-6)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def attend(q, k, v):
        return dot_product_attention(q, k, v, is_causal=True)

    np.testing.assert_allclose(attend(query, key, value), batched, atol=1e-6)
    attend(query + 1.0, key, value)  # same shapes: must not trace again


def call_case(name, override, message):
    mark = pytest.mark.reliability("Attention inputs", CASES[name], f"`ValueError`/`TypeError`: {message!r}")
    return pytest.param(name, override, message, marks=mark, id=name)


CASES = {
    "rank": "query of rank < 3",
    "batch": "batch dims that differ",
    "length": "key and value lengths that differ",
    "depth": "query and key depths that differ",
    "kv heads": "kv heads not dividing query heads",
    "mask shape": "boolean mask of a shape that does not broadcast",
    "float mask": "float mask where a boolean one is expected",
    "bias shape": "bias of a shape that does not broadcast",
    "dropout rate": "dropout rate outside [0, 1)",
    "dropout rng": "dropout without an rng",
    "integer input": "integer query/key/value",
    "causal mask conflict": "a mask whose query/key lengths conflict with is_causal",
}

BAD_CALLS = [
    call_case("rank", dict(query=np.ones((4, 8))), "rank >= 3"),
    call_case("batch", dict(key=np.ones((3, 5, 2, 4))), "batch dims differ"),
    call_case("length", dict(value=np.ones((2, 6, 2, 4))), "agree in length"),
    call_case("depth", dict(key=np.ones((2, 5, 2, 3))), "query depth 4 != key depth 3"),
    call_case("kv heads", dict(key=np.ones((2, 5, 3, 4)), value=np.ones((2, 5, 3, 4))), "K=3 must divide"),
    call_case("mask shape", dict(mask=np.ones((2, 4, 4), bool)), "mask of shape (2, 4, 4)"),
    call_case("float mask", dict(mask=np.ones((4, 5), np.float32)), "mask must be boolean"),
    call_case("bias shape", dict(bias=np.ones((7, 5))), "bias of shape (7, 5)"),
    call_case("dropout rate", dict(dropout_rate=1.0), "dropout_rate must be in [0, 1)"),
    call_case("dropout rng", dict(dropout_rate=0.1), "needs a dropout_rng"),
    call_case("integer input", dict(query=np.ones((2, 4, 4, 4), np.int32)), "floating point"),
    call_case(
        "causal mask conflict", dict(mask=np.ones((5, 5), bool), is_causal=True), "mask of shape (5, 5)"
    ),
]


@pytest.mark.parametrize("name,override,message", BAD_CALLS)
def test_bad_arguments_raise_clear_errors(name, override, message):
    args = dict(
        query=np.ones((2, 4, 4, 4), np.float32),
        key=np.ones((2, 5, 2, 4), np.float32),
        value=np.ones((2, 5, 2, 4), np.float32),
    )
    args.update(override)
    with pytest.raises((ValueError, TypeError)) as info:
        dot_product_attention(**args)
    assert message in str(info.value)


@pytest.mark.reliability(
    "Attention inputs",
    "mask helpers given bad sizes, lengths, dtypes or shapes",
    "`ValueError`/`TypeError` naming the value",
)
@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: causal_mask(0), "T must be a positive int"),
        (lambda: causal_mask(3, -1), "S must be a positive int"),
        (lambda: padding_mask(np.array([5]), 4), "lengths must lie in [0, max_len=4]"),
        (lambda: padding_mask(np.array([1.5]), 4), "lengths must be integers"),
        (lambda: combine_masks(np.ones(3), None), "masks must be boolean"),
        (lambda: combine_masks(np.ones(3, bool), np.ones(4, bool)), "do not broadcast"),
    ],
)
def test_mask_helpers_reject_bad_input(call, message):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert message in str(info.value)
