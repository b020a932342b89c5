"""Many seeds of one config trained together in one compiled program.

`jax.vmap` runs the same pure `init_train_state` and `make_train_chunk` that a
single run uses over a leading seed axis (init and data keys), so seed i of a
vmapped run follows the same steps as a run with seed i alone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qkv_jax.training.loop import init_train_state, make_optimizer, make_train_chunk, seed_keys
from qkv_jax.training.run import build_setup, compile_for_platform, to_dict

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
    train = config["train"]
    steps, log_every = train["steps"], train["log_every"]
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("train_seeds: no seeds given")
    keys = jax.vmap(seed_keys)(jnp.asarray(seeds))  # {name: (num_seeds, 2)}
    tx = make_optimizer(train)
    init = jax.jit(jax.vmap(lambda key: init_train_state(setup, tx, key)))
    states = init(keys["init"])
    evaluate = jax.jit(jax.vmap(setup.evaluate, in_axes=(0, 0, None)))

    t = time.perf_counter()
    chunks = {}

    def chunk_fn(n: int):
        if n not in chunks:
            vmapped = jax.vmap(make_train_chunk(setup, n), in_axes=(0, 0, None))
            chunks[n] = compile_for_platform(jax.jit(vmapped), states, keys["data"], setup.data)
        return chunks[n]

    chunk_fn(min(log_every, steps))
    untrained, _ = jax.device_get(evaluate(states.params, keys["eval"], setup.data))
    compile_s = time.perf_counter() - t

    curve_steps: list[int] = []
    curves: list[np.ndarray] = []
    t = time.perf_counter()
    step = 0
    while step < steps:
        n = min(log_every, steps - step)
        states, losses = chunk_fn(n)(states, keys["data"], setup.data)
        losses = np.asarray(jax.device_get(losses))  # (num_seeds, n)
        for i in range(n):
            if (step + i) % log_every == 0 or step + i == steps - 1:
                curve_steps.append(step + i)
                curves.append(losses[:, i])
        step += n
    train_s = time.perf_counter() - t
    trained, _ = jax.device_get(evaluate(states.params, keys["eval"], setup.data))
    curves_by_seed = np.stack(curves, axis=1)  # (num_seeds, num_logged)
    final_loss = curves_by_seed[:, -1]
    return {
        "seeds": seeds,
        "final_loss": final_loss.tolist(),
        "metrics": {name: np.asarray(v).tolist() for name, v in trained.items()},
        "untrained_metrics": {name: np.asarray(v).tolist() for name, v in untrained.items()},
        "curve_steps": curve_steps,
        "curves": curves_by_seed.tolist(),
        "diverged": [
            s for s, ok in zip(seeds, np.isfinite(curves_by_seed).all(axis=1), strict=True) if not ok
        ],
        "params": states.params,
        "compile_s": compile_s,
        "train_s": train_s,
        "wall_time_s": time.perf_counter() - started,
    }
