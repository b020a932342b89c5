"""Interpretability of a TransformerLM: circuits of the learned matrices, and reading its activations.

The model learns W_Q, W_K, W_V and W_O; an attention pattern is what they
give on one input. This package looks at both:

  circuits     the learned matrices per head: W_QK and W_OV, their singular
               values and effective rank, Q-/K-/V-composition between heads,
               token-level QK and OV circuits, OV copying scores.
  attribution  reading a cache of activations (TransformerLens hook names):
               logit lens, per-head results, residual decomposition, direct
               logit attribution with the final LayerNorm's scale frozen.
  cache        the hook-name vocabulary (`HOOK_SHAPES`, `hook_name`) and names filters.
  capture      reading and changing activations by name: run_with_cache,
               run_with_hooks, generate_with_cache (linen and nnx models).
  patching     hooks that replace or ablate activations, and patching sweeps
               over (layer, head) or (layer, position) in one program.
  tl           the same model as TransformerLens 4.x's own (imports torch and
               transformer_lens on use; not imported here).
"""

from qkv_jax.interpretability import attribution, cache, capture, circuits, patching
from qkv_jax.interpretability.attribution import (
    accumulated_resid,
    direct_logit_attribution,
    head_results,
    logit_lens,
    residual_decomposition,
)
from qkv_jax.interpretability.cache import HOOK_SHAPES, hook_name, hook_names, select_names
from qkv_jax.interpretability.capture import generate_with_cache, run_with_cache, run_with_hooks
from qkv_jax.interpretability.circuits import (
    EmbeddingWeights,
    HeadWeights,
    composition_scores,
    copying_scores,
    effective_rank,
    embedding_weights,
    head_weights,
    ov_matrices,
    ov_singular_values,
    qk_matrices,
    qk_singular_values,
    singular_values,
    token_ov_circuit,
    token_qk_circuit,
)
from qkv_jax.interpretability.patching import ablate, activation_axes, patching_sweep, replace

__all__ = [
    "attribution",
    "cache",
    "circuits",
    "capture",
    "patching",
    "HOOK_SHAPES",
    "hook_names",
    "hook_name",
    "select_names",
    "run_with_cache",
    "run_with_hooks",
    "generate_with_cache",
    "activation_axes",
    "replace",
    "ablate",
    "patching_sweep",
    "HeadWeights",
    "EmbeddingWeights",
    "head_weights",
    "embedding_weights",
    "qk_matrices",
    "ov_matrices",
    "singular_values",
    "qk_singular_values",
    "ov_singular_values",
    "effective_rank",
    "composition_scores",
    "token_qk_circuit",
    "token_ov_circuit",
    "copying_scores",
    "accumulated_resid",
    "logit_lens",
    "head_results",
    "residual_decomposition",
    "direct_logit_attribution",
]
