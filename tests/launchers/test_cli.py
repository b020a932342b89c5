"""The command line: bad input exits 2 with one line naming field and value, and writes nothing.

Most cases run experiments.train in this process (`in_process.launch_train`: the launcher's own
parsing, validation and task build); the end-to-end ones start it as a user does.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from in_process import launch_train
from launch import cache_flag, launcher_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = "configs/flag_retrieval.py"
SMALL = [
    "--config.train.steps=4",
    "--config.train.log_every=2",
    "--config.train.checkpoint_every=2",
    "--config.eval.num_examples=16",
    "--config.train.cpu_optimization_level=0",  # 4 steps: compile time is most of the run
]


def run_cli(*args, module="experiments.train"):
    env = launcher_env()
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def error_lines(result):
    return [line for line in result.stderr.splitlines() if line.strip()]


def command_case(name, args, expected, case):
    mark = pytest.mark.reliability(
        "Config and command line",
        case,
        "exit 2 before compiling, one line: " + ", ".join(f"`{e}`" for e in expected) + "; nothing written",
    )
    return pytest.param(name, args, expected, marks=mark, id=name)


BAD_COMMANDS = [
    command_case(
        "unknown field",
        ["--config.model.nmu_heads=4"],
        ["--config.model.nmu_heads: no such config field (did you mean num_heads?)"],
        "unknown config field (a typo)",
    ),
    command_case(
        "unknown section",
        ["--config.trian.steps=4"],
        ["--config.trian.steps: no config section trian (did you mean train?)"],
        "unknown config section (a typo)",
    ),
    command_case(
        "field as a section",
        ["--config.train.steps.max=4"],
        ["--config.train.steps.max: train.steps is a field (an integer), not a section"],
        "a field used as a section",
    ),
    command_case(
        "section given a value",
        ["--config.train=4"],
        ["--config.train=4: train is a section; set its fields one by one"],
        "a section given a value",
    ),
    command_case(
        "malformed override",
        ["--config..steps=4"],
        ["--config..steps: not a field name; overrides read --config.<section>.<field>=<value>"],
        "an override that is not a field name",
    ),
    command_case(
        "wrong type",
        ["--config.train.steps=abc"],
        ["--config.train.steps=abc: not an integer"],
        "value of the wrong type",
    ),
    command_case(
        "empty value",
        ["--config.train.learning_rate="],
        ["--config.train.learning_rate=: no value; expected a number"],
        "an empty value",
    ),
    command_case(
        "non-positive size", ["--config.model.d_k=0"], ["model.d_k=0", "positive"], "non-positive size"
    ),
    command_case("negative steps", ["--config.train.steps=-5"], ["train.steps=-5"], "negative step count"),
    command_case(
        "huge steps",
        ["--config.train.steps=3000000000"],
        ["train.steps=3000000000: must be at most 2147483647 (steps are counted in int32)"],
        "a step count past int32",
    ),
    command_case(
        "nan learning rate",
        ["--config.train.learning_rate=nan"],
        ["train.learning_rate=nan"],
        "learning rate that is not a positive finite number",
    ),
    command_case(
        "heads not dividing",
        ["--config.model.kind=multihead", "--config.model.num_heads=3"],
        ["model.num_heads=3 does not divide model.d_k=8"],
        "heads not dividing the width",
    ),
    command_case(
        "unknown kind",
        ["--config.model.kind=lstm"],
        ["model.kind='lstm'", "learned_query"],
        "unknown model kind",
    ),
    command_case(
        "unknown task module",
        ["--config.task.module=no_such_package.sorting"],
        ["task.module='no_such_package.sorting'", "cannot be imported"],
        "task module that cannot be imported",
    ),
    command_case(
        "task module without build",
        ["--config.task.module=json"],
        ["task.module='json': has no function build(config) -> Setup"],
        "task module without a build function",
    ),
    command_case(
        "unknown optimizer",
        ["--config.train.optimizer=lion"],
        ["train.optimizer='lion'"],
        "unknown optimizer",
    ),
    command_case(
        "unknown cpu optimization level",
        ["--config.train.cpu_optimization_level=3"],
        ["train.cpu_optimization_level=3: must be 0, 1 or 2"],
        "CPU optimization level other than 0, 1 or 2",
    ),
    command_case(
        "missing config file",
        ["--config", "configs/nope.py"],
        ["--config=configs/nope.py: no such file"],
        "a config file that does not exist",
    ),
    command_case(
        "config directory",
        ["--config", "configs"],
        ["--config=configs: a directory, not a config file"],
        "a directory given as the config file",
    ),
    command_case(
        "config not python",
        ["--config", "README.md"],
        ["--config=README.md: loading it raised SyntaxError"],
        "a config file that is not Python",
    ),
    command_case(
        "unknown flag",
        ["--confg.train.steps=4"],
        ["--confg.train.steps: no such flag (did you mean --config.train.steps?)"],
        "a misspelt flag",
    ),
]


@pytest.mark.parametrize("name,args,expected", BAD_COMMANDS, ids=[c[0] for c in BAD_COMMANDS])
def test_bad_command_lines(tmp_path, name, args, expected):
    config = [] if "--config" in args else ["--config", CONFIG]
    result = launch_train(*config, "--workdir", str(tmp_path / "w"), *args)
    assert result.code == 2 and result.stdout == ""
    (line,) = result.error_lines
    assert line.startswith("error: ")
    for text in expected:
        assert text in line, line
    assert not (tmp_path / "w").exists()  # refused before anything was written


# A task from outside qkv_jax that fails in one of the ways a task can.
BROKEN_TASKS = {
    "raises on import": (
        "raise RuntimeError('no GPU here')",
        "importing it raised RuntimeError: no GPU here",
    ),
    "build raises": (
        "def build(config):\n    return config['model']['nope']",
        "build(config) raised KeyError: 'nope'",
    ),
    "build returns a dict": ("def build(config):\n    return {}", "build(config) returned dict, not a Setup"),
}


@pytest.mark.reliability(
    "Config and command line",
    "a task module that raises while it is imported, a build that raises (a KeyError), a build that "
    "returns something other than a Setup",
    "exit 2 before compiling, one line naming `task.module` and what went wrong; nothing written",
)
@pytest.mark.parametrize("kind", BROKEN_TASKS)
def test_broken_task_modules(tmp_path, monkeypatch, kind):
    source, expected = BROKEN_TASKS[kind]
    name = f"broken_task_{list(BROKEN_TASKS).index(kind)}"
    (tmp_path / f"{name}.py").write_text(source + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = launch_train(
        "--config", CONFIG, "--workdir", str(tmp_path / "w"), f"--config.task.module={name}"
    )
    assert result.code == 2
    assert result.error_lines == [f"error: task.module='{name}': {expected}"]
    assert not (tmp_path / "w").exists()


def run_as_user(*args):
    """(exit code, error lines) of experiments.train with `args`, held to the files' mode bits: in this
    process, or for root (who reads and writes anything) in a process without CAP_DAC_OVERRIDE."""
    if os.geteuid() != 0:
        result = launch_train(*args)
        return result.code, result.error_lines
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    result = subprocess.run(
        [*drop, sys.executable, "-m", "experiments.train", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=launcher_env(),
    )
    return result.returncode, error_lines(result)


@pytest.mark.slow
@pytest.mark.reliability(
    "Config and command line",
    "unknown config variant (`file.py:nope`, `file.py:a:b`); a config file the user cannot read, one "
    "without get_config() or whose get_config() returns something else; missing or empty --workdir",
    "exit 2 with one line naming the variant and the known ones / the file and what is wrong / the flag",
)
def test_config_files_and_required_flags(tmp_path):
    for variant in ("nope", "a:b"):
        result = launch_train("--config", f"{CONFIG}:{variant}", "--workdir", str(tmp_path / "w"))
        assert result.code == 2
        (line,) = result.error_lines
        assert line.startswith(f"error: --config: configs/flag_retrieval.py:{variant}: unknown variant"), line
        for known in ("learned_query", "static", "multihead", "two_flag", "thermostat"):
            assert known in line, line
    files = {"no_get.py": ("x = 1\n", "has no function get_config()")}
    files["three.py"] = ("def get_config():\n    return 3\n", "get_config() returned int, not a ConfigDict")
    for name, (source, expected) in files.items():
        (tmp_path / name).write_text(source)
        result = launch_train("--config", str(tmp_path / name), "--workdir", str(tmp_path / "w"))
        assert result.code == 2 and result.error_lines == [f"error: --config={tmp_path / name}: {expected}"]
    hidden = tmp_path / "hidden.py"
    hidden.write_text((ROOT / CONFIG).read_text())
    hidden.chmod(0)
    expected = [f"error: --config={hidden}: not readable by this user"]
    assert run_as_user("--config", str(hidden), "--workdir", str(tmp_path / "w")) == (2, expected)
    assert launch_train("--config", CONFIG).error_lines == ["error: --workdir is required"]
    empty = launch_train("--config", CONFIG, "--workdir=")
    assert empty.code == 2 and empty.error_lines == ["error: --workdir is required (and not empty)"]
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
@pytest.mark.reliability(
    "Config and command line",
    "a workdir that is a file, one under a file, one the user cannot write (a read-only directory), one "
    "on a read-only filesystem",
    "exit 2 before compiling, one line naming `workdir=...` and which of these it is; nothing written",
)
def test_workdirs_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cases = {
        blocker: "is a file, not a directory",
        blocker / "sub": f"is under '{blocker}', a file, not a directory",
    }
    for workdir, reason in cases.items():
        result = launch_train("--config", CONFIG, "--workdir", str(workdir))
        assert result.code == 2 and result.error_lines == [f"error: workdir='{workdir}': {reason}"]
    assert blocker.read_text() == "not a directory"
    locked = tmp_path / "read_only"
    locked.mkdir(mode=0o555)
    expected = [f"error: workdir='{locked / 'w'}': '{locked}' is not writable by this user"]
    assert run_as_user("--config", CONFIG, "--workdir", str(locked / "w")) == (2, expected)
    assert list(locked.iterdir()) == []
    mount = tmp_path / "mount"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)]).returncode:
        pytest.skip("mounting a read-only tmpfs needs root")
    try:
        result = launch_train("--config", CONFIG, "--workdir", str(mount / "w"))
        assert result.error_lines == [
            f"error: workdir='{mount / 'w'}': '{mount}' is on a read-only filesystem"
        ]
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


@pytest.mark.slow
@pytest.mark.reliability(
    "Config and command line",
    "workdir holding a different config's run, from the command line as a user starts it",
    "refused with one line naming the differing field and both values; `--config.train.overwrite=True` "
    "moves the old run to `replaced-<time>/` instead of deleting it; the first run printed `starting from "
    "step 0` and nothing on stderr",
)
def test_run_then_refuse_a_different_config_in_the_same_workdir(tmp_path):
    ok = run_cli("--config", CONFIG, "--workdir", str(tmp_path), *SMALL, cache_flag())
    assert ok.returncode == 0, ok.stderr
    assert ok.stderr == "" and ok.stdout.splitlines()[0] == "starting from step 0"  # no INFO logs
    assert "eval_accuracy" in ok.stdout and "resumed from" not in ok.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4

    # The first launch showed what a user's command prints; the launcher's parsing and the workdir's
    # checks behave the same in this process (one JAX start-up and compilation fewer each).
    refused = launch_train("--config", CONFIG, "--workdir", str(tmp_path), *SMALL, "--config.model.d_k=4")
    assert refused.code != 0
    (line,) = refused.error_lines
    assert "model.d_k=4 here but 8 in the workdir" in line and "overwrite" in line

    replaced = launch_train(
        "--config",
        CONFIG,
        "--workdir",
        str(tmp_path),
        *SMALL,
        "--config.model.d_k=4",
        "--config.train.overwrite=True",
    )
    assert replaced.code == 0, replaced.stderr
    (archive,) = tmp_path.glob("replaced-*")
    assert json.loads((archive / "config.json").read_text())["model"]["d_k"] == 8
    assert json.loads((tmp_path / "config.json").read_text())["model"]["d_k"] == 4
