"""The training loop shared by every experiment.

An experiment is a `Setup` (qkv_jax/training/setup.py): how to initialise
parameters, sample a batch from a key, compute the loss, and evaluate. The
loop around it is the same for all:

  * one `TrainState`; `train_chunk` runs `length` optimizer steps inside one
    `lax.scan`, a pure function compiled once;
  * the batch of step s comes from `fold_in(data_key, s)`, on device, so a run
    resumed from a checkpoint replays exactly the batches it would have seen;
  * `train_chunks` calls the compiled chunks from a start step to the end and
    hands each chunk's losses to the caller (`run.py`, for one seed or
    many vmapped);
  * parameters with LoRA adapters (`qkv_jax.lora`) train only the adapters:
    `init_train_state` wraps the optimizer in `optax.multi_transform`, the
    adapters labelled "adapter" and every other parameter "frozen"
    (`optax.set_to_zero()`: its update is exactly 0, so it stays bit-identical).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from jax import lax

from qkv_jax.lora import adapter_labels, has_adapters
from qkv_jax.training.setup import Setup
from qkv_jax.training.sharding import to_host

__all__ = [
    "TrainState",
    "make_optimizer",
    "only_adapters_train",
    "init_train_state",
    "make_train_chunk",
    "chunk_length",
    "kept_checkpoints",
    "train_chunks",
    "logged_losses",
    "seed_keys",
]


def kept_checkpoints(train: dict) -> int | None:
    """orbax's max_to_keep from `train.keep_checkpoints` (0 = all: None)."""
    return train["keep_checkpoints"] or None


def make_optimizer(train: Any) -> optax.GradientTransformation:
    """optax optimizer from the `train` section: optimizer, learning_rate, weight_decay
    (adamw), grad_clip_norm (None: no clipping), warmup_steps, schedule."""
    learning_rate: Any = train["learning_rate"]
    warmup = train["warmup_steps"]
    if train["schedule"] == "cosine":
        learning_rate = optax.warmup_cosine_decay_schedule(
            0.0, learning_rate, max(warmup, 1), max(train["steps"], max(warmup, 1) + 1)
        )
    elif warmup:
        learning_rate = optax.linear_schedule(0.0, learning_rate, warmup)
    name = train["optimizer"]
    if name == "adam":
        optimizer = optax.adam(learning_rate)
    elif name == "adamw":
        optimizer = optax.adamw(learning_rate, weight_decay=train["weight_decay"])
    else:
        optimizer = optax.sgd(learning_rate)
    clip = train["grad_clip_norm"]
    if clip is not None:
        optimizer = optax.chain(optax.clip_by_global_norm(clip), optimizer)
    return optimizer


@jax.jit
def seed_keys(seed: int | jax.Array) -> dict[str, jax.Array]:
    """Independent streams for init, training data and evaluation from one seed."""
    root = jax.random.PRNGKey(seed)
    return {name: jax.random.fold_in(root, i) for i, name in enumerate(("init", "data", "eval"))}


def only_adapters_train(tx: optax.GradientTransformation, params: Any) -> optax.GradientTransformation:
    """`tx` for the LoRA adapters of `params` and a zero update for every other parameter
    (`optax.multi_transform` over `qkv_jax.lora.adapter_labels`); `tx` itself when
    `params` has no adapters. Gradient clipping in `tx` sees the adapters' gradients only."""
    if not has_adapters(params):
        return tx
    return optax.multi_transform({"adapter": tx, "frozen": optax.set_to_zero()}, adapter_labels)


def init_train_state(setup: Setup, tx: optax.GradientTransformation, init_key: jax.Array) -> TrainState:
    """Fresh parameters and optimizer state; with LoRA adapters only they train (`only_adapters_train`)."""
    params = setup.init(init_key)
    return TrainState.create(apply_fn=setup.model.apply, params=params, tx=only_adapters_train(tx, params))


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


def chunk_length(train: dict) -> int:
    """Steps per compiled call (the `train` section's): every log and checkpoint falls on a
    chunk boundary."""
    return math.gcd(train["log_every"], train["checkpoint_every"])


def train_chunks(
    state: Any,
    run_chunk: Callable[[Any, int, int], tuple[Any, Any]],
    *,
    start_step: int,
    steps: int,
    chunk_length: int,
    after_chunk: Callable[[int, np.ndarray, Any], None],
) -> Any:
    """The training loop: from `start_step` to `steps` in compiled chunks; returns the state.

    `run_chunk(state, first_step, n) -> (state, losses [..., n])` trains steps
    first_step .. first_step + n - 1 (one compiled call; `...` is a seed axis
    when vmapped); `after_chunk(first_step, losses, state)` then sees the
    losses on the host, to log, check and checkpoint them.
    """
    step = start_step
    while step < steps:
        n = min(chunk_length, steps - step)
        state, losses = run_chunk(state, step, n)
        after_chunk(step, np.asarray(to_host(losses)), state)
        step += n
    return state


def logged_losses(first_step: int, losses: np.ndarray, log_every: int, steps: int) -> list[tuple[int, Any]]:
    """The (step, loss) pairs of a chunk that go into the logs: every `log_every`-th
    step and the last step of the run (`losses[..., i]` is the loss of `first_step + i`)."""
    return [
        (first_step + i, losses[..., i])
        for i in range(losses.shape[-1])
        if (first_step + i) % log_every == 0 or first_step + i == steps - 1
    ]
