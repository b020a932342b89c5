"""The command line: bad input exits non-zero with one line naming field and value."""

import json
import pathlib
import subprocess
import sys

import pytest
from launch import cache_flag, launcher_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "configs/flag_retrieval.py"
SMALL = [
    "--config.train.steps=4",
    "--config.train.log_every=2",
    "--config.train.checkpoint_every=2",
    "--config.eval.num_examples=16",
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
        "exits non-zero before compiling, one line: " + ", ".join(f"`{e}`" for e in expected),
    )
    return pytest.param(name, args, expected, marks=mark, id=name)


BAD_COMMANDS = [
    command_case(
        "unknown field",
        ["--config.model.nmu_heads=4"],
        ["--config.model.nmu_heads", "did you mean num_heads"],
        "unknown config field (a typo)",
    ),
    command_case(
        "wrong type", ["--config.train.steps=abc"], ["--config.train.steps=abc"], "value of the wrong type"
    ),
    command_case(
        "non-positive size", ["--config.model.d_k=0"], ["model.d_k=0", "positive"], "non-positive size"
    ),
    command_case("negative steps", ["--config.train.steps=-5"], ["train.steps=-5"], "negative step count"),
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
        "unknown optimizer",
        ["--config.train.optimizer=lion"],
        ["train.optimizer='lion'"],
        "unknown optimizer",
    ),
]


@pytest.mark.parametrize("name,args,expected", BAD_COMMANDS, ids=[c[0] for c in BAD_COMMANDS])
def test_bad_command_lines(tmp_path, name, args, expected):
    result = run_cli("--config", CONFIG, "--workdir", str(tmp_path / "w"), *args)
    assert result.returncode != 0
    lines = error_lines(result)
    assert len(lines) == 1, result.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    assert not (tmp_path / "w" / "checkpoints").exists()  # failed before any work


@pytest.mark.reliability(
    "Config and command line",
    "unknown config variant (`file.py:nope`); missing --workdir",
    "exits non-zero with one line naming the variant and the known ones / the flag",
)
def test_unknown_variant_and_missing_workdir(tmp_path):
    result = run_cli("--config", f"{CONFIG}:nope", "--workdir", str(tmp_path))
    assert result.returncode != 0
    (line,) = error_lines(result)
    assert line.startswith("error: --config: configs/flag_retrieval.py:nope: unknown variant"), line
    for known in ("learned_query", "static", "multihead", "two_flag", "thermostat"):
        assert known in line, line
    result = run_cli("--config", CONFIG)
    assert result.returncode != 0 and error_lines(result) == ["error: --workdir is required"]


@pytest.mark.reliability(
    "Config and command line",
    "unwritable workdir (a path under a file)",
    "exits non-zero with one line naming `workdir=...`, before compiling",
)
def test_unwritable_workdir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = run_cli("--config", CONFIG, "--workdir", str(blocker / "sub"))
    assert result.returncode != 0
    (line,) = error_lines(result)
    assert f"workdir='{blocker / 'sub'}'" in line


@pytest.mark.slow
@pytest.mark.reliability(
    "Config and command line",
    "workdir holding a different config's run",
    "refused with one line naming the differing field and both values; `--config.train.overwrite=True` "
    "moves the old run to `replaced-<time>/` instead of deleting it",
)
def test_run_then_refuse_a_different_config_in_the_same_workdir(tmp_path):
    ok = run_cli("--config", CONFIG, "--workdir", str(tmp_path), *SMALL, cache_flag())
    assert ok.returncode == 0, ok.stderr
    assert "eval_accuracy" in ok.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4

    refused = run_cli(
        "--config", CONFIG, "--workdir", str(tmp_path), *SMALL, cache_flag(), "--config.model.d_k=4"
    )
    assert refused.returncode != 0
    (line,) = error_lines(refused)
    assert "model.d_k=4 here but 8 in the workdir" in line and "overwrite" in line

    replaced = run_cli(
        "--config",
        CONFIG,
        "--workdir",
        str(tmp_path),
        *SMALL,
        cache_flag(),
        "--config.model.d_k=4",
        "--config.train.overwrite=True",
    )
    assert replaced.returncode == 0, replaced.stderr
    (archive,) = tmp_path.glob("replaced-*")
    assert json.loads((archive / "config.json").read_text())["model"]["d_k"] == 8
    assert json.loads((tmp_path / "config.json").read_text())["model"]["d_k"] == 4
