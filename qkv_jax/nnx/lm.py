"""The language model as native `flax.nnx` modules, from the linen model's `TransformerConfig`.

TransformerBlock, TransformerLM  the linen `qkv_jax.lm` model from the same
                    `TransformerConfig`, with `init_cache` and decoding.
generate            prompts -> new tokens for the nnx `TransformerLM` (`qkv_jax.generation`).
linen_to_nnx, nnx_to_linen  parameters (and decode caches) between the linen
                    modules' variables and these modules, both ways.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from qkv_jax import generation, lm
from qkv_jax.nnx.attention import LoRALinearGeneral, MultiHeadAttention
from qkv_jax.nnx.hooks import HookPoint, hooks_of
from qkv_jax.nnx.norms import Norm

Array = jax.Array
Dtype = Any

__all__ = ["TransformerBlock", "TransformerLM", "generate", "linen_to_nnx", "nnx_to_linen"]

# TransformerBlock's hook points (attributes named as the linen block's HookPoints).
_BLOCK_HOOKS = (
    "hook_resid_pre",
    "hook_attn_out",
    "hook_resid_mid",
    "mlp_hook_pre",
    "mlp_hook_post",
    "hook_mlp_out",
    "hook_resid_post",
)


def _norm(config: lm.TransformerConfig, rngs: nnx.Rngs) -> Norm:
    return Norm(
        config.d_model,
        kind=config.norm,
        epsilon=config.norm_epsilon,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        rngs=rngs,
    )


class TransformerBlock(nnx.Module):
    """`qkv_jax.lm.TransformerBlock` as an nnx module: `lm.block_forward` over nnx sub-modules of
    the linen block's names.

    `TransformerBlock(config, *, rngs, layer=0)` (`layer` picks its window);
    `__call__(x, deterministic=True, decode=False, head_mask=None,
    segment_ids=None)` on `[batch..., T, d_model]`.
    """

    def __init__(self, config: lm.TransformerConfig, *, rngs: nnx.Rngs, layer: int = 0):
        self.config = config
        norms = lm.block_norms(config)
        if "attention_norm" in norms:
            self.attention_norm = _norm(config, rngs)
        self.attention = MultiHeadAttention(
            in_features=config.d_model, decode=False, rngs=rngs, **lm.attention_options(config, layer)
        )
        if "mlp_norm" in norms:
            self.mlp_norm = _norm(config, rngs)
        dense: Any = nnx.Linear
        options: dict[str, Any] = dict(
            use_bias=config.mlp_bias,
            dtype=config.dtype,
            param_dtype=config.param_dtype,
            precision=config.precision,
            rngs=rngs,
        )
        if config.lora_rank and "mlp" in config.lora_targets:
            dense = functools.partial(LoRALinearGeneral, rank=config.lora_rank, alpha=config.lora_alpha)
        for name, (width_in, width_out) in lm.mlp_projections(config).items():
            setattr(self, name, dense(width_in, width_out, **options))
        for name in norms:
            if name.endswith("_post_norm"):
                setattr(self, name, _norm(config, rngs))
        self.dropout = nnx.Dropout(config.residual_dropout_rate, rngs=rngs)
        hooks = _BLOCK_HOOKS + (("mlp_hook_pre_linear",) if config.gated_mlp else ())
        for name in hooks:
            setattr(self, name, HookPoint())

    def _layers(self) -> lm.BlockLayers:
        return lm.BlockLayers(
            norm=lambda name, x: getattr(self, name)(x),
            attention=lambda h, call: self.attention(h, **call._asdict()),
            dense=lambda name, h: getattr(self, name)(h),
            dropout=lambda x, deterministic: self.dropout(x, deterministic=deterministic),
            hook=hooks_of(self),
        )

    def __call__(
        self, x: Array, deterministic: bool = True, decode: bool = False, head_mask=None, segment_ids=None
    ) -> Array:
        call = lm.CallArgs(deterministic, decode, head_mask, segment_ids)
        return lm.block_forward(self.config, self._layers(), x, call)


class TransformerLM(nnx.Module):
    """`qkv_jax.lm.TransformerLM` as an nnx module, built from the same `TransformerConfig`:
    `lm.lm_forward` over nnx sub-modules.

    `TransformerLM(config, *, rngs)`; `__call__(tokens, deterministic=True,
    decode=False, head_mask=None, segment_ids=None)`: int tokens `[batch...,
    T]` -> float32 logits `[batch..., T, vocab_size]`. Attributes
    `token_embedding`, `position_embedding` (learned positions only),
    `block_0` ... `block_{L-1}`, `final_norm`, `head` (not with
    tie_embeddings): the linen model's parameter names (`linen_to_nnx`,
    `nnx_to_linen`). `init_cache(batch_size)` makes room for
    `config.max_len` positions; decoding continues the positions from
    `cache_index`.
    """

    def __init__(self, config: lm.TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.token_embedding = nnx.Embed(
            config.vocab_size,
            config.d_model,
            embedding_init=lm.embedding_init,
            dtype=config.dtype,
            param_dtype=config.param_dtype,
            rngs=rngs,
        )
        self.hook_embed = HookPoint()
        self.position_embedding: nnx.Param | None = nnx.data(None)
        if config.positions == "learned":
            self.position_embedding = nnx.Param(
                lm.embedding_init(rngs.params(), (config.max_len, config.d_model), config.param_dtype)
            )
            self.hook_pos_embed = HookPoint()
        for layer in range(config.num_layers):
            setattr(self, f"block_{layer}", TransformerBlock(config, rngs=rngs, layer=layer))
        self.final_norm = _norm(config, rngs)
        self.head: nnx.Linear | None = nnx.data(None)
        if not config.tie_embeddings:
            self.head = nnx.Linear(
                config.d_model,
                config.vocab_size,
                use_bias=False,
                dtype=config.dtype,
                param_dtype=config.param_dtype,
                precision=config.precision,
                rngs=rngs,
            )
        self.dropout = nnx.Dropout(config.residual_dropout_rate, rngs=rngs)
        self.cache_index: nnx.Cache | None = nnx.data(None)

    def blocks(self) -> list[TransformerBlock]:
        return [getattr(self, f"block_{layer}") for layer in range(self.config.num_layers)]

    def init_cache(self, batch_size: int, dtype: Dtype | None = None, max_length: int | None = None) -> None:
        """A zeroed cache for `batch_size` sequences of up to `max_length` tokens (None:
        `config.max_len`), in `dtype` (default: the computation dtype, else the parameters')."""
        config = self.config
        dtype = dtype or config.dtype or config.param_dtype
        length = max_length or config.max_len
        for block in self.blocks():
            block.attention.init_cache((batch_size, length, config.d_model), dtype)
        self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))

    def _layers(self) -> lm.LMLayers:
        blocks = self.blocks()

        def position_table() -> Array:
            assert self.position_embedding is not None  # read with learned positions only
            return self.position_embedding[...]

        return lm.LMLayers(
            embed=self.token_embedding,
            position_table=position_table,
            block=lambda layer, x, call: blocks[layer](x, *call),
            final_norm=self.final_norm,
            embedding_table=lambda: self.token_embedding.embedding[...],
            head=self.head,
            dropout=lambda x, deterministic: self.dropout(x, deterministic=deterministic),
            hook=hooks_of(self),
        )

    def __call__(
        self,
        tokens: Array,
        deterministic: bool = True,
        decode: bool = False,
        head_mask=None,
        segment_ids=None,
    ):
        if decode and self.cache_index is None:
            raise ValueError("qkv_jax.nnx.TransformerLM: decoding needs init_cache(batch_size) first")
        index = self.cache_index[...] if decode and self.cache_index is not None else None
        call = lm.CallArgs(deterministic, decode, head_mask, segment_ids)
        logits, new_index = lm.lm_forward(self.config, self._layers(), tokens, call, index)
        if self.cache_index is not None and new_index is not None:
            self.cache_index[...] = new_index
        return logits


def _decode(graphdef, state, inputs, prefill, out_width, cache_length, top_k, mesh=None):
    """`generate`'s traced body: a fresh cache of `cache_length` positions, then
    `generation.decode` over the nnx model. Returns (tokens, logprobs, count)."""
    model = nnx.merge(graphdef, state)
    model.init_cache(inputs.prompt.shape[0], max_length=cache_length)
    graphdef, cache, rest = nnx.split(model, nnx.Cache, ...)  # type: ignore[misc]
    cache = generation.placed(cache, mesh)

    def step(cache, tokens):
        decoder = nnx.merge(graphdef, cache, rest)
        logits = decoder(tokens, decode=True)  # (B, T, V)
        return logits, nnx.state(decoder, nnx.Cache)

    final = generation.decode(step, cache, inputs, prefill, out_width, top_k)
    return final.tokens, final.logprobs, final.produced


_compiled_decode = jax.jit(
    _decode, static_argnames=("graphdef", "prefill", "out_width", "cache_length", "top_k", "mesh")
)


def generate(
    model: TransformerLM,
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
    """`qkv_jax.generation.generate` for the nnx `TransformerLM`: the same arguments but the
    parameters (`prompt`: an array `[B, P]` or a list of 1-D rows), the same checks, buckets and
    tokens. The model is not changed (its own cache, if any, is left as it was)."""
    graphdef, state = nnx.split(model)

    def run(inputs: Any, **static: Any) -> Any:
        return _compiled_decode(graphdef, state, inputs, mesh=generation.mesh_of(state), **static)

    settings = dict(rng=rng, temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id)
    return generation.run_request(model, run, prompt, max_new_tokens, settings, return_logprobs)


def _load(module: Any, tree: Mapping[str, Any], path: str, kind: type[nnx.Variable]) -> None:
    for name, value in tree.items():
        where = f"{path}/{name}"
        current = getattr(module, name, None)
        if isinstance(value, Mapping):
            if current is None:
                raise ValueError(f"linen_to_nnx: {where} has no sub-module in the nnx model")
            _load(current, value, where, kind)
        elif isinstance(current, kind) and current.shape == jnp.shape(value):
            current[...] = jnp.asarray(value)
        elif kind is nnx.Cache and (current is None or isinstance(current, nnx.Cache)):
            setattr(module, name, nnx.Cache(jnp.asarray(value)))  # a cache of another size
        else:
            found = (
                "nothing" if current is None else f"{type(current).__name__} {getattr(current, 'shape', '')}"
            )
            raise ValueError(
                f"linen_to_nnx: {where} of shape {jnp.shape(value)} does not fit the nnx model's {found}"
            )


def _paths(tree: Any) -> set[str]:
    return {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)}


def linen_to_nnx(variables: Mapping[str, Any], model: nnx.Module) -> nnx.Module:
    """Loads linen variables (`params`, and a decode `cache` if present) into `model`, in place.

    `model` is the nnx twin of the linen module the variables come from
    (`MultiHeadAttention` or `TransformerLM` with the same settings); every
    parameter must be present with its shape. Returns `model`.
    """
    params = variables["params"]
    wanted, given = _paths(nnx.to_pure_dict(nnx.state(model, nnx.Param))), _paths(params)
    if wanted != given:
        raise ValueError(
            f"linen_to_nnx: parameters of the nnx model missing from the linen params: "
            f"{sorted(wanted - given)}; linen params the nnx model lacks: {sorted(given - wanted)}"
        )
    _load(model, params, "params", nnx.Param)
    if "cache" in variables:
        _load(model, variables["cache"], "cache", nnx.Cache)
    return model


def nnx_to_linen(model: nnx.Module) -> dict[str, Any]:
    """The linen variables of `model`: `{"params": ...}`, plus `"cache"` when it has a decode cache."""
    variables = {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param))}
    cache = nnx.to_pure_dict(nnx.state(model, nnx.Cache))
    if cache:
        variables["cache"] = cache
    return variables
