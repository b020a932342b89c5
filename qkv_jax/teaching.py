"""The teaching modules: attention from parameter-free to learned, one head each.

Every module works on an unbatched `[S, D]` input and on any leading batch
dims `[batch..., S, D]`; `jax.vmap` of `apply` over a batch equals the batched
`apply`. All of them compute attention with `qkv_jax.dot_product_attention`,
and `qkv_jax.interpretability` reads their hook points as it reads
`MultiHeadAttention`'s (one head).

  StaticAttention        Q = K = V = X, nothing to learn (identity W).
  SelfAttentionV1        raw `W_query`, `W_key`, `W_value` matrices [d_in, d_out].
  SelfAttention          the same through `nn.Dense` layers.
  LearnedQueryAttention  one learned query vector reads a sequence.

They are importable from `qkv_jax` and from `qkv_jax.modules` as well.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from qkv_jax.attention import KeyVisibility, PrecisionLike, dot_product_attention, visible_keys
from qkv_jax.heads import (
    Inspectable,
    _check_inputs,
    _check_one_head,
    _check_pattern_request,
    attend_heads,
    torch_linear_init,
)
from qkv_jax.hooks import hook as _hook

Array = jax.Array
Dtype = Any
Initializer = Any

__all__ = ["StaticAttention", "SelfAttentionV1", "SelfAttention", "LearnedQueryAttention"]


def _dropout(module: nn.Module, rate: float, deterministic: bool) -> dict:
    """`dropout_rate` and `dropout_rng` arguments: no dropout when deterministic."""
    if deterministic or rate == 0.0:
        return {"dropout_rate": 0.0, "dropout_rng": None}
    return {"dropout_rate": rate, "dropout_rng": module.make_rng("dropout")}


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


def _dense(module: Any, features: int, use_bias: bool, name: str) -> nn.Dense:
    """The projection `name` of a teaching module, inside its compact method: `nn.Dense` with the
    module's kernel_init, dtypes and precision."""
    dtypes = dict(dtype=module.dtype, param_dtype=module.param_dtype, precision=module.precision)
    return nn.Dense(features, use_bias=use_bias, kernel_init=module.kernel_init, name=name, **dtypes)


class _OneHead(Inspectable):
    """The options every teaching module has (keyword-only), read by `_single_head`:
    `is_causal`, `scale` (default `1/sqrt(depth)`), attention-weight `dropout_rate`,
    `sow_weights` and the dots' `precision`."""

    _: dataclasses.KW_ONLY
    is_causal: bool = False
    scale: float | None = None
    dropout_rate: float = 0.0
    sow_weights: bool = False
    precision: PrecisionLike = None


class _LearnedHead(_OneHead):
    """`_OneHead` with learned projections: their computation `dtype` and `param_dtype`."""

    _: dataclasses.KW_ONLY
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32


class StaticAttention(_OneHead):
    """Parameter-free attention: Q = K = V = X, i.e. every W is the identity.

    `__call__(inputs_q, inputs_kv=None, mask=None, deterministic=True,
    return_weights=False)`: inputs `[batch..., T, D]` and `[batch..., S, D]`
    (self-attention when `inputs_kv` is None), output `[batch..., T, D]`, and
    the attention weights `[batch..., T, S]` when `return_weights`. `mask`
    broadcasts to `[batch..., T, S]`. `scale` defaults to `1/sqrt(D)`; set it
    to 1.0 for the unscaled `softmax(X X^T) X`. `precision`: of the two dots.
    """

    def __post_init__(self):
        _check_one_head(self)
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs_q, inputs_kv=None, mask=None, deterministic=True, return_weights=False):
        inputs_kv = inputs_q if inputs_kv is None else inputs_kv
        _check_inputs("StaticAttention", "inputs_q", inputs_q)
        _check_inputs("StaticAttention", "inputs_kv", inputs_kv)
        output, weights = _single_head(self, inputs_q, inputs_kv, inputs_kv, mask, deterministic)
        return (output, weights) if return_weights else output


class SelfAttentionV1(_LearnedHead):
    """Self-attention with raw learned matrices, the first form of learned attention.

    Parameters `W_query`, `W_key`, `W_value` of shape `[d_in, d_out]`, drawn
    uniform in [0, 1) as `torch.rand` does. `__call__(inputs, mask=None,
    deterministic=True, return_weights=False)`: `[batch..., S, d_in]` to
    `[batch..., S, d_out]` (and weights `[batch..., S, S]`). `precision`: of
    the projections and the attention's dots.
    """

    d_out: int
    kernel_init: Initializer = nn.initializers.uniform(scale=1.0)

    def __post_init__(self):
        _check_one_head(self, d_out=self.d_out)
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


class SelfAttention(_LearnedHead):
    """Self-attention through `nn.Dense` projections.

    Sub-modules `W_query`, `W_key`, `W_value` are `nn.Dense(d_out)` (kernel
    `[d_in, d_out]`, the transpose of `torch.nn.Linear.weight`), initialised
    like `torch.nn.Linear`. `__call__` and `precision` as for `SelfAttentionV1`.
    """

    d_out: int
    qkv_bias: bool = False
    kernel_init: Initializer = torch_linear_init

    def __post_init__(self):
        _check_one_head(self, d_out=self.d_out)
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs, mask=None, deterministic=True, return_weights=False):
        _check_inputs("SelfAttention", "inputs", inputs)

        query = _dense(self, self.d_out, self.qkv_bias, "W_query")(inputs)  # (..., S, d_out)
        key = _dense(self, self.d_out, self.qkv_bias, "W_key")(inputs)  # (..., S, d_out)
        value = _dense(self, self.d_out, self.qkv_bias, "W_value")(inputs)  # (..., S, d_out)
        output, weights = _single_head(self, query, key, value, mask, deterministic)
        return (output, weights) if return_weights else output


class LearnedQueryAttention(_LearnedHead):
    """One learned query vector attends over a sequence.

    Parameters: `query` `[D]` (standard normal) and bias-free `nn.Dense`
    layers `W_query` (D -> d_k), `W_key` (D -> d_k) and `W_value` (D -> d_v).
    `__call__(inputs, mask=None, deterministic=True)` maps `[batch..., S, D]`
    to `(output [batch..., d_v], weights [batch..., S])`; `mask` is a key mask
    broadcastable to `[batch..., S]`. `precision`: of the projections and the
    attention's dots. `is_causal` must stay False: one query has no future.
    """

    d_k: int
    d_v: int
    kernel_init: Initializer = torch_linear_init
    query_init: Initializer = nn.initializers.normal(stddev=1.0)

    def __post_init__(self):
        _check_one_head(self, d_k=self.d_k, d_v=self.d_v)
        if self.is_causal:
            raise ValueError("LearnedQueryAttention: is_causal=True has no meaning for one query")
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs, mask=None, deterministic=True):
        _check_inputs("LearnedQueryAttention", "inputs", inputs)

        query_vector = self.param("query", self.query_init, (inputs.shape[-1],), self.param_dtype)
        query = _dense(self, self.d_k, False, "W_query")(query_vector)  # (d_k,)
        key = _dense(self, self.d_k, False, "W_key")(inputs)  # (..., S, d_k)
        value = _dense(self, self.d_v, False, "W_value")(inputs)  # (..., S, d_v)
        query = jnp.broadcast_to(query, (*key.shape[:-2], 1, self.d_k))  # (..., 1, d_k)
        if mask is not None:
            mask = jnp.asarray(mask)[..., None, :]  # (..., 1, S)
        output, weights = _single_head(self, query, key, value, mask, deterministic)
        return output[..., 0, :], weights[..., 0, :]  # (..., d_v), (..., S)
