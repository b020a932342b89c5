"""qkv_jax modules next to flax: linen parameters both ways, and Flax NNX through the bridge."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qkv_jax

X = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 16))
MASK = qkv_jax.combine_masks(qkv_jax.causal_mask(6), qkv_jax.padding_mask(jnp.array([6, 4]), 6))


@pytest.mark.parametrize("use_bias", [True, False])
def test_flax_multihead_parameters_load_both_ways(use_bias):
    ours = qkv_jax.MultiHeadAttention(num_heads=4, use_bias=use_bias, out_features=12)
    theirs = nn.MultiHeadDotProductAttention(num_heads=4, use_bias=use_bias, out_features=12)
    from_flax = theirs.init(jax.random.PRNGKey(1), X)
    np.testing.assert_allclose(
        ours.apply(from_flax, X, mask=MASK), theirs.apply(from_flax, X, mask=MASK), atol=1e-6
    )
    from_ours = ours.init(jax.random.PRNGKey(2), X)
    assert jax.tree.structure(from_ours) == jax.tree.structure(from_flax)
    np.testing.assert_allclose(
        theirs.apply(from_ours, X, mask=MASK), ours.apply(from_ours, X, mask=MASK), atol=1e-6
    )


MODULES = [
    qkv_jax.StaticAttention(is_causal=True),
    qkv_jax.SelfAttentionV1(8),
    qkv_jax.SelfAttention(8, qkv_bias=True),
    qkv_jax.MultiHeadAttention(num_heads=4, num_kv_heads=2, is_causal=True),
    qkv_jax.LearnedQueryAttention(d_k=4, d_v=6),
]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: type(m).__name__)
def test_nnx_bridge_gives_the_linen_outputs(module):
    wrapped = nnx.bridge.ToNNX(module, rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(wrapped, X)
    through_nnx = wrapped(X)
    params = nnx.state(wrapped, nnx.Param)
    variables = {"params": jax.tree.map(lambda v: v, nnx.to_pure_dict(params))} if params else {}
    through_linen = module.apply(variables, X)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), through_nnx, through_linen)
    # The same numbers under nnx.jit.
    jitted = nnx.jit(lambda m, x: m(x))(wrapped, X)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), jitted, through_linen)
