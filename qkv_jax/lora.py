"""Low-rank adapters (LoRA, Hu et al. 2021) beside learned projections, and merging them away.

  LoRADenseGeneral  `flax.linen.DenseGeneral` plus a low-rank update: `kernel` W
                    `[in..., out...]` and `bias` exactly where DenseGeneral keeps them,
                    `lora_a` A `[in..., r]` and `lora_b` B `[r, out...]`;
                    y = x W + b + (alpha / r) (x A) B. B starts at zero, so a fresh
                    adapter leaves the layer's outputs unchanged.
  lora_update       (alpha / r) (x A) B, the update LoRADenseGeneral adds (and
                    `qkv_jax.nnx.LoRALinearGeneral`, its flax.nnx form).
  effective_kernel  W + (alpha / r) A B of one projection's parameters (W alone when it
                    has no adapter): the kernel the adapted layer computes with.
  merge_lora        a parameter tree with every adapter folded into its kernel: plain
                    DenseGeneral parameters, which load into the modules without adapters.
  adapter_labels    "adapter" or "frozen" per parameter, from its path (the labels
                    `optax.multi_transform` trains only the adapters by).
  count_params      (all parameters, the trainable ones) of a tree.

`MultiHeadAttention` (`lora_rank`, `lora_alpha`, `lora_targets`) and the
TransformerLM's MLP (`TransformerConfig`) build their projections from these
classes when asked to, linen and nnx alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array
Initializer = Any

__all__ = [
    "ADAPTER_NAMES",
    "LoRADenseGeneral",
    "lora_update",
    "default_lora_a_init",
    "check_adapter",
    "effective_kernel",
    "merge_lora",
    "has_adapters",
    "adapter_labels",
    "count_params",
]

# The names of an adapter's two factors, beside a projection's `kernel`.
ADAPTER_NAMES = ("lora_a", "lora_b")


def _scale(alpha: float, rank: int) -> float:
    return alpha / rank


def check_adapter(owner: str, rank: Any, alpha: Any) -> None:
    """ValueError naming the value unless `rank` is a positive int and `alpha` > 0."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"{owner}: rank={rank!r} must be a positive int")
    if not alpha > 0:
        raise ValueError(f"{owner}: alpha={alpha!r} must be > 0")


def default_lora_a_init(num_in_axes: int) -> Initializer:
    """Normal with variance 1/fan_in over A's `num_in_axes` input axes."""
    return nn.initializers.variance_scaling(
        1.0, "fan_in", "normal", in_axis=tuple(range(num_in_axes)), out_axis=-1
    )


def lora_update(
    inputs: Array,
    lora_a: Array,
    lora_b: Array,
    axis: tuple[int, ...],
    alpha: float,
    dtype: Any,
    precision: Any,
) -> Array:
    """(alpha / r) (x A) B for inputs `[batch..., in...]` (contracted over `axis`, sorted,
    non-negative), A `[in..., r]`, B `[r, out...]`: `[batch..., out...]`, in `dtype`'s
    promotion of the three."""
    x, lora_a, lora_b = nn.dtypes.promote_dtype(inputs, lora_a, lora_b, dtype=dtype)
    down = lax.dot_general(
        x, lora_a, ((axis, tuple(range(len(axis)))), ((), ())), precision=precision
    )  # (..., r)
    up = lax.dot_general(down, lora_b, (((down.ndim - 1,), (0,)), ((), ())), precision=precision)
    return _scale(alpha, lora_a.shape[-1]) * up  # (..., out...)


class LoRADenseGeneral(nn.DenseGeneral):
    """`nn.DenseGeneral` with a trainable low-rank update beside its kernel.

    Attributes (besides DenseGeneral's; `batch_dims` is not supported):
      rank: r, the adapter's inner width (positive).
      alpha: the update is scaled by alpha / r, so that changing r needs no new
        learning rate (Hu et al. 2021, section 4.1).
      lora_a_init: of A `[in..., r]`; default normal with variance 1/fan_in.
        B `[r, out...]` is zero at initialisation.

    Parameters `kernel`, `bias` (as DenseGeneral's, drawn from the same
    random streams: the same key gives the same W and b), `lora_a`, `lora_b`.
    Output `[batch..., out...]` = DenseGeneral(x) + (alpha / r) (x A) B.
    """

    rank: int = 0
    alpha: float = 1.0
    lora_a_init: Initializer | None = None

    def __post_init__(self):
        check_adapter("LoRADenseGeneral", self.rank, self.alpha)
        if self.batch_dims:
            raise ValueError(f"LoRADenseGeneral: batch_dims={self.batch_dims!r} is not supported")
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs: Array) -> Array:
        output = super().__call__(inputs)  # kernel and bias: (..., out...)
        axis = tuple(sorted(a % inputs.ndim for a in np.atleast_1d(self.axis)))
        features = tuple(np.atleast_1d(self.features).tolist())
        in_shape = tuple(inputs.shape[a] for a in axis)
        init = self.lora_a_init or default_lora_a_init(len(axis))
        lora_a = self.param("lora_a", init, (*in_shape, self.rank), self.param_dtype)  # (in..., r)
        lora_b = self.param(
            "lora_b", nn.initializers.zeros_init(), (self.rank, *features), self.param_dtype
        )  # (r, out...)
        update = lora_update(inputs, lora_a, lora_b, axis, self.alpha, self.dtype, self.precision)
        return output + update.astype(output.dtype)  # (..., out...)


def effective_kernel(params: Mapping[str, Any], alpha: float) -> Array:
    """The kernel `[in..., out...]` of one projection's parameters: `kernel` + (alpha / r)
    `lora_a` @ `lora_b` when it has an adapter, else `kernel` itself (float32 products at
    full precision)."""
    kernel = params["kernel"]
    if "lora_a" not in params:
        return kernel
    lora_a, lora_b = params["lora_a"], params["lora_b"]  # (in..., r), (r, out...)
    update = jnp.tensordot(lora_a, lora_b, axes=1, precision=lax.Precision.HIGHEST)  # (in..., out...)
    return (kernel + _scale(alpha, lora_a.shape[-1]) * update).astype(kernel.dtype)


def merge_lora(params: Any, alpha: float) -> Any:
    """`params` with every adapter folded into its kernel (`effective_kernel`) and
    `lora_a`/`lora_b` removed: the parameters of the same model without adapters
    (e.g. `TransformerLM(dataclasses.replace(config, lora_rank=0))`), whose outputs equal the
    adapted model's up to float rounding. `alpha`: the adapters' `lora_alpha`."""
    if not isinstance(params, Mapping):
        return params
    merged = {name: merge_lora(value, alpha) for name, value in params.items() if name not in ADAPTER_NAMES}
    if "lora_a" in params:
        merged["kernel"] = effective_kernel(params, alpha)
    return merged


def _path_names(path: tuple) -> list[str]:
    return [str(getattr(entry, "key", getattr(entry, "idx", entry))) for entry in path]


def has_adapters(params: Any) -> bool:
    """Whether any leaf of `params` is an adapter factor (`lora_a` or `lora_b`)."""
    return any(
        _path_names(path)[-1] in ADAPTER_NAMES for path, _ in jax.tree_util.tree_leaves_with_path(params)
    )


def adapter_labels(params: Any) -> Any:
    """A tree like `params` of "adapter" (a `lora_a`/`lora_b` leaf) or "frozen" (every other)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "adapter" if _path_names(path)[-1] in ADAPTER_NAMES else "frozen", params
    )


def count_params(params: Any) -> tuple[int, int]:
    """(parameters, trainable parameters) of `params`: with adapters only they train."""
    sizes = [
        (int(np.size(leaf)), label)
        for leaf, label in zip(jax.tree.leaves(params), jax.tree.leaves(adapter_labels(params)), strict=True)
    ]
    total = sum(size for size, _ in sizes)
    if not has_adapters(params):
        return total, total
    return total, sum(size for size, label in sizes if label == "adapter")
