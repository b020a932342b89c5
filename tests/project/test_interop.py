"""qkv_jax modules next to flax: linen parameters both ways, flax.nnx's attention parameters
into the linen modules and back (`qkv_jax.nnx`), and the linen modules in NNX through the bridge."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qkv_jax
from qkv_jax.nnx import MultiHeadAttention as NnxMultiHeadAttention
from qkv_jax.nnx import linen_to_nnx, nnx_to_linen

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


def test_flax_nnx_attention_parameters_load_into_the_linen_modules_and_back():
    """flax.nnx.MultiHeadAttention keeps its parameters under the linen names: `nnx_to_linen`
    reads them for flax's and qkv_jax's linen modules, and `linen_to_nnx` loads them into
    qkv_jax.nnx's module; all four give one output."""
    theirs = nnx.MultiHeadAttention(4, 16, out_features=12, decode=False, rngs=nnx.Rngs(3))
    variables = nnx_to_linen(theirs)
    ours = linen_to_nnx(
        variables, NnxMultiHeadAttention(4, 16, out_features=12, decode=False, rngs=nnx.Rngs(4))
    )
    want = theirs(X, mask=MASK)
    for output in (
        ours(X, mask=MASK),
        qkv_jax.MultiHeadAttention(num_heads=4, out_features=12).apply(variables, X, mask=MASK),
        nn.MultiHeadDotProductAttention(num_heads=4, out_features=12).apply(variables, X, mask=MASK),
    ):
        np.testing.assert_allclose(output, want, atol=1e-6, rtol=0)


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
