"""Many seeds of one config trained together in one compiled program.

`jax.vmap` runs the same pure `init_train_state` and `make_train_chunk` that a
single run uses over a leading seed axis (init and data keys), and the same
loop (`loop.train_chunks`) calls them, so seed i of a vmapped run follows the
same steps as a run with seed i alone.

Given a `workdir` (a sweep's cell), the seeds' states are checkpointed there
every `train.checkpoint_every` steps and the logged losses kept in
`curves.jsonl`, so a cell stopped by a signal (`StopSignals`) or killed
resumes where it stopped.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qkv_jax.training.checkpoints import Checkpoints, checkpoint_tree, restore_train_state
from qkv_jax.training.compiled import compile_for_platform
from qkv_jax.training.init_from import fitted_params, read_source
from qkv_jax.training.loop import (
    chunk_length,
    init_train_state,
    kept_checkpoints,
    logged_losses,
    make_optimizer,
    make_train_chunk,
    seed_keys,
    train_chunks,
)
from qkv_jax.training.preemption import StopSignals
from qkv_jax.training.task import Setup, build_setup, to_dict
from qkv_jax.training.workdir import MetricsWriter, read_metrics

__all__ = ["train_seeds"]


def train_seeds(
    config: Any,
    seeds: Sequence[int],
    *,
    setup: Setup | None = None,
    workdir: str | pathlib.Path | None = None,
    stop: StopSignals | None = None,
    probe: Callable[[Any], dict] | None = None,
) -> dict:
    """Trains `config` once per seed, all seeds in one vmapped program.

    `config.seed` is ignored; `seeds` replaces it; with `train.init_from` every seed
    starts from that run's parameters (its own fresh adapters). `setup` is `config`'s
    (built here when None). A seed whose loss stops being finite keeps
    training (its numbers become nan) and is reported in `diverged`, so one
    bad seed does not stop the others. With `workdir`, training resumes from
    its checkpoint and, when `stop` reaches a boundary, saves one and raises
    `Preempted`. `probe(params) -> {name: array}` (one seed's parameters; it
    is vmapped and jitted here) is measured before training and after every
    compiled chunk, to follow something through training.

    Returns a dict with, per seed (lists in the order of `seeds`):
      final_loss, metrics {name: [...]}, untrained_metrics {name: [...]},
      curve_steps (the logged steps) and curves (loss at those steps, [seed][step]);
    probes (with `probe`: {"step": [...], name: [step][seed]...}); params (the
    trained parameters, leading axis = seed), diverged (seeds with a non-finite
    loss), compile_s, train_s, wall_time_s.
    """
    started = time.perf_counter()
    config = to_dict(config)
    setup = build_setup(config) if setup is None else setup
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("train_seeds: no seeds given")
    keys = jax.vmap(seed_keys)(jnp.asarray(seeds))  # {name: (num_seeds, 2)}
    tx = make_optimizer(config["train"])
    initial = jax.jit(jax.vmap(lambda key: init_train_state(setup, tx, key)))(keys["init"])
    if config["train"].get("init_from"):  # every seed starts from the source's parameters
        source = read_source(config["train"]["init_from"])
        initial = initial.replace(params=jax.vmap(lambda p: fitted_params(config, source, p))(initial.params))
    evaluate = jax.jit(jax.vmap(setup.evaluate, in_axes=(0, 0, None)))
    chunks = _VmappedChunks(setup, keys, initial)

    t = time.perf_counter()
    untrained, _ = jax.device_get(evaluate(initial.params, keys["eval"], setup.data))
    chunks.compiled(min(_chunk_length(config["train"]), config["train"]["steps"]))
    compile_s = time.perf_counter() - t

    t = time.perf_counter()
    store = _Store(workdir, config["train"])
    probe = None if probe is None else jax.jit(jax.vmap(probe))
    states = _train(config, chunks, initial, store, stop or StopSignals(), probe)
    train_s = time.perf_counter() - t
    trained, _ = jax.device_get(evaluate(states.params, keys["eval"], setup.data))
    logged = store.records("loss")
    curves = np.array([r["loss"] for r in logged]).T  # (num_seeds, num_logged)
    probes = store.records("probe")
    return {
        "seeds": seeds,
        "final_loss": curves[:, -1].tolist(),
        "metrics": {name: np.asarray(v).tolist() for name, v in trained.items()},
        "untrained_metrics": {name: np.asarray(v).tolist() for name, v in untrained.items()},
        "curve_steps": [r["step"] for r in logged],
        "curves": curves.tolist(),
        **({"probes": {name: [r[name] for r in probes] for name in probes[0]}} if probes else {}),
        "diverged": [s for s, ok in zip(seeds, np.isfinite(curves).all(axis=1), strict=True) if not ok],
        "params": states.params,
        "compile_s": compile_s,
        "train_s": train_s,
        "wall_time_s": time.perf_counter() - started,
    }


def _chunk_length(train: dict) -> int:
    return chunk_length(train["log_every"], train["checkpoint_every"])


class _VmappedChunks:
    """The vmapped training chunk of each length, compiled once."""

    def __init__(self, setup: Setup, keys: dict, states: Any):
        self._setup, self._keys, self._states = setup, keys, states
        self._compiled: dict[int, Any] = {}

    def compiled(self, n: int) -> Any:
        if n not in self._compiled:
            vmapped = jax.vmap(make_train_chunk(self._setup, n), in_axes=(0, 0, None))
            args = (self._states, self._keys["data"], self._setup.data)
            self._compiled[n] = compile_for_platform(jax.jit(vmapped, donate_argnums=0), *args)
        return self._compiled[n]

    def __call__(self, states: Any, first_step: int, n: int) -> tuple[Any, jax.Array]:
        return self.compiled(n)(states, self._keys["data"], self._setup.data)


class _Store:
    """Where a vmapped run keeps its progress: in memory, or in a workdir (checkpoints/,
    curves.jsonl with the logged losses, probes.jsonl with the probe's values) to resume from."""

    def __init__(self, workdir: Any, train: dict):
        self.directory = None if workdir is None else pathlib.Path(workdir)
        self._log_every = train["log_every"]
        self._logged: list[dict] = []
        self._probes: list[dict] = []
        self._checkpoints = None
        if self.directory is not None:
            self._checkpoints = Checkpoints(
                self.directory / "checkpoints", max_to_keep=kept_checkpoints(train)
            )

    def restore(self, initial: Any) -> tuple[Any, int]:
        """(states, step) from the newest checkpoint, else (initial, 0); opens the logs there."""
        restored = None if self._checkpoints is None else restore_train_state(self._checkpoints, initial)
        states, start_step = (initial, 0) if restored is None else (restored[1], restored[0])
        if self.directory is not None:
            # As metrics.jsonl: on resume, the losses on the log grid before the checkpoint stay.
            self._curves = MetricsWriter(
                self.directory / "curves.jsonl", start_step, self._log_every, tensorboard=False
            )
            self._probe_log = MetricsWriter(self.directory / "probes.jsonl", start_step, 1, tensorboard=False)
        return states, start_step

    def write(self, kind: str, record: dict) -> None:
        (self._logged if kind == "loss" else self._probes).append(record)
        if self.directory is not None:
            (self._curves if kind == "loss" else self._probe_log).write(record)

    def save(self, step: int, states: Any) -> None:
        if self._checkpoints is not None:
            self._checkpoints.save(step, checkpoint_tree(states))

    def records(self, kind: str) -> list[dict]:
        """Every record of the run (from before a resume too)."""
        if self.directory is None:
            return self._logged if kind == "loss" else self._probes
        return read_metrics(self.directory / ("curves.jsonl" if kind == "loss" else "probes.jsonl"))

    def close(self) -> None:
        if self.directory is not None:
            self._curves.close()
            self._probe_log.close()
        if self._checkpoints is not None:
            self._checkpoints.close()


def _train(
    config: dict, chunks: _VmappedChunks, initial: Any, store: _Store, stop: StopSignals, probe: Any
) -> Any:
    """Trains the vmapped states from `store`'s newest checkpoint (or `initial`) to `train.steps`;
    logs losses and the probe's values into `store`, checkpoints there, stops on `stop`."""
    train = config["train"]
    steps, log_every, checkpoint_every = train["steps"], train["log_every"], train["checkpoint_every"]
    states, start_step = store.restore(initial)
    if probe is not None:
        store.write("probe", {"step": start_step, **_plain(probe(states.params))})

    def after_chunk(first_step: int, losses: np.ndarray, states: Any) -> None:
        for step, seed_losses in logged_losses(first_step, losses, log_every, steps):
            store.write("loss", {"step": step, "loss": seed_losses.tolist()})
        end = first_step + losses.shape[-1]
        if probe is not None:
            store.write("probe", {"step": end, **_plain(probe(states.params))})
        stop.save_or_stop(
            end, steps, checkpoint_every, lambda step: store.save(step, states), store.directory
        )

    try:
        return train_chunks(
            states,
            chunks,
            start_step=start_step,
            steps=steps,
            chunk_length=_chunk_length(train),
            after_chunk=after_chunk,
        )
    finally:
        store.close()


def _plain(values: dict) -> dict:
    return {name: np.asarray(value).tolist() for name, value in jax.device_get(values).items()}
