"""Seed 002 ('The cat sat on the mat') reproduced from the checked reference numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qkv_jax

ATOL = 1e-5  # the fixture holds 6-decimal values


@pytest.fixture(scope="module")
def walkthrough(seed002):
    X = jnp.asarray(seed002["X"], jnp.float32)
    v1_params = {name: jnp.asarray(w, jnp.float32) for name, w in seed002["v1_weights_d_in_by_d_out"].items()}
    v2_params = {  # torch.nn.Linear stores [d_out, d_in]; nn.Dense wants [d_in, d_out]
        name: {"kernel": jnp.asarray(w, jnp.float32).T}
        for name, w in seed002["v2_weights_d_out_by_d_in"].items()
    }
    return X, {"params": v1_params}, {"params": v2_params}


def test_walkthrough_for_sat(seed002, walkthrough):
    X, v1, _ = walkthrough
    expected = seed002["walkthrough_for_sat"]
    sat = 2
    W = v1["params"]
    # Step 1: project (x_sat @ W).
    np.testing.assert_allclose(X[sat] @ W["W_query"], expected["query_sat"], atol=ATOL)
    np.testing.assert_allclose(X[sat] @ W["W_key"], expected["key_sat"], atol=ATOL)
    np.testing.assert_allclose(X[sat] @ W["W_value"], expected["value_sat"], atol=ATOL)
    # Steps 3-5 through the module: attention weights (scaled by sqrt(d_k)) and context.
    output, weights = qkv_jax.SelfAttentionV1(2).apply(v1, X, return_weights=True)
    np.testing.assert_allclose(weights[sat], expected["weights_scaled_by_sqrt_dk"], atol=ATOL)
    np.testing.assert_allclose(output[sat], expected["context"], atol=ATOL)
    # Step 3's raw scores: with scale=1 the log-weights are the scores up to a constant.
    _, unscaled = qkv_jax.SelfAttentionV1(2, scale=1.0).apply(v1, X, return_weights=True)
    log_weights = np.log(np.asarray(unscaled[sat], np.float64))
    scores = np.asarray(expected["scores"])
    np.testing.assert_allclose(log_weights - log_weights[0], scores - scores[0], atol=ATOL)
    qkv_jax.checks.assert_attention_weights(weights)


def test_v1_outputs(seed002, walkthrough):
    X, v1, _ = walkthrough
    out = qkv_jax.SelfAttentionV1(2).apply(v1, X)
    np.testing.assert_allclose(out, seed002["v1_outputs"], atol=ATOL)


def test_v2_outputs(seed002, walkthrough):
    X, _, v2 = walkthrough
    out = qkv_jax.SelfAttention(2).apply(v2, X)
    np.testing.assert_allclose(out, seed002["v2_outputs"], atol=ATOL)


def test_exercise_3_1_v2_weights_transposed_into_v1(walkthrough):
    X, _, v2 = walkthrough
    v1_from_v2 = {"params": {name: p["kernel"] for name, p in v2["params"].items()}}
    np.testing.assert_allclose(
        qkv_jax.SelfAttentionV1(2).apply(v1_from_v2, X),
        qkv_jax.SelfAttention(2).apply(v2, X),
        atol=1e-6,
    )


def count_parameters(module, input_shape):
    shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), jnp.zeros(input_shape))
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes))


def test_parameter_counts(seed002):
    counts = seed002["parameter_counts"]
    assert count_parameters(qkv_jax.SelfAttentionV1(2), (6, 3)) == counts["v1_or_v2_d_in_3_d_out_2"]
    assert count_parameters(qkv_jax.SelfAttention(2), (6, 3)) == counts["v1_or_v2_d_in_3_d_out_2"]
    assert (
        count_parameters(qkv_jax.MultiHeadAttention(num_heads=2), (5, 8))
        == counts["multihead_embed_8_heads_2_with_biases_and_output_projection"]
    )
    assert count_parameters(qkv_jax.SelfAttention(768), (4, 768)) == counts["v2_d_in_768_d_out_768_no_bias"]


def test_static_attention_is_v1_with_identity_weights(walkthrough):
    """Seed 002: set W_q = W_k = W_v = I and part 7 becomes part 6."""
    X, _, _ = walkthrough
    identity = jnp.eye(3)
    v1 = {"params": {"W_query": identity, "W_key": identity, "W_value": identity}}
    np.testing.assert_allclose(
        qkv_jax.StaticAttention().apply({}, X),
        qkv_jax.SelfAttentionV1(3).apply(v1, X),
        atol=1e-6,
    )
    # Part 6 itself is unscaled: softmax(X X^T) X.
    want = jax.nn.softmax(X @ X.T, axis=-1) @ X
    np.testing.assert_allclose(qkv_jax.StaticAttention(scale=1.0).apply({}, X), want, atol=1e-6)
