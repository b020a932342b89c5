"""OLMo 2: Llama's decoder with the norms after each sublayer (x + norm(f(x))), and an RMSNorm
of the whole query (all its heads' features, gain `[num_heads * head_dim]`) and of the whole key
(`[num_kv_heads * head_dim]`) before RoPE.
"""

from __future__ import annotations

from typing import Any

from qkv_jax.lm import TransformerConfig
from qkv_jax.pretrained.families.common import ConfigReader, attention_biases
from qkv_jax.pretrained.families.decoder import decoder_fields, decoder_hf_config, from_decoder, to_decoder

# The tensors: the Llama-shaped decoder's names and layouts.
from_hf, to_hf = from_decoder, to_decoder

MODEL_TYPES = ("olmo2",)


def to_config(hf: ConfigReader) -> TransformerConfig:
    """The TransformerConfig of an OLMo 2 config.json."""
    fields = dict(decoder_fields(hf, epsilon=1e-5), **attention_biases(hf))
    return TransformerConfig(**fields, norm_placement="post", normalize_qk="rms", qk_norm_width="full")


def hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The config.json of `config` as OLMo 2."""
    return dict(decoder_hf_config(config, "olmo2", "Olmo2ForCausalLM"), attention_bias=config.qkv_bias)
