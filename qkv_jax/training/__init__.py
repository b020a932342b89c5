"""The trainer: the loop every experiment shares, checkpoints, workdir files.

`train_and_evaluate(config, workdir)` is the entry point the launchers call,
`train_seeds(config, seeds)` the same run for several seeds at once, vmapped
(docs/architecture.md follows one run through them). A task is a module whose
`build(config)` returns a `Setup` (`qkv_jax.training.setup`; the built-in ones
are in `qkv_jax.tasks`).
"""

from qkv_jax.training.checkpoints import (
    CheckpointMismatchError,
    Checkpoints,
    CheckpointWarning,
    NoCheckpointError,
    read_params,
    read_train_state,
)
from qkv_jax.training.loop import (
    TrainState,
    chunk_length,
    init_train_state,
    make_optimizer,
    make_train_chunk,
    seed_keys,
)
from qkv_jax.training.run import train_and_evaluate, train_seeds
from qkv_jax.training.setup import AttentionView, Setup, build_setup
from qkv_jax.training.validate import ConfigError

__all__ = [
    "AttentionView",
    "CheckpointMismatchError",
    "CheckpointWarning",
    "Checkpoints",
    "ConfigError",
    "NoCheckpointError",
    "Setup",
    "TrainState",
    "build_setup",
    "chunk_length",
    "init_train_state",
    "make_optimizer",
    "make_train_chunk",
    "read_params",
    "read_train_state",
    "seed_keys",
    "train_and_evaluate",
    "train_seeds",
]
