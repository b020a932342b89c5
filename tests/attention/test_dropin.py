"""qkv_jax's attention modules in place of flax's, by changing the import only.

One small model per API is written once against a namespace `lib`: `flax.linen` or
`qkv_jax` for linen (`lib.MultiHeadDotProductAttention` and `lib.MultiHeadAttention` exist
in both), `flax.nnx` or `qkv_jax.nnx` for nnx (`lib.MultiHeadAttention`). With the same
random keys both give the same parameter trees and, in float32 within 1e-6, the same
outputs: with masks (flax's float masks from its helpers), cross-attention, dropout (the
same key drops the same weights: qkv_jax draws flax's Bernoulli mask, so the outputs
match exactly, broadcast over batch and heads or not), sown weights, gradients, and
decoding with the cache.
"""

import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qkv_jax
import qkv_jax.nnx

B, T, S, D = 2, 5, 7, 8
KEYS = jax.random.split(jax.random.PRNGKey(0), 4)
X = jax.random.normal(KEYS[0], (B, T, D))
MEMORY = jax.random.normal(KEYS[1], (B, S, 6))
LENGTHS = jnp.array([S, 4])
# flax's helpers: float32 masks, [B, 1, T, S] and [B, 1, T, T].
PADDING = nn.make_attention_mask(jnp.ones((B, T)), jnp.arange(S)[None, :] < LENGTHS[:, None])
CAUSAL = nn.make_causal_mask(jnp.ones((B, T)))

LINEN = {"flax": nn, "qkv_jax": qkv_jax}
NNX = {"flax": nnx, "qkv_jax": qkv_jax.nnx}


def assert_trees_close(a, b, atol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=atol, rtol=0), a, b)


# --------------------------------------------------------------------------------- linen


class Encoder(nn.Module):
    """A linen model written against `lib`: self-attention (flax's default name, so
    `MultiHeadDotProductAttention_0`), cross-attention through `lib.MultiHeadAttention`
    (`MultiHeadAttention_0`), then a Dense head."""

    lib: types.ModuleType
    broadcast_dropout: bool = True
    normalize_qk: bool = False

    @nn.compact
    def __call__(self, x, memory, *, train: bool, sow: bool = False):
        h = nn.Dense(D)(x)
        h = h + self.lib.MultiHeadDotProductAttention(
            num_heads=2,
            dropout_rate=0.3,
            broadcast_dropout=self.broadcast_dropout,
            normalize_qk=self.normalize_qk,
        )(h, mask=CAUSAL, deterministic=not train, sow_weights=sow)
        h = h + self.lib.MultiHeadAttention(num_heads=4, qkv_features=12, out_features=D)(
            h, memory, mask=PADDING
        )
        return nn.Dense(3)(h)


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "normalize_qk"])
def linen_pair(request):
    """(flax model, qkv_jax model, flax's variables)."""
    flax_model, ours = (Encoder(LINEN[name], normalize_qk=request.param) for name in ("flax", "qkv_jax"))
    return flax_model, ours, flax_model.init(KEYS[2], X, MEMORY, train=False)


def test_linen_same_parameter_tree(linen_pair):
    flax_model, ours, variables = linen_pair
    assert_trees_close(ours.init(KEYS[2], X, MEMORY, train=False), variables, atol=0)


@pytest.mark.slow
def test_linen_same_outputs_sown_weights_and_gradients(linen_pair):
    flax_model, ours, variables = linen_pair
    results = []
    for model in (flax_model, ours):
        output, state = model.apply(variables, X, MEMORY, train=False, sow=True, mutable=["intermediates"])
        loss = lambda p, m=model: jnp.sum(m.apply({"params": p}, X, MEMORY, train=False) ** 2)  # noqa: E731
        results.append((output, state["intermediates"], jax.jit(jax.grad(loss))(variables["params"])))
    assert_trees_close(results[0][:2], results[1][:2], atol=1e-6)
    for theirs, mine in zip(jax.tree.leaves(results[0][2]), jax.tree.leaves(results[1][2]), strict=True):
        # Float32 sums of many terms: 1e-6 of each gradient's largest entry (up to ~30 here), and
        # 1e-6 for the key bias, whose gradient is zero up to rounding (the softmax cancels it).
        np.testing.assert_allclose(mine, theirs, atol=1e-6 * max(1.0, np.abs(theirs).max()), rtol=0)
    weights = results[1][1]["MultiHeadDotProductAttention_0"]["attention_weights"][0]
    assert weights.shape == (B, 2, T, T) and np.asarray(weights)[..., 0, 1:].max() == 0  # causal


@pytest.mark.parametrize("broadcast_dropout", [True, False])
def test_linen_dropout_draws_flax_mask(linen_pair, broadcast_dropout):
    flax_model, ours, variables = linen_pair
    flax_model, ours = (m.clone(broadcast_dropout=broadcast_dropout) for m in (flax_model, ours))
    outputs = [
        model.apply(variables, X, MEMORY, train=True, rngs={"dropout": KEYS[3]})
        for model in (flax_model, ours)
    ]
    np.testing.assert_allclose(outputs[1], outputs[0], atol=1e-6, rtol=0)
    eval_output = ours.apply(variables, X, MEMORY, train=False)
    assert np.abs(np.asarray(outputs[1] - eval_output)).max() > 1e-2  # dropout did something
    other_key = ours.apply(variables, X, MEMORY, train=True, rngs={"dropout": KEYS[0]})
    assert np.abs(np.asarray(outputs[1] - other_key)).max() > 1e-2


def test_linen_decoding_matches_flax():
    """flax's decode: the attribute, `init` creating the cache, one token per `apply`."""
    variables = None
    outputs, caches = {}, {}
    for name, lib in LINEN.items():
        module = lib.MultiHeadDotProductAttention(num_heads=2, decode=True)
        variables = variables or module.init(KEYS[2], X)
        cache, pieces = variables["cache"], []
        for t in range(T):
            output, state = module.apply(
                {"params": variables["params"], "cache": cache}, X[:, t : t + 1], mutable=["cache"]
            )
            cache = state["cache"]
            pieces.append(output)
        outputs[name], caches[name] = jnp.concatenate(pieces, axis=1), cache
    assert_trees_close(outputs["qkv_jax"], outputs["flax"])
    assert_trees_close(caches["qkv_jax"], caches["flax"])
    assert set(caches["qkv_jax"]) == {"cached_key", "cached_value", "cache_index"}


def test_linen_deterministic_is_merged_as_flax_merges_it():
    """With dropout, `deterministic` must come from the constructor or the call, once."""
    for lib in LINEN.values():
        module = lib.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.5)
        with pytest.raises(ValueError, match='"deterministic" must be passed to the constructor or at call'):
            module.init(KEYS[2], X)
        with pytest.raises(ValueError, match='"deterministic" was passed to the constructor and at call'):
            module.clone(deterministic=True).init(KEYS[2], X, deterministic=True)


# ----------------------------------------------------------------------------------- nnx


class Block(nnx.Module):
    """An nnx model written against `lib`: Linear, then self-attention with dropout."""

    def __init__(self, lib: types.ModuleType, broadcast_dropout: bool, *, rngs: nnx.Rngs):
        self.proj = nnx.Linear(D, D, rngs=rngs)
        self.attention = lib.MultiHeadAttention(
            num_heads=2,
            in_features=D,
            num_kv_heads=1,
            dropout_rate=0.3,
            broadcast_dropout=broadcast_dropout,
            normalize_qk=True,
            decode=False,
            rngs=rngs,
        )

    def __call__(self, x, *, train: bool, sow: bool = False):
        return self.attention(self.proj(x), mask=CAUSAL, deterministic=not train, sow_weights=sow)


def nnx_pair(broadcast_dropout=True):
    return tuple(Block(NNX[n], broadcast_dropout, rngs=nnx.Rngs(0)) for n in ("flax", "qkv_jax"))


def state_tree(model):
    """Every variable of `model` (parameters and the kept dropout stream) as plain arrays."""
    keys_as_data = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x  # noqa: E731
    return jax.tree.map(keys_as_data, nnx.to_pure_dict(nnx.state(model)))


def test_nnx_same_state_outputs_and_sown_weights():
    theirs, ours = nnx_pair()
    assert_trees_close(state_tree(ours), state_tree(theirs), atol=0)
    captured = [
        nnx.capture(lambda m: m(X, train=False, sow=True), nnx.Intermediate)(m) for m in (theirs, ours)
    ]
    assert_trees_close(captured[1], captured[0])
    assert captured[1][1]["attention"]["attention_weights"][0].shape == (B, 2, T, T)


@pytest.mark.parametrize("broadcast_dropout", [True, False])
def test_nnx_dropout_draws_flax_mask(broadcast_dropout):
    theirs, ours = nnx_pair(broadcast_dropout)
    for _ in range(2):  # the kept streams advance alike
        np.testing.assert_allclose(ours(X, train=True), theirs(X, train=True), atol=1e-6, rtol=0)
    assert np.abs(np.asarray(ours(X, train=True) - ours(X, train=False))).max() > 1e-2


def test_nnx_decoding_matches_flax():
    models = {
        name: lib.MultiHeadAttention(
            num_heads=2, in_features=D, num_kv_heads=1, decode=True, rngs=nnx.Rngs(1)
        )
        for name, lib in NNX.items()
    }
    outputs = {}
    for name, model in models.items():
        model.init_cache(X.shape)
        outputs[name] = jnp.concatenate([model(X[:, t : t + 1]) for t in range(T)], axis=1)
    assert_trees_close(outputs["qkv_jax"], outputs["flax"])
    assert_trees_close(
        nnx.to_pure_dict(nnx.state(models["qkv_jax"], nnx.Cache)),
        nnx.to_pure_dict(nnx.state(models["flax"], nnx.Cache)),
    )
