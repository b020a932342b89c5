"""What a shared cluster does to a run: preemption, a second launch, too little memory, a full disk.

Each case ends with one line naming the cause, and nothing a run saved is lost.
"""

import errno
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from launch import cache_flag, launcher_env
from saved_state import final_state

from configs import flag_retrieval
from qkv_jax.training import Checkpoints, train_and_evaluate
from qkv_jax.training.memory import InsufficientMemoryError
from qkv_jax.training.preemption import EXIT_PREEMPTED
from qkv_jax.training.workdir import DiskFullError, WorkdirLock

ROOT = pathlib.Path(__file__).resolve().parents[2]
LONG = ["--config.train.steps=400000", "--config.train.log_every=100", "--config.train.checkpoint_every=1000"]


def small_config(**train):
    config = flag_retrieval.get_config()
    config.train.steps = 20
    config.train.batch_size = 8
    config.train.log_every = 5
    config.train.checkpoint_every = 5
    config.train.cpu_optimization_level = 0  # 20 steps of a tiny model: compile time is most of it
    config.eval.num_examples = 32
    config.eval.num_plot_examples = 2
    config.train.update(train)
    return config


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted small run to compare against."""
    workdir = tmp_path_factory.mktemp("reference")
    train_and_evaluate(small_config(), workdir)
    return workdir


def assert_same_run(workdir, reference, config):
    step_a, state_a = final_state(workdir, config)
    step_b, state_b = final_state(reference, config)
    assert step_a == step_b
    jax.tree.map(np.testing.assert_array_equal, state_a, state_b)
    assert (workdir / "metrics.jsonl").read_text() == (reference / "metrics.jsonl").read_text()


def launch(module, workdir, log_path, *extra, config="configs/flag_retrieval.py"):
    log = open(log_path, "w")
    command = [sys.executable, "-m", module, "--config", config, "--workdir", str(workdir)]
    process = subprocess.Popen(
        [*command, cache_flag(), *extra],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=launcher_env(),
    )
    return process, log


def wait_for_text(path, text, process, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if text in path.read_text():
            return True
        time.sleep(0.01)
    return text in path.read_text()


def error_line(log_path):
    """The one line the launcher printed for the failure (after absl's INFO/WARNING lines)."""
    text = log_path.read_text()
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


# --- Preemption -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.reliability(
    "Preemption",
    "SIGTERM (as SLURM, Kubernetes and preemptible VMs send) at random moments of training, 4 times, "
    "then the same command to the end",
    f"each stop finishes its chunk, saves a checkpoint at that step and exits {EXIT_PREEMPTED} with one "
    "line; the resumed run's parameters and metrics.jsonl are bit-identical to an uninterrupted run's",
)
def test_sigterm_at_random_moments_then_resume(tmp_path):
    extra = [
        "--config.train.steps=20000",
        "--config.train.log_every=100",
        "--config.train.checkpoint_every=2000",
    ]
    reference, log = launch("experiments.train", tmp_path / "reference", tmp_path / "reference.log", *extra)
    assert reference.wait(timeout=600) == 0, (tmp_path / "reference.log").read_text()[-2000:]
    workdir, rng, stops = tmp_path / "preempted", random.Random(20261201), []
    for attempt in range(20):
        log_path = tmp_path / f"attempt{attempt}.log"
        process, log = launch("experiments.train", workdir, log_path, *extra)
        if len(stops) < 4:
            assert wait_for_text(log_path, "from", process)  # "starting from" / "resuming from": handlers on
            time.sleep(rng.uniform(0.0, 1.5))
            process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=600)
        log.close()
        if code == 0:
            break
        assert code == EXIT_PREEMPTED, log_path.read_text()[-2000:]
        line = error_line(log_path)
        assert (
            line.startswith("error: stopped by SIGTERM at step ") and "run the same command to resume" in line
        )
        step = int(line.split("at step ")[1].split(":")[0])
        assert step in Checkpoints(workdir / "checkpoints").all_steps()
        stops.append(step)
    assert len(stops) == 4 and code == 0, stops
    config = flag_retrieval.get_config()
    config.train.steps, config.train.log_every, config.train.checkpoint_every = 20000, 100, 2000
    assert_same_run(workdir, tmp_path / "reference", config)


@pytest.mark.slow
@pytest.mark.reliability(
    "Preemption",
    "SIGTERM while a sweep trains a cell",
    f"the cell checkpoints its seeds and the sweep exits {EXIT_PREEMPTED} with one line; the re-run "
    "resumes the cell and its results equal an uninterrupted sweep's",
)
def test_sigterm_during_a_sweep_cell_then_resume(tmp_path):
    extra = [
        "--sweep=model.d_k=4,8",
        "--seeds=2",
        "--config.train.steps=30000",
        "--config.train.log_every=500",
        "--config.train.checkpoint_every=5000",
    ]
    reference, log = launch("experiments.sweep", tmp_path / "reference", tmp_path / "reference.log", *extra)
    assert reference.wait(timeout=600) == 0, (tmp_path / "reference.log").read_text()[-2000:]
    log_path = tmp_path / "stopped.log"
    process, log = launch("experiments.sweep", tmp_path / "sweep", log_path, *extra)
    assert wait_for_text(log_path, "[1/2]", process)  # the first cell is done; the second is training
    time.sleep(1.0)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=600) == EXIT_PREEMPTED, log_path.read_text()[-2000:]
    assert error_line(log_path).startswith("error: stopped by SIGTERM at step ")
    process, log = launch("experiments.sweep", tmp_path / "sweep", tmp_path / "resumed.log", *extra)
    assert process.wait(timeout=600) == 0, (tmp_path / "resumed.log").read_text()[-2000:]
    rows = [json.loads((tmp_path / d / "results.json").read_text())["rows"] for d in ("sweep", "reference")]
    assert [r["final_loss"] for r in rows[0]] == [r["final_loss"] for r in rows[1]]
    assert [r["curves"] for r in rows[0]] == [r["curves"] for r in rows[1]]


# --- Two launches on one workdir ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.reliability(
    "Concurrency",
    "the same command started twice at once on one workdir (a double submit)",
    "exactly one trains; the other stops before compiling with one line naming the first's host and pid",
)
def test_two_launches_on_one_workdir(tmp_path):
    workdir = tmp_path / "w"
    launched = {name: launch("experiments.train", workdir, tmp_path / name, *LONG) for name in ("a", "b")}
    deadline = time.monotonic() + 120
    while all(process.poll() is None for process, _ in launched.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    (loser,) = [name for name, (process, _) in launched.items() if process.poll() is not None]
    (winner,) = set(launched) - {loser}
    assert launched[loser][0].returncode == 1
    line = error_line(tmp_path / loser)
    assert f"pid {launched[winner][0].pid} on host {os.uname().nodename}" in line and "is in use" in line, (
        line
    )
    assert "starting from" not in (tmp_path / loser).read_text()  # refused before anything was compiled
    assert wait_for_text(tmp_path / winner, "starting from step 0", launched[winner][0])
    launched[winner][0].send_signal(signal.SIGTERM)
    assert launched[winner][0].wait(timeout=120) == EXIT_PREEMPTED


@pytest.mark.slow
@pytest.mark.reliability(
    "Concurrency",
    "a run killed with `kill -9` leaves its lock file; the same command again",
    "the new launch takes the lock over, saying whose it was (host, pid), and resumes",
)
def test_lock_of_a_killed_run_is_taken_over(tmp_path):
    workdir = tmp_path / "w"
    process, log = launch("experiments.train", workdir, tmp_path / "killed.log", *LONG)
    assert wait_for_text(tmp_path / "killed.log", "starting from step 0", process)
    assert json.loads((workdir / ".lock").read_text())["pid"] == process.pid
    process.kill()
    process.wait()
    resumed, log = launch("experiments.train", workdir, tmp_path / "resumed.log", *LONG)
    assert wait_for_text(tmp_path / "resumed.log", "from", resumed)
    text = (tmp_path / "resumed.log").read_text()
    assert f"took over {workdir / '.lock'}, left by pid {process.pid} on host {os.uname().nodename}" in text
    resumed.send_signal(signal.SIGTERM)
    assert resumed.wait(timeout=120) == EXIT_PREEMPTED


def test_lock_names_its_holder_and_is_released(tmp_path):
    first = WorkdirLock(tmp_path)
    assert first.acquire() is None
    holder = json.loads((tmp_path / ".lock").read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == os.uname().nodename
    first.release()
    assert (tmp_path / ".lock").read_text() == ""  # a clean exit leaves no holder behind
    again = WorkdirLock(tmp_path)
    assert again.acquire() is None
    again.release()


# --- Memory ---------------------------------------------------------------------------------


@pytest.mark.reliability(
    "Memory",
    "a config whose training step cannot fit (`train.batch_size` of 2^28 flag examples)",
    "refused before the first step with one line: the bytes needed, the bytes available and the "
    "fields that drive them; no checkpoint written",
)
@pytest.mark.slow
def test_oversized_config_is_refused_before_training(tmp_path):
    config = small_config(batch_size=2**28)
    with pytest.raises(InsufficientMemoryError) as info:
        train_and_evaluate(config, tmp_path)
    message = str(info.value)
    assert message.startswith("the training step needs ") and "GB of memory but the host has " in message
    needed, available = (float(part.split(" GB")[0]) for part in message.split("needs ")[1].split("has ")[:2])
    assert needed > available
    assert "train.batch_size=268435456" in message and "task.seq_len=5" in message
    assert not Checkpoints(tmp_path / "checkpoints").all_steps()


@pytest.mark.reliability(
    "Memory",
    "the allocator fails anyway (RESOURCE_EXHAUSTED from XLA)",
    "the command line prints one line, `error: out of memory: ...`, exit 1, no traceback",
)
def test_resource_exhausted_becomes_one_line(capsys):
    from experiments import common

    with pytest.raises(SystemExit) as info, common.training_errors():
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 44972248072 bytes.")
    assert info.value.code == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: out of memory: Out of memory allocating 44972248072 bytes.; lower train.batch_size or the "
        "model's size"
    ]


@pytest.mark.reliability(
    "Preemption",
    "KeyboardInterrupt reaching the command line (a second Ctrl-C, or one while the run starts up)",
    "exit 130 with one line saying the checkpoints saved before are kept; no traceback",
)
def test_keyboard_interrupt_becomes_one_line(capsys):
    from experiments import common

    with pytest.raises(SystemExit) as info, common.training_errors():
        raise KeyboardInterrupt
    assert info.value.code == 130
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: interrupted by SIGINT") and "the checkpoints saved before are kept" in line


# --- A full disk ----------------------------------------------------------------------------


@pytest.mark.reliability(
    "Disk",
    "no space left on the device while a checkpoint is written (ENOSPC from the writer, simulated)",
    "DiskFullError naming the checkpoint and what is kept; the previous checkpoint and the metrics up "
    "to it stay intact, and once space is back the run resumes to an uninterrupted run's parameters",
)
def test_disk_full_during_a_checkpoint(tmp_path, monkeypatch, reference_run):
    real_save = ocp.CheckpointManager.save

    def save(manager, step, *args, **kwargs):
        if step == 10:  # a partial save, then the device is full
            (pathlib.Path(manager.directory) / "10.orbax-checkpoint-tmp").mkdir()
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(manager, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    with pytest.raises(DiskFullError) as info:
        train_and_evaluate(small_config(), tmp_path)
    assert str(info.value).startswith(f"no space left on the device writing checkpoint step 10 in {tmp_path}")
    assert "the checkpoint of step 5 and metrics.jsonl up to it are kept" in str(info.value)
    assert Checkpoints(tmp_path / "checkpoints").all_steps() == [5]
    monkeypatch.setattr(ocp.CheckpointManager, "save", real_save)  # space is back
    train_and_evaluate(small_config(), tmp_path)
    assert_same_run(tmp_path, reference_run, small_config())


@pytest.mark.slow
@pytest.mark.reliability(
    "Disk",
    "the workdir's filesystem fills up during training (a 4 MiB tmpfs, filled after step 10)",
    "one DiskFullError; the checkpoints written before stay readable; after the filler is deleted the "
    "run resumes to an uninterrupted run's parameters",
)
def test_real_full_filesystem(tmp_path, reference_run):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        workdir = mount / "w"
        train_and_evaluate(small_config(steps=10), workdir)
        filler = mount / "filler"
        # Unbuffered: a buffered file would raise ENOSPC again when it is closed.
        with open(filler, "wb", buffering=0) as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * 65536)
        with pytest.raises(DiskFullError, match="no space left on the device writing"):
            train_and_evaluate(small_config(), workdir)
        assert Checkpoints(workdir / "checkpoints").all_steps()[-1] >= 10
        filler.unlink()
        train_and_evaluate(small_config(), workdir)
        assert_same_run(workdir, reference_run, small_config())
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


# --- A finished run -------------------------------------------------------------------------


@pytest.mark.reliability(
    "Finished runs",
    "the command of a finished run run again (its last step off the log grid: steps 20, log_every 3)",
    "the run is left as it was: config.json, summary.json, metrics.jsonl and the checkpoints unchanged, "
    "the same summary returned, marked `already_finished`; `final_loss` is the loss of step steps - 1 "
    "in both",
)
def test_finished_run_is_left_as_it_was(tmp_path):
    config = small_config(log_every=3)
    first = train_and_evaluate(config, tmp_path)
    names = ("config.json", "summary.json", "metrics.jsonl")
    files = {name: (tmp_path / name).read_bytes() for name in names}
    records = [json.loads(line) for line in files["metrics.jsonl"].decode().splitlines()]
    assert records[-1]["step"] == 19 and first["final_loss"] == records[-1]["loss"]
    steps = Checkpoints(tmp_path / "checkpoints").all_steps()
    again = train_and_evaluate(config, tmp_path)
    assert again == {**json.loads(files["summary.json"]), "already_finished": True, "not_applied": []}
    for name, content in files.items():
        assert (tmp_path / name).read_bytes() == content, name
    assert Checkpoints(tmp_path / "checkpoints").all_steps() == steps


@pytest.mark.slow
@pytest.mark.reliability(
    "Preemption",
    "SIGTERM to one process of a two-process run (jax.distributed, two CPU processes)",
    "JAX's preemption service tells the other: both save the same step's checkpoint and exit "
    f"{EXIT_PREEMPTED}; the same two commands resume from it and finish",
)
def test_sigterm_to_one_of_two_processes(tmp_path):
    extra = [
        "--config.train.steps=800",
        "--config.train.log_every=100",
        "--config.train.checkpoint_every=1000",
    ]

    def start(attempt):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return [
            launch(
                "experiments.train",
                tmp_path / "w",
                tmp_path / f"{attempt}-{i}.log",
                *extra,
                "--num_cpu_devices=1",
                f"--coordinator=127.0.0.1:{port}",
                "--num_processes=2",
                f"--process_id={i}",
                config="configs/flag_retrieval.py:multihead",
            )
            for i in range(2)
        ]

    processes = start("stopped")
    for i, (process, _) in enumerate(processes):
        assert wait_for_text(tmp_path / f"stopped-{i}.log", "starting from step 0", process, timeout=300)
    time.sleep(1.0)
    processes[1][0].send_signal(signal.SIGTERM)
    assert [p.wait(timeout=300) for p, _ in processes] == [EXIT_PREEMPTED, EXIT_PREEMPTED]
    steps = {error_line(tmp_path / f"stopped-{i}.log").split("at step ")[1].split(":")[0] for i in range(2)}
    (step,) = steps  # both stopped at the same step
    assert int(step) in Checkpoints(tmp_path / "w" / "checkpoints").all_steps()
    processes = start("resumed")
    assert [p.wait(timeout=600) for p, _ in processes] == [0, 0]
    assert f"resuming from checkpoint step {step}" in (tmp_path / "resumed-0.log").read_text()
    assert json.loads((tmp_path / "w" / "summary.json").read_text())["steps"] == 800
