"""The TransformerLM on synthetic next-token tasks with a known answer (task.name copy or brackets).

Loss: cross-entropy on the answer positions only (`answer_mask`; the rest is
random and cannot be learned). Metrics on fresh sequences: `loss` (nats),
`accuracy` (answer tokens predicted right by the argmax) and
`sequence_accuracy` (sequences with every answer token right).
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from qkv_jax.tasks.sequences import bracket_batch, copy_batch
from qkv_jax.training import validate
from qkv_jax.training.char_lm import make_model, validate_model_config
from qkv_jax.training.loop import Setup, validate_train_config

__all__ = ["TASK_NAMES", "build", "validate_config", "task_shapes", "answer_metrics"]

TASK_NAMES = ("copy", "brackets")


def task_shapes(task: dict) -> tuple[int, int]:
    """(sequence length L of inputs and targets, vocabulary size) of a task config."""
    if task["name"] == "copy":
        return 2 * task["length"], task["vocab_size"]
    return 2 * task["length"], 2 + 2 * task["num_types"]


def validate_config(config: Any) -> None:
    validate_train_config(config)
    validate.require_choice(config, "task.name", TASK_NAMES)
    validate.require_positive_int(config, "task.length")
    task = config["task"]
    if task["name"] == "copy":
        validate.require_positive_int(config, "task.vocab_size")
        if task["vocab_size"] < 2:
            raise validate.ConfigError(f"task.vocab_size={task['vocab_size']}: must be >= 2")
    else:
        validate.require_positive_int(config, "task.num_types")
    validate_model_config(config, task_shapes(task)[0], "2 * task.length")


def answer_metrics(logits: jax.Array, batch: dict) -> dict[str, jax.Array]:
    """loss, accuracy and sequence_accuracy on the answer positions; logits `[B, L, V]`."""
    mask = batch["answer_mask"]  # (B, L)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])  # (B, L)
    right = (jnp.argmax(logits, axis=-1) == batch["targets"]) | ~mask  # (B, L)
    return {
        "loss": jnp.sum(losses * mask) / jnp.sum(mask),
        "accuracy": 1.0 - jnp.sum(~right) / jnp.sum(mask),
        "sequence_accuracy": jnp.all(right, axis=-1).mean(),
    }


def build(config: Any) -> Setup:
    validate_config(config)
    task = config["task"]
    seq_len, vocab_size = task_shapes(task)
    model = make_model(config["model"], vocab_size)

    def sample(key, batch_size):
        if task["name"] == "copy":
            return copy_batch(key, batch_size, task["length"], task["vocab_size"])
        return bracket_batch(key, batch_size, task["length"], task["num_types"])

    def loss(params, batch, rng):
        logits = cast(
            jax.Array,
            model.apply({"params": params}, batch["inputs"], deterministic=False, rngs={"dropout": rng}),
        )  # (B, L, V)
        return answer_metrics(logits, batch)["loss"], {}

    def evaluate(params, key, data):
        del data  # the task is generated from the key alone
        batch = sample(key, config["eval"]["num_examples"])
        logits = cast(jax.Array, model.apply({"params": params}, batch["inputs"]))  # (B, L, V)
        return answer_metrics(logits, batch), {}

    return Setup(
        init=lambda key: model.init(key, jnp.zeros((1, seq_len), jnp.int32))["params"],
        sample_batch=lambda key, data: sample(key, config["train"]["batch_size"]),
        loss=loss,
        evaluate=evaluate,
        apply=model.apply,
    )
