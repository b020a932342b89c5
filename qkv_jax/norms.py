"""The norms of the transformer: LayerNorm, RMSNorm and Gemma's RMSNorm, one function and two faces.

  NORMS       the kinds: "layernorm", "rms", "rms_offset"
  check_norm  ValueError naming a kind that is not one of them
  normalize   the pure function over the last axis, with TransformerLens's two hook points
  Norm        the linen module (parameters `scale`, and `bias` for "layernorm"); its
              nnx twin is `qkv_jax.nnx.norms.Norm`

The kinds, over the last axis of x `[..., D]`, with eps the epsilon:
  layernorm   (x - mean) / sqrt(var + eps) * scale + bias, flax's LayerNorm
              (scale ones, bias zeros; the variance as E[x^2] - E[x]^2 clipped at 0)
  rms         x / sqrt(mean(x^2) + eps) * scale, RMSNorm (scale ones; Llama, Qwen, OLMo 2)
  rms_offset  x / sqrt(mean(x^2) + eps) * (1 + scale), Gemma's RMSNorm (scale zeros)
The statistics are computed in at least float32 (rms_offset's whole product
too), then cast to the computation dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from qkv_jax.hooks import hook

Array = jax.Array
Dtype = Any

__all__ = ["NORMS", "check_norm", "normalize", "Norm", "has_bias", "scale_init"]

# The kinds of norm (TransformerConfig.norm, Norm.kind).
NORMS = ("layernorm", "rms", "rms_offset")


def check_norm(owner: str, kind: Any, field: str = "norm") -> str:
    """`kind` if it is one of `NORMS`, else ValueError naming `owner`, `field` and the value."""
    if not isinstance(kind, str) or kind not in NORMS:
        raise ValueError(f"{owner}: {field}={kind!r} must be one of {', '.join(NORMS)}")
    return kind


def _identity(name: str, x: Array) -> Array:
    return x


def normalize(
    x: Array,
    *,
    kind: str,
    epsilon: float,
    scale: Array,
    bias: Array | None = None,
    dtype: Dtype | None = None,
    hook: Callable[[str, Array], Array] = _identity,
) -> Array:
    """The norm `kind` (of `NORMS`) of `x` `[..., D]` over its last axis, with `scale` (and `bias`) `[D]`.

    As TransformerLens names them, the denominator sqrt(var + eps) (or
    sqrt(mean(x^2) + eps)) `[..., 1]` passes through `hook("hook_scale", .)`
    and the normalised input `[..., D]` through `hook("hook_normalized", .)`
    before the gain, so a patched scale freezes the norm. `bias` None: no
    bias. Returns `[..., D]` in `dtype` (None: promoted from the input and
    the parameters).
    """
    check_norm("normalize", kind, "kind")
    stats = x.astype(jnp.promote_types(dtype or x.dtype, jnp.float32))  # (..., D)
    if kind == "layernorm":
        mean = jnp.mean(stats, axis=-1, keepdims=True)  # (..., 1)
        variance = jnp.maximum(0.0, jnp.mean(jnp.square(stats), axis=-1, keepdims=True) - jnp.square(mean))
        centred = x - mean  # (..., D)
    else:
        variance = jnp.mean(jnp.square(stats), axis=-1, keepdims=True)  # (..., 1)
        centred = stats if kind == "rms_offset" else x  # (..., D)
    std = hook("hook_scale", jnp.sqrt(variance + epsilon))  # (..., 1)
    normalized = hook("hook_normalized", centred / std)  # (..., D)
    lead = (1,) * (x.ndim - 1)
    gain = scale.reshape(*lead, -1)  # (1..., D)
    if kind == "rms_offset":
        gain = 1.0 + gain.astype(normalized.dtype)
    y = normalized * gain  # (..., D)
    if bias is not None:
        y = y + bias.reshape(*lead, -1)
    return jnp.asarray(y, nn.dtypes.canonicalize_dtype(x, scale, bias, dtype=dtype))


def has_bias(kind: str, use_bias: bool) -> bool:
    """Whether a norm of `kind` has a `bias` (only "layernorm", with `use_bias`)."""
    return kind == "layernorm" and use_bias


def scale_init(kind: str) -> Callable[..., Array]:
    """The initializer of a norm's `scale`: ones, zeros for "rms_offset" (its gain is 1 + scale)."""
    return nn.initializers.zeros if kind == "rms_offset" else nn.initializers.ones


class Norm(nn.Module):
    """A norm of `NORMS` over the last axis with TransformerLens's hook points hook_scale, hook_normalized.

    Parameters `scale` `[D]` (ones; zeros for "rms_offset") and, for
    "layernorm" with `use_bias`, `bias` `[D]` (zeros): with the defaults,
    `flax.linen.LayerNorm`'s parameters and statistics, so its checkpoints
    load unchanged. `use_bias` is read by "layernorm" only (the RMS kinds have
    no bias).
    """

    kind: str = "layernorm"
    epsilon: float = 1e-6
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32

    def __post_init__(self):
        check_norm(type(self).__name__, self.kind, "kind")
        super().__post_init__()

    @nn.compact
    def __call__(self, x: Array) -> Array:
        features = (x.shape[-1],)
        scale = self.param("scale", scale_init(self.kind), features, self.param_dtype)
        bias = None
        if has_bias(self.kind, self.use_bias):
            bias = self.param("bias", nn.initializers.zeros, features, self.param_dtype)
        return normalize(
            x,
            kind=self.kind,
            epsilon=self.epsilon,
            scale=scale,
            bias=bias,
            dtype=self.dtype,
            hook=lambda name, value: hook(self, name, value),
        )
