"""Llama (1, 2, 3, 3.1 with its "llama3" RoPE scaling; "linear" and "yarn" scaling too).

A pre-norm RMSNorm decoder with a SwiGLU MLP, GQA and RoPE over whole heads
(`decoder`); `attention_bias` puts biases on all four attention projections,
`mlp_bias` on the three MLP ones. Refused: `pretraining_tp` other than 1 (the
sliced matmuls of Meta's tensor-parallel pretraining).
"""

from __future__ import annotations

from typing import Any

from qkv_jax.lm import TransformerConfig
from qkv_jax.pretrained.families.common import ConfigReader, attention_biases
from qkv_jax.pretrained.families.decoder import decoder_fields, decoder_hf_config, from_decoder, to_decoder

# The tensors: the Llama-shaped decoder's names and layouts.
from_hf, to_hf = from_decoder, to_decoder

MODEL_TYPES = ("llama",)


def to_config(hf: ConfigReader) -> TransformerConfig:
    """The TransformerConfig of a Llama config.json."""
    hf.accept("pretraining_tp", 1)
    biases = attention_biases(hf)
    fields = decoder_fields(hf)
    return TransformerConfig(**dict(fields, **biases, mlp_bias=hf.accept("mlp_bias", False, True)))


def hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The config.json of `config` as Llama."""
    return dict(
        decoder_hf_config(config, "llama", "LlamaForCausalLM"),
        attention_bias=config.qkv_bias,
        mlp_bias=config.mlp_bias,
        pretraining_tp=1,
    )
