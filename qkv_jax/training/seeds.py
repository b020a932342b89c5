"""Many seeds of one config trained together in one compiled program.

`jax.vmap` runs the same pure `init_train_state` and `make_train_chunk` that a
single run uses over a leading seed axis (init and data keys), and the same
loop (`loop.train_chunks`) calls them, so seed i of a vmapped run follows the
same steps as a run with seed i alone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qkv_jax.training.compiled import compile_for_platform
from qkv_jax.training.loop import (
    init_train_state,
    logged_losses,
    make_optimizer,
    make_train_chunk,
    seed_keys,
    train_chunks,
)
from qkv_jax.training.task import build_setup, to_dict

__all__ = ["train_seeds"]


def train_seeds(config: Any, seeds: Sequence[int]) -> dict:
    """Trains `config` once per seed, all seeds in one vmapped program.

    `config.seed` is ignored; `seeds` replaces it. A seed whose loss stops
    being finite keeps training (its numbers become nan) and is reported in
    `diverged`, so one bad seed does not stop the others.

    Returns a dict with, per seed (lists in the order of `seeds`):
      final_loss, metrics {name: [...]}, untrained_metrics {name: [...]},
      curve_steps (the logged steps) and curves (loss at those steps, [seed][step]);
    and params (the trained parameters, leading axis = seed), diverged (seeds
    with a non-finite loss), compile_s, train_s, wall_time_s.
    """
    started = time.perf_counter()
    config = to_dict(config)
    setup = build_setup(config)
    steps, log_every = config["train"]["steps"], config["train"]["log_every"]
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("train_seeds: no seeds given")
    keys = jax.vmap(seed_keys)(jnp.asarray(seeds))  # {name: (num_seeds, 2)}
    tx = make_optimizer(config["train"])
    states = jax.jit(jax.vmap(lambda key: init_train_state(setup, tx, key)))(keys["init"])
    evaluate = jax.jit(jax.vmap(setup.evaluate, in_axes=(0, 0, None)))
    chunks: dict[int, Any] = {}

    def compiled_chunk(n: int) -> Any:
        if n not in chunks:
            vmapped = jax.vmap(make_train_chunk(setup, n), in_axes=(0, 0, None))
            chunks[n] = compile_for_platform(jax.jit(vmapped), states, keys["data"], setup.data)
        return chunks[n]

    def run_chunk(states: Any, first_step: int, n: int) -> tuple[Any, jax.Array]:
        return compiled_chunk(n)(states, keys["data"], setup.data)

    t = time.perf_counter()
    compiled_chunk(min(log_every, steps))
    untrained, _ = jax.device_get(evaluate(states.params, keys["eval"], setup.data))
    compile_s = time.perf_counter() - t

    logged: list[tuple[int, np.ndarray]] = []  # (step, losses [num_seeds])
    t = time.perf_counter()
    states = train_chunks(
        states,
        run_chunk,
        start_step=0,
        steps=steps,
        chunk_length=log_every,
        after_chunk=lambda first, losses, _: logged.extend(logged_losses(first, losses, log_every, steps)),
    )
    train_s = time.perf_counter() - t
    trained, _ = jax.device_get(evaluate(states.params, keys["eval"], setup.data))
    curves = np.stack([losses for _, losses in logged], axis=1)  # (num_seeds, num_logged)
    return {
        "seeds": seeds,
        "final_loss": curves[:, -1].tolist(),
        "metrics": {name: np.asarray(v).tolist() for name, v in trained.items()},
        "untrained_metrics": {name: np.asarray(v).tolist() for name, v in untrained.items()},
        "curve_steps": [step for step, _ in logged],
        "curves": curves.tolist(),
        "diverged": [s for s, ok in zip(seeds, np.isfinite(curves).all(axis=1), strict=True) if not ok],
        "params": states.params,
        "compile_s": compile_s,
        "train_s": train_s,
        "wall_time_s": time.perf_counter() - started,
    }
