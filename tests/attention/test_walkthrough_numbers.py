"""A six-token self-attention walkthrough ('The cat sat on the mat') reproduced from its reference numbers
(tests/data/cat_sat_mat_walkthrough.json): fixed weights in, every intermediate and output compared."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qkv_jax

ATOL = 1e-5  # the fixture holds 6-decimal values


@pytest.fixture(scope="module")
def x_and_params(walkthrough):
    X = jnp.asarray(walkthrough["X"], jnp.float32)
    v1_params = {
        name: jnp.asarray(w, jnp.float32) for name, w in walkthrough["v1_weights_d_in_by_d_out"].items()
    }
    v2_params = {  # torch.nn.Linear stores [d_out, d_in]; nn.Dense wants [d_in, d_out]
        name: {"kernel": jnp.asarray(w, jnp.float32).T}
        for name, w in walkthrough["v2_weights_d_out_by_d_in"].items()
    }
    return X, {"params": v1_params}, {"params": v2_params}


def test_walkthrough_for_sat(walkthrough, x_and_params):
    X, v1, _ = x_and_params
    expected = walkthrough["walkthrough_for_sat"]
    sat = 2
    W = v1["params"]
    # The projections of 'sat' (x_sat @ W).
    np.testing.assert_allclose(X[sat] @ W["W_query"], expected["query_sat"], atol=ATOL)
    np.testing.assert_allclose(X[sat] @ W["W_key"], expected["key_sat"], atol=ATOL)
    np.testing.assert_allclose(X[sat] @ W["W_value"], expected["value_sat"], atol=ATOL)
    # Through the module: attention weights (scores scaled by sqrt(d_k), softmaxed) and context.
    output, weights = qkv_jax.SelfAttentionV1(2).apply(v1, X, return_weights=True)
    np.testing.assert_allclose(weights[sat], expected["weights_scaled_by_sqrt_dk"], atol=ATOL)
    np.testing.assert_allclose(output[sat], expected["context"], atol=ATOL)
    # The raw scores: with scale=1 the log-weights are the scores up to a constant.
    _, unscaled = qkv_jax.SelfAttentionV1(2, scale=1.0).apply(v1, X, return_weights=True)
    log_weights = np.log(np.asarray(unscaled[sat], np.float64))
    scores = np.asarray(expected["scores"])
    np.testing.assert_allclose(log_weights - log_weights[0], scores - scores[0], atol=ATOL)
    qkv_jax.checks.assert_attention_weights(weights)


def test_v1_outputs(walkthrough, x_and_params):
    X, v1, _ = x_and_params
    out = qkv_jax.SelfAttentionV1(2).apply(v1, X)
    np.testing.assert_allclose(out, walkthrough["v1_outputs"], atol=ATOL)


def test_v2_outputs(walkthrough, x_and_params):
    X, _, v2 = x_and_params
    out = qkv_jax.SelfAttention(2).apply(v2, X)
    np.testing.assert_allclose(out, walkthrough["v2_outputs"], atol=ATOL)


def test_v2_weights_transposed_into_v1(x_and_params):
    X, _, v2 = x_and_params
    v1_from_v2 = {"params": {name: p["kernel"] for name, p in v2["params"].items()}}
    np.testing.assert_allclose(
        qkv_jax.SelfAttentionV1(2).apply(v1_from_v2, X),
        qkv_jax.SelfAttention(2).apply(v2, X),
        atol=1e-6,
    )


def count_parameters(module, input_shape):
    shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), jnp.zeros(input_shape))
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes))


def test_parameter_counts(walkthrough):
    counts = walkthrough["parameter_counts"]
    assert count_parameters(qkv_jax.SelfAttentionV1(2), (6, 3)) == counts["v1_or_v2_d_in_3_d_out_2"]
    assert count_parameters(qkv_jax.SelfAttention(2), (6, 3)) == counts["v1_or_v2_d_in_3_d_out_2"]
    assert (
        count_parameters(qkv_jax.MultiHeadAttention(num_heads=2), (5, 8))
        == counts["multihead_embed_8_heads_2_with_biases_and_output_projection"]
    )
    assert count_parameters(qkv_jax.SelfAttention(768), (4, 768)) == counts["v2_d_in_768_d_out_768_no_bias"]


def test_static_attention_is_v1_with_identity_weights(x_and_params):
    """With W_q = W_k = W_v = I, learned self-attention is static attention."""
    X, _, _ = x_and_params
    identity = jnp.eye(3)
    v1 = {"params": {"W_query": identity, "W_key": identity, "W_value": identity}}
    np.testing.assert_allclose(
        qkv_jax.StaticAttention().apply({}, X),
        qkv_jax.SelfAttentionV1(3).apply(v1, X),
        atol=1e-6,
    )
    # Static attention without the scale: softmax(X X^T) X.
    want = jax.nn.softmax(X @ X.T, axis=-1) @ X
    np.testing.assert_allclose(qkv_jax.StaticAttention(scale=1.0).apply({}, X), want, atol=1e-6)
