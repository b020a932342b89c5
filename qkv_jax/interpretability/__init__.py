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

# Each submodule's public names are the package's: `__all__` is theirs, not a second list.
from qkv_jax.interpretability.attribution import *  # noqa: F403
from qkv_jax.interpretability.cache import *  # noqa: F403
from qkv_jax.interpretability.capture import *  # noqa: F403
from qkv_jax.interpretability.circuits import *  # noqa: F403
from qkv_jax.interpretability.patching import *  # noqa: F403

__all__ = [
    "attribution",
    "cache",
    "capture",
    "circuits",
    "patching",
    *cache.__all__,
    *capture.__all__,
    *patching.__all__,
    *circuits.__all__,
    *attribution.__all__,
]
