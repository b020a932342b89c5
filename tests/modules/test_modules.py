"""The Flax modules: shapes, batching, parameter layout, sown weights, errors."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest

import qkv_jax
from qkv_jax.checks import assert_attention_weights

B, S, D = 3, 5, 8
X = jax.random.normal(jax.random.PRNGKey(0), (B, S, D))

MODULES = {
    "static": qkv_jax.StaticAttention(),
    "v1": qkv_jax.SelfAttentionV1(4),
    "v2": qkv_jax.SelfAttention(4, qkv_bias=True),
    "mha": qkv_jax.MultiHeadAttention(num_heads=4, is_causal=True),
    "gqa": qkv_jax.MultiHeadAttention(num_heads=4, num_kv_heads=2, head_dim=3, v_head_dim=5),
    "learned_query": qkv_jax.LearnedQueryAttention(d_k=4, d_v=6),
}


@pytest.fixture(scope="module", params=sorted(MODULES))
def module_and_params(request):
    module = MODULES[request.param]
    return request.param, module, module.init(jax.random.PRNGKey(1), X)


def test_unbatched_vmap_and_batched_agree(module_and_params):
    name, module, params = module_and_params
    apply = jax.jit(module.apply)
    batched = apply(params, X)
    mapped = jax.vmap(apply, in_axes=(None, 0))(params, X)
    unbatched = apply(params, X[1])
    chex.assert_trees_all_close(mapped, batched, atol=1e-6)
    chex.assert_trees_all_close(unbatched, jax.tree.map(lambda x: x[1], batched), atol=1e-6)
    # Two leading batch dims work too.
    nested = apply(params, X.reshape(1, B, S, D))
    chex.assert_trees_all_close(jax.tree.map(lambda x: x[0], nested), batched, atol=1e-6)


def test_output_shapes(module_and_params):
    name, module, params = module_and_params
    out = module.apply(params, X)
    expected = {
        "static": (B, S, D),
        "v1": (B, S, 4),
        "v2": (B, S, 4),
        "mha": (B, S, D),
        "gqa": (B, S, D),
    }
    if name == "learned_query":
        output, weights = out
        chex.assert_shape(output, (B, 6))
        chex.assert_shape(weights, (B, S))
        assert_attention_weights(weights)
    else:
        chex.assert_shape(out, expected[name])


def test_multihead_matches_independent_reference():
    """MHA = per-head attention on the projected inputs, concatenated, then W_O."""
    module = MODULES["gqa"]
    params = module.init(jax.random.PRNGKey(2), X)["params"]
    p = jax.tree.map(np.asarray, params)
    x = np.asarray(X, np.float64)
    query = np.einsum("bsd,dnh->bsnh", x, p["query"]["kernel"]) + p["query"]["bias"]
    key = np.einsum("bsd,dkh->bskh", x, p["key"]["kernel"]) + p["key"]["bias"]
    value = np.einsum("bsd,dkh->bskh", x, p["value"]["kernel"]) + p["value"]["bias"]
    heads, _ = ref.attention(query, key, value)  # (B, S, N, Hv)
    want = np.einsum("bsnh,nho->bso", heads, p["out"]["kernel"]) + p["out"]["bias"]
    got = module.apply({"params": params}, X)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_parameter_layout_matches_flax_multihead():
    ours = qkv_jax.MultiHeadAttention(num_heads=2)
    theirs = nn.MultiHeadDotProductAttention(num_heads=2)
    ours_shapes = jax.tree.map(jnp.shape, ours.init(jax.random.PRNGKey(0), X))
    theirs_shapes = jax.tree.map(jnp.shape, theirs.init(jax.random.PRNGKey(0), X))
    assert ours_shapes == theirs_shapes
    flax_params = theirs.init(jax.random.PRNGKey(3), X)
    mask = qkv_jax.causal_mask(S)
    np.testing.assert_allclose(
        ours.apply(flax_params, X, mask=mask), theirs.apply(flax_params, X, mask=mask), atol=1e-6
    )


def test_sown_attention_weights():
    module = qkv_jax.MultiHeadAttention(num_heads=2, num_kv_heads=1, is_causal=True, sow_weights=True)
    params = module.init(jax.random.PRNGKey(4), X)
    padding = qkv_jax.padding_mask(jnp.array([5, 3, 1]), S)
    _, state = module.apply(params, X, mask=padding, mutable=["intermediates"])
    (weights,) = state["intermediates"]["attention_weights"]
    chex.assert_shape(weights, (B, 2, S, S))
    assert_attention_weights(weights, np.asarray(qkv_jax.combine_masks(padding, qkv_jax.causal_mask(S))))
    single = qkv_jax.SelfAttention(4, is_causal=True, sow_weights=True)
    _, state = single.apply(single.init(jax.random.PRNGKey(5), X), X, mutable=["intermediates"])
    (weights,) = state["intermediates"]["attention_weights"]
    chex.assert_shape(weights, (B, 1, S, S))  # a head axis, like MultiHeadAttention's
    assert_attention_weights(weights, np.asarray(qkv_jax.causal_mask(S)))


def test_attention_dropout_in_modules():
    module = qkv_jax.MultiHeadAttention(num_heads=2, dropout_rate=0.5)
    params = module.init(jax.random.PRNGKey(6), X, deterministic=True)
    with pytest.raises(ValueError, match='"deterministic" must be passed to the constructor or at call time'):
        module.apply(params, X)  # flax's rule: with dropout, deterministic is needed
    eval_out = module.apply(params, X, deterministic=True)  # no rng needed
    train_a = module.apply(params, X, deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)})
    train_b = module.apply(params, X, deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)})
    train_c = module.apply(params, X, deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)})
    np.testing.assert_array_equal(train_a, train_b)
    assert not np.allclose(train_a, eval_out, atol=1e-3)
    assert not np.allclose(train_a, train_c, atol=1e-3)


def test_learned_query_mask_and_dtype():
    module = qkv_jax.LearnedQueryAttention(d_k=4, d_v=3, dtype=jnp.bfloat16)
    params = module.init(jax.random.PRNGKey(7), X)
    key_mask = np.array([True, False, True, False, False])
    output, weights = module.apply(params, X, mask=key_mask)
    assert output.dtype == jnp.bfloat16
    assert_attention_weights(weights, np.broadcast_to(key_mask, (B, S)))


def test_low_precision_multihead():
    module = qkv_jax.MultiHeadAttention(num_heads=2, dtype=jnp.bfloat16, is_causal=True)
    params = module.init(jax.random.PRNGKey(8), X)
    out = module.apply(params, X.astype(jnp.bfloat16))
    want = qkv_jax.MultiHeadAttention(num_heads=2, is_causal=True).apply(params, X)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=5e-2, rtol=5e-2)


@pytest.mark.reliability(
    "Modules",
    "module attributes a user can get wrong (kv heads not dividing heads, non-positive sizes, dropout rate)",
    "`ValueError` naming the values, at construction",
)
@pytest.mark.parametrize(
    "build,message",
    [
        (
            lambda: qkv_jax.MultiHeadAttention(num_heads=4, num_kv_heads=3),
            "num_kv_heads=3 must divide num_heads=4",
        ),
        (lambda: qkv_jax.MultiHeadAttention(num_heads=0), "num_heads=0 must be a positive int"),
        (
            lambda: qkv_jax.MultiHeadAttention(num_heads=2, head_dim=-1),
            "head_dim=-1 must be a positive int",
        ),
        (
            lambda: qkv_jax.MultiHeadAttention(num_heads=2, dropout_rate=1.5),
            "dropout_rate=1.5 must be in [0, 1)",
        ),
        (lambda: qkv_jax.SelfAttentionV1(0), "d_out=0 must be a positive int"),
        (lambda: qkv_jax.SelfAttention(-2), "d_out=-2 must be a positive int"),
        (lambda: qkv_jax.LearnedQueryAttention(d_k=0, d_v=3), "d_k=0 must be a positive int"),
        (lambda: qkv_jax.StaticAttention(dropout_rate=-0.1), "dropout_rate=-0.1 must be in [0, 1)"),
        (
            lambda: qkv_jax.MultiHeadAttention(num_heads=4, qkv_features=12, head_dim=4),
            "qkv_features=12 != num_heads=4 * head_dim=4",
        ),
        (
            lambda: qkv_jax.MultiHeadAttention(num_heads=4, qkv_features=10),
            "num_heads=4 does not divide qkv_features=10",
        ),
        (
            lambda: qkv_jax.MultiHeadAttention(num_heads=2, kv_latent_dim=3, normalize_qk=True),
            "normalize_qk=True with kv_latent_dim=3 needs absorb_latent=False",
        ),
        (
            lambda: qkv_jax.MultiHeadAttention(num_heads=2, scale=1.0, attention_fn=nn.dot_product_attention),
            "attention_fn=dot_product_attention takes no `scale` argument",
        ),
        (
            lambda: qkv_jax.MultiHeadAttention(num_heads=2, qk_attn_weights_einsum_cls=lambda: jnp.einsum),
            "takes no `qk_attn_weights_einsum` argument",
        ),
    ],
)
def test_bad_module_arguments(build, message):
    with pytest.raises(ValueError) as info:
        build()
    assert message in str(info.value)


@pytest.mark.reliability(
    "Modules",
    "call arguments a user can get wrong (heads not dividing the width, mask shape, "
    "mask against is_causal, batch mismatch, rank, float mask)",
    "`ValueError`/`TypeError` naming the shapes",
)
@pytest.mark.parametrize(
    "call,message",
    [
        (
            lambda: qkv_jax.MultiHeadAttention(num_heads=3).init(jax.random.PRNGKey(0), X),
            "num_heads=3 does not divide the input width 8",
        ),
        (
            lambda: qkv_jax.MultiHeadAttention(num_heads=2).init(
                jax.random.PRNGKey(0), X, mask=np.ones((4, 4), bool)
            ),
            "mask of shape (4, 4) does not broadcast",
        ),
        (
            lambda: qkv_jax.MultiHeadAttention(num_heads=2, is_causal=True).init(
                jax.random.PRNGKey(0), X, mask=np.ones((B, 1, 1, S + 1), bool)
            ),
            "mask of shape (3, 1, 1, 6)",
        ),
        (
            lambda: qkv_jax.MultiHeadAttention(num_heads=2).init(jax.random.PRNGKey(0), X, X[:2]),
            "batch dims differ",
        ),
        (
            lambda: qkv_jax.SelfAttention(2).init(jax.random.PRNGKey(0), X[0, 0]),
            "inputs must have shape [batch..., length, features], got (8,)",
        ),
        (
            lambda: qkv_jax.SelfAttention(2).init(jax.random.PRNGKey(0), X, mask=np.ones((S, S))),
            "mask must be boolean",
        ),
        (
            lambda: qkv_jax.MultiHeadAttention(num_heads=2).init(
                jax.random.PRNGKey(0), X, X, np.ones((S, S), bool)
            ),
            "the third positional argument is inputs_v, as in flax, and got a boolean array of shape (5, 5); "
            "pass mask=...",
        ),
    ],
)
def test_bad_call_arguments(call, message):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert message in str(info.value)


@pytest.mark.slow
def test_causal_cross_attention_is_top_left_and_any_attention_fn_sees_the_same_mask():
    """is_causal with T != S: query t sees keys 0..t (jax.nn's alignment). flax's own
    attention function as `attention_fn` gets the triangle (and, decoding, the cache's
    visibility) as an explicit mask and gives the same outputs."""
    memory = jax.random.normal(jax.random.PRNGKey(9), (B, S + 2, D))
    module = qkv_jax.MultiHeadAttention(num_heads=2, is_causal=True, sow_weights=True)
    params = module.init(jax.random.PRNGKey(10), X, memory)
    output, state = module.apply(params, X, memory, mutable=["intermediates"])
    (weights,) = state["intermediates"]["attention_weights"]
    top_left = np.arange(S + 2)[None, :] <= np.arange(S)[:, None]  # (T, S + 2)
    assert_attention_weights(weights, np.broadcast_to(top_left, weights.shape))
    theirs = module.clone(attention_fn=nn.dot_product_attention)
    np.testing.assert_allclose(theirs.apply(params, X, memory), output, atol=1e-6)
    outputs = []
    for variant in (module, theirs):
        variant = variant.clone(decode=True, sow_weights=False)
        cache = variant.init(jax.random.PRNGKey(10), X)["cache"]
        first, state = variant.apply({**params, "cache": cache}, X[:, :3], mutable=["cache"])
        second, _ = variant.apply({**params, "cache": state["cache"]}, X[:, 3:], mutable=["cache"])
        outputs.append(jnp.concatenate([first, second], axis=1))
    np.testing.assert_allclose(outputs[1], outputs[0], atol=1e-6)
    np.testing.assert_allclose(outputs[0], module.clone(sow_weights=False).apply(params, X), atol=1e-5)


class TestAssertAttentionWeights:
    def test_accepts_valid_weights(self):
        weights = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(0), (2, 4, 4)), axis=-1)
        assert_attention_weights(weights)

    @pytest.mark.parametrize(
        "weights,mask,message",
        [
            (np.full((2, 3), 0.5, np.float32), None, "sums to 1.5"),
            (np.array([[1.0, np.nan]], np.float32), None, "finite"),
            (np.array([[1.2, -0.2]], np.float32), None, "negative"),
            (np.array([[0.5, 0.5]], np.float32), np.array([[True, False]]), "where the mask forbids"),
            (np.array([[0.0, 0.0]], np.float32), np.array([[True, True]]), "sums to 0"),
            (np.array([[0.0, 1.0]], np.float32), np.array([[False, False]]), "where the mask forbids"),
        ],
    )
    def test_rejects_invalid_weights(self, weights, mask, message):
        with pytest.raises(AssertionError) as info:
            assert_attention_weights(weights, mask)
        assert message in str(info.value)

    def test_fully_masked_rows_must_be_zero(self):
        mask = np.array([[True, True], [False, False]])
        assert_attention_weights(np.array([[0.25, 0.75], [0.0, 0.0]], np.float32), mask)

    def test_tolerance_by_dtype(self):
        slightly_off = np.array([[0.5, 0.508]])
        assert_attention_weights(jnp.asarray(slightly_off, jnp.bfloat16))
        with pytest.raises(AssertionError):
            assert_attention_weights(slightly_off.astype(np.float32))
