"""Small models built from the attention modules, one per kind of experiment."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from qkv_jax.attention import PrecisionLike
from qkv_jax.modules import MultiHeadAttention
from qkv_jax.teaching import LearnedQueryAttention, StaticAttention

__all__ = ["FlagReader", "FLAG_READER_KINDS"]

FLAG_READER_KINDS = ("learned_query", "static", "multihead")


class FlagReader(nn.Module):
    """One attention layer that reads flagged tokens out of a sequence.

    Input `[batch..., S, D]`, where the last `num_flags` channels are flags
    and the rest content; output `[batch..., out_features]`. The attention
    weights are sown into `intermediates` as `[batch..., N, 1, S]`.

    kind:
      learned_query: a learned query vector through W_q, keys
        and values through W_k, W_v (`LearnedQueryAttention`, one head).
      static: nothing trainable. The query is the mean token, keys and values
        are the raw tokens (every W is the identity); the prediction is the
        blended content, repeated for each flag.
      multihead: a learned query token read by `MultiHeadAttention` with
        `num_heads` heads of query/key depth `d_k // num_heads` and value depth
        `d_v // num_heads`, then W_O, all without bias. The parameter count does not depend on
        `num_heads`: the heads split fixed total widths d_k and d_v.

    `precision` (None: JAX's default) goes to every projection and attention
    dot of whichever kind is built. `normalize_qk` (False, True/"layernorm" or
    "rms") and `attn_logits_soft_cap` (None or c > 0) are `MultiHeadAttention`'s,
    multihead only.
    """

    kind: str
    out_features: int
    d_k: int = 8
    d_v: int | None = None  # multihead: total value width (default d_k)
    num_heads: int = 1
    num_flags: int = 1
    scaled: bool = True
    precision: PrecisionLike = None
    normalize_qk: bool | str = False
    attn_logits_soft_cap: float | None = None

    @nn.compact
    def __call__(self, inputs):
        scale = None if self.scaled else 1.0
        if self.kind != "multihead" and (self.normalize_qk or self.attn_logits_soft_cap is not None):
            raise ValueError(
                f"FlagReader: normalize_qk={self.normalize_qk!r} and attn_logits_soft_cap="
                f"{self.attn_logits_soft_cap!r} need kind='multihead', got kind={self.kind!r}"
            )
        if self.kind == "learned_query":
            output, _ = LearnedQueryAttention(
                d_k=self.d_k,
                d_v=self.out_features,
                scale=scale,
                sow_weights=True,
                precision=self.precision,
                name="attention",
            )(inputs)
            return output  # (..., out_features)
        if self.kind == "static":
            query = jnp.mean(inputs, axis=-2, keepdims=True)  # (..., 1, D)
            blended = StaticAttention(
                scale=scale, sow_weights=True, precision=self.precision, name="attention"
            )(query, inputs)
            content = blended[..., 0, : inputs.shape[-1] - self.num_flags]  # (..., C)
            return jnp.tile(content, self.num_flags)  # (..., F * C)
        if self.kind == "multihead":
            query_token = self.param("query", nn.initializers.normal(1.0), (inputs.shape[-1],))
            query = jnp.broadcast_to(query_token, (*inputs.shape[:-2], 1, inputs.shape[-1]))
            d_v = self.d_v or self.d_k
            output = MultiHeadAttention(
                num_heads=self.num_heads,
                head_dim=self.d_k // self.num_heads,
                v_head_dim=d_v // self.num_heads,
                use_bias=False,  # bare W_Q, W_K, W_V, W_O (a key bias would get no gradient)
                out_features=self.out_features,
                scale=scale,
                normalize_qk=self.normalize_qk,
                attn_logits_soft_cap=self.attn_logits_soft_cap,
                sow_weights=True,
                precision=self.precision,
                name="attention",
            )(query, inputs)  # (..., 1, out_features)
            return output[..., 0, :]
        raise ValueError(f"FlagReader: kind={self.kind!r}; choose one of {', '.join(FLAG_READER_KINDS)}")
