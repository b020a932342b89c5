"""A TransformerLM as TransformerLens's own model (TransformerLens 4.x, no download).

  transformer_lens_config       the `TransformerBridgeConfig` of a `TransformerConfig`
  transformer_lens_state_dict   the parameters in TransformerLens's per-head layout
                                (`blocks.{i}.attn.W_Q` `[N, D, H]`, ...), as torch tensors
  to_transformer_lens           a `TransformerBridge` computing the same function: booted
                                from the config (`sources.native.boot`), loaded from the
                                state dict through `convert_tl_checkpoint`

The bridge's `run_with_cache` then names activations the classic way
(`blocks.0.attn.hook_pattern`, ...), which is what the parity tests compare
this package's functions against. What makes the two models one function:
LayerNorm eps 1e-6 (flax's default), the tanh GELU (flax's `nn.gelu` default;
TransformerLens's "gelu_new"), learned position embeddings over `max_len`
positions, a bias-free head (the bridge keeps a zero `b_U`), grouped K/V heads
(`n_key_value_heads`; query head n reads kv head n // (N / K) in both).
LoRA adapters are merged into their kernels (`qkv_jax.lora.merge_lora`); an
MLA latent is folded into the key and value projections (K = (x W_C + b_C) W_K
+ b_K = x (W_C W_K) + (b_C W_K + b_K)), which computes the same K and V, so
the bridge's hook_k and hook_v are the reconstructed keys and values.

torch and transformer_lens are imported only when these functions run;
`import qkv_jax` imports neither (`pip install 'qkv_jax[test]'` installs both).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qkv_jax.lm import TransformerConfig, TransformerLM, layer_windows
from qkv_jax.lora import has_adapters, merge_lora

__all__ = ["transformer_lens_config", "transformer_lens_state_dict", "to_transformer_lens"]

# flax.linen.LayerNorm's default epsilon (TransformerLens's default is 1e-5).
LAYER_NORM_EPS = 1e-6


def _import_transformer_lens():
    try:
        import torch
        import transformer_lens
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "qkv_jax.interpretability.tl needs torch and transformer-lens 4.x: pip install 'qkv_jax[test]'"
        ) from error
    return torch, transformer_lens


def _config_of(model: TransformerLM | TransformerConfig) -> TransformerConfig:
    if isinstance(model, TransformerLM):
        return model.config
    if isinstance(model, TransformerConfig):
        return model
    raise TypeError(f"model must be a TransformerLM or TransformerConfig, got {type(model).__name__}")


# The block options of TransformerConfig and the one value of each that the bridge computes.
_BRIDGE_BLOCK: dict[str, Any] = {
    "norm": "layernorm",
    "norm_epsilon": LAYER_NORM_EPS,
    "norm_placement": "pre",
    "parallel_block": False,
    "mlp_activation": "gelu_tanh",
    "gated_mlp": False,
    "mlp_bias": True,
    "qkv_bias": True,
    "out_bias": True,
    "tie_embeddings": False,
    "embedding_scale": None,
    "final_logit_soft_cap": None,
}


def _check_expressible(config: TransformerConfig, caller: str) -> None:
    """ValueError naming every option of `config` that the bridge built here would not compute:
    converting such a model would give TransformerLens a different function, silently."""
    windows = [w for w in layer_windows(config) if w is not None and w < config.max_len]
    refused = {
        f"positions={config.positions!r} (the bridge adds a learned table)": config.positions != "learned",
        f"window={config.window!r}": bool(windows),
        f"normalize_qk={config.normalize_qk!r}": bool(config.normalize_qk),
        f"attn_logits_soft_cap={config.attn_logits_soft_cap!r}": config.attn_logits_soft_cap is not None,
        f"attention_scale={config.attention_scale!r} (the bridge divides by sqrt(d_head))": (
            config.attention_scale is not None
        ),
        "use_sinks=True": config.use_sinks,
    }
    if config.head_dim not in (None, config.d_model // config.num_heads):
        refused[f"head_dim={config.head_dim}"] = True
    for name, computed in _BRIDGE_BLOCK.items():
        value = getattr(config, name)
        refused[f"{name}={value!r}"] = value != computed
    named = [name for name, set_ in refused.items() if set_]
    if named:
        raise ValueError(
            f"{caller}: {', '.join(named)}: no form in the TransformerLens bridge built here; it "
            "converts learned positions, global attention, no QK-norm, cap or sinks, and 1/sqrt(d_head), "
            "in pre-LayerNorm blocks with a tanh-GELU MLP, every bias, and an untied, uncapped head"
        )


def transformer_lens_config(model: TransformerLM | TransformerConfig) -> Any:
    """The `transformer_lens.config.TransformerBridgeConfig` of `model` (a TransformerLM or its config).

    Weights are not initialised on boot (`init_weights=False`): they come from
    `transformer_lens_state_dict`. ValueError for a model whose options the bridge would not
    compute (RoPE or no positions, windows, QK-norm, a soft cap, another logit scale, sinks, and
    every block option but pre-LayerNorm tanh-GELU blocks with biases and an untied head).
    """
    _, _ = _import_transformer_lens()
    from transformer_lens.config import TransformerBridgeConfig

    config = _config_of(model)
    _check_expressible(config, "transformer_lens_config")
    return TransformerBridgeConfig(
        d_model=config.d_model,
        d_head=config.d_model // config.num_heads,
        n_layers=config.num_layers,
        n_ctx=config.max_len,
        n_heads=config.num_heads,
        d_vocab=config.vocab_size,
        d_mlp=config.mlp_dim or 4 * config.d_model,
        n_key_value_heads=config.num_kv_heads,
        act_fn="gelu_new",
        eps=LAYER_NORM_EPS,
        normalization_type="LN",
        positional_embedding_type="standard",
        attention_dir="causal" if config.causal else "bidirectional",
        init_weights=False,
        model_name="qkv_jax.TransformerLM",
    )


def _attention_tensors(attention: dict) -> dict[str, np.ndarray]:
    """One layer's attention in TransformerLens's layout, float64.

    W_Q `[N, D, H]`, W_K `[K, D, H]`, W_V `[K, D, Hv]`, W_O `[N, Hv, D]`,
    b_Q `[N, H]`, b_K `[K, H]`, b_V `[K, Hv]`, b_O `[D]`; an MLA latent folded in.
    """
    if "query_ln" in attention:
        raise ValueError(
            "transformer_lens_state_dict: normalize_qk (query_ln, key_ln) has no TransformerLens form"
        )
    array = {
        name: {key: np.asarray(value, np.float64) for key, value in attention[name].items()}
        for name in attention
    }
    key_kernel, key_bias = array["key"]["kernel"], array["key"]["bias"]  # (D|C, K, H), (K, H)
    value_kernel, value_bias = array["value"]["kernel"], array["value"]["bias"]  # (D|C, K, Hv), (K, Hv)
    if "kv_latent" in array:  # K = (x W_C + b_C) W_K + b_K
        latent_kernel, latent_bias = array["kv_latent"]["kernel"], array["kv_latent"]["bias"]  # (D, C), (C,)
        key_bias = key_bias + np.einsum("c,ckh->kh", latent_bias, key_kernel)  # (K, H)
        value_bias = value_bias + np.einsum("c,ckv->kv", latent_bias, value_kernel)  # (K, Hv)
        key_kernel = np.einsum("dc,ckh->dkh", latent_kernel, key_kernel)  # (D, K, H)
        value_kernel = np.einsum("dc,ckv->dkv", latent_kernel, value_kernel)  # (D, K, Hv)
    return {
        "W_Q": array["query"]["kernel"].transpose(1, 0, 2),  # (N, D, H)
        "W_K": key_kernel.transpose(1, 0, 2),  # (K, D, H)
        "W_V": value_kernel.transpose(1, 0, 2),  # (K, D, Hv)
        "W_O": array["out"]["kernel"],  # (N, Hv, D)
        "b_Q": array["query"]["bias"],  # (N, H)
        "b_K": key_bias,
        "b_V": value_bias,
        "b_O": array["out"]["bias"],  # (D,)
    }


def transformer_lens_state_dict(model: TransformerLM | TransformerConfig, params: Any) -> dict:
    """`params` of `model` as a TransformerLens property-layout state dict of float32 torch tensors.

    Keys and shapes are HookedTransformer's: `embed.W_E` `[V, D]`,
    `pos_embed.W_pos` `[max_len, D]`, `blocks.{i}.ln1.w`/`.b` `[D]`,
    `blocks.{i}.attn.W_Q` `[N, D, H]`, `.W_K`/`.W_V` `[K, D, H]`, `.W_O`
    `[N, H, D]`, biases `b_Q` `[N, H]`, `b_K`/`b_V` `[K, H]`, `b_O` `[D]`,
    `blocks.{i}.ln2.w`/`.b`, `blocks.{i}.mlp.W_in` `[D, M]`, `b_in` `[M]`,
    `W_out` `[M, D]`, `b_out` `[D]`, `ln_final.w`/`.b`, `unembed.W_U` `[D, V]`
    and a zero `unembed.b_U` `[V]`. `params`: the model's parameters (or
    variables with a "params" entry); LoRA adapters are merged first.
    """
    torch, _ = _import_transformer_lens()
    config = _config_of(model)
    _check_expressible(config, "transformer_lens_state_dict")
    params = params.get("params", params)
    if has_adapters(params):
        params = merge_lora(params, config.lora_alpha)
    state: dict[str, np.ndarray] = {
        "embed.W_E": np.asarray(params["token_embedding"]["embedding"]),  # (V, D)
        "pos_embed.W_pos": np.asarray(params["position_embedding"]),  # (max_len, D)
    }
    for layer in range(config.num_layers):
        block, prefix = params[f"block_{layer}"], f"blocks.{layer}"
        for norm, name in (("ln1", "attention_norm"), ("ln2", "mlp_norm")):
            state[f"{prefix}.{norm}.w"] = np.asarray(block[name]["scale"])  # (D,)
            state[f"{prefix}.{norm}.b"] = np.asarray(block[name]["bias"])  # (D,)
        for name, tensor in _attention_tensors(block["attention"]).items():
            state[f"{prefix}.attn.{name}"] = tensor
        state[f"{prefix}.mlp.W_in"] = np.asarray(block["mlp_in"]["kernel"])  # (D, M)
        state[f"{prefix}.mlp.b_in"] = np.asarray(block["mlp_in"]["bias"])  # (M,)
        state[f"{prefix}.mlp.W_out"] = np.asarray(block["mlp_out"]["kernel"])  # (M, D)
        state[f"{prefix}.mlp.b_out"] = np.asarray(block["mlp_out"]["bias"])  # (D,)
    state["ln_final.w"] = np.asarray(params["final_norm"]["scale"])  # (D,)
    state["ln_final.b"] = np.asarray(params["final_norm"]["bias"])  # (D,)
    state["unembed.W_U"] = np.asarray(params["head"]["kernel"])  # (D, V)
    state["unembed.b_U"] = np.zeros(config.vocab_size)  # (V,): the head has no bias
    return {name: torch.from_numpy(np.array(value, np.float32)) for name, value in state.items()}


def to_transformer_lens(model: TransformerLM | TransformerConfig, params: Any) -> Any:
    """A TransformerLens `TransformerBridge` (float32, CPU, eval mode) computing `model` at `params`.

    Built without any download: `transformer_lens.model_bridge.sources.native.boot`
    of `transformer_lens_config(model)`, loaded (strictly) with
    `convert_tl_checkpoint(transformer_lens_state_dict(model, params), ...)`.
    Its `run_with_cache(tokens)` on int64 tokens `[B, T]` gives logits
    `[B, T, V]` and the classic hook names. In TransformerLens 4.3 this
    bridge's `blocks.{i}.attn.hook_attn_scores` holds the softmax output (the
    pattern again, not the scores before it), and per-head results come from
    `cache.stack_head_results()` (`set_use_attn_result` is not supported here).
    """
    torch, _ = _import_transformer_lens()
    from transformer_lens.model_bridge.sources.native import boot
    from transformer_lens.utilities.tl_checkpoint_conversion import convert_tl_checkpoint

    tl_config = transformer_lens_config(model)
    bridge = boot(tl_config)
    state = convert_tl_checkpoint(transformer_lens_state_dict(model, params), bridge.cfg)
    bridge.load_state_dict(state, strict=True)
    return bridge.eval()
