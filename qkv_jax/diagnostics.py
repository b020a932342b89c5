"""What each attention head learned, from its attention weights.

`head_diagnostics` reduces attention weights `[batch..., N, T, S]` to one
number per head for each of:
  entropy          mean entropy of the attention rows, in nats (0 = one key,
                   log(S) = uniform over S keys);
  distance         mean |query position - key position| under the weights;
  previous_token   mean weight on the key just before the query's position;
  first_token      mean weight on key position 0;
  max_weight       mean of each row's largest weight;
  sink_mass        (with `sinks=True`) the mean weight the head's sink takes:
                   1 minus the row's weights on keys (`sink_mass`).
Queries are taken as the last T of the S positions, as in
`causal_mask(T, S, query_offset=S - T)` (a decode cache's alignment). A
sliding window of w keys bounds a head's `distance` by w - 1.

`collect_attention_weights` gathers every sown `attention_weights` of a Flax
variables tree (one entry per layer); `induction_scores` measures, for an LM,
how much each head attends from a token in the second copy of a repeated
random sequence to the token that followed its first occurrence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "head_diagnostics",
    "sink_mass",
    "collect_attention_weights",
    "induction_scores",
    "repeated_sequence",
]


def sink_mass(weights: Any) -> jax.Array:
    """`[N]`: the mean share of each query row that a head's sink takes, from the weights on the
    keys `[batch..., N, T, S]` (with sinks a row sums to 1 minus its sink's share)."""
    weights = jnp.asarray(weights, jnp.float32)
    rows = weights.reshape(-1, *weights.shape[-3:])  # (B, N, T, S)
    return (1.0 - rows.sum(axis=-1)).mean(axis=(0, 2))


def head_diagnostics(weights: jax.Array, sinks: bool = False) -> dict[str, jax.Array]:
    """Per-head statistics of attention weights `[batch..., N, T, S]`; each value is `[N]`.

    `sinks`: the attention had sinks (`sink_mass` is added; without sinks every
    row that sees a key sums to 1)."""
    weights = jnp.asarray(weights, jnp.float32)
    if weights.ndim < 3:
        raise ValueError(f"head_diagnostics: weights must be [batch..., N, T, S], got shape {weights.shape}")
    T, S = weights.shape[-2], weights.shape[-1]
    query_pos = jnp.arange(T)[:, None] + (S - T)  # (T, 1)
    key_pos = jnp.arange(S)[None, :]  # (1, S)
    rows = weights.reshape(-1, weights.shape[-3], T, S)  # (B, N, T, S)

    def mean_over_rows(x):  # (B, N, T) -> (N,)
        return x.mean(axis=(0, 2))

    entropy = -jnp.sum(jnp.where(rows > 0, rows * jnp.log(jnp.where(rows > 0, rows, 1.0)), 0.0), axis=-1)
    distance = jnp.sum(rows * jnp.abs(query_pos - key_pos)[None, None], axis=-1)  # (B, N, T)
    previous = jnp.sum(rows * (key_pos == query_pos - 1)[None, None], axis=-1)  # (B, N, T)
    statistics = {
        "entropy": mean_over_rows(entropy),
        "distance": mean_over_rows(distance),
        "previous_token": mean_over_rows(previous),
        "first_token": mean_over_rows(rows[..., 0]),
        "max_weight": mean_over_rows(rows.max(axis=-1)),
    }
    if sinks:
        statistics["sink_mass"] = sink_mass(rows)
    return statistics


def collect_attention_weights(intermediates: Any) -> dict[str, jax.Array]:
    """{'block_0/attention': weights [batch..., N, T, S], ...} from sown intermediates."""
    found = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(intermediates):
        names = [str(getattr(entry, "key", getattr(entry, "idx", ""))) for entry in path]
        if "attention_weights" in names:
            scope = "/".join(n for n in names[: names.index("attention_weights")] if n != "intermediates")
            found[scope or "attention"] = leaf
    return found


def repeated_sequence(key: jax.Array, batch: int, length: int, vocab_size: int) -> jax.Array:
    """`[batch, 2 * length]` tokens: a random sequence, then the same sequence again."""
    first = jax.random.randint(key, (batch, length), 0, vocab_size)
    return jnp.concatenate([first, first], axis=-1)


def induction_scores(weights: jax.Array, length: int) -> jax.Array:
    """Per-head induction score `[N]` on a repeated sequence of 2 * `length` tokens.

    For a query at position i in the second copy (i >= length), the induction
    target is key position i - length + 1: the token that followed the
    previous occurrence of the query's token. The score is the mean weight on
    that key (1 = a perfect induction head).
    """
    weights = jnp.asarray(weights, jnp.float32)
    rows = weights.reshape(-1, weights.shape[-3], weights.shape[-2], weights.shape[-1])  # (B, N, T, S)
    T = rows.shape[-2]
    if T != 2 * length:
        raise ValueError(f"induction_scores: expected {2 * length} positions, got {T}")
    queries = jnp.arange(length, 2 * length - 1)  # the last position has no next token to copy
    targets = queries - length + 1
    return rows[:, :, queries, targets].mean(axis=(0, 2))


def diagnose(apply: Callable[..., Any], variables: Any, inputs: jax.Array, **kwargs: Any) -> dict[str, dict]:
    """Runs `apply(variables, inputs, mutable=['intermediates'])` and diagnoses every layer.

    The modules must sow their attention weights (`sow_weights=True`).
    Returns {layer: {statistic: [N]}}.
    """
    _, state = apply(variables, inputs, mutable=["intermediates"], **kwargs)
    return {layer: head_diagnostics(w) for layer, w in collect_attention_weights(state).items()}
