"""qkv_jax: learned attention (Q, K, V and O projections) in JAX and Flax.

Layout everywhere: query `[batch..., T, N, H]`, key `[batch..., S, K, H]`,
value `[batch..., S, K, Hv]`, attention weights `[batch..., N, T, S]`; a mask
is boolean with True = may attend.

Pure functions:  dot_product_attention (select_implementation picks its path),
                 chunked_attention, causal_mask, padding_mask, combine_masks
Flax modules:    StaticAttention, SelfAttentionV1, SelfAttention,
                 LearnedQueryAttention, MultiHeadAttention (a drop-in for
                 flax.linen.MultiHeadDotProductAttention, also under that name),
                 FlagReader
Language model:  TransformerConfig, TransformerBlock, TransformerLM, generate, init_cache
Hugging Face:    load_pretrained, save_pretrained (qkv_jax.pretrained: safetensors directories)
Head analysis:   collect_attention_weights, head_diagnostics, induction_scores
Submodules:      qkv_jax.checks (chex checks), qkv_jax.interop (PyTorch and Flax
                 weights), qkv_jax.diagnostics, qkv_jax.lm, qkv_jax.generation
                 (the decode loop, its cache and filters), qkv_jax.text
                 (character corpus), qkv_jax.lora (LoRA adapters, merge_lora),
                 qkv_jax.finetune (K/V head conversion, head ablation masks),
                 qkv_jax.positions (rotary position embeddings),
                 qkv_jax.sharding (TransformerLM's partition rules on a
                 ("data", "model") mesh)
Imported on use: qkv_jax.nnx (native flax.nnx MultiHeadAttention and
                 TransformerLM; flax.nnx imports optax), qkv_jax.interpretability
                 (activation caches, patching, attribution, circuits),
                 qkv_jax.plots (matplotlib figures), qkv_jax.training (the
                 trainer), qkv_jax.tasks (the built-in tasks), qkv_jax.report
                 (report.json, report.html); the sweeps and studies are the
                 checkout's `studies` package, beside the launchers
"""

from qkv_jax import checks, diagnostics, finetune, generation, interop, lm, lora, positions, text
from qkv_jax.attention import (
    causal_mask,
    chunked_attention,
    combine_masks,
    dot_product_attention,
    padding_mask,
    select_implementation,
)
from qkv_jax.diagnostics import collect_attention_weights, head_diagnostics, induction_scores
from qkv_jax.lm import TransformerBlock, TransformerConfig, TransformerLM, generate, init_cache
from qkv_jax.models import FlagReader
from qkv_jax.modules import MultiHeadAttention, MultiHeadDotProductAttention
from qkv_jax.pretrained import load_pretrained, save_pretrained
from qkv_jax.teaching import LearnedQueryAttention, SelfAttention, SelfAttentionV1, StaticAttention

__version__ = "0.1.0"

__all__ = [
    "dot_product_attention",
    "select_implementation",
    "chunked_attention",
    "causal_mask",
    "padding_mask",
    "combine_masks",
    "StaticAttention",
    "SelfAttentionV1",
    "SelfAttention",
    "LearnedQueryAttention",
    "MultiHeadAttention",
    "MultiHeadDotProductAttention",
    "FlagReader",
    "TransformerConfig",
    "TransformerBlock",
    "TransformerLM",
    "generate",
    "init_cache",
    "load_pretrained",
    "save_pretrained",
    "collect_attention_weights",
    "head_diagnostics",
    "induction_scores",
    "checks",
    "diagnostics",
    "finetune",
    "generation",
    "interop",
    "lm",
    "lora",
    "positions",
    "text",
]
