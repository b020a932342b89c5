"""Which keys each query may see: the one representation every attention path reads.

Query t sits at key position `t + query_offset`. It may see key s when every
rule that is set allows the pair:

  is_causal        s <= t + query_offset
  window (l, r)    t + query_offset - l <= s <= t + query_offset + r
  query_lengths    t < query length (a padded query sees nothing)
  key_lengths      s < key length
  segment_ids      the query's id equals the key's
  mask             an explicit boolean mask (True = may see)

`KeyVisibility` holds these; `masks_at` turns them into boolean masks for
any positions (the reference path's whole `[T, S]`, one tile of the chunked
kernel), `key_bounds` / `query_bounds` say which keys (queries) a block of
queries (keys) can reach at all, which is how the chunked kernel skips tiles.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

__all__ = [
    "KeyVisibility",
    "visible_keys",
    "masks_at",
    "and_masks",
    "window_pair",
    "causal_mask",
    "padding_mask",
    "combine_masks",
]

_alignment_warned = False


def warn_alignment(T: int, S: int, owner: str, stacklevel: int) -> None:
    """The one FutureWarning per process about causal masks with T != S changing alignment;
    `stacklevel` counts from this function to the user's call."""
    global _alignment_warned
    if _alignment_warned:
        return
    _alignment_warned = True
    warnings.warn(
        f"{owner}: a causal mask with T={T} queries and S={S} keys is now aligned top-left, as "
        f"jax.nn's (query t sees keys 0..t); it used to be aligned bottom-right (the queries as "
        f"the last T of the S positions). Pass query_offset=S - T (here {S - T}) for the old "
        f"alignment, or query_offset=0 to keep the new one without this warning.",
        FutureWarning,
        stacklevel=stacklevel,
    )


def is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def lift(x: Array, rank: int) -> Array:
    """`x` with leading size-1 axes up to `rank` (explicit broadcasting, no rank promotion)."""
    return x.reshape((1,) * (rank - x.ndim) + x.shape)


def and_masks(*masks: Any) -> Array | None:
    """Logical AND of boolean masks of any ranks, aligned at their trailing axes (None entries
    are skipped; None when all are)."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    rank = max(jnp.ndim(m) for m in present)
    combined = lift(jnp.asarray(present[0]), rank)
    for m in present[1:]:
        combined = combined & lift(jnp.asarray(m), rank)
    return combined


def window_pair(local_window_size: Any, owner: str) -> tuple[int, int] | None:
    """`local_window_size` as jax.nn reads it: None, an int w (= (w, w)) or (left, right).

    Query t (at key position t + offset) may attend key s when
    `t + offset - left <= s <= t + offset + right`. Raises naming `owner` otherwise.
    """
    if local_window_size is None:
        return None
    pair = (local_window_size,) * 2 if np.ndim(local_window_size) == 0 else tuple(local_window_size)
    if len(pair) != 2 or not all(is_int(n) for n in pair):
        raise TypeError(
            f"{owner}: local_window_size must be None, an int or a pair of ints (left, right), "
            f"got {local_window_size!r}"
        )
    return int(pair[0]), int(pair[1])


@dataclasses.dataclass(frozen=True)
class KeyVisibility:
    """Which keys each query may see (module docstring). A pytree: `is_causal` and `window`
    are static, the rest are arrays (or None: the rule is off).

    is_causal: key s visible to query t when s <= t + query_offset.
    query_offset: the key position of query 0 (None: 0): an int, or ints per example.
    window: (left, right), jax.nn's local_window_size: t + offset - left <= s <= t + offset + right.
    segment_ids: (query ids `[batch..., T]`, key ids `[batch..., S]`): equal ids only.
    mask: boolean, broadcastable to `[batch..., N|1, T, S]`, or None.
    query_lengths, key_lengths: ints `[batch...]`: queries t >= length see nothing, keys
      s >= length are seen by none.

    The shapes are those of `dot_product_attention`'s arguments; `masks_at` reads the arrays
    laid out to broadcast against the positions it is given instead (`laid_out` makes that
    layout for the whole `[batch..., N, T, S]`).
    """

    is_causal: bool = False
    query_offset: Any = None
    window: tuple[int, int] | None = None
    segment_ids: tuple[Any, Any] | None = None
    mask: Any = None
    query_lengths: Any = None
    key_lengths: Any = None

    def keywords(self, lengths: bool = False) -> dict[str, Any]:
        """`dot_product_attention`'s keywords of the causal, offset, window and segment rules:
        is_causal, query_offset, local_window_size, query_segment_ids and key_segment_ids; with
        `lengths` also query_seq_lengths and key_value_seq_lengths (the mask is left out)."""
        query_ids, key_ids = self.segment_ids or (None, None)
        rules = dict(
            is_causal=self.is_causal,
            query_offset=self.query_offset,
            local_window_size=self.window,
            query_segment_ids=query_ids,
            key_segment_ids=key_ids,
        )
        if not lengths:
            return rules
        return dict(rules, query_seq_lengths=self.query_lengths, key_value_seq_lengths=self.key_lengths)

    def replace(self, **changes: Any) -> KeyVisibility:
        return dataclasses.replace(self, **changes)

    def key_span(self) -> int | None:
        """The most keys one query may see by the causal triangle and the window (None: any)."""
        if self.window is None:
            return None
        left, right = self.window
        return left + (min(right, 0) if self.is_causal else right) + 1

    def key_bounds(self, first_at: Any, last_at: Any) -> tuple[Any, Any]:
        """`(first, last)` key a query at a key position in `[first_at, last_at]` may see by
        the causal triangle and the window; None where nothing bounds it."""
        first, last = None, None
        if self.is_causal:
            last = last_at
        if self.window is not None:
            left, right = self.window
            first = first_at - left
            last = last_at + right if last is None else jnp.minimum(last, last_at + right)
        return first, last

    def query_bounds(self, first_key: Any, last_key: Any) -> tuple[Any, Any]:
        """`(first, last)` key position of a query that may see a key in `[first_key, last_key]`
        by the causal triangle and the window; None where nothing bounds it."""
        first, last = None, None
        if self.is_causal:
            first = first_key
        if self.window is not None:
            left, right = self.window
            first = first_key - right if first is None else jnp.maximum(first, first_key - right)
            last = last_key + left
        return first, last


jax.tree_util.register_dataclass(
    KeyVisibility,
    data_fields=["query_offset", "segment_ids", "mask", "query_lengths", "key_lengths"],
    meta_fields=["is_causal", "window"],
)


def masks_at(keys: KeyVisibility, query_index: Array, key_index: Array) -> list[Array]:
    """The boolean masks of `keys` at the pairs (`query_index`, `key_index`), broadcast together
    (e.g. `[..., T, 1]` and `[..., 1, S]`); `keys`' arrays must be laid out to broadcast with
    them: the offset and lengths as `[batch..., 1, 1, 1]` (or scalars), the segment ids as
    `[batch..., 1, T, 1]` and `[batch..., 1, 1, S]` (`laid_out`)."""
    masks = [] if keys.mask is None else [keys.mask]
    if keys.is_causal or keys.window is not None:
        at = query_index + (0 if keys.query_offset is None else keys.query_offset)  # key positions
        if keys.is_causal:
            masks.append(key_index <= at)
        if keys.window is not None:
            left, right = keys.window
            masks.append((key_index >= at - left) & (key_index <= at + right))
    if keys.query_lengths is not None:
        masks.append(query_index < keys.query_lengths)
    if keys.key_lengths is not None:
        masks.append(key_index < keys.key_lengths)
    if keys.segment_ids is not None:
        query_ids, key_ids = keys.segment_ids
        masks.append(query_ids == key_ids)
    return masks


def _per_example(x: Any, rank: int) -> Any:
    """Values broadcastable to `[batch...]` as `[batch...|1, 1, 1, 1]` of `rank` = len(batch) + 3
    (a Python int or a scalar is returned as it is)."""
    if x is None or is_int(x) or jnp.ndim(x) == 0:
        return x
    x = lift(jnp.asarray(x), rank - 3)
    return x.reshape(*x.shape, 1, 1, 1)


def laid_out(keys: KeyVisibility, rank: int) -> KeyVisibility:
    """`keys` with the arrays of `dot_product_attention`'s shapes laid out for `masks_at` on
    positions `[1..., T, 1]` and `[1..., 1, S]` of `rank` = len(batch) + 3."""
    segments = None
    if keys.segment_ids is not None:
        query_ids, key_ids = (lift(jnp.asarray(ids), rank - 2) for ids in keys.segment_ids)
        segments = (query_ids[..., None, :, None], key_ids[..., None, None, :])  # (batch..., 1, T|S ...)
    return keys.replace(
        query_offset=_per_example(keys.query_offset, rank),
        query_lengths=_per_example(keys.query_lengths, rank),
        key_lengths=_per_example(keys.key_lengths, rank),
        segment_ids=segments,
    )


def _rank_of(keys: KeyVisibility) -> int:
    """The rank of the masks `keys` stands for: 2 (`[T, S]`), or len(batch) + 3."""
    ranks = [2]
    if keys.segment_ids is not None:
        ranks.append(jnp.ndim(keys.segment_ids[0]) + 2)
    for x in (keys.query_offset, keys.query_lengths, keys.key_lengths):
        if x is not None and jnp.ndim(x) > 0:
            ranks.append(jnp.ndim(x) + 3)
    if keys.mask is not None:
        ranks.append(jnp.ndim(keys.mask))
    return max(ranks)


def visible_keys(keys: KeyVisibility, T: int, S: int, rank: int | None = None) -> Array | None:
    """`keys` as one boolean mask broadcastable to `[batch..., N|1, T, S]` (None: every key).

    `rank` is that of the mask (len(batch) + 3); None: the least that holds `keys`' arrays
    (2, `[T, S]`, when they have no batch dims)."""
    rules = (keys.window, keys.segment_ids, keys.query_lengths, keys.key_lengths)
    if not keys.is_causal and all(rule is None for rule in rules):
        return and_masks(keys.mask)  # no positions to compare
    rank = _rank_of(keys) if rank is None else rank
    query_index = lift(jnp.arange(T)[:, None], rank)  # (1..., T, 1)
    key_index = lift(jnp.arange(S)[None, :], rank)  # (1..., 1, S)
    layout = laid_out(keys, rank) if rank >= 3 else keys
    return and_masks(*masks_at(layout, query_index, key_index))


def causal_mask(T: int, S: int | None = None, *, query_offset: int | None = None) -> Array:
    """Boolean `[T, S]` mask, True where query t may attend key s: `s <= t + query_offset`.

    `query_offset` is the key position of query 0: 0 is jax.nn's top-left
    triangle (with S = T the usual lower triangle); `S - T` makes the T queries
    the last T of the S positions (decoding with a cache of S keys). Left out
    with T != S, it is 0 and a FutureWarning (once per process) says that this
    used to mean `S - T`.
    """
    S = T if S is None else S
    for name, n in (("T", T), ("S", S)):
        if not is_int(n) or n <= 0:
            raise ValueError(f"causal_mask: {name} must be a positive int, got {n!r}")
    if query_offset is None:
        if T != S:
            warn_alignment(T, S, "causal_mask", stacklevel=3)
        query_offset = 0
    if not is_int(query_offset):
        raise ValueError(f"causal_mask: query_offset must be an int, got {query_offset!r}")
    mask = visible_keys(KeyVisibility(True, query_offset), T, S)
    assert mask is not None  # a causal rule always gives a mask
    return mask  # (T, S)


def check_length_values(owner: str, name: str, lengths: Any, limit_name: str, limit: int) -> None:
    """Raises unless concrete `lengths` lie in [0, limit] (traced ones cannot be checked)."""
    if lengths is None or isinstance(lengths, jax.core.Tracer):
        return
    values = np.asarray(lengths)
    if values.size and ((values < 0) | (values > limit)).any():
        raise ValueError(
            f"{owner}: {name} must lie in [0, {limit_name}={limit}], "
            f"got min {values.min()} and max {values.max()}"
        )


def padding_mask(lengths: Any, max_len: int) -> Array:
    """Key-padding mask `[batch..., 1, 1, max_len]` from per-sequence lengths.

    Position s of a sequence with length L may be attended to iff s < L. The two
    singleton axes broadcast over heads and query positions, so the result can
    be passed straight to `dot_product_attention` or `MultiHeadAttention`.

    With `dot_product_attention` itself, pass the lengths instead:
    `dot_product_attention(q, k, v, key_value_seq_lengths=lengths)` (and
    `query_seq_lengths=` for padded queries) gives the same result, skips the
    padding on the "chunked" path, and on a GPU in bf16/fp16 reaches cuDNN's
    padded kernel, where a mask becomes a `[batch, 1, T, S]` bias.
    """
    if not is_int(max_len) or max_len <= 0:
        raise ValueError(f"padding_mask: max_len must be a positive int, got {max_len!r}")
    lengths = jnp.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"padding_mask: lengths must be integers, got dtype {lengths.dtype}")
    check_length_values("padding_mask", "lengths", lengths, "max_len", max_len)
    positions = lift(jnp.arange(max_len), lengths.ndim + 1)  # (1..., S)
    mask = positions < lengths[..., None]  # (batch..., S)
    return mask[..., None, None, :]  # (batch..., 1, 1, S)


def combine_masks(*masks: Any) -> Array | None:
    """Logical AND of boolean masks with broadcasting; `None` entries are skipped.

    Masks of shapes broadcastable together (e.g. `[T, S]`, `[batch..., 1, 1, S]`
    and `[batch..., N, T, S]`) give one mask of their broadcast shape. Returns
    None when every mask is None.
    """
    present = [jnp.asarray(m) for m in masks if m is not None]
    for i, m in enumerate(present):
        if m.dtype != jnp.bool_:
            raise TypeError(
                f"combine_masks: masks must be boolean (True = may attend), mask {i} has dtype {m.dtype}"
            )
    if not present:
        return None
    try:
        shape = jnp.broadcast_shapes(*(m.shape for m in present))
    except ValueError:
        shapes = ", ".join(str(m.shape) for m in present)
        raise ValueError(f"combine_masks: mask shapes {shapes} do not broadcast") from None
    combined = and_masks(*present)
    assert combined is not None  # `present` is not empty
    return jnp.broadcast_to(combined, shape)
