"""A run's newest checkpoint as tests compare it: `(step, {"step", "params", "opt_state"})`."""

import jax

from qkv_jax.training import build_setup, init_train_state, make_optimizer, read_train_state, seed_keys
from qkv_jax.training.checkpoints import checkpoint_tree
from qkv_jax.training.setup import to_dict


def final_state(workdir, config):
    """The newest usable checkpoint of `workdir`, restored into `config`'s model on this process's
    devices (so a checkpoint of another model's shapes is a CheckpointMismatchError)."""
    config = to_dict(config)
    setup = build_setup(config)
    tx = make_optimizer(config["train"])
    template = jax.jit(lambda key: init_train_state(setup, tx, key))(seed_keys(config["seed"])["init"])
    saved = read_train_state(workdir, like=checkpoint_tree(template))
    return saved.step, saved.tree
