"""Training: the loop every experiment shares, checkpoints, workdir files.

`train_and_evaluate(config, workdir)` is the entry point the launchers call;
`Setup`, `make_train_chunk` and `init_train_state` are the pieces the sweep
launcher vmaps over seeds.
"""

from qkv_jax.training.checkpoints import CheckpointMismatchError, Checkpoints, CheckpointWarning
from qkv_jax.training.loop import (
    Setup,
    TrainState,
    chunk_length,
    init_train_state,
    make_optimizer,
    make_train_chunk,
    seed_keys,
)
from qkv_jax.training.run import build_setup, train_and_evaluate
from qkv_jax.training.validate import ConfigError

__all__ = [
    "CheckpointMismatchError",
    "CheckpointWarning",
    "Checkpoints",
    "ConfigError",
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
