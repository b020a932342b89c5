"""One mapping file per model family: its config translation and its tensor names and layouts.

Each family module has
  MODEL_TYPES  the config.json `model_type` values it reads
  to_config    Hugging Face config (`qkv_jax.pretrained.schema.HFConfig`) -> TransformerConfig
  from_hf      (config, tensors) -> (linen parameter path, array) pairs, one tensor at a time
  to_hf        (config, params) -> (Hugging Face tensor name, array) pairs
  hf_config    TransformerConfig -> config.json (transformers 5's schema)
Adding a family is adding such a file and its line in `FAMILIES`; what the families share
lives in `common` (readers, layouts) and `decoder` (the Llama-shaped decoder).
"""

from __future__ import annotations

from types import ModuleType

from qkv_jax.pretrained.families import gemma2, gemma3, gpt2, gpt_neox, llama, mistral, olmo2, qwen2, qwen3

__all__ = ["FAMILIES"]

# model_type -> the family module that reads it.
FAMILIES: dict[str, ModuleType] = {
    model_type: family
    for family in (gpt2, gpt_neox, llama, mistral, qwen2, qwen3, gemma2, gemma3, olmo2)
    for model_type in family.MODEL_TYPES
}
