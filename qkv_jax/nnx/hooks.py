"""Hook points as flax.nnx modules: the nnx twin of `qkv_jax.hooks`.

HookPoint  a named activation, the identity unless `qkv_jax.interpretability`
           sets its `hook` or `capture`
hooks_of   `(name, x) -> x` through an nnx module's HookPoint attributes
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

Array = jax.Array

__all__ = ["HookPoint", "hooks_of"]


class HookPoint(nnx.Module):
    """`qkv_jax.hooks.HookPoint` as an nnx module: `__call__(x) -> x`, no parameters.

    Two static attributes, set by `qkv_jax.interpretability` around a run and
    reset after it: `hook` (None, or `x -> x'`, which the point then returns)
    and `capture` (sow the value it returns as `nnx.Intermediate`
    "activation", which `nnx.capture` collects). Both off, it is the identity.
    """

    def __init__(self):
        self.hook: Callable[[Array], Array] | None = None
        self.capture = False

    def __call__(self, x: Array) -> Array:
        if self.hook is not None:
            x = self.hook(x)
        if self.capture:
            self.sow(nnx.Intermediate, "activation", x)
        return x


def hooks_of(module: nnx.Module) -> Callable[[str, Array], Array]:
    """`(name, x) -> x` through `module`'s HookPoint attribute `name`."""
    return lambda name, x: getattr(module, name)(x)
