"""The trainer: the loop every experiment shares, checkpoints, workdir files.

`train_and_evaluate(config, workdir)` is the entry point the launchers call,
`train_seeds(config, seeds)` the same run for several seeds at once, vmapped
(docs/architecture.md follows one run through them). A task is a module whose
`build(config)` returns a `Setup` (`qkv_jax.training.setup`; the built-in ones
are in `qkv_jax.tasks`).
"""

import importlib
from typing import TYPE_CHECKING, Any

# Where each public name lives. The package imports a submodule only when one of its names is
# first asked for: `qkv_jax.training.validate`, say, then costs no orbax and no optax (their
# imports take about 0.2 s, a tenth of `experiments.generate`'s time to its first token).
_HOMES = {
    "CheckpointMismatchError": "checkpoints",
    "CheckpointWarning": "checkpoints",
    "Checkpoints": "checkpoints",
    "NoCheckpointError": "checkpoints",
    "read_params": "checkpoints",
    "read_train_state": "checkpoints",
    "TrainState": "loop",
    "chunk_length": "loop",
    "init_train_state": "loop",
    "make_optimizer": "loop",
    "make_train_chunk": "loop",
    "seed_keys": "loop",
    "train_and_evaluate": "run",
    "train_seeds": "run",
    "AttentionView": "setup",
    "Setup": "setup",
    "build_setup": "setup",
    "ConfigError": "validate",
}

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
]  # the keys of _HOMES

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'qkv_jax.training' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"qkv_jax.training.{_HOMES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
