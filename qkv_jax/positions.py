"""Rotary position embeddings (RoPE) and the positions of packed sequences, as pure functions.

  rotary_dims        how many of a head's H dims a rotary fraction rotates
  rope_angles        the rotation angles `[..., T, r/2]` of positions `[..., T]`
  RopeScaling        a RoPE scaling rule for long contexts: "linear", "llama3" or "yarn"
  rope_frequencies   the inverse frequencies `[r/2]` (scaled or not) and the factor of cos and sin
  apply_rope         rotates queries or keys `[batch..., T, heads, H]` by their positions
  segment_positions  positions that restart at 0 where a packed sequence's segment id changes

Convention (GPT-NeoX's, the one Hugging Face's `rotary_pct` / `partial_rotary_factor`
models use): the rotated part of a head is its leading r = int(H * fraction) dims,
split in two halves; dim i of the first half and dim i of the second half form a
pair rotated by the angle position * base^(-2i / r), i < r / 2. The frequencies
are those of the r rotated dims (not of H); the remaining H - r dims pass
unchanged. Query and key at positions p and q then have logits that depend on
their positions only through p - q.

Scaling (`RopeScaling`, the rules Hugging Face's `rope_type` names) changes the
frequencies, and YaRN also multiplies cos and sin by an attention factor:
  linear  every frequency divided by `factor` (positions interpolated)
  llama3  wavelengths longer than original_max_len / low_freq_factor divided by
          `factor`, shorter than original_max_len / high_freq_factor kept, and
          those between blended smoothly (Llama 3.1)
  yarn    per pair a blend of the interpolated (divided by `factor`) and the
          original frequency by a linear ramp between the pairs that turn
          beta_fast and beta_slow times over original_max_len positions; cos and
          sin times attention_factor (default 0.1 ln(factor) + 1)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array

__all__ = [
    "ROPE_SCALINGS",
    "RopeScaling",
    "rotary_dims",
    "rope_angles",
    "rope_frequencies",
    "apply_rope",
    "segment_positions",
    "check_rope",
]

# The kinds of RoPE scaling (RopeScaling.kind), Hugging Face's `rope_type` names.
ROPE_SCALINGS = ("linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling rule (see the module docstring), checked when built.

    Attributes:
      kind: "linear", "llama3" or "yarn" (`ROPE_SCALINGS`).
      factor: the context extension, > 0: frequencies divided by it (all of
        them for "linear", the long wavelengths for the others).
      original_max_len: the pretraining length the "llama3" and "yarn" bands
        are measured against (required by them, unused by "linear").
      low_freq_factor, high_freq_factor: "llama3"'s band edges, wavelengths of
        original_max_len / low_freq_factor and / high_freq_factor (high > low > 0).
      beta_fast, beta_slow: "yarn"'s ramp ends, in turns over original_max_len.
      attention_factor: "yarn"'s factor of cos and sin; None: 0.1 ln(factor) + 1
        (1 when factor <= 1).
      truncate: "yarn" rounds the ramp's ends outwards to whole pairs.
    """

    kind: str
    factor: float
    original_max_len: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        owner = "RopeScaling"
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"{owner}: kind={self.kind!r} must be one of {', '.join(ROPE_SCALINGS)}")
        numbers = dict(
            factor=self.factor,
            low_freq_factor=self.low_freq_factor,
            high_freq_factor=self.high_freq_factor,
            beta_fast=self.beta_fast,
            beta_slow=self.beta_slow,
            attention_factor=1.0 if self.attention_factor is None else self.attention_factor,
        )
        for field, value in numbers.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{owner}: {field}={value!r} must be a finite number > 0")
        length = self.original_max_len
        if self.kind != "linear" and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
            raise ValueError(
                f"{owner}: kind={self.kind!r} needs original_max_len, a positive int (the pretraining "
                f"length), got {length!r}"
            )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"{owner}: high_freq_factor={self.high_freq_factor} must be > "
                f"low_freq_factor={self.low_freq_factor}"
            )
        if not isinstance(self.truncate, bool):
            raise ValueError(f"{owner}: truncate={self.truncate!r} must be True or False")


def _llama3_frequencies(inverse: np.ndarray, scaling: RopeScaling, length: int) -> np.ndarray:
    """Llama 3.1's rule on float64 inverse frequencies `[r/2]`: long wavelengths divided by the
    factor, short ones kept, the band between blended linearly in turns over `length` positions
    (original_max_len)."""
    wavelength = 2 * math.pi / inverse  # (r/2,)
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    turns = length / wavelength  # (r/2,) turns over the pretraining length
    smooth = np.clip((turns - low) / (high - low), 0.0, 1.0)  # (r/2,) 0: long, 1: short wavelengths
    return (1 - smooth) * inverse / scaling.factor + smooth * inverse


def _yarn_frequencies(
    inverse: np.ndarray, rotated: int, base: float, scaling: RopeScaling, length: int
) -> np.ndarray:
    """YaRN's blend of interpolated and original float64 inverse frequencies `[r/2]`, the ramp
    measured in turns over `length` positions (original_max_len)."""

    def pair_of(turns: float) -> float:  # the (fractional) pair turning `turns` times over the length
        return rotated * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_of(scaling.beta_fast), pair_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotated - 1)
    if low == high:
        high += 0.001  # a ramp of one step
    ramp = np.clip((np.arange(rotated // 2) - low) / (high - low), 0.0, 1.0)  # (r/2,) 0: keep, 1: interpolate
    return inverse / scaling.factor * ramp + inverse * (1 - ramp)


def rope_frequencies(
    rotated: int, base: float, scaling: RopeScaling | None = None
) -> tuple[np.ndarray, float]:
    """(inverse frequencies `[rotated // 2]` float32, the attention factor multiplying cos and sin).

    Pair i turns at base^(-2i / rotated) radians per position, changed by
    `scaling`'s rule (see the module docstring); the factor is 1 except for
    "yarn". Computed in float64 on the host, then rounded to float32.
    """
    inverse = float(base) ** -(np.arange(0, rotated, 2, dtype=np.float64) / rotated)  # (r/2,)
    if scaling is None:
        return inverse.astype(np.float32), 1.0
    length = scaling.original_max_len or 0  # checked by RopeScaling for llama3 and yarn
    if scaling.kind == "linear":
        return (inverse / scaling.factor).astype(np.float32), 1.0
    if scaling.kind == "llama3":
        return _llama3_frequencies(inverse, scaling, length).astype(np.float32), 1.0
    factor = scaling.attention_factor
    if factor is None:
        factor = 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0
    return _yarn_frequencies(inverse, rotated, base, scaling, length).astype(np.float32), float(factor)


def check_rope(owner: str, base: Any, fraction: Any) -> None:
    """ValueError naming `rope_base` or `rope_fraction` unless base > 0 (or None: no RoPE) and
    0 < fraction <= 1."""
    number = (int, float)
    if base is not None and (
        isinstance(base, bool) or not isinstance(base, number) or not 0 < base < math.inf
    ):
        raise ValueError(
            f"{owner}: rope_base={base!r} must be a finite number > 0 (or None: no rotary embedding)"
        )
    if isinstance(fraction, bool) or not isinstance(fraction, number) or not 0 < fraction <= 1:
        raise ValueError(f"{owner}: rope_fraction={fraction!r} must be a number in (0, 1]")


def rotary_dims(head_dim: int, fraction: float, owner: str = "apply_rope") -> int:
    """r = int(head_dim * fraction), the leading dims of each head that rotate; ValueError
    unless r is even and at least 2 (the dims rotate in pairs)."""
    rotated = int(head_dim * fraction)
    if rotated < 2 or rotated % 2:
        raise ValueError(
            f"{owner}: rope_fraction={fraction} of head_dim={head_dim} rotates {rotated} dims; "
            "it must be an even number >= 2"
        )
    return rotated


def rope_angles(positions: Any, rotated: int, base: float) -> Array:
    """float32 angles `[..., T, rotated // 2]`: position p times base^(-2i / rotated) for pair i."""
    exponents = jnp.arange(0, rotated, 2, dtype=jnp.float32) / rotated  # (r/2,)
    frequencies = jnp.asarray(base, jnp.float32) ** -exponents  # (r/2,)
    positions = jnp.asarray(positions).astype(jnp.float32)
    return positions[..., None] * frequencies.reshape((1,) * positions.ndim + frequencies.shape)


def _scaled_angles(positions: Any, rotated: int, base: float, scaling: RopeScaling) -> tuple[Array, float]:
    """float32 angles `[..., T, rotated // 2]` with `scaling`'s frequencies, and its attention
    factor (`rope_frequencies`)."""
    inverse, factor = rope_frequencies(rotated, base, scaling)  # (r/2,)
    positions = jnp.asarray(positions).astype(jnp.float32)
    return positions[..., None] * jnp.asarray(inverse).reshape((1,) * positions.ndim + inverse.shape), factor


def apply_rope(
    x: Array, positions: Any, *, base: float, fraction: float = 1.0, scaling: RopeScaling | None = None
) -> Array:
    """Queries or keys `[batch..., T, heads, H]` rotated by their positions.

    `positions`: integers `[T]` (shared by the batch) or `[batch..., T]`.
    The leading r = `rotary_dims(H, fraction)` dims rotate (see the module
    docstring), in float32; the result has `x`'s dtype and shape. Written as
    x * cos + swap_halves(x) * (-sin, sin): one elementwise pass, no pair
    gathering. `scaling` (None: none) changes the frequencies, and "yarn"
    multiplies cos and sin by its attention factor (`rope_frequencies`).
    """
    H = x.shape[-1]
    rotated = rotary_dims(H, fraction)
    factor = 1.0
    if scaling is None:
        angles = rope_angles(positions, rotated, base)  # (..., T, r/2)
    else:
        angles, factor = _scaled_angles(positions, rotated, base, scaling)  # (..., T, r/2), ()
    angles = angles.reshape((1,) * (x.ndim - 1 - angles.ndim) + angles.shape[:-1] + (1, rotated // 2))
    cos, sin = jnp.cos(angles), jnp.sin(angles)  # (..., T, 1, r/2): one angle for every head
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor  # (..., T, 1, r/2): YaRN's attention factor
    cos = jnp.concatenate([cos, cos], axis=-1)  # (..., T, 1, r): both dims of a pair
    sin = jnp.concatenate([-sin, sin], axis=-1)  # (..., T, 1, r)
    part = x[..., :rotated].astype(jnp.float32)  # (..., T, heads, r)
    swapped = jnp.concatenate([part[..., rotated // 2 :], part[..., : rotated // 2]], axis=-1)
    turned = (part * cos + swapped * sin).astype(x.dtype)  # (..., T, heads, r)
    if rotated == H:
        return turned
    return jnp.concatenate([turned, x[..., rotated:]], axis=-1)  # (..., T, heads, H)


def segment_positions(segment_ids: Any) -> Array:
    """int32 positions `[..., T]` that restart at 0 wherever `segment_ids` `[..., T]` changes.

    A packed row `[a a a b b c]` has positions `[0 1 2 0 1 0]`: a segment starts
    at t = 0 and wherever the id differs from the one before it.
    """
    ids = jnp.asarray(segment_ids)
    T = ids.shape[-1]
    steps = jnp.arange(T, dtype=jnp.int32).reshape((1,) * (ids.ndim - 1) + (T,))  # (1..., T)
    first = jnp.ones(ids.shape[:-1] + (1,), jnp.bool_)  # (..., 1)
    starts = jnp.concatenate([first, ids[..., 1:] != ids[..., :-1]], axis=-1)  # (..., T)
    start_of_segment = lax.cummax(jnp.where(starts, steps, 0), axis=ids.ndim - 1)  # (..., T)
    return steps - start_of_segment
