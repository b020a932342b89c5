"""Training: the loop every experiment shares, checkpoints, workdir files.

`train_and_evaluate(config, workdir)` is the entry point the launchers call
(docs/architecture.md follows one run through it). A task is a module whose
`build(config)` returns a `Setup` (`qkv_jax.training.task`); `make_train_chunk`
and `init_train_state` are the pieces the sweep launcher vmaps over seeds.
"""

from qkv_jax.training.checkpoints import (
    CheckpointMismatchError,
    Checkpoints,
    CheckpointWarning,
    NoCheckpointError,
)
from qkv_jax.training.loop import (
    TrainState,
    chunk_length,
    init_train_state,
    make_optimizer,
    make_train_chunk,
    seed_keys,
)
from qkv_jax.training.run import train_and_evaluate
from qkv_jax.training.task import Setup, build_setup
from qkv_jax.training.validate import ConfigError

__all__ = [
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
    "seed_keys",
    "train_and_evaluate",
]
