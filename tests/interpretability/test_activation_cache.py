"""Hook points and run_with_cache / generate_with_cache against float64 NumPy, linen and nnx.

Every activation of a TransformerLM (MHA, GQA, MLA with LoRA) against the
float64 forward of tests/interpretability/test_interpretability_circuits.py; patterns of
chosen heads on the chunked, XLA and reference paths; the attention variants
(RoPE, windows, QK-norm, soft cap, sinks, packed segments) against float64
attention of the captured queries, keys and values; the KV-cache loop's
captures against the full pass; nnx against linen; the modules and
FlagReader's readers; memory of one head's pattern at 4096 keys.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
from flax import nnx
from test_interpretability_circuits import CONFIGS, model_params, reference_forward, tokens_for

from qkv_jax import lm
from qkv_jax import nnx as qkv_nnx
from qkv_jax.interpretability import cache, generate_with_cache, run_with_cache
from qkv_jax.models import FlagReader
from qkv_jax.modules import LayerNorm, MultiHeadAttention

VOCAB, T = 11, 8


def _f64(x):
    return np.asarray(x, np.float64)


def assert_close(actual, want, tol=1e-5, err_msg=""):
    """Within `tol` of the largest magnitude in `want` (at least 1): float32 rounding of a sum is
    relative to its terms, not to the (possibly tiny) result."""
    scale = max(1.0, float(np.max(np.abs(np.where(np.isfinite(want), want, 0)))))
    np.testing.assert_allclose(actual, want, rtol=0, atol=tol * scale, err_msg=err_msg)


# ------------------------------------------------------------------ every name, float64


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_activation_equals_the_float64_reference(name):
    config = CONFIGS[name]
    params = model_params(config)
    tokens = tokens_for()
    want_logits, want = reference_forward(config, params, tokens)
    run = jax.jit(functools.partial(run_with_cache, TransformerLM(config)))
    logits, acts = run({"params": params}, tokens)
    latent = config.kv_latent_dim is not None
    assert set(acts) == set(cache.hook_names(config.num_layers, latent=latent))  # HOOK_SHAPES is the model's
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
    for hook in acts:
        assert_close(acts[hook], want[hook], err_msg=hook)


TransformerLM = lm.TransformerLM


@pytest.mark.parametrize("implementation", ["chunked", "xla", "reference"])
def test_chosen_heads_patterns_on_every_path_leave_the_output(implementation):
    """Only the requested heads' scores and patterns are built; the other heads keep the path's
    own output, and the logits do not change (1e-6)."""
    config = dataclasses.replace(CONFIGS["gqa"], attention_implementation=implementation)
    params = model_params(config)
    tokens = tokens_for()
    _, want = reference_forward(config, params, tokens)
    names = [
        f"blocks.{layer}.attn.{hook}" for layer in (0, 1) for hook in ("hook_pattern", "hook_attn_scores")
    ]
    run = functools.partial(
        run_with_cache, TransformerLM(config), names_filter=names, pattern_heads={1: (0, 3)}
    )
    logits, acts = jax.jit(run)({"params": params}, tokens)
    np.testing.assert_allclose(logits, TransformerLM(config).apply({"params": params}, tokens), atol=1e-6)
    assert acts["blocks.0.attn.hook_pattern"].shape == (3, 4, T, T)  # layer 0 not in the mapping: all heads
    assert acts["blocks.1.attn.hook_pattern"].shape == (3, 2, T, T)
    for hook in ("hook_pattern", "hook_attn_scores"):
        np.testing.assert_allclose(
            acts[f"blocks.0.attn.{hook}"], want[f"blocks.0.attn.{hook}"], rtol=1e-5, atol=1e-5
        )
        np.testing.assert_allclose(
            acts[f"blocks.1.attn.{hook}"], want[f"blocks.1.attn.{hook}"][:, [0, 3]], atol=1e-5
        )


# --------------------------------------------------------------------- the attention variants

D, N = 16, 4
VARIANTS = {
    "rope_window_rms": dict(positions="rope", rope_fraction=0.5, window=3, normalize_qk="rms"),
    "cap_sinks_gqa": dict(attn_logits_soft_cap=1.5, use_sinks=True, num_kv_heads=2, normalize_qk="layernorm"),
    "bidirectional_window": dict(causal=False, window=(3, None), positions="none"),
    "packed_rope": dict(positions="rope", num_kv_heads=1),
}


def _norm(x, kind, scale):
    if kind == "layernorm":
        x = x - x.mean(-1, keepdims=True)
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6) * scale


def _variant_params(config):
    shapes = jax.eval_shape(TransformerLM(config).init, jax.random.PRNGKey(0), jnp.zeros((1, T), jnp.int32))
    rng = np.random.default_rng(3)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.5, s.shape), s.dtype), shapes["params"])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_hooks_equal_float64_attention_of_the_captured_qkv(variant):
    """hook_q/hook_k are after the QK-norm and RoPE (float64 from the LayerNorm's output); the pattern
    of head 1, scores and every head's z equal float64 attention of the captured q, k, v under the
    causal/window/segment mask, the soft cap and the sinks."""
    config = lm.TransformerConfig(
        vocab_size=VOCAB, num_layers=2, d_model=D, num_heads=N, max_len=T, **VARIANTS[variant]
    )
    params = _variant_params(config)
    tokens = tokens_for()
    segments = np.array([[0, 0, 0, 1, 1, 1, 1, 2]] * 3) if variant == "packed_rope" else None
    names = lambda n: n.startswith("blocks.1.") and ("attn." in n or n.endswith("ln1.hook_normalized"))
    run = functools.partial(run_with_cache, TransformerLM(config), names_filter=names, pattern_heads=(1,))
    _, acts = jax.jit(run)({"params": params}, tokens, segment_ids=segments)
    p = jax.tree.map(_f64, params["block_1"])
    h = (
        _f64(acts["blocks.1.ln1.hook_normalized"]) * p["attention_norm"]["scale"]
        + p["attention_norm"]["bias"]
    )
    q, k, v = (
        np.einsum("btd,dnh->btnh", h, p["attention"][n]["kernel"]) + p["attention"][n]["bias"]
        for n in ("query", "key", "value")
    )
    if config.normalize_qk:
        q = _norm(q, config.normalize_qk, p["attention"]["query_ln"]["scale"])
        k = _norm(k, config.normalize_qk, p["attention"]["key_ln"]["scale"])
    if config.positions == "rope":
        positions = np.arange(T) if segments is None else np.array([0, 1, 2, 0, 1, 2, 3, 0])
        q, k = (ref.slow_rope(x, positions, config.rope_base, config.rope_fraction) for x in (q, k))
    np.testing.assert_allclose(acts["blocks.1.attn.hook_q"], q, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(acts["blocks.1.attn.hook_k"], k, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(acts["blocks.1.attn.hook_v"], v, rtol=1e-5, atol=1e-5)
    window = lm.attention_options(config, 1)["local_window_size"]
    allowed = ref.allowed_pairs(
        (3,), N, T, T, is_causal=config.causal, window=window, query_segments=segments, key_segments=segments
    )
    sinks = p["attention"].get("sinks")
    z, pattern, _ = ref.attention_full(
        q, k, v, allowed=allowed, soft_cap=config.attn_logits_soft_cap, sinks=sinks
    )
    np.testing.assert_allclose(acts["blocks.1.attn.hook_pattern"][:, 0], pattern[:, 1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        acts["blocks.1.attn.hook_z"], z, rtol=1e-5, atol=1e-5
    )  # head 1 recomputed, the rest not
    logits = np.einsum("bth,bsh->bts", q[:, :, 1], k[:, :, 1 * k.shape[2] // N]) / np.sqrt(D // N)
    if config.attn_logits_soft_cap:
        logits = config.attn_logits_soft_cap * np.tanh(logits / config.attn_logits_soft_cap)
    scores = np.where(allowed[:, 1], logits, -np.inf)
    np.testing.assert_allclose(acts["blocks.1.attn.hook_attn_scores"][:, 0], scores, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ the KV-cache loop

GENERATION = {
    "mha": CONFIGS["mha"],
    "ring": dataclasses.replace(CONFIGS["gqa"], positions="rope", window=3),
    "mla_absorbed": dataclasses.replace(CONFIGS["mla_lora"], use_sinks=True),
}


@pytest.mark.parametrize("name", sorted(GENERATION))
@pytest.mark.slow
def test_generation_captures_every_decode_step_as_the_full_pass(name):
    """Greedy generation's tokens are generate's; step i's z, k (its new position) and pattern row
    equal the full pass over prompt + generated tokens at position P + i (the absorbed MLA scores
    included: the key bias is added back); a ring cache's pattern rows hold the same weights."""
    config = GENERATION[name]
    model, variables = TransformerLM(config), {"params": model_params(config)}
    prompt, steps = tokens_for()[:, :3], 4
    names = lambda n: (
        n.startswith("blocks.1.attn.")
        and n.rpartition(".")[2] in ("hook_z", "hook_k", "hook_pattern", "hook_attn_scores", "hook_kv_latent")
    )
    tokens, prefill, decoded = generate_with_cache(
        model, variables, prompt, steps, rng=jax.random.PRNGKey(0), names_filter=names, temperature=0.0
    )
    np.testing.assert_array_equal(
        tokens,
        lm.generate(model, variables["params"], prompt, steps, rng=jax.random.PRNGKey(0), temperature=0.0),
    )
    sequence = np.concatenate([prompt, np.asarray(tokens)[:, :-1]], axis=1)  # (B, P + steps - 1)
    full_config = dataclasses.replace(config, absorb_latent=False)
    _, full = run_with_cache(TransformerLM(full_config), variables, sequence, names_filter=names)
    P = prompt.shape[1]
    assert_close(prefill["blocks.1.attn.hook_z"], full["blocks.1.attn.hook_z"][:, :P])
    entry = "hook_kv_latent" if config.kv_latent_dim else "hook_k"
    for i in range(steps - 1):
        at = P + i
        step = {hook: value[i] for hook, value in decoded.items()}
        assert_close(step["blocks.1.attn.hook_z"][:, 0], full["blocks.1.attn.hook_z"][:, at])
        assert_close(step[f"blocks.1.attn.{entry}"][:, 0], full[f"blocks.1.attn.{entry}"][:, at])
        row = step["blocks.1.attn.hook_pattern"][:, :, 0]  # (B, N, slots)
        want = full["blocks.1.attn.hook_pattern"][:, :, at, : at + 1]  # (B, N, at + 1)
        if name == "ring":  # the slots hold the window's last positions in ring order
            assert_close(np.sort(row, -1)[..., -3:], np.sort(want, -1)[..., -3:])
            continue
        assert_close(row[..., : at + 1], want)
        np.testing.assert_array_equal(row[..., at + 1 :], 0.0)
        scores = step["blocks.1.attn.hook_attn_scores"][:, :, 0]
        assert_close(scores[..., : at + 1], full["blocks.1.attn.hook_attn_scores"][:, :, at, : at + 1])
        assert np.all(scores[..., at + 1 :] == -np.inf)


# ------------------------------------------------------------------------------ nnx


@pytest.mark.parametrize("name", ["gqa", "mla_lora"])
@pytest.mark.slow
def test_nnx_captures_equal_linen_and_leave_the_model_as_it_was(name):
    config = CONFIGS[name]
    params = model_params(config)
    tokens = tokens_for()
    linen_logits, linen_acts = run_with_cache(TransformerLM(config), {"params": params}, tokens)
    model = qkv_nnx.linen_to_nnx({"params": params}, qkv_nnx.TransformerLM(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens):
        return run_with_cache(nnx.merge(graphdef, state), None, tokens)

    logits, acts = run(state, tokens)
    np.testing.assert_allclose(logits, linen_logits, rtol=1e-5, atol=1e-5)
    assert set(acts) == set(linen_acts)
    for hook in acts:
        assert_close(acts[hook], linen_acts[hook], err_msg=hook)
    _, eager = run_with_cache(
        model, None, tokens, names_filter="blocks.0.attn.hook_pattern", pattern_heads=(2,)
    )
    np.testing.assert_allclose(
        eager["blocks.0.attn.hook_pattern"][:, 0], linen_acts["blocks.0.attn.hook_pattern"][:, 2], atol=1e-6
    )
    assert (
        model.block_0.attention.request == qkv_nnx.AttentionRequest()
        if hasattr(qkv_nnx, "AttentionRequest")
        else True
    )
    assert not model.block_0.attention.hook_q.capture and model.block_0.attention.hook_q.hook is None
    assert_close(model(tokens), linen_logits)


@pytest.mark.slow
def test_nnx_generation_captures_equal_linen():
    """...and sample generate's tokens: each row draws from generate's key for its position."""
    config = CONFIGS["gqa"]
    params = model_params(config)
    model = qkv_nnx.linen_to_nnx({"params": params}, qkv_nnx.TransformerLM(config, rngs=nnx.Rngs(0)))
    prompt, names = tokens_for()[:, :4], ["blocks.0.attn.hook_pattern", "blocks.1.hook_resid_post"]
    sampling = dict(rng=jax.random.PRNGKey(1), temperature=0.7, top_p=0.9)
    linen = generate_with_cache(
        TransformerLM(config), {"params": params}, prompt, 3, names_filter=names, **sampling
    )
    ours = generate_with_cache(model, None, prompt, 3, names_filter=names, **sampling)
    np.testing.assert_array_equal(ours[0], linen[0])
    np.testing.assert_array_equal(linen[0], lm.generate(TransformerLM(config), params, prompt, 3, **sampling))
    for got, want in zip(jax.tree.leaves(ours[1:]), jax.tree.leaves(linen[1:]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------ the modules and the flag readers


@pytest.mark.slow
def test_block_and_attention_alone_have_the_names_without_the_prefix():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, D))
    config = lm.TransformerConfig(vocab_size=VOCAB, num_layers=1, d_model=D, num_heads=N, num_kv_heads=2)
    block = lm.TransformerBlock(config)
    variables = block.init(jax.random.PRNGKey(1), x)
    out, acts = run_with_cache(block, variables, x)
    np.testing.assert_allclose(out, block.apply(variables, x), atol=1e-6)
    assert set(acts) == {
        name.removeprefix("blocks.0.") for name in cache.hook_names(1) if name.startswith("blocks.0.")
    }
    attention = MultiHeadAttention(num_heads=N, num_kv_heads=2, is_causal=True)
    variables = attention.init(jax.random.PRNGKey(2), x)
    _, acts = run_with_cache(attention, variables, x, names_filter=lambda n: n in ("hook_pattern", "hook_k"))
    assert acts["hook_pattern"].shape == (2, N, 5, 5) and acts["hook_k"].shape == (2, 5, 2, D // N)
    q = np.einsum("btd,dnh->btnh", _f64(x), _f64(variables["params"]["query"]["kernel"])) + _f64(
        variables["params"]["query"]["bias"]
    )
    _, pattern = ref.attention(q, acts["hook_k"], acts["hook_k"], mask=ref.causal(5, 5))
    np.testing.assert_allclose(acts["hook_pattern"], pattern, rtol=1e-5, atol=1e-5)


def test_every_heads_pattern_replaces_the_default_path_but_not_a_sower_or_a_custom_attention_fn(monkeypatch):
    """With every head's pattern asked for, the explicit path gives the whole output: the default
    attention function is skipped, except where it sows its weights; a custom one still runs."""
    from qkv_jax import modules

    calls = []
    inner = modules.dot_product_attention
    monkeypatch.setattr(modules, "dot_product_attention", lambda *a, **k: calls.append(1) or inner(*a, **k))

    @functools.wraps(modules.flax_dot_product_attention)  # its signature: the module passes what it takes
    def custom(*args, **kwargs):
        return modules.flax_dot_product_attention(*args, **kwargs)

    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, D))
    keep = lambda n: n == "hook_pattern"  # noqa: E731
    cases = [(modules.flax_dot_product_attention, None, 0), (modules.flax_dot_product_attention, (1, 0), 1)]
    cases += [(modules.flax_dot_product_attention, (0, 2), 1), (custom, None, 1)]
    for attention_fn, heads, runs in cases:
        attention = MultiHeadAttention(num_heads=N, num_kv_heads=2, is_causal=True, attention_fn=attention_fn)
        variables = attention.init(jax.random.PRNGKey(2), x)
        want = attention.apply(variables, x)
        calls.clear()
        out, acts = run_with_cache(attention, variables, x, names_filter=keep, pattern_heads=heads)
        assert len(calls) == runs, (attention_fn, heads)
        np.testing.assert_allclose(out, want, atol=1e-6)
        assert acts["hook_pattern"].shape == (2, N if heads is None else len(heads), 5, 5)
    attention = MultiHeadAttention(num_heads=N, num_kv_heads=2, is_causal=True, sow_weights=True)
    variables = attention.init(jax.random.PRNGKey(2), x)
    calls.clear()
    (out, state), acts = run_with_cache(attention, variables, x, names_filter=keep, mutable=["intermediates"])
    assert len(calls) == 1
    np.testing.assert_allclose(
        state["intermediates"]["attention_weights"][0], acts["hook_pattern"], atol=1e-6
    )


@pytest.mark.slow
def test_to_host_returns_the_same_activations_in_host_memory():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, D))
    attention = MultiHeadAttention(num_heads=N, num_kv_heads=2, is_causal=True)
    variables = attention.init(jax.random.PRNGKey(2), x)
    names = ("hook_pattern", "hook_z")
    run = functools.partial(run_with_cache, attention, names_filter=names)
    out, on_device = jax.jit(run)(variables, x)
    out_host, on_host = jax.jit(functools.partial(run, to_host=True))(variables, x)
    np.testing.assert_array_equal(out_host, out)
    assert out_host.sharding.memory_kind == "device"
    for name in names:
        assert on_device[name].sharding.memory_kind == "device"
        assert on_host[name].sharding.memory_kind == "pinned_host"
        np.testing.assert_array_equal(on_host[name], on_device[name])


def test_activation_spec_splits_the_batch_and_the_heads_where_they_divide():
    sizes = {"data": 2, "model": 4}
    assert cache.activation_spec("blocks.3.attn.hook_q", (4, 7, 8, 2), sizes) == ("data", None, "model", None)
    assert cache.activation_spec("blocks.0.attn.hook_k", (4, 7, 2, 2), sizes) == ("data", None, None, None)
    assert cache.activation_spec("blocks.0.attn.hook_pattern", (3, 8, 7, 7), sizes) == (
        None,
        "model",
        None,
        None,
    )
    assert cache.activation_spec("hook_embed", (4, 7, 16), sizes) == ("data", None, None)
    assert cache.activation_spec("hook_embed", (7, 16), sizes) == (None, None)  # no batch axis
    assert cache.activation_spec("not_a_hook", (4, 4), sizes) == (None, None)


@pytest.mark.parametrize("kind", ["learned_query", "static", "multihead"])
def test_flag_readers_attention_hooks(kind):
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 6, 5))
    reader = FlagReader(
        kind=kind, out_features=4 if kind != "static" else 4, d_k=4, num_heads=2 if kind == "multihead" else 1
    )
    variables = reader.init(jax.random.PRNGKey(4), x)
    (out, state), acts = run_with_cache(reader, variables, x, mutable=["intermediates"])
    np.testing.assert_allclose(out, reader.apply(variables, x), atol=1e-6)
    assert {
        "attn.hook_q",
        "attn.hook_k",
        "attn.hook_v",
        "attn.hook_pattern",
        "attn.hook_attn_scores",
        "attn.hook_z",
    } <= set(acts)
    (sown,) = state["intermediates"]["attention"]["attention_weights"]  # (2, heads, 1, 6)
    np.testing.assert_allclose(acts["attn.hook_pattern"], sown, atol=1e-6)
    _, pattern = ref.attention(acts["attn.hook_q"], acts["attn.hook_k"], acts["attn.hook_v"], scale=None)
    np.testing.assert_allclose(acts["attn.hook_pattern"], pattern, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ parameters unchanged


def test_layer_norm_keeps_flax_parameters_and_values_and_the_trees_have_no_hooks():
    x = jax.random.normal(jax.random.PRNGKey(5), (2, 3, 7)) * 3 + 1
    theirs = nn.LayerNorm().init(jax.random.PRNGKey(0), x)
    params = {"params": {"scale": jnp.linspace(0.5, 2, 7), "bias": jnp.linspace(-1, 1, 7)}}
    assert jax.tree.structure(LayerNorm().init(jax.random.PRNGKey(0), x)) == jax.tree.structure(theirs)
    np.testing.assert_allclose(LayerNorm().apply(params, x), nn.LayerNorm().apply(params, x), atol=1e-6)
    for config in CONFIGS.values():
        paths = jax.tree_util.tree_flatten_with_path(model_params(config))[0]
        assert not [path for path, _ in paths if any("hook" in str(key) for key in path)]


# --------------------------------------------------------------------------------- refusals


def test_refusals_name_the_argument():
    config = CONFIGS["gqa"]
    model, variables, tokens = TransformerLM(config), {"params": model_params(config)}, tokens_for()
    with pytest.raises(ValueError, match=r"names_filter names \['blocks.5.hook_z'\]"):
        run_with_cache(model, variables, tokens, names_filter=["blocks.5.hook_z", "hook_embed"])
    with pytest.raises(ValueError, match=r"hooks names \['blocks.0.hook_zz'\]"):
        run_with_cache(model, variables, tokens, hooks={"blocks.0.hook_zz": lambda x, name: x})
    with pytest.raises(ValueError, match=r"pattern_heads names \['blocks.7.attn'\]"):
        run_with_cache(
            model, variables, tokens, names_filter="blocks.0.attn.hook_pattern", pattern_heads={7: (0,)}
        )
    with pytest.raises(ValueError, match=r"pattern_heads=\(4,\) must be query heads in \[0, 4\)"):
        run_with_cache(
            model, variables, tokens, names_filter="blocks.0.attn.hook_pattern", pattern_heads=(4,)
        )
    dropping = TransformerLM(dataclasses.replace(config, attention_dropout_rate=0.1))
    with pytest.raises(ValueError, match="attention dropout on"):
        run_with_cache(
            dropping,
            variables,
            tokens,
            names_filter="blocks.0.attn.hook_pattern",
            deterministic=False,
            rngs={"dropout": jax.random.PRNGKey(0)},
        )
    with pytest.raises(TypeError, match="needs its variables, got None"):
        run_with_cache(model, None, tokens)
    with pytest.raises(TypeError, match="model must be a flax linen or nnx module, got str"):
        run_with_cache("model", variables, tokens)
    with pytest.raises(ValueError, match="capture_intermediates is set by the run"):
        run_with_cache(model, variables, tokens, capture_intermediates=True)


# ---------------------------------------------------------------------------------- memory


def _temp_bytes(function, *args) -> int:
    return jax.jit(function).lower(*args).compile().memory_analysis().temp_size_in_bytes


LONG = 4096


def _long_model(implementation):
    config = lm.TransformerConfig(
        vocab_size=16,
        num_layers=1,
        d_model=32,
        num_heads=4,
        max_len=LONG,
        attention_implementation=implementation,
    )
    model = TransformerLM(config)
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    return model, variables, jax.ShapeDtypeStruct((1, LONG), jnp.int32)


def test_one_heads_pattern_at_4096_keys_stays_below_every_heads_pattern():
    """The chunked path with hook_pattern of one head asked for (cached, or patched) keeps its
    temporaries below one float32 [N, T, S] pattern: the other heads' patterns are never built."""
    from qkv_jax.interpretability import ablate, run_with_hooks

    model, variables, tokens = _long_model("chunked")
    one_head = LONG * LONG * 4  # bytes of one head's float32 [T, S] pattern
    all_heads = 4 * one_head  # and of every head's: 256 MiB
    one = functools.partial(
        run_with_cache, model, names_filter="blocks.0.attn.hook_pattern", pattern_heads=(0,)
    )
    assert _temp_bytes(one, variables, tokens) < 2.5 * one_head < all_heads  # its scores and weights
    patched = functools.partial(
        run_with_hooks, model, hooks={"blocks.0.attn.hook_pattern": ablate("zero")}, pattern_heads=(1,)
    )
    assert _temp_bytes(patched, variables, tokens) < 2.5 * one_head


@pytest.mark.slow
def test_memory_of_patterns_at_4096_keys_against_every_head_and_the_reference_path():
    """The figures of docs/interpretability.md: one head < every head on the chunked path, and the
    reference path (which builds every head's weights anyway) above both."""
    chunked, variables, tokens = _long_model("chunked")
    reference, _, _ = _long_model("reference")
    name = "blocks.0.attn.hook_pattern"
    figures = {
        "chunked, one head": _temp_bytes(
            functools.partial(run_with_cache, chunked, names_filter=name, pattern_heads=(0,)),
            variables,
            tokens,
        ),
        "chunked, every head": _temp_bytes(
            functools.partial(run_with_cache, chunked, names_filter=name), variables, tokens
        ),
        "chunked, no capture": _temp_bytes(chunked.apply, variables, tokens),
        "reference, one head": _temp_bytes(
            functools.partial(run_with_cache, reference, names_filter=name, pattern_heads=(0,)),
            variables,
            tokens,
        ),
    }
    print({key: f"{value / 2**20:.1f} MiB" for key, value in figures.items()})
    assert figures["chunked, no capture"] < figures["chunked, one head"] < figures["chunked, every head"]
    assert figures["chunked, one head"] < figures["reference, one head"]
