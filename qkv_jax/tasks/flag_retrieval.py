"""The flag-retrieval task: a learned query must find the flagged token; fixed attention cannot.

`flag_retrieval_batch` generates it from a PRNG key. Each example is
`seq_len` tokens of width `d_model`: `d_model - num_flags` content
dimensions drawn fresh from N(0, 1), then `num_flags` flag channels. Flag
channel j is 1 at one position p_j (distinct positions for distinct channels)
and 0 elsewhere. The target is the content at p_0, then at p_1, ...:
nothing about the content tells where the flags are, so raw embedding
similarity carries no signal; only the flag channels do. With one flag: content ~ N(0, 1), the flag at a
uniformly random position, target = that position's content.

The task (`build`): a `FlagReader` (qkv_jax.models) trained to output the
flagged content, evaluated on fresh examples (`flag_metrics`).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any, cast

import jax
import jax.numpy as jnp

from qkv_jax.diagnostics import head_diagnostics
from qkv_jax.models import FLAG_READER_KINDS, FlagReader
from qkv_jax.tasks.transformer import NORMALIZE_QK, PRECISIONS
from qkv_jax.training import validate
from qkv_jax.training.setup import AttentionView, Setup
from qkv_jax.training.validate import ConfigError

_QK_NORM = cast("dict[str, bool | str]", NORMALIZE_QK)  # model.normalize_qk -> FlagReader's normalize_qk

__all__ = [
    "flag_retrieval_batch",
    "FlagRetrieval",
    "build",
    "validate_config",
    "attention_weights",
    "flag_metrics",
]


def flag_retrieval_batch(
    key: jax.Array, batch_size: int, seq_len: int, d_model: int, num_flags: int = 1
) -> dict[str, jax.Array]:
    """A batch of the flag task.

    Returns:
      inputs `[batch_size, seq_len, d_model]` float32,
      targets `[batch_size, num_flags * (d_model - num_flags)]`,
      flag_positions `[batch_size, num_flags]` int32 (position of each flag).
    """
    if not 1 <= num_flags <= seq_len or num_flags >= d_model:
        raise ValueError(
            f"flag_retrieval_batch: need 1 <= num_flags <= seq_len and num_flags < d_model, got "
            f"num_flags={num_flags}, seq_len={seq_len}, d_model={d_model}"
        )
    # One draw: the content, plus one extra standard normal per position whose
    # top num_flags entries pick the flagged positions (distinct, uniformly random).
    noise = jax.random.normal(key, (batch_size, seq_len, d_model - num_flags + 1))
    content = noise[..., :-1]  # (B, S, C)
    _, flag_positions = jax.lax.top_k(noise[..., -1], num_flags)  # (B, F)
    flag_positions = flag_positions.astype(jnp.int32)
    flags = jax.nn.one_hot(flag_positions, seq_len, axis=1)  # (B, S, F)
    inputs = jnp.concatenate([content, flags], axis=-1)  # (B, S, D)
    targets = jnp.take_along_axis(content, flag_positions[:, :, None], axis=1)  # (B, F, C)
    return {
        "inputs": inputs,
        "targets": targets.reshape(batch_size, -1),  # (B, F * C)
        "flag_positions": flag_positions,
    }


def validate_config(config: Any) -> None:
    """The task and model sections: ConfigError naming the first bad field and its value."""
    validate.require_choice(config, "model.kind", FLAG_READER_KINDS)
    validate.require_positive_int(
        config, "model.d_model", "model.d_k", "model.num_heads", "task.seq_len", "task.num_flags"
    )
    validate.require_bool(config, "model.scaled")
    if config["model"].get("precision") is not None:
        validate.require_choice(config, "model.precision", PRECISIONS)
    model, task = config["model"], config["task"]
    _validate_attention_variants(model)
    if model["kind"] == "multihead":
        validate.require_divides(config, "model.num_heads", "model.d_k")
        if model.get("d_v") is not None:
            validate.require_positive_int(config, "model.d_v")
            validate.require_divides(config, "model.num_heads", "model.d_v")
    elif model["num_heads"] != 1:
        raise ConfigError(
            f"model.num_heads={model['num_heads']}: model.kind={model['kind']!r} has one head; "
            "use model.kind='multihead'"
        )
    if task["num_flags"] >= model["d_model"]:
        raise ConfigError(
            f"task.num_flags={task['num_flags']}: must be below model.d_model={model['d_model']} "
            "(the flags are channels of the token)"
        )
    if task["num_flags"] > task["seq_len"]:
        raise ConfigError(
            f"task.num_flags={task['num_flags']}: more flags than positions (task.seq_len={task['seq_len']})"
        )


def _validate_attention_variants(model: dict) -> None:
    """model.normalize_qk (none, layernorm, rms) and model.attn_logits_soft_cap (unset or a
    finite number > 0), both for model.kind='multihead' only; a config written before these
    fields existed reads as neither."""
    normalize_qk, cap = model.get("normalize_qk", "none"), model.get("attn_logits_soft_cap")
    if normalize_qk not in NORMALIZE_QK:
        raise ConfigError(
            f"model.normalize_qk={normalize_qk!r}: unknown; choose one of {', '.join(NORMALIZE_QK)}"
        )
    if cap is not None and (
        isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (math.isfinite(cap) and cap > 0)
    ):
        raise ConfigError(f"model.attn_logits_soft_cap={cap!r}: must be a positive finite number (or unset)")
    if model["kind"] != "multihead" and (normalize_qk != "none" or cap is not None):
        field = "model.normalize_qk" if normalize_qk != "none" else "model.attn_logits_soft_cap"
        value = normalize_qk if normalize_qk != "none" else cap
        raise ConfigError(
            f"{field}={value!r}: only model.kind='multihead' (MultiHeadAttention) takes it, "
            f"not model.kind={model['kind']!r}"
        )


def attention_weights(intermediates: Any) -> jax.Array:
    """The reader's sown attention weights `[B, N, 1, S]` as `[B, N, S]`."""
    (weights,) = intermediates["attention"]["attention_weights"]
    return weights[..., 0, :]


def flag_metrics(predictions, weights, batch, num_flags: int) -> dict[str, jax.Array]:
    """Metrics of one evaluation batch.

    accuracy: the `num_flags` most attended positions (head-averaged) are
      exactly the flagged ones; for one flag, the top-attended position is the
      flagged one.
    decode_accuracy: each predicted content slot is nearest (L2) to the content
      at its flagged position, among all positions.
    mse: mean squared error against the targets.
    entropy: mean entropy (nats) of the attention rows (log(seq_len) = uniform).
    flag_attention: mean attention mass on the flagged positions.
    head_entropy, head_max_weight, head_flag_attention: the same per head
      (`qkv_jax.diagnostics.head_diagnostics`), arrays `[N]`.
    """
    inputs, targets, positions = batch["inputs"], batch["targets"], batch["flag_positions"]
    batch_size, seq_len, d_model = inputs.shape
    mean_weights = weights.mean(axis=1)  # (B, S)
    top = jnp.argsort(-mean_weights, axis=-1)[:, :num_flags]  # (B, F)
    accuracy = jnp.all(jnp.sort(top, -1) == jnp.sort(positions, -1), axis=-1)
    content = inputs[..., : d_model - num_flags]  # (B, S, C)
    slots = predictions.reshape(batch_size, num_flags, -1)  # (B, F, C)
    distances = jnp.sum((slots[:, :, None, :] - content[:, None, :, :]) ** 2, axis=-1)  # (B, F, S)
    decoded = jnp.argmin(distances, axis=-1) == positions  # (B, F)
    heads = head_diagnostics(weights[:, :, None, :])  # one query row per head: (B, N, 1, S)
    flagged = jax.nn.one_hot(positions, seq_len).sum(axis=1)  # (B, S)
    return {
        "accuracy": accuracy.mean(),
        "decode_accuracy": decoded.mean(),
        "mse": jnp.mean((predictions - targets) ** 2),
        "entropy": heads["entropy"].mean(),
        "flag_attention": jnp.sum(mean_weights * flagged, axis=-1).mean(),
        "head_entropy": heads["entropy"],  # (N,)
        "head_max_weight": heads["max_weight"],  # (N,)
        "head_flag_attention": jnp.sum(weights * flagged[:, None, :], axis=-1).mean(axis=0),  # (N,)
    }


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: jit keys on its bound methods
class FlagRetrieval:
    """The flag task's pure functions (`Setup`'s fields are its bound methods)."""

    model: FlagReader
    seq_len: int
    d_model: int
    num_flags: int
    batch_size: int
    num_eval_examples: int
    num_plot_examples: int

    def sample(self, key: jax.Array, batch_size: int) -> dict:
        return flag_retrieval_batch(key, batch_size, self.seq_len, self.d_model, self.num_flags)

    def init(self, key: jax.Array) -> Any:
        return self.model.init(key, jnp.zeros((1, self.seq_len, self.d_model))).get("params", {})

    def sample_batch(self, key: jax.Array, data: Any) -> dict:
        del data  # the task is generated from the key alone
        return self.sample(key, self.batch_size)

    def loss(self, params: Any, batch: dict, rng: jax.Array) -> tuple[jax.Array, dict]:
        del rng  # no dropout here
        predictions = self.model.apply({"params": params}, batch["inputs"])
        return jnp.mean((predictions - batch["targets"]) ** 2), {}

    def forward(self, params: Any, inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(predictions, attention weights [B, N, S])."""
        predictions, state = self.model.apply({"params": params}, inputs, mutable=["intermediates"])
        return predictions, attention_weights(state["intermediates"])

    def evaluate(self, params: Any, key: jax.Array, data: Any) -> tuple[dict, dict]:
        del data  # the task is generated from the key alone
        batch = self.sample(key, self.num_eval_examples)
        predictions, weights = self.forward(params, batch["inputs"])
        examples = {
            "attention_weights": weights[: self.num_plot_examples],
            "flag_positions": batch["flag_positions"][: self.num_plot_examples],
        }
        return flag_metrics(predictions, weights, batch, self.num_flags), examples

    def save_examples(self, workdir: str | pathlib.Path, stage: str, examples: dict) -> dict:
        """attention_<stage>.png: the plotted examples' attention rows, the flags ringed."""
        from qkv_jax.plots import plot_flag_attention  # matplotlib only when writing pictures

        plot_flag_attention(
            examples["attention_weights"],
            examples["flag_positions"],
            pathlib.Path(workdir) / f"attention_{stage}.png",
            title=f"{self.model.kind} attention, {stage} training",
        )
        return {}

    def inspect(self, params: Any, text: str | None) -> AttentionView:
        """One fresh example; `text` is its seed (default 0). The flagged positions are marked."""
        batch = self.sample(jax.random.PRNGKey(int(text) if text else 0), 1)
        _, weights = jax.jit(self.forward)(params, batch["inputs"])  # (1, N, S)
        flagged = {int(p): f for f, p in enumerate(batch["flag_positions"][0])}
        keys = [f"{s}" + (f" (flag {flagged[s]})" if s in flagged else "") for s in range(self.seq_len)]
        return AttentionView(
            {"attention": weights[0][:, None, :]}, ["query"], keys, sorted(flagged)
        )  # (N, 1, S)

    def explorer_inputs(self, data: Any, prompt: str | None) -> list[tuple[str, str]]:
        """Four fresh examples (seeds 0-3; a prompt has no meaning here)."""
        del data, prompt
        return [(f"example {seed}", str(seed)) for seed in range(4)]


def build(config: Any) -> Setup:
    """The flag task's Setup: a FlagReader of `model.kind` and the pure functions around it."""
    validate_config(config)
    model_config, task = config["model"], config["task"]
    num_flags, d_model = task["num_flags"], model_config["d_model"]
    model = FlagReader(
        kind=model_config["kind"],
        out_features=num_flags * (d_model - num_flags),
        d_k=model_config["d_k"],
        d_v=model_config.get("d_v"),
        num_heads=model_config["num_heads"],
        num_flags=num_flags,
        scaled=model_config["scaled"],
        precision=model_config.get("precision"),
        normalize_qk=_QK_NORM[model_config.get("normalize_qk", "none")],
        attn_logits_soft_cap=model_config.get("attn_logits_soft_cap"),
    )
    flag = FlagRetrieval(
        model=model,
        seq_len=task["seq_len"],
        d_model=d_model,
        num_flags=num_flags,
        batch_size=config["train"]["batch_size"],
        num_eval_examples=config["eval"]["num_examples"],
        num_plot_examples=config["eval"]["num_plot_examples"],
    )
    return Setup.from_methods(flag, model=model)
