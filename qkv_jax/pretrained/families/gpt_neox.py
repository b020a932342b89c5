"""GPT-NeoX and Pythia: LayerNorm blocks with the attention and the MLP in parallel
(`use_parallel_residual`: x + attn(ln1(x)) + mlp(ln2(x))), an exact-GELU MLP, RoPE on the
leading `rotary_pct` of each head (rotate-half pairing) and an untied head.

Tensors (`GPTNeoXForCausalLM.save_pretrained`): `gpt_neox.embed_in`, per layer
`gpt_neox.layers.{i}.input_layernorm`, `attention.query_key_value` (one torch weight
`[3 N H, D]` whose rows are, head by head, that head's query, key and value: `[N, 3, H, D]`),
`attention.dense`, `post_attention_layernorm`, `mlp.dense_h_to_4h`, `mlp.dense_4h_to_h`, then
`gpt_neox.final_layer_norm` and `embed_out`; old checkpoints' buffers `attention.bias`,
`attention.masked_bias` and `attention.rotary_emb.inv_freq` are skipped.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

import qkv_jax.pretrained.families.common as common
from qkv_jax.lm import TransformerConfig
from qkv_jax.pretrained.families.common import ConfigReader, Field, Tensor, TensorSource

MODEL_TYPES = ("gpt_neox",)
BUFFERS = ("bias", "masked_bias", "rotary_emb.inv_freq")
DEFAULT_FRACTION = 0.25  # transformers' rotary_pct when a config gives none
# config.json fields read and written as they are (the others are in to_config and hf_config).
FIELDS = {
    "vocab_size": Field("vocab_size"),
    "num_hidden_layers": Field("num_layers"),
    "hidden_size": Field("d_model"),
    "num_attention_heads": Field("num_heads"),
    "max_position_embeddings": Field("max_len", 2048),
    "layer_norm_eps": Field("norm_epsilon", 1e-5),
    "tie_word_embeddings": Field("tie_embeddings", False),
    "attention_dropout": Field("attention_dropout_rate", 0.0),
    "hidden_dropout": Field("residual_dropout_rate", 0.0),
}


def _rope_dict(hf: ConfigReader) -> dict[str, Any]:
    """transformers 5's flat `rope_parameters` (empty when absent or nested)."""
    parameters = hf.get("rope_parameters")
    return parameters if isinstance(parameters, dict) else {}


def to_config(hf: ConfigReader) -> TransformerConfig:
    """The TransformerConfig of a GPT-NeoX config.json."""
    base, scaling = hf.rope(default_base=hf.get("rotary_emb_base", 10000.0))["full_attention"]
    given = "rotary_pct" in hf or "partial_rotary_factor" in hf or "partial_rotary_factor" in _rope_dict(hf)
    fraction = hf.rope_fraction("rotary_pct") if given else DEFAULT_FRACTION
    bias = hf.accept("attention_bias", True, False)
    hf.get("classifier_dropout")  # the classification heads', not the language model's
    hf.get("is_decoder")
    return TransformerConfig(
        **common.read_fields(hf, FIELDS),
        mlp_dim=hf.require("intermediate_size"),
        positions="rope",
        rope_base=base,
        rope_scaling=scaling,
        rope_fraction=fraction,
        norm="layernorm",
        parallel_block=hf.accept("use_parallel_residual", True, False),
        mlp_activation=common.activation(hf, "hidden_act", "gelu"),
        qkv_bias=bias,
        out_bias=bias,
    )


def _tensors(config: TransformerConfig) -> list[Tensor]:
    """Every parameter but the fused query/key/value, with its Hugging Face name and layout."""
    table = [Tensor("token_embedding/embedding", "gpt_neox.embed_in.weight")]
    for i in range(config.num_layers):
        block, layer = f"block_{i}", f"gpt_neox.layers.{i}"
        table += common.norm_tensors(f"{block}/attention_norm", f"{layer}.input_layernorm", True)
        table += common.dense_tensors(
            f"{block}/attention/out",
            f"{layer}.attention.dense",
            config.out_bias,
            "heads_out",
            config.num_heads,
        )
        table += common.norm_tensors(f"{block}/mlp_norm", f"{layer}.post_attention_layernorm", True)
        table += common.dense_tensors(f"{block}/mlp_in", f"{layer}.mlp.dense_h_to_4h", config.mlp_bias)
        table += common.dense_tensors(f"{block}/mlp_out", f"{layer}.mlp.dense_4h_to_h", config.mlp_bias)
    table += common.norm_tensors("final_norm", "gpt_neox.final_layer_norm", True)
    return table if config.tie_embeddings else [*table, Tensor("head/kernel", "embed_out.weight", "linear")]


def from_hf(config: TransformerConfig, tensors: TensorSource) -> Iterator[tuple[str, np.ndarray]]:
    """The linen parameters of a GPT-NeoX checkpoint."""
    N = config.num_heads
    buffers = [f"gpt_neox.layers.{i}.attention.{name}" for i in range(config.num_layers) for name in BUFFERS]
    common.skip_stored(tensors, config, "embed_out.weight", buffers)
    yield from common.read_tensors(_tensors(config), tensors)
    for i in range(config.num_layers):
        fused = f"gpt_neox.layers.{i}.attention.query_key_value"
        weight = tensors.get(f"{fused}.weight")
        weight = weight.reshape(N, 3, -1, weight.shape[-1])  # (N, 3, H, D)
        bias = tensors.get(f"{fused}.bias").reshape(N, 3, -1) if config.qkv_bias else None  # (N, 3, H)
        for part, name in enumerate(("query", "key", "value")):
            yield f"block_{i}/attention/{name}/kernel", weight[:, part].transpose(2, 0, 1)  # (D, N, H)
            if bias is not None:
                yield f"block_{i}/attention/{name}/bias", bias[:, part]  # (N, H)


def to_hf(config: TransformerConfig, params: Mapping[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """The Hugging Face tensors of a GPT-NeoX-shaped model."""
    yield from common.write_tensors(_tensors(config), params)
    for i in range(config.num_layers):
        fused = f"gpt_neox.layers.{i}.attention.query_key_value"
        kernels = np.stack(common.qkv_arrays(params, i, "kernel"), axis=1)  # (D, 3, N, H)
        yield (
            f"{fused}.weight",
            np.ascontiguousarray(kernels.transpose(2, 1, 3, 0).reshape(-1, kernels.shape[0])),
        )
        if config.qkv_bias:
            biases = np.stack(common.qkv_arrays(params, i, "bias"), axis=1)  # (N, 3, H)
            yield f"{fused}.bias", biases.reshape(-1)


def hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The config.json of `config` as GPT-NeoX."""
    return dict(
        model_type="gpt_neox",
        architectures=["GPTNeoXForCausalLM"],
        **common.write_fields(config, FIELDS),
        intermediate_size=config.mlp_dim or 4 * config.d_model,
        rope_parameters=common.rope_parameters(config.rope_base, config.rope_scaling, config.rope_fraction),
        use_parallel_residual=config.parallel_block,
        hidden_act=common.hf_activation(config),
        attention_bias=config.qkv_bias,
    )
