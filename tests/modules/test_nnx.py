"""qkv_jax.nnx: the native flax.nnx modules against their linen twins.

Parameters move both ways (`linen_to_nnx`, `nnx_to_linen`); the nnx model then gives the
linen model's outputs (float32, 1e-6) for MHA, GQA and MLA (with LoRA adapters), in a full
pass and in cached decoding, and the language model generates the same tokens.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qkv_jax
from qkv_jax import lm
from qkv_jax.lora import LoRADenseGeneral
from qkv_jax.nnx import LoRALinearGeneral, MultiHeadAttention, TransformerLM, linen_to_nnx, nnx_to_linen

B, L, D = 2, 6, 8
X = jax.random.normal(jax.random.PRNGKey(0), (B, L, D))
PADDING = jnp.arange(L)[None, None, None, :] < jnp.array([L, 4])[:, None, None, None]  # (B, 1, 1, L)

VARIANTS = {
    "mha": dict(),
    "gqa": dict(num_kv_heads=2),
    "mla_lora": dict(num_kv_heads=2, kv_latent_dim=3, lora_rank=2, lora_targets=("kv_latent", "key", "out")),
}


def noisy(params, seed=1):
    """Every leaf plus noise: biases and LoRA factors that are not zero."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(
        tree, [p + 0.3 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys, strict=True)]
    )


def decode(step, state, inputs, lengths=(3, 1, 2)):
    pieces, start = [], 0
    for length in lengths:
        output, state = step(state, inputs[:, start : start + length])
        pieces.append(output)
        start += length
    return jnp.concatenate(pieces, axis=1), state


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.slow
def test_attention_converts_both_ways_and_decodes_alike(variant):
    fields = dict(num_heads=4, is_causal=True, **VARIANTS[variant])
    linen = qkv_jax.MultiHeadAttention(**fields)
    params = noisy(nnx_to_linen(MultiHeadAttention(in_features=D, rngs=nnx.Rngs(2), **fields))["params"])
    shapes = jax.eval_shape(functools.partial(linen.init, decode=True), jax.random.PRNGKey(2), X)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, shapes["params"])
    model = linen_to_nnx({"params": params}, MultiHeadAttention(in_features=D, rngs=nnx.Rngs(3), **fields))
    full = linen.apply({"params": params}, X, mask=PADDING)
    np.testing.assert_allclose(model(X, mask=PADDING, decode=False), full, atol=1e-6, rtol=0)
    jax.tree.map(np.testing.assert_array_equal, nnx_to_linen(model), {"params": params})

    # Decoding: a 3-token prompt then single tokens, the linen cache and the nnx one.
    model.init_cache(X.shape)
    cache = nnx_to_linen(model)["cache"]
    assert jax.tree.map(jnp.shape, cache) == jax.tree.map(jnp.shape, shapes["cache"])

    def linen_step(cache, inputs):
        output, state = linen.apply(
            {"params": params, "cache": cache}, inputs, mask=PADDING, decode=True, mutable=["cache"]
        )
        return output, state["cache"]

    decoded, cache = decode(linen_step, cache, X)
    nnx_decoded, _ = decode(lambda m, x: (m(x, mask=PADDING, decode=True), m), model, X)
    np.testing.assert_allclose(decoded, full, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(nnx_decoded, decoded, atol=1e-6, rtol=0)
    jax.tree.map(np.testing.assert_array_equal, nnx_to_linen(model)["cache"], cache)


LM_FIELDS = dict(vocab_size=11, num_layers=2, d_model=16, num_heads=4, max_len=10)
TOKENS = jax.random.randint(jax.random.PRNGKey(4), (B, 10), 0, 11)


@pytest.mark.slow
def test_language_model_converts_both_ways_and_decodes_alike():
    """GQA with MLA latents and LoRA adapters on W_Q and W_V: every kind of parameter at once."""
    config = lm.TransformerConfig(**LM_FIELDS, num_kv_heads=2, kv_latent_dim=8, lora_rank=2)
    linen = lm.TransformerLM(config)
    params = noisy(nnx_to_linen(TransformerLM(config, rngs=nnx.Rngs(5)))["params"], seed=6)
    shapes = jax.eval_shape(linen.init, jax.random.PRNGKey(5), TOKENS)["params"]
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, shapes)
    model = linen_to_nnx({"params": params}, TransformerLM(config, rngs=nnx.Rngs(0)))
    full = linen.apply({"params": params}, TOKENS)
    np.testing.assert_allclose(model(TOKENS), full, atol=1e-6, rtol=0)
    jax.tree.map(np.testing.assert_array_equal, nnx_to_linen(model), {"params": params})

    # Decode 7 tokens in nnx, move the cache to linen, and continue in both.
    model.init_cache(B)
    prompt_logits = model(TOKENS[:, :7], decode=True)
    cache = nnx_to_linen(model)["cache"]
    assert jax.tree.structure(cache) == jax.tree.structure(lm.init_cache(linen, B))
    assert int(cache["cache_index"]) == 7
    logits, _ = linen.apply({"params": params, "cache": cache}, TOKENS[:, 7:], decode=True, mutable=["cache"])
    np.testing.assert_allclose(prompt_logits, full[:, :7], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(logits, full[:, 7:], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(model(TOKENS[:, 7:], decode=True), logits, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_generate_gives_the_linen_models_tokens():
    """`qkv_jax.nnx.generate` (greedy) equals `qkv_jax.lm.generate` on the same parameters, and leaves
    the model's own cache as it was."""
    config = lm.TransformerConfig(**LM_FIELDS, num_kv_heads=2, kv_latent_dim=8)
    model = TransformerLM(config, rngs=nnx.Rngs(0))
    params = noisy(nnx_to_linen(model)["params"], seed=8)
    linen_to_nnx({"params": params}, model)
    model.init_cache(B)
    model(TOKENS[:, :2], decode=True)
    arguments = dict(rng=jax.random.PRNGKey(7), temperature=0.0)
    generated = qkv_jax.nnx.generate(model, TOKENS[:, :3], 6, **arguments)
    want = lm.generate(lm.TransformerLM(config), params, TOKENS[:, :3], 6, **arguments)
    np.testing.assert_array_equal(generated, want)
    assert int(model.cache_index[...]) == 2


def test_sown_weights_through_capture_and_pop():
    config = lm.TransformerConfig(**LM_FIELDS, sow_weights=True)
    model = TransformerLM(config, rngs=nnx.Rngs(0))
    _, intermediates = nnx.capture(model, nnx.Intermediate)(TOKENS)
    weights = intermediates["block_1"]["attention"]["attention_weights"][0]
    assert weights.shape == (B, 4, 10, 10)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)
    assert np.asarray(weights)[..., 0, 1:].max() == 0  # causal
    attention = MultiHeadAttention(num_heads=2, in_features=D, decode=False, rngs=nnx.Rngs(0))
    attention(X, sow_weights=True)
    (popped,) = nnx.pop(attention, nnx.Intermediate)["attention_weights"]
    assert popped.shape == (B, 2, L, L)


@pytest.mark.slow
def test_lora_linear_general_is_the_linen_adapter():
    layer = LoRALinearGeneral((4, 2), 5, axis=(-2, -1), rank=3, alpha=6.0, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(8), (2, 3, 4, 2))
    params = noisy(nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
    nnx.update(layer, params)
    linen = LoRADenseGeneral(5, axis=(-2, -1), rank=3, alpha=6.0)
    np.testing.assert_allclose(layer(x), linen.apply({"params": params}, x), atol=1e-6, rtol=0)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(
        jnp.shape, linen.init(jax.random.PRNGKey(0), x)["params"]
    )


@pytest.mark.slow
def test_flax_nnx_options_and_views():
    """in_kv_features, qkv_features, out_features as flax.nnx takes them; `nnx.view`'s hook."""
    model = MultiHeadAttention(4, 8, qkv_features=12, out_features=5, in_kv_features=6, rngs=nnx.Rngs(0))
    assert model.key.kernel.shape == (6, 4, 3) and model.out.kernel.shape == (4, 3, 5)
    memory = jnp.ones((B, 3, 6))
    assert model(X, memory, decode=False).shape == (B, L, 5)
    model.set_view(decode=True, batch_size=B, max_length=L)
    assert model.cached_key.shape == (B, L, 4, 3) and model(X[:, :2], memory[:, :2]).shape == (B, 2, 5)
    assert int(model.cache_index[...]) == 2


@pytest.mark.parametrize(
    "build,error,message",
    [
        (
            lambda: MultiHeadAttention(4, 8, num_kv_heads=3, rngs=nnx.Rngs(0)),
            ValueError,
            "num_kv_heads=3 must divide",
        ),
        (
            lambda: MultiHeadAttention(3, 8, rngs=nnx.Rngs(0)),
            ValueError,
            "num_heads=3 does not divide the input width 8",
        ),
        (
            lambda: MultiHeadAttention(2, 8, rngs=nnx.Rngs(0))(X),
            ValueError,
            '"decode" must be passed to the constructor or at call time',
        ),
        (
            lambda: MultiHeadAttention(2, 8, decode=True, rngs=nnx.Rngs(0))(X),
            ValueError,
            "call init_cache first",
        ),
        (lambda: MultiHeadAttention(2, 6, decode=False, rngs=nnx.Rngs(0))(X), ValueError, "in_features=6"),
        (
            lambda: MultiHeadAttention(
                2, 8, dropout_rate=0.5, keep_rngs=False, decode=False, rngs=nnx.Rngs(0)
            )(X, deterministic=False),
            ValueError,
            "dropout needs rngs=",
        ),
        (
            lambda: MultiHeadAttention(2, 8, decode=True, rngs=nnx.Rngs(0)).set_view(decode=True),
            TypeError,
            "batch_size",
        ),
        (
            lambda: TransformerLM(lm.TransformerConfig(**LM_FIELDS), rngs=nnx.Rngs(0))(TOKENS, decode=True),
            ValueError,
            "init_cache",
        ),
        (
            lambda: linen_to_nnx({"params": {"query": {}}}, MultiHeadAttention(2, 8, rngs=nnx.Rngs(0))),
            ValueError,
            "missing from the linen params",
        ),
    ],
)
def test_errors_name_what_to_do(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_decoding_past_the_cache_raises():
    model = TransformerLM(lm.TransformerConfig(**LM_FIELDS), rngs=nnx.Rngs(0))
    model.init_cache(B)
    model(TOKENS[:, :8], decode=True)
    with pytest.raises(
        ValueError, match=r"decoding 3 position\(s\) from position 8 overflows the cache of max"
    ):
        model(TOKENS[:, :3], decode=True)


def test_model_clone_replaces_the_config():
    """`TransformerLM.replace` is gone: `dataclasses.replace` on the config, `clone` on the model."""
    linen = lm.TransformerLM(lm.TransformerConfig(**LM_FIELDS))
    causal = linen.clone(config=dataclasses.replace(linen.config, causal=False))
    assert causal.config.causal is False and not hasattr(linen, "replace")
    assert isinstance(causal, nn.Module)
