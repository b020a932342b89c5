"""Multi-head attention: one core, the linen face, and the pieces both faces share.

  AttentionOptions      every option of multi-head attention, declared once (a
                        frozen dataclass, checked when built)
  multi_head_attention  the core: every check, the projections, RoPE, the hook
                        points, the decode cache, the attention and W_O, for
                        either face (`AttentionFace`: how a face makes its
                        parameters and keeps its cache)
  MultiHeadAttention    the linen face, a drop-in for
                        `flax.linen.MultiHeadDotProductAttention` (same call,
                        fields, parameter and cache layout) with grouped K/V
                        heads, latent K/V (MLA), LoRA adapters and multi-token
                        decoding on top; the nnx face is `qkv_jax.nnx.MultiHeadAttention`.
  MultiHeadDotProductAttention  the same class under flax's other name, so that
                        unnamed instances get flax's default names (and so
                        flax's parameter paths and random streams).
  LayerNorm             flax's LayerNorm with TransformerLens's hook points (the
                        "layernorm" kind of `qkv_jax.norms`).

The core's steps, as pure functions:
  project_inputs        inputs -> query `[..., T, N, H]` and what a cache holds
                        (K and V, or MLA's latent)
  cache_step            writes T positions into a cache (in order, or a ring)
  attend_entries        K/V (or absorbed latents) -> attention -> head mask -> W_O
  flax_dot_product_attention  the default `attention_fn`: flax's signature,
                        `qkv_jax.dot_product_attention` underneath, flax's dropout

Each takes `precision` (flax's spelling: None for JAX's default, 'highest',
a `jax.lax.Precision`, a pair, ...), passed to every projection and to every
dot of the attention itself, forward and backward.

The teaching modules (`StaticAttention`, `SelfAttentionV1`, `SelfAttention`,
`LearnedQueryAttention`) live in `qkv_jax.teaching`; importing them from here
still works.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify

from qkv_jax.attention import (
    IMPLEMENTATIONS,
    SUPPORTED,
    KeyVisibility,
    PrecisionLike,
    and_masks,
    dot_product_attention,
    visible_keys,
    window_pair,
)
from qkv_jax.heads import (
    AttentionRequest,
    Inspectable,
    _check_dropout,
    _check_heads,
    _check_inputs,
    _check_lora,
    _check_pattern_request,
    _check_positive_fields,
    attend_heads,
    torch_linear_init,
)
from qkv_jax.hooks import HookPoint
from qkv_jax.hooks import hook as _hook
from qkv_jax.lora import LoRADenseGeneral, effective_kernel
from qkv_jax.norms import Norm, normalize
from qkv_jax.positions import RopeScaling, apply_rope, check_rope, rotary_dims, segment_positions

Array = jax.Array
Dtype = Any
Initializer = Any

__all__ = [
    "AttentionOptions",
    "OPTION_NAMES",
    "AttentionFace",
    "DecodeCache",
    "multi_head_attention",
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

# The teaching modules, importable from here as before (`__getattr__`; they import this module).
TEACHING = ("StaticAttention", "SelfAttentionV1", "SelfAttention", "LearnedQueryAttention")


def __getattr__(name: str) -> Any:
    if name in TEACHING:
        from qkv_jax import teaching

        return getattr(teaching, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# MultiHeadAttention's projections a LoRA adapter can sit beside (kv_latent: MLA's down-projection).
ATTENTION_LORA_TARGETS = ("query", "key", "value", "out", "kv_latent")

# ------------------------------------------------------------------------------------ norms


def layer_norm(
    x: Array,
    scale: Array,
    bias: Array,
    epsilon: float,
    dtype: Dtype | None,
    hook: Callable[[str, Array], Array],
) -> Array:
    """flax's LayerNorm over the last axis of `x` `[..., D]`, with `scale`, `bias` `[D]`: the
    "layernorm" kind of `qkv_jax.norms.normalize` (hook_scale `[..., 1]`, hook_normalized
    `[..., D]` through `hook`). Returns `[..., D]` in `dtype` (None: promoted)."""
    return normalize(x, kind="layernorm", epsilon=epsilon, scale=scale, bias=bias, dtype=dtype, hook=hook)


class LayerNorm(nn.Module):
    """`flax.linen.LayerNorm` (last axis, with scale and bias) with TransformerLens's two hook points.

    The "layernorm" kind of `qkv_jax.norms.Norm` under flax's fields: the same
    parameters, `scale` (ones) and `bias` (zeros) `[D]`, so checkpoints of
    `nn.LayerNorm` load unchanged, and the same statistics; `hook_scale`
    `[..., 1]` and `hook_normalized` `[..., D]` in between.
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


# ------------------------------------------------------------------ masks shared by the pieces below


def _as_bool_mask(mask: Any) -> Array | None:
    """A mask as booleans: flax's helpers (`make_causal_mask`, ...) give float 0/1 masks."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    return mask if mask.dtype == jnp.bool_ else mask != 0


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

# The name every multi-head attention error starts with, the linen face's and the nnx face's alike.
OWNER = "MultiHeadAttention"
# normalize_qk's kinds (True is "layernorm", False none) and qk_norm_width's widths.
QK_NORMS = ("layernorm", "rms", "rms_offset")
QK_NORM_WIDTHS = ("head", "full")


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """Every option of multi-head attention, declared once; the checks run when it is built.

    The linen `MultiHeadAttention`'s fields and the nnx `MultiHeadAttention`'s
    constructor keywords carry these names and defaults: flax's own by hand, in
    flax's order, and the others written from here by `python -m docs.generate
    faces` (tests/modules/test_faces_attention.py fails while a face lacks
    one). Each face builds one `AttentionOptions` from them
    (`AttentionOptions.pick`) and the core reads nothing else. What only one
    face has stays there: the initializers, `dot_general`s, `decode` and
    `deterministic` (flax's defaults differ between linen and nnx), nnx's
    `in_features`, `rngs` and metadata.

    flax's options have flax's meaning (`flax.linen.MultiHeadDotProductAttention`;
    see the linen face). qkv_jax's own:
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
      normalize_qk: flax's True (a LayerNorm), or "layernorm" (the same),
        "rms" (an RMSNorm: x / rms(x) * scale) or "rms_offset" (Gemma's:
        x / rms(x) * (1 + scale), scale zero at init, in float32); the
        parameters are `query_ln`/`key_ln` `scale` either way.
      qk_norm_width: "head" (each head's query and key over H, one gain
        `[H]` shared by the heads: flax's, Qwen3's, Gemma 3's) or "full" (the
        query over its N * H features, the key over K * H: OLMo 2's; gains
        `[N * H]` and `[K * H]`). qk_norm_epsilon: the norms' epsilon (1e-6).
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
      out_bias: whether W_O has a bias (None: `use_bias`, which then covers
        the query, key and value projections only when out_bias is set).
      rope_scaling: a `qkv_jax.positions.RopeScaling` ("linear", "llama3" or
        "yarn") applied to the RoPE frequencies (None: unscaled).
    """

    # Sizes: N query heads, K key/value heads, head depths, MLA's latent.
    num_heads: int
    qkv_features: int | None = None
    out_features: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    v_head_dim: int | None = None
    kv_latent_dim: int | None = None
    absorb_latent: bool = True
    # The projections: biases, dtypes, precision, LoRA adapters.
    use_bias: bool = True
    out_bias: bool | None = None
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: PrecisionLike = None
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("query", "value")
    # QK-norm of the projected queries and keys.
    normalize_qk: bool | str = False
    qk_norm_width: str = "head"
    qk_norm_epsilon: float = 1e-6
    # Positions: RoPE, causality, the window.
    rope_base: float | None = None
    rope_fraction: float = 1.0
    rope_scaling: RopeScaling | None = None
    is_causal: bool = False
    local_window_size: int | tuple[int, int] | None = None
    # The attention itself.
    attention_fn: Callable[..., Array] = flax_dot_product_attention
    attention_implementation: str | None = None
    scale: float | None = None
    attn_logits_soft_cap: float | None = None
    use_sinks: bool = False
    force_fp32_for_softmax: bool = False
    qk_attn_weights_einsum_cls: Any = None
    attn_weights_value_einsum_cls: Any = None
    # Attention-weight dropout and sown weights.
    dropout_rate: float = 0.0
    broadcast_dropout: bool = True
    sow_weights: bool = False

    def __post_init__(self):
        check_attention_settings(OWNER, self)

    @classmethod
    def pick(cls, given: Mapping[str, Any]) -> AttentionOptions:
        """The options named in `given` (a face's fields or keywords); the others at their defaults."""
        return cls(
            **{field.name: given[field.name] for field in dataclasses.fields(cls) if field.name in given}
        )

    @property
    def qk_norm(self) -> str | None:
        """`normalize_qk` as one of `QK_NORMS`, or None (no norm)."""
        return qk_norm_kind(OWNER, self.normalize_qk)

    @property
    def bias_of_out(self) -> bool:
        """Whether W_O has a bias: `out_bias`, None meaning `use_bias`."""
        return self.use_bias if self.out_bias is None else self.out_bias


# The option names, in declaration order.
OPTION_NAMES = tuple(field.name for field in dataclasses.fields(AttentionOptions))


class AttentionLayers(NamedTuple):
    """The learned pieces of one attention layer: linen sub-modules or nnx modules, as callables.

    query `[..., T, D] -> [..., T, N, H]`; key and value `[..., S, D_kv] ->
    [..., S, K, H]` / `[..., S, K, Hv]` (with MLA they read the latent `[..., S,
    C]`); out `[..., T, N, Hv] -> [..., T, D_out]`; kv_latent (MLA only) `[...,
    S, D_kv] -> [..., S, C]`; query_ln and key_ln (normalize_qk) over the last
    axis of what `qk_norm_width` gives them (H, or N * H and K * H);
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


def check_attention_settings(owner: str, settings: AttentionOptions) -> None:
    """Every check of a multi-head attention's options (`AttentionOptions` runs them when built).

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
    _check_positive_fields(
        owner, settings, "num_heads qkv_features head_dim num_kv_heads v_head_dim out_features kv_latent_dim"
    )
    _check_heads(owner, settings.num_heads, settings.num_kv_heads)
    _check_dropout(owner, settings.dropout_rate)
    if settings.qkv_features is not None:
        resolve_head_dim(owner, settings.num_heads, settings.head_dim, settings.qkv_features, None)
    _check_qk_norm(owner, settings)
    _check_positions(owner, settings)
    _check_attention_fn(owner, settings)


def _check_qk_norm(owner: str, settings: AttentionOptions) -> None:
    """normalize_qk, qk_norm_width and qk_norm_epsilon: ValueError naming the field and its value."""
    kind = qk_norm_kind(owner, settings.normalize_qk)
    if settings.qk_norm_width not in QK_NORM_WIDTHS:
        raise ValueError(
            f"{owner}: qk_norm_width={settings.qk_norm_width!r} must be one of {', '.join(QK_NORM_WIDTHS)}"
        )
    epsilon = settings.qk_norm_epsilon
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0 < epsilon < math.inf:
        raise ValueError(f"{owner}: qk_norm_epsilon={epsilon!r} must be a finite number > 0")
    if kind and settings.kv_latent_dim is not None and settings.absorb_latent:
        raise ValueError(
            f"{owner}: normalize_qk={settings.normalize_qk!r} with kv_latent_dim={settings.kv_latent_dim} "
            "needs absorb_latent=False (a norm of the keys does not fold into the query)"
        )


def _check_attention_fn(owner: str, settings: AttentionOptions) -> None:
    """ValueError when `attention_fn` takes no argument the other options need."""
    latent = settings.kv_latent_dim is not None
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
    bias), "rms" an RMSNorm, "rms_offset" Gemma's RMSNorm (x_hat * (1 + scale)); None or one of
    `QK_NORMS`. ValueError naming the value otherwise."""
    if normalize_qk is None or normalize_qk is False:
        return None
    if normalize_qk is True:
        return "layernorm"
    if isinstance(normalize_qk, str) and normalize_qk in QK_NORMS:
        return normalize_qk
    raise ValueError(
        f"{owner}: normalize_qk={normalize_qk!r} must be False, True, 'layernorm', 'rms' or 'rms_offset'"
    )


def _check_positions(owner: str, settings: AttentionOptions) -> None:
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
    if settings.rope_scaling is not None and not isinstance(settings.rope_scaling, RopeScaling):
        raise ValueError(
            f"{owner}: rope_scaling={settings.rope_scaling!r} must be a qkv_jax.positions.RopeScaling "
            "(or None)"
        )
    check_soft_cap(owner, settings.attn_logits_soft_cap)
    check_jax_nn_path(
        owner, settings.attention_implementation, settings.attn_logits_soft_cap, settings.use_sinks
    )


def check_jax_nn_path(owner: str, implementation: Any, soft_cap: Any, sinks: Any) -> None:
    """ValueError naming `attention_implementation` unless it is None or one of `IMPLEMENTATIONS`,
    and when a path without them in `qkv_jax.attention.SUPPORTED` (jax.nn's "xla" and "cudnn") is
    asked for with a soft cap or sinks."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{owner}: attention_implementation={implementation!r}: unknown; choose one of "
            f"{', '.join(IMPLEMENTATIONS)} (or None: the dispatch rule)"
        )
    wanted = {"logits_soft_cap": soft_cap is not None, "sinks": bool(sinks)}
    if implementation is not None and any(
        given and feature not in SUPPORTED[implementation] for feature, given in wanted.items()
    ):
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


def normalize_heads(norm: Callable[[Array], Array] | None, x: Array, width: str) -> Array:
    """`norm` (query_ln or key_ln; None: none) of `x` `[..., T, heads, H]`: over each head's H
    (`width` "head"), or over all its heads * H features at once ("full")."""
    if norm is None:
        return x
    if width == "head":
        return norm(x)
    return norm(x.reshape(*x.shape[:-2], -1)).reshape(x.shape)  # (..., T, heads * H) -> (..., T, heads, H)


def project_inputs(
    layers: AttentionLayers, qk_norm_width: str, inputs_q: Array, inputs_k: Array, inputs_v: Array
) -> tuple[Array, dict[str, Array]]:
    """Query `[..., T, N, H]` and the per-position entries a decode cache keeps.

    Entries: `key` `[..., S, K, H]` and `value` `[..., S, K, Hv]` (after
    `key_ln`, over `qk_norm_width`), or with MLA (`layers.kv_latent`) the
    `latent` `[..., S, C]` that both are rebuilt from, which needs one input
    for keys and values.
    """
    query = normalize_heads(layers.query_ln, layers.query(inputs_q), qk_norm_width)  # (..., T, N, H)
    if layers.kv_latent is not None:
        if inputs_v is not inputs_k:
            raise ValueError(
                f"{OWNER}: with kv_latent_dim, keys and values are rebuilt from one latent; "
                "pass one input (inputs_k) for both"
            )
        return query, {"latent": layers.kv_latent(inputs_k)}  # (..., S, C)
    key = normalize_heads(layers.key_ln, layers.key(inputs_k), qk_norm_width)  # (..., S, K, H)
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
    settings: AttentionOptions,
    query: Array,
    entries: Mapping[str, Array],
    query_positions: Array,
    key_positions: Array,
) -> tuple[Array, dict[str, Array]]:
    """RoPE (`settings.rope_base`, scaled by `settings.rope_scaling`; None: none) on the query
    `[..., T, N, H]` and the key entry `[..., S, K, H]` by their positions (`input_positions`),
    after the projections and query_ln/key_ln and before the decode cache, which so holds
    rotated keys. The leading int(H * rope_fraction) dims of each head rotate (`qkv_jax.positions`)."""
    if settings.rope_base is None:
        return query, dict(entries)
    rotary_dims(query.shape[-1], settings.rope_fraction, owner)  # the error names the owner
    rope = functools.partial(
        apply_rope, base=settings.rope_base, fraction=settings.rope_fraction, scaling=settings.rope_scaling
    )
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
    settings: AttentionOptions,
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
    mask = and_masks(mask, keys.mask)
    needed = {
        "is_causal": keys.is_causal,
        "query_offset": keys.query_offset is not None and (keys.is_causal or keys.window is not None),
        "local_window_size": keys.window is not None,
        "query_segment_ids": keys.segment_ids is not None,
        "key_segment_ids": keys.segment_ids is not None,
    }
    if any(need and name not in accepted for name, need in needed.items()):
        mask = and_masks(mask, visible_keys(keys.replace(mask=None), query.shape[-3], key.shape[-3]))
        keys = KeyVisibility(False)
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
        **keys.keywords(),
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
    settings: AttentionOptions, grouped: Array, key_params: Mapping[str, Array], scale, scored: bool
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
        visible = and_masks(mask, visible_keys(keys, output.shape[-3], L), jnp.ones((1, 1, 1), jnp.bool_))
        assert visible is not None  # (..., N|1, T, L)
        has_key = jnp.swapaxes(jnp.any(visible, axis=-1), -1, -2)[..., None]  # (..., T, N|1, 1)
        has_key = has_key.reshape((1,) * (output.ndim - has_key.ndim) + has_key.shape)
        value_bias = jnp.where(has_key, value_bias, 0)  # (..., T, N, Hv)
    return output + value_bias


def _absorbed(
    settings: AttentionOptions,
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
    settings: AttentionOptions,
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
    sown: Any = None,
) -> Array:
    """`attend` (the attention on its own path), then the requested heads' patterns (`attend_heads`).
    With every head requested in order the explicit path gives the whole output, so the default
    `attention_fn` is not also run, unless it sows its weights into `sown` (a custom one always
    runs: it may do more than attend)."""
    heads = layers.request.pattern_heads
    every = heads == tuple(range(query.shape[-2]))
    replaced = every and settings.attention_fn is flax_dot_product_attention and sown is None
    output = None if replaced else attend(query, key, value, scale=scale, bias=bias)  # (..., T, N, Hv)
    allowed = and_masks(mask, visible_keys(keys, query.shape[-3], key.shape[-3]))
    output, _ = attend_heads(
        layers.hook,
        heads,
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
        dtype=jnp.result_type(query, key, value) if settings.dtype is None else settings.dtype,
    )
    return output


def _project_out(settings: AttentionOptions, layers: AttentionLayers, z: Array) -> Array:
    """W_O on the heads' outputs `[..., T, N, Hv]` -> `[..., T, D_out]`. With `request.head_results`
    per head first: hook_result `[..., T, N, D_out]` (the effective kernel, LoRA included, through a
    plain einsum), then their sum plus b_O."""
    if not layers.request.head_results:
        return layers.out(z)
    params = layers.params("out")
    kernel = effective_kernel(params, settings.lora_alpha)  # (N, Hv, D_out)
    z, kernel = nn.dtypes.promote_dtype(z, kernel, dtype=settings.dtype)
    # Heads leading, as the product leaves them: from einsum's "...tnv,nvd->...tnd" XLA:CPU wrote
    # (N, D, T) and copied it twice. At Qwen2.5-0.5B's shape and 512 tokens the product with its
    # copies takes 22 ms a layer against 39 ms, with bit-identical values.
    by_head = jnp.moveaxis(z, -2, 0)  # (N, ..., T, Hv)
    dims = (((by_head.ndim - 1,), (1,)), ((0,), (0,)))
    results = jnp.moveaxis(lax.dot_general(by_head, kernel, dims, precision=settings.precision), 0, -2)
    output = jnp.sum(layers.hook("hook_result", results), axis=-2)  # (..., T, D_out)
    if "bias" not in params:
        return output
    return output + params["bias"].astype(output.dtype).reshape((1,) * (output.ndim - 1) + (-1,))


def attend_entries(
    settings: AttentionOptions,
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
        _check_pattern_request(OWNER, heads, settings.num_heads, dropping)
        attend = functools.partial(_attend_requested, settings, layers, attend, mask, keys, sown=sow_module)
    if "latent" not in entries:
        output = attend(query, entries["key"], entries["value"], scale=settings.scale)  # (..., T, N, Hv)
    elif decoding and settings.absorb_latent:
        output = _absorbed(settings, layers, query, entries["latent"], mask, keys, attend)
    else:
        key = normalize_heads(layers.key_ln, layers.key(entries["latent"]), settings.qk_norm_width)
        key, value = layers.hook("hook_k", key), layers.hook("hook_v", layers.value(entries["latent"]))
        output = attend(query, key, value, scale=settings.scale)  # (..., T, N, Hv)
    if head_mask is not None:  # (batch..., N): one factor per head
        factors = jnp.asarray(head_mask, output.dtype)[..., None, :, None]  # (batch..., 1, N, 1)
        output = output * factors.reshape((1,) * (output.ndim - factors.ndim) + factors.shape)
    output = _project_out(settings, layers, layers.hook("hook_z", output))  # (..., T, D_out)
    return output if fits is None else jnp.where(fits, output, jnp.nan)


class DecodeCache(NamedTuple):
    """A face's decode cache as arrays: `cached` entries `[batch..., L, ...]` (`cached_<name>`),
    `cache_index` (positions filled) and `store(written, index)`, which writes the new
    ones into the face's variables."""

    cached: Mapping[str, Array]
    cache_index: Array
    store: Callable[[Mapping[str, Array], Array], None]


class AttentionFace(NamedTuple):
    """What a face (the linen or the nnx `MultiHeadAttention`) gives `multi_head_attention` for a call.

    options: its `AttentionOptions`.
    layers: the queries' input width -> the layer's learned pieces (`AttentionLayers`).
    widths: the input width each input's projection was built for, by input name
      (`inputs_q`, `inputs_k`, `inputs_v`; None: not built yet, as in linen's `init`).
    cache: (the new entries, their position axis) -> the decode cache, or None where this call
      creates it (linen's `init`), which is then an ordinary pass.
    decode, is_causal: this call's (the call's argument, else the face's field).
    deterministic: (the field, the call's, strict): `resolve_flag`'s arguments.
    dropout_rng: the dropout key, asked for only when the weights are dropped.
    sow_module: the module the attention weights are sown into, or None.
    """

    options: AttentionOptions
    layers: Callable[[int], AttentionLayers]
    widths: Mapping[str, int | None]
    cache: Callable[[Mapping[str, Array], int], DecodeCache | None]
    decode: bool
    is_causal: bool
    deterministic: tuple[bool | None, bool | None, bool]
    dropout_rng: Callable[[], Array]
    sow_module: Any


def resolve_flag(name: str, field: bool | None, call: bool | None, strict: bool = False) -> bool:
    """A face's `decode` or `deterministic`: the call's, else the field's; ValueError when neither
    is given, and with `strict` (flax.linen's `merge_param` rule for `deterministic`) when both are."""
    if field is None and call is None:
        raise ValueError(f'{OWNER}: Parameter "{name}" must be passed to the constructor or at call time.')
    if strict and field is not None and call is not None:
        raise ValueError(
            f'{OWNER}: Parameter "{name}" was passed to the constructor and at call time. Should be passed '
            "just once."
        )
    return bool(call if call is not None else field)


class InputWidthError(ValueError, flax.errors.ScopeParamShapeError):
    """An input of another width than its projection was built for. A ValueError naming both
    widths, and also flax's `ScopeParamShapeError`, which flax's linen modules raise for it, so a
    handler written for flax catches it."""

    def __init__(self, message: str):
        Exception.__init__(self, message)  # flax's own __init__ takes shapes and adds a link


def check_widths(widths: Mapping[str, int | None], inputs: Mapping[str, Array]) -> None:
    """ValueError naming the input, its width and the projection's, for an input of another width
    than its projection was built for (`AttentionFace.widths`)."""
    fields = {"inputs_q": "in_features", "inputs_k": "in_kv_features", "inputs_v": "in_kv_features"}
    for name, x in inputs.items():
        width = widths.get(name)
        if width is not None and x.shape[-1] != width:
            raise InputWidthError(
                f"{OWNER}: {name} has {x.shape[-1]} features (shape {tuple(x.shape)}), but its projection "
                f"was built for {fields[name]}={width}"
            )


def check_head_mask(head_mask: Any, num_heads: int, batch: tuple[int, ...]) -> None:
    """ValueError naming the shapes unless `head_mask` is `[batch..., num_heads]` (batch dims
    broadcasting to the inputs' `batch`)."""
    if head_mask is None:
        return
    shape = tuple(jnp.shape(head_mask))
    fits = len(shape) >= 1 and shape[-1] == num_heads and len(shape) - 1 <= len(batch)
    if fits:
        try:
            fits = np.broadcast_shapes(shape[:-1], batch) == batch
        except ValueError:
            fits = False
    if not fits:
        raise ValueError(
            f"{OWNER}: head_mask of shape {shape} must be [batch..., num_heads={num_heads}], one factor per "
            f"head, its batch dims broadcasting to the inputs' {batch}"
        )


def multi_head_attention(
    face: AttentionFace,
    inputs_q: Array,
    inputs_k: Array,
    inputs_v: Array,
    *,
    mask: Any,
    head_mask: Any,
    segment_ids: Any,
) -> Array:
    """Multi-head attention of `inputs_q` `[batch..., T, D]` over `inputs_k` / `inputs_v` `[batch...,
    S, D_kv]` (as `resolve_inputs` gives them), for either face: every check, then the projections,
    RoPE, the hook points, the decode cache, the attention and W_O. Returns `[batch..., T, D_out]`."""
    options, decode = face.options, face.decode
    inputs = {"inputs_q": inputs_q, "inputs_k": inputs_k, "inputs_v": inputs_v}
    for name, x in inputs.items():
        _check_inputs(OWNER, name, x)
    check_widths(face.widths, inputs)
    check_segment_ids(OWNER, segment_ids, decode)
    check_head_mask(head_mask, options.num_heads, inputs_q.shape[:-2])
    layers = face.layers(inputs_q.shape[-1])
    query, entries = project_inputs(layers, options.qk_norm_width, inputs_q, inputs_k, inputs_v)
    axis = inputs_k.ndim - 2
    cache = face.cache(entries, axis) if decode else None
    start = None if cache is None else cache.cache_index
    positions = input_positions(OWNER, query.shape[-3], inputs_k.shape[-2], start, segment_ids)
    query, entries = hook_projections(layers, *rotate_inputs(OWNER, options, query, entries, *positions))
    keys, fits = full_pass_keys(OWNER, options.local_window_size, face.is_causal, segment_ids), None
    if cache is not None:
        written, index, entries, keys, fits = cache_step(
            OWNER, options.local_window_size, cache.cached, cache.cache_index, entries, axis
        )
        cache.store(written, index)
    deterministic = options.dropout_rate == 0.0 or resolve_flag("deterministic", *face.deterministic)
    return attend_entries(
        options,
        layers,
        query,
        entries,
        mask=mask,
        head_mask=head_mask,
        keys=keys,
        decoding=cache is not None,
        fits=fits,
        deterministic=deterministic,
        dropout_rng=None if deterministic else face.dropout_rng(),
        sow_module=face.sow_module,
    )


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

    qkv_jax's own fields: every other `AttentionOptions` field, with its type
    and default; `AttentionOptions` gives each one's meaning.

    Every field except the initializers, `dot_general`s, `decode` and
    `deterministic` is an `AttentionOptions` field of the same name and default;
    `options()` gives this module's, and the core (`multi_head_attention`)
    reads nothing else.

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
    # generated:options - AttentionOptions' fields flax has not (python -m docs.generate faces)
    num_kv_heads: int | None = None
    head_dim: int | None = None
    v_head_dim: int | None = None
    kv_latent_dim: int | None = None
    absorb_latent: bool = True
    out_bias: bool | None = None
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("query", "value")
    qk_norm_width: str = "head"
    qk_norm_epsilon: float = 1e-06
    rope_base: float | None = None
    rope_fraction: float = 1.0
    rope_scaling: RopeScaling | None = None
    is_causal: bool = False
    local_window_size: int | tuple[int, int] | None = None
    attention_implementation: str | None = None
    scale: float | None = None
    attn_logits_soft_cap: float | None = None
    use_sinks: bool = False
    sow_weights: bool = False
    # end generated:options

    def __post_init__(self):
        self.options()  # the checks, at construction
        super().__post_init__()

    def options(self) -> AttentionOptions:
        """This module's `AttentionOptions` (its fields of that name), checked."""
        return AttentionOptions.pick({name: getattr(self, name) for name in OPTION_NAMES})

    def _projection(self, options: AttentionOptions, features: Any, name: str, axis: Any = -1):
        """The DenseGeneral projection `name`, with a LoRA adapter when `name` is a target."""
        is_out = name == "out"
        settings = dict(
            axis=axis,
            use_bias=options.bias_of_out if is_out else options.use_bias,
            kernel_init=(self.out_kernel_init or self.kernel_init) if is_out else self.kernel_init,
            bias_init=(self.out_bias_init or self.bias_init) if is_out else self.bias_init,
            dtype=options.dtype,
            param_dtype=options.param_dtype,
            precision=options.precision,
            dot_general=self.out_dot_general if is_out else self.qkv_dot_general,
            dot_general_cls=self.out_dot_general_cls if is_out else self.qkv_dot_general_cls,
            name=name,
        )
        if options.lora_rank and name in options.lora_targets:
            return LoRADenseGeneral(features, rank=options.lora_rank, alpha=options.lora_alpha, **settings)
        return nn.DenseGeneral(features, **settings)

    def _qk_norm(self, options: AttentionOptions, name: str) -> Callable[[Array], Array] | None:
        """query_ln or key_ln (normalize_qk; None without): flax's LayerNorm (no bias) or RMSNorm
        as flax builds them, or Gemma's offset RMSNorm (`qkv_jax.norms`)."""
        kind = options.qk_norm
        settings = dict(epsilon=options.qk_norm_epsilon, dtype=options.dtype, param_dtype=options.param_dtype)
        if kind == "layernorm":
            return nn.LayerNorm(use_bias=False, name=name, **settings)
        if kind == "rms":
            return nn.RMSNorm(name=name, **settings)
        if kind == "rms_offset":
            return Norm(kind=kind, name=name, **settings)
        return None

    def _layers(self, options: AttentionOptions, features: int) -> AttentionLayers:
        head_dim = resolve_head_dim(
            OWNER, options.num_heads, options.head_dim, options.qkv_features, features
        )
        num_kv_heads = options.num_kv_heads or options.num_heads
        projections = {
            "query": self._projection(options, (options.num_heads, head_dim), "query"),
            "key": self._projection(options, (num_kv_heads, head_dim), "key"),
            "value": self._projection(options, (num_kv_heads, options.v_head_dim or head_dim), "value"),
            "out": self._projection(options, options.out_features or features, "out", axis=(-2, -1)),
        }
        latent = options.kv_latent_dim is not None
        sinks = (options.num_heads,)  # (N,): one sink logit per query head
        return AttentionLayers(
            **projections,
            kv_latent=self._projection(options, options.kv_latent_dim, "kv_latent") if latent else None,
            query_ln=self._qk_norm(options, "query_ln"),
            key_ln=self._qk_norm(options, "key_ln"),
            sinks=self.param("sinks", nn.initializers.zeros_init(), sinks, options.param_dtype)
            if options.use_sinks
            else None,
            params=lambda name: projections[name].variables["params"],
            hook=functools.partial(_hook, self),
            request=self.interpretability_request(),
        )

    def _widths(self) -> dict[str, int | None]:
        """The input widths the projections' kernels were built for (None inside `init`)."""
        params = self.variables.get("params", {})

        def width(name: str) -> int | None:
            kernel = params.get(name, {}).get("kernel")
            return None if kernel is None else int(kernel.shape[0])

        key = "kv_latent" if self.kv_latent_dim is not None else "key"
        value = "kv_latent" if self.kv_latent_dim is not None else "value"
        return {"inputs_q": width("query"), "inputs_k": width(key), "inputs_v": width(value)}

    def _cache(self, entries: Mapping[str, Array], axis: int) -> DecodeCache | None:
        """The decode cache's variables, or None on the first call (inside `init`), which creates
        them: `cache_slots` positions of the entries' length."""
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
        if not initialized:
            return None

        def store(written: Mapping[str, Array], new_index: Array) -> None:
            for name, variable in cached.items():
                variable.value = written[name]
            index.value = new_index

        return DecodeCache({name: c.value for name, c in cached.items()}, index.value, store)

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
        options = self.options()
        inputs_k, inputs_v = resolve_inputs(OWNER, inputs_q, inputs_k, inputs_v, inputs_kv)
        face = AttentionFace(
            options,
            layers=functools.partial(self._layers, options),
            widths=self._widths(),
            cache=self._cache,
            decode=resolve_flag("decode", self.decode, decode),
            is_causal=options.is_causal,
            deterministic=(self.deterministic, deterministic, True),
            dropout_rng=lambda: self.make_rng("dropout") if dropout_rng is None else dropout_rng,
            sow_module=self if sow_weights or options.sow_weights else None,
        )
        return multi_head_attention(
            face, inputs_q, inputs_k, inputs_v, mask=mask, head_mask=head_mask, segment_ids=segment_ids
        )


class MultiHeadDotProductAttention(MultiHeadAttention):
    """`MultiHeadAttention` under flax's other name.

    flax.linen has both names (`MultiHeadAttention` subclasses
    `MultiHeadDotProductAttention`); an unnamed instance is named after its
    class (`MultiHeadDotProductAttention_0`), which sets its parameter path and
    its random streams. Replacing `flax.linen.MultiHeadDotProductAttention`
    by this class keeps both.
    """
