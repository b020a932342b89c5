"""`train_and_evaluate(config, workdir)`: one run, from config to summary.json.

The run in five steps, each a function below:

  1. `start_run`: build the task from the config (validated), prepare the
     workdir, the device mesh and the optimizer, start compiling;
  2. `restore_or_init`: the newest checkpoint in the workdir, or fresh parameters;
  3. `train`: the chunked loop (`loop.train_chunks`) with logging, the NaN/inf
     guard and checkpoints;
  4. `evaluate` the untrained and the trained parameters;
  5. `summarise` and `write_outputs`: summary.json and the task's pictures.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from qkv_jax.lora import count_params
from qkv_jax.training.checkpoints import Checkpoints, checkpoint_tree, restore_train_state
from qkv_jax.training.compiled import CompiledPrograms
from qkv_jax.training.init_from import initial_params
from qkv_jax.training.loop import (
    chunk_length,
    kept_checkpoints,
    logged_losses,
    make_optimizer,
    seed_keys,
    train_chunks,
)
from qkv_jax.training.preemption import StopSignals
from qkv_jax.training.sharding import is_primary, make_mesh, mesh_shape, to_host
from qkv_jax.training.task import Setup, build_setup, to_dict
from qkv_jax.training.workdir import (
    RUN_OUTPUTS,
    MetricsWriter,
    WorkdirLock,
    check_writable,
    disk_full_guard,
    prepare_workdir,
    read_metrics,
    write_json,
)

__all__ = ["Run", "train_and_evaluate"]


@dataclasses.dataclass
class Run:
    """What the steps of one run share."""

    config: dict
    setup: Setup
    workdir: pathlib.Path
    keys: dict
    mesh: Any
    programs: CompiledPrograms
    checkpoints: Checkpoints
    primary: bool
    started: float
    lock: WorkdirLock | None
    stop: StopSignals
    timings: dict = dataclasses.field(default_factory=dict)
    metrics: MetricsWriter | None = None
    pictures_before: Any = None

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.checkpoints.close()
        self.programs.close()
        self.stop.restore()
        if self.lock is not None:
            self.lock.release()

    def kept(self) -> str:
        """What a failed write leaves: the newest checkpoint, and the metrics up to it."""
        saved = self.checkpoints.all_steps()
        newest = f"the checkpoint of step {saved[-1]}" if saved else "no checkpoint yet"
        return f"{newest} and metrics.jsonl up to it are kept in {self.workdir}"


def train_and_evaluate(config: Any, workdir: str | pathlib.Path) -> dict:
    """Trains the experiment `config` describes, resuming from `workdir`'s checkpoints.

    Writes into `workdir`: config.json, metrics.jsonl (`{"step": s, "loss": ...}`,
    the training loss of step s, computed before its update; step 0 is the
    untrained model), checkpoints/, summary.json and the experiment's pictures.
    Returns the summary. A run that already finished (its newest checkpoint is
    at `train.steps` and summary.json is written) is left as it is, and its
    summary returned. Raises ConfigError for a bad config (before anything
    compiles) and FloatingPointError when the loss stops being finite (with
    `train.checkify=True`, when any operation inside the compiled step makes a
    nan or divides by zero, naming the operation).

    `config.mesh.data` x `config.mesh.model` devices (see
    `qkv_jax.training.sharding`) run one jitted step with explicit shardings;
    in a multi-process run (after `jax.distributed.initialize`) every process
    calls this, and process 0 alone writes metrics, summary and pictures.
    """
    run = start_run(to_dict(config), pathlib.Path(workdir))
    try:
        # Restore or initialise.
        initial_state, state, start_step = restore_or_init(run)
        if (finished := finished_summary(run, start_step)) is not None:
            return finished
        # Evaluate the untrained model; its pictures are drawn while the training runs.
        untrained, examples_before = evaluate(run, initial_state.params)
        if run.setup.report is not None and run.primary:
            run.pictures_before = run.programs.submit(
                run.setup.report, run.workdir, "before", examples_before
            )
        # Train.
        state = train(run, state, start_step)
        # Evaluate the trained model.
        trained, examples_after = evaluate(run, state.params)
    finally:
        run.close()
    # Summarise and write the outputs.
    summary = summarise(run, state, start_step, untrained, trained)
    write_outputs(run, summary, examples_after)
    return summary


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def start_run(config: dict, workdir: pathlib.Path) -> Run:
    """Validates and builds the task, prepares the workdir, mesh and optimizer, starts compiling."""
    started = time.perf_counter()
    setup = build_setup(config)
    mesh = make_mesh(*mesh_shape(config))
    primary = is_primary()
    lock = claim_workdir(workdir, config, setup) if primary else None
    _barrier("workdir ready")
    keys = seed_keys(config["seed"])
    programs = CompiledPrograms(setup, make_optimizer(config["train"]), mesh, keys, config)
    programs.start(first_chunk=None)
    if setup.report is not None and primary:  # matplotlib's import, meanwhile
        programs.submit(__import__, "qkv_jax.plots")
    checkpoints = Checkpoints(workdir / "checkpoints", max_to_keep=kept_checkpoints(config["train"]))
    stop = StopSignals().install()
    return Run(config, setup, workdir, keys, mesh, programs, checkpoints, primary, started, lock, stop)


def claim_workdir(workdir: pathlib.Path, config: dict, setup: Setup) -> WorkdirLock:
    """Creates the workdir, takes its lock (WorkdirBusyError naming a live holder), then checks
    and writes its config.json (see `prepare_workdir`)."""
    with disk_full_guard(f"the lock and config.json of {workdir}", "nothing else was written"):
        check_writable(workdir)
        lock = WorkdirLock(workdir)
        previous = lock.acquire()
        try:
            outputs = RUN_OUTPUTS + setup.outputs
            prepare_workdir(workdir, config, overwrite=config["train"]["overwrite"], outputs=outputs)
        except BaseException:
            lock.release()
            raise
    if previous is not None:
        logging.warning(
            "%s",
            f"took over {lock.path}, left by pid {previous.get('pid')} on host {previous.get('host')}, "
            "which is no longer running",
        )
    return lock


def restore_or_init(run: Run) -> tuple[Any, Any, int]:
    """(initial state, state to train from, its step): the newest usable checkpoint in
    the workdir, else the initial state at step 0: fresh parameters, or with
    `train.init_from` another run's (`init_from.initial_params`; a fresh optimizer state,
    whose init does not depend on the parameters' values)."""
    initial_state = run.programs.init(run.keys["init"])
    restored = restore_train_state(run.checkpoints, initial_state)
    if restored is None and run.config["train"].get("init_from"):
        params, _ = initial_params(run.config, initial_state.params)
        initial_state = initial_state.replace(params=params)
    state, start_step = (initial_state, 0) if restored is None else (restored[1], restored[0])
    logging.info("%s", f"resuming from checkpoint step {start_step}" if restored else "starting from step 0")
    train = run.config["train"]
    if start_step < train["steps"]:
        run.programs.start(min(_chunk_length(train), train["steps"] - start_step))
    run.timings["setup_s"] = time.perf_counter() - run.started
    return initial_state, state, start_step


def finished_summary(run: Run, start_step: int) -> dict | None:
    """The summary.json of a run that already finished at `train.steps`, else None."""
    path = run.workdir / "summary.json"
    if start_step < run.config["train"]["steps"] or not path.exists():
        return None
    summary = json.loads(path.read_text())
    if summary.get("steps") != start_step:
        return None
    logging.info("%s", f"the run finished at step {start_step} before; {path} is left as it was")
    return summary


def _chunk_length(train: dict) -> int:
    return chunk_length(train["log_every"], train["checkpoint_every"])


def evaluate(run: Run, params: Any) -> tuple[dict, Any]:
    """(metrics, examples) of `params` on the evaluation data, on the host."""
    started = time.perf_counter()
    metrics, examples = to_host(run.programs.evaluate(params))
    run.timings["first_eval_s" if "first_eval_s" not in run.timings else "eval_s"] = (
        time.perf_counter() - started
    )
    if run.metrics is not None:  # after training: the scalars to TensorBoard, at the step trained to
        run.metrics.write_scalars(
            "eval", {k: _to_json(v) for k, v in metrics.items()}, run.metrics.last_step + 1
        )
    return metrics, examples


def train(run: Run, state: Any, start_step: int) -> Any:
    """Trains from `start_step` to `train.steps`: metrics.jsonl every `log_every`
    steps, a checkpoint every `checkpoint_every` steps and at the end, and a
    FloatingPointError (naming the window and the last good checkpoint) when
    the loss stops being finite."""
    train_config = run.config["train"]
    steps, log_every = train_config["steps"], train_config["log_every"]
    metrics = run.metrics = MetricsWriter(run.workdir / "metrics.jsonl", start_step, log_every, run.primary)
    progress = _Progress(steps, start_step, enabled=run.primary)

    def after_chunk(first_step: int, losses: np.ndarray, state: Any) -> None:
        _check_finite(run, first_step, losses)
        with disk_full_guard(f"{metrics.path}", run.kept()):
            for step, loss in logged_losses(first_step, losses, log_every, steps):
                metrics.write({"step": step, "loss": float(loss)})
        end = first_step + len(losses)
        progress.update(len(losses), float(losses[-1]))
        save = lambda step: save_checkpoint(run, step, state)
        run.stop.save_or_stop(end, steps, train_config["checkpoint_every"], save, run.checkpoints.directory)

    try:
        state = train_chunks(
            state,
            run.programs.train_chunk,
            start_step=start_step,
            steps=steps,
            chunk_length=_chunk_length(train_config),
            after_chunk=after_chunk,
        )
    finally:
        progress.close()
    return state


def save_checkpoint(run: Run, step: int, state: Any) -> None:
    """Checkpoint `step` of `state` (one line, DiskFullError, when the disk is full)."""
    with disk_full_guard(f"checkpoint step {step} in {run.checkpoints.directory}", run.kept()):
        run.checkpoints.save(step, checkpoint_tree(state))


def _check_finite(run: Run, first_step: int, losses: np.ndarray) -> None:
    bad = ~np.isfinite(losses)
    if bad.any():
        saved = run.checkpoints.all_steps()
        raise FloatingPointError(
            f"loss is {losses[bad][0]} at step {first_step + int(np.argmax(bad))} (in the window of steps "
            f"{first_step}-{first_step + len(losses) - 1}); last good checkpoint: "
            f"{'step ' + str(saved[-1]) if saved else 'none'} in {run.checkpoints.directory}"
        )


def final_loss(workdir: pathlib.Path, steps: int) -> float:
    """The training loss of the run's last step (`steps - 1`), as metrics.jsonl logged it."""
    records = [r for r in read_metrics(workdir / "metrics.jsonl") if r.get("step") == steps - 1]
    return records[-1]["loss"] if records else float("nan")


def _to_json(value: Any) -> Any:
    array = np.asarray(value)
    return array.item() if array.ndim == 0 else array.tolist()


def summarise(run: Run, state: Any, start_step: int, untrained: dict, trained: dict) -> dict:
    """summary.json's content (without the pictures' entries and the wall time)."""
    steps = int(to_host(state.step))
    params, trainable_params = count_params(state.params)
    return {
        "experiment": run.config.get("experiment", run.config["task"]["name"]),
        "steps": steps,
        "resumed_from_step": start_step,
        "final_loss": final_loss(run.workdir, steps),
        "params": params,
        "trainable_params": trainable_params,
        "mesh": dict(run.mesh.shape),
        "processes": jax.process_count(),
        **{f"eval_{name}": _to_json(value) for name, value in trained.items()},
        "untrained": {f"eval_{name}": _to_json(value) for name, value in untrained.items()},
    }


def write_outputs(run: Run, summary: dict, examples_after: Any) -> None:
    """The task's pictures of the trained model, summary.json (process 0), the
    evaluation scalars to TensorBoard."""
    if run.pictures_before is not None and run.setup.report is not None:
        started = time.perf_counter()
        with disk_full_guard(f"the pictures in {run.workdir}", "the final checkpoint is kept"):
            summary.update(run.pictures_before.result())
            summary.update(run.setup.report(run.workdir, "after", examples_after))
        run.timings["report_s"] = time.perf_counter() - started
    run.timings["compile_s"] = run.programs.compile_seconds()
    run.timings["train_loop_s"] = run.programs.train_seconds
    summary["wall_time_s"] = time.perf_counter() - run.started
    summary["timings"] = run.timings
    if run.primary:
        with disk_full_guard(f"{run.workdir / 'summary.json'}", "the final checkpoint is kept"):
            write_json(run.workdir / "summary.json", summary)
    _barrier("summary written")


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
