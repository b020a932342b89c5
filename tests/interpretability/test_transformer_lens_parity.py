"""Parity with TransformerLens 4.x on the converted model (skipped when transformer_lens is missing).

The models are tiny (2 layers, d_model 32, 4 heads, T 8), one with 4 K/V heads
(MHA) and one with 2 (GQA); each is converted once (`to_transformer_lens`)
and run once through TransformerLens's `run_with_cache`, which takes most
of this module's time. torch and transformer_lens (several seconds to import) are imported
by the tests that use them, not at collection: an xdist worker that runs none of them does not
pay for them.
"""

import dataclasses
import importlib.util
import re

import numpy as np
import pytest
from test_interpretability_circuits import CONFIGS, model_params, reference_forward, tokens_for

from qkv_jax.interpretability import attribution, cache, circuits
from qkv_jax.interpretability import tl as qkv_tl
from qkv_jax.lm import TransformerLM

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformer_lens") is None, reason="transformer_lens is not installed"
)


def _numpy(tree):
    return {name: value.detach().numpy() for name, value in tree.items()}


@dataclasses.dataclass
class Converted:
    config: object
    params: object
    tokens: np.ndarray
    bridge: object  # the converted model
    tl_cache: object  # its ActivationCache on `tokens`
    acts: dict  # that cache as NumPy arrays
    folded: object  # the converted model after TransformerLens's fold_ln
    folded_cache: object


@pytest.fixture(scope="module", params=["mha", "gqa"])
def converted(request):
    config = CONFIGS[request.param]
    params = model_params(config)
    tokens = tokens_for()
    import torch

    bridge = qkv_tl.to_transformer_lens(config, params)
    folded = qkv_tl.to_transformer_lens(config, params)
    folded.process_weights(
        fold_ln=True, center_writing_weights=False, center_unembed=False, fold_value_biases=False
    )
    with torch.no_grad():
        _, tl_cache = bridge.run_with_cache(torch.from_numpy(tokens).long())
        _, folded_cache = folded.run_with_cache(torch.from_numpy(tokens).long())
    return Converted(config, params, tokens, bridge, tl_cache, _numpy(tl_cache), folded, folded_cache)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_conversion_gives_the_models_logits_and_patterns(name):
    config = CONFIGS[name]
    params = model_params(config)
    tokens = tokens_for()
    import torch

    bridge = qkv_tl.to_transformer_lens(config, {"params": params})
    assert bridge.cfg.n_key_value_heads == config.num_kv_heads and bridge.cfg.eps == 1e-6
    with torch.no_grad():
        logits, tl_cache = bridge.run_with_cache(torch.from_numpy(tokens).long())
    model = TransformerLM(dataclasses.replace(config, sow_weights=True))
    ours, state = model.apply({"params": params}, tokens, mutable=["intermediates"])
    np.testing.assert_allclose(logits.detach().numpy(), ours, atol=1e-5)
    for layer in range(config.num_layers):
        (pattern,) = state["intermediates"][f"block_{layer}"]["attention"]["attention_weights"]
        np.testing.assert_allclose(
            tl_cache[f"blocks.{layer}.attn.hook_pattern"].detach().numpy(), pattern, atol=1e-5
        )


def test_every_shared_activation_matches_the_float64_reference(converted):
    """Every name of `cache.HOOK_SHAPES` TransformerLens fills, against float64 NumPy."""
    _, want = reference_forward(converted.config, converted.params, converted.tokens)
    compared = []
    for name in cache.hook_names(converted.config.num_layers):
        # TransformerLens 4.3's native bridge fills hook_attn_scores with the softmax output
        # (the pattern again) and hook_result only on request (stack_head_results, below).
        if name in converted.acts and not name.endswith("hook_attn_scores"):
            np.testing.assert_allclose(converted.acts[name], want[name], atol=1e-5, err_msg=name)
            compared.append(name)
    assert len(compared) == 2 + 2 * 16 + 2
    results = converted.tl_cache.stack_head_results().detach().numpy()  # (L N, B, T, D)
    for layer in range(converted.config.num_layers):
        np.testing.assert_allclose(
            results[4 * layer : 4 * layer + 4],
            np.moveaxis(want[f"blocks.{layer}.attn.hook_result"], 2, 0),
            atol=1e-5,
        )


def test_residual_decomposition_matches_transformer_lens(converted):
    config = converted.config
    ours, labels = attribution.residual_decomposition(converted.acts, converted.params)
    heads = [
        labels.index(f"L{layer}H{h}") for layer in range(config.num_layers) for h in range(config.num_heads)
    ]
    np.testing.assert_allclose(
        ours[np.array(heads)], converted.tl_cache.stack_head_results().detach().numpy(), atol=1e-5
    )
    theirs, their_labels = converted.tl_cache.decompose_resid(return_labels=True)
    assert their_labels == ["embed", "pos_embed", "0_attn_out", "0_mlp_out", "1_attn_out", "1_mlp_out"]
    grouped = [ours[0], ours[1]]
    for layer in range(config.num_layers):
        start = labels.index(f"L{layer}H0")
        grouped += [ours[start : start + config.num_heads + 1].sum(0), ours[labels.index(f"{layer}_mlp_out")]]
    np.testing.assert_allclose(np.stack(grouped), theirs.detach().numpy(), atol=1e-5)


def test_direct_logit_attribution_matches_transformer_lens(converted):
    """TransformerLens's logit_attrs on the fold_ln model (gamma folded into W_U), per head and
    per layer output, for an answer per sequence against a contrast token."""
    config = converted.config
    answer, contrast = np.array([1, 4, 7]), np.array([5, 5, 2])
    ours, labels = attribution.direct_logit_attribution(
        converted.acts, converted.params, answer[:, None], contrast[:, None]
    )
    import torch

    folded_cache = converted.folded_cache
    kwargs = dict(tokens=torch.from_numpy(answer), incorrect_tokens=torch.from_numpy(contrast))
    heads = (
        folded_cache.logit_attrs(folded_cache.stack_head_results(), **kwargs).detach().numpy()
    )  # (L N, B, T)
    head_rows = [
        labels.index(f"L{layer}H{h}") for layer in range(config.num_layers) for h in range(config.num_heads)
    ]
    np.testing.assert_allclose(ours[np.array(head_rows)], heads, atol=1e-5)
    layers = (
        folded_cache.logit_attrs(folded_cache.decompose_resid(), **kwargs).detach().numpy()
    )  # (2 + 2 L, B, T)
    grouped = [ours[0], ours[1]]
    for layer in range(config.num_layers):
        start = labels.index(f"L{layer}H0")
        grouped += [ours[start : start + config.num_heads + 1].sum(0), ours[labels.index(f"{layer}_mlp_out")]]
    np.testing.assert_allclose(np.stack(grouped), layers, atol=1e-5)


def test_logit_lens_matches_transformer_lens(converted):
    ours, labels = attribution.logit_lens(converted.acts, converted.params, incl_mid=True)
    stack, their_labels = converted.tl_cache.accumulated_resid(
        incl_mid=True, apply_ln=True, return_labels=True
    )
    assert labels == their_labels
    np.testing.assert_allclose(ours, (stack @ converted.bridge.W_U).detach().numpy(), atol=1e-5)


def test_qk_and_ov_circuits_match_transformer_lens(converted):
    weights = circuits.head_weights(converted.params)
    bridge = converted.bridge
    np.testing.assert_allclose(circuits.qk_matrices(weights), bridge.QK.AB.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(circuits.ov_matrices(weights), bridge.OV.AB.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(circuits.qk_singular_values(weights), bridge.QK.S.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(circuits.ov_singular_values(weights), bridge.OV.S.detach().numpy(), atol=1e-5)
    E, U = bridge.W_E.detach(), bridge.W_U.detach()
    embeddings = circuits.embedding_weights(converted.params)
    full_qk = (E @ bridge.QK[1, 2] @ E.T).AB.detach().numpy()  # (V, V)
    np.testing.assert_allclose(
        circuits.token_qk_circuit(weights, 1, 2, embeddings.W_E, embeddings.W_E), full_qk, atol=1e-5
    )
    full_ov = E @ bridge.OV @ U  # FactoredMatrix (L, N, V, V)
    np.testing.assert_allclose(
        circuits.token_ov_circuit(weights, 0, 3, embeddings.W_E, embeddings.W_U),
        full_ov[0, 3].AB.detach().numpy(),
        atol=1e-5,
    )
    eigenvalues = full_ov.eigenvalues  # (L, N, Hv) complex
    copying = (eigenvalues.sum(-1) / eigenvalues.abs().sum(-1)).real.detach().numpy()
    np.testing.assert_allclose(
        circuits.copying_scores(weights, embeddings.W_E, embeddings.W_U), copying, atol=1e-5
    )


@pytest.mark.parametrize("mode", ["Q", "K", "V"])
def test_composition_scores_match_transformer_lens(converted, mode):
    weights = circuits.head_weights(converted.params)
    theirs = converted.bridge.all_composition_scores(mode).scores.detach().numpy()  # (L, N, L, N)
    np.testing.assert_allclose(circuits.composition_scores(weights, mode), theirs, atol=1e-5)


def test_folded_weights_match_transformer_lens_fold_ln(converted):
    folded = converted.folded
    ours = circuits.head_weights(converted.params, fold_layer_norm=True)
    group = converted.config.num_heads // (converted.config.num_kv_heads or converted.config.num_heads)

    def per_query_head(x):  # TransformerLens keeps K/V per kv head: (L, K, ...) -> (L, N, ...)
        return np.repeat(x.detach().numpy(), group, axis=1)

    for got, want in [
        (ours.W_Q, folded.W_Q.detach().numpy()),
        (ours.b_Q, folded.b_Q.detach().numpy()),
        (ours.W_K, per_query_head(folded.W_K)),
        (ours.b_K, per_query_head(folded.b_K)),
        (ours.W_V, per_query_head(folded.W_V)),
        (ours.b_V, per_query_head(folded.b_V)),
        (ours.W_O, folded.W_O.detach().numpy()),
    ]:
        np.testing.assert_allclose(got, want, atol=1e-5)
    embeddings = circuits.embedding_weights(converted.params, fold_layer_norm=True)
    np.testing.assert_allclose(embeddings.W_U, folded.W_U.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(embeddings.b_U, folded.b_U.detach().numpy(), atol=1e-5)


def test_state_dict_has_transformer_lens_layout():
    config = CONFIGS["gqa"]
    state = qkv_tl.transformer_lens_state_dict(config, model_params(config))
    assert state["blocks.1.attn.W_Q"].shape == (4, 32, 8) and state["blocks.1.attn.W_K"].shape == (2, 32, 8)
    assert state["blocks.0.attn.W_O"].shape == (4, 8, 32) and state["blocks.0.attn.b_V"].shape == (2, 8)
    assert state["unembed.W_U"].shape == (32, 11) and not state["unembed.b_U"].any()
    with pytest.raises(TypeError, match="model must be a TransformerLM or TransformerConfig, got dict"):
        qkv_tl.transformer_lens_config({})


@pytest.mark.parametrize(
    "option, message",
    [
        (dict(positions="rope"), "positions='rope'"),
        (dict(positions="none"), "positions='none'"),
        (dict(window=(4, None)), "window=(4, None)"),
        (dict(normalize_qk="rms"), "normalize_qk='rms'"),
        (dict(attn_logits_soft_cap=5.0), "attn_logits_soft_cap=5.0"),
        (dict(attention_scale=1.0), "attention_scale=1.0"),
        (dict(use_sinks=True), "use_sinks=True"),
        (dict(head_dim=4), "head_dim=4"),
        (dict(norm="rms"), "norm='rms'"),
        (dict(norm_epsilon=1e-5), "norm_epsilon=1e-05"),
        (dict(norm_placement="sandwich"), "norm_placement='sandwich'"),
        (dict(parallel_block=True), "parallel_block=True"),
        (dict(mlp_activation="silu"), "mlp_activation='silu'"),
        (dict(gated_mlp=True), "gated_mlp=True"),
        (dict(mlp_bias=False), "mlp_bias=False"),
        (dict(qkv_bias=False), "qkv_bias=False"),
        (dict(out_bias=False), "out_bias=False"),
        (dict(tie_embeddings=True), "tie_embeddings=True"),
        (dict(embedding_scale=2.0), "embedding_scale=2.0"),
        (dict(final_logit_soft_cap=30.0), "final_logit_soft_cap=30.0"),
    ],
)
def test_options_the_bridge_would_not_compute_are_refused(option, message):
    """Each option TransformerLens's bridge has no form for is named, never converted into another
    function; a window as long as max_len is global attention and converts."""
    config = dataclasses.replace(CONFIGS["mha"], **option)
    for convert in (qkv_tl.transformer_lens_config, lambda c: qkv_tl.transformer_lens_state_dict(c, {})):
        with pytest.raises(ValueError, match=re.escape(message)):
            convert(config)
    qkv_tl.transformer_lens_config(dataclasses.replace(CONFIGS["mha"], window=CONFIGS["mha"].max_len))
