"""MultiHeadAttention's decode mode: the KV cache (MHA, GQA, MQA) and the MLA latent cache."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
from jax.experimental import checkify

import qkv_jax

B, L, D, N, HEAD = 2, 6, 8, 4, 2  # batch, cache length, width, query heads, head depth
X = jax.random.normal(jax.random.PRNGKey(0), (B, L, D))

VARIANTS = {
    "mha": dict(),
    "gqa": dict(num_kv_heads=2),
    "mqa": dict(num_kv_heads=1),
    "mla": dict(num_kv_heads=2, kv_latent_dim=3),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def decoder(request):
    """(name, module, params, empty cache, full causal output, jitted decode step)."""
    module = qkv_jax.MultiHeadAttention(num_heads=N, is_causal=True, **VARIANTS[request.param])
    variables = module.init(jax.random.PRNGKey(1), X, decode=True)
    params, cache = variables["params"], variables["cache"]
    full = jax.jit(module.apply)({"params": params}, X)

    @jax.jit
    def step(cache, inputs):
        output, state = module.apply(
            {"params": params, "cache": cache}, inputs, decode=True, mutable=["cache"]
        )
        return output, state["cache"]

    return request.param, module, params, cache, full, step


def decode_in_segments(step, cache, inputs, lengths):
    outputs, start = [], 0
    for length in lengths:
        output, cache = step(cache, inputs[:, start : start + length])
        outputs.append(output)
        start += length
    return jnp.concatenate(outputs, axis=1), cache


@pytest.mark.reliability(
    "Decoding",
    "cached decoding (one token at a time, a prompt then tokens, a whole prefill) for MHA, GQA, MQA and MLA",
    "equals the full causal pass within 1e-5 in float32",
)
@pytest.mark.parametrize("lengths", [(1,) * L, (3, 1, 1, 1), (L,)], ids=["prompt1", "prompt3", "prefill"])
def test_cached_decoding_equals_the_full_causal_pass(decoder, lengths):
    _, _, _, cache, full, step = decoder
    decoded, cache = decode_in_segments(step, cache, X, lengths)
    np.testing.assert_allclose(decoded, full, atol=1e-5, rtol=1e-5)
    assert int(cache["cache_index"]) == L


def test_cache_is_sized_by_kv_heads_or_holds_the_latent(decoder):
    name, module, _, cache, _, _ = decoder
    if name == "mla":
        assert set(cache) == {"cached_latent", "cache_index"}  # no K, no V
        chex.assert_shape(cache["cached_latent"], (B, L, 3))
    else:
        num_kv_heads = module.num_kv_heads or N
        assert set(cache) == {"cached_key", "cached_value", "cache_index"}
        chex.assert_shape([cache["cached_key"], cache["cached_value"]], (B, L, num_kv_heads, HEAD))


def test_cached_entries_are_the_projected_inputs(decoder):
    """What the cache stores is exactly W_K x, W_V x (or the MLA latent W_latent x)."""
    name, _, params, cache, _, step = decoder
    _, cache = step(cache, X[:, :4])
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(X[:, :4], np.float64)
    if name == "mla":
        latent = x @ p["kv_latent"]["kernel"] + p["kv_latent"]["bias"]
        np.testing.assert_allclose(cache["cached_latent"][:, :4], latent, atol=1e-5)
    else:
        key = np.einsum("btd,dkh->btkh", x, p["key"]["kernel"]) + p["key"]["bias"]
        np.testing.assert_allclose(cache["cached_key"][:, :4], key, atol=1e-5)
    unfilled = cache["cached_latent" if name == "mla" else "cached_value"][:, 4:]
    np.testing.assert_array_equal(unfilled, 0)


def test_mla_matches_an_independent_reference():
    """K and V rebuilt from the latent: K = (x W_latent + b) W_K + b_K, same for V."""
    module = qkv_jax.MultiHeadAttention(num_heads=N, num_kv_heads=2, kv_latent_dim=3, is_causal=True)
    params = module.init(jax.random.PRNGKey(2), X)["params"]
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(X, np.float64)
    latent = x @ p["kv_latent"]["kernel"] + p["kv_latent"]["bias"]  # (B, S, C)
    query = np.einsum("bsd,dnh->bsnh", x, p["query"]["kernel"]) + p["query"]["bias"]
    key = np.einsum("bsc,ckh->bskh", latent, p["key"]["kernel"]) + p["key"]["bias"]
    value = np.einsum("bsc,ckh->bskh", latent, p["value"]["kernel"]) + p["value"]["bias"]
    heads, _ = ref.attention(query, key, value, mask=ref.causal(L, L))  # (B, S, N, Hv)
    want = np.einsum("bsnh,nho->bso", heads, p["out"]["kernel"]) + p["out"]["bias"]
    np.testing.assert_allclose(module.apply({"params": params}, X), want, atol=1e-5)


@pytest.mark.reliability(
    "Decoding",
    "appending past the KV cache's max length, eagerly",
    "`ValueError` naming the position and the capacity (flax's cache would overwrite silently)",
)
@pytest.mark.slow
def test_decoding_past_the_cache_raises_eagerly():
    module = qkv_jax.MultiHeadAttention(num_heads=2, num_kv_heads=1, is_causal=True)
    variables = module.init(jax.random.PRNGKey(3), X[:, :3], decode=True)  # room for 3
    _, state = module.apply(variables, X[:, :2], decode=True, mutable=["cache"])
    with pytest.raises(
        ValueError, match=r"decoding 2 position\(s\) from position 2 overflows the cache of max length 3"
    ):
        module.apply({**variables, **state}, X[:, 2:4], decode=True, mutable=["cache"])
    with pytest.raises(ValueError, match="from position 0 overflows the cache of max length 3"):
        module.apply(variables, X[:, :4], decode=True, mutable=["cache"])


@pytest.mark.reliability(
    "Decoding",
    "appending past the KV cache's max length inside jit",
    "nothing cached is overwritten, the output is nan and `checkify` raises naming the position",
)
def test_decoding_past_the_cache_under_jit_is_nan_and_checkify_raises(decoder):
    _, _, _, cache, _, step = decoder
    _, full_cache = step(cache, X)
    output, after = step(full_cache, X[:, :1])
    assert np.isnan(np.asarray(output)).all()
    assert int(after["cache_index"]) == L + 1  # the overflow is recorded ...
    for name in full_cache:  # ... and nothing cached is overwritten
        if name != "cache_index":
            np.testing.assert_array_equal(after[name], full_cache[name])
    error, _ = checkify.checkify(step)(full_cache, X[:, :1])
    with pytest.raises(
        checkify.JaxRuntimeError, match=f"from position {L} overflows the cache of max length {L}"
    ):
        error.throw()
    error, _ = checkify.checkify(step)(cache, X[:, :1])
    assert error.get() is None


def test_decode_arguments_are_checked():
    causal = qkv_jax.MultiHeadAttention(num_heads=2, is_causal=True)
    variables = causal.init(jax.random.PRNGKey(0), X, decode=True)
    with pytest.raises(ValueError, match=r"does not fit the cache of shape \(2, 6, 2, 4\)"):
        causal.apply(variables, X[:1, :1], decode=True, mutable=["cache"])
    with pytest.raises(ValueError, match="kv_latent_dim=0 must be a positive int"):
        qkv_jax.MultiHeadAttention(num_heads=2, kv_latent_dim=0)
    with pytest.raises(ValueError, match="keys and values are rebuilt from one latent"):
        qkv_jax.MultiHeadAttention(num_heads=2, kv_latent_dim=3).init(jax.random.PRNGKey(0), X, X, X + 1)


def test_decoding_without_is_causal_attends_to_the_filled_positions_up_to_its_own():
    """As flax's one-token decode: the cache is causal in its positions whatever is_causal says
    (here in segments of 2, 1 and 3 tokens), while `init` with decode=True, which creates the
    cache, is the ordinary pass over all positions."""
    plain = qkv_jax.MultiHeadAttention(num_heads=2, decode=True)
    params, cache = plain.init(jax.random.PRNGKey(4), X).values()
    full = plain.init_with_output(jax.random.PRNGKey(4), X)[0]
    np.testing.assert_allclose(full, plain.apply({"params": params}, X, decode=False), atol=1e-6)

    @jax.jit
    def step(cache, inputs):
        output, state = plain.apply({"params": params, "cache": cache}, inputs, mutable=["cache"])
        return output, state["cache"]

    decoded, _ = decode_in_segments(step, cache, X, (2, 1, 3))
    causal = qkv_jax.MultiHeadAttention(num_heads=2, is_causal=True)
    np.testing.assert_allclose(decoded, causal.apply({"params": params}, X), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.slow
def test_absorbed_mla_decoding_equals_rebuilding_keys_and_values(kv_heads):
    """Weight absorption (the default) against K and V rebuilt from the latents at every step:
    the same outputs (float32, 1e-5), with non-zero biases, a prompt and single tokens, GQA."""
    fields = dict(num_heads=N, num_kv_heads=kv_heads, kv_latent_dim=3, is_causal=True)
    absorbed = qkv_jax.MultiHeadAttention(**fields)
    explicit = qkv_jax.MultiHeadAttention(**fields, absorb_latent=False)
    variables = absorbed.init(jax.random.PRNGKey(1), X, decode=True)
    noise = jax.random.split(jax.random.PRNGKey(2), len(jax.tree.leaves(variables["params"])))
    params = jax.tree.unflatten(
        jax.tree.structure(variables["params"]),
        [
            p + 0.3 * jax.random.normal(k, p.shape)
            for p, k in zip(jax.tree.leaves(variables["params"]), noise, strict=True)
        ],
    )
    outputs = {}
    for name, module in (("absorbed", absorbed), ("explicit", explicit)):
        cache, pieces = variables["cache"], []
        for inputs in (X[:, :3], X[:, 3:4], X[:, 4:5], X[:, 5:6]):
            output, state = jax.jit(
                lambda c, x, m=module: m.apply(
                    {"params": params, "cache": c}, x, decode=True, mutable=["cache"]
                )
            )(cache, inputs)
            cache = state["cache"]
            pieces.append(output)
        outputs[name] = jnp.concatenate(pieces, axis=1)
    np.testing.assert_allclose(outputs["absorbed"], outputs["explicit"], atol=1e-5, rtol=1e-5)
    full = absorbed.apply({"params": params}, X)
    np.testing.assert_allclose(outputs["absorbed"], full, atol=1e-5, rtol=1e-5)


def test_absorbed_mla_decoding_builds_no_keys_or_values():
    """The absorbed decode step's program has no [.., L, K, H] key or value array in it."""
    module = qkv_jax.MultiHeadAttention(num_heads=N, num_kv_heads=2, kv_latent_dim=3, is_causal=True)
    variables = module.init(jax.random.PRNGKey(1), X, decode=True)

    def shapes(module):
        step = lambda c, x: module.apply(
            {"params": variables["params"], "cache": c}, x, decode=True, mutable=["cache"]
        )
        jaxpr = jax.make_jaxpr(step)(variables["cache"], X[:, :1])
        return {tuple(v.aval.shape) for eqn in jaxpr.eqns for v in eqn.outvars if hasattr(v.aval, "shape")}

    rebuilt = (B, L, 2, D // N)  # K and V over the whole cache, [B, L, K, H]
    assert rebuilt in shapes(module.clone(absorb_latent=False))
    assert rebuilt not in shapes(module)
