"""What every TransformerLM task shares: the model from a config's `model` section, its checks, the loss.

The `model` section's fields are `qkv_jax.TransformerConfig`'s, by name (a
dtype as its name, e.g. "bfloat16"), so a new model option is a field of
TransformerConfig and of `configs/common.py:transformer_model`, and nothing here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from qkv_jax.attention import IMPLEMENTATIONS
from qkv_jax.diagnostics import collect_attention_weights
from qkv_jax.lm import LORA_TARGETS, TransformerConfig, TransformerLM
from qkv_jax.training import validate
from qkv_jax.training.validate import ConfigError

__all__ = [
    "DTYPES",
    "PRECISIONS",
    "transformer_config",
    "lora_targets",
    "make_model",
    "validate_model_config",
    "cross_entropy",
    "token_cross_entropy",
    "init_params",
    "training_logits",
    "layer_attention",
]

_FIELDS = {field.name for field in dataclasses.fields(TransformerConfig)}
# model.dtype / model.param_dtype by name.
DTYPES = ("float32", "bfloat16", "float16")
# model.precision: jax.lax.Precision's names.
PRECISIONS = ("default", "high", "highest")


def transformer_config(model_config: dict, vocab_size: int, **overrides: Any) -> TransformerConfig:
    """The TransformerConfig a config's `model` section describes (fields by name;
    others, and fields of configs written before one existed, are left out).
    `overrides`, e.g. `causal=True`, replace fields."""
    fields = {name: value for name, value in model_config.items() if name in _FIELDS}
    for name in ("dtype", "param_dtype"):
        if isinstance(fields.get(name), str):
            fields[name] = jnp.dtype(fields[name])
    if isinstance(fields.get("lora_targets"), str):
        fields["lora_targets"] = lora_targets(fields["lora_targets"])
    return TransformerConfig(**{**fields, "vocab_size": vocab_size, **overrides})


def lora_targets(text: str) -> tuple[str, ...]:
    """'query,value' -> ('query', 'value')."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _validate_lora(config: Any) -> None:
    model = config["model"]
    if "lora_rank" not in model:  # a config written before LoRA existed
        return
    validate.require_nonnegative_int(config, "model.lora_rank")
    validate.require_positive_float(config, "model.lora_alpha")
    targets = model["lora_targets"]
    names = lora_targets(targets) if isinstance(targets, str) else ()
    unknown = [name for name in names if name not in LORA_TARGETS]
    if not isinstance(targets, str) or unknown or (model["lora_rank"] and not names):
        raise ConfigError(
            f"model.lora_targets={targets!r}: must be comma-separated names of {', '.join(LORA_TARGETS)}"
        )
    if model["lora_rank"] and "kv_latent" in names and model.get("kv_latent_dim") is None:
        raise ConfigError(f"model.lora_targets={targets!r}: kv_latent needs model.kv_latent_dim")


def make_model(model_config: dict, vocab_size: int, **overrides: Any) -> TransformerLM:
    """The TransformerLM of a config's `model` section (see `transformer_config`)."""
    return TransformerLM(transformer_config(model_config, vocab_size, **overrides))


def validate_model_config(config: Any, seq_len: int, source: str) -> None:
    """model.* of every TransformerLM experiment; `seq_len`, the training length (`source`
    says where it comes from, e.g. 'task.seq_len'), must fit model.max_len."""
    validate.require_positive_int(
        config, "model.num_layers", "model.d_model", "model.num_heads", "model.max_len"
    )
    validate.require_fraction(config, "model.dropout_rate", "model.attention_dropout_rate")
    validate.require_bool(config, "model.causal")
    model = config["model"]
    for field in ("num_kv_heads", "kv_latent_dim", "mlp_dim"):
        if model.get(field) is not None:
            validate.require_positive_int(config, f"model.{field}")
    validate.require_divides(config, "model.num_heads", "model.d_model")
    if model.get("attention_implementation") is not None:
        validate.require_choice(config, "model.attention_implementation", IMPLEMENTATIONS)
    for field in ("dtype", "param_dtype"):
        if model.get(field) is not None:
            validate.require_choice(config, f"model.{field}", DTYPES)
    if model.get("precision") is not None:
        validate.require_choice(config, "model.precision", PRECISIONS)
    if model.get("num_kv_heads") is not None:
        validate.require_divides(config, "model.num_kv_heads", "model.num_heads")
    _validate_lora(config)
    if seq_len > model["max_len"]:
        raise ConfigError(
            f"model.max_len={model['max_len']}: shorter than the training sequences ({source}={seq_len})"
        )


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Cross-entropy in nats at each position `[..., T]`: logits `[..., T, V]`, targets `[..., T]`.

    Written as logsumexp minus the target's logit picked by a one-hot product:
    its gradient is softmax minus one-hot, where a gather of the target logit
    (optax's form) has a scatter-add for a gradient, which XLA constant-folds
    for seconds at large batches.
    """
    logits = logits.astype(jnp.float32)
    target_logits = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - target_logits


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats: logits `[..., T, V]`, targets `[..., T]`."""
    return token_cross_entropy(logits, targets).mean()


def init_params(model: TransformerLM, seq_len: int, key: jax.Array) -> Any:
    """Fresh parameters of `model` for sequences of `seq_len` tokens."""
    return model.init(key, jnp.zeros((1, seq_len), jnp.int32))["params"]


def training_logits(model: TransformerLM, params: Any, tokens: jax.Array, rng: jax.Array) -> jax.Array:
    """Logits `[B, T, V]` of `tokens` `[B, T]` in training mode (dropout drawn from `rng`)."""
    logits = model.apply({"params": params}, tokens, deterministic=False, rngs={"dropout": rng})
    return jnp.asarray(logits)


def layer_attention(model: TransformerLM, params: Any, tokens: jax.Array) -> list[jax.Array]:
    """[attention weights `[B, N, T, T]` of block 0, block 1, ...] of `model` with the causal
    mask on `tokens` `[B, T]` (sown by the reference path)."""
    probe = model.replace(causal=True, sow_weights=True)
    _, state = probe.apply({"params": params}, tokens, mutable=["intermediates"])
    weights = collect_attention_weights(state["intermediates"])
    return [weights[f"block_{layer}/attention"] for layer in range(model.config.num_layers)]
