"""The Llama-shaped decoder that Llama, Mistral, Qwen 2 and 3, Gemma 2 and 3 and OLMo 2 share.

Tensor names (`*ForCausalLM.save_pretrained`): `model.embed_tokens`, per layer `model.layers.{i}.`
`self_attn.{q,k,v,o}_proj` (and `q_norm`, `k_norm`), `mlp.{gate,up,down}_proj` and the norms
`NORM_NAMES` gives for the norm placement, then `model.norm` and `lm_head` (absent when tied).
RMSNorm gains are `weight` (Gemma's `1 + w` form keeps `w`: qkv_jax's "rms_offset" scale).

  decoder_fields     the TransformerConfig fields every such config.json gives
  decoder_tensors    the table of (linen path, tensor name, layout) of a config
  from_decoder       from_hf of these families
  to_decoder         to_hf of these families
  decoder_hf_config  the config.json fields every such family writes
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from qkv_jax.lm import TransformerConfig, head_dim_of
from qkv_jax.pretrained.families.common import (
    ConfigReader,
    Tensor,
    TensorSource,
    activation,
    dense_tensors,
    hf_activation,
    kv_heads,
    norm_tensors,
    read_tensors,
    rope_parameters,
    skip_stored,
    write_tensors,
)

__all__ = [
    "NORM_NAMES",
    "decoder_fields",
    "decoder_tensors",
    "from_decoder",
    "to_decoder",
    "decoder_hf_config",
]

# The Hugging Face name of each block norm, by TransformerConfig.norm_placement.
NORM_NAMES = {
    "pre": {"attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    "post": {
        "attention_post_norm": "post_attention_layernorm",
        "mlp_post_norm": "post_feedforward_layernorm",
    },
    "sandwich": {
        "attention_norm": "input_layernorm",
        "attention_post_norm": "post_attention_layernorm",
        "mlp_norm": "pre_feedforward_layernorm",
        "mlp_post_norm": "post_feedforward_layernorm",
    },
}


def decoder_fields(
    hf: ConfigReader,
    *,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    max_len: int = 2048,
    epsilon: float = 1e-6,
    activation_field: str = "hidden_act",
    activation_default: str = "silu",
    tie_embeddings: bool = False,
    default_base: float = 10000.0,
    rope_kinds: tuple[str, ...] = ("full_attention",),
) -> dict[str, Any]:
    """The fields of a Llama-shaped config (no biases; the family sets its own); the keywords are
    the family's defaults of the Hugging Face fields absent from the file (num_kv_heads None:
    num_heads; head_dim None: hidden_size // num_heads). RoPE rotates whole heads; rope_base and
    rope_scaling are those of the "full_attention" layers (`rope_kinds`: the layer kinds the
    config's RoPE names)."""
    d_model, num_heads = hf.require("hidden_size"), hf.require("num_attention_heads")
    kv = hf.get("num_key_value_heads", num_kv_heads) or num_heads
    width = hf.get("head_dim", head_dim) or d_model // num_heads
    fraction = hf.rope_fraction()
    if fraction != 1.0:
        hf.refuse("partial_rotary_factor", fraction, f"{hf.model_type} rotates whole heads")
    base, scaling = hf.rope(kinds=rope_kinds, default_base=default_base)["full_attention"]
    return dict(
        vocab_size=hf.require("vocab_size"),
        num_layers=hf.require("num_hidden_layers"),
        d_model=d_model,
        num_heads=num_heads,
        num_kv_heads=None if kv == num_heads else kv,
        head_dim=None if width * num_heads == d_model else width,
        mlp_dim=hf.require("intermediate_size"),
        max_len=hf.get("max_position_embeddings", max_len),
        positions="rope",
        rope_base=base,
        rope_scaling=scaling,
        norm="rms",
        norm_epsilon=hf.get("rms_norm_eps", epsilon),
        gated_mlp=True,
        mlp_activation=activation(hf, activation_field, activation_default),
        mlp_bias=False,
        qkv_bias=False,
        out_bias=False,
        tie_embeddings=hf.get("tie_word_embeddings", tie_embeddings),
        attention_dropout_rate=hf.get("attention_dropout", 0.0) or 0.0,
    )


def decoder_tensors(config: TransformerConfig) -> list[Tensor]:
    """Every parameter of `config`'s linen TransformerLM with its Hugging Face name and layout."""
    N, K, with_bias = config.num_heads, kv_heads(config), config.norm == "layernorm"
    table = [Tensor("token_embedding/embedding", "model.embed_tokens.weight")]
    for i in range(config.num_layers):
        block, layer = f"block_{i}", f"model.layers.{i}"
        for ours, theirs in NORM_NAMES[config.norm_placement].items():
            table += norm_tensors(f"{block}/{ours}", f"{layer}.{theirs}", with_bias)
        for ours, theirs, heads in (("query", "q_proj", N), ("key", "k_proj", K), ("value", "v_proj", K)):
            table += dense_tensors(
                f"{block}/attention/{ours}", f"{layer}.self_attn.{theirs}", config.qkv_bias, "heads_in", heads
            )
        table += dense_tensors(
            f"{block}/attention/out", f"{layer}.self_attn.o_proj", config.out_bias, "heads_out", N
        )
        if config.normalize_qk:
            table += norm_tensors(f"{block}/attention/query_ln", f"{layer}.self_attn.q_norm", False)
            table += norm_tensors(f"{block}/attention/key_ln", f"{layer}.self_attn.k_norm", False)
        for ours, theirs in (("mlp_gate", "gate_proj"), ("mlp_in", "up_proj"), ("mlp_out", "down_proj")):
            table += dense_tensors(f"{block}/{ours}", f"{layer}.mlp.{theirs}", config.mlp_bias)
    table += norm_tensors("final_norm", "model.norm", with_bias)
    return table if config.tie_embeddings else [*table, Tensor("head/kernel", "lm_head.weight", "linear")]


def from_decoder(config: TransformerConfig, tensors: TensorSource) -> Iterator[tuple[str, np.ndarray]]:
    """The linen parameters of a Llama-shaped checkpoint; a tied model's stored `lm_head.weight`
    (a copy of the embedding) and old checkpoints' `rotary_emb.inv_freq` buffers are skipped."""
    buffers = [f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(config.num_layers)]
    skip_stored(tensors, config, "lm_head.weight", buffers)
    yield from read_tensors(decoder_tensors(config), tensors)


def to_decoder(config: TransformerConfig, params: Mapping[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """The Hugging Face tensors of a Llama-shaped model's linen parameters."""
    yield from write_tensors(decoder_tensors(config), params)


def decoder_hf_config(config: TransformerConfig, model_type: str, architecture: str) -> dict[str, Any]:
    """The config.json fields of a Llama-shaped `config` (transformers 5's schema); each family
    adds its own. These families have no residual dropout to write."""
    return dict(
        model_type=model_type,
        architectures=[architecture],
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.mlp_dim or 4 * config.d_model,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=kv_heads(config),
        head_dim=head_dim_of(config),
        max_position_embeddings=config.max_len,
        rms_norm_eps=config.norm_epsilon,
        hidden_act=hf_activation(config),
        tie_word_embeddings=config.tie_embeddings,
        rope_parameters=rope_parameters(config.rope_base, config.rope_scaling),
        attention_dropout=config.attention_dropout_rate,
    )
