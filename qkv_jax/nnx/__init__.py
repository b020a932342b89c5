"""qkv_jax's attention and language model as native `flax.nnx` modules.

  HookPoint, LayerNorm  the linen `qkv_jax.modules` hook point and LayerNorm with
                      hook points, as nnx modules (`qkv_jax.interpretability`).
  LoRALinearGeneral   `flax.nnx.LinearGeneral` with a LoRA adapter (the linen
                      `qkv_jax.lora.LoRADenseGeneral`'s parameters).
  MultiHeadAttention  a drop-in for `flax.nnx.MultiHeadAttention` (its
                      constructor, call, attribute names, `init_cache`), with
                      qkv_jax's extras: MLA latents, head_dim/v_head_dim,
                      is_causal, scale, the attention implementation, LoRA.
  TransformerBlock, TransformerLM  the linen `qkv_jax.lm` model from the same
                      `TransformerConfig`, with `init_cache` and decoding.
  generate            prompts -> new tokens for the nnx `TransformerLM` (`qkv_jax.generation`).
  linen_to_nnx, nnx_to_linen  parameters (and decode caches) between the linen
                      modules' variables and these modules, both ways.
  flax_dot_product_attention  the default `attention_fn` (flax's signature,
                      `qkv_jax.dot_product_attention` underneath; the old name
                      `dot_product_attention` warns and still works).

The attention lives in `qkv_jax.nnx.attention`, the language model in `qkv_jax.nnx.lm`.
"""

from qkv_jax.nnx.attention import (
    HookPoint,
    LayerNorm,
    LoRALinearGeneral,
    MultiHeadAttention,
    flax_dot_product_attention,
)
from qkv_jax.nnx.attention import __getattr__ as __getattr__
from qkv_jax.nnx.lm import TransformerBlock, TransformerLM, generate, linen_to_nnx, nnx_to_linen
from qkv_jax.pretrained.io import load_pretrained_nnx as load_pretrained

__all__ = [
    "HookPoint",
    "LayerNorm",
    "MultiHeadAttention",
    "LoRALinearGeneral",
    "TransformerBlock",
    "TransformerLM",
    "generate",
    "linen_to_nnx",
    "nnx_to_linen",
    "load_pretrained",
    "flax_dot_product_attention",
]
