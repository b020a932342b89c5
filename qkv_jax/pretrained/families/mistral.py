"""Mistral: Llama's decoder with GQA and one sliding window for every layer.

`sliding_window` (None: global attention) is every layer's window, as
transformers' Mistral applies it (a `layer_types` list in the file is read and,
as there, not used). Mistral has no biases.
"""

from __future__ import annotations

from typing import Any

from qkv_jax.lm import TransformerConfig
from qkv_jax.pretrained.families.common import ConfigReader, sliding_window
from qkv_jax.pretrained.families.decoder import decoder_fields, decoder_hf_config, from_decoder, to_decoder

# The tensors: the Llama-shaped decoder's names and layouts.
from_hf, to_hf = from_decoder, to_decoder

MODEL_TYPES = ("mistral",)


def to_config(hf: ConfigReader) -> TransformerConfig:
    """The TransformerConfig of a Mistral config.json."""
    fields = decoder_fields(hf, num_kv_heads=8, max_len=4096 * 32)
    hf.get("layer_types")
    return TransformerConfig(**dict(fields, window=hf.get("sliding_window", 4096)))


def hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The config.json of `config` as Mistral (one window, or none, for every layer)."""
    return dict(
        decoder_hf_config(config, "mistral", "MistralForCausalLM"), sliding_window=sliding_window(config)
    )
