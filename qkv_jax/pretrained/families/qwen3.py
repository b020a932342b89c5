"""Qwen 3 (dense): Qwen 2's decoder with an RMSNorm of each head's query and key (one gain
`[head_dim]` shared by the heads, before RoPE) and, with `attention_bias`, biases on all four
attention projections.
"""

from __future__ import annotations

from typing import Any

from qkv_jax.lm import TransformerConfig
from qkv_jax.pretrained.families.common import ConfigReader, attention_biases
from qkv_jax.pretrained.families.decoder import decoder_fields, decoder_hf_config, from_decoder, to_decoder
from qkv_jax.pretrained.families.qwen2 import qwen_hf_window, qwen_window

# The tensors: the Llama-shaped decoder's names and layouts.
from_hf, to_hf = from_decoder, to_decoder

MODEL_TYPES = ("qwen3",)


def to_config(hf: ConfigReader) -> TransformerConfig:
    """The TransformerConfig of a Qwen 3 config.json."""
    fields = dict(decoder_fields(hf, num_kv_heads=32, head_dim=128, max_len=32768), **attention_biases(hf))
    return TransformerConfig(**fields, normalize_qk="rms", qk_norm_width="head", window=qwen_window(hf))


def hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The config.json of `config` as Qwen 3."""
    return dict(
        decoder_hf_config(config, "qwen3", "Qwen3ForCausalLM"),
        attention_bias=config.qkv_bias,
        **qwen_hf_window(config),
    )
