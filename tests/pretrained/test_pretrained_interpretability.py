"""The interpretability tools on checkpoints loaded by `qkv_jax.pretrained`.

Tiny random transformers models (tests/pretrained/test_pretrained_families.py's `build`) of
Llama (gated MLP, RMSNorm, GQA, biases), Gemma 2 (sandwich norms, rms_offset,
soft caps, tied head, embedding_scale, head_dim != d_model / num_heads), GPT-NeoX
(parallel block, LayerNorm eps 1e-5) and OLMo 2 (post norms, full-width QK-norm):
  - run_with_cache: every hook's shape is HOOK_SHAPES's, the norms' hooks are there
    under TransformerLens's names, the last hook_resid_post through the final norm
    and the head is the logits (transformers' too), run_with_hooks changes them;
  - patching_sweep over (layer, head): an entry is one run_with_hooks patched run;
  - logit lens and direct logit attribution for the RMS norms, a tied head,
    embedding_scale and a soft cap, against a float64 computation; what they refuse;
  - circuits: W_QK, W_OV, biases and composition from the parameter tree by hand
    (GQA, head_dim, biases or none); QK-norm and RMS folding refused;
  - to_transformer_lens on a loaded GPT-2: refused, naming the options.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_pretrained_families import build, compile_once

from qkv_jax import lm
from qkv_jax.interpretability import (
    HOOK_SHAPES,
    attribution,
    circuits,
    hook_names,
    patching_sweep,
    replace,
    run_with_cache,
    run_with_hooks,
)
from qkv_jax.norms import normalize

FAMILIES = ["llama", "gemma2", "gpt_neox", "olmo2"]
PARAMS = [FAMILIES[0], *(pytest.param(name, marks=pytest.mark.slow) for name in FAMILIES[1:])]
TOLERANCE = 1e-5  # of the largest |logit|


@dataclasses.dataclass
class Loaded:
    """A loaded model, its variables, transformers' logits and the model's own logits and cache."""

    name: str
    config: lm.TransformerConfig
    model: lm.TransformerLM
    variables: dict
    tokens: jax.Array  # (2, T)
    hf_logits: np.ndarray  # (2, T, V)
    logits: np.ndarray  # (2, T, V)
    cache: dict


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    """name -> Loaded, each family built, loaded and run once for the module."""

    @functools.cache
    def loaded(name: str) -> Loaded:
        built = build(name, tmp_path_factory.mktemp(name))
        model = lm.TransformerLM(built.config)
        variables = {"params": built.params}
        tokens = jnp.asarray(built.tokens)
        logits, cache = compile_once(functools.partial(run_with_cache, model))(variables, tokens)
        cache = {key: np.asarray(value) for key, value in cache.items()}
        return Loaded(name, built.config, model, variables, tokens, built.logits, np.asarray(logits), cache)

    return loaded


def expected_shape(template: str, config: lm.TransformerConfig, batch: int, length: int) -> tuple:
    """HOOK_SHAPES's `[..., T, N, H]` with the model's sizes (every head's pattern)."""
    head = lm.head_dim_of(config)
    sizes = {
        "...": (batch,),
        "T": (length,),
        "S": (length,),
        "D": (config.d_model,),
        "N": (config.num_heads,),
        "n": (config.num_heads,),
        "K": (config.num_kv_heads or config.num_heads,),
        "H": (head,),
        "Hv": (head,),
        "M": (config.mlp_dim or 4 * config.d_model,),
        "1": (1,),
    }
    dims = HOOK_SHAPES[template].split("]")[0].lstrip("[").split(", ")
    return sum((sizes[dim] for dim in dims), ())


def final_logits(loaded: Loaded, residual: np.ndarray) -> np.ndarray:
    """The final norm, the head (or the tied embedding) and the soft cap of `residual` `[..., D]`."""
    config, params = loaded.config, loaded.variables["params"]
    norm = params["final_norm"]
    x = normalize(
        jnp.asarray(residual),
        kind=config.norm,
        epsilon=config.norm_epsilon,
        scale=norm["scale"],
        bias=norm.get("bias"),
    )
    logits = np.asarray(jnp.matmul(x, circuits.unembedding(params), precision="highest"))
    cap = config.final_logit_soft_cap
    return logits if cap is None else cap * np.tanh(logits / cap)


def relative_error(ours, theirs) -> float:
    return float(np.max(np.abs(np.asarray(ours) - theirs)) / np.max(np.abs(theirs)))


# ------------------------------------------------------------------------------ run_with_cache


@pytest.mark.parametrize("name", PARAMS)
def test_cache_has_every_hook_in_its_shape_and_reproduces_the_logits(load, name):
    loaded = load(name)
    config, cache = loaded.config, loaded.cache
    assert relative_error(loaded.logits, loaded.hf_logits) <= TOLERANCE
    names = set(hook_names(config.num_layers, gated=config.gated_mlp, norm_placement=config.norm_placement))
    names.discard("hook_pos_embed")  # RoPE: no position table
    assert set(cache) == names
    batch, length = loaded.tokens.shape
    for key, value in cache.items():
        template = key if key in HOOK_SHAPES else "blocks.{l}." + key.split(".", 2)[2]
        assert value.shape == expected_shape(template, config, batch, length), key
    new_norm_hooks = {
        "llama": ["ln1.hook_scale", "ln1.hook_normalized", "ln2.hook_scale", "mlp.hook_pre_linear"],
        "gemma2": [
            "ln1.hook_scale",
            "ln1_post.hook_scale",
            "ln2_post.hook_normalized",
            "mlp.hook_pre_linear",
        ],
        "gpt_neox": ["ln1.hook_scale", "ln2.hook_normalized"],
        "olmo2": ["ln1_post.hook_scale", "ln1_post.hook_normalized", "ln2_post.hook_scale"],
    }[name]
    last = config.num_layers - 1
    assert all(f"blocks.{last}.{hook}" in cache for hook in new_norm_hooks)
    assert "ln_final.hook_scale" in cache and "ln_final.hook_normalized" in cache
    if config.norm_placement == "post":
        assert "blocks.0.ln1.hook_scale" not in cache
    # The last block's residual through the final norm and the head is the logits.
    through = final_logits(loaded, cache[f"blocks.{last}.hook_resid_post"])
    assert relative_error(through, loaded.logits) <= TOLERANCE
    # The norms' hooks are their statistics: RMS kinds x / sqrt(mean(x^2) + eps).
    resid = cache[f"blocks.{last}.hook_resid_post"].astype(np.float64)
    if config.norm != "layernorm":
        want = np.sqrt(np.mean(resid**2, axis=-1, keepdims=True) + config.norm_epsilon)
    else:
        centred = resid - resid.mean(-1, keepdims=True)
        want = np.sqrt(np.mean(centred**2, axis=-1, keepdims=True) + config.norm_epsilon)
    np.testing.assert_allclose(cache["ln_final.hook_scale"], want, rtol=1e-5)
    # Block structure read off the cache: a parallel block adds both sublayers to its input.
    block = {key.split(".", 2)[2]: cache[key] for key in cache if key.startswith(f"blocks.{last}.")}
    mid_or_pre = block["hook_resid_pre"] if config.parallel_block else block["hook_resid_mid"]
    np.testing.assert_allclose(
        block["hook_resid_post"],
        mid_or_pre + block["hook_mlp_out"] + (block["hook_attn_out"] if config.parallel_block else 0),
        atol=1e-5,
    )
    if config.norm_placement != "pre":  # the attention output is the post norm's output
        gain = np.asarray(loaded.variables["params"][f"block_{last}"]["attention_post_norm"]["scale"])
        gain = 1.0 + gain if config.norm == "rms_offset" else gain
        np.testing.assert_allclose(
            block["hook_attn_out"], block["ln1_post.hook_normalized"] * gain, atol=1e-5
        )


@pytest.mark.parametrize("name", PARAMS)
def test_run_with_hooks_changes_the_named_activations(load, name):
    loaded = load(name)
    config, cache = loaded.config, loaded.cache
    # Freezing the final norm's scale at its cached value leaves the logits as they are.
    frozen_scale = cache["ln_final.hook_scale"]
    hooks = {"ln_final.hook_scale": lambda x, name: jnp.asarray(frozen_scale)}
    frozen = run_with_hooks(loaded.model, loaded.variables, loaded.tokens, hooks=hooks)
    assert relative_error(frozen, loaded.logits) <= TOLERANCE
    # Zeroing the MLP's hidden units of layer 0 makes its output mlp_out's bias (zero without one).
    hidden = "blocks.0.mlp.hook_pre_linear" if config.gated_mlp else "blocks.0.mlp.hook_post"
    _, changed = run_with_cache(
        loaded.model,
        loaded.variables,
        loaded.tokens,
        hooks={hidden: lambda x, name: jnp.zeros_like(x)},
        names_filter=["blocks.0.hook_mlp_out", "blocks.0.hook_resid_pre"],
    )
    mlp_out = loaded.variables["params"]["block_0"]["mlp_out"]
    bias = np.asarray(mlp_out.get("bias", np.zeros(config.d_model)))
    if config.norm_placement != "pre":  # then the post norm of that constant
        row = jnp.broadcast_to(jnp.asarray(bias), (config.d_model,))
        norm = loaded.variables["params"]["block_0"]["mlp_post_norm"]
        bias = np.asarray(
            normalize(row + 0.0, kind=config.norm, epsilon=config.norm_epsilon, scale=norm["scale"])
        )
    out = np.asarray(changed["blocks.0.hook_mlp_out"])
    np.testing.assert_allclose(out, np.broadcast_to(bias, out.shape), atol=1e-5)
    np.testing.assert_array_equal(changed["blocks.0.hook_resid_pre"], cache["blocks.0.hook_resid_pre"])


# ------------------------------------------------------------------------------ patching


def logit_difference(logits):
    """Mean over the batch of logit(3) - logit(5) at the last position."""
    return jnp.mean(logits[:, -1, 3] - logits[:, -1, 5])


def test_head_sweep_entry_is_one_patched_run(load):
    loaded = load("llama")
    config = loaded.config
    corrupted = jnp.roll(loaded.tokens, 1, axis=-1)
    sweep = patching_sweep(loaded.model, loaded.variables, corrupted, loaded.cache, logit_difference)
    assert sweep.shape == (config.num_layers, config.num_heads)
    layer, head = 1, 2
    name = f"blocks.{layer}.attn.hook_z"
    hooks = {name: replace(loaded.cache[name], heads=head)}
    single = logit_difference(run_with_hooks(loaded.model, loaded.variables, corrupted, hooks=hooks))
    np.testing.assert_allclose(sweep[layer, head], single, atol=1e-5)
    unpatched = logit_difference(run_with_hooks(loaded.model, loaded.variables, corrupted, hooks={}))
    assert np.max(np.abs(np.asarray(sweep) - unpatched)) > 1e-3  # the patches do something


# ------------------------------------------------------------------------------ attribution


def gemma_like(load) -> Loaded:
    """Gemma 2's options but pre norms (rms_offset, soft cap 4, tied head, embedding_scale
    sqrt(24)), the loaded parameters without the post norms, every norm gain random."""
    gemma = load("gemma2")
    config = dataclasses.replace(gemma.config, norm_placement="pre")
    params = jax.tree.map(lambda x: x, gemma.variables["params"])
    for layer in range(config.num_layers):
        block = dict(params[f"block_{layer}"])
        block.pop("attention_post_norm")
        block.pop("mlp_post_norm")
        params[f"block_{layer}"] = block
    model = lm.TransformerLM(config)
    variables = {"params": params}
    logits, cache = compile_once(functools.partial(run_with_cache, model))(variables, gemma.tokens)
    cache = {key: np.asarray(value) for key, value in cache.items()}
    return Loaded(
        "gemma_pre", config, model, variables, gemma.tokens, gemma.hf_logits, np.asarray(logits), cache
    )


def direct_float64(loaded: Loaded, answer: int, contrast: int) -> tuple[np.ndarray, np.ndarray]:
    """logit(answer) - logit(contrast) before the soft cap `[B, T]` with the final norm's cached
    scale, and head (L-1, 0)'s share of it, computed in float64 from the cache and the params."""
    config, params = (
        loaded.config,
        jax.tree.map(lambda x: np.asarray(x, np.float64), loaded.variables["params"]),
    )
    last = config.num_layers - 1
    resid = loaded.cache[f"blocks.{last}.hook_resid_post"].astype(np.float64)  # (B, T, D)
    scale = loaded.cache["ln_final.hook_scale"].astype(np.float64)  # (B, T, 1)
    gain = params["final_norm"]["scale"] + (1.0 if config.norm == "rms_offset" else 0.0)
    W_U = params["head"]["kernel"] if "head" in params else params["token_embedding"]["embedding"].T
    direction = W_U[:, answer] - W_U[:, contrast]  # (D,)

    def through(x, with_bias):
        if config.norm == "layernorm":
            x = x - x.mean(-1, keepdims=True)
        y = x / scale * gain
        if config.norm == "layernorm" and with_bias:
            y = y + params["final_norm"]["bias"]
        return y @ direction

    z = loaded.cache[f"blocks.{last}.attn.hook_z"].astype(np.float64)[..., 0, :]  # (B, T, H)
    head = z @ params[f"block_{last}"]["attention"]["out"]["kernel"][0]  # (B, T, D)
    return through(resid, True), through(head, False)


@pytest.mark.parametrize("name", ["llama", pytest.param("gpt_neox", marks=pytest.mark.slow), "gemma_pre"])
def test_direct_logit_attribution_sums_to_the_logit_before_the_cap(load, name):
    loaded = gemma_like(load) if name == "gemma_pre" else load(name)
    config = loaded.config
    answer, contrast = 3, 5
    rows, labels = attribution.direct_logit_attribution(
        loaded.cache, loaded.variables["params"], answer, contrast, config=config
    )
    want, head = direct_float64(loaded, answer, contrast)
    assert rows.shape == (len(labels), *loaded.tokens.shape)
    total = np.asarray(rows, np.float64).sum(0)
    np.testing.assert_allclose(total, want, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(rows[labels.index(f"L{config.num_layers - 1}H0")], head, atol=1e-5)
    # The model's logits are the cap of that sum; without the frozen scale in the cache the same.
    logits = loaded.logits[..., answer] - loaded.logits[..., contrast]
    cap = config.final_logit_soft_cap
    if cap is None:
        np.testing.assert_allclose(total, logits, atol=1e-5 * np.abs(logits).max())
    else:
        capped = np.asarray(loaded.logits, np.float64)
        pre = cap * np.arctanh(capped / cap)
        np.testing.assert_allclose(total, pre[..., answer] - pre[..., contrast], atol=1e-4)
    unfrozen = {key: value for key, value in loaded.cache.items() if key != "ln_final.hook_scale"}
    recomputed, _ = attribution.direct_logit_attribution(
        unfrozen, loaded.variables["params"], answer, contrast, config=config
    )
    np.testing.assert_allclose(recomputed, rows, atol=1e-5)
    if config.norm != "layernorm":
        assert "pos_embed" not in labels and np.all(np.asarray(rows[-1]) == 0)  # no bias row content
    # The logit lens's last row is the logits (after the cap), its rows the final norm of each.
    lens, lens_labels = attribution.logit_lens(loaded.cache, loaded.variables["params"], config=config)
    assert lens_labels[-1] == "final_post"
    assert relative_error(lens[-1], loaded.logits) <= TOLERANCE
    np.testing.assert_allclose(
        lens[0], final_logits(loaded, loaded.cache["blocks.0.hook_resid_pre"]), atol=1e-5
    )


def test_attribution_refuses_post_norms_and_an_rms_norm_it_cannot_name(load):
    llama = load("llama")
    with pytest.raises(ValueError, match=r"config="):
        attribution.direct_logit_attribution(llama.cache, llama.variables["params"], 3)
    with pytest.raises(ValueError, match=r"config="):
        attribution.logit_lens(llama.cache, llama.variables["params"])
    gemma = load("gemma2")
    with pytest.raises(ValueError, match=r"attention_post_norm, mlp_post_norm"):
        attribution.direct_logit_attribution(gemma.cache, gemma.variables["params"], 3, config=gemma.config)
    with pytest.raises(ValueError, match=r"norm_placement"):
        attribution.residual_decomposition(gemma.cache, gemma.variables["params"])


# ------------------------------------------------------------------------------ circuits


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_circuits_read_the_loaded_kernels(load, name):
    loaded = load(name)
    config = loaded.config
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), loaded.variables["params"])
    weights = circuits.head_weights(loaded.variables)
    N, K, H = config.num_heads, config.num_kv_heads or config.num_heads, lm.head_dim_of(config)
    L, D = config.num_layers, config.d_model
    assert weights.W_Q.shape == (L, N, D, H) and weights.W_O.shape == (L, N, H, D)
    qk, ov = np.asarray(circuits.qk_matrices(weights)), np.asarray(circuits.ov_matrices(weights))
    for layer in range(L):
        attention = params[f"block_{layer}"]["attention"]
        for n in range(N):
            kv = n // (N // K)
            q, k = attention["query"]["kernel"][:, n], attention["key"]["kernel"][:, kv]  # (D, H)
            v, o = attention["value"]["kernel"][:, kv], attention["out"]["kernel"][n]  # (D, H), (H, D)
            np.testing.assert_allclose(qk[layer, n], q @ k.T, atol=1e-5)
            np.testing.assert_allclose(ov[layer, n], v @ o, atol=1e-5)
            for field, projection, index in (("b_Q", "query", n), ("b_K", "key", kv), ("b_V", "value", kv)):
                bias = attention[projection].get("bias", np.zeros((K if index == kv else N, H)))[index]
                np.testing.assert_allclose(getattr(weights, field)[layer, n], bias, atol=1e-7)
        np.testing.assert_allclose(weights.b_O[layer], attention["out"].get("bias", np.zeros(D)), atol=1e-7)
    scores = np.asarray(circuits.composition_scores(weights, "Q"))
    assert scores.shape == (L, N, L, N)
    first, second = qk[1, 2], ov[0, 1]
    want = np.linalg.norm(second @ first) / (np.linalg.norm(second) * np.linalg.norm(first))
    np.testing.assert_allclose(scores[0, 1, 1, 2], want, rtol=1e-4)
    assert np.all(scores[1, :, 0, :] == 0)
    embeddings = circuits.embedding_weights(loaded.variables, embedding_scale=config.embedding_scale)
    W_E = params["token_embedding"]["embedding"] * (config.embedding_scale or 1.0)
    np.testing.assert_allclose(embeddings.W_E, W_E, rtol=1e-6)
    np.testing.assert_allclose(embeddings.W_U, np.asarray(circuits.unembedding(loaded.variables)))
    if config.tie_embeddings:
        np.testing.assert_array_equal(embeddings.W_U, params["token_embedding"]["embedding"].T)
    assert embeddings.W_pos.shape == (0, D)  # RoPE: no table
    with pytest.raises(ValueError, match=r"RMS"):
        circuits.head_weights(loaded.variables, fold_layer_norm=True)


def test_circuits_refuse_qk_norm(load):
    olmo = load("olmo2")
    with pytest.raises(ValueError, match=r"normalize_qk"):
        circuits.head_weights(olmo.variables)


# ------------------------------------------------------------------------------ TransformerLens


def test_to_transformer_lens_refuses_a_loaded_gpt2_naming_its_options(load):
    pytest.importorskip("transformer_lens")
    from qkv_jax.interpretability import tl

    gpt2 = load("gpt2")
    with pytest.raises(ValueError, match=r"norm_epsilon=1e-05.*tie_embeddings=True") as refused:
        tl.to_transformer_lens(gpt2.model, gpt2.variables["params"])
    message = str(refused.value)
    for allowed in ("positions=", "window=", "normalize_qk=", "norm='", "parallel_block", "gated_mlp"):
        assert allowed not in message  # only what this GPT-2 sets differently is named
