"""Rotary position embeddings (RoPE) and the positions of packed sequences, as pure functions.

  rotary_dims        how many of a head's H dims a rotary fraction rotates
  rope_angles        the rotation angles `[..., T, r/2]` of positions `[..., T]`
  apply_rope         rotates queries or keys `[batch..., T, heads, H]` by their positions
  segment_positions  positions that restart at 0 where a packed sequence's segment id changes

Convention (GPT-NeoX's, the one Hugging Face's `rotary_pct` / `partial_rotary_factor`
models use): the rotated part of a head is its leading r = int(H * fraction) dims,
split in two halves; dim i of the first half and dim i of the second half form a
pair rotated by the angle position * base^(-2i / r), i < r / 2. The frequencies
are those of the r rotated dims (not of H); the remaining H - r dims pass
unchanged. Query and key at positions p and q then have logits that depend on
their positions only through p - q.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

__all__ = ["rotary_dims", "rope_angles", "apply_rope", "segment_positions", "check_rope"]


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


def apply_rope(x: Array, positions: Any, *, base: float, fraction: float = 1.0) -> Array:
    """Queries or keys `[batch..., T, heads, H]` rotated by their positions.

    `positions`: integers `[T]` (shared by the batch) or `[batch..., T]`.
    The leading r = `rotary_dims(H, fraction)` dims rotate (see the module
    docstring), in float32; the result has `x`'s dtype and shape. Written as
    x * cos + swap_halves(x) * (-sin, sin): one elementwise pass, no pair
    gathering.
    """
    H = x.shape[-1]
    rotated = rotary_dims(H, fraction)
    angles = rope_angles(positions, rotated, base)  # (..., T, r/2)
    angles = angles.reshape((1,) * (x.ndim - 1 - angles.ndim) + angles.shape[:-1] + (1, rotated // 2))
    cos, sin = jnp.cos(angles), jnp.sin(angles)  # (..., T, 1, r/2): one angle for every head
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
