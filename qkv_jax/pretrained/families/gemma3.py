"""Gemma 3 (the text model, `Gemma3ForCausalLM`): Gemma 2's decoder with a Gemma RMSNorm of each
head's query and key ("rms_offset", one gain `[head_dim]` shared by the heads), no soft caps by
default, five local layers to a global one (`layer_types`, or `sliding_window_pattern`), and two
RoPEs: the global layers' `rope_theta` (with `rope_scaling`) and the local layers' unscaled
`rope_local_base_freq` (qkv_jax's rope_base, rope_scaling and local_rope_base).

Refused: `use_bidirectional_attention`, and a scaled RoPE on the local layers.
"""

from __future__ import annotations

from typing import Any

from qkv_jax.lm import TransformerConfig
from qkv_jax.pretrained.families.common import ConfigReader, rope_parameters
from qkv_jax.pretrained.families.decoder import from_decoder, to_decoder
from qkv_jax.pretrained.families.gemma2 import gemma_decoder_fields, gemma_fields, gemma_hf_config

# The tensors: the Llama-shaped decoder's names and layouts.
from_hf, to_hf = from_decoder, to_decoder

MODEL_TYPES = ("gemma3_text",)
KINDS = ("full_attention", "sliding_attention")
GLOBAL_BASE, LOCAL_BASE = 1e6, 1e4  # transformers' RoPE bases of the global and local layers


def to_config(hf: ConfigReader) -> TransformerConfig:
    """The TransformerConfig of a Gemma 3 text config.json."""
    fields = gemma_decoder_fields(hf, 131072, default_base=GLOBAL_BASE, rope_kinds=KINDS)
    pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
    types = [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(fields["num_layers"])
    ]
    hf.get("cache_implementation")  # a generation setting
    ropes = dict(hf.rope(kinds=KINDS, default_base=GLOBAL_BASE))
    if "rope_parameters" not in hf and "rope_local_base_freq" not in hf:
        ropes["sliding_attention"] = (LOCAL_BASE, None)  # transformers' default local base
    base, scaling = ropes["sliding_attention"]
    local_base = None if ropes["sliding_attention"] == ropes["full_attention"] else base
    if local_base is not None and scaling is not None:
        hf.refuse("rope_parameters", {"sliding_attention": scaling}, "the local layers' RoPE is unscaled")
    return TransformerConfig(
        **dict(
            gemma_fields(hf, fields, types, (None, None)),
            normalize_qk="rms_offset",
            qk_norm_width="head",
            local_rope_base=local_base,
        )
    )


def hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The config.json of `config` as Gemma 3's text model."""
    full = rope_parameters(config.rope_base, config.rope_scaling)
    local = full if config.local_rope_base is None else rope_parameters(config.local_rope_base, None)
    return dict(
        gemma_hf_config(config, "gemma3_text", "Gemma3ForCausalLM"),
        rope_parameters={"full_attention": full, "sliding_attention": local},
    )
