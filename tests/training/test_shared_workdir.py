"""Workdirs a team shares: file modes under the user's umask, a workdir that never contradicts
itself (finished, continued and shortened runs), damaged files, and reading a run while it trains."""

import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from in_process import launch_train
from launch import cache_flag, launcher_env
from saved_state import final_state

from configs import flag_retrieval
from qkv_jax.report.run import report_run
from qkv_jax.training import Checkpoints, CheckpointWarning, read_params, train_and_evaluate
from qkv_jax.training.checkpoints import NoCheckpointError
from qkv_jax.training.workdir import WorkdirBusyError, WorkdirLock, differences, read_metrics
from studies.results import write_sweep_results

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The small run every test here starts from, as command-line overrides and as a config.
# (cpu_optimization_level 0: 20 steps of a tiny model, whose compile time is most of the run.)
SMALL = {"steps": 20, "batch_size": 8, "log_every": 5, "checkpoint_every": 10, "cpu_optimization_level": 0}
ARGS = [f"--config.train.{name}={value}" for name, value in SMALL.items()]
ARGS += ["--config.eval.num_examples=32", "--config.eval.num_plot_examples=2"]


def small_config(**train):
    config = flag_retrieval.get_config()
    config.train.update({**SMALL, **train})
    config.eval.num_examples, config.eval.num_plot_examples = 32, 2
    return config


def command(workdir, *extra):
    config = str(ROOT / "configs" / "flag_retrieval.py")
    return ["--config", config, "--workdir", str(workdir), cache_flag(), *ARGS, *extra]


def contents(workdir):
    """Every file of a workdir and its bytes (the lock's are rewritten by each launch)."""
    return {
        str(p.relative_to(workdir)): p.read_bytes()
        for p in sorted(workdir.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run (20 steps, checkpoints 10 and 20) trained through the command line, and
    what it printed."""
    workdir = tmp_path_factory.mktemp("finished") / "run"
    launched = launch_train(*command(workdir))
    assert launched.code == 0, launched.stderr
    return workdir, launched


@pytest.fixture
def run_copy(finished, tmp_path):
    shutil.copytree(finished[0], tmp_path / "run")
    return tmp_path / "run"


# --- Files a colleague can read --------------------------------------------------------------


def modes(directory):
    """{path: permission bits} of everything under `directory` (itself included)."""
    return {str(p): stat.S_IMODE(p.stat().st_mode) for p in [directory, *directory.rglob("*")]}


@pytest.mark.reliability(
    "Shared workdirs",
    "a run, its report and a sweep's results written under umask 0022 and under umask 0077",
    "every file is 0666 less the umask and every directory 0777 less it (0644/0755 under 0022), as "
    "any program's: config.json, metrics.jsonl, summary.json (atomic writes), the lock, orbax's "
    "checkpoint files, TensorBoard's, report.json, report.html, pictures and results.*",
)
@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["umask 0022", "umask 0077"])
@pytest.mark.slow
def test_files_follow_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        workdir = tmp_path / "run"
        train_and_evaluate(small_config(steps=10), workdir)
        report_run(workdir)
        rows = [
            {"cell": {"model.d_k": 4}, "status": "done", "seeds": [0], "final_loss": [0.5],
             "final_loss_stats": {"mean": 0.5, "std": 0.0, "min": 0.5, "max": 0.5}, "wall_time_s": 1.0},
            {"cell": {"model.d_k": 3}, "status": "failed", "reason": "ValueError: three"},
        ]  # fmt: skip
        write_sweep_results(workdir, rows, "final_loss")
    finally:
        os.umask(previous)
    found = modes(workdir)
    for name in ("config.json", "metrics.jsonl", "summary.json", ".lock", "report.json", "report.html"):
        assert str(workdir / name) in found, name
    for name in ("results.csv", "results.json", "results.md", "results.html", "attention_after.png"):
        assert str(workdir / name) in found, name
    assert any("tensorboard/events" in p for p in found) and any("/checkpoints/10/state/" in p for p in found)
    for path, mode in found.items():
        expected = (0o777 if pathlib.Path(path).is_dir() else 0o666) & ~umask
        assert mode == expected, (path, oct(mode), oct(expected))


# --- A workdir that never contradicts itself --------------------------------------------------


@pytest.mark.reliability(
    "Finished runs",
    "a fresh run from the command line",
    "says `starting from step 0` once (never `resumed from step 0`); nothing on stderr: absl's and the "
    "libraries' INFO logs stay off unless --verbosity asks for them",
)
def test_fresh_run_output(finished):
    _, launched = finished
    assert launched.stderr == ""
    assert launched.stdout.count("starting from step 0") == 1 and "resumed from" not in launched.stdout
    assert launched.stdout.splitlines()[0] == "starting from step 0"


@pytest.mark.reliability(
    "Finished runs",
    "a finished run launched again from the command line, also with another eval.num_examples",
    "exit 0; says the run had already finished at step N, with its results and no timing; every file "
    "stays byte-identical (config.json too; the field it would not apply is named)",
)
def test_relaunched_finished_run_says_so(run_copy):
    before = contents(run_copy)
    again = launch_train(*command(run_copy))
    assert again.code == 0 and again.stderr == "", again.stderr
    first = again.stdout.splitlines()[0]
    assert first == (
        f"flag_retrieval: the run had already finished at step 20; nothing was trained and {run_copy} is "
        "left as it was"
    )
    assert " s (compile" not in again.stdout and "starting from" not in again.stdout
    assert "eval_accuracy" in again.stdout
    assert contents(run_copy) == before
    other = launch_train(*command(run_copy, "--config.eval.num_examples=16"))
    assert (
        other.code == 0 and "(not applied: eval.num_examples=16 here but 32 in the workdir)" in other.stdout
    )
    assert contents(run_copy) == before


@pytest.mark.reliability(
    "Finished runs",
    "a finished 20-step run launched with --config.train.steps=10 (fewer)",
    "exit 2, one line: the workdir already holds a run trained to step 20, with what to do; every file "
    "byte-identical (config.json still says 20); `--check` says the same without launching",
)
def test_fewer_steps_are_refused(run_copy):
    before = contents(run_copy)
    for extra in ([], ["--check"]):
        refused = launch_train(*command(run_copy, "--config.train.steps=10", *extra))
        assert refused.code == 2 and refused.stdout == ""
        (line,) = refused.error_lines
        assert line == (
            f"error: workdir='{run_copy}' already holds a run trained to step 20, more than train.steps=10; "
            "nothing was changed: use train.steps=20 or more to continue it, another workdir, or "
            "--config.train.overwrite=True to move it aside"
        )
        assert contents(run_copy) == before


@pytest.mark.reliability(
    "Finished runs",
    "a finished 20-step run continued with --config.train.steps=30",
    "config.json says 30 only once the run trains, and while it does no summary.json claims an end: the "
    "20-step summary is kept as summary-20.json; the continued run says where it resumed, ends at 30 "
    "with a summary of its own, and metrics.jsonl continues the 20-step run's",
)
def test_more_steps_continue_a_finished_run(run_copy):
    old_summary = (run_copy / "summary.json").read_text()
    old_metrics = read_metrics(run_copy / "metrics.jsonl")
    seen = []

    def at_start(line):  # called once the run is about to train: the window a reader may look into
        config = json.loads((run_copy / "config.json").read_text())
        seen.append((line, (run_copy / "summary.json").exists(), config["train"]["steps"]))

    summary = train_and_evaluate(small_config(steps=30), run_copy, log=at_start)
    assert seen == [
        (
            "resuming from checkpoint step 20, where the run had finished, to step 30 (the earlier summary "
            "is kept as summary-20.json)",
            False,
            30,
        )
    ]
    assert (run_copy / "summary-20.json").read_text() == old_summary
    assert summary["steps"] == 30 and summary["resumed_from_step"] == 20
    assert json.loads((run_copy / "summary.json").read_text())["steps"] == 30
    metrics = read_metrics(run_copy / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 5, 10, 15, 20, 25, 29]
    assert metrics[:4] == old_metrics[:4]


# --- Damaged files --------------------------------------------------------------------------


@pytest.mark.reliability(
    "Damaged workdir files",
    "config.json truncated",
    "exit 2, one line naming the file and what to do (delete it and run the command again, or another "
    "workdir); nothing changed; after deleting it the same command finds the run finished and writes "
    "config.json again",
)
def test_truncated_config(run_copy):
    path = run_copy / "config.json"
    path.write_text(path.read_text()[:40])
    before = contents(run_copy)
    refused = launch_train(*command(run_copy))
    assert refused.code == 2
    (line,) = refused.error_lines
    assert line.startswith(f"error: {path}: not valid JSON, truncated or damaged")
    assert "delete config.json and run the command again" in line
    assert contents(run_copy) == before
    path.unlink()
    again = launch_train(*command(run_copy))
    assert again.code == 0 and "already finished at step 20" in again.stdout
    assert json.loads(path.read_text()) == small_config().to_dict()


@pytest.mark.reliability(
    "Damaged workdir files",
    "metrics.jsonl of an interrupted run cut in half (records before its checkpoint lost, a torn line)",
    "the run resumes from its checkpoint with one warning naming the file and the steps it has no record "
    "of; the file is rewritten with every record that reads back and the new ones, each line valid JSON",
)
def test_truncated_metrics(run_copy):
    shutil.rmtree(run_copy / "checkpoints" / "20")
    (run_copy / "summary.json").unlink()
    path = run_copy / "metrics.jsonl"
    text = path.read_text()
    path.write_text(text[: len(text) // 3])  # step 0, and part of step 5
    resumed = launch_train(*command(run_copy))
    assert resumed.code == 0, resumed.stderr
    assert resumed.stdout.splitlines()[0] == "resuming from checkpoint step 10"
    (line,) = resumed.error_lines
    assert line == (
        f"warning: {path}: no record of 1 logged step before checkpoint step 10 (step 5; the file was "
        "truncated or damaged, or train.log_every changed); training continues and the file keeps the "
        "records that read back"
    )
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 10, 15, 19]


@pytest.mark.reliability(
    "Damaged workdir files",
    "summary.json of a finished run damaged",
    "the same command recomputes it from the final checkpoint, with one warning naming the file; the "
    "evaluation and final loss equal the original's",
)
def test_damaged_summary_is_recomputed(run_copy, finished):
    path = run_copy / "summary.json"
    original = json.loads(path.read_text())
    path.write_text('{"steps": 2')
    again = launch_train(*command(run_copy))
    assert again.code == 0
    (line,) = again.error_lines
    assert (
        line.startswith(f"warning: {path}: not valid JSON")
        and "recomputing it from checkpoint step 20" in line
    )
    recomputed = json.loads(path.read_text())
    for name in ("steps", "final_loss", "eval_accuracy", "eval_mse", "untrained"):
        assert recomputed[name] == original[name], name


@pytest.mark.slow
@pytest.mark.reliability(
    "Damaged workdir files",
    "the lock file holding garbage; the lock file replaced by a directory; a live holder whose record "
    "is unreadable",
    "garbage is overwritten and the run goes on; a directory is exit 2, one line naming .lock and what "
    "to do; a live holder is one line saying the workdir is in use",
)
def test_damaged_lock_file(run_copy, tmp_path):
    lock = run_copy / ".lock"
    lock.write_bytes(b"\x00\xffnot json")
    assert launch_train(*command(run_copy)).code == 0
    lock.unlink()
    lock.mkdir()
    refused = launch_train(*command(run_copy))
    assert refused.code == 2
    assert refused.error_lines == [
        f"error: {lock}: cannot open the workdir's lock file (Is a directory); it is not a regular file: "
        "remove it and run again"
    ]
    lock.rmdir()
    hold = (
        "import fcntl, sys, time\nf = open(sys.argv[1], 'a+')\nfcntl.lockf(f, fcntl.LOCK_EX)\n"
        "f.write('{torn'); f.flush()\nprint('held', flush=True)\ntime.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            WorkdirBusyError, match=r"another process holds .*\.lock \(its holder record is unreadable\)"
        ):
            WorkdirLock(run_copy).acquire()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.reliability(
    "Damaged workdir files",
    "a checkpoint directory missing its digest record (the newest one; then every one)",
    "the newest is skipped with a `CheckpointWarning` naming the missing record and the run resumes from "
    "the one before; with none verifiable, exit 2 and one line naming checkpoints/ and what to do (no "
    "training from step 0 beside them); readers say there is no usable checkpoint",
)
def test_checkpoint_without_its_record(run_copy, finished):
    (run_copy / "summary.json").unlink()
    shutil.rmtree(run_copy / "checkpoints" / "20" / "record")
    with pytest.warns(
        CheckpointWarning, match=r"checkpoint step 20 in .* has no digest record \(.*/20/record is missing\)"
    ):
        summary = train_and_evaluate(small_config(), run_copy)
    assert summary["resumed_from_step"] == 10
    jax.tree.map(
        np.testing.assert_array_equal,
        final_state(run_copy, small_config())[1],
        final_state(finished[0], small_config())[1],
    )
    for step in Checkpoints(run_copy / "checkpoints").all_steps():
        shutil.rmtree(run_copy / "checkpoints" / str(step) / "record")
    (run_copy / "summary.json").unlink()
    before = contents(run_copy)
    refused = launch_train(*command(run_copy))
    assert refused.code == 2
    (line,) = [line for line in refused.error_lines if line.startswith("error: ")]
    assert line == (
        f"error: {run_copy / 'checkpoints'}: none of its checkpoints (steps 10, 20) reads back and verifies "
        "(the warnings above say why); move the directory aside to train this run from step 0, or use "
        "another workdir"
    )
    assert all(line.startswith("warning: checkpoint step") for line in refused.error_lines[:-1])
    assert contents(run_copy) == before
    with pytest.warns(CheckpointWarning), pytest.raises(NoCheckpointError):
        read_params(run_copy)


# --- Reading a run while it trains -------------------------------------------------------------


def start(module, *args, log):
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=launcher_env(),
    )


def test_an_abandoned_shard_reads_failure_is_not_reported_but_others_are(caplog):
    """Readers racing a checkpoint's deletion: asyncio's report of a failed orbax shard read
    that nobody retrieved (the first failure is caught and warned about) is dropped; any other
    unretrieved task failure is still logged."""
    import asyncio
    import gc

    async def _read_array_index_and_device_put():  # orbax's shard read, by name
        raise OSError("the step directory was deleted")

    async def something_else():
        raise OSError("a real problem")

    async def abandon(coroutine):
        task = asyncio.ensure_future(coroutine())
        await asyncio.sleep(0.01)
        del task

    with caplog.at_level("ERROR", logger="asyncio"):
        for coroutine in (_read_array_index_and_device_put, something_else):
            asyncio.run(abandon(coroutine))
            gc.collect()
    messages = [record.getMessage() for record in caplog.records if record.name == "asyncio"]
    assert len(messages) == 1 and "something_else" in messages[0], messages


@pytest.mark.slow
@pytest.mark.reliability(
    "Concurrency",
    "experiments.report, experiments.inspect and experiments.generate run again and again on workdirs "
    "that are training at that moment (a flag run and a char LM, checkpoints every few hundred steps, "
    "older ones deleted as new ones come)",
    "every reader exits 0 with its output, or 2 with one line before the first checkpoint; no traceback; "
    "what it read was whole (atomic JSON, verified checkpoints, torn metrics lines dropped); the runs "
    "finish as if nobody had read them",
)
def test_reading_runs_while_they_train(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def forward(self, x):\n    return self.scale * x + self.bias\n" * 300)
    flag, lm = tmp_path / "flag", tmp_path / "lm"
    kept = ["--config.train.keep_checkpoints=2", "--config.train.cpu_optimization_level=0", cache_flag()]
    flag_run = [
        "--config",
        "configs/flag_retrieval.py",
        "--workdir",
        str(flag),
        "--config.train.steps=400000",
    ]
    flag_run += ["--config.train.checkpoint_every=400", "--config.train.log_every=100"]
    lm_run = ["--config", "configs/char_lm.py", "--workdir", str(lm), f"--config.data.path={corpus}"]
    lm_run += ["--config.model.num_layers=1", "--config.model.d_model=32", "--config.task.seq_len=32"]
    lm_run += ["--config.model.max_len=32", "--config.eval.sample_length=8", "--config.eval.num_examples=16"]
    lm_run += ["--config.eval.ablation_examples=0", "--config.train.steps=400000"]
    lm_run += ["--config.train.checkpoint_every=50", "--config.train.log_every=10"]
    runs = [
        start("experiments.train", *flag_run, *kept, log=open(tmp_path / "flag.log", "w")),
        start("experiments.train", *lm_run, *kept, log=open(tmp_path / "lm.log", "w")),
    ]
    readers = {
        "report": ["experiments.report", "--workdir", str(flag)],
        "inspect": ["experiments.inspect", "--workdir", str(flag)],
        "generate": [
            "experiments.generate",
            "--workdir",
            str(lm),
            "--prompt",
            "def ",
            "--max_new_tokens",
            "8",
        ],
    }
    outcomes = {name: [] for name in readers}
    deadline = time.monotonic() + 240
    try:  # a failed assertion still stops both runs (each trains for 400000 steps)
        while time.monotonic() < deadline and any(run.poll() is None for run in runs):
            for name, args in readers.items():
                result = subprocess.run(
                    [sys.executable, "-m", *args, cache_flag()], cwd=ROOT, capture_output=True, text=True,
                    timeout=300, env=launcher_env(),
                )  # fmt: skip
                assert "Traceback" not in result.stdout + result.stderr, (name, result.stderr[-3000:])
                lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
                assert result.returncode == 0 or (result.returncode == 2 and len(lines) == 1), (
                    name,
                    result.stderr,
                )
                outcomes[name].append(result.returncode)
            if all(outcomes[name].count(0) >= 2 for name in readers):
                break
    finally:
        for run in runs:
            run.terminate()  # SIGTERM: each saves a checkpoint and stops
        codes = [run.wait(timeout=120) for run in runs]
    assert all(code in (0, 75) for code in codes), codes
    assert all(outcomes[name].count(0) >= 2 for name in readers), outcomes
    report = json.loads((flag / "report.json").read_text())
    assert report["step"] > 0 and (flag / "report.html").stat().st_size > 0
    for workdir in (flag, lm):
        records = read_metrics(workdir / "metrics.jsonl")
        assert [r["step"] for r in records] == sorted(r["step"] for r in records)


def test_a_run_saved_before_an_optional_field_existed_still_matches():
    """A field the saved config lacks matches an unset (None) one: a release that adds an optional
    field resumes the runs written before it. Set, or dropped from the current config, it differs."""
    saved = {"model": {"d_k": 8}}
    assert differences(saved, {"model": {"d_k": 8, "attention_scale": None}}) == []
    assert differences(saved, {"model": {"d_k": 8, "attention_scale": 1.0}}) == [
        "model.attention_scale=1.0 here but '<absent>' in the workdir"
    ]
    assert differences({"model": {"d_k": 8, "attention_scale": None}}, saved) == [
        "model.attention_scale='<absent>' here but None in the workdir"
    ]


def test_a_run_saved_before_the_cpu_optimization_level_existed_resumes_and_reports_at_level_1():
    """Such a run's config.json has no train.cpu_optimization_level: it resumes (the field may
    change between a run and its resumption), and a report compiles its evaluation as the run
    was compiled then, at level 1."""
    from qkv_jax.training.compiled import run_level
    from qkv_jax.training.workdir import RESUMABLE_FIELDS

    saved = {"train": {"steps": 20}}
    assert differences(saved, {"train": {"steps": 20, "cpu_optimization_level": 0}}, RESUMABLE_FIELDS) == []
    assert run_level(saved) == 1 and run_level({"train": {"cpu_optimization_level": 0}}) == 0


def test_a_run_saved_before_a_field_was_renamed_still_matches():
    """A workdir written before `model.sinks` became `model.use_sinks` (and `model.dropout_rate`
    `model.residual_dropout_rate`) resumes: its value counts under the new name, and the old
    name, unset here, matches its absence. A changed value still differs."""
    saved = {"model": {"d_k": 8, "sinks": True, "dropout_rate": 0.1}}
    current = {
        "model": {
            "d_k": 8,
            "use_sinks": True,
            "sinks": None,
            "residual_dropout_rate": 0.1,
            "dropout_rate": None,
        }
    }
    assert differences(saved, current) == []
    current["model"]["use_sinks"] = False
    assert differences(saved, current) == ["model.use_sinks=False here but True in the workdir"]
