"""The TransformerLM on synthetic next-token tasks with a known answer (task.name copy or brackets).

Each task is a row of `SEQUENCE_TASKS`: its generator in `qkv_jax.tasks.sequences`,
the `task.*` fields it reads, and its vocabulary size. A new task of this kind
is a generator there and one row here.

Loss: cross-entropy on the answer positions only (`answer_mask`; the rest is
random and cannot be learned). Metrics on fresh sequences: `loss` (nats),
`accuracy` (answer tokens predicted right by the argmax) and
`sequence_accuracy` (sequences with every answer token right).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qkv_jax.lm import TransformerLM
from qkv_jax.tasks.sequences import bracket_batch, copy_batch, repeat_batch
from qkv_jax.training import validate
from qkv_jax.training.loop import validate_train_config
from qkv_jax.training.task import AttentionView, Setup
from qkv_jax.training.transformer import (
    init_params,
    layer_attention,
    make_model,
    token_cross_entropy,
    training_logits,
    validate_model_config,
)

__all__ = ["SequenceTask", "SEQUENCE_TASKS", "build", "validate_config", "task_shapes", "answer_metrics"]


@dataclasses.dataclass(frozen=True)
class SequenceTask:
    """A synthetic next-token task.

    Attributes:
      generate: `generate(key, batch_size, *fields) -> {"inputs", "targets",
        "answer_mask"}`, each `[batch, 2 task.length]`.
      fields: the `task.*` fields passed to `generate` after the batch size, in
        order (`length` first); each must be a positive integer, and at least
        its `minimum`.
      vocab_size: the vocabulary size, from the task fields.
      minimum: smallest allowed value of some fields.
    """

    generate: Callable[..., dict]
    fields: tuple[str, ...]
    vocab_size: Callable[[dict], int]
    minimum: dict = dataclasses.field(default_factory=dict)


SEQUENCE_TASKS = {
    "copy": SequenceTask(
        generate=copy_batch,
        fields=("length", "vocab_size"),
        vocab_size=lambda task: task["vocab_size"],
        minimum={"vocab_size": 2},
    ),
    "brackets": SequenceTask(
        generate=bracket_batch,
        fields=("length", "num_types"),
        vocab_size=lambda task: 2 + 2 * task["num_types"],  # pad, '=', an opener and a closer per type
    ),
    "repeat": SequenceTask(
        generate=repeat_batch,
        fields=("length", "vocab_size"),
        vocab_size=lambda task: task["vocab_size"],
        minimum={"length": 2, "vocab_size": 2},
    ),
}


def task_shapes(task: dict) -> tuple[int, int]:
    """(sequence length L of inputs and targets, vocabulary size) of a task config."""
    return 2 * task["length"], SEQUENCE_TASKS[task["name"]].vocab_size(task)


def validate_config(config: Any) -> None:
    validate_train_config(config)
    validate.require_choice(config, "task.name", SEQUENCE_TASKS)
    spec = SEQUENCE_TASKS[config["task"]["name"]]
    validate.require_positive_int(config, *(f"task.{field}" for field in spec.fields))
    for field, minimum in spec.minimum.items():
        if config["task"][field] < minimum:
            raise validate.ConfigError(f"task.{field}={config['task'][field]}: must be >= {minimum}")
    validate_model_config(config, task_shapes(config["task"])[0], "2 * task.length")


def answer_metrics(logits: jax.Array, batch: dict) -> dict[str, jax.Array]:
    """loss, accuracy and sequence_accuracy on the answer positions; logits `[B, L, V]`."""
    mask = batch["answer_mask"]  # (B, L)
    losses = token_cross_entropy(logits, batch["targets"])  # (B, L)
    right = (jnp.argmax(logits, axis=-1) == batch["targets"]) | ~mask  # (B, L)
    return {
        "loss": jnp.sum(losses * mask) / jnp.sum(mask),
        "accuracy": 1.0 - jnp.sum(~right) / jnp.sum(mask),
        "sequence_accuracy": jnp.all(right, axis=-1).mean(),
    }


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: jit keys on its bound methods
class SequenceLM:
    """A TransformerLM on one `SequenceTask` (`Setup`'s fields are its bound methods)."""

    model: TransformerLM
    spec: SequenceTask
    fields: dict
    batch_size: int
    num_eval_examples: int

    def sample(self, key: jax.Array, batch_size: int) -> dict:
        return self.spec.generate(key, batch_size, *(self.fields[f] for f in self.spec.fields))

    def init(self, key: jax.Array) -> Any:
        return init_params(self.model, 2 * self.fields["length"], key)

    def sample_batch(self, key: jax.Array, data: Any) -> dict:
        del data  # the task is generated from the key alone
        return self.sample(key, self.batch_size)

    def loss(self, params: Any, batch: dict, rng: jax.Array) -> tuple[jax.Array, dict]:
        logits = training_logits(self.model, params, batch["inputs"], rng)  # (B, L, V)
        return answer_metrics(logits, batch)["loss"], {}

    def evaluate(self, params: Any, key: jax.Array, data: Any) -> tuple[dict, dict]:
        del data
        batch = self.sample(key, self.num_eval_examples)
        logits = jnp.asarray(self.model.apply({"params": params}, batch["inputs"]))  # (B, L, V)
        return answer_metrics(logits, batch), {}

    def inspect(self, params: Any, text: str | None) -> AttentionView:
        """Every block's attention on one fresh sequence; `text` is its seed (default 0). The
        positions whose next token is an answer are marked."""
        batch = self.sample(jax.random.PRNGKey(int(text) if text else 0), 1)
        weights = jax.jit(layer_attention, static_argnums=0)(self.model, params, batch["inputs"])
        labels = [str(int(token)) for token in batch["inputs"][0]]
        marks = [int(t) for t in np.flatnonzero(np.asarray(batch["answer_mask"][0]))]
        return AttentionView({f"block {i}": w[0] for i, w in enumerate(weights)}, labels, labels, marks)

    def report_inputs(self, data: Any, prompt: str | None) -> list[tuple[str, str]]:
        """Four fresh sequences (seeds 0-3; a prompt has no meaning here)."""
        del data, prompt
        return [(f"sequence {seed}", str(seed)) for seed in range(4)]


def build(config: Any) -> Setup:
    validate_config(config)
    task = config["task"]
    spec = SEQUENCE_TASKS[task["name"]]
    lm = SequenceLM(
        model=make_model(config["model"], task_shapes(task)[1]),
        spec=spec,
        fields={field: task[field] for field in spec.fields},
        batch_size=config["train"]["batch_size"],
        num_eval_examples=config["eval"]["num_examples"],
    )
    return Setup.from_methods(lm, model=lm.model)
