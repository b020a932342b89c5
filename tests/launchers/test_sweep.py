"""Sweeps: vmapped seeds equal single runs; a tiny grid end to end, with resume."""

import csv
import importlib
import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from launch import cache_flag, launcher_env
from saved_state import final_state

from configs import flag_retrieval
from qkv_jax.training import train_and_evaluate, train_seeds
from qkv_jax.training.validate import ConfigError
from studies.grid import apply_overrides, grid, parse_sweep_arg
from studies.sweep import CellsFailed, run_sweep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_config(variant="multihead"):
    config = flag_retrieval.get_config(variant)
    config.train.steps = 12
    config.train.batch_size = 8
    config.train.log_every = 4
    config.train.checkpoint_every = 12
    config.train.cpu_optimization_level = 0  # a tiny model: compile time is most of each run
    config.eval.num_examples = 32
    return config


@pytest.mark.slow
def test_vmapped_seeds_equal_training_each_seed_alone(tmp_path):
    config = tiny_config()
    together = train_seeds(config, [0, 3])
    for index, seed in enumerate([0, 3]):
        alone = config.to_dict()
        alone["seed"] = seed
        summary = train_and_evaluate(alone, tmp_path / f"seed{seed}")
        _, state = final_state(tmp_path / f"seed{seed}", alone)
        jax.tree.map(
            lambda vmapped, single, index=index: np.testing.assert_allclose(
                vmapped[index], single, atol=1e-6, rtol=0
            ),
            together["params"],
            state["params"],
        )
        np.testing.assert_allclose(together["final_loss"][index], summary["final_loss"], rtol=1e-5)


def test_grid_and_overrides():
    assert grid({"a.x": [1, 2], "b.y": [True]}) == [{"a.x": 1, "b.y": True}, {"a.x": 2, "b.y": True}]
    assert grid([{"a.x": 3}]) == [{"a.x": 3}]
    config = tiny_config().to_dict()
    assert parse_sweep_arg("model.d_k=2,4", config) == ("model.d_k", [2, 4])
    assert parse_sweep_arg("model.scaled=true,False", config) == ("model.scaled", [True, False])
    assert parse_sweep_arg("train.learning_rate=0.1,1e-3", config) == ("train.learning_rate", [0.1, 1e-3])
    assert parse_sweep_arg("model.d_v=4,12", config) == ("model.d_v", [4, 12])  # a placeholder field
    with pytest.raises(ConfigError, match="model.d_k='x': not a int"):
        parse_sweep_arg("model.d_k=2,x", config)
    with pytest.raises(ConfigError, match="model.nmu_heads: missing"):
        parse_sweep_arg("model.nmu_heads=1", config)
    with pytest.raises(ConfigError, match="model.bogus: no such config field"):
        apply_overrides(config, {"model.bogus": 1})


@pytest.mark.slow
def test_tiny_sweep_end_to_end_with_resume(tmp_path):
    sweep = {"model.d_k": [4, 6], "model.num_heads": [1, 4]}
    logged = []
    rows = run_sweep(tiny_config(), tmp_path, sweep, [0, 1], metric="eval_accuracy", log=logged.append)
    assert [r["status"] for r in rows] == ["done", "done", "done", "skipped"]
    assert "model.num_heads=4 does not divide model.d_k=6" in rows[3]["reason"]
    for row in rows[:3]:
        assert len(row["eval_accuracy"]) == 2 and len(row["final_loss"]) == 2
        stats = row["eval_accuracy_stats"]
        assert stats["min"] <= stats["mean"] <= stats["max"]
        assert np.isclose(stats["mean"], np.mean(row["eval_accuracy"]))
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["rows"] == json.loads(json.dumps(rows))
    with open(tmp_path / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["model.d_k"] for r in table] == ["4", "4", "6", "6"]
    assert table[3]["status"] == "skipped"
    markdown = (tmp_path / "results.md").read_text()
    assert markdown.count("\n") == len(rows) + 2 and "skipped" in markdown
    for picture in ("eval_accuracy_vs_d_k.png", "eval_accuracy_heatmap.png"):
        assert (tmp_path / picture).read_bytes()[:4] == b"\x89PNG"

    # A re-run skips every finished cell and returns the same rows.
    logged.clear()
    again = run_sweep(tiny_config(), tmp_path, sweep, [0, 1], metric="eval_accuracy", log=logged.append)
    assert again == json.loads(json.dumps(rows))
    assert sum("done before, skipped" in line for line in logged) == 4  # skipped cells too
    # Another base config in the same workdir is refused.
    other = tiny_config()
    other.train.steps = 13
    with pytest.raises(ConfigError, match="different config"):
        run_sweep(other, tmp_path, sweep, [0, 1])


@pytest.mark.slow
def test_sweep_command_line(tmp_path):
    args = [
        sys.executable,
        "-m",
        "experiments.sweep",
        "--config",
        "configs/flag_retrieval.py:multihead",
        "--workdir",
        str(tmp_path),
        "--sweep",
        "model.num_heads=1,3",
        "--seeds",
        "2",
        "--config.train.steps=8",
        "--config.train.cpu_optimization_level=0",
        "--config.train.log_every=4",
        "--config.eval.num_examples=16",
        cache_flag(),
    ]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, env=launcher_env())
    assert result.returncode == 0, result.stderr
    assert "1 of 2 cells done, 1 skipped, 0 failed" in result.stdout
    bad = subprocess.run(
        args[:-3] + ["--sweep", "model.d_k=two"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=launcher_env(),
    )
    assert bad.returncode != 0
    assert [line for line in bad.stderr.splitlines() if line.strip()] == [
        "error: --sweep model.d_k='two': not a int"
    ]


@pytest.mark.slow
@pytest.mark.reliability(
    "Sweeps",
    "two shards (`--shard 0/2`, `--shard 1/2`) of one sweep started at the same time on one workdir, "
    "then a plain re-run",
    "each cell is trained once; the last shard to finish writes the results; the re-run finds nothing "
    "left to do; results.csv has every cell exactly once",
)
def test_two_shards_at_once_then_a_rerun(tmp_path):
    args = [
        sys.executable,
        "-m",
        "experiments.sweep",
        "--config",
        "configs/flag_retrieval.py:multihead",
        "--workdir",
        str(tmp_path),
        "--sweep",
        "model.num_heads=1,2,4",
        "--sweep",
        "model.d_k=4,8",
        "--seeds",
        "2",
        "--config.train.steps=40",
        "--config.train.cpu_optimization_level=0",
        "--config.train.log_every=10",
        "--config.eval.num_examples=16",
        cache_flag(),
    ]
    shards = [
        subprocess.Popen(
            [*args, f"--shard={i}/2"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=launcher_env(),
        )
        for i in range(2)
    ]
    outputs = [shard.communicate(timeout=600)[0] for shard in shards]
    assert [shard.returncode for shard in shards] == [0, 0], outputs
    trained = [line for output in outputs for line in output.splitlines() if "(mean of 2 seeds)" in line]
    assert len(trained) == 6  # every cell trained exactly once, by one of the shards
    assert all("being trained by another process" not in output for output in outputs)
    assert sum("cells done" in output for output in outputs) >= 1  # the last one wrote the results
    again = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, env=launcher_env())
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("done before, skipped") == 6 and "(mean of" not in again.stdout
    with open(tmp_path / "results.csv") as f:
        cells = [(row["model.num_heads"], row["model.d_k"]) for row in csv.DictReader(f)]
    assert sorted(cells) == sorted((h, d) for h in ("1", "2", "4") for d in ("4", "8"))


# A task from outside qkv_jax whose model raises when it is initialised with three heads (while
# `BROKEN`): the flag task's build, which accepts three heads of d_k=6, with its init replaced.
OUTSIDE_TASK = """
import dataclasses

from qkv_jax.tasks import flag_retrieval

BROKEN = ValueError


def build(config):
    setup = flag_retrieval.build(config)
    if config["model"]["num_heads"] != 3 or BROKEN is None:
        return setup

    def init(key):
        raise BROKEN("three heads do not fit this model")

    return dataclasses.replace(setup, init=init)
"""
FAILING_GRID = {"model.d_k": [6], "model.num_heads": [1, 3]}


@pytest.fixture
def outside_task(tmp_path, monkeypatch):
    """The task above as the module `outside_task` (importable from tmp_path), and a config using it."""
    (tmp_path / "outside_task.py").write_text(OUTSIDE_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("outside_task")
    config = tiny_config()
    config.task.module = "outside_task"
    yield module, config
    sys.modules.pop("outside_task", None)


@pytest.mark.reliability(
    "Sweeps",
    "a task from outside the repository whose model raises (ValueError in its init) for one cell",
    "the other cells train; the cell's row says `failed` with a one-line reason in results.csv, .json, "
    ".md and .html, its traceback is kept in cells/<cell>.traceback.txt; `CellsFailed` names the cell "
    "(the command line: exit 1, one line); the same command retries only that cell, and once it trains "
    "the traceback is gone",
)
@pytest.mark.slow
def test_a_failing_cell_does_not_stop_the_sweep(tmp_path, outside_task):
    module, config = outside_task
    workdir, logged = tmp_path / "sweep", []
    with pytest.raises(CellsFailed) as info:
        run_sweep(config, workdir, FAILING_GRID, [0, 1], log=logged.append)
    reason = "ValueError: three heads do not fit this model"
    assert str(info.value) == (
        f"1 of 2 cells failed: model.d_k=6,model.num_heads=3 ({reason}); the tracebacks are in "
        f"{workdir / 'cells'}; run the same command to retry them"
    )
    assert [r["status"] for r in info.value.rows] == ["done", "failed"]
    with open(workdir / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["status"], r["reason"]) for r in table] == [("done", ""), ("failed", reason)]
    assert [r["status"] for r in json.loads((workdir / "results.json").read_text())["rows"]] == [
        "done",
        "failed",
    ]
    assert f"failed: {reason}" in (workdir / "results.md").read_text()
    assert f"failed: {reason}" in (workdir / "results.html").read_text()
    traceback_file = workdir / "cells" / "model.d_k=6,model.num_heads=3.traceback.txt"
    assert "Traceback (most recent call last)" in traceback_file.read_text()
    assert (workdir / "cells" / "model.d_k=6,model.num_heads=3" / ".lock").read_text() == ""  # released

    logged.clear()
    with pytest.raises(CellsFailed):
        run_sweep(config, workdir, FAILING_GRID, [0, 1], log=logged.append)
    assert logged[0] == "[1/2] model.d_k=6,model.num_heads=1: done before, skipped"
    assert logged[1] == f"[2/2] model.d_k=6,model.num_heads=3: failed before ({reason}), trying again"

    module.BROKEN = None  # the task is fixed
    rows = run_sweep(config, workdir, FAILING_GRID, [0, 1], log=logged.append)
    assert [r["status"] for r in rows] == ["done", "done"] and not traceback_file.exists()


@pytest.mark.reliability(
    "Sweeps",
    "KeyboardInterrupt (a second Ctrl-C) raised while a cell starts",
    "it stops the sweep at once: not recorded as a failed cell, the cell's lock released, the signal "
    "handlers the sweep installed restored",
)
@pytest.mark.slow
def test_keyboard_interrupt_stops_the_sweep(tmp_path, outside_task):
    module, config = outside_task
    module.BROKEN = KeyboardInterrupt
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    with pytest.raises(KeyboardInterrupt):
        run_sweep(config, tmp_path, FAILING_GRID, [0, 1], log=lambda line: None)
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers
    assert (tmp_path / "cells" / "model.d_k=6,model.num_heads=1.json").exists()
    assert not (tmp_path / "cells" / "model.d_k=6,model.num_heads=3.json").exists()
    assert (tmp_path / "cells" / "model.d_k=6,model.num_heads=3" / ".lock").read_text() == ""


@pytest.mark.slow
def test_sweep_command_line_with_a_failing_cell(tmp_path, outside_task):
    args = [sys.executable, "-m", "experiments.sweep", "--config", "configs/flag_retrieval.py:multihead"]
    args += ["--workdir", str(tmp_path / "sweep"), "--sweep", "model.num_heads=1,3", "--seeds", "2"]
    args += [
        "--config.model.d_k=6",
        "--config.task.module=outside_task",
        "--config.train.steps=8",
        "--config.train.cpu_optimization_level=0",
        cache_flag(),
    ]
    env = launcher_env()
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 1, result.stderr
    assert "1 of 2 cells done, 0 skipped, 1 failed" in result.stdout
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith(
        "error: 1 of 2 cells failed: model.num_heads=3 (ValueError: three heads do not fit"
    )
