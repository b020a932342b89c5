"""`train_and_evaluate(config, workdir)`: one run, from config to summary.json.

The run in five steps, each a function below:

  1. `start_run`: build the task from the config (validated), prepare the
     workdir, the device mesh and the optimizer, start compiling;
  2. `restore_or_init`: the newest checkpoint in the workdir, or fresh parameters;
  3. `train`: the chunked loop (`loop.train_chunks`) with logging, the NaN/inf
     guard and checkpoints;
  4. `evaluate` the untrained and the trained parameters;
  5. `summarise` and `write_outputs`: summary.json and the task's pictures.

`train_seeds(config, seeds)` is the same run for several seeds at once: the
same steps with every compiled function vmapped over a leading seed axis
(`CompiledPrograms(vmapped=True)`). Where vmapping changes what a step can do,
it says so: a seed whose loss stops being finite keeps training (its numbers
become nan) and is reported in `diverged` instead of stopping the others, the
losses logged are one per seed, and no pictures are drawn.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from qkv_jax.lora import count_params
from qkv_jax.training.checkpoints import Checkpoints, checkpoint_tree
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
from qkv_jax.training.setup import Setup, build_setup, to_dict
from qkv_jax.training.sharding import is_primary, make_mesh, mesh_shape, to_host
from qkv_jax.training.validate import ConfigError
from qkv_jax.training.workdir import (
    RESUMABLE_FIELDS,
    RUN_OUTPUTS,
    MetricsWriter,
    WorkdirError,
    WorkdirLock,
    check_workdir_path,
    differences,
    disk_full_guard,
    make_workdir,
    missing_steps,
    move_aside,
    newest_checkpoint_step,
    plain,
    read_json,
    saved_config,
    write_json,
)

__all__ = ["Run", "check_run", "check_workdir", "train_and_evaluate", "train_seeds"]

Probe = Callable[[Any], dict]


@dataclasses.dataclass
class Run:
    """What the steps of one run share. `seeds` is None for a single run (its seed is
    `config.seed`), else the seeds trained together, vmapped; `workdir` is None for a run
    that keeps nothing on disk (a vmapped run inside a study or test)."""

    config: dict
    setup: Setup
    workdir: pathlib.Path | None
    seeds: tuple[int, ...] | None
    keys: dict
    mesh: Any
    pool: concurrent.futures.ThreadPoolExecutor
    programs: CompiledPrograms
    checkpoints: Checkpoints | None
    primary: bool
    started: float
    lock: WorkdirLock | None
    stop: StopSignals
    restore_signals: bool
    log: Callable[[str], None]  # where the run says what it starts from
    probe: Any = None  # the jitted probe, or None
    timings: dict = dataclasses.field(default_factory=dict)
    metrics: MetricsWriter | None = None
    probes: MetricsWriter | None = None
    pictures_before: Any = None

    def close(self) -> None:
        for writer in (self.metrics, self.probes):
            if writer is not None:
                writer.close()
        if self.checkpoints is not None:
            self.checkpoints.close()
        self.pool.shutdown(wait=True)
        if self.restore_signals:
            self.stop.restore()
        if self.lock is not None:
            self.lock.release()

    def kept(self) -> str:
        """What a failed write leaves: the newest checkpoint, and the metrics up to it."""
        saved = [] if self.checkpoints is None else self.checkpoints.all_steps()
        newest = f"the checkpoint of step {saved[-1]}" if saved else "no checkpoint yet"
        return f"{newest} and metrics.jsonl up to it are kept in {self.workdir}"


def train_and_evaluate(
    config: Any,
    workdir: str | pathlib.Path | None,
    *,
    setup: Setup | None = None,
    seeds: Sequence[int] | None = None,
    stop: StopSignals | None = None,
    probe: Probe | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Trains the experiment `config` describes, resuming from `workdir`'s checkpoints.

    Writes into `workdir`: config.json, metrics.jsonl (`{"step": s, "loss": ...}`,
    the training loss of step s, computed before its update; step 0 is the
    untrained model), checkpoints/, summary.json and the experiment's pictures.
    Returns the summary.

    A workdir never contradicts itself: config.json describes what its
    checkpoints and summary hold. A run that already finished at `train.steps`
    is left as it is (config.json too, even if resumable fields such as
    `eval.*` differ: the summary's `not_applied` lists them) and its summary
    returned with `already_finished: True`. More steps continue a finished run:
    its summary.json is first renamed `summary-<steps>.json`, so that no
    summary claims the new end before it is reached. Fewer steps than the
    workdir's run already has are refused (ConfigError, nothing changed) unless
    `train.overwrite`. Raises ConfigError for a bad config (before anything is
    written or compiled) and FloatingPointError when the loss stops being
    finite (with `train.checkify=True`, when any operation inside the compiled
    step makes a nan or divides by zero, naming the operation).

    `seeds`: train one copy per seed in one vmapped program (`train_seeds`).
    `setup`: the config's Setup when the caller built it already. `stop`: the
    signal handler to obey (a sweep shares one across its cells; by default the
    run installs its own). `probe(params) -> {name: array}` (one seed's
    parameters) is measured before training and after every compiled chunk, into
    probes.jsonl and the summary's `probes`. `log(line)`: where the run says
    what it starts from ("starting from step 0", "resuming from checkpoint step
    N"); absl's INFO log by default.

    `config.mesh.data` x `config.mesh.model` devices (see
    `qkv_jax.training.sharding`) run one jitted step with explicit shardings;
    in a multi-process run (after `jax.distributed.initialize`) every process
    calls this, and process 0 alone writes metrics, summary and pictures.
    """
    run = start_run(to_dict(config), workdir, setup, seeds, stop, probe, log)
    try:
        # Restore or initialise.
        initial_state, state, start_step = restore_or_init(run)
        if (finished := finished_summary(run, start_step)) is not None:
            return finished
        announce_start(run, start_step, record_config(run))
        # Evaluate the untrained model; its pictures are drawn while the training runs.
        untrained, examples_before = evaluate(run, initial_state.params)
        if run.setup.save_examples is not None and run.primary and run.seeds is None:
            run.pictures_before = run.pool.submit(
                run.setup.save_examples, run.workdir, "before", examples_before
            )
        # Train.
        state = train(run, state, start_step)
        # Evaluate the trained model.
        trained, examples_after = evaluate(run, state.params)
        # Summarise and write the outputs.
        summary = summarise(run, state, start_step, untrained, trained)
        write_outputs(run, summary, examples_after)
    finally:
        run.close()
    return summary if run.seeds is None else {**summary, "params": state.params}


def train_seeds(
    config: Any,
    seeds: Sequence[int],
    *,
    setup: Setup | None = None,
    workdir: str | pathlib.Path | None = None,
    stop: StopSignals | None = None,
    probe: Probe | None = None,
) -> dict:
    """`train_and_evaluate` once per seed, all seeds in one vmapped program (`config.seed` is
    ignored). Seed i follows the same steps as a run with seed i alone. Without `workdir`
    nothing is written. The summary's per-seed entries are lists in the order of `seeds`
    (final_loss, eval_*, untrained eval_*, curves [seed][logged step] at curve_steps, probes
    {name: [step][seed]}), `diverged` names the seeds whose loss stopped being finite, and
    `params` holds the trained parameters (leading axis = seed)."""
    if not list(seeds):
        raise ValueError("train_seeds: no seeds given")
    return train_and_evaluate(config, workdir, setup=setup, seeds=seeds, stop=stop, probe=probe)


def check_run(config: Any, workdir: str | pathlib.Path | None) -> str:
    """Everything `train_and_evaluate` checks before it compiles, with nothing written: the
    shared sections and the task's (its `build`), the device mesh, and whether `workdir` can
    take this run (`check_workdir`). Returns what the run would do, in words; raises
    ConfigError naming the problem."""
    config = to_dict(config)
    build_setup(config)
    mesh_shape(config)
    steps = config["train"]["steps"]
    name = config.get("experiment") or config["task"]["module"]
    if workdir is None:
        return f"{name} would train {steps} steps"
    workdir = pathlib.Path(workdir)
    if check_workdir(workdir, config):
        return f"{name} would move the run in {workdir} aside (train.overwrite) and train {steps} steps"
    trained = _trained_steps(workdir)
    if trained == steps:
        return f"{name}: the run in {workdir} has trained its {steps} steps; it would be left as it is"
    if trained:
        return f"{name} would resume from checkpoint step {trained} in {workdir} and train to step {steps}"
    return f"{name} would train {steps} steps in {workdir}, from step 0"


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def start_run(
    config: dict,
    workdir: str | pathlib.Path | None,
    setup: Setup | None,
    seeds: Sequence[int] | None,
    stop: StopSignals | None,
    probe: Probe | None,
    log: Callable[[str], None] | None = None,
) -> Run:
    """Validates and builds the task, prepares the workdir, mesh and optimizer, starts compiling.
    What it took (the workdir's lock, the compile threads) is given back when a later step fails."""
    started = time.perf_counter()
    setup = build_setup(config) if setup is None else setup
    mesh = make_mesh(*mesh_shape(config))
    primary = is_primary()
    workdir = None if workdir is None else pathlib.Path(workdir)
    if workdir is not None and not primary:  # refuses as process 0 does, reading the shared files
        check_workdir(workdir, config)
    lock = claim_workdir(workdir, config, setup) if primary and workdir is not None else None
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=3)
    try:
        _barrier("workdir ready")
        vmapped = seeds is not None
        seeds = None if seeds is None else tuple(int(s) for s in seeds)
        keys = seed_keys(config["seed"]) if seeds is None else jax.vmap(seed_keys)(jnp.asarray(seeds))
        programs = CompiledPrograms(
            setup, make_optimizer(config["train"]), mesh, keys, config, pool, vmapped=vmapped
        )
        programs.start(first_chunk=None)
        if setup.save_examples is not None and primary and not vmapped:  # matplotlib's import, meanwhile
            pool.submit(__import__, "qkv_jax.plots")
        checkpoints = None
        if workdir is not None:
            checkpoints = Checkpoints(workdir / "checkpoints", max_to_keep=kept_checkpoints(config["train"]))
        jitted_probe = None if probe is None else jax.jit(jax.vmap(probe) if vmapped else probe)
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        if lock is not None:
            lock.release()
        raise
    restore_signals = stop is None
    stop = StopSignals().install() if stop is None else stop
    log = log or (lambda line: logging.info("%s", line))
    return Run(
        config, setup, workdir, seeds, keys, mesh, pool, programs, checkpoints, primary, started, lock,
        stop, restore_signals, log, jitted_probe,
    )  # fmt: skip


def _trained_steps(workdir: pathlib.Path) -> int:
    """How far the run in `workdir` has trained: its newest checkpoint's step, or its summary's."""
    try:
        summary = read_json(workdir / "summary.json")
    except WorkdirError:  # damaged: recomputed by the run that finds it
        summary = None
    ended = summary.get("steps") if isinstance(summary, dict) else None
    return max(newest_checkpoint_step(workdir) or 0, ended if isinstance(ended, int) else 0)


def check_workdir(workdir: pathlib.Path, config: dict) -> bool:
    """Whether `workdir` can take the run `config` describes, read without writing anything.

    ConfigError naming the workdir when it cannot be written (a file, not writable, a
    read-only filesystem), holds a run of a different config (a field outside
    RESUMABLE_FIELDS differs, and the run saved a checkpoint: one that stopped before its
    first has nothing to keep), or holds one already trained past `train.steps`;
    WorkdirError when its config.json is damaged. With `train.overwrite` the last two are
    allowed: returns True when the run in it is to be moved aside first.
    """
    check_workdir_path(workdir)
    saved = saved_config(workdir)
    trained = _trained_steps(workdir)
    started = trained > 0 or (workdir / "summary.json").exists()
    # A run that saved nothing (it stopped before its first checkpoint) has nothing to keep.
    changed = differences(saved, config, RESUMABLE_FIELDS) if saved is not None and started else []
    steps, overwrite = config["train"]["steps"], config["train"]["overwrite"]
    if changed and not overwrite:
        raise ConfigError(
            f"workdir={str(workdir)!r} holds a run of a different config ("
            + "; ".join(changed[:3])
            + "); use another workdir or --config.train.overwrite=True"
        )
    if trained > steps and not changed and not overwrite:
        raise ConfigError(
            f"workdir={str(workdir)!r} already holds a run trained to step {trained}, more than "
            f"train.steps={steps}; nothing was changed: use train.steps={trained} or more to continue "
            "it, another workdir, or --config.train.overwrite=True to move it aside"
        )
    return bool(changed) or trained > steps


def claim_workdir(workdir: pathlib.Path, config: dict, setup: Setup) -> WorkdirLock:
    """Checks the workdir (`check_workdir`, before anything is written), creates it and takes its
    lock (WorkdirBusyError naming a live holder), and with `train.overwrite` moves a run it
    replaces aside. config.json is written later, by `record_config`, once the run trains."""
    check_workdir(workdir, config)
    with disk_full_guard(f"the lock of {workdir}", "nothing else was written"):
        make_workdir(workdir)
        lock = WorkdirLock(workdir)
        previous = lock.acquire()
        try:
            if check_workdir(workdir, config):  # again, holding the lock
                move_aside(workdir, RUN_OUTPUTS + setup.outputs)
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
    whose init does not depend on the parameters' values). A workdir whose checkpoints are
    all unusable is a WorkdirError (training from step 0 beside them would mix two runs)."""
    initial_state = run.programs.init()
    restored = None
    if run.checkpoints is not None:
        restored = run.checkpoints.restore_latest(checkpoint_tree(initial_state))
        if restored is None and (saved := run.checkpoints.all_steps()):
            raise WorkdirError(
                f"{run.checkpoints.directory}: none of its checkpoints (steps "
                f"{', '.join(map(str, saved))}) reads back and verifies (the warnings above say why); "
                "move the directory aside to train this run from step 0, or use another workdir"
            )
    if restored is None and run.config["train"]["init_from"]:
        params = initial_params(run.config, initial_state.params, vmapped=run.seeds is not None)
        initial_state = initial_state.replace(params=params)
    if restored is None:
        state, start_step = initial_state, 0
    else:
        start_step, tree = restored
        state = initial_state.replace(step=tree["step"], params=tree["params"], opt_state=tree["opt_state"])
    train = run.config["train"]
    if start_step < train["steps"]:
        run.programs.start(min(chunk_length(train), train["steps"] - start_step))
    run.timings["setup_s"] = time.perf_counter() - run.started
    return initial_state, state, start_step


def finished_summary(run: Run, start_step: int) -> dict | None:
    """The summary.json of a run that already finished at `train.steps`, with
    `already_finished: True` and `not_applied` (the fields this config sets otherwise, left as
    config.json has them), else None. A damaged summary.json of a finished run is recomputed:
    None, with a warning. A missing config.json is written."""
    if run.workdir is None or start_step < run.config["train"]["steps"]:
        return None
    path = run.workdir / "summary.json"
    try:
        summary = read_json(path, f"recomputing it from checkpoint step {start_step}")
    except WorkdirError as error:
        logging.warning("%s", str(error))
        return None
    if not isinstance(summary, dict) or summary.get("steps") != start_step:
        return None
    saved = saved_config(run.workdir)
    not_applied = [] if saved is None else differences(saved, run.config, ("train.overwrite",))
    if saved is None and run.primary:  # deleted (it was damaged, say): the run's config, again
        write_json(run.workdir / "config.json", run.config)
    logging.info("%s", f"the run finished at step {start_step} before; {run.workdir} is left as it was")
    return {**summary, "already_finished": True, "not_applied": not_applied}


def record_config(run: Run) -> str | None:
    """Writes config.json (process 0) now that the run trains or evaluates. A summary.json of an
    earlier end (a finished run continued to more steps) is first renamed
    `summary-<steps>.json`: no summary claims to be this run's end before it is. Returns that
    name, or None."""
    if not run.primary or run.workdir is None:
        return None
    path, kept = run.workdir / "summary.json", None
    try:
        earlier = read_json(path)
    except WorkdirError:  # damaged: recomputed at the end
        earlier = None
    with disk_full_guard(f"config.json in {run.workdir}", "nothing else was written"):
        ended = earlier.get("steps") if isinstance(earlier, dict) else None
        if isinstance(ended, int) and ended != run.config["train"]["steps"]:
            kept = f"summary-{ended}.json"
            os.replace(path, run.workdir / kept)
        write_json(run.workdir / "config.json", run.config)
    return kept


def announce_start(run: Run, start_step: int, kept_summary: str | None) -> None:
    """One line: the step the run starts from, and from what."""
    if start_step == 0:
        source = run.config["train"]["init_from"]
        run.log("starting from step 0" + (f" with the parameters of {source}" if source else ""))
    elif kept_summary is not None:
        run.log(
            f"resuming from checkpoint step {start_step}, where the run had finished, to step "
            f"{run.config['train']['steps']} (the earlier summary is kept as {kept_summary})"
        )
    else:
        run.log(f"resuming from checkpoint step {start_step}")


def evaluate(run: Run, params: Any) -> tuple[dict, Any]:
    """(metrics, examples) of `params` on the evaluation data, on the host."""
    started = time.perf_counter()
    metrics, examples = to_host(run.programs.evaluate(params))
    run.timings["first_eval_s" if "first_eval_s" not in run.timings else "eval_s"] = (
        time.perf_counter() - started
    )
    if run.metrics is not None:  # after training: the scalars to TensorBoard, at the step trained to
        run.metrics.write_scalars("eval", plain(metrics), run.metrics.last_step + 1)
    return metrics, examples


def train(run: Run, state: Any, start_step: int) -> Any:
    """Trains from `start_step` to `train.steps`: metrics.jsonl every `log_every`
    steps, a checkpoint every `checkpoint_every` steps and at the end, and a
    FloatingPointError (naming the window and the last good checkpoint) when
    the loss stops being finite (a vmapped run's seeds keep training)."""
    train_config = run.config["train"]
    steps, log_every = train_config["steps"], train_config["log_every"]
    directory = run.workdir
    metrics = run.metrics = MetricsWriter(
        None if directory is None else directory / "metrics.jsonl",
        start_step,
        log_every,
        enabled=run.primary,
        tensorboard=run.seeds is None,
        final_step=steps - 1,
    )
    if metrics.enabled and (gaps := missing_steps(metrics.records, start_step, log_every)):
        count = f"{len(gaps)} logged step{'s' if len(gaps) > 1 else ''}"
        which = f"step {gaps[0]}" if len(gaps) == 1 else f"steps {gaps[0]}-{gaps[-1]}"
        logging.warning(
            "%s",
            f"{metrics.path}: no record of {count} before checkpoint step {start_step} ({which}; the file "
            "was truncated or damaged, or train.log_every changed); training continues and the file keeps "
            "the records that read back",
        )
    if run.probe is not None:
        run.probes = MetricsWriter(None if directory is None else directory / "probes.jsonl", start_step, 1)
        run.probes.write({"step": start_step, **plain(run.probe(state.params))})
    progress = _Progress(steps, start_step, enabled=run.primary and directory is not None)

    def after_chunk(first_step: int, losses: np.ndarray, state: Any) -> None:
        if run.seeds is None:
            _check_finite(run, first_step, losses)
        with disk_full_guard(f"{metrics.path}", run.kept()):
            for step, loss in logged_losses(first_step, losses, log_every, steps):
                metrics.write({"step": step, "loss": plain(loss)})
        end = first_step + losses.shape[-1]
        if run.probes is not None:
            run.probes.write({"step": end, **plain(run.probe(state.params))})
        progress.update(losses.shape[-1], float(np.mean(losses[..., -1])))
        save = lambda step: save_checkpoint(run, step, state)
        run.stop.save_or_stop(end, steps, train_config["checkpoint_every"], save, directory)

    try:
        state = train_chunks(
            state,
            run.programs.train_chunk,
            start_step=start_step,
            steps=steps,
            chunk_length=chunk_length(train_config),
            after_chunk=after_chunk,
        )
    finally:
        progress.close()
    return state


def save_checkpoint(run: Run, step: int, state: Any) -> None:
    """Checkpoint `step` of `state` (one line, DiskFullError, when the disk is full)."""
    if run.checkpoints is None:
        return
    with disk_full_guard(f"checkpoint step {step} in {run.checkpoints.directory}", run.kept()):
        run.checkpoints.save(step, checkpoint_tree(state))


def _check_finite(run: Run, first_step: int, losses: np.ndarray) -> None:
    bad = ~np.isfinite(losses)
    if bad.any():
        saved = [] if run.checkpoints is None else run.checkpoints.all_steps()
        where = f" in {run.checkpoints.directory}" if run.checkpoints is not None else ""
        raise FloatingPointError(
            f"loss is {losses[bad][0]} at step {first_step + int(np.argmax(bad))} (in the window of steps "
            f"{first_step}-{first_step + len(losses) - 1}); last good checkpoint: "
            f"{'step ' + str(saved[-1]) if saved else 'none'}{where}"
        )


def summarise(run: Run, state: Any, start_step: int, untrained: dict, trained: dict) -> dict:
    """summary.json's content (without the pictures' entries and the wall time)."""
    assert run.metrics is not None
    steps = int(np.max(to_host(state.step)))
    params, trainable_params = count_params(state.params if run.seeds is None else _first(state.params))
    records = run.metrics.records
    final = [r["loss"] for r in records if r["step"] == steps - 1]
    summary = {
        "experiment": run.config.get("experiment", run.config["task"]["name"]),
        "steps": steps,
        "resumed_from_step": start_step,
        # The training loss of the run's last step (steps - 1), as metrics.jsonl logged it.
        "final_loss": final[-1] if final else float("nan"),
        "params": params,
        "trainable_params": trainable_params,
        "mesh": dict(run.mesh.shape),
        "processes": jax.process_count(),
        **{f"eval_{name}": value for name, value in plain(trained).items()},
        "untrained": {f"eval_{name}": value for name, value in plain(untrained).items()},
    }
    if run.seeds is not None:
        curves = np.asarray([r["loss"] for r in records], dtype=float).T  # (seeds, logged steps)
        summary.update(
            seeds=list(run.seeds),
            curve_steps=[r["step"] for r in records],
            curves=curves.tolist(),
            diverged=[s for s, ok in zip(run.seeds, np.isfinite(curves).all(axis=1), strict=True) if not ok],
        )
    if run.probes is not None:
        names = [name for name in run.probes.records[0] if name != "step"]
        summary["probes"] = {
            "step": [r["step"] for r in run.probes.records],
            **{name: [r[name] for r in run.probes.records] for name in names},
        }
    return summary


def _first(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[0], tree)


def write_outputs(run: Run, summary: dict, examples_after: Any) -> None:
    """The task's pictures of the trained model, summary.json (process 0), the
    evaluation scalars to TensorBoard."""
    if run.pictures_before is not None and run.setup.save_examples is not None:
        started = time.perf_counter()
        with disk_full_guard(f"the pictures in {run.workdir}", "the final checkpoint is kept"):
            summary.update(run.pictures_before.result())
            summary.update(run.setup.save_examples(run.workdir, "after", examples_after))
        run.timings["report_s"] = time.perf_counter() - started
    run.timings["compile_s"] = run.programs.compile_seconds()
    run.timings["train_loop_s"] = run.programs.train_seconds
    summary["wall_time_s"] = time.perf_counter() - run.started
    summary["timings"] = run.timings
    if run.primary and run.workdir is not None:
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
