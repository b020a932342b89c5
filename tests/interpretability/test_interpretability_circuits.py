"""qkv_jax.interpretability against float64 NumPy: circuits of the learned matrices, attribution.

`reference_forward` is an independent float64 forward pass of a TransformerLM
that names every activation as TransformerLens does; the attribution
functions read its cache, and tests/interpretability/test_transformer_lens_parity.py uses it
to check TransformerLens's own activations on the converted model.
"""

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkv_jax.interpretability import attribution, cache, circuits
from qkv_jax.lm import TransformerConfig, TransformerLM
from qkv_jax.lora import merge_lora

EPS = 1e-6
VOCAB, LENGTH, BATCH = 11, 8, 3
CONFIGS = {
    "mha": TransformerConfig(vocab_size=VOCAB, num_layers=2, d_model=32, num_heads=4, max_len=LENGTH),
    "gqa": TransformerConfig(
        vocab_size=VOCAB, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, max_len=LENGTH
    ),
    "mla_lora": TransformerConfig(
        vocab_size=VOCAB,
        num_layers=2,
        d_model=32,
        num_heads=4,
        num_kv_heads=2,
        kv_latent_dim=6,
        max_len=LENGTH,
        lora_rank=2,
        lora_alpha=4.0,
        lora_targets=("query", "kv_latent", "value", "out"),
    ),
}


def model_params(config, seed=0):
    """Random parameters of the model's shapes (from `jax.eval_shape` of its init, so nothing
    compiles): kernels and LoRA factors normal with variance 1/fan_in, biases 0.1 N(0, 1),
    LayerNorm scales 1 + 0.1 N(0, 1), embeddings 0.5 N(0, 1); none trivially zero or one."""
    shapes = jax.eval_shape(
        TransformerLM(config).init, jax.random.PRNGKey(0), jnp.zeros((1, LENGTH), jnp.int32)
    )["params"]
    rng = np.random.default_rng(seed)

    def draw(path, shape):
        name, normal = path[-1].key, rng.normal(size=shape.shape)
        if name in ("kernel", "lora_a", "lora_b"):
            return normal / np.sqrt(shape.shape[0])
        if name == "scale":
            return 1.0 + 0.1 * normal
        return (0.1 if name == "bias" else 0.5) * normal

    return jax.tree_util.tree_map_with_path(lambda path, s: jnp.asarray(draw(path, s), jnp.float32), shapes)


def tokens_for(seed=2):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(BATCH, LENGTH))


def _f64(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _kernel(projection, alpha):
    """W, or W + (alpha / r) A B for a projection with a LoRA adapter (float64)."""
    kernel = projection["kernel"]
    if "lora_a" in projection:
        a, b = projection["lora_a"], projection["lora_b"]
        kernel = kernel + alpha / a.shape[-1] * np.tensordot(a, b, axes=1)
    return kernel


def _layer_norm(x, norm):
    centred = x - x.mean(-1, keepdims=True)
    scale = np.sqrt((centred**2).mean(-1, keepdims=True) + EPS)
    return centred / scale, scale, centred / scale * norm["scale"] + norm["bias"]


def _gelu(x):  # the tanh approximation (flax's nn.gelu default)
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def reference_forward(config, params, tokens):
    """float64 logits `[B, T, V]` and every activation by its TransformerLens name."""
    p, alpha = _f64(params), config.lora_alpha
    B, T = tokens.shape
    N = config.num_heads
    H = config.d_model // N
    group = N // (config.num_kv_heads or N)
    acts = {"hook_embed": p["token_embedding"]["embedding"][tokens]}
    acts["hook_pos_embed"] = np.broadcast_to(p["position_embedding"][:T], acts["hook_embed"].shape)
    x = acts["hook_embed"] + acts["hook_pos_embed"]
    for layer in range(config.num_layers):
        block, name = p[f"block_{layer}"], f"blocks.{layer}."
        att = block["attention"]
        acts[name + "hook_resid_pre"] = x
        normalized, scale, h = _layer_norm(x, block["attention_norm"])
        acts[name + "ln1.hook_normalized"], acts[name + "ln1.hook_scale"] = normalized, scale
        q = np.einsum("btd,dnh->btnh", h, _kernel(att["query"], alpha)) + att["query"]["bias"]
        source = h
        if "kv_latent" in att:
            source = acts[name + "attn.hook_kv_latent"] = (
                h @ _kernel(att["kv_latent"], alpha) + att["kv_latent"]["bias"]
            )
        k = np.einsum("btc,ckh->btkh", source, _kernel(att["key"], alpha)) + att["key"]["bias"]
        v = np.einsum("btc,ckh->btkh", source, _kernel(att["value"], alpha)) + att["value"]["bias"]
        scores = np.empty((B, N, T, T))
        for n in range(N):
            scores[:, n] = np.einsum("bth,bsh->bts", q[:, :, n], k[:, :, n // group]) / np.sqrt(H)
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
        pattern = np.exp(scores - scores.max(-1, keepdims=True))
        pattern /= pattern.sum(-1, keepdims=True)
        z = np.stack([pattern[:, n] @ v[:, :, n // group] for n in range(N)], axis=2)  # (B, T, N, H)
        out_kernel = _kernel(att["out"], alpha)  # (N, H, D)
        result = np.stack([z[:, :, n] @ out_kernel[n] for n in range(N)], axis=2)  # (B, T, N, D)
        acts |= {
            name + "attn.hook_q": q,
            name + "attn.hook_k": k,
            name + "attn.hook_v": v,
            name + "attn.hook_attn_scores": scores,
            name + "attn.hook_pattern": pattern,
            name + "attn.hook_z": z,
            name + "attn.hook_result": result,
        }
        acts[name + "hook_attn_out"] = result.sum(2) + att["out"]["bias"]
        x = acts[name + "hook_resid_mid"] = x + acts[name + "hook_attn_out"]
        normalized, scale, h = _layer_norm(x, block["mlp_norm"])
        acts[name + "ln2.hook_normalized"], acts[name + "ln2.hook_scale"] = normalized, scale
        pre = h @ block["mlp_in"]["kernel"] + block["mlp_in"]["bias"]
        acts[name + "mlp.hook_pre"], acts[name + "mlp.hook_post"] = pre, _gelu(pre)
        acts[name + "hook_mlp_out"] = _gelu(pre) @ block["mlp_out"]["kernel"] + block["mlp_out"]["bias"]
        x = acts[name + "hook_resid_post"] = x + acts[name + "hook_mlp_out"]
    normalized, scale, h = _layer_norm(x, p["final_norm"])
    acts["ln_final.hook_normalized"], acts["ln_final.hook_scale"] = normalized, scale
    return h @ p["head"]["kernel"], acts


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request):
    config = CONFIGS[request.param]
    params = model_params(config)
    tokens = tokens_for()
    logits, acts = reference_forward(config, params, tokens)
    return config, params, tokens, logits, acts


def _weights(config, params, **kwargs):
    return circuits.head_weights(params, lora_alpha=config.lora_alpha, **kwargs)


def test_reference_forward_matches_the_model(case):
    config, params, tokens, logits, _ = case
    np.testing.assert_allclose(TransformerLM(config).apply({"params": params}, tokens), logits, atol=1e-5)


# --- head weights --------------------------------------------------------------------


def test_head_weights_compute_each_heads_queries_keys_and_values(case):
    config, params, _, _, acts = case
    weights = _f64(_weights(config, params))
    L, N = config.num_layers, config.num_heads
    assert weights.W_Q.shape == (L, N, 32, 8) and weights.W_O.shape == (L, N, 8, 32)
    group = N // (config.num_kv_heads or N)
    for layer in range(L):
        name = f"blocks.{layer}."
        # The attention LayerNorm's output, which the projections read.
        norm = params[f"block_{layer}"]["attention_norm"]
        h = acts[name + "ln1.hook_normalized"] * np.asarray(norm["scale"]) + np.asarray(norm["bias"])
        for n in range(N):
            q = h @ weights.W_Q[layer, n] + weights.b_Q[layer, n]
            k = h @ weights.W_K[layer, n] + weights.b_K[layer, n]
            v = h @ weights.W_V[layer, n] + weights.b_V[layer, n]
            np.testing.assert_allclose(q, acts[name + "attn.hook_q"][:, :, n], atol=1e-5)
            np.testing.assert_allclose(k, acts[name + "attn.hook_k"][:, :, n // group], atol=1e-5)
            np.testing.assert_allclose(v, acts[name + "attn.hook_v"][:, :, n // group], atol=1e-5)
            np.testing.assert_allclose(
                acts[name + "attn.hook_z"][:, :, n] @ weights.W_O[layer, n],
                acts[name + "attn.hook_result"][:, :, n],
                atol=1e-5,
            )


def test_folded_layer_norm_reads_the_normalised_residual(case):
    config, params, _, logits, acts = case
    weights = _f64(_weights(config, params, fold_layer_norm=True))
    for layer in range(config.num_layers):
        name = f"blocks.{layer}."
        x_hat = acts[name + "ln1.hook_normalized"]
        np.testing.assert_allclose(
            np.einsum("btd,ndh->btnh", x_hat, weights.W_Q[layer]) + weights.b_Q[layer],
            acts[name + "attn.hook_q"],
            atol=1e-5,
        )
        np.testing.assert_allclose(weights.W_K[layer].mean(axis=1), 0.0, atol=1e-6)  # centred over D
    embeddings = _f64(circuits.embedding_weights(params, fold_layer_norm=True))
    np.testing.assert_allclose(
        acts["ln_final.hook_normalized"] @ embeddings.W_U + embeddings.b_U, logits, atol=1e-5
    )


def test_lora_adapters_are_added_to_the_kernels():
    config = CONFIGS["mla_lora"]
    params = model_params(config)
    merged = circuits.head_weights(merge_lora(params, config.lora_alpha))
    for got, want in zip(_weights(config, params), merged, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    with pytest.raises(ValueError, match="lora_alpha"):
        circuits.head_weights(params)
    with pytest.raises(ValueError, match="TransformerLM's parameters"):
        circuits.head_weights({"query": {}})


@pytest.mark.slow
def test_head_weights_scores_and_attribution_under_jit(case):
    config, params, _, _, acts = case
    eager = _weights(config, params, fold_layer_norm=True)
    jitted = jax.jit(circuits.head_weights, static_argnames="fold_layer_norm")(
        params, lora_alpha=config.lora_alpha, fold_layer_norm=True
    )
    for got, want in zip(jitted, eager, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(
        jax.jit(circuits.composition_scores, static_argnames="mode")(eager, mode="K"),
        circuits.composition_scores(eager, "K"),
        atol=1e-6,
    )
    answer = np.array([[1], [2], [3]])
    attribute = functools.partial(attribution.direct_logit_attribution, lora_alpha=config.lora_alpha)
    np.testing.assert_allclose(
        jax.jit(lambda *args: attribute(*args)[0])(acts, params, answer),
        attribute(acts, params, answer)[0],
        atol=1e-5,
    )


# --- circuits ----------------------------------------------------------------------


def _full_circuits(weights):
    """float64 W_QK and W_OV `[L, N, D, D]`."""
    w = _f64(weights)
    qk = np.einsum("lndh,lneh->lnde", w.W_Q, w.W_K)
    ov = np.einsum("lndh,lnhe->lnde", w.W_V, w.W_O)
    return qk, ov


def test_qk_and_ov_matrices_and_their_singular_values(case):
    config, params, _, _, _ = case
    weights = _weights(config, params)
    qk, ov = _full_circuits(weights)
    np.testing.assert_allclose(circuits.qk_matrices(weights), qk, atol=1e-5)
    np.testing.assert_allclose(circuits.ov_matrices(weights), ov, atol=1e-5)
    H = weights.W_Q.shape[-1]
    for got, full in ((circuits.qk_singular_values(weights), qk), (circuits.ov_singular_values(weights), ov)):
        want = np.linalg.svd(full, compute_uv=False)[..., :H]  # rank <= H: the rest are zero
        # Relative to each head's largest value (float32 resolves the smallest, zero for an
        # MLA head whose latent is narrower than H, only to ~1e-7 of it).
        largest = want[..., :1]
        np.testing.assert_allclose(got / largest, want / largest, atol=1e-6)
        rank = circuits.effective_rank(got)
        p = want / want.sum(-1, keepdims=True)
        np.testing.assert_allclose(rank, np.exp(-(p * np.log(p)).sum(-1)), rtol=1e-5)


def test_effective_rank_counts_equal_singular_values():
    values = jnp.array(
        [[1.0, 1.0, 1.0, 0.0], [5.0, 0.0, 0.0, 0.0], [2.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    )
    p = np.array([2.0, 1.0]) / 3.0
    np.testing.assert_allclose(
        circuits.effective_rank(values), [3.0, 1.0, np.exp(-(p * np.log(p)).sum()), 1.0], rtol=1e-6
    )


@pytest.mark.parametrize("mode", ["Q", "K", "V"])
def test_composition_scores_match_the_full_matrices(case, mode):
    config, params, _, _, _ = case
    weights = _weights(config, params)
    qk, ov = _full_circuits(weights)
    right = {"Q": qk, "K": np.swapaxes(qk, -1, -2), "V": ov}[mode]
    L, N = qk.shape[:2]
    want = np.zeros((L, N, L, N))
    for l1, h1, l2, h2 in np.ndindex(L, N, L, N):
        if l1 < l2:
            product = np.linalg.norm(ov[l1, h1] @ right[l2, h2])
            want[l1, h1, l2, h2] = product / np.linalg.norm(ov[l1, h1]) / np.linalg.norm(right[l2, h2])
    got = circuits.composition_scores(weights, mode)
    assert np.all(want[1, :, 1, :] == 0) and np.all(want[0, :, 1, :] > 0)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_composition_scores_name_a_bad_mode(case):
    config, params, _, _, _ = case
    with pytest.raises(ValueError, match="mode must be 'Q', 'K' or 'V', got 'O'"):
        circuits.composition_scores(_weights(config, params), "O")


def test_token_circuits_and_copying_scores(case):
    config, params, _, _, _ = case
    weights = _weights(config, params)
    embeddings = circuits.embedding_weights(params)
    E, P, U = (np.asarray(x, np.float64) for x in (embeddings.W_E, embeddings.W_pos, embeddings.W_U))
    qk, ov = _full_circuits(weights)
    for layer, head in ((0, 1), (1, 3)):
        np.testing.assert_allclose(
            circuits.token_qk_circuit(weights, layer, head, embeddings.W_E, embeddings.W_pos),
            E @ qk[layer, head] @ P.T,
            atol=1e-5,
        )
        np.testing.assert_allclose(
            circuits.token_ov_circuit(weights, layer, head, embeddings.W_E, embeddings.W_U),
            E @ ov[layer, head] @ U,
            atol=1e-5,
        )
    # Traced (layer, head): one program for every head.
    heads = jnp.arange(config.num_heads)
    per_head = jax.jit(
        jax.vmap(lambda h: circuits.token_qk_circuit(weights, 1, h, embeddings.W_E, embeddings.W_E))
    )(heads)
    np.testing.assert_allclose(per_head, np.einsum("vd,nde,we->nvw", E, qk[1], E), atol=1e-5)
    eigenvalues = np.linalg.eigvals(np.einsum("vd,lnde,ew->lnvw", E, ov, U))  # (L, N, V)
    want = eigenvalues.real.sum(-1) / np.abs(eigenvalues).sum(-1)
    np.testing.assert_allclose(
        circuits.copying_scores(weights, embeddings.W_E, embeddings.W_U), want, atol=1e-5
    )


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_copying_score_is_one_for_a_copying_head_and_minus_one_for_its_opposite(sign):
    """W_OV = +-A A^T with W_E = W_U = I: every eigenvalue is >= 0 (or <= 0)."""
    A = jnp.asarray(np.random.default_rng(3).normal(size=(1, 1, 6, 3)), jnp.float32)  # (L, N, D, Hv)
    zero = jnp.zeros((1, 1, 6, 3))
    bias = jnp.zeros((1, 1, 3))
    W_O = sign * jnp.swapaxes(A, -1, -2)  # (L, N, Hv, D)
    weights = circuits.HeadWeights(zero, bias, zero, bias, A, bias, W_O, jnp.zeros((1, 6)))
    np.testing.assert_allclose(circuits.copying_scores(weights, jnp.eye(6), jnp.eye(6)), [[sign]], atol=1e-6)


# --- attribution -------------------------------------------------------------------


def test_residual_decomposition_sums_to_the_final_residual(case):
    config, params, _, _, acts = case
    stack, labels = attribution.residual_decomposition(acts, params, lora_alpha=config.lora_alpha)
    N = config.num_heads
    assert labels[:3] == ["embed", "pos_embed", "L0H0"] and labels[2 + N : 4 + N] == [
        "0_attn_bias",
        "0_mlp_out",
    ]
    assert stack.shape == (2 + config.num_layers * (N + 2), BATCH, LENGTH, 32)
    np.testing.assert_allclose(
        stack.sum(0), acts[f"blocks.{config.num_layers - 1}.hook_resid_post"], atol=1e-5
    )
    # Without hook_result the heads' writes are computed from hook_z and W_O.
    without = {name: value for name, value in acts.items() if not name.endswith("hook_result")}
    recomputed, _ = attribution.residual_decomposition(without, params, lora_alpha=config.lora_alpha)
    np.testing.assert_allclose(recomputed, stack, atol=1e-5)


def test_direct_logit_attribution_sums_to_the_logit_difference(case):
    config, params, _, logits, acts = case
    answer, contrast = np.array([[1], [4], [7]]), 5
    attrs, labels = attribution.direct_logit_attribution(
        acts, params, answer, contrast, lora_alpha=config.lora_alpha
    )
    assert labels[-1] == "final_norm_bias" and attrs.shape == (len(labels), BATCH, LENGTH)
    want = np.take_along_axis(logits, np.broadcast_to(answer[..., None], (BATCH, LENGTH, 1)), -1)[..., 0]
    np.testing.assert_allclose(attrs.sum(0), want - logits[..., contrast], atol=1e-5)
    # The frozen scale, when the cache lacks it, is computed from the final residual stream.
    without = {name: value for name, value in acts.items() if name != "ln_final.hook_scale"}
    recomputed, _ = attribution.direct_logit_attribution(
        without, params, answer, contrast, lora_alpha=config.lora_alpha
    )
    np.testing.assert_allclose(recomputed, attrs, atol=1e-5)
    # One head's row: its write, centred, over the frozen scale, times gamma . (W_U[a] - W_U[c]).
    head = labels.index("L1H2")
    gamma, W_U = (
        np.asarray(x, np.float64) for x in (params["final_norm"]["scale"], params["head"]["kernel"])
    )
    write = acts["blocks.1.attn.hook_result"][:, :, 2]
    write = (write - write.mean(-1, keepdims=True)) / acts["ln_final.hook_scale"]
    direction = gamma * (W_U[:, answer[:, 0]].T - W_U[:, contrast])  # (B, D)
    np.testing.assert_allclose(attrs[head], np.einsum("btd,bd->bt", write, direction), atol=1e-5)


def test_direct_logit_attribution_names_bad_tokens(case):
    config, params, _, _, acts = case
    with pytest.raises(TypeError, match="answer must hold integer tokens"):
        attribution.direct_logit_attribution(acts, params, 1.0, lora_alpha=config.lora_alpha)
    with pytest.raises(ValueError, match=r"contrast must be one token .* got shape \(3,\)"):
        attribution.direct_logit_attribution(
            acts, params, 1, np.array([1, 2, 3]), lora_alpha=config.lora_alpha
        )
    with pytest.raises(ValueError, match="cache has no 'hook_embed'"):
        attribution.direct_logit_attribution({}, params, 1, lora_alpha=config.lora_alpha)


def test_logit_lens_reads_each_layers_input_through_the_final_norm(case):
    config, params, _, logits, acts = case
    lens, labels = attribution.logit_lens(acts, params, incl_mid=True)
    assert labels == ["0_pre", "0_mid", "1_pre", "1_mid", "final_post"]
    np.testing.assert_allclose(lens[-1], logits, atol=1e-5)
    norm = _f64(params["final_norm"])
    _, _, h = _layer_norm(acts["blocks.1.hook_resid_mid"], norm)
    np.testing.assert_allclose(lens[3], h @ np.asarray(params["head"]["kernel"], np.float64), atol=1e-5)


# --- hook names ----------------------------------------------------------------------


def test_hook_names_and_filters():
    names = cache.hook_names(2)
    assert names[:3] == ("hook_embed", "hook_pos_embed", "blocks.0.hook_resid_pre")
    assert names[-1] == "ln_final.hook_normalized" and len(names) == 2 + 2 * 18 + 2
    assert "blocks.1.attn.hook_kv_latent" in cache.hook_names(2, latent=True)
    assert cache.select_names(names, None) == names
    assert cache.select_names(names, "blocks.1.attn.hook_z") == ("blocks.1.attn.hook_z",)
    assert cache.select_names(names, lambda n: n.endswith("hook_pattern")) == (
        "blocks.0.attn.hook_pattern",
        "blocks.1.attn.hook_pattern",
    )
    with pytest.raises(ValueError, match=r"unknown names \['blocks.2.hook_resid_pre'\]"):
        cache.select_names(names, ["blocks.2.hook_resid_pre", "hook_embed"])
    with pytest.raises(ValueError, match="num_layers must be a positive int, got 0"):
        cache.hook_names(0)


@pytest.mark.slow
def test_importing_the_package_imports_neither_torch_nor_transformer_lens():
    code = (
        "import sys, qkv_jax.interpretability; "
        "print(sorted(m for m in ('torch', 'transformer_lens') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"
