"""The block options of TransformerConfig (norm kinds and placements, parallel blocks, MLP kinds and
biases, head_dim, tied and scaled embeddings, the final soft cap) against a float64 NumPy model, in
linen and nnx; cached decoding equals the full pass for configs combining them; their checks."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from numpy_reference import attention_full, causal

from configs import common
from qkv_jax import lm
from qkv_jax import nnx as qnnx
from qkv_jax.interpretability import cache, run_with_cache
from qkv_jax.positions import RopeScaling
from qkv_jax.tasks.transformer import model_fields, transformer_config
from qkv_jax.training.validate import ConfigError

VOCAB, D, N, MAX_LEN, B, T = 13, 16, 4, 12, 2, 7
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (B, T)), jnp.int32)
BASE = dict(vocab_size=VOCAB, num_layers=2, d_model=D, num_heads=N, max_len=MAX_LEN, mlp_dim=24)

# Each config combines several options (the families' layouts, on tiny shapes).
CONFIGS = {
    "llama": dict(
        norm="rms", gated_mlp=True, mlp_activation="silu", mlp_bias=False, qkv_bias=False, out_bias=False
    ),
    "gemma2": dict(
        norm="rms_offset",
        norm_placement="sandwich",
        gated_mlp=True,
        tie_embeddings=True,
        embedding_scale=math.sqrt(D),
        final_logit_soft_cap=3.0,
        head_dim=6,
    ),
    "olmo2": dict(
        norm="rms",
        norm_placement="post",
        gated_mlp=True,
        mlp_activation="silu",
        norm_epsilon=1e-5,
        normalize_qk="rms",
        qk_norm_width="full",
        qkv_bias=False,
        out_bias=False,
    ),
    "qwen2": dict(norm="rms", gated_mlp=True, mlp_activation="silu", mlp_bias=False, out_bias=False),
    "qwen3": dict(norm="rms", normalize_qk="rms", qkv_bias=False, out_bias=False, head_dim=8, num_kv_heads=2),
    "gemma3": dict(norm="rms_offset", normalize_qk="rms_offset", norm_placement="sandwich", qkv_bias=False),
    "layernorm_qk": dict(normalize_qk=True, qkv_bias=False),
    "neox": dict(parallel_block=True, mlp_activation="gelu", norm_epsilon=1e-5, num_kv_heads=2),
    "relu": dict(mlp_activation="relu", head_dim=8, norm_epsilon=1e-3, positions="none"),
}


def config_of(name: str) -> lm.TransformerConfig:
    return lm.TransformerConfig(**{**BASE, **CONFIGS[name]})


def randomized(params, seed=1):
    """Every parameter moved off its init, norm gains and biases included."""
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    return tree.unflatten([leaf + 0.2 * rng.normal(size=leaf.shape).astype(leaf.dtype) for leaf in leaves])


@functools.cache
def built(name: str):
    config = config_of(name)
    model = lm.TransformerLM(config)
    return config, model, randomized(model.init(jax.random.PRNGKey(0), TOKENS)["params"])


# ------------------------------------------------------------------- the float64 reference

ACTIVATIONS = {
    "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))),
    "gelu": lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / np.sqrt(2))),
    "silu": lambda x: x / (1 + np.exp(-x)),
    "relu": lambda x: np.maximum(x, 0.0),
}


def f64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def ref_norm(x, p, kind, epsilon):
    if kind == "layernorm":
        x = x - x.mean(-1, keepdims=True)
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + epsilon) * p["scale"] + p.get("bias", 0.0)
    gain = 1 + p["scale"] if kind == "rms_offset" else p["scale"]
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + epsilon) * gain


def ref_dense(p, x):
    return x @ p["kernel"] + p.get("bias", 0.0)


def ref_attention(p, x, config):
    project = {
        name: np.einsum("...td,dnh->...tnh", x, p[name]["kernel"]) for name in ("query", "key", "value")
    }
    q, k, v = (project[name] + p[name].get("bias", 0.0) for name in ("query", "key", "value"))
    kind = "layernorm" if config.normalize_qk is True else config.normalize_qk
    if kind:

        def qk_norm(x, p):  # (..., T, heads, H), over H or over heads * H
            flat = x.reshape(*x.shape[:-2], -1) if config.qk_norm_width == "full" else x
            return ref_norm(flat, p, kind, config.norm_epsilon).reshape(x.shape)

        q, k = qk_norm(q, p["query_ln"]), qk_norm(k, p["key_ln"])
    z, _, _ = attention_full(q, k, v, allowed=causal(x.shape[-2], x.shape[-2]))  # (..., T, N, H)
    return np.einsum("...tnh,nhd->...td", z, p["out"]["kernel"]) + p["out"].get("bias", 0.0)


def ref_block(p, x, config):
    def norm(name, h):
        return ref_norm(h, p[name], config.norm, config.norm_epsilon)

    def sublayer(name, h, f):
        h = norm(f"{name}_norm", h) if config.norm_placement != "post" else h
        h = f(h)
        return norm(f"{name}_post_norm", h) if config.norm_placement != "pre" else h

    def mlp(h):
        act = ACTIVATIONS[config.mlp_activation]
        hidden = (
            act(ref_dense(p["mlp_gate"], h)) * ref_dense(p["mlp_in"], h)
            if config.gated_mlp
            else act(ref_dense(p["mlp_in"], h))
        )
        return ref_dense(p["mlp_out"], hidden)

    mid = x + sublayer("attention", x, lambda h: ref_attention(p["attention"], h, config))
    return mid + sublayer("mlp", x if config.parallel_block else mid, mlp)


def ref_lm(params, tokens, config):
    p = f64(params)
    table = p["token_embedding"]["embedding"]
    x = table[np.asarray(tokens)]
    if config.embedding_scale is not None:
        x = x * float(np.float32(config.embedding_scale))
    if config.positions == "learned":
        x = x + p["position_embedding"][: tokens.shape[-1]]
    for layer in range(config.num_layers):
        x = ref_block(p[f"block_{layer}"], x, config)
    x = ref_norm(x, p["final_norm"], config.norm, config.norm_epsilon)
    logits = x @ table.T if config.tie_embeddings else x @ p["head"]["kernel"]
    cap = config.final_logit_soft_cap
    return logits if cap is None else cap * np.tanh(logits / cap)


# ------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("name", CONFIGS)
def test_linen_and_nnx_equal_the_float64_model(name):
    config, model, params = built(name)
    want = ref_lm(params, TOKENS, config)
    got = model.apply({"params": params}, TOKENS)
    tolerance = 2e-5 * np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=tolerance, rtol=0)
    twin = qnnx.linen_to_nnx({"params": params}, qnnx.TransformerLM(config, rngs=nnx.Rngs(0)))
    np.testing.assert_allclose(twin(TOKENS), got, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_parameter_tree_has_the_options_names(name):
    config, _, params = built(name)
    block = params["block_0"]
    norms = {"attention_norm", "mlp_norm"} if config.norm_placement != "post" else set()
    if config.norm_placement != "pre":
        norms |= {"attention_post_norm", "mlp_post_norm"}
    mlp = {"mlp_in", "mlp_out"} | ({"mlp_gate"} if config.gated_mlp else set())
    assert set(block) == norms | mlp | {"attention"}
    assert ("head" in params) != config.tie_embeddings
    bias = {"bias"} if config.norm == "layernorm" else set()
    assert set(params["final_norm"]) == {"scale"} | bias
    assert all(("bias" in block[name]) == config.mlp_bias for name in mlp)
    assert ("bias" in block["attention"]["query"]) == config.qkv_bias
    assert ("bias" in block["attention"]["out"]) == config.out_bias
    if config.normalize_qk:
        heads = N if config.qk_norm_width == "full" else 1
        kv_heads = (config.num_kv_heads or N) if config.qk_norm_width == "full" else 1
        assert block["attention"]["query_ln"]["scale"].shape == (heads * (config.head_dim or D // N),)
        assert block["attention"]["key_ln"]["scale"].shape == (kv_heads * (config.head_dim or D // N),)
    head_dim = config.head_dim or D // N
    assert block["attention"]["query"]["kernel"].shape == (D, N, head_dim)
    assert block["attention"]["out"]["kernel"].shape == (N, head_dim, D)
    if config.gated_mlp:
        assert block["mlp_gate"]["kernel"].shape == (D, 24)
    nnx_params = nnx.to_pure_dict(nnx.state(qnnx.TransformerLM(config, rngs=nnx.Rngs(0)), nnx.Param))
    assert jax.tree.structure(nnx_params) == jax.tree.structure(params)


# A prompt of 3, one token, then a chunk of 3 that crosses the window of 4: each shape compiles once.
CHUNKS = ((0, 3), (3, 4), (4, 7))


@pytest.mark.parametrize("name", ["qwen3", "olmo2", "gemma2"])
def test_cached_decoding_equals_the_full_pass_linen_and_nnx(name):
    """RoPE (scaled on the global layers, another base on the local ones) and windows on top."""
    config, model, params = built(name)
    config = dataclasses.replace(
        config,
        positions="rope",
        window=(4, None),
        rope_scaling=RopeScaling("linear", 2.0),
        local_rope_base=100.0,
    )
    model = lm.TransformerLM(config)
    params = {k: v for k, v in params.items() if k != "position_embedding"}
    full = jax.jit(model.apply)({"params": params}, TOKENS)
    variables = {"params": params, "cache": lm.init_cache(model, B)}
    steps = []
    decode = jax.jit(functools.partial(model.apply, decode=True, mutable=["cache"]))
    for start, stop in CHUNKS:
        logits, state = decode(variables, TOKENS[:, start:stop])
        variables = {"params": params, "cache": state["cache"]}
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5, rtol=1e-5)
    twin = qnnx.linen_to_nnx({"params": params}, qnnx.TransformerLM(config, rngs=nnx.Rngs(0)))
    twin.init_cache(B)
    nnx_decode = nnx.jit(lambda model, tokens: model(tokens, decode=True))
    nnx_steps = [nnx_decode(twin, TOKENS[:, start:stop]) for start, stop in CHUNKS]
    np.testing.assert_allclose(jnp.concatenate(nnx_steps, axis=1), full, atol=1e-5, rtol=1e-5)
    greedy = lm.generate(model, params, TOKENS[:, :3], 4, rng=jax.random.PRNGKey(0), temperature=0.0)
    np.testing.assert_array_equal(
        qnnx.generate(twin, TOKENS[:, :3], 4, rng=jax.random.PRNGKey(0), temperature=0.0), greedy
    )


def test_the_new_hook_points_carry_their_activations():
    """ln1_post / ln2_post (sandwich), mlp.hook_pre (the gate) and mlp.hook_pre_linear (gated)."""
    config, model, params = built("gemma2")
    names = cache.hook_names(config.num_layers, gated=True, norm_placement="sandwich")
    logits, captured = run_with_cache(model, {"params": params}, TOKENS)
    assert set(captured) == set(names)
    block = f64(params["block_0"])
    h = np.asarray(captured["blocks.0.ln2.hook_normalized"], np.float64) * (1 + block["mlp_norm"]["scale"])
    np.testing.assert_allclose(captured["blocks.0.mlp.hook_pre"], ref_dense(block["mlp_gate"], h), atol=1e-4)
    np.testing.assert_allclose(
        captured["blocks.0.mlp.hook_pre_linear"], ref_dense(block["mlp_in"], h), atol=1e-4
    )
    pre = np.asarray(captured["blocks.0.mlp.hook_pre"], np.float64)
    post = ACTIVATIONS["gelu_tanh"](pre) * np.asarray(captured["blocks.0.mlp.hook_pre_linear"], np.float64)
    np.testing.assert_allclose(captured["blocks.0.mlp.hook_post"], post, atol=1e-4)
    assert captured["blocks.1.ln1_post.hook_scale"].shape == (B, T, 1)
    twin = qnnx.linen_to_nnx({"params": params}, qnnx.TransformerLM(config, rngs=nnx.Rngs(0)))
    nnx_logits, nnx_captured = run_with_cache(twin, None, TOKENS)
    assert set(nnx_captured) == set(captured)
    np.testing.assert_allclose(
        nnx_captured["blocks.0.mlp.hook_pre_linear"], captured["blocks.0.mlp.hook_pre_linear"], atol=1e-6
    )


def test_local_layers_take_the_local_rope_base_and_global_layers_the_scaling():
    scaling = RopeScaling("linear", 2.0)
    config = lm.TransformerConfig(
        **{**BASE, "num_layers": 3}, positions="rope", window=(4, None), rope_base=1e6, local_rope_base=1e4
    )
    local, global_ = lm.attention_options(config, 0), lm.attention_options(config, 1)
    assert (local["rope_base"], global_["rope_base"]) == (1e4, 1e6)
    assert lm.attention_options(config, 2)["rope_base"] == 1e4
    assert lm.attention_options(dataclasses.replace(config, local_rope_base=None), 0)["rope_base"] == 1e6
    scaled = dataclasses.replace(config, rope_scaling=scaling)
    assert lm.attention_options(scaled, 1)["rope_scaling"] == scaling
    assert lm.attention_options(scaled, 0).get("rope_scaling") is None
    assert (
        lm.attention_options(dataclasses.replace(scaled, local_rope_base=None), 0)["rope_scaling"] == scaling
    )


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(norm="batchnorm"), "norm='batchnorm' must be one of layernorm, rms, rms_offset"),
        (dict(norm_epsilon=0.0), "norm_epsilon=0.0 must be a finite number > 0"),
        (dict(norm_epsilon=None), "norm_epsilon=None must be a finite number > 0"),
        (dict(norm_placement="middle"), "norm_placement='middle' must be one of pre, post, sandwich"),
        (dict(parallel_block=1), "parallel_block=1 must be True or False"),
        (dict(mlp_activation="swish"), "mlp_activation='swish' must be one of gelu_tanh, gelu, silu, relu"),
        (dict(gated_mlp="yes"), "gated_mlp='yes' must be True or False"),
        (dict(mlp_bias=None), "mlp_bias=None must be True or False"),
        (dict(qkv_bias=0), "qkv_bias=0 must be True or False"),
        (dict(out_bias="no"), "out_bias='no' must be True or False"),
        (dict(tie_embeddings=1), "tie_embeddings=1 must be True or False"),
        (dict(embedding_scale=-1.0), "embedding_scale=-1.0 must be a finite number > 0"),
        (dict(final_logit_soft_cap=0.0), "final_logit_soft_cap=0.0 must be a finite number > 0"),
        (dict(head_dim=0), "head_dim=0 must be a positive int"),
        (dict(num_heads=3), "num_heads=3 must divide d_model=16 (or set head_dim)"),
        (dict(qk_norm_width="half"), "qk_norm_width='half' must be one of head, full"),
        (dict(rope_scaling=RopeScaling("linear", 2.0)), "rope_scaling=RopeScaling(kind='linear'"),
        (dict(local_rope_base=1e4), "local_rope_base=10000.0 needs positions='rope'"),
        (dict(positions="rope", rope_scaling="linear"), "rope_scaling='linear' must be a qkv_jax.positions"),
        (dict(positions="rope", local_rope_base=-1.0), "local_rope_base=-1.0 must be a finite number > 0"),
    ],
)
def test_config_checks_name_the_field_in_one_line(options, message):
    with pytest.raises(ValueError, match="^TransformerConfig: ") as caught:
        lm.TransformerConfig(**{**BASE, **options})
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_head_dim_lets_num_heads_not_divide_d_model():
    config = lm.TransformerConfig(**{**BASE, "num_heads": 3}, head_dim=4)
    params = lm.TransformerLM(config).init(jax.random.PRNGKey(0), TOKENS)["params"]
    assert params["block_0"]["attention"]["query"]["kernel"].shape == (D, 3, 4)
    assert params["block_0"]["attention"]["out"]["kernel"].shape == (3, 4, D)


@pytest.mark.parametrize(
    "old, new, value", [("sinks", "use_sinks", True), ("dropout_rate", "residual_dropout_rate", 0.25)]
)
def test_the_old_keywords_still_work_with_a_deprecation_warning(old, new, value):
    with pytest.warns(DeprecationWarning, match=f"{old}= is renamed {new}="):
        config = lm.TransformerConfig(**BASE, **{old: value})
    assert getattr(config, new) == value
    with pytest.warns(DeprecationWarning, match=f"{old}= is renamed {new}="):
        replaced = dataclasses.replace(config, **{old: type(value)(0)})
    assert getattr(replaced, new) == type(value)(0)
    with pytest.warns(DeprecationWarning, match=f"TransformerConfig.{old} is renamed {new}"):
        assert getattr(config, old) == value


def test_the_model_section_sets_every_new_option_and_leaves_the_rest_at_their_defaults():
    """configs/common.py adds every TransformerConfig field it does not spell out, unset; the
    launcher parses the ones spelled as words (rope_scaling as "kind,factor,name=value")."""
    section = common.transformer(num_layers=2, d_model=D, num_heads=N, max_len=MAX_LEN)
    assert set(model_fields()) <= set(section.keys())
    assert transformer_config(section.to_dict(), VOCAB) == lm.TransformerConfig(**{**BASE, "mlp_dim": None})
    section.update(
        norm="rms_offset",
        norm_placement="sandwich",
        gated_mlp=True,
        tie_embeddings=True,
        head_dim=8,
        positions="rope",
        rope_scaling="llama3,8,original_max_len=64,high_freq_factor=2",
        local_rope_base=100.0,
        normalize_qk="rms_offset",
        window="4,full",
    )
    config = transformer_config(section.to_dict(), VOCAB)
    assert config.rope_scaling == RopeScaling("llama3", 8.0, original_max_len=64, high_freq_factor=2.0)
    assert (config.norm, config.norm_placement, config.gated_mlp, config.head_dim) == (
        "rms_offset",
        "sandwich",
        True,
        8,
    )
    assert (config.tie_embeddings, config.local_rope_base, config.normalize_qk) == (True, 100.0, "rms_offset")
    section.update(rope_scaling="cubic,2")
    with pytest.raises(ConfigError, match=r"^model.rope_scaling='cubic,2': expected 'kind,factor'"):
        transformer_config(section.to_dict(), VOCAB)
    section.update(rope_scaling=None, norm="l2")
    with pytest.raises(ConfigError, match=r"^model.norm='l2' must be one of layernorm, rms, rms_offset$"):
        transformer_config(section.to_dict(), VOCAB)


@pytest.mark.parametrize(
    "old, new, value", [("sinks", "use_sinks", True), ("dropout_rate", "residual_dropout_rate", 0.25)]
)
def test_the_model_section_s_old_names_still_work_with_a_deprecation_warning(old, new, value):
    section = common.transformer(num_layers=2, d_model=D, num_heads=N, max_len=MAX_LEN).to_dict()
    section[old] = value
    with pytest.warns(DeprecationWarning, match=f"model.{old} is renamed model.{new}"):
        config = transformer_config(section, VOCAB)
    assert getattr(config, new) == value
