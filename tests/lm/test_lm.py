"""TransformerLM: cached decoding, causal receptive field, generate."""

import dataclasses

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkv_jax import generation, lm

VOCAB, LAYERS, D, N, MAX_LEN = 11, 2, 16, 4, 12
TOKENS = jax.random.randint(jax.random.PRNGKey(0), (2, MAX_LEN), 0, VOCAB)

VARIANTS = {
    "mha": dict(),
    "gqa": dict(num_kv_heads=2),
    "mqa": dict(num_kv_heads=1),
    "mla": dict(kv_latent_dim=8),
}


def make_model(**overrides):
    fields = dict(vocab_size=VOCAB, num_layers=LAYERS, d_model=D, num_heads=N, max_len=MAX_LEN)
    return lm.TransformerLM(lm.TransformerConfig(**{**fields, **overrides}))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request):
    """(name, model, params, full logits of TOKENS, jitted decode step)."""
    model = make_model(**VARIANTS[request.param])
    params = jax.jit(model.init)(jax.random.PRNGKey(1), TOKENS)["params"]
    full = jax.jit(model.apply)({"params": params}, TOKENS)

    @jax.jit
    def step(cache, tokens):
        logits, state = model.apply(
            {"params": params, "cache": cache}, tokens, decode=True, mutable=["cache"]
        )
        return logits, state["cache"]

    return request.param, model, params, full, step


@pytest.mark.reliability(
    "Decoding",
    "the whole LM decoded with its cache, prompts of length 1 and 5, MHA/GQA/MQA/MLA",
    "logits equal the full causal forward pass within 1e-5",
)
@pytest.mark.parametrize("prompt_length", [1, 5])
@pytest.mark.slow
def test_cached_decoding_equals_the_full_pass(variant, prompt_length):
    _, model, _, full, step = variant
    logits, cache = step(lm.init_cache(model, 2), TOKENS[:, :prompt_length])
    pieces = [logits]
    for t in range(prompt_length, MAX_LEN):
        logits, cache = step(cache, TOKENS[:, t : t + 1])
        pieces.append(logits)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=1e-5, rtol=1e-5)


def test_kv_cache_bytes_per_token(variant):
    name, model, _, _, _ = variant
    head_dim = D // N
    per_layer = {
        "mha": 2 * N * head_dim,
        "gqa": 2 * 2 * head_dim,
        "mqa": 2 * 1 * head_dim,
        "mla": 8,  # the latent only
    }[name]
    assert lm.kv_cache_bytes_per_token(model) == LAYERS * per_layer * 4  # float32


def receptive_field(model, params):
    """[T, T] norms of d(sum of logits at t)/d(embedding at s), through a perturbation
    added to the token embeddings (an interceptor; the model is unchanged)."""

    def logits_sum(delta, t):
        def add_delta(call, args, kwargs, context):
            output = call(*args, **kwargs)
            is_embedding = isinstance(context.module, nn.Embed) and context.method_name == "__call__"
            return output + delta if is_embedding else output

        with nn.intercept_methods(add_delta):
            logits = model.apply({"params": params}, TOKENS[:1])  # (1, T, V)
        return logits[0, t].sum()

    delta = jnp.zeros((1, MAX_LEN, D))
    grads = jax.vmap(jax.grad(logits_sum), in_axes=(None, 0))(delta, jnp.arange(MAX_LEN))  # (T, 1, T, D)
    return np.linalg.norm(np.asarray(grads[:, 0]), axis=-1)  # (T, T): [t, s]


@pytest.mark.slow
def test_causal_receptive_field_through_gradients():
    causal = make_model()
    params = jax.jit(causal.init)(jax.random.PRNGKey(2), TOKENS)["params"]
    field = receptive_field(causal, params)
    future = np.triu(np.ones((MAX_LEN, MAX_LEN), bool), k=1)
    assert (field[future] == 0).all()  # exactly: nothing flows back from the future
    assert (field[~future] > 1e-6).all()  # every past position (and the current one) matters
    unmasked = receptive_field(causal.clone(config=dataclasses.replace(causal.config, causal=False)), params)
    assert (unmasked > 1e-6).all()


def test_generate_greedy_equals_recomputing_the_full_pass():
    model = make_model(num_kv_heads=2)
    params = jax.jit(model.init)(jax.random.PRNGKey(3), TOKENS)["params"]
    prompt_length, new = 3, 7
    generated = lm.generate(
        model, params, TOKENS[:, :prompt_length], new, rng=jax.random.PRNGKey(0), temperature=0.0
    )
    forward = jax.jit(model.apply)
    sequence = np.array(TOKENS)  # positions past t do not affect logits at t (causal)
    for t in range(prompt_length, prompt_length + new):
        logits = forward({"params": params}, jnp.asarray(sequence))
        sequence[:, t] = np.argmax(logits[:, t - 1], axis=-1)
    np.testing.assert_array_equal(generated, sequence[:, prompt_length : prompt_length + new])


def test_generate_is_deterministic_for_an_rng_and_compiles_once():
    model = make_model(num_kv_heads=1)
    params = jax.jit(model.init)(jax.random.PRNGKey(4), TOKENS)["params"]
    traced = jax.jit(
        chex.assert_max_traces(generation.sample, n=1), static_argnames=("model", "max_new_tokens", "top_k")
    )

    def sample(prompt, seed, temperature):
        sampling = generation.Sampling(jnp.float32(temperature), jnp.float32(1.0))
        return traced(model, params, prompt, jax.random.PRNGKey(seed), sampling, max_new_tokens=6, top_k=4)

    first = sample(TOKENS[:, :4], 0, 1.0)
    np.testing.assert_array_equal(sample(TOKENS[:, :4], 0, 1.0), first)
    assert not np.array_equal(sample(TOKENS[:, :4], 1, 1.0), first)
    sample(TOKENS[:, 4:8], 2, 0.5)  # new prompt content and temperature: no retrace
    chex.assert_shape(first, (2, 6))
    assert first.dtype == jnp.int32 and (np.asarray(first) >= 0).all() and (np.asarray(first) < VOCAB).all()


def test_choose_top_k_and_temperature():
    logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]]))
    keys = jax.random.split(jax.random.PRNGKey(0), 4000)

    def choose(logits, key, temperature, top_k):
        sampling = generation.Sampling(jnp.float32(temperature), jnp.float32(1.0))
        return generation.choose(logits, key[None], sampling, top_k)

    draw = jax.jit(jax.vmap(choose, in_axes=(None, 0, None, None)), static_argnums=3)
    counts = np.bincount(np.asarray(draw(logits, keys, 1.0, None))[:, 0], minlength=4) / 4000
    np.testing.assert_allclose(counts, [0.1, 0.2, 0.3, 0.4], atol=0.03)
    top_2 = np.bincount(np.asarray(draw(logits, keys, 1.0, 2))[:, 0], minlength=4) / 4000
    np.testing.assert_allclose(top_2, [0, 0, 3 / 7, 4 / 7], atol=0.03)
    hot = np.bincount(np.asarray(draw(logits, keys, 0.5, None))[:, 0], minlength=4) / 4000
    sharpened = np.array([0.1, 0.2, 0.3, 0.4]) ** 2
    np.testing.assert_allclose(hot, sharpened / sharpened.sum(), atol=0.03)
    assert (np.asarray(draw(logits, keys[:10], 0.0, None)) == 3).all()


@pytest.mark.reliability(
    "Decoding",
    "generate() with a prompt that would decode past max_len, or bad max_new_tokens/top_k/temperature/prompt",
    "`ValueError` naming the values, before anything compiles",
)
@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(max_new_tokens=2),
            "a prompt of 12 tokens and max_new_tokens=2 decode 13 positions, past the model's max_len=12",
        ),
        (dict(max_new_tokens=0), "max_new_tokens=0 must be a positive int"),
        (dict(max_new_tokens=1, top_k=VOCAB + 1), "top_k=12 must be in [1, 11] or None"),
        (dict(max_new_tokens=1, temperature=-1.0), "temperature=-1.0 must be finite and >= 0"),
        (dict(max_new_tokens=1, model=make_model(causal=False)), "the model has causal=False"),
        (dict(max_new_tokens=1, prompt=TOKENS[0]), "prompt must have shape [batch, length >= 1], got [12]"),
        (dict(max_new_tokens=1, prompt=TOKENS[:, :2] * 1.0), "prompt must hold integer tokens"),
    ],
)
def test_generate_rejects_bad_arguments_before_running(kwargs, message):
    arguments = {**dict(model=make_model(), params=None, prompt=TOKENS, rng=jax.random.PRNGKey(0)), **kwargs}
    with pytest.raises(ValueError) as info:
        lm.generate(**arguments)
    assert message in str(info.value)


@pytest.mark.reliability(
    "Decoding",
    "TransformerLM decoding or running past max_len",
    "`ValueError` naming the length and max_len",
)
def test_decoding_the_lm_past_max_len_raises():
    model = make_model(num_layers=1)
    variables = {
        "params": jax.jit(model.init)(jax.random.PRNGKey(5), TOKENS)["params"],
        "cache": lm.init_cache(model, 2),
    }
    with pytest.raises(
        ValueError,
        match=f"TransformerLM: decoding 13 position\\(s\\) from position 0 overflows the cache "
        f"of max length {MAX_LEN}",
    ):
        model.apply(variables, jnp.zeros((2, MAX_LEN + 1), jnp.int32), decode=True, mutable=["cache"])
    with pytest.raises(ValueError, match=f"sequence length 13 exceeds max_len={MAX_LEN}"):
        model.apply(variables, jnp.zeros((2, MAX_LEN + 1), jnp.int32))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(num_heads=3), "num_heads=3 must divide d_model=16"),
        (dict(num_kv_heads=3), "num_kv_heads=3 must divide num_heads=4"),
        (dict(max_len=0), "max_len=0 must be a positive int"),
        (dict(residual_dropout_rate=1.0), "residual_dropout_rate=1.0 must be in [0, 1)"),
    ],
)
def test_bad_model_arguments(overrides, message):
    with pytest.raises(ValueError) as info:
        make_model(**overrides)
    assert message in str(info.value)


def test_transformer_block_is_pre_layernorm_residual():
    """With both branches' output projections zeroed, a block is the identity."""
    block = lm.TransformerBlock(lm.TransformerConfig(vocab_size=VOCAB, d_model=8, num_heads=2))
    x = jax.random.normal(jax.random.PRNGKey(6), (2, 5, 8))
    params = jax.jit(block.init)(jax.random.PRNGKey(7), x)["params"]
    apply = jax.jit(block.apply)
    zeroed = jax.tree_util.tree_map_with_path(
        lambda path, a: (
            jnp.zeros_like(a) if any(getattr(k, "key", None) in ("out", "mlp_out") for k in path) else a
        ),
        params,
    )
    np.testing.assert_array_equal(apply({"params": zeroed}, x), x)
    assert not np.allclose(apply({"params": params}, x), x)
