"""The static options of one `dot_product_attention` call, and the checks of their values."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from jax import lax

# flax's spelling: None (JAX's default), a string ('default', 'high', 'highest', ...),
# a `jax.lax.Precision`, or a pair of either (one per operand).
PrecisionLike = None | str | lax.Precision | tuple[str, str] | tuple[lax.Precision, lax.Precision]

__all__ = ["CallOptions", "PrecisionLike", "check_soft_cap"]


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def check_soft_cap(owner: str, cap: Any, argument: str = "logits_soft_cap") -> float | None:
    """`cap` as a float, or None; ValueError naming `owner` and `argument` unless it is None or
    a finite number > 0."""
    if cap is None:
        return None
    if not is_number(cap) or not 0 < cap < math.inf:
        raise ValueError(f"{owner}: {argument} must be None or a positive number, got {cap!r}")
    return float(cap)


@dataclasses.dataclass(frozen=True)
class CallOptions:
    """The arguments of `dot_product_attention` that shape the program (jit-static), built once
    from its keywords; the arrays (lengths, segment ids, an array offset or scale, sinks,
    the dropout key) travel beside it."""

    is_causal: bool = False
    scale: float | None = None  # a Python-number scale, compiled in (cuDNN takes no traced one)
    window: tuple[int, int] | None = None  # (left, right)
    offset: int | None = 0  # a static query offset; None when it is an array (traced)
    soft_cap: float | None = None
    dropout_rate: float = 0.0
    return_residual: bool = False
    return_weights: bool = False
    implementation: str | None = None
    precision: Any = None
