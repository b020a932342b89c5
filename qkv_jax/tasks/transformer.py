"""What every TransformerLM task shares: the model from a config's `model` section, the loss.

The `model` section's fields are `qkv_jax.TransformerConfig`'s, by name (a
dtype by its name, e.g. "bfloat16"; lora_targets comma-separated; window as
comma-separated ints and "full", e.g. "64,full"; normalize_qk "none",
"layernorm", "rms" or "rms_offset"; rope_scaling as "kind,factor" and its
other numbers by name, e.g. "llama3,8,original_max_len=8192"); an unset
(None) field takes TransformerConfig's default. `model_fields` lists them
from `dataclasses.fields(TransformerConfig)`, and `configs/common.py:transformer`
adds every field it does not spell out as an unset placeholder, so a new
model option is a field of TransformerConfig and nothing here. The renamed
fields' old names (`model.sinks`, `model.dropout_rate`) still work, with a
DeprecationWarning naming the new one. TransformerConfig checks its own
fields where it is built; `make_model` turns its ValueError into the
one-line ConfigError naming `model.<field>`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from qkv_jax.diagnostics import collect_attention_weights
from qkv_jax.lm import RENAMED_FIELDS, TransformerConfig, TransformerLM
from qkv_jax.positions import RopeScaling
from qkv_jax.training.validate import ConfigError

__all__ = [
    "PRECISIONS",
    "NORMALIZE_QK",
    "model_fields",
    "parse_window",
    "parse_rope_scaling",
    "transformer_config",
    "make_model",
    "check_sequence_length",
    "cross_entropy",
    "token_cross_entropy",
    "init_params",
    "training_logits",
    "causal_model",
    "layer_attention",
]

_FIELDS = tuple(field.name for field in dataclasses.fields(TransformerConfig))
# A field's annotation's leading type -> the type of its command-line placeholder (others: str).
_PLACEHOLDER_TYPES = {"bool": bool, "int": int, "float": float}
# The fields a config spells as words or comma lists (`_parsed_words`).
_WORDS = ("lora_targets", "window", "normalize_qk", "rope_scaling")
# model.precision: jax.lax.Precision's names (flax's spelling).
PRECISIONS = ("default", "high", "highest")
# model.normalize_qk's words and TransformerConfig's values.
NORMALIZE_QK = {"none": False, "layernorm": "layernorm", "rms": "rms", "rms_offset": "rms_offset"}
# model.window's word for a global layer.
GLOBAL_WINDOW = "full"


def _config_message(error: Exception) -> str:
    """A TransformerConfig error in the config's words: `num_heads=3 must divide d_model=128`
    becomes `model.num_heads=3 must divide model.d_model=128`."""
    text = re.sub(r"^\w+: ", "", str(error))
    return re.sub(r"(?<![\w.])(" + "|".join(_FIELDS) + r")(?==)", r"model.\1", text)


def model_fields() -> dict[str, type]:
    """Every field of TransformerConfig a `model` section can set (all but vocab_size, which the
    data gives), with the type of its command-line placeholder (`config_dict.placeholder`)."""
    return {
        field.name: str
        if field.name in _WORDS
        else _PLACEHOLDER_TYPES.get(str(field.type).split(" | ")[0], str)
        for field in dataclasses.fields(TransformerConfig)
        if field.name != "vocab_size"
    }


def _renamed(model_config: dict) -> dict:
    """`model_config` with each old field name of `RENAMED_FIELDS` that is set moved to its new
    name, with a DeprecationWarning naming it."""
    model_config = dict(model_config)
    for old, new in RENAMED_FIELDS.items():
        value = model_config.pop(old, None)
        if value is not None:
            warnings.warn(f"model.{old} is renamed model.{new}", DeprecationWarning, stacklevel=3)
            model_config[new] = value
    return model_config


def transformer_config(
    model_config: dict, vocab_size: int, *, base: TransformerConfig | None = None, **overrides: Any
) -> TransformerConfig:
    """The TransformerConfig a config's `model` section describes (fields by name; others are
    left out, unset ones take `base`'s value, or TransformerConfig's default without one: a
    pretrained checkpoint's config is a `base` whose fields the section changes one by one).
    `overrides`, e.g. `causal=True`, replace fields. ConfigError naming the field when
    TransformerConfig refuses a value."""
    fields = {
        name: value for name, value in _renamed(model_config).items() if name in _FIELDS and value is not None
    }
    try:
        for name in ("dtype", "param_dtype"):
            if isinstance(fields.get(name), str):
                fields[name] = jnp.dtype(fields[name])
    except TypeError:
        raise ConfigError(
            f"model.{name}={fields[name]!r}: not a dtype name (e.g. float32, bfloat16)"
        ) from None
    fields.update(_parsed_words(fields))
    if fields.get("precision") is not None and fields["precision"] not in PRECISIONS:
        raise ConfigError(
            f"model.precision={fields['precision']!r}: unknown; choose one of {', '.join(PRECISIONS)}"
        )
    try:
        if base is not None:
            fields = {**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, **fields}
        return TransformerConfig(**{**fields, "vocab_size": vocab_size, **overrides})
    except (TypeError, ValueError) as error:
        raise ConfigError(_config_message(error)) from None


def _parsed_words(fields: dict) -> dict:
    """The fields a config spells as words or comma lists, as TransformerConfig takes them."""
    parsed: dict[str, Any] = {}
    if isinstance(fields.get("lora_targets"), str):
        parsed["lora_targets"] = tuple(t.strip() for t in fields["lora_targets"].split(",") if t.strip())
    if isinstance(fields.get("window"), str):
        parsed["window"] = parse_window(fields["window"])
    if isinstance(fields.get("rope_scaling"), str):
        parsed["rope_scaling"] = parse_rope_scaling(fields["rope_scaling"])
    normalize_qk = fields.get("normalize_qk")
    if isinstance(normalize_qk, str):
        if normalize_qk not in NORMALIZE_QK:
            raise ConfigError(
                f"model.normalize_qk={normalize_qk!r}: unknown; choose one of {', '.join(NORMALIZE_QK)}"
            )
        parsed["normalize_qk"] = NORMALIZE_QK[normalize_qk]
    return parsed


def parse_window(text: str) -> int | tuple[int | None, ...] | None:
    """model.window: "64" (every layer local, 64 keys), "full" (every layer global), or a comma
    list cycled over the layers, e.g. "64,full" (local and global alternating). ConfigError
    naming the field for anything else."""
    entries = [entry.strip() for entry in text.split(",")]
    if not all(entry == GLOBAL_WINDOW or entry.isdecimal() for entry in entries):
        raise ConfigError(
            f"model.window={text!r}: expected comma-separated window sizes (ints >= 1, the keys each "
            f"query sees) or {GLOBAL_WINDOW!r} for a global layer, e.g. '64,{GLOBAL_WINDOW}'"
        )
    windows = tuple(None if entry == GLOBAL_WINDOW else int(entry) for entry in entries)
    return windows[0] if len(windows) == 1 else windows


def parse_rope_scaling(text: str) -> RopeScaling:
    """model.rope_scaling: "kind,factor" and RopeScaling's other fields by name, e.g. "linear,2",
    "llama3,8,original_max_len=8192,low_freq_factor=1,high_freq_factor=4", "yarn,4,
    original_max_len=4096". ConfigError naming the field for anything else."""
    kind, _, rest = text.partition(",")
    factor, *named = [entry.strip() for entry in rest.split(",")] if rest else [""]
    fields = {field.name: field.type for field in dataclasses.fields(RopeScaling)}
    try:
        values: dict[str, Any] = {"kind": kind.strip(), "factor": float(factor)}
        for entry in named:
            name, _, value = entry.partition("=")
            name = name.strip()
            if name not in fields or name in values:
                raise ValueError(f"unknown or repeated field {name!r}")
            kinds = str(fields[name])
            values[name] = (
                value.strip() in ("true", "True", "1")
                if kinds.startswith("bool")
                else int(value)
                if kinds.startswith("int")
                else float(value)
            )
        return RopeScaling(**values)
    except (TypeError, ValueError) as error:
        raise ConfigError(
            f"model.rope_scaling={text!r}: expected 'kind,factor' and RopeScaling's other fields by name, "
            f"e.g. 'llama3,8,original_max_len=8192' ({re.sub(r'^RopeScaling: ', '', str(error))})"
        ) from None


def make_model(model_config: dict, vocab_size: int, **overrides: Any) -> TransformerLM:
    """The TransformerLM of a config's `model` section (see `transformer_config`)."""
    return TransformerLM(transformer_config(model_config, vocab_size, **overrides))


def check_sequence_length(model: TransformerLM, seq_len: int, source: str) -> None:
    """ConfigError unless the training sequences (`seq_len`, from the config field `source`,
    e.g. 'task.seq_len') fit the model's positions."""
    if seq_len > model.config.max_len:
        raise ConfigError(
            f"model.max_len={model.config.max_len}: shorter than the training sequences ({source}={seq_len})"
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


def training_logits(
    model: TransformerLM, params: Any, tokens: jax.Array, rng: jax.Array, **inputs: Any
) -> jax.Array:
    """Logits `[B, T, V]` of `tokens` `[B, T]` in training mode (dropout drawn from `rng`);
    `inputs`: the model's other arguments (e.g. `segment_ids` of packed rows)."""
    logits = model.apply({"params": params}, tokens, deterministic=False, rngs={"dropout": rng}, **inputs)
    return jnp.asarray(logits)


def causal_model(model: TransformerLM, **changes: Any) -> TransformerLM:
    """`model` with the causal mask on (and `changes` to its config); the parameters fit both."""
    return model.clone(config=dataclasses.replace(model.config, causal=True, **changes))


def layer_attention(model: TransformerLM, params: Any, tokens: jax.Array) -> list[jax.Array]:
    """[attention weights `[B, N, T, T]` of block 0, block 1, ...] of `model` with the causal
    mask on `tokens` `[B, T]` (sown by the reference path)."""
    weights = _sown_attention(causal_model(model, sow_weights=True), params, tokens)
    return [weights[f"block_{layer}/attention"] for layer in range(model.config.num_layers)]


# Jitted with the model static, so that an evaluation asking twice for the same model's
# weights on inputs of one shape (the char LM's diagnostics and induction scores) traces the
# model once.
@functools.partial(jax.jit, static_argnums=0)
def _sown_attention(probe: TransformerLM, params: Any, tokens: jax.Array) -> dict:
    _, state = probe.apply({"params": params}, tokens, mutable=["intermediates"])
    return collect_attention_weights(state["intermediates"])
