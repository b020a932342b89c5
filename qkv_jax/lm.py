"""A small causal language model: pre-LayerNorm transformer blocks, KV-cache sampling.

  TransformerConfig every option of the two modules below, in one frozen dataclass.
  TransformerBlock  x + Dropout(MHA(LN(x))), then x + Dropout(MLP(LN(x))).
  TransformerLM     token embeddings (+ learned position embeddings, or RoPE in the
                    attention, or no positions), blocks, LN, vocabulary head; packed
                    sequences through `segment_ids`.
  init_cache        the zeroed decode cache of a TransformerLM for a batch size.
  generate          prompt -> sampled tokens, the token loop inside one `lax.scan`
                    (`check_generate_args`: its host-side checks).

Decoding follows flax's `decode=True` convention: the cache lives in the
'cache' collection (each attention layer's `cached_key` and `cached_value`,
sized by `num_kv_heads`, or its MLA `cached_latent`, and `cache_index`; see
`MultiHeadAttention`), created by `init_cache` with room for `max_len`
positions; a layer with a sliding window of w < max_len keys keeps a ring
buffer of w positions instead. `qkv_jax.nnx.TransformerLM` is the same model
as a flax.nnx module (the same parameter and cache trees), with its own
`generate`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
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
    LayerNorm,
    MultiHeadAttention,
    _check_dropout,
    _check_heads,
    _check_lora,
    _check_positive,
    _hook,
    advance_cache_index,
    check_jax_nn_path,
    check_segment_ids,
    check_soft_cap,
    qk_norm_kind,
)
from qkv_jax.positions import check_rope, rotary_dims, segment_positions

Array = jax.Array
Dtype = Any

__all__ = [
    "LORA_TARGETS",
    "POSITIONS",
    "TransformerConfig",
    "layer_windows",
    "attention_options",
    "decode_capacity",
    "check_tokens",
    "token_positions",
    "position_embeddings",
    "TransformerBlock",
    "TransformerLM",
    "init_cache",
    "kv_cache_bytes",
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
# TransformerConfig.positions: learned absolute embeddings, rotary embeddings in the attention, none.
POSITIONS = ("learned", "rope", "none")


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
      positions: "learned" (a `position_embedding` table `[max_len, d_model]`
        added to the token embeddings), "rope" (rotary embeddings of each
        head's queries and keys inside the attention, no table; not with
        kv_latent_dim) or "none" (no position signal: causal attention infers
        position from what each query can see).
      rope_base, rope_fraction: RoPE's base (10000) and the fraction of each
        head's dims that rotate, the leading int(head_dim * rope_fraction)
        (GPT-NeoX's partial rotary; `qkv_jax.positions`). Read with "rope".
      window: sliding-window attention per layer. None: every layer global;
        an int w: every layer local; a tuple of int | None, cycled over the
        layers (`(64, None)`: local and global layers alternating, gemma's
        pattern). A causal layer with window w lets each query see itself and
        the w - 1 keys before it (the module's local_window_size=(w - 1, 0));
        a non-causal one the w - 1 keys on either side. Its decode cache is a
        ring buffer of w positions when w < max_len (`layer_windows`).
        Decoding may go past max_len when nothing grows with the sequence: no
        learned positions and every layer local (`decode_capacity`).
      normalize_qk: False, True or "layernorm" (flax's LayerNorm of each
        head's query and key over head_dim), or "rms" (an RMSNorm); the
        parameters are query_ln/key_ln either way.
      attn_logits_soft_cap: c, the attention logits become c * tanh(logits / c)
        (None: off).
      attention_scale: the factor of every attention logit q.k (jax.nn's
        `scale`): None is 1/sqrt(head_dim); 1.0 leaves the logits unscaled.
        Applied before the soft cap, with or without normalize_qk.
      sinks: a learned sink logit per head and layer (`sinks` `[num_heads]`,
        zero at init) in the softmax's denominator: it takes weight and gives
        no value.

    `TransformerLM` takes `segment_ids` `[batch..., T]` for packed sequences:
    attention never crosses a segment and positions (learned or rotary)
    restart at 0 where the id changes.
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
    positions: str = "learned"
    rope_base: float = 10000.0
    rope_fraction: float = 1.0
    window: int | tuple[int | None, ...] | None = None
    normalize_qk: bool | str = False
    attn_logits_soft_cap: float | None = None
    attention_scale: float | None = None
    sinks: bool = False

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
        _check_attention_variants(owner, self)


def _check_attention_variants(owner: str, config: TransformerConfig) -> None:
    """positions, RoPE, window, normalize_qk, the soft cap and sinks: ValueError naming the field."""
    if config.positions not in POSITIONS:
        raise ValueError(f"{owner}: positions={config.positions!r} must be one of {', '.join(POSITIONS)}")
    if config.positions == "rope":
        check_rope(owner, config.rope_base, config.rope_fraction)
        rotary_dims(config.d_model // config.num_heads, config.rope_fraction, owner)
        if config.kv_latent_dim is not None:
            raise ValueError(
                f"{owner}: positions='rope' with kv_latent_dim={config.kv_latent_dim}: RoPE with MLA is not "
                "defined without DeepSeek-V2's decoupled rotary key, which qkv_jax does not have"
            )
    _window_pattern(config)  # checked without expanding it over (possibly very many) layers
    if qk_norm_kind(owner, config.normalize_qk) and config.kv_latent_dim is not None and config.absorb_latent:
        raise ValueError(
            f"{owner}: normalize_qk={config.normalize_qk!r} with kv_latent_dim={config.kv_latent_dim} needs "
            "absorb_latent=False (a norm of the keys does not fold into the query)"
        )
    check_soft_cap(owner, config.attn_logits_soft_cap)
    scale = config.attention_scale
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf
    ):
        raise ValueError(f"{owner}: attention_scale={scale!r} must be a finite number > 0 (or None)")
    check_jax_nn_path(owner, config.attention_implementation, config.attn_logits_soft_cap, config.sinks)
    if not isinstance(config.sinks, bool):
        raise ValueError(f"{owner}: sinks={config.sinks!r} must be True or False")


def _window_pattern(config: TransformerConfig) -> tuple[int | None, ...]:
    """`config.window` as the pattern cycled over the layers. ValueError naming `window` unless it
    is None, an int >= 1 or a non-empty tuple of those and None."""
    window = config.window
    pattern = window if isinstance(window, tuple) else (window,)
    valid = all(w is None or (isinstance(w, int) and not isinstance(w, bool) and w >= 1) for w in pattern)
    if not pattern or not valid:
        raise ValueError(
            f"TransformerConfig: window={window!r} must be None, an int >= 1 (the keys each query sees, "
            "itself included) or a tuple of those and None (a global layer), cycled over the layers"
        )
    return pattern


def layer_windows(config: TransformerConfig) -> tuple[int | None, ...]:
    """Each layer's window w (None: global), `config.window` cycled over the layers."""
    pattern = _window_pattern(config)
    return tuple(pattern[layer % len(pattern)] for layer in range(config.num_layers))


def decode_capacity(config: TransformerConfig) -> int | None:
    """Positions a decode cache can take: max_len, or None (no limit) when no learned position
    table bounds them and every layer keeps a ring buffer (a window of at most max_len keys)."""
    rings = all(w is not None and w <= config.max_len for w in layer_windows(config))
    return None if config.positions != "learned" and rings else config.max_len


def attention_options(config: TransformerConfig, layer: int = 0) -> dict[str, Any]:
    """The attention's fields of block `layer` from `config`, shared by the linen and the nnx
    `TransformerBlock`: window w becomes local_window_size (w - 1, 0) (causal) or (w - 1, w - 1)."""
    window = layer_windows(config)[layer]
    return dict(
        local_window_size=None if window is None else (window - 1, 0 if config.causal else window - 1),
        rope_base=config.rope_base if config.positions == "rope" else None,
        rope_fraction=config.rope_fraction,
        normalize_qk=config.normalize_qk,
        attn_logits_soft_cap=config.attn_logits_soft_cap,
        scale=config.attention_scale,
        use_sinks=config.sinks,
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


def check_tokens(tokens: Array, decode: bool, config: TransformerConfig, segment_ids: Any = None) -> None:
    """A TransformerLM's input checks: integer tokens `[batch..., T]`; outside decoding T <=
    max_len with learned positions (a decode call's length is checked against the cache);
    `segment_ids` integers of the tokens' shape, not when decoding."""
    if not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.ndim < 1:
        raise ValueError(
            f"TransformerLM: tokens must be integers [batch..., T], got {tokens.dtype}{list(tokens.shape)}"
        )
    if not decode and config.positions == "learned" and tokens.shape[-1] > config.max_len:
        raise ValueError(
            f"TransformerLM: sequence length {tokens.shape[-1]} exceeds max_len={config.max_len} "
            "(the learned position table's)"
        )
    check_segment_ids("TransformerLM", segment_ids, decode)
    if segment_ids is not None and (
        jnp.shape(segment_ids) != tokens.shape
        or not jnp.issubdtype(jnp.asarray(segment_ids).dtype, jnp.integer)
    ):
        raise ValueError(
            f"TransformerLM: segment_ids must be integers of the tokens' shape {list(tokens.shape)}, got "
            f"{jnp.asarray(segment_ids).dtype}{list(jnp.shape(segment_ids))}"
        )


def token_positions(length: int, decode_index: Any, segment_ids: Any, capacity: int | None):
    """(the next decode index or None, the tokens' positions or None): when decoding from
    `decode_index` (None: the call that creates the cache, from 0), its positions `[T]` and the
    index after them; with `segment_ids` `[batch..., T]` positions restarting at each segment;
    otherwise None, positions 0..T-1."""
    if decode_index is not None:
        return decode_positions(decode_index, length, capacity)
    if segment_ids is not None:
        return None, segment_positions(segment_ids)  # (batch..., T)
    return None, None


def position_embeddings(position_table: Array, positions: Array | None, embedded: Array) -> Array:
    """The learned embeddings of `positions` (`[T]` or `[batch..., T]`; None: 0..T-1 as a static
    slice, whose gradient is a pad where a gather's is a scatter-add), broadcast explicitly to the
    token embeddings' shape `[batch..., T, D]` (TransformerLens's hook_pos_embed)."""
    if positions is None:
        position_embedding = position_table[: embedded.shape[-2]]  # (T, D)
    else:
        position_embedding = jnp.take(position_table, positions, axis=0)  # (T, D) or (batch..., T, D)
    position_embedding = position_embedding.reshape(
        (1,) * (embedded.ndim - position_embedding.ndim) + position_embedding.shape
    )
    return jnp.broadcast_to(position_embedding, embedded.shape)  # (batch..., T, D)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm transformer block on `[batch..., T, d_model]` (output the same shape).

    x + Dropout(MHA(LN(x))), then x + Dropout(MLP(LN(x))), the MLP a GELU of
    width `config.mlp_dim` (default 4 d_model); every option comes from
    `config` (`TransformerConfig`); `layer` picks its window. `head_mask` `[N]` and
    `segment_ids` `[batch..., T]`: the attention's (see `MultiHeadAttention`).
    Hook points (TransformerLens's names, `qkv_jax.interpretability`):
    hook_resid_pre, hook_attn_out, hook_resid_mid, mlp_hook_pre (before the
    GELU; `mlp.hook_pre` by name), mlp_hook_post, hook_mlp_out,
    hook_resid_post, and those of its LayerNorms (`modules.LayerNorm`) and
    attention.
    """

    config: TransformerConfig
    layer: int = 0

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
    def __call__(self, x, deterministic: bool = True, decode: bool = False, head_mask=None, segment_ids=None):
        config = self.config
        width = x.shape[-1]
        hook = functools.partial(_hook, self)
        norm = functools.partial(LayerNorm, dtype=config.dtype, param_dtype=config.param_dtype)
        x = hook("hook_resid_pre", x)
        h = norm(name="attention_norm")(x)
        h = MultiHeadAttention(**attention_options(config, self.layer), name="attention")(
            h, deterministic=deterministic, decode=decode, head_mask=head_mask, segment_ids=segment_ids
        )  # (..., T, D)
        x = hook(
            "hook_resid_mid", x + nn.Dropout(config.dropout_rate)(hook("hook_attn_out", h), deterministic)
        )
        h = norm(name="mlp_norm")(x)
        h = hook(
            "mlp_hook_pre", self._mlp_dense(config.mlp_dim or 4 * width, "mlp_in")(h)
        )  # (..., T, mlp_dim)
        h = self._mlp_dense(width, "mlp_out")(hook("mlp_hook_post", nn.gelu(h)))  # (..., T, D)
        return hook(
            "hook_resid_post", x + nn.Dropout(config.dropout_rate)(hook("hook_mlp_out", h), deterministic)
        )


class TransformerLM(nn.Module):
    """Next-token model: tokens `[batch..., T]` (int) -> logits `[batch..., T, vocab_size]` (f32).

    Token embedding (plus, with `config.positions` "learned", a position
    embedding `position_embedding` `[max_len, d_model]`), `num_layers`
    `TransformerBlock`s, a final LayerNorm and a bias-free head; every option
    is a field of `config` (`TransformerConfig`). Another config for the same
    parameters: `model.clone(config=dataclasses.replace(model.config, ...))`.

    `__call__(tokens, deterministic=True, decode=False, head_mask=None,
    segment_ids=None)`; with `decode` the positions continue from the cache
    (`init_cache`, `generate`); `head_mask` `[num_layers, num_heads]`
    multiplies each head's attention output before W_O (0 ablates it;
    `qkv_jax.finetune.head_ablation_masks`); `segment_ids` `[batch..., T]`
    (int, not when decoding): packed sequences, attention within a segment
    only and positions restarting at 0 where the id changes. Hook points:
    hook_embed, hook_pos_embed (learned positions; broadcast to `[..., T,
    D]`), then the blocks' and the final LayerNorm's (`qkv_jax.interpretability`).
    """

    config: TransformerConfig

    def _decode_index(self, decode: bool) -> Any:
        """The model's `cache_index` variable when decoding from an existing cache, else None
        (the call inside `init` creates it)."""
        if not decode:
            return None
        initialized = self.has_variable("cache", "cache_index")
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        return index if initialized else None

    @nn.compact
    def __call__(
        self, tokens, deterministic: bool = True, decode: bool = False, head_mask=None, segment_ids=None
    ):
        config = self.config
        check_tokens(tokens, decode, config, segment_ids)
        index = self._decode_index(decode)
        new_index, positions = token_positions(
            tokens.shape[-1], None if index is None else index.value, segment_ids, decode_capacity(config)
        )
        if index is not None:
            index.value = new_index
        token_embedding = nn.Embed(
            config.vocab_size,
            config.d_model,
            embedding_init=embedding_init,
            dtype=config.dtype,
            param_dtype=config.param_dtype,
            name="token_embedding",
        )
        x = _hook(self, "hook_embed", token_embedding(tokens))  # (..., T, D)
        if config.positions == "learned":
            table = self.param(
                "position_embedding", embedding_init, (config.max_len, config.d_model), config.param_dtype
            )
            x = x + _hook(self, "hook_pos_embed", position_embeddings(table, positions, x))  # (..., T, D)
        x = nn.Dropout(config.dropout_rate)(x, deterministic)
        if head_mask is not None:
            chex.assert_shape(head_mask, (config.num_layers, config.num_heads))
        for layer in range(config.num_layers):
            layer_mask = None if head_mask is None else head_mask[layer]  # (N,)
            x = TransformerBlock(config, layer, name=f"block_{layer}")(
                x, deterministic, decode, layer_mask, segment_ids
            )  # (..., T, D)
        x = LayerNorm(dtype=config.dtype, param_dtype=config.param_dtype, name="final_norm")(x)
        logits = nn.Dense(
            config.vocab_size,
            use_bias=False,
            dtype=config.dtype,
            param_dtype=config.param_dtype,
            precision=config.precision,
            name="head",
        )(x)  # (..., T, V)
        return logits.astype(jnp.float32)


def decode_positions(index: Array, length: int, capacity: int | None) -> tuple[Array, Array]:
    """The next decode index and the positions `[length]` of the tokens appended at `index`.

    Appending past `capacity` (`decode_capacity`; None: no limit) raises
    (`qkv_jax.modules.advance_cache_index`).
    """
    if capacity is None:
        return index + length, index + jnp.arange(length)
    new_index, _ = advance_cache_index("TransformerLM", index, length, capacity)
    return new_index, index + jnp.arange(length)  # (), (T,)


def init_cache(model: TransformerLM, batch_size: int) -> dict:
    """The decode cache for `batch_size` sequences of up to `model.config.max_len` tokens, zeroed.

    Built from the shapes `model.init(..., decode=True)` would create, without
    computing anything: the same pytree as its "cache" collection, per layer
    the cached keys and values `[batch_size, max_len, K, H]` (with
    `kv_latent_dim`, the latents `[batch_size, max_len, kv_latent_dim]`; a
    layer with a window w < max_len holds w positions, a ring buffer) and
    the int32 scalar `cache_index` of positions filled (and the model's own
    `cache_index`, where the position embeddings continue).
    """
    tokens = jnp.zeros((batch_size, model.config.max_len), jnp.int32)
    shapes = jax.eval_shape(functools.partial(model.init, decode=True), jax.random.PRNGKey(0), tokens)[
        "cache"
    ]
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def kv_cache_bytes(model: TransformerLM, batch_size: int = 1) -> int:
    """Bytes of the decode cache's entries (cached K and V, or latents) over all layers, for
    `batch_size` sequences (ring-buffer layers hold their window, the others max_len)."""
    shapes = jax.eval_shape(functools.partial(init_cache, model, batch_size))
    return sum(
        int(np.prod(leaf.shape)) * leaf.dtype.itemsize
        for path, leaf in jax.tree_util.tree_leaves_with_path(shapes)
        if path[-1].key.startswith("cached_")  # not the position counters
    )


def kv_cache_bytes_per_token(model: TransformerLM) -> int:
    """Bytes the decode cache holds per token over all layers: `kv_cache_bytes` / max_len (with
    ring-buffer layers, the mean over a full cache of max_len positions)."""
    return kv_cache_bytes(model) // model.config.max_len


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
    has_aux: bool = False,
) -> Any:
    """Prefill `prompt` `[B, P]` through `step`, then sample one token per step inside `lax.scan`.

    `step(cache, tokens [B, T]) -> (logits [B, T, V], cache)` is one cached
    decode call (of a linen or an nnx model). Returns `[B, max_new_tokens]`
    int32; the P prompt positions and all but the last sampled token go
    through the cache (P + max_new_tokens - 1 positions). With `has_aux`,
    `step` returns `(logits, cache, aux)` and this returns (tokens, the
    prefill's aux, the decode steps' aux stacked `[max_new_tokens - 1, ...]`).
    """
    chex.assert_rank(prompt, 2)

    def call(cache: Any, tokens: Array) -> tuple[Array, Any, Any]:
        return step(cache, tokens) if has_aux else (*step(cache, tokens), None)

    logits, cache, prefill_aux = call(cache, prompt)  # (B, P, V)
    keys = jax.random.split(rng, max_new_tokens)
    first = sample_logits(logits[:, -1], keys[0], temperature, top_k)  # (B,)

    def body(carry, key):
        token, cache = carry
        logits, cache, aux = call(cache, token[:, None])  # (B, 1, V)
        token = sample_logits(logits[:, -1], key, temperature, top_k)  # (B,)
        return (token, cache), (token, aux)

    _, (rest, steps_aux) = lax.scan(body, (first, cache), keys[1:])  # rest: (max_new_tokens - 1, B)
    tokens = jnp.concatenate([first[:, None], rest.T], axis=1)  # (B, max_new_tokens)
    return (tokens, prefill_aux, steps_aux) if has_aux else tokens


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
    capacity = decode_capacity(model.config)
    if capacity is not None and needed > capacity:
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
