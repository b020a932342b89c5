"""qkv_jax: learned attention (Q, K, V and O projections) in JAX and Flax.

Pure functions:  dot_product_attention (select_implementation picks its path),
                 chunked_attention, causal_mask, padding_mask, combine_masks
Flax modules:    StaticAttention, SelfAttentionV1, SelfAttention,
                 LearnedQueryAttention, MultiHeadAttention
Submodules:      qkv_jax.checks (chex checks), qkv_jax.interop (PyTorch weights)
"""

from qkv_jax import checks, interop
from qkv_jax.attention import (
    causal_mask,
    combine_masks,
    dot_product_attention,
    padding_mask,
    select_implementation,
)
from qkv_jax.chunked import chunked_attention
from qkv_jax.modules import (
    LearnedQueryAttention,
    MultiHeadAttention,
    SelfAttention,
    SelfAttentionV1,
    StaticAttention,
)

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
    "checks",
    "interop",
]
