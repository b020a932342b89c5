"""The nnx face of qkv_jax's attention (the language model: `qkv_jax.nnx.lm`).

  MultiHeadAttention  drop-in for `flax.nnx.MultiHeadAttention` (constructor,
                      call, attribute names, `init_cache`) plus qkv_jax's
                      options; it makes its parameters and cache the nnx way
  LoRALinearGeneral   `flax.nnx.LinearGeneral` beside a LoRA adapter, with
                      `qkv_jax.lora.LoRADenseGeneral`'s parameter names
  HookPoint, LayerNorm  nnx forms of the linen hook point and LayerNorm
  flax_dot_product_attention  the default `attention_fn` (flax's signature,
                      `qkv_jax.dot_product_attention` underneath; the old name
                      `dot_product_attention` warns and still works).

Both faces call one core, `qkv_jax.modules.multi_head_attention`, with one
`AttentionOptions`: only where the parameters and the cache live differs.
Attribute names equal the linen parameter names, so
`nnx.to_pure_dict(nnx.state(model, nnx.Param))` is the
linen `params` tree.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypedDict, Unpack

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from qkv_jax.attention import PrecisionLike
from qkv_jax.heads import _check_positive
from qkv_jax.lora import check_adapter, default_lora_a_init, lora_update
from qkv_jax.modules import (
    OWNER,
    AttentionFace,
    AttentionLayers,
    AttentionOptions,
    AttentionRequest,
    DecodeCache,
    cache_slots,
    flax_dot_product_attention,
    layer_norm,
    multi_head_attention,
    resolve_flag,
    resolve_head_dim,
    resolve_inputs,
)
from qkv_jax.nnx.hooks import HookPoint
from qkv_jax.nnx.hooks import hooks_of as _hooks_of
from qkv_jax.nnx.norms import Norm
from qkv_jax.positions import RopeScaling

Array = jax.Array
Dtype = Any
Initializer = Any

__all__ = [
    "HookPoint",
    "LayerNorm",
    "MultiHeadAttention",
    "LoRALinearGeneral",
    "flax_dot_product_attention",
]

# Old names that still work, with a DeprecationWarning naming the new one (`__getattr__`).
RENAMED = {"dot_product_attention": "flax_dot_product_attention"}

_EMPTY: Mapping[str, Any] = MappingProxyType({})
# flax.nnx.MultiHeadAttention's initializers.
_KERNEL_INIT = nnx.initializers.lecun_normal()
_BIAS_INIT = nnx.initializers.zeros_init()


def __getattr__(name: str) -> Any:
    if name in RENAMED:
        warnings.warn(
            f"qkv_jax.nnx.{name} is renamed qkv_jax.nnx.{RENAMED[name]} (flax's attention_fn signature, "
            "not qkv_jax.dot_product_attention's); the old name will be removed",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


class OptionKeywords(TypedDict, total=False):
    """qkv_jax's own options as keywords of the nnx `MultiHeadAttention`: every `AttentionOptions`
    field that flax.nnx's constructor has not, with its type; its default and meaning are
    `AttentionOptions`'. Type checkers and editors see each one (PEP 692); a keyword not
    declared here or by flax is a TypeError, as for any Python function."""

    # generated:options - AttentionOptions' fields flax has not (python -m docs.generate faces)
    head_dim: int | None
    v_head_dim: int | None
    kv_latent_dim: int | None
    absorb_latent: bool
    out_bias: bool | None
    lora_rank: int
    lora_alpha: float
    lora_targets: tuple[str, ...]
    qk_norm_width: str
    qk_norm_epsilon: float
    rope_base: float | None
    rope_fraction: float
    rope_scaling: RopeScaling | None
    is_causal: bool
    local_window_size: int | tuple[int, int] | None
    attention_implementation: str | None
    scale: float | None
    attn_logits_soft_cap: float | None
    use_sinks: bool
    force_fp32_for_softmax: bool
    qk_attn_weights_einsum_cls: Any
    attn_weights_value_einsum_cls: Any
    sow_weights: bool
    # end generated:options


def _keywords(given: Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, Any]:
    """The constructor's arguments by name: flax's keywords (`given`, its locals) and qkv_jax's
    `options`, checked against `OptionKeywords`."""
    unknown = sorted(set(options) - set(OptionKeywords.__annotations__))
    if unknown:
        raise TypeError(f"MultiHeadAttention.__init__() got an unexpected keyword argument {unknown[0]!r}")
    return {**{name: value for name, value in given.items() if name != "options"}, **options}


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

    qkv_jax's keywords: every other `AttentionOptions` field, with its type and
    default (`AttentionOptions` gives each one's meaning; with kv_latent_dim the
    sub-module `kv_latent` `[D_kv, C]`, key/value `[C, K, H]`, and the cache holds
    `cached_latent` `[batch..., L, C]`; lora_targets' projections are
    `qkv_jax.lora.LoRALinearGeneral`; normalize_qk "rms" is `nnx.RMSNorm` and
    "rms_offset" `qkv_jax.nnx.norms.Norm`; use_sinks adds the `nnx.Param`
    `sinks` `[N]`, zero at init; a local_window_size narrower than the cache
    keeps a ring buffer of left + 1 slots). The
    options are one `AttentionOptions` (`options`, also each as an attribute
    of its name); the computation is the linen face's core,
    `qkv_jax.modules.multi_head_attention`.

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

    # The options (`AttentionOptions`, also as attributes of their names) and these, resolved as
    # flax.nnx keeps them.
    options: AttentionOptions
    in_features: int
    in_kv_features: int
    qkv_features: int
    out_features: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    deterministic: bool | None
    decode: bool | None

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
        **options: Unpack[OptionKeywords],
    ):
        arguments: Mapping[str, Any] = MappingProxyType(_keywords(locals(), options))
        self._settle(AttentionOptions.pick(arguments), in_features, in_kv_features)
        self.deterministic, self.decode = deterministic, decode
        self._build(arguments)

    def _settle(self, options: AttentionOptions, in_features: int, in_kv_features: int | None) -> None:
        """The options (checked when built), each also an attribute of its name, and the sizes
        resolved as flax.nnx keeps them (`qkv_features`, `out_features`, `num_kv_heads`, ...)."""
        _check_positive(OWNER, in_features=in_features, in_kv_features=in_kv_features)
        self.options = options
        for field in dataclasses.fields(options):
            setattr(self, field.name, getattr(options, field.name))
        self.in_features = in_features
        self.in_kv_features = in_kv_features or in_features
        self.head_dim = resolve_head_dim(
            OWNER, options.num_heads, options.head_dim, options.qkv_features, in_features
        )
        self.v_head_dim = options.v_head_dim or self.head_dim
        self.qkv_features = options.num_heads * self.head_dim
        self.out_features = options.out_features or in_features
        self.num_kv_heads = options.num_kv_heads or options.num_heads

    def _projection(
        self, given: Mapping[str, Any], name: str, features_in: Any, features_out: Any, **settings
    ):
        """The `nnx.LinearGeneral` projection `name` (W_O with the `out_*` keywords), with a LoRA
        adapter when `name` is one of `lora_targets`."""
        options, out = self.options, name == "out"
        settings |= dict(
            use_bias=options.bias_of_out if out else options.use_bias,
            dtype=options.dtype,
            param_dtype=options.param_dtype,
            kernel_init=(given["out_kernel_init"] or given["kernel_init"]) if out else given["kernel_init"],
            bias_init=(given["out_bias_init"] or given["bias_init"]) if out else given["bias_init"],
            precision=options.precision,
            promote_dtype=given["out_promote_dtype"] if out else given["qkv_promote_dtype"],
            dot_general=given["out_dot_general"] if out else given["qkv_dot_general"],
            dot_general_cls=given["out_dot_general_cls"] if out else given["qkv_dot_general_cls"],
            kernel_metadata=(given["out_kernel_metadata"] or given["kernel_metadata"])
            if out
            else given["kernel_metadata"],
            bias_metadata=(given["out_bias_metadata"] or given["bias_metadata"])
            if out
            else given["bias_metadata"],
            rngs=given["rngs"],
        )
        if options.lora_rank and name in options.lora_targets:
            rank, alpha = options.lora_rank, options.lora_alpha
            return LoRALinearGeneral(features_in, features_out, rank=rank, alpha=alpha, **settings)
        return nnx.LinearGeneral(features_in, features_out, **settings)

    def _qk_norm(self, given: Mapping[str, Any], heads: int, metadata: Mapping[str, Any]) -> Any:
        """query_ln or key_ln (normalize_qk) over H, or with qk_norm_width "full" over `heads` * H:
        flax.nnx's LayerNorm (no bias) or RMSNorm as flax builds them, or Gemma's offset RMSNorm
        (`qkv_jax.norms`)."""
        options = self.options
        features = self.head_dim * (heads if options.qk_norm_width == "full" else 1)
        settings = dict(epsilon=options.qk_norm_epsilon, dtype=options.dtype, param_dtype=options.param_dtype)
        if options.qk_norm == "rms_offset":
            return Norm(features, kind="rms_offset", rngs=given["rngs"], **settings)
        norm = nnx.RMSNorm if options.qk_norm == "rms" else functools.partial(nnx.LayerNorm, use_bias=False)
        return norm(
            features,
            promote_dtype=given["ln_promote_dtype"],
            scale_metadata=metadata,
            rngs=given["rngs"],
            **settings,
        )

    def _build(self, given: Mapping[str, Any]) -> None:
        """The sub-modules, drawn from `given["rngs"]` in flax.nnx's order (query, key, value,
        query_ln, key_ln, out; MLA's kv_latent after the query), the kept dropout stream, and the
        empty cache slots."""
        options = self.options
        heads, kv_heads, key_in = (options.num_heads, self.head_dim), self.num_kv_heads, self.in_kv_features
        self.query = self._projection(given, "query", self.in_features, heads)
        self.kv_latent: nnx.LinearGeneral | None = nnx.data(None)
        if options.kv_latent_dim is not None:
            self.kv_latent = self._projection(given, "kv_latent", key_in, options.kv_latent_dim)
            key_in = options.kv_latent_dim
        self.key = self._projection(given, "key", key_in, (kv_heads, self.head_dim))
        self.value = self._projection(given, "value", key_in, (kv_heads, self.v_head_dim))
        self.query_ln: nnx.Module | None = nnx.data(None)
        self.key_ln: nnx.Module | None = nnx.data(None)
        if options.qk_norm:
            self.query_ln = self._qk_norm(given, options.num_heads, given["query_ln_scale_metadata"])
            self.key_ln = self._qk_norm(given, kv_heads, given["key_ln_scale_metadata"])
        self.out = self._projection(
            given, "out", (options.num_heads, self.v_head_dim), self.out_features, axis=(-2, -1)
        )
        self.sinks: nnx.Param | None = nnx.data(None)
        if options.use_sinks:  # (N,): one sink logit per query head
            self.sinks = nnx.Param(jnp.zeros((options.num_heads,), options.param_dtype))
        dropping = given["keep_rngs"] and options.dropout_rate > 0
        self.rngs = given["rngs"].dropout.fork() if dropping else None
        latent = ("hook_kv_latent",) if options.kv_latent_dim is not None else ()
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
        return ("latent",) if self.options.kv_latent_dim is not None else ("key", "value")

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
        slots = cache_slots(self.options.local_window_size, input_shape[-2])
        positions = (*input_shape[:-2], slots)  # (batch..., max_length or the ring's slots)
        widths = {
            "key": (self.num_kv_heads, self.head_dim),
            "value": (self.num_kv_heads, self.v_head_dim),
            "latent": (self.options.kv_latent_dim,),
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
                    f"{OWNER}.set_view: a decode view creates the cache and needs batch_size and "
                    f"max_length, got batch_size={batch_size!r}, max_length={max_length!r}"
                )
            batch = (batch_size,) if isinstance(batch_size, int) else tuple(batch_size)
            self.init_cache((*batch, max_length, self.in_features), self.options.dtype or jnp.float32)

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
        options = self.options
        inputs_k, inputs_v = resolve_inputs(OWNER, inputs_q, inputs_k, inputs_v, None, warn_square=False)
        kv_width = self.in_kv_features
        face = AttentionFace(
            options,
            layers=lambda features: self._layers(qkv_sharding, out_sharding),
            widths={"inputs_q": self.in_features, "inputs_k": kv_width, "inputs_v": kv_width},
            cache=self._cache,
            decode=resolve_flag("decode", self.decode, decode),
            is_causal=options.is_causal if is_causal is None else is_causal,
            deterministic=(self.deterministic, deterministic, False),
            dropout_rng=functools.partial(self._dropout_rng, rngs),
            sow_module=self if sow_weights or options.sow_weights else None,
        )
        return multi_head_attention(
            face, inputs_q, inputs_k, inputs_v, mask=mask, head_mask=head_mask, segment_ids=segment_ids
        )

    def _cache(self, entries: Mapping[str, Array], axis: int) -> DecodeCache:
        """The decode cache's arrays (`init_cache` made them) and how to write them back."""
        if self.cache_index is None:
            raise ValueError(f"{OWNER}: the decode cache is not initialized; call init_cache first")
        cached = {name: getattr(self, f"cached_{name}")[...] for name in entries}
        return DecodeCache(cached, self.cache_index[...], self._store)

    def _store(self, written: Mapping[str, Array], index: Array) -> None:
        for name, value in written.items():
            getattr(self, f"cached_{name}")[...] = value
        assert self.cache_index is not None
        self.cache_index[...] = index

    def _dropout_rng(self, rngs: nnx.Rngs | nnx.RngStream | None) -> Array:
        """flax.nnx's rule: the dropout key from the call's `rngs`, else the kept stream."""
        stream = self.rngs if rngs is None else rngs
        if stream is None:
            raise ValueError(
                f"{OWNER}: dropout needs rngs= in the call when the module keeps none (keep_rngs=False)"
            )
        return (stream.dropout if isinstance(stream, nnx.Rngs) else stream)()
