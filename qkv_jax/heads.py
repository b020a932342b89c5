"""What every attention module of qkv_jax shares (the teaching modules and `MultiHeadAttention`).

  _check_positive, _check_positive_fields, _check_dropout, _check_heads, _check_lora, _check_inputs
                        the argument checks (ValueError naming the field and its value)
  AttentionRequest, Inspectable  what an interpretability run asks of an attention layer
  attend_heads          the requested heads' scores and pattern, explicitly, with their hook points
  torch_linear_init     torch.nn.Linear's initializer

The lowest layer of the modules: `qkv_jax.modules` and `qkv_jax.teaching` import it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from qkv_jax.attention import PrecisionLike, softmax_with_sinks

Array = jax.Array

__all__ = ["AttentionRequest", "Inspectable", "attend_heads", "torch_linear_init"]

# torch.nn.Linear's default: uniform in +-1/sqrt(fan_in), the start of learned
# projections written in PyTorch.
torch_linear_init = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")
torch_linear_init.__doc__ = """Flax initializer `(key, shape, dtype) -> array`: uniform in +-1/sqrt(fan_in).

torch.nn.Linear's default for its weight; with Dense/DenseGeneral, fan_in is
the product of the kernel's input axes (e.g. E for a `[E, N, H]` projection).
"""


def _check_positive(owner: str, **sizes: Any) -> None:
    for name, value in sizes.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{owner}: {name}={value!r} must be a positive int")


def _check_positive_fields(owner: str, settings: Any, names: str) -> None:
    """`_check_positive` on the fields `names` (space-separated) of `settings`, None allowed."""
    _check_positive(owner, **{name: getattr(settings, name) for name in names.split()})


def _check_dropout(owner: str, rate: float) -> None:
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{owner}: dropout_rate={rate!r} must be in [0, 1)")


def _check_one_head(module: Any, **sizes: int) -> None:
    """A teaching module's checks at construction: positive `sizes`, a dropout rate in [0, 1)."""
    _check_positive(type(module).__name__, **sizes)
    _check_dropout(type(module).__name__, module.dropout_rate)


def _check_heads(owner: str, num_heads: int, num_kv_heads: int | None) -> None:
    if num_kv_heads is not None and num_heads % num_kv_heads:
        raise ValueError(f"{owner}: num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")


def _check_lora(
    owner: str, rank: Any, alpha: Any, targets: Any, allowed: tuple[str, ...], kv_latent_dim: int | None
) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"{owner}: lora_rank={rank!r} must be an int >= 0")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"{owner}: lora_alpha={alpha!r} must be a number > 0")
    if isinstance(targets, str) or any(t not in allowed for t in targets):
        raise ValueError(f"{owner}: lora_targets={targets!r} must be a tuple of {allowed}")
    if rank and "kv_latent" in targets and kv_latent_dim is None:
        raise ValueError(f"{owner}: lora_targets={targets!r} has 'kv_latent' but kv_latent_dim=None")


def _check_inputs(owner: str, name: str, x: Array, min_rank: int = 2) -> None:
    if x.ndim < min_rank:
        raise ValueError(f"{owner}: {name} must have shape [batch..., length, features], got {x.shape}")


class AttentionRequest(NamedTuple):
    """What an interpretability run asks of one attention layer; the default asks nothing.

    pattern_heads: query heads whose scores and pattern are computed, beside
      the attention's own path (chunked, cuDNN, XLA or MLA's absorbed one):
      hook_attn_scores and hook_pattern `[..., len(pattern_heads), T, S]`;
      those heads' outputs are then pattern @ V, so a changed pattern acts.
    head_results: W_O applied per head, each head's write `[..., T, N, D]`
      through hook_result, the output their sum plus b_O.
    """

    pattern_heads: tuple[int, ...] = ()
    head_results: bool = False


class Inspectable(nn.Module):
    """A linen attention module that `qkv_jax.interpretability` can ask for patterns.

    `interpretability_request()` returns the default `AttentionRequest()`;
    an interpretability run intercepts this method (`nn.intercept_methods`)
    to ask a layer for its pattern or its per-head results.
    """

    def interpretability_request(self) -> AttentionRequest:
        """This layer's `AttentionRequest`: nothing, unless a run intercepts the call."""
        return AttentionRequest()


def _check_pattern_request(owner: str, heads: tuple[int, ...], num_heads: int, dropping: bool) -> None:
    """ValueError unless every requested pattern head is in [0, num_heads) and no dropout is on."""
    if any(isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < num_heads for h in heads):
        raise ValueError(f"{owner}: pattern_heads={heads!r} must be query heads in [0, {num_heads})")
    if dropping:
        raise ValueError(
            f"{owner}: attention patterns requested with attention dropout on; run deterministic=True"
        )


def attend_heads(
    hook: Callable[[str, Array], Array],
    heads: tuple[int, ...],
    output: Array | None,
    query: Array,
    key: Array,
    value: Array,
    *,
    allowed: Array | None,
    scale: Any,
    precision: PrecisionLike,
    bias: Array | None = None,
    soft_cap: float | None = None,
    sinks: Array | None = None,
    dtype: Any = None,
) -> tuple[Array, Array]:
    """The attention of `heads` (query heads) again, explicitly, with their scores and pattern hooked.

    `output` `[..., T, N, Hv]` is the attention's result on its own path, or
    None when `heads` are every head in order (the result is then theirs alone,
    in `dtype`, default the query's);
    `query` `[..., T, N, H]`, `key` `[..., S, K, H]`, `value` `[..., S, K, Hv]`
    (query head n reads kv head n // (N / K)); `allowed` boolean,
    broadcastable to `[..., N|1, T, S]`; `bias` `[..., N|1, T|1, S|1]`,
    `scale` (None: 1/sqrt(H)), `soft_cap` and `sinks` `[N]` as the attention
    takes them. For the n = len(heads) heads only (O(n T S) memory): scores
    `[..., n, T, S]` (scaled, biased, capped, -inf where not allowed) through
    `hook("hook_attn_scores", .)`, their softmax through `hook("hook_pattern", .)`,
    and pattern @ V in place of those heads' outputs. Returns (output, pattern).
    """
    N = query.shape[-2]
    every = heads == tuple(range(N))
    picked = slice(None) if every else jnp.array(heads)  # every head: no gathers
    compute_dtype = jnp.promote_types(jnp.result_type(query, key), jnp.float32)
    kv = jnp.array(heads) // (N // key.shape[-2])  # (n,): each head's kv head
    scores = jnp.einsum(
        "...tnh,...snh->...nts",
        query[..., picked, :],
        key[..., kv, :],
        preferred_element_type=compute_dtype,
        precision=precision,
    )  # (..., n, T, S)
    scores = scores * jnp.asarray(query.shape[-1] ** -0.5 if scale is None else scale, compute_dtype)

    def per_head(x: Array) -> Array:  # (..., N|1, T|1, S|1) -> (..., n|1, T|1, S|1), rank of the scores
        x = x.reshape((1,) * (scores.ndim - x.ndim) + x.shape)
        return x[..., picked, :, :] if x.shape[-3] == N else x

    if bias is not None:
        scores = scores + per_head(bias).astype(compute_dtype)
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    if allowed is not None:
        scores = jnp.where(per_head(allowed), scores, -jnp.inf)
    scores = hook("hook_attn_scores", scores)  # (..., n, T, S)
    weights, _ = softmax_with_sinks(scores, None if sinks is None else sinks[picked])  # (..., n, T, S)
    pattern = hook("hook_pattern", weights)
    blended = jnp.einsum(
        "...nts,...snv->...tnv", pattern, value[..., kv, :].astype(pattern.dtype), precision=precision
    )  # (..., T, n, Hv)
    if every:
        target = output.dtype if output is not None else (query.dtype if dtype is None else dtype)
        return blended.astype(target), pattern
    if output is None:
        raise ValueError(f"attend_heads: output=None needs every head in order, got heads={heads}")
    return output.at[..., picked, :].set(blended.astype(output.dtype)), pattern
