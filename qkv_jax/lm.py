"""A causal language model: transformer blocks and their KV cache, one core for linen and nnx.

  TransformerConfig every option of the block and the model, in one frozen dataclass.
  block_forward     the block's computation, once: x + Dropout(attn(norm(x))), then
                    x + Dropout(MLP(norm(x))), with the norm kinds and placements, the
                    parallel block and the MLP kinds of the config (`BlockLayers`: the
                    face's sub-modules as callables; `CallArgs`: a call's deterministic,
                    decode, head_mask and segment_ids, passed down as one value).
  lm_forward        the model's computation, once: token embeddings (+ learned
                    position embeddings, or RoPE in the attention, or no positions),
                    blocks, the final norm, the vocabulary head (`LMLayers`).
  TransformerBlock, TransformerLM  the linen faces: parameters the linen way, then
                    the core; `qkv_jax.nnx.lm` has the nnx faces over the same core.
  init_cache        the zeroed decode cache of a TransformerLM for a batch size.
  generate          prompts -> new tokens: `qkv_jax.generation.generate` (the bucketed
                    cache, ragged prompts, the filters, end-of-text). The sampling itself,
                    its filters and loops, lives in `qkv_jax.generation`.

Decoding follows flax's `decode=True` convention: the cache lives in the
'cache' collection (each attention layer's `cached_key` and `cached_value`,
sized by `num_kv_heads`, or its MLA `cached_latent`, and `cache_index`; see
`MultiHeadAttention`), created by `init_cache` with room for `max_len`
positions; a layer with a sliding window of w < max_len keys keeps a ring
buffer of w positions instead. `qkv_jax.nnx.TransformerLM` is the same model
as a flax.nnx module (the same parameter and cache trees).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from qkv_jax import generation
from qkv_jax.attention import PrecisionLike
from qkv_jax.hooks import hook as _hook
from qkv_jax.lora import LoRADenseGeneral
from qkv_jax.modules import (
    ATTENTION_LORA_TARGETS,
    OPTION_NAMES,
    QK_NORM_WIDTHS,
    MultiHeadAttention,
    _check_heads,
    _check_lora,
    _check_positive_fields,
    advance_cache_index,
    check_jax_nn_path,
    check_segment_ids,
    check_soft_cap,
    qk_norm_kind,
)
from qkv_jax.norms import Norm, check_norm
from qkv_jax.positions import RopeScaling, check_rope, rotary_dims, segment_positions

Array = jax.Array
Dtype = Any

__all__ = [
    "LORA_TARGETS",
    "POSITIONS",
    "NORM_PLACEMENTS",
    "MLP_ACTIVATIONS",
    "RENAMED_FIELDS",
    "TransformerConfig",
    "head_dim_of",
    "layer_windows",
    "attention_options",
    "decode_capacity",
    "check_tokens",
    "token_positions",
    "position_embeddings",
    "check_head_mask",
    "BlockLayers",
    "block_norms",
    "mlp_projections",
    "CallArgs",
    "block_forward",
    "LMLayers",
    "lm_forward",
    "TransformerBlock",
    "TransformerLM",
    "init_cache",
    "kv_cache_bytes",
    "kv_cache_bytes_per_token",
    "decode_positions",
    "generate",
]

embedding_init = nn.initializers.normal(stddev=0.02)
# Where a TransformerLM's LoRA adapters can go: the attention projections, and "mlp" (mlp_in and mlp_out).
LORA_TARGETS = (*ATTENTION_LORA_TARGETS, "mlp")
# TransformerConfig.positions: learned absolute embeddings, rotary embeddings in the attention, none.
POSITIONS = ("learned", "rope", "none")
# TransformerConfig.norm_placement: the norms before each sublayer, after it, or both.
NORM_PLACEMENTS = ("pre", "post", "sandwich")
# TransformerConfig.mlp_activation: its name -> the function (gelu_tanh is flax's nn.gelu).
MLP_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}
# Old keyword -> new field of TransformerConfig (the old one still works, with a DeprecationWarning).
RENAMED_FIELDS = {"sinks": "use_sinks", "dropout_rate": "residual_dropout_rate"}


def _renamed_keywords(cls: type) -> type:
    """`cls` whose constructor also takes the old keywords of `RENAMED_FIELDS`, each with a
    DeprecationWarning naming the new one; given, the old keyword sets the field
    (`dataclasses.replace(config, sinks=True)` passes use_sinks too)."""
    generated = vars(cls)["__init__"]

    @functools.wraps(generated)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for old, new in RENAMED_FIELDS.items():
            if old not in kwargs:
                continue
            warnings.warn(
                f"{cls.__name__}: {old}= is renamed {new}= (the old keyword will be removed)",
                DeprecationWarning,
                stacklevel=2,
            )
            kwargs[new] = kwargs.pop(old)
        generated(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]
    return cls


@_renamed_keywords
@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Every option of `TransformerBlock` and `TransformerLM`, declared once (as flax's lm1b does).

    A new option is a field here, its check in `__post_init__` and its
    computation in `block_forward` / `lm_forward` (or one entry in
    `attention_options`), shared by the linen and the nnx faces; the training
    tasks build this from a config's `model` section by field name
    (`qkv_jax.tasks.transformer`). Its checks run here, once, when it is built;
    `dataclasses.replace(config, causal=False)` is a changed copy, checked again.
    The old keywords `sinks` and `dropout_rate` still work, with a
    DeprecationWarning (`RENAMED_FIELDS`).

    Attributes:
      vocab_size, num_layers, d_model: sizes; num_heads must divide d_model
        unless head_dim is set.
      head_dim: each head's width (None: d_model // num_heads); queries have
        num_heads * head_dim features, keys and values num_kv_heads * head_dim,
        and W_O maps them back to d_model.
      num_heads, num_kv_heads, kv_latent_dim: the attention (MHA; GQA/MQA with
        num_kv_heads < num_heads; MLA with a latent; see `MultiHeadAttention`).
      max_len: positions of the embedding table and of the decode cache.
      mlp_dim: MLP hidden width (default 4 d_model).
      causal: causal self-attention (False: every position sees every other).
      residual_dropout_rate, attention_dropout_rate: dropout on embeddings and
        residual branches, and on the attention weights, when not deterministic.
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
        head's query and key over head_dim), "rms" (an RMSNorm) or
        "rms_offset" (Gemma 3's x_hat * (1 + scale)); the parameters are
        query_ln/key_ln either way, the epsilon norm_epsilon.
      qk_norm_width: "head" (each head's q and k over head_dim, one gain
        [head_dim] for all heads) or "full" (q over its num_heads * head_dim
        features, k over num_kv_heads * head_dim; OLMo 2).
      attn_logits_soft_cap: c, the attention logits become c * tanh(logits / c)
        (None: off).
      attention_scale: the factor of every attention logit q.k (jax.nn's
        `scale`): None is 1/sqrt(head_dim); 1.0 leaves the logits unscaled.
        Applied before the soft cap, with or without normalize_qk.
      use_sinks: a learned sink logit per head and layer (`sinks`
        `[num_heads]`, zero at init) in the softmax's denominator: it takes
        weight and gives no value.
      rope_scaling: a `qkv_jax.positions.RopeScaling` ("linear", "llama3",
        "yarn") of every RoPE layer, or only of the global layers when
        local_rope_base is set. Read with "rope".
      local_rope_base: the RoPE base of the windowed layers, unscaled (Gemma
        3); None: every layer uses rope_base (and rope_scaling).
      norm, norm_epsilon: the kind of every norm of the blocks and of the
        final norm (`qkv_jax.norms.NORMS`: "layernorm", "rms", "rms_offset")
        and the epsilon of those and of the QK-norm.
      norm_placement: "pre" x + f(norm(x)); "post" x + norm(f(x)) (OLMo 2);
        "sandwich" x + post_norm(f(pre_norm(x))) (Gemma 2 and 3). The pre
        norms are attention_norm and mlp_norm, the post norms
        attention_post_norm and mlp_post_norm.
      parallel_block: x + attn(attention_norm(x)) + mlp(mlp_norm(x))
        (GPT-NeoX's parallel residual).
      mlp_activation: "gelu_tanh" (flax's nn.gelu), "gelu" (exact), "silu",
        "relu" (`MLP_ACTIVATIONS`).
      gated_mlp: mlp_out(act(mlp_gate(h)) * mlp_in(h)) (SwiGLU with "silu",
        GeGLU with a GELU); mlp_gate is a kernel [d_model, mlp_dim].
      mlp_bias, qkv_bias, out_bias: the biases of the MLP projections, of the
        query/key/value projections, and of W_O.
      tie_embeddings: the head is the token embedding's transpose (no `head`
        parameter).
      embedding_scale: the token embeddings times this (Gemma: sqrt(d_model)),
        cast to the computation dtype first; None: 1.
      final_logit_soft_cap: c, the logits become c * tanh(logits / c) (Gemma 2;
        None: off).

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
    residual_dropout_rate: float = 0.0
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
    use_sinks: bool = False
    head_dim: int | None = None
    norm: str = "layernorm"
    norm_epsilon: float = 1e-6
    norm_placement: str = "pre"
    parallel_block: bool = False
    mlp_activation: str = "gelu_tanh"
    gated_mlp: bool = False
    mlp_bias: bool = True
    qkv_bias: bool = True
    out_bias: bool = True
    tie_embeddings: bool = False
    embedding_scale: float | None = None
    qk_norm_width: str = "head"
    rope_scaling: RopeScaling | None = None
    local_rope_base: float | None = None
    final_logit_soft_cap: float | None = None

    @property
    def decode_capacity(self) -> int | None:
        """Positions a decode cache can take (`decode_capacity`; None: no limit)."""
        return decode_capacity(self)

    @property
    def sinks(self) -> bool:
        """Deprecated: `use_sinks`."""
        warnings.warn("TransformerConfig.sinks is renamed use_sinks", DeprecationWarning, stacklevel=2)
        return self.use_sinks

    @property
    def dropout_rate(self) -> float:
        """Deprecated: `residual_dropout_rate`."""
        warnings.warn(
            "TransformerConfig.dropout_rate is renamed residual_dropout_rate",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.residual_dropout_rate

    def __post_init__(self):
        owner = "TransformerConfig"
        _check_lora(
            owner, self.lora_rank, self.lora_alpha, self.lora_targets, LORA_TARGETS, self.kv_latent_dim
        )
        _check_positive_fields(
            owner,
            self,
            "vocab_size num_layers d_model num_heads num_kv_heads max_len mlp_dim kv_latent_dim head_dim",
        )
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(
                f"{owner}: num_heads={self.num_heads} must divide d_model={self.d_model} (or set head_dim)"
            )
        _check_heads(owner, self.num_heads, self.num_kv_heads)
        if not 0.0 <= self.residual_dropout_rate < 1.0:
            raise ValueError(
                f"{owner}: residual_dropout_rate={self.residual_dropout_rate!r} must be in [0, 1)"
            )
        if not 0.0 <= self.attention_dropout_rate < 1.0:
            raise ValueError(
                f"{owner}: attention_dropout_rate={self.attention_dropout_rate!r} must be in [0, 1)"
            )
        _check_attention_variants(owner, self)
        _check_block_variants(owner, self)


def head_dim_of(config: TransformerConfig) -> int:
    """Each head's width: `config.head_dim`, else d_model // num_heads."""
    return config.head_dim or config.d_model // config.num_heads


def _check_number(owner: str, **numbers: Any) -> None:
    """ValueError naming the field unless each value is None or a finite number > 0."""
    for name, value in numbers.items():
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf
        ):
            raise ValueError(f"{owner}: {name}={value!r} must be a finite number > 0 (or None)")


def _check_choice(owner: str, name: str, value: Any, choices: Any) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{owner}: {name}={value!r} must be one of {', '.join(choices)}")


def _check_block_variants(owner: str, config: TransformerConfig) -> None:
    """The norms, the MLP, the biases, the embeddings and the logit cap: ValueError naming the field."""
    check_norm(owner, config.norm)
    if config.norm_epsilon is None:
        raise ValueError(f"{owner}: norm_epsilon=None must be a finite number > 0")
    _check_number(
        owner,
        norm_epsilon=config.norm_epsilon,
        embedding_scale=config.embedding_scale,
        final_logit_soft_cap=config.final_logit_soft_cap,
    )
    _check_choice(owner, "norm_placement", config.norm_placement, NORM_PLACEMENTS)
    _check_choice(owner, "mlp_activation", config.mlp_activation, tuple(MLP_ACTIVATIONS))
    flags = ("parallel_block", "gated_mlp", "mlp_bias", "qkv_bias", "out_bias", "tie_embeddings", "use_sinks")
    for name in flags:
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{owner}: {name}={getattr(config, name)!r} must be True or False")


def _check_attention_variants(owner: str, config: TransformerConfig) -> None:
    """positions, RoPE, window, normalize_qk, the soft cap and sinks: ValueError naming the field."""
    if config.positions not in POSITIONS:
        raise ValueError(f"{owner}: positions={config.positions!r} must be one of {', '.join(POSITIONS)}")
    if config.positions == "rope":
        check_rope(owner, config.rope_base, config.rope_fraction)
        rotary_dims(head_dim_of(config), config.rope_fraction, owner)
        if config.kv_latent_dim is not None:
            raise ValueError(
                f"{owner}: positions='rope' with kv_latent_dim={config.kv_latent_dim}: RoPE with MLA is not "
                "defined without DeepSeek-V2's decoupled rotary key, which qkv_jax does not have"
            )
    for name in ("rope_scaling", "local_rope_base"):
        if getattr(config, name) is not None and config.positions != "rope":
            raise ValueError(
                f"{owner}: {name}={getattr(config, name)!r} needs positions='rope', got {config.positions!r}"
            )
    if config.rope_scaling is not None and not isinstance(config.rope_scaling, RopeScaling):
        raise ValueError(
            f"{owner}: rope_scaling={config.rope_scaling!r} must be a qkv_jax.positions.RopeScaling or None"
        )
    _check_number(owner, local_rope_base=config.local_rope_base)
    _window_pattern(config)  # checked without expanding it over (possibly very many) layers
    _check_choice(owner, "qk_norm_width", config.qk_norm_width, QK_NORM_WIDTHS)
    if qk_norm_kind(owner, config.normalize_qk) and config.kv_latent_dim is not None and config.absorb_latent:
        raise ValueError(
            f"{owner}: normalize_qk={config.normalize_qk!r} with kv_latent_dim={config.kv_latent_dim} needs "
            "absorb_latent=False (a norm of the keys does not fold into the query)"
        )
    check_soft_cap(owner, config.attn_logits_soft_cap)
    _check_number(owner, attention_scale=config.attention_scale)
    check_jax_nn_path(owner, config.attention_implementation, config.attn_logits_soft_cap, config.use_sinks)


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


# The attention options a TransformerConfig field of the same name sets (a new attention option
# that the model exposes needs only its field here, by that name).
_SHARED_OPTIONS = tuple(
    name for name in OPTION_NAMES if name in {f.name for f in dataclasses.fields(TransformerConfig)}
)


def attention_options(config: TransformerConfig, layer: int = 0) -> dict[str, Any]:
    """The attention's fields of block `layer` from `config`, shared by the linen and the nnx
    `TransformerBlock`: every `AttentionOptions` field that `TransformerConfig` has by the same
    name, and those it names or computes otherwise: window w becomes local_window_size (w - 1, 0)
    (causal) or (w - 1, w - 1); a windowed layer takes local_rope_base (unscaled) when it is set."""
    window = layer_windows(config)[layer]
    rope = config.positions == "rope"
    local = window is not None and config.local_rope_base is not None
    return dict(
        {name: getattr(config, name) for name in _SHARED_OPTIONS},
        local_window_size=None if window is None else (window - 1, 0 if config.causal else window - 1),
        rope_base=(config.local_rope_base if local else config.rope_base) if rope else None,
        rope_scaling=None if local or not rope else config.rope_scaling,
        scale=config.attention_scale,
        use_bias=config.qkv_bias,
        qk_norm_epsilon=config.norm_epsilon,
        is_causal=config.causal,
        dropout_rate=config.attention_dropout_rate,
        lora_targets=tuple(t for t in config.lora_targets if t != "mlp"),
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


def check_head_mask(owner: str, head_mask: Any, shape: tuple[int, ...]) -> None:
    """ValueError naming `owner` unless `head_mask` is None or has the shape `shape` (names in the
    message: (num_layers, num_heads) for a model, (num_heads,) for a block)."""
    if head_mask is not None and tuple(jnp.shape(head_mask)) != shape:
        what = "(num_layers, num_heads)" if len(shape) == 2 else "(num_heads,)"
        raise ValueError(
            f"{owner}: head_mask has shape {tuple(jnp.shape(head_mask))}, expected {what} = {shape}"
        )


class CallArgs(NamedTuple):
    """The arguments of one call of a model or a block, passed down as one value: to each block
    (`head_mask` `[num_layers, num_heads]`, one row per block) and from a block to its attention
    (`head_mask` `[num_heads]`). `segment_ids` `[batch..., T]`: packed sequences."""

    deterministic: bool = True
    decode: bool = False
    head_mask: Any = None
    segment_ids: Any = None


class BlockLayers(NamedTuple):
    """A block's sub-modules as callables, built by a face (linen or nnx) for `block_forward`.

    norm: `(name, x) -> x` through the norm `name` (attention_norm, mlp_norm,
      attention_post_norm, mlp_post_norm).
    attention: `(h, call: CallArgs) -> [..., T, D]`.
    dense: `(name, h) -> h` through the MLP projection `name` (mlp_in, mlp_gate, mlp_out).
    dropout: `(x, deterministic) -> x`, residual dropout.
    hook: `(name, x) -> x` through the block's hook point `name`.
    """

    norm: Callable[[str, Array], Array]
    attention: Callable[..., Array]
    dense: Callable[[str, Array], Array]
    dropout: Callable[[Array, bool], Array]
    hook: Callable[[str, Array], Array]


def block_norms(config: TransformerConfig) -> tuple[str, ...]:
    """The names of a block's norms under `config.norm_placement`, in the order they run."""
    pre = ("attention_norm", "mlp_norm") if config.norm_placement != "post" else ()
    post = ("attention_post_norm", "mlp_post_norm") if config.norm_placement != "pre" else ()
    return (*pre, *post)


def mlp_projections(config: TransformerConfig) -> dict[str, tuple[int, int]]:
    """A block's MLP projections: name -> (input width, output width)."""
    width, hidden = config.d_model, config.mlp_dim or 4 * config.d_model
    gate = {"mlp_gate": (width, hidden)} if config.gated_mlp else {}
    return {"mlp_in": (width, hidden), "mlp_out": (hidden, width), **gate}


def _sublayer(config: TransformerConfig, layers: BlockLayers, name: str, x: Array, f: Callable) -> Array:
    """f between the sublayer's norms: f(norm(x)) ("pre"), norm(f(x)) ("post"), or both ("sandwich")."""
    h = layers.norm(f"{name}_norm", x) if config.norm_placement != "post" else x  # (..., T, D)
    h = f(h)  # (..., T, D)
    return layers.norm(f"{name}_post_norm", h) if config.norm_placement != "pre" else h


def _mlp(config: TransformerConfig, layers: BlockLayers, h: Array) -> Array:
    """mlp_out(act(mlp_in(h))), or gated mlp_out(act(mlp_gate(h)) * mlp_in(h)); `[..., T, D]`."""
    hook, dense = layers.hook, layers.dense
    pre = hook("mlp_hook_pre", dense("mlp_gate" if config.gated_mlp else "mlp_in", h))  # (..., T, F)
    post = MLP_ACTIVATIONS[config.mlp_activation](pre)  # (..., T, F)
    if config.gated_mlp:
        post = post * hook("mlp_hook_pre_linear", dense("mlp_in", h))  # (..., T, F)
    return dense("mlp_out", hook("mlp_hook_post", post))  # (..., T, D)


def block_forward(config: TransformerConfig, layers: BlockLayers, x: Array, call: CallArgs) -> Array:
    """One transformer block on `x` `[batch..., T, d_model]` (the output the same shape).

    x + Dropout(attn(norm(x))), then x + Dropout(MLP(norm(x))), the norms
    placed by `config.norm_placement`; with `config.parallel_block` both
    sublayers read x and the output is x + attn + MLP (hook_resid_mid is then
    x + attn). Hook points (TransformerLens's names through
    `qkv_jax.interpretability.cache.hook_name`): hook_resid_pre,
    hook_attn_out, hook_resid_mid, mlp_hook_pre (before the activation; the
    gate's with gated_mlp), mlp_hook_pre_linear (gated: mlp_in's output),
    mlp_hook_post, hook_mlp_out, hook_resid_post. `call.head_mask` `[num_heads]`.
    """
    if x.ndim < 2 or x.shape[-1] != config.d_model:
        raise ValueError(
            f"TransformerBlock: x must have shape [batch..., T, d_model={config.d_model}], "
            f"got {list(x.shape)}"
        )
    check_head_mask("TransformerBlock", call.head_mask, (config.num_heads,))
    hook = layers.hook
    x = hook("hook_resid_pre", x)  # (..., T, D)
    h = _sublayer(config, layers, "attention", x, lambda h: layers.attention(h, call))  # (..., T, D)
    mid = hook("hook_resid_mid", x + layers.dropout(hook("hook_attn_out", h), call.deterministic))
    h = _sublayer(
        config, layers, "mlp", x if config.parallel_block else mid, lambda h: _mlp(config, layers, h)
    )
    return hook("hook_resid_post", mid + layers.dropout(hook("hook_mlp_out", h), call.deterministic))


class LMLayers(NamedTuple):
    """A model's sub-modules as callables, built by a face for `lm_forward`.

    embed: tokens `[..., T]` -> token embeddings `[..., T, D]`.
    position_table: `() -> [max_len, D]` (read with learned positions only).
    block: `(layer, x, call: CallArgs) -> x`, the call's head_mask that layer's row `[N]`.
    final_norm: `x -> x`.
    embedding_table: `() -> [V, D]`, the token embedding (read by a tied head).
    head: `x -> [..., T, V]` (None with tie_embeddings).
    dropout, hook: as `BlockLayers`'.
    """

    embed: Callable[[Array], Array]
    position_table: Callable[[], Array]
    block: Callable[..., Array]
    final_norm: Callable[[Array], Array]
    embedding_table: Callable[[], Array]
    head: Callable[[Array], Array] | None
    dropout: Callable[[Array, bool], Array]
    hook: Callable[[str, Array], Array]


# Rows of a tied head computed as `table @ x^T`: XLA:CPU reads the [V, D] table in its own order
# instead of packing it per call, 0.7x the time of `x @ table^T` at 8 rows (a decode step). The
# transpose back is kept apart by an optimization barrier: without it XLA folds it into the dot,
# which is `x @ table^T` again (42 ms against 31 ms at 8 rows of Qwen2.5-0.5B's [151936, 896] table).
FEW_HEAD_ROWS = 64


def tied_head(x: Array, table: Array, precision: Any) -> Array:
    """Logits `[..., T, V]` of `x` `[..., T, D]` against the token embedding `table` `[V, D]`."""
    rows = math.prod(x.shape[:-1])
    if rows > FEW_HEAD_ROWS:
        return jnp.einsum("...d,vd->...v", x, table, precision=precision)  # (..., T, V)
    flat = x.reshape(rows, x.shape[-1])  # (R, D)
    logits = jax.lax.optimization_barrier(jnp.einsum("vd,rd->vr", table, flat, precision=precision))  # (V, R)
    return logits.T.reshape(*x.shape[:-1], table.shape[0])  # (..., T, V)


def lm_forward(
    config: TransformerConfig, layers: LMLayers, tokens: Array, call: CallArgs, decode_index: Any = None
) -> tuple[Array, Any]:
    """The language model on `tokens` `[batch..., T]` (int): `(logits [batch..., T, V] float32,
    the next decode index or None)`.

    `decode_index`: the model's `cache_index` when decoding from a cache (None:
    not decoding, or the call that creates the cache). Embeddings (times
    `embedding_scale`; hook_embed), learned positions (hook_pos_embed,
    broadcast to `[..., T, D]`), residual dropout, the blocks (`call.head_mask`
    `[num_layers, num_heads]`, row l to block l), the final norm, the head
    (or the token embedding's transpose with tie_embeddings), float32, then
    the final soft cap.
    """
    check_tokens(tokens, call.decode, config, call.segment_ids)
    check_head_mask("TransformerLM", call.head_mask, (config.num_layers, config.num_heads))
    new_index, positions = token_positions(
        tokens.shape[-1], decode_index, call.segment_ids, decode_capacity(config)
    )
    x = layers.embed(tokens)  # (..., T, D)
    if config.embedding_scale is not None:
        x = x * jnp.asarray(config.embedding_scale, x.dtype)  # the factor in the compute dtype, as HF
    x = layers.hook("hook_embed", x)
    if config.positions == "learned":
        x = x + layers.hook("hook_pos_embed", position_embeddings(layers.position_table(), positions, x))
    x = layers.dropout(x, call.deterministic)
    for layer in range(config.num_layers):
        layer_mask = None if call.head_mask is None else call.head_mask[layer]  # (N,)
        x = layers.block(layer, x, call._replace(head_mask=layer_mask))  # (..., T, D)
    x = layers.final_norm(x)
    if layers.head is None:
        x, table = nn.dtypes.promote_dtype(x, layers.embedding_table(), dtype=config.dtype)
        logits = tied_head(x, table, config.precision)  # (..., T, V)
    else:
        logits = layers.head(x)  # (..., T, V)
    logits = logits.astype(jnp.float32)
    cap = config.final_logit_soft_cap
    return (logits if cap is None else cap * jnp.tanh(logits / cap)), new_index


def _norm_options(config: TransformerConfig) -> dict[str, Any]:
    return dict(
        kind=config.norm, epsilon=config.norm_epsilon, dtype=config.dtype, param_dtype=config.param_dtype
    )


class TransformerBlock(nn.Module):
    """A transformer block on `[batch..., T, d_model]` (output the same shape): `block_forward`'s
    linen face.

    Every option comes from `config` (`TransformerConfig`); `layer` picks its
    window. `head_mask` `[N]` and `segment_ids` `[batch..., T]`: the
    attention's (see `MultiHeadAttention`). Sub-modules: attention_norm,
    attention, mlp_norm, mlp_in, (mlp_gate), mlp_out, and the post norms with
    norm_placement "post" or "sandwich" (`block_norms`); hook points as
    `block_forward`'s, and those of its norms (`qkv_jax.norms`) and attention.
    """

    config: TransformerConfig
    layer: int = 0

    def _mlp_dense(self, name: str, h: Array) -> Array:
        """The MLP projection `name`: `nn.Dense`, or with "mlp" in `lora_targets` its LoRA form
        (the same `kernel` `[in, out]` and `bias`)."""
        config = self.config
        features = mlp_projections(config)[name][1]
        options = dict(
            use_bias=config.mlp_bias,
            dtype=config.dtype,
            param_dtype=config.param_dtype,
            precision=config.precision,
            name=name,
        )
        if config.lora_rank and "mlp" in config.lora_targets:
            return LoRADenseGeneral(features, rank=config.lora_rank, alpha=config.lora_alpha, **options)(h)
        return nn.Dense(features, **options)(h)

    @nn.compact
    def __call__(self, x, deterministic: bool = True, decode: bool = False, head_mask=None, segment_ids=None):
        config = self.config

        def attention(h: Array, call: CallArgs) -> Array:
            return MultiHeadAttention(**attention_options(config, self.layer), name="attention")(
                h, **call._asdict()
            )

        layers = BlockLayers(
            norm=lambda name, h: Norm(**_norm_options(config), name=name)(h),
            attention=attention,
            dense=self._mlp_dense,
            dropout=lambda h, deterministic: nn.Dropout(config.residual_dropout_rate)(h, deterministic),
            hook=functools.partial(_hook, self),
        )
        return block_forward(config, layers, x, CallArgs(deterministic, decode, head_mask, segment_ids))


class TransformerLM(nn.Module):
    """Next-token model: tokens `[batch..., T]` (int) -> logits `[batch..., T, vocab_size]` (f32):
    `lm_forward`'s linen face.

    Token embedding (plus, with `config.positions` "learned", a position
    embedding `position_embedding` `[max_len, d_model]`), `num_layers`
    `TransformerBlock`s, a final norm and a bias-free head (none with
    tie_embeddings); every option is a field of `config` (`TransformerConfig`).
    Another config for the same parameters:
    `model.clone(config=dataclasses.replace(model.config, ...))`.

    `__call__(tokens, deterministic=True, decode=False, head_mask=None,
    segment_ids=None)`; with `decode` the positions continue from the cache
    (`init_cache`, `generate`); `head_mask` `[num_layers, num_heads]`
    multiplies each head's attention output before W_O (0 ablates it;
    `qkv_jax.finetune.head_ablation_masks`); `segment_ids` `[batch..., T]`
    (int, not when decoding): packed sequences, attention within a segment
    only and positions restarting at 0 where the id changes. Hook points:
    hook_embed, hook_pos_embed (learned positions; broadcast to `[..., T,
    D]`), then the blocks' and the final norm's (`qkv_jax.interpretability`).
    """

    config: TransformerConfig

    def _decode_index(self, decode: bool) -> Any:
        """The model's `cache_index` variable when decoding, and whether it existed before this
        call (the call inside `init` creates it); None when not decoding."""
        if not decode:
            return None, False
        initialized = self.has_variable("cache", "cache_index")
        return self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32)), initialized

    @nn.compact
    def __call__(
        self, tokens, deterministic: bool = True, decode: bool = False, head_mask=None, segment_ids=None
    ):
        config = self.config
        index, initialized = self._decode_index(decode)
        token_embedding = nn.Embed(
            config.vocab_size,
            config.d_model,
            embedding_init=embedding_init,
            dtype=config.dtype,
            param_dtype=config.param_dtype,
            name="token_embedding",
        )
        head = None
        if not config.tie_embeddings:
            head = nn.Dense(
                config.vocab_size,
                use_bias=False,
                dtype=config.dtype,
                param_dtype=config.param_dtype,
                precision=config.precision,
                name="head",
            )
        layers = LMLayers(
            embed=token_embedding,
            position_table=lambda: self.param(
                "position_embedding", embedding_init, (config.max_len, config.d_model), config.param_dtype
            ),
            block=lambda layer, x, call: TransformerBlock(config, layer, name=f"block_{layer}")(x, *call),
            final_norm=Norm(**_norm_options(config), name="final_norm"),
            embedding_table=lambda: token_embedding.embedding,
            head=head,
            dropout=lambda x, deterministic: nn.Dropout(config.residual_dropout_rate)(x, deterministic),
            hook=functools.partial(_hook, self),
        )
        call = CallArgs(deterministic, decode, head_mask, segment_ids)
        logits, new_index = lm_forward(config, layers, tokens, call, index.value if initialized else None)
        if index is not None and new_index is not None:
            index.value = new_index
        return logits


def decode_positions(index: Array, length: int, capacity: int | None) -> tuple[Array, Array]:
    """The next decode index and the positions `[length]` of the tokens appended at `index`.

    Appending past `capacity` (`decode_capacity`; None: no limit) raises
    (`qkv_jax.modules.advance_cache_index`).
    """
    if capacity is None:
        return index + length, index + jnp.arange(length)
    new_index, _ = advance_cache_index("TransformerLM", index, length, capacity)
    return new_index, index + jnp.arange(length)  # (), (T,)


def init_cache(model: TransformerLM, batch_size: int, length: int | None = None) -> dict:
    """The decode cache for `batch_size` sequences of up to `length` tokens (None:
    `model.config.max_len`), zeroed (`qkv_jax.generation.zeroed_cache`).

    The same pytree as `model.init(..., decode=True)`'s "cache" collection, per layer the cached
    keys and values `[batch_size, length, K, H]` (with `kv_latent_dim`, the latents
    `[batch_size, length, kv_latent_dim]`; a layer with a window w < length holds w positions,
    a ring buffer) and the int32 scalar `cache_index` of positions filled (and the model's own
    `cache_index`, where the position embeddings continue).
    """
    return generation.zeroed_cache(model, batch_size, length or model.config.max_len)


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


def generate(
    model: TransformerLM,
    params: Any,
    prompt: Any,
    max_new_tokens: int,
    *,
    rng: Array | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    return_logprobs: bool = False,
) -> Any:
    """Samples `max_new_tokens` tokens after each row of `prompt`: `qkv_jax.generation.generate`
    (a `[B, P]` array returns `[B, max_new_tokens]` int32; a list of rows of different lengths, a
    list). `temperature` 0 is greedy (and needs no `rng`; sampling without one is a ValueError).
    """
    return generation.generate(
        model,
        params,
        prompt,
        max_new_tokens,
        rng=rng,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_token_id=eos_token_id,
        return_logprobs=return_logprobs,
    )
