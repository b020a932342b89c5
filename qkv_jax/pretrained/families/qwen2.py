"""Qwen 2 and 2.5: Llama's decoder with biases on the query, key and value projections (none
on the output), and sliding windows on the layers `layer_types` marks (transformers 4 configs:
`use_sliding_window` and the layers from `max_window_layers` on).
"""

from __future__ import annotations

from typing import Any

from qkv_jax.lm import TransformerConfig
from qkv_jax.pretrained.families.common import (
    ConfigReader,
    layer_types,
    sliding_window,
    windows,
)
from qkv_jax.pretrained.families.decoder import decoder_fields, decoder_hf_config, from_decoder, to_decoder

# The tensors: the Llama-shaped decoder's names and layouts.
from_hf, to_hf = from_decoder, to_decoder

MODEL_TYPES = ("qwen2",)


def qwen_window(hf: ConfigReader) -> int | tuple[int | None, ...] | None:
    """TransformerConfig.window of a Qwen config: `sliding_window` keys (only with
    `use_sliding_window`) on the "sliding_attention" layers of `layer_types`, which default to
    the layers from `max_window_layers` on."""
    size = hf.get("sliding_window", 4096)
    if not hf.accept("use_sliding_window", False, True):
        size = None  # as transformers' Qwen configs: no window without use_sliding_window
    first_windowed = hf.get("max_window_layers", 28)
    default_types = [
        "sliding_attention" if size is not None and i >= first_windowed else "full_attention"
        for i in range(hf.require("num_hidden_layers"))
    ]
    return windows(hf.get("layer_types") or default_types, size)


def qwen_hf_window(config: TransformerConfig) -> dict[str, Any]:
    """The window fields of a Qwen config.json."""
    size = sliding_window(config)
    return dict(
        use_sliding_window=size is not None,
        sliding_window=size,
        max_window_layers=config.num_layers,
        layer_types=layer_types(config),
    )


def to_config(hf: ConfigReader) -> TransformerConfig:
    """The TransformerConfig of a Qwen 2 config.json."""
    fields = decoder_fields(hf, num_kv_heads=32, max_len=32768)
    return TransformerConfig(**dict(fields, qkv_bias=True, window=qwen_window(hf)))


def hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The config.json of `config` as Qwen 2."""
    return dict(decoder_hf_config(config, "qwen2", "Qwen2ForCausalLM"), **qwen_hf_window(config))
