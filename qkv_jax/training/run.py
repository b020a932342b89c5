"""`train_and_evaluate(config, workdir)`: one run, from config to summary.json."""

from __future__ import annotations

import concurrent.futures
import importlib
import math
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import checkify, multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from qkv_jax.training.checkpoints import Checkpoints
from qkv_jax.training.loop import (
    Setup,
    TrainState,
    chunk_length,
    init_train_state,
    make_optimizer,
    make_train_chunk,
    seed_keys,
)
from qkv_jax.training.sharding import is_primary, make_mesh, mesh_shape, state_shardings, to_host
from qkv_jax.training.validate import ConfigError, get_field
from qkv_jax.training.workdir import MetricsWriter, prepare_workdir, read_metrics, write_json

__all__ = ["TASKS", "build_setup", "train_and_evaluate", "to_dict"]

# task.name -> module whose build(config) returns the Setup.
TASKS = {
    "flag_retrieval": "qkv_jax.training.flag_retrieval",
    "char_lm": "qkv_jax.training.char_lm",
    "copy": "qkv_jax.training.lm_tasks",
    "brackets": "qkv_jax.training.lm_tasks",
}


def to_dict(config: Any) -> dict:
    """A ConfigDict (or mapping) as a plain dict."""
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def build_setup(config: Any) -> Setup:
    """Validates `config` (ConfigError naming field and value) and builds its Setup."""
    config = to_dict(config)
    name = get_field(config, "task.name")
    if name not in TASKS:
        raise ConfigError(f"task.name={name!r}: unknown; choose one of {', '.join(TASKS)}")
    return importlib.import_module(TASKS[name]).build(config)


def _checkpoint_tree(state: TrainState) -> dict:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state}


def _to_json(value: Any) -> Any:
    array = np.asarray(value)
    return array.item() if array.ndim == 0 else array.tolist()


class _Progress:
    """A tqdm bar on a terminal, nothing otherwise."""

    def __init__(self, total: int, initial: int, enabled: bool = True):
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, steps: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(steps)
            self.bar.set_postfix(loss=f"{loss:.4g}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def compile_for_platform(jitted: Any, *args: Any) -> Any:
    """AOT-compiles `jitted` for `args` (arrays or ShapeDtypeStructs).

    On CPU, XLA's backend optimization level 1 instead of the default 2: for
    the small models here it compiles about a third faster and the compiled
    loops run as fast or faster (benchmarks/flag_retrieval.py measures both).
    """
    lowered = jitted.lower(*args)
    if jax.default_backend() == "cpu":
        return lowered.compile(compiler_options=dict(CPU_COMPILER_OPTIONS))
    return lowered.compile()


CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}


class _Compiler:
    """AOT compiles in background threads (XLA compiles release the GIL), timed."""

    def __init__(self):
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=3)
        self.futures: dict[Any, concurrent.futures.Future] = {}

    def get(self, name: Any, jitted: Callable[[], Any], *args: Any, wait: bool = True):
        if name not in self.futures:

            def timed():
                t = time.perf_counter()
                return compile_for_platform(jitted(), *args), time.perf_counter() - t

            self.futures[name] = self.executor.submit(timed)
        return self.futures[name].result()[0] if wait else None

    def seconds(self) -> float:
        return sum(f.result()[1] for f in self.futures.values() if f.done() and not f.exception())


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def train_and_evaluate(config: Any, workdir: str | pathlib.Path) -> dict:
    """Trains the experiment `config` describes, resuming from `workdir`'s checkpoints.

    Writes into `workdir`: config.json, metrics.jsonl (`{"step": s, "loss": ...}`,
    the training loss of step s, computed before its update; step 0 is the
    untrained model), checkpoints/, summary.json and the experiment's pictures.
    Returns the summary. Raises ConfigError for a bad config (before anything
    compiles) and FloatingPointError when the loss stops being finite (with
    `train.checkify=True`, when any operation inside the compiled step makes a
    nan or divides by zero, naming the operation).

    `config.mesh.data` x `config.mesh.model` devices (see
    `qkv_jax.training.sharding`) run one jitted step with explicit shardings;
    in a multi-process run (after `jax.distributed.initialize`) every process
    calls this, and process 0 alone writes metrics, summary and pictures.
    """
    started = time.perf_counter()
    timings: dict[str, float] = {}
    config = to_dict(config)
    setup = build_setup(config)
    mesh = make_mesh(*mesh_shape(config))
    train = config["train"]
    primary = is_primary()
    workdir = pathlib.Path(workdir)
    if primary:
        prepare_workdir(workdir, config, overwrite=train["overwrite"])
    _barrier("workdir ready")
    steps, log_every, checkpoint_every = train["steps"], train["log_every"], train["checkpoint_every"]
    use_checkify = bool(train.get("checkify", False))
    keys = seed_keys(config["seed"])
    tx = make_optimizer(train)

    abstract_state = jax.eval_shape(lambda key: init_train_state(setup, tx, key), keys["init"])
    state_sharding = state_shardings(abstract_state, mesh)
    replicated = NamedSharding(mesh, P())
    batches_sharding = NamedSharding(mesh, P(None, "data"))  # (steps, batch, ...)
    init = jax.jit(lambda key: init_train_state(setup, tx, key), out_shardings=state_sharding)

    def chunk_jit(n: int):
        chunk = make_train_chunk(setup, n, batches_sharding)
        if use_checkify:  # the error value's sharding is left to XLA
            return jax.jit(
                checkify.checkify(chunk, errors=checkify.float_checks),
                in_shardings=(state_sharding, replicated, replicated),
            )
        return jax.jit(
            chunk,
            in_shardings=(state_sharding, replicated, replicated),
            out_shardings=(state_sharding, replicated),
        )

    compiler = _Compiler()

    def chunk_fn(n: int, wait: bool = True):
        return compiler.get(
            ("chunk", n), lambda: chunk_jit(n), abstract_state, keys["data"], setup.data, wait=wait
        )

    def evaluate_fn(wait: bool = True):
        jitted = lambda: jax.jit(  # noqa: E731
            setup.evaluate,
            in_shardings=(state_sharding.params, replicated, replicated),
            out_shardings=replicated,
        )
        return compiler.get("evaluate", jitted, abstract_state.params, keys["eval"], setup.data, wait=wait)

    length = chunk_length(log_every, checkpoint_every)
    evaluate_fn(wait=False)
    if setup.report is not None and primary:  # matplotlib's import, meanwhile
        compiler.executor.submit(importlib.import_module, "qkv_jax.plots")

    initial_state = init(keys["init"])
    checkpoints = Checkpoints(workdir / "checkpoints")
    state = initial_state
    restored = checkpoints.restore_latest(_checkpoint_tree(initial_state))
    if restored is not None:
        tree = restored[1]
        state = initial_state.replace(step=tree["step"], params=tree["params"], opt_state=tree["opt_state"])
    start_step = int(to_host(state.step))
    logging.info("%s", f"resuming from checkpoint step {start_step}" if restored else "starting from step 0")
    if start_step < steps:
        chunk_fn(min(length, steps - start_step), wait=False)
    timings["setup_s"] = time.perf_counter() - started

    t = time.perf_counter()
    untrained, examples_before = to_host(evaluate_fn()(initial_state.params, keys["eval"], setup.data))
    timings["first_eval_s"] = time.perf_counter() - t
    report_before = None
    if setup.report is not None and primary:  # drawn while the training runs
        report_before = compiler.executor.submit(setup.report, workdir, "before", examples_before)

    metrics = MetricsWriter(workdir / "metrics.jsonl", start_step, log_every, enabled=primary)
    progress = _Progress(steps, start_step, enabled=primary)
    last_loss = None
    train_loop_s = 0.0
    step = start_step
    try:
        while step < steps:
            n = min(length, steps - step)
            run_chunk = chunk_fn(n)
            t = time.perf_counter()
            if use_checkify:
                error, (state, losses) = run_chunk(state, keys["data"], setup.data)
                state = jax.device_put(state, state_sharding)
                try:
                    error.throw()
                except checkify.JaxRuntimeError as found:
                    raise FloatingPointError(
                        f"checkify: {str(found).splitlines()[0]} "
                        f"(in the window of steps {step}-{step + n - 1})"
                    ) from None
            else:
                state, losses = run_chunk(state, keys["data"], setup.data)
            losses = np.asarray(to_host(losses))
            train_loop_s += time.perf_counter() - t
            bad = ~np.isfinite(losses)
            if bad.any():
                first = step + int(np.argmax(bad))
                saved = checkpoints.all_steps()
                raise FloatingPointError(
                    f"loss is {losses[bad][0]} at step {first} (in the window of steps {step}-"
                    f"{step + n - 1}); last good checkpoint: "
                    f"{'step ' + str(saved[-1]) if saved else 'none'} in {checkpoints.directory}"
                )
            for i, loss in enumerate(losses):
                if (step + i) % log_every == 0 or step + i == steps - 1:
                    metrics.write({"step": step + i, "loss": float(loss)})
            last_loss = float(losses[-1])
            step += n
            progress.update(n, last_loss)
            if step % checkpoint_every == 0 or step == steps:
                checkpoints.save(step, _checkpoint_tree(state))
        t = time.perf_counter()
        trained, examples_after = to_host(evaluate_fn()(state.params, keys["eval"], setup.data))
        timings["eval_s"] = time.perf_counter() - t
        metrics.write_scalars("eval", {k: _to_json(v) for k, v in trained.items()}, step)
    finally:
        progress.close()
        metrics.close()
        checkpoints.close()
        compiler.executor.shutdown(wait=True)
    timings["train_loop_s"] = train_loop_s
    timings["compile_s"] = compiler.seconds()
    if last_loss is None:  # nothing left to train: the run was complete
        records = read_metrics(workdir / "metrics.jsonl")
        last_loss = records[-1]["loss"] if records else math.nan

    summary: dict[str, Any] = {
        "experiment": config.get("experiment", config["task"]["name"]),
        "steps": int(to_host(state.step)),
        "resumed_from_step": start_step,
        "final_loss": last_loss,
        "num_params": int(sum(np.size(x) for x in jax.tree.leaves(state.params))),
        "mesh": dict(mesh.shape),
        "processes": jax.process_count(),
        **{f"eval_{name}": _to_json(value) for name, value in trained.items()},
        "untrained": {f"eval_{name}": _to_json(value) for name, value in untrained.items()},
    }
    if report_before is not None and setup.report is not None:
        t = time.perf_counter()
        summary.update(report_before.result())
        summary.update(setup.report(workdir, "after", examples_after))
        timings["report_s"] = time.perf_counter() - t
    summary["wall_time_s"] = time.perf_counter() - started
    summary["timings"] = timings
    if primary:
        write_json(workdir / "summary.json", summary)
    _barrier("summary written")
    return summary
