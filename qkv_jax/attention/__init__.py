"""Scaled dot-product attention as a pure function, and the masks it takes.

The whole mechanism is one line,

    attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V,

and `dot_product_attention` (function.py) is that line with the details a research
codebase needs. It is a drop-in for `jax.nn.dot_product_attention` (the same
positional order, argument names and meanings: bias, mask, scale, is_causal,
sequence lengths, local_window_size, implementation, return_residual), and
adds: any number of leading batch dims, a query offset (a KV cache, chunked
prefill), segment ids for packed sequences, a logits soft cap, attention
sinks, dropout on the weights, returned weights, a matmul precision, and a
softmax that stays finite for fully masked rows and low-precision inputs.
docs/compatibility.md lists every difference from jax.nn.

Layout (jax.nn's):
  query  [batch..., T, N, H]    T query positions, N query heads, depth H
  key    [batch..., S, K, H]    S key positions, K key/value heads (K divides N)
  value  [batch..., S, K, Hv]
  output [batch..., T, N, Hv]
  attention weights [batch..., N, T, S]; residual (log-sum-exp) [batch..., T, N]
A mask is boolean, True = may attend, broadcastable to [batch..., N, T, S].

Query t sits at key position t + query_offset: `is_causal` lets it attend
keys s <= t + query_offset and `local_window_size=(left, right)` keys within
[t + query_offset - left, t + query_offset + right]. The default offset 0 is
jax.nn's top-left alignment; `query_offset=S - T` puts the queries at the end
of the keys (bottom-right), as when decoding from a cache of S keys.

Six implementations compute the same thing (`implementation=`): "reference",
the explicit einsum/softmax of reference.py (the one to read, and the only one that
returns weights or applies dropout); "xla", jax.nn's XLA path; "cudnn",
jax.nn's cuDNN path (GPU only); "chunked", `chunked_attention`, a blocked
online softmax whose memory grows as O(T x block) and which skips the tiles
that causality, a window or segment ids rule out; "pallas", `pallas_attention`,
the same as fused Pallas kernels (Triton on a GPU, interpret mode elsewhere);
and, only when asked for, "splash", jax's splash attention (Pallas, Mosaic TPU;
splash.py). What each takes is one
table, `SUPPORTED`; by default `select_implementation` picks one by a
written rule that reads it, and `check_supported` checks a choice ahead of
the call (as the modules do).

The package, one file per part:
  visibility.py  which keys each query may see (`KeyVisibility`), for every path;
                 the masks (`causal_mask`, `padding_mask`, `combine_masks`)
  reference.py   the reference path (and `softmax_with_sinks`)
  jax_nn.py      jax.nn's paths, "xla" and "cudnn"
  chunked.py     the blocked kernel, `chunked_attention`
  pallas.py      the fused Pallas kernels, `pallas_attention`
  splash.py      the "splash" path: jax's splash attention kernels
  dispatch.py    the table of what each path supports, the rule, the checks
  options.py     `CallOptions`, the static options of one call
  function.py    `dot_product_attention` itself
"""

from qkv_jax.attention.chunked import (
    BACKWARD_KEY_BLOCK,
    KEY_BLOCK,
    TILE_ELEMENTS,
    block_sizes,
    chunked_attention,
    flatten_batch,
    per_example,
)
from qkv_jax.attention.dispatch import (
    ACCELERATOR_BYTES,
    CHUNKED_MIN_KEYS,
    FEATURES,
    IMPLEMENTATIONS,
    MATERIALIZE_FRACTION,
    SUPPORTED,
    accelerator_block_sizes,
    check_supported,
    materialized_bytes,
    select_implementation,
)
from qkv_jax.attention.function import dot_product_attention
from qkv_jax.attention.options import CallOptions, PrecisionLike, check_soft_cap
from qkv_jax.attention.pallas import pallas_attention
from qkv_jax.attention.reference import softmax_with_sinks
from qkv_jax.attention.visibility import (
    KeyVisibility,
    and_masks,
    causal_mask,
    combine_masks,
    padding_mask,
    visible_keys,
    window_pair,
)

__all__ = [
    "dot_product_attention",
    "select_implementation",
    "check_supported",
    "IMPLEMENTATIONS",
    "FEATURES",
    "SUPPORTED",
    "CHUNKED_MIN_KEYS",
    "MATERIALIZE_FRACTION",
    "ACCELERATOR_BYTES",
    "accelerator_block_sizes",
    "materialized_bytes",
    "CallOptions",
    "PrecisionLike",
    "causal_mask",
    "padding_mask",
    "combine_masks",
    "and_masks",
    "KeyVisibility",
    "visible_keys",
    "window_pair",
    "softmax_with_sinks",
    "check_soft_cap",
    "chunked_attention",
    "pallas_attention",
    "flatten_batch",
    "per_example",
    "block_sizes",
    "TILE_ELEMENTS",
    "KEY_BLOCK",
    "BACKWARD_KEY_BLOCK",
]
