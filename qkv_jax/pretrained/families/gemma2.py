"""Gemma 2: Llama's decoder with Gemma's RMSNorm x_hat * (1 + w) (qkv_jax's "rms_offset", the
stored `w` its scale) before and after each sublayer, a GeGLU MLP, embeddings times
sqrt(hidden_size) and tied to the head, attention logits scaled by query_pre_attn_scalar^-1/2,
soft caps on the attention logits and on the final logits, and sliding windows on the layers
`layer_types` marks (default: every other layer, from the first).

Refused: `use_bidirectional_attention` (the embedding models' attention).
"""

from __future__ import annotations

from typing import Any

from qkv_jax.lm import TransformerConfig, head_dim_of
from qkv_jax.pretrained.families.common import (
    ConfigReader,
    attention_biases,
    hf_activation,
    layer_types,
    sliding_window,
    windows,
)
from qkv_jax.pretrained.families.decoder import decoder_fields, decoder_hf_config, from_decoder, to_decoder

# The tensors: the Llama-shaped decoder's names and layouts.
from_hf, to_hf = from_decoder, to_decoder

MODEL_TYPES = ("gemma2",)


def gemma_fields(
    hf: ConfigReader, fields: dict[str, Any], types: list[str], soft_caps: tuple[Any, Any]
) -> dict[str, Any]:
    """`fields` with what Gemma 2 and 3 add to Llama's decoder; `types` the default `layer_types`,
    `soft_caps` the defaults of (attn_logit_softcapping, final_logit_softcapping)."""
    hf.accept("use_bidirectional_attention", None, False)
    hf.get("hidden_act")  # transformers' Gemma 2 and 3 read hidden_activation only
    biases = attention_biases(hf)
    width = fields["head_dim"] or fields["d_model"] // fields["num_heads"]
    scalar = hf.get("query_pre_attn_scalar", 256)
    return dict(
        fields,
        **biases,
        norm="rms_offset",
        norm_placement="sandwich",
        embedding_scale=fields["d_model"] ** 0.5,
        attention_scale=None if scalar == width else scalar**-0.5,
        attn_logits_soft_cap=hf.get("attn_logit_softcapping", soft_caps[0]),
        final_logit_soft_cap=hf.get("final_logit_softcapping", soft_caps[1]),
        window=windows(hf.get("layer_types") or types, hf.get("sliding_window", 4096)),
    )


def gemma_decoder_fields(hf: ConfigReader, max_len: int, **rope: Any) -> dict[str, Any]:
    """`decoder_fields` with Gemma 2 and 3's defaults; `rope` its RoPE keywords."""
    return decoder_fields(
        hf,
        num_kv_heads=4,
        head_dim=256,
        max_len=max_len,
        activation_field="hidden_activation",
        activation_default="gelu_pytorch_tanh",
        tie_embeddings=True,
        **rope,
    )


def gemma_hf_config(config: TransformerConfig, model_type: str, architecture: str) -> dict[str, Any]:
    """The config.json fields of Gemma 2 and 3."""
    scale = config.attention_scale
    scalar = head_dim_of(config) if scale is None else scale**-2
    return dict(
        decoder_hf_config(config, model_type, architecture),
        hidden_activation=hf_activation(config),
        attention_bias=config.qkv_bias,
        query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
        attn_logit_softcapping=config.attn_logits_soft_cap,
        final_logit_softcapping=config.final_logit_soft_cap,
        sliding_window=sliding_window(config),
        layer_types=layer_types(config),
    )


def to_config(hf: ConfigReader) -> TransformerConfig:
    """The TransformerConfig of a Gemma 2 config.json."""
    fields = gemma_decoder_fields(hf, 8192)
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(fields["num_layers"])]
    hf.get("cache_implementation")  # a generation setting
    return TransformerConfig(**gemma_fields(hf, fields, types, (50.0, 30.0)))


def hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The config.json of `config` as Gemma 2."""
    return gemma_hf_config(config, "gemma2", "Gemma2ForCausalLM")
