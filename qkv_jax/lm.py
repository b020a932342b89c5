"""A small causal language model: pre-LayerNorm transformer blocks, KV-cache sampling.

  TransformerConfig every option of the two modules below, in one frozen dataclass.
  TransformerBlock  x + Dropout(MHA(LN(x))), then x + Dropout(MLP(LN(x))).
  TransformerLM     token + learned position embeddings, blocks, LN, vocabulary head.
  init_cache        the zeroed decode cache of a TransformerLM for a batch size.
  generate          prompt -> sampled tokens, the token loop inside one `lax.scan`
                    (`check_generate_args`: its host-side checks).

Decoding follows flax's `decode=True` convention: the cache lives in the
'cache' collection (each attention layer's `cached_key` and `cached_value`,
sized by `num_kv_heads`, or its MLA `cached_latent`, and `cache_index`; see
`MultiHeadAttention`), created by `init_cache` with room for `max_len`
positions. `qkv_jax.nnx.TransformerLM` is the same model as a flax.nnx module
(the same parameter and cache trees), with its own `generate`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qkv_jax.attention import PrecisionLike
from qkv_jax.lora import LoRADenseGeneral
from qkv_jax.modules import (
    ATTENTION_LORA_TARGETS,
    MultiHeadAttention,
    _check_dropout,
    _check_heads,
    _check_lora,
    _check_positive,
    advance_cache_index,
)

Array = jax.Array
Dtype = Any

__all__ = [
    "LORA_TARGETS",
    "TransformerConfig",
    "attention_options",
    "check_tokens",
    "add_positions",
    "TransformerBlock",
    "TransformerLM",
    "init_cache",
    "kv_cache_bytes_per_token",
    "sample_logits",
    "sample_tokens",
    "check_generate_args",
    "decode_positions",
    "sample_with_cache",
    "generate",
]

embedding_init = nn.initializers.normal(stddev=0.02)
# Where a TransformerLM's LoRA adapters can go: the attention projections, and "mlp" (mlp_in and mlp_out).
LORA_TARGETS = (*ATTENTION_LORA_TARGETS, "mlp")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Every option of `TransformerBlock` and `TransformerLM`, declared once (as flax's lm1b does).

    A new attention option is a field here and one entry in `attention_options`
    (shared by the linen and the nnx `TransformerBlock`); the training tasks
    build this from a config's `model` section by field name
    (`qkv_jax.tasks.transformer`). Its checks run here, once, when it is built;
    `dataclasses.replace(config, causal=False)` is a changed copy, checked again.

    Attributes:
      vocab_size, num_layers, d_model: sizes; num_heads must divide d_model.
      num_heads, num_kv_heads, kv_latent_dim: the attention (MHA; GQA/MQA with
        num_kv_heads < num_heads; MLA with a latent; see `MultiHeadAttention`).
      max_len: positions of the embedding table and of the decode cache.
      mlp_dim: MLP hidden width (default 4 d_model).
      causal: causal self-attention (False: every position sees every other).
      dropout_rate, attention_dropout_rate: dropout on embeddings and residual
        branches, and on the attention weights, when not deterministic.
      attention_implementation: `dot_product_attention`'s path in every block
        (None: its dispatch rule picks the fastest eligible one).
      sow_weights: every block sows its attention weights `[batch..., N, T, S]`
        into `intermediates/block_i/attention/attention_weights`.
      dtype: computation dtype (None: float32 for float32 parameters);
        bfloat16 computes in bfloat16 while `param_dtype` keeps float32 weights.
      param_dtype: dtype of the parameters.
      precision: of every matmul (projections, attention, MLP, head), flax's
        spelling: None is JAX's default (TF32 for float32 on recent GPUs),
        "highest" full float32.
      absorb_latent: MLA decoding attends over the cached latents with the
        up-projections folded into the query and W_O (see `MultiHeadAttention`).
      lora_rank, lora_alpha, lora_targets: LoRA adapters of rank lora_rank (0 =
        none), scaled by lora_alpha / lora_rank, beside the kernels of the
        projections named in lora_targets (of `LORA_TARGETS`; "mlp" is mlp_in
        and mlp_out); every kernel keeps its place (`qkv_jax.lora`).
    """

    vocab_size: int
    num_layers: int = 2
    d_model: int = 128
    num_heads: int = 4
    num_kv_heads: int | None = None
    kv_latent_dim: int | None = None
    mlp_dim: int | None = None
    max_len: int = 256
    causal: bool = True
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    attention_implementation: str | None = None
    sow_weights: bool = False
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: PrecisionLike = None
    absorb_latent: bool = True
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("query", "value")

    def __post_init__(self):
        owner = "TransformerConfig"
        _check_lora(
            owner, self.lora_rank, self.lora_alpha, self.lora_targets, LORA_TARGETS, self.kv_latent_dim
        )
        _check_positive(
            owner,
            vocab_size=self.vocab_size,
            num_layers=self.num_layers,
            d_model=self.d_model,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            max_len=self.max_len,
            mlp_dim=self.mlp_dim,
            kv_latent_dim=self.kv_latent_dim,
        )
        if self.d_model % self.num_heads:
            raise ValueError(f"{owner}: num_heads={self.num_heads} must divide d_model={self.d_model}")
        _check_heads(owner, self.num_heads, self.num_kv_heads)
        _check_dropout(owner, self.dropout_rate)
        if not 0.0 <= self.attention_dropout_rate < 1.0:
            raise ValueError(
                f"{owner}: attention_dropout_rate={self.attention_dropout_rate!r} must be in [0, 1)"
            )


def attention_options(config: TransformerConfig) -> dict[str, Any]:
    """The attention's fields from `config`, shared by the linen and the nnx `TransformerBlock`."""
    return dict(
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        kv_latent_dim=config.kv_latent_dim,
        is_causal=config.causal,
        dropout_rate=config.attention_dropout_rate,
        sow_weights=config.sow_weights,
        attention_implementation=config.attention_implementation,
        precision=config.precision,
        absorb_latent=config.absorb_latent,
        lora_rank=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_targets=tuple(t for t in config.lora_targets if t != "mlp"),
        dtype=config.dtype,
        param_dtype=config.param_dtype,
    )


def check_tokens(tokens: Array, decode: bool, max_len: int) -> None:
    """A TransformerLM's input checks: integer tokens `[batch..., T]`, T <= max_len outside decoding
    (a decode call's length is checked against the cache)."""
    if not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.ndim < 1:
        raise ValueError(
            f"TransformerLM: tokens must be integers [batch..., T], got {tokens.dtype}{list(tokens.shape)}"
        )
    if not decode and tokens.shape[-1] > max_len:
        raise ValueError(f"TransformerLM: sequence length {tokens.shape[-1]} exceeds max_len={max_len}")


def add_positions(embedded: Array, position_embedding: Array) -> Array:
    """Token embeddings `[batch..., T, D]` plus position embeddings `[T, D]`, broadcast explicitly."""
    return embedded + position_embedding.reshape((1,) * (embedded.ndim - 2) + position_embedding.shape)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm transformer block on `[batch..., T, d_model]` (output the same shape).

    x + Dropout(MHA(LN(x))), then x + Dropout(MLP(LN(x))), the MLP a GELU of
    width `config.mlp_dim` (default 4 d_model); every option comes from
    `config` (`TransformerConfig`). `head_mask` `[N]`: the attention's (see
    `MultiHeadAttention`).
    """

    config: TransformerConfig

    def _mlp_dense(self, features: int, name: str) -> nn.Module:
        """An MLP projection: `nn.Dense`, or with "mlp" in `lora_targets` its LoRA form
        (the same `kernel` `[in, out]` and `bias`)."""
        config = self.config
        options = dict(
            dtype=config.dtype, param_dtype=config.param_dtype, precision=config.precision, name=name
        )
        if config.lora_rank and "mlp" in config.lora_targets:
            return LoRADenseGeneral(features, rank=config.lora_rank, alpha=config.lora_alpha, **options)
        return nn.Dense(features, **options)

    @nn.compact
    def __call__(self, x, deterministic: bool = True, decode: bool = False, head_mask=None):
        config = self.config
        width = x.shape[-1]
        norm = functools.partial(nn.LayerNorm, dtype=config.dtype, param_dtype=config.param_dtype)
        h = norm(name="attention_norm")(x)
        h = MultiHeadAttention(**attention_options(config), name="attention")(
            h, deterministic=deterministic, decode=decode, head_mask=head_mask
        )  # (..., T, D)
        x = x + nn.Dropout(config.dropout_rate)(h, deterministic)
        h = norm(name="mlp_norm")(x)
        h = nn.gelu(self._mlp_dense(config.mlp_dim or 4 * width, "mlp_in")(h))  # (..., T, mlp_dim)
        h = self._mlp_dense(width, "mlp_out")(h)  # (..., T, D)
        return x + nn.Dropout(config.dropout_rate)(h, deterministic)


class TransformerLM(nn.Module):
    """Next-token model: tokens `[batch..., T]` (int) -> logits `[batch..., T, vocab_size]` (f32).

    Token embedding plus a learned position embedding `[max_len, d_model]`,
    `num_layers` `TransformerBlock`s, a final LayerNorm and a bias-free head;
    every option is a field of `config` (`TransformerConfig`). Another config
    for the same parameters: `model.clone(config=dataclasses.replace(model.config, ...))`.

    `__call__(tokens, deterministic=True, decode=False, head_mask=None)`; with
    `decode` the positions continue from the cache (`init_cache`, `generate`);
    `head_mask` `[num_layers, num_heads]` multiplies each head's attention
    output before W_O (0 ablates it; `qkv_jax.finetune.head_ablation_masks`).
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, tokens, deterministic: bool = True, decode: bool = False, head_mask=None):
        config = self.config
        check_tokens(tokens, decode, config.max_len)
        length = tokens.shape[-1]
        token_embedding = nn.Embed(
            config.vocab_size,
            config.d_model,
            embedding_init=embedding_init,
            dtype=config.dtype,
            param_dtype=config.param_dtype,
            name="token_embedding",
        )
        position_table = self.param(
            "position_embedding", embedding_init, (config.max_len, config.d_model), config.param_dtype
        )
        if decode:  # the positions continue from the cache
            initialized = self.has_variable("cache", "cache_index")
            index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
            positions = jnp.arange(length)  # (T,): the init call, which creates the cache
            if initialized:
                index.value, positions = decode_positions(index.value, length, config.max_len)
            position_embedding = jnp.take(position_table, positions, axis=0)  # (T, D)
        else:  # a static slice: its gradient is a pad, where a gather's is a scatter-add
            position_embedding = position_table[:length]  # (T, D)
        x = add_positions(token_embedding(tokens), position_embedding)  # (..., T, D)
        x = nn.Dropout(config.dropout_rate)(x, deterministic)
        if head_mask is not None:
            chex.assert_shape(head_mask, (config.num_layers, config.num_heads))
        for layer in range(config.num_layers):
            layer_mask = None if head_mask is None else head_mask[layer]  # (N,)
            x = TransformerBlock(config, name=f"block_{layer}")(
                x, deterministic, decode, layer_mask
            )  # (..., T, D)
        x = nn.LayerNorm(dtype=config.dtype, param_dtype=config.param_dtype, name="final_norm")(x)
        logits = nn.Dense(
            config.vocab_size,
            use_bias=False,
            dtype=config.dtype,
            param_dtype=config.param_dtype,
            precision=config.precision,
            name="head",
        )(x)  # (..., T, V)
        return logits.astype(jnp.float32)


def decode_positions(index: Array, length: int, max_len: int) -> tuple[Array, Array]:
    """The next decode index and the positions `[length]` of the tokens appended at `index`.

    Appending past `max_len` raises (`qkv_jax.modules.advance_cache_index`).
    """
    new_index, _ = advance_cache_index("TransformerLM", index, length, max_len)
    return new_index, index + jnp.arange(length)  # (), (T,)


def init_cache(model: TransformerLM, batch_size: int) -> dict:
    """The decode cache for `batch_size` sequences of up to `model.config.max_len` tokens, zeroed.

    Built from the shapes `model.init(..., decode=True)` would create, without
    computing anything: the same pytree as its "cache" collection, per layer
    the cached keys and values `[batch_size, max_len, K, H]` (with
    `kv_latent_dim`, the latents `[batch_size, max_len, kv_latent_dim]`) and
    the int32 scalar `cache_index` of positions filled (and the model's own
    `cache_index`, where the position embeddings continue).
    """
    tokens = jnp.zeros((batch_size, model.config.max_len), jnp.int32)
    shapes = jax.eval_shape(functools.partial(model.init, decode=True), jax.random.PRNGKey(0), tokens)[
        "cache"
    ]
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def kv_cache_bytes_per_token(model: TransformerLM) -> int:
    """Bytes the decode cache holds per token, over all layers (cached K and V, or latents)."""
    shapes = jax.eval_shape(functools.partial(init_cache, model, 1))
    total = sum(
        int(np.prod(leaf.shape)) * leaf.dtype.itemsize
        for path, leaf in jax.tree_util.tree_leaves_with_path(shapes)
        if path[-1].key.startswith("cached_")  # not the position counters
    )
    return total // model.config.max_len


def sample_logits(logits: Array, key: Array, temperature: Array, top_k: int | None) -> Array:
    """One token per row of `logits` `[B, V]` -> `[B]` int32.

    Keeps the `top_k` largest logits (all when None), then samples from
    softmax(logits / temperature); temperature 0 picks the argmax.
    """
    if top_k is not None:
        kth_largest = lax.top_k(logits, top_k)[0][..., -1:]  # (B, 1)
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    sampled = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6))  # (B,)
    return jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


def sample_with_cache(
    step: Any,
    cache: Any,
    prompt: Array,
    rng: Array,
    temperature: Array,
    max_new_tokens: int,
    top_k: int | None,
) -> Array:
    """Prefill `prompt` `[B, P]` through `step`, then sample one token per step inside `lax.scan`.

    `step(cache, tokens [B, T]) -> (logits [B, T, V], cache)` is one cached
    decode call (of a linen or an nnx model). Returns `[B, max_new_tokens]`
    int32; the P prompt positions and all but the last sampled token go
    through the cache (P + max_new_tokens - 1 positions).
    """
    chex.assert_rank(prompt, 2)
    logits, cache = step(cache, prompt)  # (B, P, V)
    keys = jax.random.split(rng, max_new_tokens)
    first = sample_logits(logits[:, -1], keys[0], temperature, top_k)  # (B,)

    def body(carry, key):
        token, cache = carry
        logits, cache = step(cache, token[:, None])  # (B, 1, V)
        token = sample_logits(logits[:, -1], key, temperature, top_k)  # (B,)
        return (token, cache), token

    _, rest = lax.scan(body, (first, cache), keys[1:])  # rest: (max_new_tokens - 1, B)
    return jnp.concatenate([first[:, None], rest.T], axis=1)  # (B, max_new_tokens)


def sample_tokens(
    model: TransformerLM,
    params: Any,
    prompt: Array,
    rng: Array,
    temperature: Array,
    max_new_tokens: int,
    top_k: int | None,
) -> Array:
    """The traceable body of `generate`: `sample_with_cache` over `model.apply` with a fresh cache.

    Returns `[B, max_new_tokens]` int32 for a prompt `[B, P]`.
    """

    def step(cache, tokens):
        logits, state = model.apply(
            {"params": params, "cache": cache}, tokens, decode=True, mutable=["cache"]
        )  # (B, T, V)
        return logits, state["cache"]

    cache = init_cache(model, prompt.shape[0])
    return sample_with_cache(step, cache, prompt, rng, temperature, max_new_tokens, top_k)


_compiled_sample_tokens = jax.jit(sample_tokens, static_argnames=("model", "max_new_tokens", "top_k"))


def check_generate_args(
    model: Any,
    prompt_shape: tuple[int, ...],
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
) -> None:
    """`generate`'s checks, host-side only: ValueError naming the bad value.

    `model`: a `TransformerLM`, linen or `qkv_jax.nnx`'s (its `config` is read).

    The cache holds `model.config.max_len` positions and the loop feeds P +
    max_new_tokens - 1 of them (all but the last sampled token).
    """
    if len(prompt_shape) != 2 or prompt_shape[1] == 0:
        raise ValueError(f"generate: prompt must have shape [batch, length >= 1], got {list(prompt_shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens!r} must be a positive int")
    needed = prompt_shape[1] + max_new_tokens - 1
    if needed > model.config.max_len:
        raise ValueError(
            f"generate: a prompt of {prompt_shape[1]} tokens and max_new_tokens={max_new_tokens} "
            f"decode {needed} positions, past the model's max_len={model.config.max_len}"
        )
    if not model.config.causal:
        raise ValueError(
            "generate: the model has causal=False, and decoding with a cache is causal; decode with "
            "model.clone(config=dataclasses.replace(model.config, causal=True))"
        )
    if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= model.config.vocab_size):
        raise ValueError(f"generate: top_k={top_k!r} must be in [1, {model.config.vocab_size}] or None")
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"generate: temperature={temperature!r} must be finite and >= 0")


def generate(
    model: TransformerLM,
    params: Any,
    prompt: Any,
    max_new_tokens: int,
    *,
    rng: Array,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> Array:
    """Samples `max_new_tokens` tokens after each row of `prompt` `[B, P]` (int).

    Returns `[B, max_new_tokens]` int32. `temperature` 0 is greedy; `top_k`
    keeps the k most likely tokens. Compiled once per (model, B, P,
    max_new_tokens, top_k): new prompts, rngs and temperatures reuse it.
    Lengths are static, so `check_generate_args` checks them before anything
    runs (decoding past `model.config.max_len` is a ValueError).
    """
    prompt = jnp.asarray(prompt)
    if not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"generate: prompt must hold integer tokens, got dtype {prompt.dtype}")
    check_generate_args(model, prompt.shape, max_new_tokens, temperature, top_k)
    return _compiled_sample_tokens(
        model,
        params,
        prompt.astype(jnp.int32),
        rng,
        jnp.float32(temperature),
        max_new_tokens=max_new_tokens,
        top_k=top_k,
    )
