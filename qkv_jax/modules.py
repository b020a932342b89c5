"""Flax linen attention modules, from parameter-free to multi-head.

Every module works on an unbatched `[S, D]` input and on any leading batch
dims `[batch..., S, D]`; `jax.vmap` of `apply` over a batch equals the batched
`apply`. All of them compute attention with `qkv_jax.dot_product_attention`.

  StaticAttention        Q = K = V = X, nothing to learn (identity W).
  SelfAttentionV1        raw `W_query`, `W_key`, `W_value` matrices [d_in, d_out].
  SelfAttention          the same through `nn.Dense` layers (seed 002's v2).
  LearnedQueryAttention  one learned query vector reads a sequence (seed 000).
  MultiHeadAttention     N heads, grouped K/V heads, output projection W_O,
                         optional latent K/V (MLA) and a KV cache for decoding.

Each takes `precision` (flax's spelling: None for JAX's default, 'highest',
a `jax.lax.Precision`, a pair, ...), passed to every projection and to every
dot of the attention itself, forward and backward.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import checkify

from qkv_jax.attention import PrecisionLike, combine_masks, dot_product_attention
from qkv_jax.lora import LoRADenseGeneral, effective_kernel

Array = jax.Array
Dtype = Any
Initializer = Any

__all__ = [
    "StaticAttention",
    "SelfAttentionV1",
    "SelfAttention",
    "LearnedQueryAttention",
    "MultiHeadAttention",
    "ATTENTION_LORA_TARGETS",
    "decode_positions",
    "torch_linear_init",
]

# MultiHeadAttention's projections a LoRA adapter can sit beside (kv_latent: MLA's down-projection).
ATTENTION_LORA_TARGETS = ("query", "key", "value", "out", "kv_latent")

# torch.nn.Linear's default: uniform in +-1/sqrt(fan_in). The seeds' modules are
# written in PyTorch, so their learned projections start from this.
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
            raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")


def _check_dropout(owner: str, rate: float) -> None:
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{owner}: dropout_rate must be in [0, 1), got {rate!r}")


def _check_lora(owner: str, rank: Any, alpha: Any, targets: Any, allowed: tuple[str, ...]) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"{owner}: lora_rank must be an int >= 0, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"{owner}: lora_alpha must be a number > 0, got {alpha!r}")
    if isinstance(targets, str) or any(t not in allowed for t in targets):
        raise ValueError(f"{owner}: lora_targets must be a tuple of {allowed}, got {targets!r}")


def _check_inputs(owner: str, name: str, x: Array, min_rank: int = 2) -> None:
    if x.ndim < min_rank:
        raise ValueError(f"{owner}: {name} must have shape [batch..., length, features], got {x.shape}")


def _dropout(module: nn.Module, rate: float, deterministic: bool) -> dict:
    """`dropout_rate` and `dropout_rng` arguments: no dropout when deterministic."""
    if deterministic or rate == 0.0:
        return {"dropout_rate": 0.0, "dropout_rng": None}
    return {"dropout_rate": rate, "dropout_rng": module.make_rng("dropout")}


def _single_head(
    module: nn.Module,
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
    `[..., 1, T, S]`.
    """
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.ndim >= 2:
            mask = jnp.expand_dims(mask, -3)  # (..., 1, T, S): one head
    output, weights = dot_product_attention(
        query[..., None, :],  # (..., T, 1, H)
        key[..., None, :],  # (..., S, 1, H)
        value[..., None, :],  # (..., S, 1, Hv)
        mask=mask,
        is_causal=module.is_causal,
        scale=module.scale,
        **_dropout(module, module.dropout_rate, deterministic),
        return_weights=True,
        precision=module.precision,
    )
    if module.sow_weights:  # with the head axis, as MultiHeadAttention sows them
        module.sow("intermediates", "attention_weights", weights)  # (..., 1, T, S)
    return output[..., 0, :], weights[..., 0, :, :]  # (..., T, Hv), (..., T, S)


class StaticAttention(nn.Module):
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


class SelfAttentionV1(nn.Module):
    """Self-attention with raw learned matrices (seed 002's `SelfAttention_v1`).

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


class SelfAttention(nn.Module):
    """Self-attention through `nn.Dense` projections (seed 002's `SelfAttention_v2`).

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


class LearnedQueryAttention(nn.Module):
    """One learned query vector attends over a sequence (seed 000, section 4.1).

    Parameters: `query` `[D]` (standard normal, the seed's `query_vec`) and
    bias-free `nn.Dense` layers `W_query` (D -> d_k), `W_key` (D -> d_k) and
    `W_value` (D -> d_v). `__call__(inputs, mask=None, deterministic=True)`
    maps `[batch..., S, D]` to `(output [batch..., d_v], weights [batch..., S])`;
    `mask` is a key mask broadcastable to `[batch..., S]`. `precision`: of the
    projections and the attention's dots.
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


def decode_positions(module: nn.Module, length: int, capacity: int) -> tuple[Array, Array | None]:
    """Positions `[length]` of the next tokens in a decode cache, and whether they fit.

    Reads and advances the int32 scalar `index` in `module`'s 'cache'
    collection (positions already filled). The first call (inside `init`)
    creates the index at 0 and returns `arange(length)` and None. Appending
    past `capacity` is an error: a ValueError when the index is concrete (an
    eager `apply`); under `jit` the index is traced, so the returned flag is
    False (the caller then keeps its cache and returns NaN) and
    `checkify.checkify` raises.
    """
    initialized = module.has_variable("cache", "index")
    index = module.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
    if not initialized:
        return jnp.arange(length), None
    start = index.value
    fits = start + length <= capacity
    message = (
        f"{type(module).__name__}: decoding {length} position(s) from position {{start}} "
        f"overflows the cache of max length {capacity}"
    )
    if isinstance(start, jax.core.Tracer):
        checkify.debug_check(fits, message, start=start)
    elif not fits:
        raise ValueError(message.format(start=int(start)))
    index.value = start + length
    return start + jnp.arange(length), fits  # (T,), ()


class MultiHeadAttention(nn.Module):
    """Multi-head attention with learned W_Q, W_K, W_V per head and W_O.

    Parameter layout is `flax.linen.MultiHeadDotProductAttention`'s:
      query kernel `[D, N, H]`, key and value kernels `[D, K, H]` / `[D, K, Hv]`,
      out kernel `[N, Hv, D_out]` (biases `[N, H]`, `[K, H]`, `[K, Hv]`, `[D_out]`).
    With `kv_latent_dim` = C (multi-head latent attention, MLA) a 'kv_latent'
    kernel `[D, C]` maps each position to a latent, and K and V are
    reconstructed from it: key and value kernels `[C, K, H]` / `[C, K, Hv]`.

    Attributes:
      num_heads: N, query heads.
      head_dim: H; defaults to `D // num_heads` (D must then divide evenly).
      num_kv_heads: K key/value heads, dividing N (default N; 1 = multi-query).
      v_head_dim: Hv; defaults to `head_dim`.
      out_features: D_out; defaults to D.
      kv_latent_dim: C, the per-position latent of MLA; None = plain K/V projections.
      use_bias: biases on all projections.
      is_causal: apply a causal mask (queries are the last T of S positions).
      dropout_rate: dropout on the attention weights when not deterministic
        (uses the 'dropout' rng stream).
      scale: logits scale, default `1/sqrt(head_dim)`.
      sow_weights: sow attention weights `[batch..., N, T, S]` into
        `intermediates/attention_weights`.
      attention_implementation: `dot_product_attention`'s `implementation`
        (None: its dispatch rule picks the fastest eligible path). Calls that
        sow weights or apply attention dropout always take "reference", the
        only path that does either.
      precision: of every projection and every attention dot, forward and
        backward (`dot_product_attention`'s `precision`); None: JAX's default.
      absorb_latent: MLA decoding from the cache attends over the cached
        latents with the key up-projection folded into the query and the value
        up-projection into W_O ("weight absorption"), never building K and V;
        False rebuilds K and V from the latents at every step (the same outputs).
      lora_rank: r > 0 puts a LoRA adapter (`qkv_jax.lora.LoRADenseGeneral`:
        parameters `lora_a` `[in..., r]`, `lora_b` `[r, out...]` beside the
        kernel, which keeps its place) on each projection named in
        `lora_targets` (of `ATTENTION_LORA_TARGETS`); 0 = none.
      lora_alpha: the adapters' update is scaled by lora_alpha / lora_rank.

    `__call__(inputs_q, inputs_kv=None, mask=None, deterministic=True, decode=False,
    head_mask=None)`: `inputs_q` `[batch..., T, D]`, `inputs_kv` `[batch..., S, D]`
    (defaults to `inputs_q`), `mask` boolean broadcastable to `[batch..., N, T, S]`;
    returns `[batch..., T, D_out]`. `head_mask` `[batch..., N]` multiplies each
    head's attention output before W_O (0 ablates a head; the parameters are
    the same with or without it).

    Decoding (`decode=True`: causal self-attention) keeps a KV cache in the
    'cache' collection: `cached_key` `[batch..., L, K, H]` and `cached_value`
    `[batch..., L, K, Hv]` (sized by the K kv heads), or for MLA only
    `cached_latent` `[batch..., L, C]`, and `index`, the positions filled.
    `init(..., decode=True)` on an input of length L creates the cache (and
    returns the full causal pass); each `apply(..., decode=True,
    mutable=['cache'])` then appends its T positions (a prompt, then one token
    at a time) and attends to all cached ones; `mask` then broadcasts to
    `[batch..., N, T, L]`. Appending past L raises (see `decode_positions`).
    """

    num_heads: int
    head_dim: int | None = None
    num_kv_heads: int | None = None
    v_head_dim: int | None = None
    out_features: int | None = None
    kv_latent_dim: int | None = None
    use_bias: bool = True
    is_causal: bool = False
    dropout_rate: float = 0.0
    scale: float | None = None
    sow_weights: bool = False
    attention_implementation: str | None = None
    precision: PrecisionLike = None
    absorb_latent: bool = True
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("query", "value")
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    kernel_init: Initializer = nn.initializers.lecun_normal()
    bias_init: Initializer = nn.initializers.zeros_init()

    def __post_init__(self):
        _check_lora(
            "MultiHeadAttention", self.lora_rank, self.lora_alpha, self.lora_targets, ATTENTION_LORA_TARGETS
        )
        if self.lora_rank and "kv_latent" in self.lora_targets and self.kv_latent_dim is None:
            raise ValueError("MultiHeadAttention: lora_targets has 'kv_latent' but kv_latent_dim is None")
        _check_positive(
            "MultiHeadAttention",
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            num_kv_heads=self.num_kv_heads,
            v_head_dim=self.v_head_dim,
            out_features=self.out_features,
            kv_latent_dim=self.kv_latent_dim,
        )
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"MultiHeadAttention: num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
            )
        _check_dropout("MultiHeadAttention", self.dropout_rate)
        super().__post_init__()

    def resolved_head_dim(self, features: int) -> int:
        """Head depth H for input width `features`."""
        if self.head_dim is not None:
            return self.head_dim
        if features % self.num_heads:
            raise ValueError(
                f"MultiHeadAttention: num_heads={self.num_heads} does not divide the input "
                f"width {features}; set head_dim explicitly"
            )
        return features // self.num_heads

    def _projection(self, features: Any, name: str, axis: Any = -1) -> nn.DenseGeneral:
        """The DenseGeneral projection `name`, with a LoRA adapter when `name` is a target."""
        options = dict(
            axis=axis,
            use_bias=self.use_bias,
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            precision=self.precision,
            name=name,
        )
        if self.lora_rank and name in self.lora_targets:
            return LoRADenseGeneral(features, rank=self.lora_rank, alpha=self.lora_alpha, **options)
        return nn.DenseGeneral(features, **options)

    def _check_decode(self, inputs_kv: Array | None) -> None:
        if inputs_kv is not None:
            raise ValueError("MultiHeadAttention: decode=True is self-attention; pass no inputs_kv")
        if not self.is_causal:
            raise ValueError(
                "MultiHeadAttention: decode=True needs is_causal=True (a cache holds only the past)"
            )

    def _cache(self, entries: dict[str, Array], mask: Array | None, axis: int):
        """Appends per-position `entries` (position axis `axis`, length T) to the decode cache.

        Returns the entries of all L cached positions, the mask `[T, L]` (a
        query sees the filled positions up to its own, combined with `mask`),
        and whether the T positions fit. On the `init` call, which creates the
        cache with L = T, returns `entries`, `mask` and None.
        """
        cached = {
            name: self.variable("cache", f"cached_{name}", jnp.zeros, x.shape, x.dtype)
            for name, x in entries.items()
        }
        length = next(iter(entries.values())).shape[axis]
        capacity = next(iter(cached.values())).value.shape[axis]
        positions, fits = decode_positions(self, length, capacity)  # (T,), ()
        if fits is None:  # the init call, which created the cache
            return entries, mask, None
        for name, x in entries.items():
            full = cached[name].value.shape
            if x.shape[:axis] + x.shape[axis + 1 :] != full[:axis] + full[axis + 1 :]:
                raise ValueError(
                    f"MultiHeadAttention: decode input gives {name} of shape {x.shape}, which does "
                    f"not fit the cache of shape {full} (batch dims and widths must match)"
                )
        for name, x in entries.items():
            old = lax.dynamic_slice_in_dim(cached[name].value, positions[0], length, axis)
            written = jnp.where(fits, x, old)  # an overflow leaves the cache as it was
            cached[name].value = lax.dynamic_update_slice_in_dim(
                cached[name].value, written, positions[0], axis
            )
        visible = jnp.arange(capacity)[None, :] <= positions[:, None]  # (T, L)
        return {name: c.value for name, c in cached.items()}, combine_masks(mask, visible), fits

    def _keys_and_values(self, inputs_kv: Array, mask: Array | None, decode: bool, projections: dict):
        """K `[batch..., S, K, H]` and V `[batch..., S, K, Hv]` (or, for MLA decoding from a
        filled cache with `absorb_latent`, None and the cached latents `[batch..., L, C]`),
        the mask, and the cache's fit flag (None when not decoding from a cache)."""
        axis = inputs_kv.ndim - 2  # the position axis of everything cached
        fits = None
        if self.kv_latent_dim is None:
            entries = {
                "key": projections["key"](inputs_kv),  # (..., S, K, H)
                "value": projections["value"](inputs_kv),  # (..., S, K, Hv)
            }
            if decode:
                entries, mask, fits = self._cache(entries, mask, axis)
            return entries["key"], entries["value"], mask, fits
        latent = self._projection(self.kv_latent_dim, "kv_latent")(inputs_kv)  # (..., S, C)
        if decode:
            entries, mask, fits = self._cache({"latent": latent}, mask, axis)
            latent = entries["latent"]  # (..., L, C)
            if fits is not None and self.absorb_latent:
                return None, latent, mask, fits
        return projections["key"](latent), projections["value"](latent), mask, fits

    def _attend(self, query, key, value, mask, fits, deterministic: bool, scale: float | None) -> Array:
        """`dot_product_attention` with this module's options; sows the weights if asked."""
        dropout = _dropout(self, self.dropout_rate, deterministic)
        needs_reference = self.sow_weights or dropout["dropout_rate"] > 0
        attended = dot_product_attention(
            query,
            key,
            value,
            mask=mask,
            is_causal=self.is_causal and fits is None,  # a cache's mask is already causal
            scale=scale,
            **dropout,
            return_weights=self.sow_weights,
            implementation="reference" if needs_reference else self.attention_implementation,
            precision=self.precision,
        )
        if not self.sow_weights:
            return attended  # (..., T, N, Hv)
        output, weights = attended  # (..., T, N, Hv), (..., N, T, S)
        self.sow("intermediates", "attention_weights", weights)
        return output

    def _absorbed(self, query, latent, mask, fits, deterministic: bool, projections: dict) -> Array:
        """MLA attention straight from the cached latents C `[..., L, C]`, K and V never built.

        With key = C W_K + b_K and value = C W_V + b_V (kernels `[C, K, H]`,
        `[C, K, Hv]`), head n (kv head k = n // (N/K)) has logits q_n (C W_K[k])^T
        = (q_n W_K[k]^T) C^T, plus q_n b_K[k], the same for every key, which the
        softmax cancels: the query is projected into the latent space and
        attends over the latents (one shared kv head of depth C). Its output
        sum_s w_s (c_s W_V[k] + b_V[k]) is the blend of the latents times W_V[k],
        plus b_V[k] where the row attends to anything (its weights sum to 1):
        the value up-projection moves past the attention, to each query's blend
        instead of every cached position, where it meets W_O.
        Both projections are applied per query token, which costs fewer
        operations than folding them into W_Q and W_O ahead of time when C is
        larger than the head depth. With LoRA adapters on them, W_K and W_V are
        the effective kernels (kernel + (alpha / r) A B). Returns the heads'
        outputs `[..., T, N, Hv]`, before W_O.
        """
        key_params, value_params = (
            projections["key"].variables["params"],
            projections["value"].variables["params"],
        )
        W_key, W_value = nn.dtypes.promote_dtype(
            effective_kernel(key_params, self.lora_alpha),
            effective_kernel(value_params, self.lora_alpha),
            dtype=self.dtype,
        )
        num_kv_heads, group = W_key.shape[1], self.num_heads // W_key.shape[1]  # (C, K, H), (C, K, Hv)
        grouped = query.reshape(*query.shape[:-2], num_kv_heads, group, query.shape[-1])  # (..., T, K, G, H)
        query_latent = jnp.einsum("...kgh,ckh->...kgc", grouped, W_key, precision=self.precision)
        query_latent = query_latent.reshape(*query.shape[:-1], -1)  # (..., T, N, C)
        latents = latent[..., None, :].astype(query_latent.dtype)  # (..., L, 1, C): key and value
        scale = self.scale if self.scale is not None else query.shape[-1] ** -0.5
        blended = self._attend(
            query_latent, latents, latents, mask, fits, deterministic, scale
        )  # (..., T, N, C)
        blended = blended.reshape(*blended.shape[:-2], num_kv_heads, group, -1)  # (..., T, K, G, C)
        output = jnp.einsum(
            "...kgc,ckv->...kgv", blended, W_value, precision=self.precision
        )  # (..., T, K, G, Hv)
        output = output.reshape(*query.shape[:-1], -1)  # (..., T, N, Hv)
        if "bias" in value_params:  # b_V[k] for every row that attends to a key
            value_bias = jnp.repeat(value_params["bias"], group, axis=0).astype(output.dtype)  # (N, Hv)
            if mask is not None:  # broadcastable to (..., N, T, L)
                has_key = jnp.any(mask.reshape((1,) * (3 - mask.ndim) + mask.shape), axis=-1)  # (..., N|1, T)
                value_bias = jnp.where(
                    jnp.swapaxes(has_key, -1, -2)[..., None], value_bias, 0
                )  # (..., T, N, Hv)
            output = output + value_bias
        return output  # (..., T, N, Hv)

    @nn.compact
    def __call__(self, inputs_q, inputs_kv=None, mask=None, deterministic=True, decode=False, head_mask=None):
        if decode:
            self._check_decode(inputs_kv)
        inputs_kv = inputs_q if inputs_kv is None else inputs_kv
        _check_inputs("MultiHeadAttention", "inputs_q", inputs_q)
        _check_inputs("MultiHeadAttention", "inputs_kv", inputs_kv)
        if inputs_q.shape[:-2] != inputs_kv.shape[:-2]:
            raise ValueError(
                f"MultiHeadAttention: batch dims of inputs_q {inputs_q.shape} and inputs_kv "
                f"{inputs_kv.shape} differ"
            )
        features = inputs_q.shape[-1]
        head_dim = self.resolved_head_dim(features)
        num_kv_heads = self.num_kv_heads or self.num_heads
        projections = {
            "key": self._projection((num_kv_heads, head_dim), "key"),
            "value": self._projection((num_kv_heads, self.v_head_dim or head_dim), "value"),
            "out": self._projection(self.out_features or features, "out", axis=(-2, -1)),
        }
        query = self._projection((self.num_heads, head_dim), "query")(inputs_q)  # (..., T, N, H)
        key, value, mask, fits = self._keys_and_values(inputs_kv, mask, decode, projections)
        if key is None:  # MLA decoding: attend over the cached latents directly
            output = self._absorbed(query, value, mask, fits, deterministic, projections)  # (..., T, N, Hv)
        else:
            output = self._attend(query, key, value, mask, fits, deterministic, self.scale)  # (..., T, N, Hv)
        if head_mask is not None:  # (batch..., N): one factor per head
            output = output * jnp.asarray(head_mask, output.dtype)[..., None, :, None]  # (..., T, N, Hv)
        output = projections["out"](output)  # (..., T, D_out)
        return output if fits is None else jnp.where(fits, output, jnp.nan)
