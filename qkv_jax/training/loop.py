"""The training loop shared by every experiment.

An experiment is a `Setup`: how to initialise parameters, sample a batch from
a key, compute the loss, and evaluate. The loop around it is the same for all:

  * one `TrainState`; `train_chunk` runs `length` optimizer steps inside one
    `lax.scan`, a pure function compiled once;
  * the batch of step s comes from `fold_in(data_key, s)`, on device, so a run
    resumed from a checkpoint replays exactly the batches it would have seen;
  * `train_and_evaluate(config, workdir)` adds the workdir: `config.json`,
    `metrics.jsonl`, orbax checkpoints with automatic resume, a NaN/inf guard,
    `summary.json` and the experiment's pictures.

The sweep launcher vmaps `init_train_state` and `make_train_chunk` over seeds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState
from jax import lax

from qkv_jax.training import validate
from qkv_jax.training.validate import ConfigError

__all__ = [
    "Setup",
    "TrainState",
    "make_optimizer",
    "init_train_state",
    "make_train_chunk",
    "chunk_length",
    "seed_keys",
    "validate_train_config",
]

Params = Any
Batch = Any


@dataclasses.dataclass(frozen=True)
class Setup:
    """One experiment, as pure functions (all jittable except `report`).

    Attributes:
      init: `init(key) -> params`.
      sample_batch: `sample_batch(key, data) -> batch` (the training batch size).
      loss: `loss(params, batch, rng) -> (scalar loss, aux dict)`; `rng` is for
        dropout.
      evaluate: `evaluate(params, key, data) -> (metrics, examples)` on fresh data:
        a dict of scalar (or small array) metrics, and a pytree of per-example
        outputs for the report.
      report: optional host-side `report(workdir, stage, examples) -> dict`,
        called with stage "before" (the untrained model's examples) and
        "after"; writes pictures and returns extra summary entries.
      apply: the model's `apply`, kept on the TrainState for users.
      data: a pytree of arrays the functions above read (a text corpus, say),
        passed to them as an argument so that it is never baked into the
        compiled program as a constant.
      inspect: optional `inspect(params, text) -> (maps, query_labels,
        key_labels)` for `experiments.inspect`: the attention weights
        `{layer: [N, T, S]}` of one input (`text` as the experiment reads it,
        or None for a default one), with a label per position.
    """

    init: Callable[[jax.Array], Params]
    sample_batch: Callable[[jax.Array, Any], Batch]
    loss: Callable[[Params, Batch, jax.Array], tuple[jax.Array, dict]]
    evaluate: Callable[[Params, jax.Array, Any], tuple[dict, Any]]
    apply: Callable[..., Any]
    report: Callable[..., dict] | None = None
    data: Any = dataclasses.field(default_factory=dict)
    inspect: Callable[..., tuple[dict, list[str], list[str]]] | None = None


OPTIMIZERS = ("adam", "adamw", "sgd")


def validate_train_config(config: Any) -> None:
    """Checks the fields every experiment shares (seed, train.*, eval.*)."""
    validate.require_nonnegative_int(config, "seed")
    validate.require_positive_int(
        config, "train.steps", "train.batch_size", "train.log_every", "train.checkpoint_every"
    )
    validate.require_positive_float(config, "train.learning_rate")
    validate.require_choice(config, "train.optimizer", OPTIMIZERS)
    validate.require_bool(config, "train.overwrite")
    validate.require_positive_int(config, "eval.num_examples")
    train = config["train"]
    for field in ("weight_decay", "grad_clip_norm"):
        if field in train and train[field] is not None and train[field] < 0:
            raise ConfigError(f"train.{field}={train[field]!r}: must be >= 0")
    if "warmup_steps" in train:
        validate.require_nonnegative_int(config, "train.warmup_steps")
    if "checkify" in train:
        validate.require_bool(config, "train.checkify")


def make_optimizer(train: Any) -> optax.GradientTransformation:
    """optax optimizer from the `train` section: optimizer, learning_rate and,
    when present, weight_decay, grad_clip_norm, warmup_steps, schedule."""
    learning_rate: Any = train["learning_rate"]
    warmup = train.get("warmup_steps", 0) or 0
    if train.get("schedule", "constant") == "cosine":
        learning_rate = optax.warmup_cosine_decay_schedule(
            0.0, learning_rate, max(warmup, 1), max(train["steps"], warmup + 1)
        )
    elif warmup:
        learning_rate = optax.linear_schedule(0.0, learning_rate, warmup)
    name = train["optimizer"]
    if name == "adam":
        optimizer = optax.adam(learning_rate)
    elif name == "adamw":
        optimizer = optax.adamw(learning_rate, weight_decay=train.get("weight_decay", 1e-4))
    else:
        optimizer = optax.sgd(learning_rate)
    clip = train.get("grad_clip_norm")
    if clip:
        optimizer = optax.chain(optax.clip_by_global_norm(clip), optimizer)
    return optimizer


@jax.jit
def seed_keys(seed: int | jax.Array) -> dict[str, jax.Array]:
    """Independent streams for init, training data and evaluation from one seed."""
    root = jax.random.PRNGKey(seed)
    return {name: jax.random.fold_in(root, i) for i, name in enumerate(("init", "data", "eval"))}


def init_train_state(setup: Setup, tx: optax.GradientTransformation, init_key: jax.Array) -> TrainState:
    return TrainState.create(apply_fn=setup.apply, params=setup.init(init_key), tx=tx)


def make_train_chunk(
    setup: Setup, length: int, batch_sharding: Any = None
) -> Callable[[TrainState, jax.Array, Any], tuple]:
    """`train_chunk(state, data_key, data) -> (state, losses [length])`: `length` steps.

    Step s trains on `sample_batch(split(fold_in(data_key, s))[0], data)`; dropout
    uses the other half of the split. Pure, so it can be jitted, vmapped over
    seeds and sharded: `batch_sharding` (a sharding for the stacked batches
    `[length, batch, ...]`) splits the batch, and its generation, over devices.
    """

    def train_chunk(state: TrainState, data_key: jax.Array, data: Any):
        # All the chunk's batches at once: one bulk draw is much cheaper than
        # `length` small ones, and gives the same batches.
        steps = state.step + jnp.arange(length)
        step_keys = jax.vmap(lambda s: jax.random.split(jax.random.fold_in(data_key, s)))(steps)
        batches = jax.vmap(setup.sample_batch, in_axes=(0, None))(step_keys[:, 0], data)
        if batch_sharding is not None:
            batches = jax.lax.with_sharding_constraint(batches, batch_sharding)

        def train_step(state: TrainState, inputs):
            batch, dropout_key = inputs
            (loss, _), grads = jax.value_and_grad(setup.loss, has_aux=True)(state.params, batch, dropout_key)
            return state.apply_gradients(grads=grads), loss

        return lax.scan(train_step, state, (batches, step_keys[:, 1]))

    return train_chunk


def chunk_length(log_every: int, checkpoint_every: int) -> int:
    """Steps per compiled call: every log and checkpoint falls on a chunk boundary."""
    return math.gcd(log_every, checkpoint_every)
