"""Hook points: named activations, identities unless `qkv_jax.interpretability` reads or changes them.

  HookPoint   the linen hook point (`capture_intermediates` reads it,
              `nn.intercept_methods` changes it)
  hook        `x` through the linen HookPoint `name` of a module, inside its compact method

The lowest layer of the modules: the norms, the attention and the language
model all pass their named activations through these (the nnx twin:
`qkv_jax.nnx.hooks`). No flax.nnx here: it would pull optax into `import qkv_jax`.
"""

from __future__ import annotations

import flax.linen as nn
import jax

Array = jax.Array

__all__ = ["HookPoint", "hook"]


class HookPoint(nn.Module):
    """A named activation, `__call__(x) -> x`: no parameters, no computation.

    A model passes what is worth reading or changing (queries, attention
    patterns, the residual stream, ...) through a HookPoint named `hook_...`;
    left alone it is the identity, which XLA removes. `qkv_jax.interpretability`
    reads hook points with flax's `capture_intermediates` and changes their
    values with `nn.intercept_methods` (`run_with_cache`, `run_with_hooks`).
    """

    def __call__(self, x: Array) -> Array:
        return x


def hook(module: nn.Module, name: str, x: Array) -> Array:
    """`x` through the HookPoint `name` of `module` (called inside its compact method)."""
    return HookPoint(name=name, parent=module)(x)
