"""The linen and the nnx faces of TransformerBlock and TransformerLM, fed the same good and bad inputs.

Good inputs give equal outputs; each bad input of docs/reliability.md that both faces can be given
gives the same exception type with the same message (the checks live once, in `qkv_jax.lm`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qkv_jax import lm
from qkv_jax import nnx as qnnx

VOCAB, LAYERS, D, N, MAX_LEN, B = 11, 2, 16, 4, 8, 2
CONFIG = lm.TransformerConfig(vocab_size=VOCAB, num_layers=LAYERS, d_model=D, num_heads=N, max_len=MAX_LEN)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (B, 6)), jnp.int32)


def randomized(params, seed=1):
    """Every parameter moved off its init (norm gains and biases included)."""
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    return tree.unflatten([leaf + 0.1 * rng.normal(size=leaf.shape).astype(leaf.dtype) for leaf in leaves])


@functools.cache
def faces(config=CONFIG):
    """(linen model, its params, the nnx model holding the same params)."""
    linen = lm.TransformerLM(config)
    params = randomized(linen.init(jax.random.PRNGKey(0), TOKENS)["params"])
    twin = qnnx.linen_to_nnx({"params": params}, qnnx.TransformerLM(config, rngs=nnx.Rngs(0)))
    return linen, params, twin


def outcome(call):
    """("ok", output) or (exception type, message) of `call()`."""
    try:
        return "ok", call()
    except Exception as error:  # noqa: BLE001 - the type is what is compared
        return type(error), str(error)


def assert_same(linen_call, nnx_call):
    """Both calls raise the same type with the same message, or return equal arrays."""
    (linen_kind, linen_value), (nnx_kind, nnx_value) = outcome(linen_call), outcome(nnx_call)
    assert linen_kind == nnx_kind, (linen_value, nnx_value)
    if linen_kind == "ok":
        np.testing.assert_allclose(np.asarray(linen_value), np.asarray(nnx_value), rtol=1e-6, atol=1e-6)
    else:
        assert linen_value == nnx_value
        assert linen_kind is ValueError, linen_value  # a user's mistake is a ValueError, not an assert
        assert "\n" not in linen_value
    return linen_kind, linen_value


GOOD = {
    "tokens": dict(),
    "head_mask": dict(head_mask=jnp.ones((LAYERS, N)).at[0, 1].set(0.0)),
    "segment_ids": dict(segment_ids=jnp.asarray([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 2, 2]], jnp.int32)),
}


@pytest.mark.parametrize("name", GOOD)
def test_the_lm_faces_give_equal_logits(name):
    linen, params, twin = faces()
    kind, _ = assert_same(
        lambda: linen.apply({"params": params}, TOKENS, **GOOD[name]), lambda: twin(TOKENS, **GOOD[name])
    )
    assert kind == "ok"


BAD = {
    "head_mask of the wrong shape": (
        TOKENS,
        dict(head_mask=jnp.ones((LAYERS, N + 1))),
        "head_mask has shape",
    ),
    "head_mask of one layer": (TOKENS, dict(head_mask=jnp.ones((N,))), "expected (num_layers, num_heads)"),
    "non-integer tokens": (TOKENS.astype(jnp.float32), dict(), "tokens must be integers"),
    "tokens without a length": (jnp.asarray(3, jnp.int32), dict(), "tokens must be integers [batch..., T]"),
    "too long for the learned positions": (
        jnp.zeros((B, MAX_LEN + 1), jnp.int32),
        dict(),
        f"sequence length {MAX_LEN + 1} exceeds max_len={MAX_LEN}",
    ),
    "segment_ids of the wrong shape": (TOKENS, dict(segment_ids=jnp.zeros((B, 3), jnp.int32)), "segment_ids"),
    "float segment_ids": (TOKENS, dict(segment_ids=jnp.zeros(TOKENS.shape)), "segment_ids must be integers"),
}


@pytest.mark.parametrize("name", BAD)
def test_the_lm_faces_refuse_bad_inputs_alike(name):
    tokens, kwargs, message = BAD[name]
    linen, params, twin = faces()
    kind, text = assert_same(
        lambda: linen.apply({"params": params}, tokens, **kwargs), lambda: twin(tokens, **kwargs)
    )
    assert message in text


def decode_linen(linen, params, chunks):
    variables = {"params": params, "cache": lm.init_cache(linen, B)}
    for chunk in chunks:
        logits, state = linen.apply(variables, chunk, decode=True, mutable=["cache"])
        variables = {"params": params, "cache": state["cache"]}
    return logits


def decode_nnx(twin, chunks):
    twin.init_cache(B)
    for chunk in chunks:
        logits = twin(chunk, decode=True)
    return logits


@pytest.mark.parametrize(
    "name, chunks, message",
    [
        ("prompt then a token", [TOKENS[:, :5], TOKENS[:, 5:6]], None),
        ("past the cache", [jnp.zeros((B, MAX_LEN), jnp.int32), TOKENS[:, :1]], "overflows the cache"),
        ("segment_ids when decoding", None, "segment_ids with decode=True"),
    ],
)
def test_the_lm_faces_decode_alike(name, chunks, message):
    linen, params, twin = faces()
    if chunks is None:
        segments = jnp.zeros_like(TOKENS)
        variables = {"params": params, "cache": lm.init_cache(linen, B)}
        twin.init_cache(B)
        kind, text = assert_same(
            lambda: linen.apply(variables, TOKENS, decode=True, segment_ids=segments, mutable=["cache"])[0],
            lambda: twin(TOKENS, decode=True, segment_ids=segments),
        )
    else:
        kind, text = assert_same(
            lambda: decode_linen(linen, params, chunks), lambda: decode_nnx(twin, chunks)
        )
    if message is None:
        assert kind == "ok"
        full = linen.apply({"params": params}, TOKENS)
        np.testing.assert_allclose(text, full[:, -1:], rtol=1e-5, atol=1e-5)
    else:
        assert message in text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=MAX_LEN), f"past the model's max_len={MAX_LEN}"),
        (dict(max_new_tokens=0), "max_new_tokens=0 must be a positive int"),
        (dict(max_new_tokens=2, top_k=VOCAB + 1), f"top_k={VOCAB + 1} must be in [1, {VOCAB}]"),
        (dict(max_new_tokens=2, temperature=-1.0), "temperature=-1.0 must be finite and >= 0"),
        (dict(max_new_tokens=2, prompt=TOKENS[0]), "prompt must have shape [batch, length >= 1]"),
        (dict(max_new_tokens=2, prompt=TOKENS.astype(jnp.float32)), "prompt must hold integer tokens"),
        (dict(max_new_tokens=2, temperature=0.0), None),
    ],
)
def test_the_two_generates_refuse_alike_and_sample_the_same_tokens(kwargs, message):
    linen, params, twin = faces()
    kwargs = {"prompt": TOKENS[:, :3], "rng": jax.random.PRNGKey(3), **kwargs}
    kind, text = assert_same(
        lambda: lm.generate(linen, params, **kwargs), lambda: qnnx.generate(twin, **kwargs)
    )
    if message is None:
        assert kind == "ok" and text.shape == (B, 2)
    else:
        assert message in text


# --------------------------------------------------------------------------- the block


@functools.cache
def block_faces():
    linen = lm.TransformerBlock(CONFIG, layer=1)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(B, 5, D)), jnp.float32)
    params = randomized(linen.init(jax.random.PRNGKey(0), x)["params"])
    twin = qnnx.linen_to_nnx({"params": params}, qnnx.TransformerBlock(CONFIG, rngs=nnx.Rngs(0), layer=1))
    return linen, params, twin, x


@pytest.mark.parametrize(
    "name, change, message",
    [
        ("good", lambda x: (x, {}), None),
        ("head_mask", lambda x: (x, dict(head_mask=jnp.asarray([1.0, 0.0, 1.0, 1.0]))), None),
        (
            "head_mask of the wrong shape",
            lambda x: (x, dict(head_mask=jnp.ones((N + 1,)))),
            "head_mask has shape",
        ),
        ("another width", lambda x: (jnp.ones((B, 5, D + 2)), {}), f"d_model={D}"),
        ("no length axis", lambda x: (jnp.ones((D,)), {}), "x must have shape [batch..., T, d_model"),
    ],
)
def test_the_block_faces_agree(name, change, message):
    linen, params, twin, x = block_faces()
    inputs, kwargs = change(x)
    kind, text = assert_same(
        lambda: linen.apply({"params": params}, inputs, **kwargs), lambda: twin(inputs, **kwargs)
    )
    if message is None:
        assert kind == "ok"
    else:
        assert message in text


def test_greedy_needs_no_key_in_either_face_and_sampling_does():
    linen, params, twin = faces()
    prompt = TOKENS[:, :3]
    keyed = lm.generate(linen, params, prompt, 3, rng=jax.random.PRNGKey(5), temperature=0.0)
    np.testing.assert_array_equal(lm.generate(linen, params, prompt, 3, temperature=0.0), keyed)
    np.testing.assert_array_equal(qnnx.generate(twin, prompt, 3, temperature=0.0), keyed)
    for generate in (lambda: lm.generate(linen, params, prompt, 3), lambda: qnnx.generate(twin, prompt, 3)):
        with pytest.raises(ValueError, match=r"temperature=1.0 samples, so it needs rng="):
            generate()
