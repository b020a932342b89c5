"""The norms of `qkv_jax.norms` as a flax.nnx module (the same function, parameters and hook points).

Norm  `qkv_jax.norms.Norm` as an nnx module
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from qkv_jax.nnx.hooks import HookPoint, hooks_of
from qkv_jax.norms import check_norm, has_bias, normalize, scale_init

Array = jax.Array
Dtype = Any

__all__ = ["Norm"]


class Norm(nnx.Module):
    """`qkv_jax.norms.Norm` as an nnx module: `Norm(num_features, *, kind="layernorm", epsilon=1e-6,
    use_bias=True, dtype=None, param_dtype=float32, rngs=None)`.

    Attributes `scale` and `bias` (`nnx.Param`; `bias` None without one, as
    flax.nnx.LayerNorm's), hook points `hook_scale` and `hook_normalized`;
    the initial values are constants, but a key is drawn from `rngs` per
    parameter as flax.nnx.LayerNorm draws them, so the modules built after
    it start from the same keys.
    """

    def __init__(
        self,
        num_features: int,
        *,
        kind: str = "layernorm",
        epsilon: float = 1e-6,
        use_bias: bool = True,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        rngs: nnx.Rngs | None = None,
    ):
        check_norm(type(self).__name__, kind, "kind")
        self.num_features, self.kind, self.epsilon = num_features, kind, epsilon
        self.dtype, self.param_dtype = dtype, param_dtype
        key = (lambda: jax.random.PRNGKey(0)) if rngs is None else rngs.params
        self.scale = nnx.Param(scale_init(kind)(key(), (num_features,), param_dtype))
        self.bias: nnx.Param | None = nnx.data(None)
        if has_bias(kind, use_bias):
            self.bias = nnx.Param(nn.initializers.zeros(key(), (num_features,), param_dtype))
        self.hook_scale = HookPoint()
        self.hook_normalized = HookPoint()

    def __call__(self, x: Array) -> Array:
        return normalize(
            x,
            kind=self.kind,
            epsilon=self.epsilon,
            scale=self.scale[...],
            bias=None if self.bias is None else self.bias[...],
            dtype=self.dtype,
            hook=hooks_of(self),
        )
