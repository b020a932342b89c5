"""Next-token tasks with a known right answer, as pure JAX functions of a PRNG key.

Each returns `inputs` and `targets` `[batch, L]` int32 (the sequence and its
shift by one) and `answer_mask` `[batch, L]` bool: the target positions whose
token is determined by the earlier ones. A model is scored on those.

  copy_batch     random symbols, a separator, the same symbols again: the copy
                 is determined (an induction head solves it).
  bracket_batch  a random prefix of opening and closing brackets of several
                 types, '=', then the closing brackets that complete it,
                 innermost first, then an end token: needs a stack.
  repeat_batch   random tokens in which a segment appears twice, at random
                 places: the repeat is predictable only by looking the current
                 token up earlier in the sequence (an induction head), since
                 where the copies are changes from sequence to sequence.

As tasks (`build`; config `task.name` copy, brackets or repeat) a
TransformerLM learns one of them. Each is a row of `SEQUENCE_TASKS`: its
generator, the `task.*` fields it reads and its vocabulary size, so a new task
of this kind is a generator and one row here.

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
from jax import lax

from qkv_jax.lm import TransformerLM
from qkv_jax.tasks.transformer import (
    check_sequence_length,
    init_params,
    layer_attention,
    make_model,
    token_cross_entropy,
    training_logits,
)
from qkv_jax.training import validate
from qkv_jax.training.setup import AttentionView, Setup

__all__ = [
    "copy_batch",
    "bracket_batch",
    "repeat_batch",
    "BRACKET_PAD",
    "BRACKET_EQUALS",
    "COPY_SEPARATOR",
    "SequenceTask",
    "SEQUENCE_TASKS",
    "build",
    "validate_config",
    "task_shapes",
    "answer_metrics",
]

COPY_SEPARATOR = 0
BRACKET_PAD = 0  # also the end of a completion
BRACKET_EQUALS = 1


def _shifted(sequence: jax.Array, answer_mask: jax.Array) -> dict[str, jax.Array]:
    return {
        "inputs": sequence[:, :-1].astype(jnp.int32),  # (B, L)
        "targets": sequence[:, 1:].astype(jnp.int32),  # (B, L)
        "answer_mask": answer_mask,  # (B, L)
    }


def copy_batch(key: jax.Array, batch_size: int, length: int, vocab_size: int) -> dict[str, jax.Array]:
    """Sequences `x, SEP, x` of `2 length + 1` tokens; x is `length` uniform symbols in
    `[1, vocab_size)`, SEP is 0. Inputs and targets `[batch, 2 length]`; the
    answers are the `length` targets after SEP."""
    if length < 1 or vocab_size < 2:
        raise ValueError(f"copy_batch: need length >= 1 and vocab_size >= 2, got {length}, {vocab_size}")
    symbols = jax.random.randint(key, (batch_size, length), 1, vocab_size)  # (B, n)
    separator = jnp.full((batch_size, 1), COPY_SEPARATOR, symbols.dtype)
    sequence = jnp.concatenate([symbols, separator, symbols], axis=1)  # (B, 2n + 1)
    answer_mask = jnp.arange(2 * length) >= length  # (2n,)
    return _shifted(sequence, jnp.broadcast_to(answer_mask, (batch_size, 2 * length)))


def _bracket_prefix(key: jax.Array, prefix_len: int, num_types: int):
    """One random prefix: (tokens [P], the stack of open types [P], its depth)."""

    def step(carry, keys):
        stack, depth = carry
        open_key, type_key = keys
        opens = (depth == 0) | jax.random.bernoulli(open_key)
        kind = jax.random.randint(type_key, (), 0, num_types)
        top = stack[jnp.maximum(depth - 1, 0)]
        token = jnp.where(opens, 2 + kind, 2 + num_types + top)
        stack = jnp.where(opens, stack.at[depth].set(kind), stack)
        return (stack, jnp.where(opens, depth + 1, depth - 1)), token

    keys = jax.random.split(key, 2 * prefix_len).reshape(prefix_len, 2, -1)  # (P, 2, key)
    initial = (jnp.zeros(prefix_len, jnp.int32), jnp.zeros((), jnp.int32))
    (stack, depth), tokens = lax.scan(step, initial, (keys[:, 0], keys[:, 1]))
    return tokens, stack, depth  # (P,), (P,), ()


def bracket_batch(
    key: jax.Array, batch_size: int, prefix_len: int, num_types: int = 3
) -> dict[str, jax.Array]:
    """Bracket completion: `prefix, '=', completion` of `2 prefix_len + 1` tokens.

    Vocabulary `2 + 2 num_types`: 0 pad/end, 1 '=', `2 + t` opens type t,
    `2 + num_types + t` closes it. The prefix is a random walk (open with
    probability 1/2, a random type; close the innermost open bracket
    otherwise; always open at depth 0). The completion closes the d brackets
    still open, innermost first, then pads. Inputs and targets
    `[batch, 2 prefix_len]`; the answers are the d closers and the end token.
    """
    if prefix_len < 1 or num_types < 1:
        raise ValueError(
            f"bracket_batch: need prefix_len >= 1 and num_types >= 1, got {prefix_len}, {num_types}"
        )
    keys = jax.random.split(key, batch_size)
    prefix, stack, depth = jax.vmap(_bracket_prefix, in_axes=(0, None, None))(keys, prefix_len, num_types)
    steps = jnp.arange(prefix_len)  # (P,)
    innermost_first = depth[:, None] - 1 - steps[None, :]  # (B, P) stack index of completion step j
    closers = 2 + num_types + jnp.take_along_axis(stack, jnp.maximum(innermost_first, 0), axis=1)
    completion = jnp.where(innermost_first >= 0, closers, BRACKET_PAD)  # (B, P)
    equals = jnp.full((batch_size, 1), BRACKET_EQUALS, prefix.dtype)
    sequence = jnp.concatenate([prefix, equals, completion], axis=1)  # (B, 2P + 1)
    answers = steps[None, :] <= depth[:, None]  # (B, P): the closers and the end token
    answer_mask = jnp.concatenate([jnp.zeros_like(answers), answers], axis=1)  # (B, 2P)
    return _shifted(sequence, answer_mask)


def repeat_batch(key: jax.Array, batch_size: int, length: int, vocab_size: int) -> dict[str, jax.Array]:
    """`2 length + 1` uniform random tokens from `[0, vocab_size)` in which a segment of
    `length // 2` tokens appears twice: first starting anywhere in the first half, again
    starting anywhere in the second half (both starts random per sequence), so the repeat is
    predictable only by finding the current token earlier in the sequence (an induction
    head), not by its position. Inputs and targets `[batch, 2 length]`; the answers are the
    tokens of the second copy after its first."""
    if length < 2 or vocab_size < 2:
        raise ValueError(f"repeat_batch: need length >= 2 and vocab_size >= 2, got {length}, {vocab_size}")
    segment = length // 2
    token_key, first_key, second_key = jax.random.split(key, 3)
    tokens = jax.random.randint(token_key, (batch_size, 2 * length + 1), 0, vocab_size)  # (B, 2L + 1)
    first = jax.random.randint(first_key, (batch_size, 1), 0, length - segment + 1)  # (B, 1)
    second = jax.random.randint(second_key, (batch_size, 1), length, 2 * length + 2 - segment)  # (B, 1)
    positions = jnp.arange(2 * length + 1)[None, :]  # (1, 2L + 1)
    in_copy = (positions >= second) & (positions < second + segment)  # (B, 2L + 1)
    source = jnp.where(in_copy, positions - second + first, positions)  # the copy reads the first
    sequence = jnp.take_along_axis(tokens, source, axis=1)
    targets = positions[:, :-1]  # (1, 2L): target t is sequence token t + 1
    answer_mask = (targets >= second) & (targets < second + segment - 1)  # (B, 2L): copy tokens 1 ..
    return _shifted(sequence, answer_mask)


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


def validate_config(config: Any) -> TransformerLM:
    """The task section's fields; returns the model the `model` section describes (checked by
    TransformerConfig), whose positions must hold the sequences."""
    validate.require_choice(config, "task.name", SEQUENCE_TASKS)
    spec = SEQUENCE_TASKS[config["task"]["name"]]
    validate.require_positive_int(config, *(f"task.{field}" for field in spec.fields))
    for field, minimum in spec.minimum.items():
        if config["task"][field] < minimum:
            raise validate.ConfigError(f"task.{field}={config['task'][field]}: must be >= {minimum}")
    length, vocab_size = task_shapes(config["task"])
    model = make_model(config["model"], vocab_size)
    check_sequence_length(model, length, "2 * task.length")
    return model


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

    def explorer_inputs(self, data: Any, prompt: str | None) -> list[tuple[str, str]]:
        """Four fresh sequences (seeds 0-3; a prompt has no meaning here)."""
        del data, prompt
        return [(f"sequence {seed}", str(seed)) for seed in range(4)]


def build(config: Any) -> Setup:
    """The Setup of the TransformerLM on the task `task.name` names."""
    model = validate_config(config)
    task = config["task"]
    spec = SEQUENCE_TASKS[task["name"]]
    lm = SequenceLM(
        model=model,
        spec=spec,
        fields={field: task[field] for field in spec.fields},
        batch_size=config["train"]["batch_size"],
        num_eval_examples=config["eval"]["num_examples"],
    )
    return Setup.from_methods(lm, model=lm.model)
