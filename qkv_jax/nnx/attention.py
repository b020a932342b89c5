"""qkv_jax's attention as native `flax.nnx` modules (the language model: `qkv_jax.nnx.lm`).

  HookPoint, LayerNorm  the linen `qkv_jax.modules` hook point and LayerNorm with
                      hook points, as nnx modules (`qkv_jax.interpretability`).
  LoRALinearGeneral   `flax.nnx.LinearGeneral` with a LoRA adapter (the linen
                      `qkv_jax.lora.LoRADenseGeneral`'s parameters).
  MultiHeadAttention  a drop-in for `flax.nnx.MultiHeadAttention` (its
                      constructor, call, attribute names, `init_cache`), with
                      qkv_jax's extras: MLA latents, head_dim/v_head_dim,
                      is_causal, scale, the attention implementation, LoRA.
  dot_product_attention  the default `attention_fn` (flax's signature,
                      `qkv_jax.dot_product_attention` underneath).

Both module families run the same pure functions of `qkv_jax.modules`
(`project_inputs`, `append_to_cache`, `attend_entries`): only where the
parameters and the cache live differs. Attribute names equal the linen
parameter names, so `nnx.to_pure_dict(nnx.state(model, nnx.Param))` is the
linen `params` tree.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.module import first_from
from flax.nnx.nn import dtypes as nnx_dtypes

from qkv_jax.attention import PrecisionLike
from qkv_jax.lora import check_adapter, default_lora_a_init, lora_update
from qkv_jax.modules import (
    AttentionLayers,
    AttentionRequest,
    KeyVisibility,
    _check_inputs,
    _check_positive,
    attend_entries,
    cache_slots,
    cache_step,
    check_attention_settings,
    check_segment_ids,
    flax_dot_product_attention,
    full_pass_keys,
    hook_projections,
    input_positions,
    layer_norm,
    project_inputs,
    qk_norm_kind,
    resolve_head_dim,
    resolve_inputs,
    rotate_inputs,
)

Array = jax.Array
Dtype = Any
Initializer = Any

__all__ = [
    "HookPoint",
    "LayerNorm",
    "MultiHeadAttention",
    "LoRALinearGeneral",
    "dot_product_attention",
]

dot_product_attention = flax_dot_product_attention

_OWNER = "qkv_jax.nnx.MultiHeadAttention"
_EMPTY: Mapping[str, Any] = MappingProxyType({})
# MultiHeadAttention's settings checked as given (by `check_attention_settings`), then the others.
_CHECKED_FIELDS = (
    "num_heads",
    "qkv_features",
    "head_dim",
    "num_kv_heads",
    "v_head_dim",
    "out_features",
    "kv_latent_dim",
    "dropout_rate",
    "normalize_qk",
    "absorb_latent",
    "attention_fn",
    "scale",
    "attention_implementation",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "local_window_size",
    "rope_base",
    "rope_fraction",
    "attn_logits_soft_cap",
    "use_sinks",
)
_PLAIN_FIELDS = (
    "in_features",
    "dtype",
    "param_dtype",
    "broadcast_dropout",
    "deterministic",
    "precision",
    "use_bias",
    "decode",
    "is_causal",
    "force_fp32_for_softmax",
    "sow_weights",
)
# flax.nnx.MultiHeadAttention's initializers.
_KERNEL_INIT = nnx.initializers.lecun_normal()
_BIAS_INIT = nnx.initializers.zeros_init()


class HookPoint(nnx.Module):
    """`qkv_jax.modules.HookPoint` as an nnx module: `__call__(x) -> x`, no parameters.

    Two static attributes, set by `qkv_jax.interpretability` around a run and
    reset after it: `hook` (None, or `x -> x'`, which the point then returns)
    and `capture` (sow the value it returns as `nnx.Intermediate`
    "activation", which `nnx.capture` collects). Both off, it is the identity.
    """

    def __init__(self):
        self.hook: Callable[[Array], Array] | None = None
        self.capture = False

    def __call__(self, x: Array) -> Array:
        if self.hook is not None:
            x = self.hook(x)
        if self.capture:
            self.sow(nnx.Intermediate, "activation", x)
        return x


def _hooks_of(module: nnx.Module) -> Callable[[str, Array], Array]:
    """`(name, x) -> x` through `module`'s HookPoint attribute `name`."""
    return lambda name, x: getattr(module, name)(x)


class LayerNorm(nnx.LayerNorm):
    """`flax.nnx.LayerNorm` over the last axis with `hook_scale` and `hook_normalized` (`HookPoint`s).

    The same constructor and parameters (`scale`, `bias` `[D]`), computed by
    `qkv_jax.modules.layer_norm` as the linen `qkv_jax.modules.LayerNorm`.
    """

    def __init__(self, num_features: int, *, rngs: nnx.Rngs, **options: Any):
        super().__init__(num_features, rngs=rngs, **options)
        self.hook_scale = HookPoint()
        self.hook_normalized = HookPoint()

    def __call__(self, x: Array, *, mask: Array | None = None) -> Array:
        if mask is not None:
            raise ValueError("qkv_jax.nnx.LayerNorm: mask is not supported")
        assert self.scale is not None and self.bias is not None  # built with both (the defaults)
        return layer_norm(x, self.scale[...], self.bias[...], self.epsilon, self.dtype, _hooks_of(self))


class LoRALinearGeneral(nnx.LinearGeneral):
    """`flax.nnx.LinearGeneral` with a trainable low-rank update beside its kernel.

    `LoRALinearGeneral(in_features, out_features, *, rank, alpha, lora_a_init=None,
    rngs, **LinearGeneral's options)` (no `batch_axis`): parameters `kernel` and
    `bias` (drawn first, as LinearGeneral draws them), `lora_a` `[in..., r]`
    and `lora_b` `[r, out...]` (zero), the same names and shapes as
    `qkv_jax.lora.LoRADenseGeneral`'s. Output = LinearGeneral(x) + (alpha / r) (x A) B.
    """

    def __init__(
        self,
        in_features: Any,
        out_features: Any,
        *,
        rank: int,
        alpha: float,
        lora_a_init: Initializer | None = None,
        rngs: nnx.Rngs,
        **options: Any,
    ):
        check_adapter("LoRALinearGeneral", rank, alpha)
        if options.get("batch_axis"):
            raise ValueError(f"LoRALinearGeneral: batch_axis={options['batch_axis']!r} is not supported")
        super().__init__(in_features, out_features, rngs=rngs, **options)
        self.alpha = alpha
        init = lora_a_init or default_lora_a_init(len(self.in_features))
        self.lora_a = nnx.Param(init(rngs.params(), (*self.in_features, rank), self.param_dtype))
        self.lora_b = nnx.Param(jnp.zeros((rank, *self.out_features), self.param_dtype))

    def __call__(self, inputs: Array, out_sharding: Any = None) -> Array:
        output = super().__call__(inputs, out_sharding=out_sharding)  # (..., out...)
        axis = tuple(sorted(a % inputs.ndim for a in self.axis))
        update = lora_update(
            inputs, self.lora_a[...], self.lora_b[...], axis, self.alpha, self.dtype, self.precision
        )
        return output + update.astype(output.dtype)  # (..., out...)


class MultiHeadAttention(nnx.Module):
    """Multi-head attention; a drop-in for `flax.nnx.MultiHeadAttention`.

    flax.nnx's constructor `(num_heads, in_features, qkv_features=None,
    out_features=None, num_kv_heads=None, in_kv_features=None, *, dtype,
    param_dtype, broadcast_dropout, dropout_rate, deterministic, precision,
    kernel_init, out_kernel_init, bias_init, out_bias_init, use_bias,
    attention_fn, decode, normalize_qk, qkv_promote_dtype, out_promote_dtype,
    ln_promote_dtype, qkv_dot_general(_cls), out_dot_general(_cls), rngs,
    keep_rngs, the *_metadata mappings)`, with flax's meaning and defaults:
    sub-modules `query` `[D, N, H]`, `key`/`value` `[D_kv, K, H]`, `out` `[N,
    Hv, D_out]` (`nnx.LinearGeneral`, drawn from `rngs` in flax's order, so the
    same `rngs` give the same parameters), `query_ln`/`key_ln` with
    normalize_qk, `rngs` (a forked dropout stream, with dropout and
    keep_rngs), and the decode cache `cached_key`, `cached_value`,
    `cache_index` (`nnx.Cache`, created by `init_cache`).

    qkv_jax's keywords (see the linen `qkv_jax.MultiHeadAttention`): head_dim,
    v_head_dim, kv_latent_dim (MLA: `kv_latent` `[D_kv, C]`, key/value
    `[C, K, H]`, the cache holds `cached_latent` `[batch..., L, C]`),
    absorb_latent, is_causal (key s visible to query t when s <= t), scale,
    force_fp32_for_softmax, sow_weights, attention_implementation, lora_rank,
    lora_alpha, lora_targets (`qkv_jax.lora.LoRALinearGeneral` projections),
    normalize_qk also "layernorm" or "rms" (`nnx.RMSNorm`), local_window_size
    (a ring-buffer cache of left + 1 slots when narrower than the cache),
    rope_base and rope_fraction (RoPE), attn_logits_soft_cap, use_sinks
    (`sinks` `[N]`, an `nnx.Param`, zero at init).

    `__call__(inputs_q, inputs_k=None, inputs_v=None, *, mask=None,
    deterministic=None, rngs=None, sow_weights=False, decode=None,
    is_causal=None, out_sharding=None, qkv_sharding=None, head_mask=None,
    segment_ids=None)`:
    inputs `[batch..., T, in_features]` and `[batch..., S, in_kv_features]`,
    returns `[batch..., T, out_features]`. Call arguments take precedence over
    the constructor's. Sown weights `[batch..., N, T, S]` go to
    `nnx.Intermediate` `attention_weights` (`nnx.capture`, `nnx.pop`).
    Decoding appends T >= 1 positions per call; each query sees the cached
    positions up to its own.
    """

    # Set by `_settle` from the constructor's arguments (see `_CHECKED_FIELDS`, `_PLAIN_FIELDS`).
    num_heads: int
    in_features: int
    qkv_features: int
    out_features: int
    in_kv_features: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    kv_latent_dim: int | None
    dtype: Dtype | None
    param_dtype: Dtype
    broadcast_dropout: bool
    dropout_rate: float
    deterministic: bool | None
    precision: PrecisionLike
    use_bias: bool
    attention_fn: Callable[..., Array]
    decode: bool | None
    normalize_qk: bool | str
    absorb_latent: bool
    is_causal: bool
    scale: float | None
    force_fp32_for_softmax: bool
    sow_weights: bool
    attention_implementation: str | None
    lora_rank: int
    lora_alpha: float
    lora_targets: tuple[str, ...]
    local_window_size: int | tuple[int, int] | None
    rope_base: float | None
    rope_fraction: float
    attn_logits_soft_cap: float | None
    use_sinks: bool

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        *,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        broadcast_dropout: bool = True,
        dropout_rate: float = 0.0,
        deterministic: bool | None = None,
        precision: PrecisionLike = None,
        kernel_init: Initializer = _KERNEL_INIT,
        out_kernel_init: Initializer | None = None,
        bias_init: Initializer = _BIAS_INIT,
        out_bias_init: Initializer | None = None,
        use_bias: bool = True,
        attention_fn: Callable[..., Array] = flax_dot_product_attention,
        decode: bool | None = None,
        normalize_qk: bool | str = False,
        qkv_promote_dtype: Any = nnx_dtypes.promote_dtype,
        out_promote_dtype: Any = nnx_dtypes.promote_dtype,
        ln_promote_dtype: Any = nnx_dtypes.promote_dtype,
        qkv_dot_general: Any = None,
        out_dot_general: Any = None,
        qkv_dot_general_cls: Any = None,
        out_dot_general_cls: Any = None,
        rngs: nnx.Rngs,
        keep_rngs: bool = True,
        kernel_metadata: Mapping[str, Any] = _EMPTY,
        out_kernel_metadata: Mapping[str, Any] = _EMPTY,
        bias_metadata: Mapping[str, Any] = _EMPTY,
        out_bias_metadata: Mapping[str, Any] = _EMPTY,
        query_ln_scale_metadata: Mapping[str, Any] = _EMPTY,
        key_ln_scale_metadata: Mapping[str, Any] = _EMPTY,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
        kv_latent_dim: int | None = None,
        absorb_latent: bool = True,
        is_causal: bool = False,
        scale: float | None = None,
        force_fp32_for_softmax: bool = False,
        sow_weights: bool = False,
        attention_implementation: str | None = None,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_targets: tuple[str, ...] = ("query", "value"),
        local_window_size: int | tuple[int, int] | None = None,
        rope_base: float | None = None,
        rope_fraction: float = 1.0,
        attn_logits_soft_cap: float | None = None,
        use_sinks: bool = False,
    ):
        given = types.SimpleNamespace(**{name: value for name, value in locals().items() if name != "self"})
        self._settle(given)
        self._build(given)

    def _settle(self, given: types.SimpleNamespace) -> None:
        """The settings: checked as given (by the linen module's checks), then resolved as
        flax.nnx keeps them (`qkv_features`, `out_features`, `num_kv_heads` filled in)."""
        for name in _CHECKED_FIELDS:
            setattr(self, name, getattr(given, name))
        self.qk_attn_weights_einsum_cls = self.attn_weights_value_einsum_cls = None
        check_attention_settings(_OWNER, self)
        _check_positive(_OWNER, in_features=given.in_features, in_kv_features=given.in_kv_features)
        for name in _PLAIN_FIELDS:
            setattr(self, name, getattr(given, name))
        self.in_kv_features = given.in_kv_features or given.in_features
        self.head_dim = resolve_head_dim(
            _OWNER, given.num_heads, given.head_dim, given.qkv_features, given.in_features
        )
        self.v_head_dim = given.v_head_dim or self.head_dim
        self.qkv_features = given.num_heads * self.head_dim
        self.out_features = given.out_features or given.in_features
        self.num_kv_heads = given.num_kv_heads or given.num_heads

    def _projection(
        self, given: types.SimpleNamespace, name: str, features_in: Any, features_out: Any, **options
    ):
        """The `nnx.LinearGeneral` projection `name` (W_O with `out_*` options), with a LoRA
        adapter when `name` is one of `lora_targets`."""
        out = name == "out"
        options |= dict(
            use_bias=given.use_bias,
            dtype=given.dtype,
            param_dtype=given.param_dtype,
            kernel_init=(given.out_kernel_init or given.kernel_init) if out else given.kernel_init,
            bias_init=(given.out_bias_init or given.bias_init) if out else given.bias_init,
            precision=given.precision,
            promote_dtype=given.out_promote_dtype if out else given.qkv_promote_dtype,
            dot_general=given.out_dot_general if out else given.qkv_dot_general,
            dot_general_cls=given.out_dot_general_cls if out else given.qkv_dot_general_cls,
            kernel_metadata=(given.out_kernel_metadata or given.kernel_metadata)
            if out
            else given.kernel_metadata,
            bias_metadata=(given.out_bias_metadata or given.bias_metadata) if out else given.bias_metadata,
            rngs=given.rngs,
        )
        if given.lora_rank and name in given.lora_targets:
            adapter = dict(rank=given.lora_rank, alpha=given.lora_alpha)
            return LoRALinearGeneral(features_in, features_out, **adapter, **options)
        return nnx.LinearGeneral(features_in, features_out, **options)

    def _build(self, given: types.SimpleNamespace) -> None:
        """The sub-modules, drawn from `given.rngs` in flax.nnx's order (query, key, value,
        query_ln, key_ln, out; MLA's kv_latent after the query), the kept dropout stream, and the
        empty cache slots."""
        heads, kv_heads, key_in = (self.num_heads, self.head_dim), self.num_kv_heads, self.in_kv_features
        self.query = self._projection(given, "query", self.in_features, heads)
        self.kv_latent: nnx.LinearGeneral | None = nnx.data(None)
        if self.kv_latent_dim is not None:
            self.kv_latent = self._projection(given, "kv_latent", key_in, self.kv_latent_dim)
            key_in = self.kv_latent_dim
        self.key = self._projection(given, "key", key_in, (kv_heads, self.head_dim))
        self.value = self._projection(given, "value", key_in, (kv_heads, self.v_head_dim))
        self.query_ln: nnx.LayerNorm | nnx.RMSNorm | None = nnx.data(None)
        self.key_ln: nnx.LayerNorm | nnx.RMSNorm | None = nnx.data(None)
        kind = qk_norm_kind(_OWNER, self.normalize_qk)
        if kind:
            norm = functools.partial(
                nnx.RMSNorm if kind == "rms" else functools.partial(nnx.LayerNorm, use_bias=False),
                self.head_dim,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                promote_dtype=given.ln_promote_dtype,
                rngs=given.rngs,
            )
            self.query_ln = norm(scale_metadata=given.query_ln_scale_metadata)
            self.key_ln = norm(scale_metadata=given.key_ln_scale_metadata)
        self.out = self._projection(
            given, "out", (self.num_heads, self.v_head_dim), self.out_features, axis=(-2, -1)
        )
        self.sinks: nnx.Param | None = nnx.data(None)
        if self.use_sinks:  # (N,): one sink logit per query head
            self.sinks = nnx.Param(jnp.zeros((self.num_heads,), self.param_dtype))
        self.rngs = given.rngs.dropout.fork() if given.keep_rngs and self.dropout_rate > 0 else None
        latent = ("hook_kv_latent",) if self.kv_latent_dim is not None else ()
        for name in (
            "hook_q",
            "hook_k",
            "hook_v",
            *latent,
            "hook_attn_scores",
            "hook_pattern",
            "hook_z",
            "hook_result",
        ):
            setattr(self, name, HookPoint())
        self.request = AttentionRequest()  # static: set by qkv_jax.interpretability around a run
        for name in self._cache_names():
            setattr(self, f"cached_{name}", nnx.data(None))
        self.cache_index: nnx.Cache | None = nnx.data(None)

    def _cache_names(self) -> tuple[str, ...]:
        return ("latent",) if self.kv_latent_dim is not None else ("key", "value")

    def _layers(self, qkv_sharding: Any, out_sharding: Any) -> AttentionLayers:
        def sharded(layer: nnx.LinearGeneral, sharding: Any) -> Callable[[Array], Array]:
            return functools.partial(layer, out_sharding=sharding)

        return AttentionLayers(
            query=sharded(self.query, qkv_sharding),
            key=sharded(self.key, qkv_sharding),
            value=sharded(self.value, qkv_sharding),
            out=sharded(self.out, out_sharding),
            kv_latent=None if self.kv_latent is None else sharded(self.kv_latent, qkv_sharding),
            query_ln=self.query_ln,
            key_ln=self.key_ln,
            sinks=None if self.sinks is None else self.sinks[...],
            params=lambda name: nnx.to_pure_dict(nnx.state(getattr(self, name), nnx.Param)),
            hook=_hooks_of(self),
            request=self.request,
        )

    def init_cache(self, input_shape: tuple[int, ...], dtype: Dtype = jnp.float32) -> None:
        """Zeroed decode cache for inputs of shape `[batch..., max_length, features]`, as flax.nnx's.

        `cached_key` `[batch..., max_length, K, H]` and `cached_value` `[...,
        K, Hv]` (with MLA `cached_latent` `[batch..., max_length, C]`) in
        `dtype`, and `cache_index` 0. With a window narrower than max_length,
        `cache_slots` positions (a ring buffer) instead of max_length.
        """
        slots = cache_slots(self.local_window_size, input_shape[-2])
        positions = (*input_shape[:-2], slots)  # (batch..., max_length or the ring's slots)
        widths = {
            "key": (self.num_kv_heads, self.head_dim),
            "value": (self.num_kv_heads, self.v_head_dim),
            "latent": (self.kv_latent_dim,),
        }
        for name in self._cache_names():
            setattr(self, f"cached_{name}", nnx.Cache(jnp.zeros((*positions, *widths[name]), dtype)))
        self.cache_index = nnx.Cache(jnp.array(0, dtype=jnp.int32))

    def set_view(
        self,
        deterministic: bool | None = None,
        decode: bool | None = None,
        batch_size: int | tuple[int, ...] | None = None,
        max_length: int | None = None,
    ) -> None:
        """`nnx.view`'s hook: set `deterministic`/`decode`; a first decode view creates the cache
        for `batch_size` (int or batch shape) and `max_length` positions."""
        if deterministic is not None:
            self.deterministic = deterministic
        if decode is None:
            return
        self.decode = decode
        if decode and self.cache_index is None:
            if batch_size is None or max_length is None:
                raise TypeError(
                    "qkv_jax.nnx.MultiHeadAttention.set_view: a decode view creates the cache and needs "
                    f"batch_size and max_length, got batch_size={batch_size!r}, max_length={max_length!r}"
                )
            batch = (batch_size,) if isinstance(batch_size, int) else tuple(batch_size)
            self.init_cache((*batch, max_length, self.in_features), self.dtype or jnp.float32)

    def __call__(
        self,
        inputs_q: Array,
        inputs_k: Array | None = None,
        inputs_v: Array | None = None,
        *,
        mask: Array | None = None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | None = None,
        sow_weights: bool = False,
        decode: bool | None = None,
        is_causal: bool | None = None,
        out_sharding: Any = None,
        qkv_sharding: Any = None,
        head_mask: Array | None = None,
        segment_ids: Array | None = None,
    ) -> Array:
        inputs_k, inputs_v = resolve_inputs(_OWNER, inputs_q, inputs_k, inputs_v, None, warn_square=False)
        _check_inputs(_OWNER, "inputs_q", inputs_q)
        if inputs_q.shape[-1] != self.in_features:
            raise ValueError(
                f"{_OWNER}: inputs_q has {inputs_q.shape[-1]} features (shape {inputs_q.shape}), "
                f"in_features={self.in_features}"
            )
        decoding = first_from(
            decode, self.decode, error_msg=f"{_OWNER}: pass decode to the constructor or the call"
        )
        check_segment_ids(_OWNER, segment_ids, decoding)
        if decoding and self.cache_index is None:
            raise ValueError(f"{_OWNER}: the decode cache is not initialized; call init_cache first")
        layers = self._layers(qkv_sharding, out_sharding)
        query, entries = project_inputs(layers, inputs_q, inputs_k, inputs_v)
        start = self.cache_index[...] if decoding and self.cache_index is not None else None
        positions = input_positions(_OWNER, query.shape[-3], inputs_k.shape[-2], start, segment_ids)
        query, entries = hook_projections(layers, *rotate_inputs(_OWNER, self, query, entries, *positions))
        is_causal = self.is_causal if is_causal is None else is_causal
        keys, fits = full_pass_keys(_OWNER, self.local_window_size, is_causal, segment_ids), None
        if decoding:
            entries, keys, fits = self._append(entries, axis=inputs_k.ndim - 2)
        deterministic, dropout_rng = self._dropout(deterministic, rngs)
        return attend_entries(
            self,
            layers,
            query,
            entries,
            mask=mask,
            head_mask=head_mask,
            keys=keys,
            decoding=decoding,
            fits=fits,
            deterministic=deterministic,
            dropout_rng=dropout_rng,
            sow_module=self if sow_weights or self.sow_weights else None,
        )

    def _append(self, entries: dict[str, Array], axis: int) -> tuple[dict[str, Array], KeyVisibility, Any]:
        """`cache_step` on the cache variables, which it updates: (the entries to attend over,
        which of them each query sees, whether the positions fit)."""
        cached = {name: getattr(self, f"cached_{name}")[...] for name in entries}
        assert self.cache_index is not None
        written, self.cache_index[...], attended, keys, fits = cache_step(
            _OWNER, self.local_window_size, cached, self.cache_index[...], entries, axis
        )
        for name, value in written.items():
            getattr(self, f"cached_{name}")[...] = value
        return attended, keys, fits

    def _dropout(self, deterministic: bool | None, rngs: Any) -> tuple[bool, Array | None]:
        """flax.nnx's rule: `deterministic` (the call's, else the constructor's) is needed only with
        dropout; the key comes from the call's `rngs`, else the kept stream."""
        if self.dropout_rate == 0.0:
            return True, None
        deterministic = first_from(
            deterministic,
            self.deterministic,
            error_msg=f"{_OWNER}: pass deterministic to the constructor or the call",
        )
        if deterministic:
            return True, None
        stream = self.rngs if rngs is None else rngs
        if stream is None:
            raise ValueError(
                f"{_OWNER}: dropout needs rngs= in the call when the module keeps none (keep_rngs=False)"
            )
        return False, (stream.dropout if isinstance(stream, nnx.Rngs) else stream)()
