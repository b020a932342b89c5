"""Flax linen attention modules, from parameter-free to multi-head, and the pure functions
that multi-head attention is made of (shared with the flax.nnx modules in `qkv_jax.nnx`).

Every module works on an unbatched `[S, D]` input and on any leading batch
dims `[batch..., S, D]`; `jax.vmap` of `apply` over a batch equals the batched
`apply`. All of them compute attention with `qkv_jax.dot_product_attention`.

  StaticAttention        Q = K = V = X, nothing to learn (identity W).
  SelfAttentionV1        raw `W_query`, `W_key`, `W_value` matrices [d_in, d_out].
  SelfAttention          the same through `nn.Dense` layers.
  LearnedQueryAttention  one learned query vector reads a sequence.
  MultiHeadAttention     a drop-in for `flax.linen.MultiHeadDotProductAttention`
                         (same call, fields, parameter and cache layout) with
                         grouped K/V heads, latent K/V (MLA), LoRA adapters and
                         multi-token decoding on top.
  MultiHeadDotProductAttention  the same class under flax's other name, so that
                         unnamed instances get flax's default names (and so
                         flax's parameter paths and random streams).

The multi-head pipeline, as pure functions both the linen and the nnx module call:
  project_inputs        inputs -> query `[..., T, N, H]` and what a cache holds
                        (K and V, or MLA's latent)
  append_to_cache       writes T positions into a cache at its index
  attend_entries        K/V (or absorbed latents) -> attention -> head mask -> W_O
  flax_dot_product_attention  the default `attention_fn`: flax's signature,
                        `qkv_jax.dot_product_attention` underneath, flax's dropout

Each takes `precision` (flax's spelling: None for JAX's default, 'highest',
a `jax.lax.Precision`, a pair, ...), passed to every projection and to every
dot of the attention itself, forward and backward.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import checkify

from qkv_jax.attention import IMPLEMENTATIONS, PrecisionLike, dot_product_attention
from qkv_jax.chunked import window_pair
from qkv_jax.lora import LoRADenseGeneral, effective_kernel
from qkv_jax.positions import apply_rope, check_rope, rotary_dims, segment_positions

Array = jax.Array
Dtype = Any
Initializer = Any

__all__ = [
    "StaticAttention",
    "SelfAttentionV1",
    "SelfAttention",
    "LearnedQueryAttention",
    "MultiHeadAttention",
    "MultiHeadDotProductAttention",
    "ATTENTION_LORA_TARGETS",
    "AttentionLayers",
    "flax_dot_product_attention",
    "project_inputs",
    "append_to_cache",
    "advance_cache_index",
    "attend_entries",
    "check_attention_settings",
    "resolve_inputs",
    "resolve_head_dim",
    "torch_linear_init",
    "HookPoint",
    "LayerNorm",
    "layer_norm",
    "AttentionRequest",
    "hook_projections",
]

# MultiHeadAttention's projections a LoRA adapter can sit beside (kv_latent: MLA's down-projection).
ATTENTION_LORA_TARGETS = ("query", "key", "value", "out", "kv_latent")

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


def _check_dropout(owner: str, rate: float) -> None:
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{owner}: dropout_rate={rate!r} must be in [0, 1)")


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


def _dropout(module: nn.Module, rate: float, deterministic: bool) -> dict:
    """`dropout_rate` and `dropout_rng` arguments: no dropout when deterministic."""
    if deterministic or rate == 0.0:
        return {"dropout_rate": 0.0, "dropout_rng": None}
    return {"dropout_rate": rate, "dropout_rng": module.make_rng("dropout")}


# ------------------------------------------------------------------------------ hook points


class HookPoint(nn.Module):
    """A named activation, `__call__(x) -> x`: no parameters, no computation.

    A model passes what is worth reading or changing (queries, attention
    patterns, the residual stream, ...) through a HookPoint named `hook_...`;
    left alone it is the identity, which XLA removes. `qkv_jax.interpretability`
    reads hook points with flax's `capture_intermediates` and changes their
    values with `nn.intercept_methods` (`run_with_cache`, `run_with_hooks`).
    """

    def __call__(self, x: Array) -> Array:
        return x


def _hook(module: nn.Module, name: str, x: Array) -> Array:
    """`x` through the HookPoint `name` of `module` (called inside its compact method)."""
    return HookPoint(name=name, parent=module)(x)


def layer_norm(
    x: Array,
    scale: Array,
    bias: Array,
    epsilon: float,
    dtype: Dtype | None,
    hook: Callable[[str, Array], Array],
) -> Array:
    """flax's LayerNorm over the last axis of `x` `[..., D]`, with `scale`, `bias` `[D]`.

    The statistics as flax computes them (in at least float32, the variance as
    E[x^2] - E[x]^2 clipped at 0); then, as TransformerLens names them, the
    standard deviation sqrt(var + epsilon) `[..., 1]` passes through
    `hook("hook_scale", .)` and the normalised input `[..., D]` through
    `hook("hook_normalized", .)` before the affine map, so a patched scale
    freezes the norm. Returns `[..., D]` in `dtype` (None: promoted from the
    input and the parameters).
    """
    stats = x.astype(jnp.promote_types(dtype or x.dtype, jnp.float32))
    mean = jnp.mean(stats, axis=-1, keepdims=True)  # (..., 1)
    variance = jnp.maximum(0.0, jnp.mean(jnp.square(stats), axis=-1, keepdims=True) - jnp.square(mean))
    std = hook("hook_scale", jnp.sqrt(variance + epsilon))  # (..., 1)
    normalized = hook("hook_normalized", (x - mean) / std)  # (..., D)
    lead = (1,) * (x.ndim - 1)
    y = normalized * scale.reshape(*lead, -1) + bias.reshape(*lead, -1)  # (..., D)
    return jnp.asarray(y, nn.dtypes.canonicalize_dtype(x, scale, bias, dtype=dtype))


class LayerNorm(nn.Module):
    """`flax.linen.LayerNorm` (last axis, with scale and bias) with TransformerLens's two hook points.

    The same parameters, `scale` (ones) and `bias` (zeros) `[D]`, so
    checkpoints of `nn.LayerNorm` load unchanged, and the same statistics;
    `hook_scale` `[..., 1]` and `hook_normalized` `[..., D]` in between
    (`layer_norm`).
    """

    epsilon: float = 1e-6
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        features = (x.shape[-1],)
        scale = self.param("scale", nn.initializers.ones, features, self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, features, self.param_dtype)
        return layer_norm(x, scale, bias, self.epsilon, self.dtype, functools.partial(_hook, self))


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


def _single_head(
    module: Inspectable,
    query: Array,
    key: Array,
    value: Array,
    mask: Array | None,
    deterministic: bool,
) -> tuple[Array, Array]:
    """One attention head on `[..., T, H]`, `[..., S, H]`, `[..., S, Hv]`.

    `mask` broadcasts to `[..., T, S]`. Returns `[..., T, Hv]` and the attention
    weights `[..., T, S]`. Reads `is_causal`, `scale`, `dropout_rate`,
    `precision` and `sow_weights` from `module`; sown weights keep a head axis,
    `[..., 1, T, S]`. Hook points with a head axis of 1: hook_q, hook_k, hook_v
    `[..., T|S, 1, H]`, hook_z `[..., T, 1, Hv]` and, on request,
    hook_attn_scores and hook_pattern `[..., 1, T, S]` (`attend_heads`).
    """
    hook = functools.partial(_hook, module)
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.ndim >= 2:
            mask = jnp.expand_dims(mask, -3)  # (..., 1, T, S): one head
    query = hook("hook_q", query[..., None, :])  # (..., T, 1, H)
    key = hook("hook_k", key[..., None, :])  # (..., S, 1, H)
    value = hook("hook_v", value[..., None, :])  # (..., S, 1, Hv)
    options = dict(scale=module.scale, precision=module.precision)
    dropout = _dropout(module, module.dropout_rate, deterministic)
    output, weights = dot_product_attention(
        query, key, value, mask=mask, is_causal=module.is_causal, **options, **dropout, return_weights=True
    )
    if module.sow_weights:  # with the head axis, as MultiHeadAttention sows them
        module.sow("intermediates", "attention_weights", weights)  # (..., 1, T, S)
    heads = module.interpretability_request().pattern_heads
    if heads:
        _check_pattern_request(type(module).__name__, heads, 1, dropout["dropout_rate"] > 0.0)
        allowed = visible_keys(KeyVisibility(module.is_causal, mask=mask), query.shape[-3], key.shape[-3])
        output, weights = attend_heads(hook, heads, output, query, key, value, allowed=allowed, **options)
    output = hook("hook_z", output)  # (..., T, 1, Hv)
    return output[..., 0, :], weights[..., 0, :, :]  # (..., T, Hv), (..., T, S)


class StaticAttention(Inspectable):
    """Parameter-free attention: Q = K = V = X, i.e. every W is the identity.

    `__call__(inputs_q, inputs_kv=None, mask=None, deterministic=True,
    return_weights=False)`: inputs `[batch..., T, D]` and `[batch..., S, D]`
    (self-attention when `inputs_kv` is None), output `[batch..., T, D]`, and
    the attention weights `[batch..., T, S]` when `return_weights`. `mask`
    broadcasts to `[batch..., T, S]`. `scale` defaults to `1/sqrt(D)`; set it
    to 1.0 for the unscaled `softmax(X X^T) X`. `precision`: of the two dots.
    """

    is_causal: bool = False
    scale: float | None = None
    dropout_rate: float = 0.0
    sow_weights: bool = False
    precision: PrecisionLike = None

    def __post_init__(self):
        _check_dropout("StaticAttention", self.dropout_rate)
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs_q, inputs_kv=None, mask=None, deterministic=True, return_weights=False):
        inputs_kv = inputs_q if inputs_kv is None else inputs_kv
        _check_inputs("StaticAttention", "inputs_q", inputs_q)
        _check_inputs("StaticAttention", "inputs_kv", inputs_kv)
        output, weights = _single_head(self, inputs_q, inputs_kv, inputs_kv, mask, deterministic)
        return (output, weights) if return_weights else output


class SelfAttentionV1(Inspectable):
    """Self-attention with raw learned matrices, the first form of learned attention.

    Parameters `W_query`, `W_key`, `W_value` of shape `[d_in, d_out]`, drawn
    uniform in [0, 1) as `torch.rand` does. `__call__(inputs, mask=None,
    deterministic=True, return_weights=False)`: `[batch..., S, d_in]` to
    `[batch..., S, d_out]` (and weights `[batch..., S, S]`). `precision`: of
    the projections and the attention's dots.
    """

    d_out: int
    is_causal: bool = False
    scale: float | None = None
    dropout_rate: float = 0.0
    sow_weights: bool = False
    precision: PrecisionLike = None
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    kernel_init: Initializer = nn.initializers.uniform(scale=1.0)

    def __post_init__(self):
        _check_positive("SelfAttentionV1", d_out=self.d_out)
        _check_dropout("SelfAttentionV1", self.dropout_rate)
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs, mask=None, deterministic=True, return_weights=False):
        _check_inputs("SelfAttentionV1", "inputs", inputs)
        shape = (inputs.shape[-1], self.d_out)  # (d_in, d_out)
        W_query = self.param("W_query", self.kernel_init, shape, self.param_dtype)
        W_key = self.param("W_key", self.kernel_init, shape, self.param_dtype)
        W_value = self.param("W_value", self.kernel_init, shape, self.param_dtype)
        inputs, W_query, W_key, W_value = nn.dtypes.promote_dtype(
            inputs, W_query, W_key, W_value, dtype=self.dtype
        )
        query = jnp.matmul(inputs, W_query, precision=self.precision)  # (..., S, d_out)
        key = jnp.matmul(inputs, W_key, precision=self.precision)  # (..., S, d_out)
        value = jnp.matmul(inputs, W_value, precision=self.precision)  # (..., S, d_out)
        output, weights = _single_head(self, query, key, value, mask, deterministic)
        return (output, weights) if return_weights else output


class SelfAttention(Inspectable):
    """Self-attention through `nn.Dense` projections.

    Sub-modules `W_query`, `W_key`, `W_value` are `nn.Dense(d_out)` (kernel
    `[d_in, d_out]`, the transpose of `torch.nn.Linear.weight`), initialised
    like `torch.nn.Linear`. `__call__` and `precision` as for `SelfAttentionV1`.
    """

    d_out: int
    qkv_bias: bool = False
    is_causal: bool = False
    scale: float | None = None
    dropout_rate: float = 0.0
    sow_weights: bool = False
    precision: PrecisionLike = None
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    kernel_init: Initializer = torch_linear_init

    def __post_init__(self):
        _check_positive("SelfAttention", d_out=self.d_out)
        _check_dropout("SelfAttention", self.dropout_rate)
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs, mask=None, deterministic=True, return_weights=False):
        _check_inputs("SelfAttention", "inputs", inputs)

        def dense(name):
            return nn.Dense(
                self.d_out,
                use_bias=self.qkv_bias,
                kernel_init=self.kernel_init,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                precision=self.precision,
                name=name,
            )

        query = dense("W_query")(inputs)  # (..., S, d_out)
        key = dense("W_key")(inputs)  # (..., S, d_out)
        value = dense("W_value")(inputs)  # (..., S, d_out)
        output, weights = _single_head(self, query, key, value, mask, deterministic)
        return (output, weights) if return_weights else output


class LearnedQueryAttention(Inspectable):
    """One learned query vector attends over a sequence.

    Parameters: `query` `[D]` (standard normal) and bias-free `nn.Dense`
    layers `W_query` (D -> d_k), `W_key` (D -> d_k) and `W_value` (D -> d_v).
    `__call__(inputs, mask=None, deterministic=True)` maps `[batch..., S, D]`
    to `(output [batch..., d_v], weights [batch..., S])`; `mask` is a key mask
    broadcastable to `[batch..., S]`. `precision`: of the projections and the
    attention's dots.
    """

    d_k: int
    d_v: int
    is_causal: bool = False  # kept for the shared head code; one query has no "future"
    scale: float | None = None
    dropout_rate: float = 0.0
    sow_weights: bool = False
    precision: PrecisionLike = None
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    kernel_init: Initializer = torch_linear_init
    query_init: Initializer = nn.initializers.normal(stddev=1.0)

    def __post_init__(self):
        _check_positive("LearnedQueryAttention", d_k=self.d_k, d_v=self.d_v)
        _check_dropout("LearnedQueryAttention", self.dropout_rate)
        if self.is_causal:
            raise ValueError("LearnedQueryAttention: is_causal=True has no meaning for one query")
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs, mask=None, deterministic=True):
        _check_inputs("LearnedQueryAttention", "inputs", inputs)

        def dense(features, name):
            return nn.Dense(
                features,
                use_bias=False,
                kernel_init=self.kernel_init,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                precision=self.precision,
                name=name,
            )

        query_vector = self.param("query", self.query_init, (inputs.shape[-1],), self.param_dtype)
        query = dense(self.d_k, "W_query")(query_vector)  # (d_k,)
        key = dense(self.d_k, "W_key")(inputs)  # (..., S, d_k)
        value = dense(self.d_v, "W_value")(inputs)  # (..., S, d_v)
        query = jnp.broadcast_to(query, (*key.shape[:-2], 1, self.d_k))  # (..., 1, d_k)
        if mask is not None:
            mask = jnp.asarray(mask)[..., None, :]  # (..., 1, S)
        output, weights = _single_head(self, query, key, value, mask, deterministic)
        return output[..., 0, :], weights[..., 0, :]  # (..., d_v), (..., S)


# ------------------------------------------------------------------ masks shared by the pieces below


def _as_bool_mask(mask: Any) -> Array | None:
    """A mask as booleans: flax's helpers (`make_causal_mask`, ...) give float 0/1 masks."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    return mask if mask.dtype == jnp.bool_ else mask != 0


def _and_masks(*masks: Array | None) -> Array | None:
    """Logical AND of boolean masks of any ranks, aligned at their trailing axes explicitly."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    rank = max(m.ndim for m in present)
    combined = present[0].reshape((1,) * (rank - present[0].ndim) + present[0].shape)
    for m in present[1:]:
        combined = jnp.logical_and(combined, m.reshape((1,) * (rank - m.ndim) + m.shape))
    return combined


class KeyVisibility(NamedTuple):
    """Which keys each query may attend to, besides the call's `mask`: the position arguments of
    `qkv_jax.dot_product_attention`, and an explicit mask where positions are not in order.

    is_causal: key s visible to query t when s <= t + query_offset.
    query_offset: the key index of query 0 (None: 0, top-left; a decode cache's index).
    window: (left, right), jax.nn's local_window_size: t + offset - left <= s <= t + offset + right.
    segment_ids: (query ids `[batch..., T]`, key ids `[batch..., S]`): equal ids only.
    mask: boolean `[T, S]` or None; a ring cache's keys, whose order is not their positions',
      are described by this alone.
    """

    is_causal: bool
    query_offset: Any = None
    window: tuple[int, int] | None = None
    segment_ids: tuple[Array, Array] | None = None
    mask: Array | None = None


def visible_keys(keys: KeyVisibility, T: int, S: int) -> Array | None:
    """`keys` as one boolean mask broadcastable to `[batch..., 1, T, S]` (None: every key)."""
    at = jnp.arange(T)[:, None] + (0 if keys.query_offset is None else keys.query_offset)  # (T, 1)
    key_pos = jnp.arange(S)[None, :]  # (1, S)
    masks = [keys.mask]
    if keys.is_causal:
        masks.append(key_pos <= at)  # (T, S)
    if keys.window is not None:
        left, right = keys.window
        masks.append((key_pos >= at - left) & (key_pos <= at + right))  # (T, S)
    if keys.segment_ids is not None:
        query_ids, key_ids = keys.segment_ids
        masks.append(query_ids[..., None, :, None] == key_ids[..., None, None, :])  # (batch..., 1, T, S)
    return _and_masks(*masks)


def _check_pattern_request(owner: str, heads: tuple[int, ...], num_heads: int, dropping: bool) -> None:
    """ValueError unless every requested pattern head is in [0, num_heads) and no dropout is on."""
    if any(isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < num_heads for h in heads):
        raise ValueError(f"{owner}: pattern_heads={heads!r} must be query heads in [0, {num_heads})")
    if dropping:
        raise ValueError(
            f"{owner}: attention patterns requested with attention dropout on; run deterministic=True"
        )


def _softmax_with_sinks(logits: Array, sinks: Array | None) -> Array:
    """softmax over the last axis of `logits` `[..., N, T, S]` with an extra logit per head `sinks`
    `[N]` in each denominator (None: none); rows without a finite logit (and no sink) are zero."""
    sink = None if sinks is None else sinks.astype(logits.dtype)[:, None, None]  # (N, 1, 1)
    row_max = jnp.max(logits, axis=-1, keepdims=True)  # (..., N, T, 1)
    if sink is not None:
        sink = sink.reshape((1,) * (logits.ndim - 3) + sink.shape)
        row_max = jnp.maximum(row_max, sink)
    row_max = lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    unnormalized = jnp.exp(logits - row_max)  # (..., N, T, S)
    denominator = jnp.sum(unnormalized, axis=-1, keepdims=True)
    if sink is not None:
        denominator = denominator + jnp.exp(sink - row_max)
    return unnormalized / jnp.where(denominator > 0, denominator, 1.0)


def attend_heads(
    hook: Callable[[str, Array], Array],
    heads: tuple[int, ...],
    output: Array,
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
) -> tuple[Array, Array]:
    """The attention of `heads` (query heads) again, explicitly, with their scores and pattern hooked.

    `output` `[..., T, N, Hv]` is the attention's result on its own path;
    `query` `[..., T, N, H]`, `key` `[..., S, K, H]`, `value` `[..., S, K, Hv]`
    (query head n reads kv head n // (N / K)); `allowed` boolean,
    broadcastable to `[..., N|1, T, S]`; `bias` `[..., N|1, T|1, S|1]`,
    `scale` (None: 1/sqrt(H)), `soft_cap` and `sinks` `[N]` as the attention
    takes them. For the n = len(heads) heads only (O(n T S) memory): scores
    `[..., n, T, S]` (scaled, biased, capped, -inf where not allowed) through
    `hook("hook_attn_scores", .)`, their softmax through `hook("hook_pattern", .)`,
    and pattern @ V in place of those heads' outputs. Returns (output, pattern).
    """
    N, K = query.shape[-2], key.shape[-2]
    picked = jnp.array(heads)  # (n,)
    kv = picked // (N // K)  # (n,): each head's kv head
    compute_dtype = jnp.promote_types(jnp.result_type(query, key), jnp.float32)
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
    pattern = hook("hook_pattern", _softmax_with_sinks(scores, None if sinks is None else sinks[picked]))
    blended = jnp.einsum(
        "...nts,...snv->...tnv", pattern, value[..., kv, :].astype(pattern.dtype), precision=precision
    )  # (..., T, n, Hv)
    return output.at[..., picked, :].set(blended.astype(output.dtype)), pattern


# ----------------------------------------------------------------- the default attention_fn


def flax_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Dtype | None = None,
    precision: PrecisionLike = None,
    module: Any = None,
    force_fp32_for_softmax: bool = False,
    is_causal: bool = False,
    *,
    scale: float | Array | None = None,
    query_offset: Any = None,
    local_window_size: int | tuple[int, int] | None = None,
    query_segment_ids: Array | None = None,
    key_segment_ids: Array | None = None,
    logits_soft_cap: float | None = None,
    sinks: Array | None = None,
    implementation: str | None = None,
) -> Array:
    """flax's `attention_fn` signature over `qkv_jax.dot_product_attention`.

    The default `attention_fn` of `MultiHeadAttention` (linen) and of
    `qkv_jax.nnx.MultiHeadAttention`, with the arguments in flax's order
    (`flax.linen.dot_product_attention`'s, plus flax.nnx's `is_causal`):

    Args:
      query: `[batch..., T, N, H]`.
      key: `[batch..., S, K, H]`, K dividing N (grouped K/V heads, as flax.nnx).
      value: `[batch..., S, K, Hv]`.
      bias: additive logits bias broadcastable to `[batch..., N, T, S]`.
      mask: broadcastable to `[batch..., N, T, S]`; True or non-zero = may attend.
      broadcast_dropout: one dropout mask `[T, S]` shared by the batch and the
        heads (flax's default), else one per batch element and head.
      dropout_rng, dropout_rate, deterministic: dropout on the attention weights
        after the softmax, when not deterministic and the rate is positive: the
        same Bernoulli draw as flax's (`jax.random.bernoulli(dropout_rng,
        1 - rate, shape)`), so the same key drops the same weights.
      dtype: the computation dtype (query, key and value are promoted to it).
      precision: of every dot.
      module: a linen or nnx module to sow the weights `[batch..., N, T, S]`
        into, as `attention_weights` in 'intermediates' (linen) or
        `nnx.Intermediate` (nnx); taken after the softmax, before dropout.
      force_fp32_for_softmax: the logits and softmax are always computed in at
        least float32 here; with this the sown weights are float32 as well.
      is_causal: key s visible to query t when s <= t + query_offset.
      scale: of the logits (default 1/sqrt(H)).
      query_offset: key position of query 0 for `is_causal` and the window;
        None or 0 is top-left (flax.nnx's and jax.nn's alignment).
      local_window_size, query_segment_ids, key_segment_ids, logits_soft_cap,
        sinks: `qkv_jax.dot_product_attention`'s (a window as jax.nn's, packed
        sequences, a soft cap of the logits, one sink logit per head `[N]`).
      implementation: `qkv_jax.dot_product_attention`'s. Sowing weights or
        dropout takes "reference", the path that returns weights.

    Returns:
      `[batch..., T, N, Hv]`.
    """
    query, key, value = nn.dtypes.promote_dtype(query, key, value, dtype=dtype)
    dropping = not deterministic and dropout_rate > 0.0
    weighted = module is not None or dropping
    attended = dot_product_attention(
        query,
        key,
        value,
        bias,
        _as_bool_mask(mask),
        scale=scale,
        is_causal=is_causal,
        # Explicit, also when 0: the alignment is the caller's (top-left unless a cache says).
        query_offset=0 if query_offset is None else query_offset,
        local_window_size=local_window_size,
        query_segment_ids=query_segment_ids,
        key_segment_ids=key_segment_ids,
        logits_soft_cap=logits_soft_cap,
        sinks=sinks,
        return_weights=weighted,
        implementation="reference" if weighted else implementation,
        precision=precision,
    )
    if not weighted:
        return attended  # (..., T, N, Hv)
    output, weights = attended  # (..., T, N, Hv), (..., N, T, S)
    if module is not None:
        _sow_weights(module, weights.astype(jnp.float32) if force_fp32_for_softmax else weights)
    if not dropping:
        return output
    if dropout_rng is None:
        raise ValueError(f"attention: dropout_rate={dropout_rate} and deterministic=False need a dropout_rng")
    return _dropped_output(weights, value, dropout_rng, dropout_rate, broadcast_dropout, precision)


def _sow_weights(module: Any, weights: Array) -> None:
    """`weights` as `attention_weights` in a linen module's 'intermediates' or an nnx module's
    `nnx.Intermediate` (flax.nnx is looked up, not imported: it pulls in optax)."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, "attention_weights", weights)
    else:
        module.sow("intermediates", "attention_weights", weights)


def _dropped_output(
    weights: Array, value: Array, rng: Array, rate: float, broadcast: bool, precision: PrecisionLike
) -> Array:
    """The heads' outputs `[..., T, N, Hv]` from weights `[..., N, T, S]` after flax's dropout.

    flax's draw: `jax.random.bernoulli(rng, 1 - rate, shape)` with shape `(1, ..., 1, T, S)`
    (one mask for the batch and the heads) when `broadcast`, else the weights' own; kept
    weights are divided by 1 - rate. (The attention's own output, computed without dropout, is
    not used: under jit XLA drops it.)
    """
    keep_prob = 1.0 - rate
    shape = (1,) * (weights.ndim - 2) + weights.shape[-2:] if broadcast else weights.shape
    keep = jax.random.bernoulli(rng, keep_prob, shape)
    dropped = weights * (keep.astype(weights.dtype) / jnp.asarray(keep_prob, weights.dtype))  # (..., N, T, S)
    *batch, N, T, S = weights.shape
    K = value.shape[-2]
    grouped = dropped.reshape(*batch, K, N // K, T, S)  # (..., K, G, T, S)
    output = jnp.einsum("...kgts,...skv->...tkgv", grouped, value, precision=precision)  # (..., T, K, G, Hv)
    return output.reshape(*batch, T, N, value.shape[-1])  # (..., T, N, Hv)


# ------------------------------------------------------------- multi-head attention, step by step


class AttentionSettings(Protocol):
    """What the pure functions read from a module (linen `MultiHeadAttention` or its nnx twin)."""

    @property
    def num_heads(self) -> int: ...

    @property
    def scale(self) -> float | None: ...

    @property
    def dropout_rate(self) -> float: ...

    @property
    def broadcast_dropout(self) -> bool: ...

    @property
    def dtype(self) -> Dtype | None: ...

    @property
    def precision(self) -> PrecisionLike: ...

    @property
    def force_fp32_for_softmax(self) -> bool: ...

    @property
    def attention_fn(self) -> Callable[..., Array]: ...

    @property
    def attention_implementation(self) -> str | None: ...

    @property
    def absorb_latent(self) -> bool: ...

    @property
    def local_window_size(self) -> int | tuple[int, int] | None: ...

    @property
    def rope_base(self) -> float | None: ...

    @property
    def rope_fraction(self) -> float: ...

    @property
    def attn_logits_soft_cap(self) -> float | None: ...

    @property
    def use_sinks(self) -> bool: ...

    @property
    def lora_alpha(self) -> float: ...

    @property
    def qk_attn_weights_einsum_cls(self) -> Any: ...

    @property
    def attn_weights_value_einsum_cls(self) -> Any: ...


class AttentionLayers(NamedTuple):
    """The learned pieces of one attention layer: linen sub-modules or nnx modules, as callables.

    query `[..., T, D] -> [..., T, N, H]`; key and value `[..., S, D_kv] ->
    [..., S, K, H]` / `[..., S, K, Hv]` (with MLA they read the latent `[..., S,
    C]`); out `[..., T, N, Hv] -> [..., T, D_out]`; kv_latent (MLA only) `[...,
    S, D_kv] -> [..., S, C]`; query_ln and key_ln (normalize_qk) over H;
    sinks (use_sinks) the learned sink logits `[N]`, one per query head.
    `params(name)` is the parameter mapping of projection `name` (`kernel`,
    `bias`, `lora_a`, `lora_b`), read by MLA's weight absorption and by
    per-head results. `hook(name, x) -> x` passes `x` through the layer's
    hook point `name` (`HookPoint`); `request` is what an interpretability
    run asks of the layer (`AttentionRequest`).
    """

    query: Callable[[Array], Array]
    key: Callable[[Array], Array]
    value: Callable[[Array], Array]
    out: Callable[[Array], Array]
    kv_latent: Callable[[Array], Array] | None
    query_ln: Callable[[Array], Array] | None
    key_ln: Callable[[Array], Array] | None
    sinks: Array | None
    params: Callable[[str], Mapping[str, Array]]
    hook: Callable[[str, Array], Array]
    request: AttentionRequest


def check_attention_settings(owner: str, settings: Any) -> None:
    """Every check of a multi-head attention's settings, run where the module is built.

    `settings` has the fields of `MultiHeadAttention` (linen or nnx).
    ValueError naming the field and its value.
    """
    _check_lora(
        owner,
        settings.lora_rank,
        settings.lora_alpha,
        settings.lora_targets,
        ATTENTION_LORA_TARGETS,
        settings.kv_latent_dim,
    )
    _check_positive(
        owner,
        num_heads=settings.num_heads,
        qkv_features=settings.qkv_features,
        head_dim=settings.head_dim,
        num_kv_heads=settings.num_kv_heads,
        v_head_dim=settings.v_head_dim,
        out_features=settings.out_features,
        kv_latent_dim=settings.kv_latent_dim,
    )
    _check_heads(owner, settings.num_heads, settings.num_kv_heads)
    _check_dropout(owner, settings.dropout_rate)
    if settings.qkv_features is not None:
        resolve_head_dim(owner, settings.num_heads, settings.head_dim, settings.qkv_features, None)
    latent = settings.kv_latent_dim is not None
    if qk_norm_kind(owner, settings.normalize_qk) and latent and settings.absorb_latent:
        raise ValueError(
            f"{owner}: normalize_qk={settings.normalize_qk!r} with kv_latent_dim={settings.kv_latent_dim} "
            "needs absorb_latent=False (a norm of the keys does not fold into the query)"
        )
    _check_positions(owner, settings)
    accepted = inspect.signature(settings.attention_fn).parameters
    needs = {
        "scale": settings.scale is not None or (latent and settings.absorb_latent),
        "implementation": settings.attention_implementation is not None,
        "logits_soft_cap": settings.attn_logits_soft_cap is not None,
        "sinks": settings.use_sinks,
        "qk_attn_weights_einsum": settings.qk_attn_weights_einsum_cls is not None,
        "attn_weights_value_einsum": settings.attn_weights_value_einsum_cls is not None,
    }
    for argument, needed in needs.items():
        if needed and argument not in accepted:
            name = getattr(settings.attention_fn, "__name__", repr(settings.attention_fn))
            raise ValueError(
                f"{owner}: attention_fn={name} takes no `{argument}` argument, which "
                f"{'absorbed MLA decoding (kv_latent_dim, absorb_latent=True) or ' * (argument == 'scale')}"
                f"the module's settings need; leave attention_fn at its default "
                "(qkv_jax.modules.flax_dot_product_attention)"
            )


def qk_norm_kind(owner: str, normalize_qk: Any) -> str | None:
    """`normalize_qk` read: False (or None) no norm, True or "layernorm" flax's LayerNorm (no
    bias), "rms" an RMSNorm; None, "layernorm" or "rms". ValueError naming the value otherwise."""
    if normalize_qk is None or normalize_qk is False:
        return None
    if normalize_qk is True or normalize_qk == "layernorm":
        return "layernorm"
    if normalize_qk == "rms":
        return "rms"
    raise ValueError(f"{owner}: normalize_qk={normalize_qk!r} must be False, True, 'layernorm' or 'rms'")


def _check_positions(owner: str, settings: Any) -> None:
    """The window, RoPE and soft-cap settings: ValueError naming the field and its value."""
    window = window_pair(settings.local_window_size, owner)
    if window is not None and min(window) < 0:
        raise ValueError(f"{owner}: local_window_size={settings.local_window_size!r} must not be negative")
    check_rope(owner, settings.rope_base, settings.rope_fraction)
    if settings.rope_base is not None and settings.kv_latent_dim is not None:
        raise ValueError(
            f"{owner}: rope_base={settings.rope_base} with kv_latent_dim={settings.kv_latent_dim}: RoPE "
            "with MLA is not defined without DeepSeek-V2's decoupled rotary key, which qkv_jax does not have"
        )
    check_soft_cap(owner, settings.attn_logits_soft_cap)
    check_jax_nn_path(
        owner, settings.attention_implementation, settings.attn_logits_soft_cap, settings.use_sinks
    )


def check_jax_nn_path(owner: str, implementation: Any, soft_cap: Any, sinks: Any) -> None:
    """ValueError naming `attention_implementation` unless it is None or one of `IMPLEMENTATIONS`,
    and when jax.nn's paths ("xla", "cudnn"), which have neither, are asked for with a soft cap or
    sinks."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{owner}: attention_implementation={implementation!r}: unknown; choose one of "
            f"{', '.join(IMPLEMENTATIONS)} (or None: the dispatch rule)"
        )
    if implementation in ("xla", "cudnn") and (soft_cap is not None or sinks):
        raise ValueError(
            f"{owner}: attention_implementation={implementation!r} (jax.nn's) has no logits soft cap and "
            f"no sinks, and attn_logits_soft_cap={soft_cap!r}, sinks={bool(sinks)}; use 'reference' or "
            "'chunked', or None (the dispatch rule)"
        )


def check_soft_cap(owner: str, cap: Any) -> None:
    """ValueError naming `attn_logits_soft_cap` unless it is None or a finite number > 0."""
    if cap is not None and (
        isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf
    ):
        raise ValueError(f"{owner}: attn_logits_soft_cap={cap!r} must be a finite number > 0 (or None)")


def resolve_inputs(
    owner: str, inputs_q: Array, inputs_k: Any, inputs_v: Any, inputs_kv: Any, warn_square: bool = True
) -> tuple[Array, Array]:
    """flax's rules for `inputs_k`, `inputs_v` and the older `inputs_kv`: (keys' input, values' input).

    Both default to `inputs_q`, `inputs_v` to `inputs_k`. A boolean array as
    the third positional argument (`mha(x, x, mask)`, the older qkv_jax call)
    is a TypeError: that argument is `inputs_v`, as in flax. `warn_square`:
    flax.linen's DeprecationWarning for an `inputs_v` that looks like a mask
    (flax.nnx has none).
    """
    if inputs_kv is not None:
        if inputs_k is not None or inputs_v is not None:
            raise ValueError(
                f"{owner}: If either `inputs_k` or `inputs_v` is not None, `inputs_kv` must be None "
                "(inputs_kv is the older spelling of inputs_k = inputs_v)"
            )
        warnings.warn(
            f"{owner}: The inputs_kv arg will be deprecated soon, as in flax; pass inputs_k "
            "(inputs_v defaults to it)",
            DeprecationWarning,
            stacklevel=3,
        )
        return inputs_kv, inputs_kv
    if inputs_k is None:
        if inputs_v is not None:
            raise ValueError(
                f"{owner}: `inputs_k` cannot be None if `inputs_v` is not None. Pass the one input "
                "of keys and values as inputs_k"
            )
        inputs_k = inputs_q
    if inputs_v is None:
        return inputs_k, inputs_k
    if jnp.asarray(inputs_v).dtype == jnp.bool_:
        raise TypeError(
            f"{owner}: the third positional argument is inputs_v, as in flax, and got a boolean array "
            f"of shape {jnp.shape(inputs_v)}; pass mask=..."
        )
    if warn_square and inputs_v.shape[-1] == inputs_v.shape[-2]:
        warnings.warn(
            f"{owner}: inputs_v has shape {inputs_v.shape}, square in its last two axes; if it is a mask, "
            "pass mask=... (the function signature of MultiHeadDotProductAttention's `__call__` method "
            "has changed in flax 0.7.4 to take inputs_k and inputs_v positionally, and qkv_jax's follows it)",
            DeprecationWarning,
            stacklevel=3,
        )
    return inputs_k, inputs_v


def resolve_head_dim(
    owner: str, num_heads: int, head_dim: int | None, qkv_features: int | None, features: int | None
) -> int:
    """Head depth H: `head_dim`, else `qkv_features // num_heads`, else the input width `// num_heads`."""
    if head_dim is not None:
        if qkv_features is not None and qkv_features != num_heads * head_dim:
            raise ValueError(
                f"{owner}: qkv_features={qkv_features} != num_heads={num_heads} * head_dim={head_dim}; "
                "set one of them"
            )
        return head_dim
    width, what = (qkv_features, f"qkv_features={qkv_features}")
    if qkv_features is None:
        width, what = (features, f"the input width {features}")
    assert width is not None
    if width % num_heads:
        raise ValueError(
            f"{owner}: num_heads={num_heads} does not divide {what}; set head_dim or qkv_features"
        )
    return width // num_heads


def project_inputs(
    layers: AttentionLayers, inputs_q: Array, inputs_k: Array, inputs_v: Array
) -> tuple[Array, dict[str, Array]]:
    """Query `[..., T, N, H]` and the per-position entries a decode cache keeps.

    Entries: `key` `[..., S, K, H]` and `value` `[..., S, K, Hv]` (after
    `key_ln`), or with MLA (`layers.kv_latent`) the `latent` `[..., S, C]`
    that both are rebuilt from, which needs one input for keys and values.
    """
    query = layers.query(inputs_q)  # (..., T, N, H)
    if layers.query_ln is not None:
        query = layers.query_ln(query)
    if layers.kv_latent is not None:
        if inputs_v is not inputs_k:
            raise ValueError(
                "MultiHeadAttention: with kv_latent_dim, keys and values are rebuilt from one latent; "
                "pass one input (inputs_k) for both"
            )
        return query, {"latent": layers.kv_latent(inputs_k)}  # (..., S, C)
    key = layers.key(inputs_k)  # (..., S, K, H)
    if layers.key_ln is not None:
        key = layers.key_ln(key)
    return query, {"key": key, "value": layers.value(inputs_v)}  # (..., S, K, Hv)


def input_positions(owner: str, T: int, S: int, start: Any, segment_ids: Array | None) -> tuple[Array, Array]:
    """Positions of the T queries and the S keys, `[T]` and `[S]` counted from `start` (a decode
    cache's index; None: 0), or with packed `segment_ids` `[batch..., T]` (self-attention, S =
    T) both `[batch..., T]`, restarting at 0 in every segment (`positions.segment_positions`)."""
    if segment_ids is None:
        start = 0 if start is None else start
        return start + jnp.arange(T), start + jnp.arange(S)
    segment_ids = jnp.asarray(segment_ids)
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer) or segment_ids.shape[-1:] != (T,) or S != T:
        raise ValueError(
            f"{owner}: segment_ids must be integers [batch..., T] for self-attention (T = S = {T} here, "
            f"S = {S}), got {segment_ids.dtype}{list(segment_ids.shape)}"
        )
    positions = segment_positions(segment_ids)  # (batch..., T)
    return positions, positions


def rotate_inputs(
    owner: str,
    settings: AttentionSettings,
    query: Array,
    entries: Mapping[str, Array],
    query_positions: Array,
    key_positions: Array,
) -> tuple[Array, dict[str, Array]]:
    """RoPE (`settings.rope_base`; None: none) on the query `[..., T, N, H]` and the key entry
    `[..., S, K, H]` by their positions (`input_positions`), after the projections and
    query_ln/key_ln and before the decode cache, which so holds rotated keys. The leading
    int(H * rope_fraction) dims of each head rotate (`qkv_jax.positions`)."""
    if settings.rope_base is None:
        return query, dict(entries)
    rotary_dims(query.shape[-1], settings.rope_fraction, owner)  # the error names the owner
    rope = functools.partial(apply_rope, base=settings.rope_base, fraction=settings.rope_fraction)
    return rope(query, query_positions), {**entries, "key": rope(entries["key"], key_positions)}


def hook_projections(layers: AttentionLayers, query: Array, entries: Mapping[str, Array]):
    """The query and the entries of the new positions through the layer's hook points, after RoPE and
    before the decode cache: hook_q `[..., T, N, H]`, and hook_k `[..., S, K, H]` and hook_v `[..., S,
    K, Hv]`, or MLA's hook_kv_latent `[..., S, C]`. Returns (query, entries)."""
    names = {"key": "hook_k", "value": "hook_v", "latent": "hook_kv_latent"}
    return layers.hook("hook_q", query), {name: layers.hook(names[name], x) for name, x in entries.items()}


def check_segment_ids(owner: str, segment_ids: Any, decode: Any) -> None:
    """Packed sequences are a full pass's: ValueError for `segment_ids` with decoding (a decode
    cache holds one sequence per row)."""
    if segment_ids is not None and decode:
        raise ValueError(
            f"{owner}: segment_ids with decode=True; a decode cache holds one sequence per row, so "
            "decode each packed sequence as its own row"
        )


def full_pass_keys(owner: str, local_window_size: Any, is_causal: bool, segment_ids: Any) -> KeyVisibility:
    """The keys each query sees without a decode cache: causal (top-left), the window, and with
    `segment_ids` `[batch..., T]` (self-attention) only its own segment's."""
    segments = None if segment_ids is None else (jnp.asarray(segment_ids),) * 2
    return KeyVisibility(is_causal, None, window_pair(local_window_size, owner), segments)


def cache_slots(local_window_size: Any, length: int) -> int:
    """Positions a decode cache keeps for inputs of `length` positions: `length`, or with a window
    (left, right) only the left + 1 a query can still reach when that is fewer (a ring)."""
    window = window_pair(local_window_size, "cache_slots")
    return length if window is None else min(length, window[0] + 1)


def advance_cache_index(owner: str, index: Array, length: int, capacity: int) -> tuple[Array, Array]:
    """The index after appending `length` positions to a cache of `capacity`, and whether they fit.

    Appending past `capacity` is an error: a ValueError when `index` is
    concrete (an eager `apply`); under `jit` it is traced, so the returned flag
    is False (callers then keep their cache and return NaN) and
    `checkify.checkify` raises.
    """
    fits = index + length <= capacity
    message = (
        f"{owner}: decoding {length} position(s) from position {{start}} "
        f"overflows the cache of max length {capacity}"
    )
    if isinstance(index, jax.core.Tracer):
        checkify.debug_check(fits, message, start=index)
    elif not fits:
        raise ValueError(message.format(start=int(index)))
    return index + length, fits


def _check_cache_shapes(owner: str, cached: Mapping[str, Array], entries: Mapping[str, Array], axis: int):
    for name, x in entries.items():
        full = cached[name].shape
        if x.shape[:axis] + x.shape[axis + 1 :] != full[:axis] + full[axis + 1 :]:
            raise ValueError(
                f"{owner}: decode input gives {name} of shape {x.shape}, which does not fit the "
                f"cache of shape {full} (batch dims and widths must match)"
            )


def append_to_cache(
    owner: str, cached: Mapping[str, Array], index: Array, entries: Mapping[str, Array], axis: int
) -> tuple[dict[str, Array], Array, Array]:
    """Writes `entries` (T positions along `axis`) into `cached` (L positions) from `index`.

    Returns the new cache arrays, the new index and whether the T positions
    fit (see `advance_cache_index`; on overflow nothing is written).
    """
    _check_cache_shapes(owner, cached, entries, axis)
    length = next(iter(entries.values())).shape[axis]
    capacity = next(iter(cached.values())).shape[axis]
    new_index, fits = advance_cache_index(owner, index, length, capacity)
    written = {}
    for name, x in entries.items():
        old = lax.dynamic_slice_in_dim(cached[name], index, length, axis)
        x = jnp.where(fits, x.astype(cached[name].dtype), old)  # an overflow leaves the cache as it was
        written[name] = lax.dynamic_update_slice_in_dim(cached[name], x, index, axis)
    return written, new_index, fits


def append_to_ring(
    cached: Mapping[str, Array],
    index: Array,
    entries: Mapping[str, Array],
    axis: int,
    window: tuple[int, int],
) -> tuple[dict[str, Array], Array, dict[str, Array], Array]:
    """A ring cache of W = left + 1 slots for a causal window (left, right): position p lives in
    slot p % W, and `index` counts every position ever appended (it never overflows).

    The T new `entries` (along `axis`) are attended together with the W slots as
    they were, `[W + T]` keys, which the returned mask `[T, W + T]` restricts to
    the keys a query sees (written, causal, inside the window); then the last
    min(T, W) of them are written. Returns (new cache arrays, new index, the
    entries to attend over, that mask).
    """
    W = next(iter(cached.values())).shape[axis]
    T = next(iter(entries.values())).shape[axis]
    slots = jnp.arange(W)
    slot_positions = index - 1 - (index - 1 - slots) % W  # (W,): the newest position p < index in each
    new_positions = index + jnp.arange(T)  # (T,)
    key_positions = jnp.concatenate([slot_positions, new_positions])[None, :]  # (1, W + T)
    query_positions = new_positions[:, None]  # (T, 1)
    left, right = window
    visible = (
        (key_positions >= 0)  # never written: position < 0
        & (key_positions <= query_positions)
        & (key_positions >= query_positions - left)
        & (key_positions <= query_positions + right)
    )  # (T, W + T)
    kept = min(T, W)  # the newest `kept` positions overwrite the oldest slots (distinct slots)
    written_slots = (index + T - kept + jnp.arange(kept)) % W  # (kept,)
    where = (slice(None),) * axis + (written_slots,)
    attended, written = {}, {}
    for name, x in entries.items():
        x = x.astype(cached[name].dtype)
        attended[name] = jnp.concatenate([cached[name], x], axis=axis)  # (..., W + T, ...)
        written[name] = cached[name].at[where].set(lax.slice_in_dim(x, T - kept, T, axis=axis))
    return written, index + T, attended, visible


def cache_step(
    owner: str,
    local_window_size: Any,
    cached: Mapping[str, Array],
    index: Array,
    entries: Mapping[str, Array],
    axis: int,
) -> tuple[dict[str, Array], Array, dict[str, Array], KeyVisibility, Array | None]:
    """One decode call's cache: (new cache arrays, new index, the entries the queries attend over,
    which of them each query sees, whether the positions fit (None: always)).

    A cache of left + 1 slots for a window (left, right) is a ring
    (`append_to_ring`); any other is written in order from `index`
    (`append_to_cache`) and the queries see its positions up to their own
    (and inside the window).
    """
    _check_cache_shapes(owner, cached, entries, axis)
    window = window_pair(local_window_size, owner)
    if window is not None and next(iter(cached.values())).shape[axis] == window[0] + 1:
        written, new_index, attended, visible = append_to_ring(cached, index, entries, axis, window)
        return written, new_index, attended, KeyVisibility(False, mask=visible), None
    written, new_index, fits = append_to_cache(owner, cached, index, entries, axis)
    return written, new_index, written, KeyVisibility(True, index, window), fits


def _call_attention_fn(
    settings: AttentionSettings,
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | None,
    keys: KeyVisibility,
    sinks: Array | None,
    scale: Any,
    bias: Array | None = None,
    deterministic: bool,
    dropout_rng: Array | None,
    sow_module: Any,
) -> Array:
    """`settings.attention_fn` called as flax calls it, with qkv_jax's extras it accepts.

    Keyword arguments it does not take are left out (flax's rule). `keys`
    becomes the causal, offset, window and segment arguments, or for a
    function without one of those that it needs, an explicit mask.
    """
    accepted = inspect.signature(settings.attention_fn).parameters
    mask = _and_masks(mask, keys.mask)
    needed = {
        "is_causal": keys.is_causal,
        "query_offset": keys.query_offset is not None and (keys.is_causal or keys.window is not None),
        "local_window_size": keys.window is not None,
        "query_segment_ids": keys.segment_ids is not None,
        "key_segment_ids": keys.segment_ids is not None,
    }
    if any(need and name not in accepted for name, need in needed.items()):
        mask = _and_masks(mask, visible_keys(keys._replace(mask=None), query.shape[-3], key.shape[-3]))
        keys = KeyVisibility(False)
    query_ids, key_ids = keys.segment_ids or (None, None)
    arguments = dict(
        bias=bias,
        mask=mask,
        dropout_rng=dropout_rng,
        dropout_rate=settings.dropout_rate,
        broadcast_dropout=settings.broadcast_dropout,
        deterministic=deterministic,
        dtype=settings.dtype,
        precision=settings.precision,
        force_fp32_for_softmax=settings.force_fp32_for_softmax,
        is_causal=keys.is_causal,
        query_offset=keys.query_offset,
        local_window_size=keys.window,
        query_segment_ids=query_ids,
        key_segment_ids=key_ids,
        logits_soft_cap=settings.attn_logits_soft_cap,
        sinks=sinks,
        scale=scale,
        implementation=settings.attention_implementation,
        module=sow_module,
    )
    if settings.qk_attn_weights_einsum_cls is not None:
        arguments["qk_attn_weights_einsum"] = settings.qk_attn_weights_einsum_cls()
        arguments["attn_weights_value_einsum"] = settings.attn_weights_value_einsum_cls()
    arguments = {name: value for name, value in arguments.items() if name in accepted}
    return settings.attention_fn(query, key, value, **arguments)


def _absorbed_key_bias(
    settings: AttentionSettings, grouped: Array, key_params: Mapping[str, Array], scale, scored: bool
):
    """`[..., N, T, 1]`: scale * q_n b_K[k], the part of each logit the latents leave out, or None.

    It is the same for every key of a row, so the softmax cancels it; a sink (a
    fixed logit beside the keys) and a soft cap (tanh of the logits) do not,
    and `scored` (requested scores, hook_attn_scores) wants the logits themselves.
    """
    cancels = settings.attn_logits_soft_cap is None and not settings.use_sinks and not scored
    if "bias" not in key_params or cancels:
        return None
    (key_bias,) = nn.dtypes.promote_dtype(key_params["bias"], dtype=settings.dtype)  # (K, H)
    shift = jnp.einsum(
        "...tkgh,kh->...kgt", grouped, key_bias, precision=settings.precision
    )  # (..., K, G, T)
    *batch, K, G, T = shift.shape
    return (shift * scale).reshape(*batch, K * G, T, 1)  # (..., N, T, 1)


def _absorbed_value_bias(
    value_bias: Array,
    output: Array,
    weight_sums: Array | None,
    mask: Array | None,
    keys: KeyVisibility,
    L: int,
) -> Array:
    """The heads' outputs `[..., T, N, Hv]` plus b_V `[K * G -> N, Hv]` times each row's total
    weight on keys: `weight_sums` `[..., T, N, 1]` when sinks take a share, else 1 where the row
    sees a key and 0 where it sees none (`mask` and `keys` over the L latents)."""
    value_bias = value_bias.astype(output.dtype)
    value_bias = value_bias.reshape((1,) * (output.ndim - 2) + value_bias.shape)  # (1.., 1, N, Hv)
    if weight_sums is not None:
        return output + weight_sums * value_bias
    if mask is not None:  # without one, every decoding query sees at least its own position
        visible = _and_masks(mask, visible_keys(keys, output.shape[-3], L), jnp.ones((1, 1, 1), jnp.bool_))
        assert visible is not None  # (..., N|1, T, L)
        has_key = jnp.swapaxes(jnp.any(visible, axis=-1), -1, -2)[..., None]  # (..., T, N|1, 1)
        has_key = has_key.reshape((1,) * (output.ndim - has_key.ndim) + has_key.shape)
        value_bias = jnp.where(has_key, value_bias, 0)  # (..., T, N, Hv)
    return output + value_bias


def _absorbed(
    settings: AttentionSettings,
    layers: AttentionLayers,
    query: Array,
    latent: Array,
    mask: Array | None,
    keys: KeyVisibility,
    attend: Callable[..., Array],
) -> Array:
    """MLA attention straight from the cached latents C `[..., L, C]`, K and V never built.

    With key = C W_K + b_K and value = C W_V + b_V (kernels `[C, K, H]`,
    `[C, K, Hv]`), head n (kv head k = n // (N/K)) has logits q_n (C W_K[k])^T
    = (q_n W_K[k]^T) C^T, plus q_n b_K[k], the same for every key, which the
    softmax cancels (and which is added as a bias where a sink or a soft cap
    would not cancel it): the query is projected into the latent space and
    attends over the latents (one shared kv head of depth C). Its output
    sum_s w_s (c_s W_V[k] + b_V[k]) is the blend of the latents times W_V[k],
    plus b_V[k] times the row's total weight (1 where it attends to anything;
    with sinks, read from a constant channel blended beside the latents):
    the value up-projection moves past the attention, to each query's blend
    instead of every cached position, where it meets W_O.
    Both projections are applied per query token, which costs fewer
    operations than folding them into W_Q and W_O ahead of time when C is
    larger than the head depth. With LoRA adapters on them, W_K and W_V are
    the effective kernels (kernel + (alpha / r) A B). Returns the heads'
    outputs `[..., T, N, Hv]`, before W_O.
    """
    key_params, value_params = layers.params("key"), layers.params("value")
    W_key, W_value = nn.dtypes.promote_dtype(
        effective_kernel(key_params, settings.lora_alpha),
        effective_kernel(value_params, settings.lora_alpha),
        dtype=settings.dtype,
    )
    num_kv_heads, group = W_key.shape[1], settings.num_heads // W_key.shape[1]  # (C, K, H), (C, K, Hv)
    *batch, T, N, H = query.shape
    grouped = query.reshape(*batch, T, num_kv_heads, group, H)  # (..., T, K, G, H)
    query_latent = jnp.einsum("...kgh,ckh->...kgc", grouped, W_key, precision=settings.precision)
    query_latent = query_latent.reshape(*batch, T, N, -1)  # (..., T, N, C)
    latents = latent[..., None, :].astype(query_latent.dtype)  # (..., L, 1, C): key and value
    scale = settings.scale if settings.scale is not None else H**-0.5
    values, C = latents, latents.shape[-1]
    summed = "bias" in value_params and settings.use_sinks
    if summed:  # a channel of ones: its blend is each row's total weight on keys
        values = jnp.concatenate([latents, jnp.ones(latents.shape[:-1] + (1,), latents.dtype)], axis=-1)
    bias = _absorbed_key_bias(settings, grouped, key_params, scale, bool(layers.request.pattern_heads))
    blended = attend(query_latent, latents, values, scale=scale, bias=bias)  # (..., T, N, C [+ 1])
    weight_sums = blended[..., C:] if summed else None  # (..., T, N, 1)
    blended = blended[..., :C].reshape(*batch, T, num_kv_heads, group, C)  # (..., T, K, G, C)
    output = jnp.einsum(
        "...kgc,ckv->...kgv", blended, W_value, precision=settings.precision
    )  # (..., T, K, G, Hv)
    output = output.reshape(*batch, T, N, -1)  # (..., T, N, Hv)
    if "bias" not in value_params:
        return output
    value_bias = jnp.repeat(value_params["bias"], group, axis=0)  # (N, Hv)
    return _absorbed_value_bias(value_bias, output, weight_sums, mask, keys, latent.shape[-2])


def _attend_requested(
    settings: AttentionSettings,
    layers: AttentionLayers,
    attend: Callable[..., Array],
    mask: Array | None,
    keys: KeyVisibility,
    query: Array,
    key: Array,
    value: Array,
    *,
    scale: Any,
    bias: Array | None = None,
) -> Array:
    """`attend` (the attention on its own path), then the requested heads' patterns (`attend_heads`)."""
    output = attend(query, key, value, scale=scale, bias=bias)  # (..., T, N, Hv)
    allowed = _and_masks(mask, visible_keys(keys, query.shape[-3], key.shape[-3]))
    output, _ = attend_heads(
        layers.hook,
        layers.request.pattern_heads,
        output,
        query,
        key,
        value,
        allowed=allowed,
        scale=scale,
        precision=settings.precision,
        bias=bias,
        soft_cap=settings.attn_logits_soft_cap,
        sinks=layers.sinks,
    )
    return output


def _project_out(settings: AttentionSettings, layers: AttentionLayers, z: Array) -> Array:
    """W_O on the heads' outputs `[..., T, N, Hv]` -> `[..., T, D_out]`. With `request.head_results`
    per head first: hook_result `[..., T, N, D_out]` (the effective kernel, LoRA included, through a
    plain einsum), then their sum plus b_O."""
    if not layers.request.head_results:
        return layers.out(z)
    params = layers.params("out")
    kernel = effective_kernel(params, settings.lora_alpha)  # (N, Hv, D_out)
    z, kernel = nn.dtypes.promote_dtype(z, kernel, dtype=settings.dtype)
    results = jnp.einsum("...tnv,nvd->...tnd", z, kernel, precision=settings.precision)  # (..., T, N, D_out)
    output = jnp.sum(layers.hook("hook_result", results), axis=-2)  # (..., T, D_out)
    if "bias" not in params:
        return output
    return output + params["bias"].astype(output.dtype).reshape((1,) * (output.ndim - 1) + (-1,))


def attend_entries(
    settings: AttentionSettings,
    layers: AttentionLayers,
    query: Array,
    entries: Mapping[str, Array],
    *,
    mask: Any,
    head_mask: Any,
    keys: KeyVisibility,
    decoding: bool,
    fits: Array | None,
    deterministic: bool,
    dropout_rng: Array | None,
    sow_module: Any,
) -> Array:
    """Attention of `query` `[..., T, N, H]` over `entries` (`project_inputs`', rotated and
    cached), then W_O.

    `keys` (`KeyVisibility`): which keys each query may see besides `mask`;
    `cache_step` gives a decode cache's. MLA entries hold the latent: K and V
    are rebuilt from it (hook_k, hook_v), or when `decoding` with
    `settings.absorb_latent` the attention runs over the latents themselves
    (`_absorbed`). `layers.sinks` `[N]`: one sink logit per head. `head_mask`
    `[batch..., N]` multiplies each head's output before W_O; the result is
    hook_z. `layers.request` adds the requested heads' patterns
    (`attend_heads`) and per-head results (hook_result). `fits` False (a
    cache overflow under jit) gives NaN. Returns `[..., T, D_out]`.
    """
    mask = _as_bool_mask(mask)
    attend = functools.partial(
        _call_attention_fn,
        settings,
        mask=mask,
        keys=keys,
        sinks=layers.sinks,
        deterministic=deterministic,
        dropout_rng=dropout_rng,
        sow_module=sow_module,
    )
    if layers.request.pattern_heads:
        dropping = not deterministic and settings.dropout_rate > 0.0
        heads = layers.request.pattern_heads
        _check_pattern_request(type(settings).__name__, heads, settings.num_heads, dropping)
        attend = functools.partial(_attend_requested, settings, layers, attend, mask, keys)
    if "latent" not in entries:
        output = attend(query, entries["key"], entries["value"], scale=settings.scale)  # (..., T, N, Hv)
    elif decoding and settings.absorb_latent:
        output = _absorbed(settings, layers, query, entries["latent"], mask, keys, attend)
    else:
        key = layers.key(entries["latent"])  # (..., S, K, H)
        if layers.key_ln is not None:
            key = layers.key_ln(key)
        key, value = layers.hook("hook_k", key), layers.hook("hook_v", layers.value(entries["latent"]))
        output = attend(query, key, value, scale=settings.scale)  # (..., T, N, Hv)
    if head_mask is not None:  # (batch..., N): one factor per head
        factors = jnp.asarray(head_mask, output.dtype)[..., None, :, None]  # (batch..., 1, N, 1)
        output = output * factors.reshape((1,) * (output.ndim - factors.ndim) + factors.shape)
    output = _project_out(settings, layers, layers.hook("hook_z", output))  # (..., T, D_out)
    return output if fits is None else jnp.where(fits, output, jnp.nan)


# ------------------------------------------------------------------------- the linen module


class MultiHeadAttention(Inspectable):
    """Multi-head attention; a drop-in for `flax.linen.MultiHeadDotProductAttention`.

    flax's fields, call and layouts, with the same meaning and defaults:
      parameters `query` `[D, N, H]`, `key`/`value` `[D_kv, K, H]` / `[D_kv, K,
      Hv]`, `out` `[N, Hv, D_out]` (each with `kernel` and, with `use_bias`,
      `bias`), and with `normalize_qk` `query_ln`/`key_ln` (`scale` `[H]`, no
      bias: a LayerNorm of the query and key of each head). Built from the same
      `nn.DenseGeneral`/`nn.LayerNorm` with the same names, the same rng gives
      the same parameters as flax. With `use_sinks`, one more parameter:
      `sinks` `[N]`.
      `__call__(inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None,
      mask=None, deterministic=None, dropout_rng=None, sow_weights=False)`:
      inputs `[batch..., T, D]` and `[batch..., S, D_kv]` (keys default to the
      queries' input, values to the keys'), mask broadcastable to `[batch...,
      N, T, S]` (boolean, or flax's float 0/1 masks: non-zero may attend);
      returns `[batch..., T, D_out]`.

    Fields as flax's (see `flax.linen.MultiHeadDotProductAttention`):
      num_heads (N), dtype, param_dtype, qkv_features (N * H; default D),
      out_features (D_out; default D), broadcast_dropout, dropout_rate,
      deterministic (merged with the call's: flax's `merge_param`, needed only
      with dropout), precision, kernel_init, out_kernel_init, bias_init,
      out_bias_init, use_bias, attention_fn (default
      `flax_dot_product_attention`; any function with flax's attention_fn
      signature), decode, normalize_qk, force_fp32_for_softmax,
      qkv_dot_general(_cls), out_dot_general(_cls) (passed to the
      projections), qk_attn_weights_einsum_cls / attn_weights_value_einsum_cls
      (passed to an attention_fn that takes them).

    qkv_jax's own fields:
      num_kv_heads: K key/value heads, dividing N (default N; 1 = multi-query).
      head_dim: H (instead of qkv_features); v_head_dim: Hv (default H).
      kv_latent_dim: C, multi-head latent attention (MLA): a 'kv_latent' kernel
        `[D_kv, C]` maps each position to a latent, key and value kernels are
        `[C, K, H]` / `[C, K, Hv]` and rebuild K and V from it; a decode cache
        holds only the latent.
      absorb_latent: MLA decoding attends over the cached latents with the key
        up-projection folded into the query and the value up-projection into
        W_O ("weight absorption"), never building K and V; False rebuilds K
        and V from the latents at every step (the same outputs).
      is_causal: key s is visible to query t when s <= t (top-left, as jax.nn
        and flax.nnx; self-attention is the usual causal mask).
      scale: of the logits, default 1/sqrt(H).
      sow_weights: sow the weights on every call (as the call's `sow_weights`).
      attention_implementation: `qkv_jax.dot_product_attention`'s
        `implementation` (None: its dispatch rule). Sowing weights or dropout
        take "reference", the only path that does either.
      lora_rank, lora_alpha, lora_targets: LoRA adapters (`LoRADenseGeneral`:
        `lora_a` `[in..., r]`, `lora_b` `[r, out...]` beside each kernel, which
        keeps its place) on the projections named in lora_targets (of
        `ATTENTION_LORA_TARGETS`), scaled by lora_alpha / lora_rank; 0 = none.
      normalize_qk: flax's True (a LayerNorm), or "layernorm" (the same) or
        "rms" (an RMSNorm: x / rms(x) * scale, eps 1e-6), over H; the
        parameters are `query_ln`/`key_ln` `scale` `[H]` either way.
      local_window_size: jax.nn's (an int w = (w, w), or (left, right), both
        >= 0): query t sees key s only when t - left <= s <= t + right (in
        positions, so after a decode cache's index). With is_causal, (w - 1, 0)
        is a causal window of w keys, the query's own included.
      rope_base: rotary position embeddings (RoPE) of the queries and keys
        with this base (None: none), after the projections and query_ln /
        key_ln, before the decode cache (which so holds rotated keys); not
        defined with kv_latent_dim. rope_fraction: the leading
        int(H * rope_fraction) dims of each head rotate (an even number; GPT-NeoX's
        partial rotary; `qkv_jax.positions`).
      attn_logits_soft_cap: c, the logits become c * tanh(logits / c) (None: off).
      use_sinks: a learned sink logit per head (`sinks` `[N]`, zero at init)
        in every softmax's denominator: it takes weight and gives no value.

    qkv_jax's call keywords: `decode` (None: the field), `head_mask`
    `[batch..., N]`, a factor per head on its attention output before W_O (0
    ablates a head), `segment_ids` `[batch..., T]` (integers, self-attention,
    not when decoding): packed sequences, each query sees only the keys of its
    own segment, and RoPE positions restart at 0 where the id changes.

    Hook points (`HookPoint` sub-modules, no parameters; `qkv_jax.interpretability`
    reads and changes them): hook_q `[..., T, N, H]` (after query_ln and RoPE),
    hook_k `[..., S, K, H]`, hook_v `[..., S, K, Hv]` (the new positions, after
    key_ln and RoPE; with MLA hook_kv_latent `[..., S, C]`, and hook_k/hook_v
    where K and V are rebuilt from the latents), hook_z `[..., T, N, Hv]` (each
    head's output after head_mask, the input of W_O), and on request
    (`interpretability_request`, `AttentionRequest`) hook_attn_scores and
    hook_pattern `[..., n, T, S]` for n requested heads and hook_result
    `[..., T, N, D_out]`.

    Decoding (`decode=True`, flax's cache): 'cache' holds `cached_key` `[batch...,
    L, K, H]`, `cached_value` `[batch..., L, K, Hv]` (or with MLA only
    `cached_latent` `[batch..., L, C]`) and `cache_index`, the int32 count of
    positions filled. `init` with decode on an input of length L creates it
    (and returns the ordinary pass over that input); each `apply(...,
    mutable=['cache'])` then appends its T >= 1 positions (a prompt, then a
    token at a time) and each query attends to the cached positions up to its
    own; `mask` then broadcasts to `[batch..., N, T, L]`. Appending past L
    raises (see `advance_cache_index`). With a window (left, right) narrower
    than L, the cache keeps W = left + 1 slots (`cache_slots`): a ring buffer
    where position p lives in slot p % W; it never overflows, and the queries
    attend over the W slots and their own T positions (`mask` then
    broadcasts to `[batch..., N, T, W + T]`).
    """

    num_heads: int
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    qkv_features: int | None = None
    out_features: int | None = None
    broadcast_dropout: bool = True
    dropout_rate: float = 0.0
    deterministic: bool | None = None
    precision: PrecisionLike = None
    kernel_init: Initializer = nn.initializers.lecun_normal()
    out_kernel_init: Initializer | None = None
    bias_init: Initializer = nn.initializers.zeros_init()
    out_bias_init: Initializer | None = None
    use_bias: bool = True
    attention_fn: Callable[..., Array] = flax_dot_product_attention
    decode: bool = False
    normalize_qk: bool | str = False
    force_fp32_for_softmax: bool = False
    qkv_dot_general: Any = None
    out_dot_general: Any = None
    qkv_dot_general_cls: Any = None
    out_dot_general_cls: Any = None
    qk_attn_weights_einsum_cls: Any = None
    attn_weights_value_einsum_cls: Any = None
    # qkv_jax's
    num_kv_heads: int | None = None
    head_dim: int | None = None
    v_head_dim: int | None = None
    kv_latent_dim: int | None = None
    absorb_latent: bool = True
    is_causal: bool = False
    scale: float | None = None
    sow_weights: bool = False
    attention_implementation: str | None = None
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("query", "value")
    local_window_size: int | tuple[int, int] | None = None
    rope_base: float | None = None
    rope_fraction: float = 1.0
    attn_logits_soft_cap: float | None = None
    use_sinks: bool = False

    def __post_init__(self):
        check_attention_settings(type(self).__name__, self)
        super().__post_init__()

    def _projection(self, features: Any, name: str, axis: Any = -1) -> nn.DenseGeneral:
        """The DenseGeneral projection `name`, with a LoRA adapter when `name` is a target."""
        is_out = name == "out"
        options = dict(
            axis=axis,
            use_bias=self.use_bias,
            kernel_init=(self.out_kernel_init or self.kernel_init) if is_out else self.kernel_init,
            bias_init=(self.out_bias_init or self.bias_init) if is_out else self.bias_init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            precision=self.precision,
            dot_general=self.out_dot_general if is_out else self.qkv_dot_general,
            dot_general_cls=self.out_dot_general_cls if is_out else self.qkv_dot_general_cls,
            name=name,
        )
        if self.lora_rank and name in self.lora_targets:
            return LoRADenseGeneral(features, rank=self.lora_rank, alpha=self.lora_alpha, **options)
        return nn.DenseGeneral(features, **options)

    def _layers(self, features: int) -> AttentionLayers:
        head_dim = resolve_head_dim(
            type(self).__name__, self.num_heads, self.head_dim, self.qkv_features, features
        )
        num_kv_heads = self.num_kv_heads or self.num_heads
        projections = {
            "query": self._projection((self.num_heads, head_dim), "query"),
            "key": self._projection((num_kv_heads, head_dim), "key"),
            "value": self._projection((num_kv_heads, self.v_head_dim or head_dim), "value"),
            "out": self._projection(self.out_features or features, "out", axis=(-2, -1)),
        }
        kind = qk_norm_kind(type(self).__name__, self.normalize_qk)
        norm = functools.partial(
            nn.RMSNorm if kind == "rms" else functools.partial(nn.LayerNorm, use_bias=False),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        latent = self.kv_latent_dim is not None
        sinks = (self.num_heads,)  # (N,): one sink logit per query head
        return AttentionLayers(
            **projections,
            kv_latent=self._projection(self.kv_latent_dim, "kv_latent") if latent else None,
            query_ln=norm(name="query_ln") if kind else None,
            key_ln=norm(name="key_ln") if kind else None,
            sinks=self.param("sinks", nn.initializers.zeros_init(), sinks, self.param_dtype)
            if self.use_sinks
            else None,
            params=lambda name: projections[name].variables["params"],
            hook=functools.partial(_hook, self),
            request=self.interpretability_request(),
        )

    def _cache(self, entries: dict[str, Array], axis: int) -> tuple[dict[str, Any], Any] | None:
        """The decode cache's variables (cached entries, cache_index), or None on the first call
        (inside `init`), which creates them: `cache_slots` positions of the entries' length."""
        initialized = self.has_variable("cache", "cache_index")

        def shape(x: Array) -> tuple[int, ...]:
            return (
                x.shape[:axis] + (cache_slots(self.local_window_size, x.shape[axis]),) + x.shape[axis + 1 :]
            )

        cached = {
            name: self.variable("cache", f"cached_{name}", jnp.zeros, shape(x), x.dtype)
            for name, x in entries.items()
        }
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        return (cached, index) if initialized else None

    def _append(
        self, cache: tuple[dict[str, Any], Any], entries: dict[str, Array], axis: int
    ) -> tuple[dict[str, Array], KeyVisibility, Array | None]:
        """`cache_step` on the cache variables, which it updates: (the entries to attend over,
        which of them each query sees, whether the positions fit)."""
        cached, index = cache
        written, index.value, attended, keys, fits = cache_step(
            type(self).__name__,
            self.local_window_size,
            {name: c.value for name, c in cached.items()},
            index.value,
            entries,
            axis,
        )
        for name, variable in cached.items():
            variable.value = written[name]
        return attended, keys, fits

    def _dropout_arguments(self, deterministic: bool | None, dropout_rng: Array | None):
        """flax's rule: `deterministic` (merged with the field) is needed only with dropout."""
        if self.dropout_rate == 0.0:
            return True, dropout_rng
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if not deterministic and dropout_rng is None:
            dropout_rng = self.make_rng("dropout")
        return deterministic, dropout_rng

    @nn.compact
    def __call__(
        self,
        inputs_q: Array,
        inputs_k: Array | None = None,
        inputs_v: Array | None = None,
        *,
        inputs_kv: Array | None = None,
        mask: Array | None = None,
        deterministic: bool | None = None,
        dropout_rng: Array | None = None,
        sow_weights: bool = False,
        decode: bool | None = None,
        head_mask: Array | None = None,
        segment_ids: Array | None = None,
    ) -> Array:
        owner = type(self).__name__
        inputs_k, inputs_v = resolve_inputs(owner, inputs_q, inputs_k, inputs_v, inputs_kv)
        _check_inputs(owner, "inputs_q", inputs_q)
        _check_inputs(owner, "inputs_k", inputs_k)
        decode = self.decode if decode is None else decode
        check_segment_ids(owner, segment_ids, decode)
        layers = self._layers(inputs_q.shape[-1])
        query, entries = project_inputs(layers, inputs_q, inputs_k, inputs_v)
        axis = inputs_k.ndim - 2
        cache = self._cache(entries, axis) if decode else None
        positions = input_positions(
            owner, query.shape[-3], inputs_k.shape[-2], None if cache is None else cache[1].value, segment_ids
        )
        query, entries = hook_projections(layers, *rotate_inputs(owner, self, query, entries, *positions))
        keys, fits = full_pass_keys(owner, self.local_window_size, self.is_causal, segment_ids), None
        if cache is not None:
            entries, keys, fits = self._append(cache, entries, axis)
        deterministic, dropout_rng = self._dropout_arguments(deterministic, dropout_rng)
        return attend_entries(
            self,
            layers,
            query,
            entries,
            mask=mask,
            head_mask=head_mask,
            keys=keys,
            decoding=cache is not None,
            fits=fits,
            deterministic=deterministic,
            dropout_rng=dropout_rng,
            sow_module=self if sow_weights or self.sow_weights else None,
        )


class MultiHeadDotProductAttention(MultiHeadAttention):
    """`MultiHeadAttention` under flax's other name.

    flax.linen has both names (`MultiHeadAttention` subclasses
    `MultiHeadDotProductAttention`); an unnamed instance is named after its
    class (`MultiHeadDotProductAttention_0`), which sets its parameter path and
    its random streams. Replacing `flax.linen.MultiHeadDotProductAttention`
    by this class keeps both.
    """
