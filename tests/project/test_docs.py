"""Every code block of README.md and of the guides in docs/ runs, so they cannot drift from the code.

python blocks are executed; bash blocks are run in order, per file (with `runs/`
moved to a temporary directory, and the port of the multi-process example
replaced by a free one); a text block of `$ command` lines must print what it
shows. The set-up commands are the exception: their `pip install` part is what
CI and tools/fresh-clone-check run, and the test command is this suite itself.
Every command's `python` is the interpreter running the tests (`sys.executable`),
whatever `python` is first on PATH, if any.

A guide of SESSIONS is one session instead: its blocks run in the order they appear, in one
temporary directory, each run of consecutive python blocks as one script (a block uses what
the blocks before it defined) with that directory as its working directory and the repository
on PYTHONPATH, and each bash block as above (`runs/` moved there): a bash block reads the
files the python blocks before it wrote under `runs/`.
"""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from launch import cache_flag, free_port, launcher_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.DOTALL | re.MULTILINE)


# The files whose blocks are run: the README and the guides.
DOCS = [
    "README.md",
    "docs/library.md",
    "docs/training.md",
    "docs/reading_a_run.md",
    "docs/studies.md",
    "docs/finetuning.md",
    "docs/scaling.md",
    "docs/adding_a_task.md",
    "docs/interpretability.md",
    "docs/pretrained.md",
]

# The guides whose blocks are one session (see the module docstring).
SESSIONS = ["docs/pretrained.md"]


def blocks(language, doc=None):
    """The `language` blocks of one file (`doc`), or of every file in DOCS."""
    found = []
    for name in [doc] if doc else DOCS:
        found += [body for lang, body in BLOCK.findall((ROOT / name).read_text()) if lang == language]
    return found


def file_names(body):
    """`my_tasks/lookup.py` for a block that opens with `# my_tasks/lookup.py`, else None."""
    first = body.splitlines()[0]
    return first[2:] if first.startswith("# ") and first.endswith(".py") else None


PYTHON_BLOCKS = [
    pytest.param(doc, index, id=f"{doc}-{index}")
    for doc in DOCS
    if doc not in SESSIONS
    for index, body in enumerate(blocks("python", doc))
    if file_names(body) is None
]


def commands(body):
    """Shell commands of a bash block, continuation lines joined."""
    return [c.strip() for c in body.replace("\\\n", " ").splitlines() if c.strip() and not c.startswith("#")]


def sandboxed(body, tmp_path, port):
    """A bash block's commands as one `set -e` script: `runs/` moved under `tmp_path`, the
    example port replaced by `port`, the set-up line's `pip install` part dropped."""
    script = []
    for line in commands(body):
        if "pip install" in line:
            line = line.split("&&", 1)[1].strip() if "&&" in line else ""
        if line:
            script.append(line.replace("runs/", f"{tmp_path}/runs/").replace("12355", port))
    return "set -e\n" + "\n".join(script) + "\nwait" if script else None


def run_bash(script, env):
    result = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, (script, result.stderr[-3000:])


@pytest.fixture(scope="module")
def shell_env(tmp_path_factory):
    """launcher_env() for the guides' shell commands, with `python` and `python3` first on PATH
    meaning sys.executable (a wrapper script: a symlink to a venv's interpreter would lose the
    venv)."""
    directory = tmp_path_factory.mktemp("interpreter")
    for name in ("python", "python3"):
        wrapper = directory / name
        wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        wrapper.chmod(0o755)
    env = launcher_env()
    env["PATH"] = os.pathsep.join(filter(None, [str(directory), env.get("PATH")]))
    return env


def test_shell_commands_run_with_this_interpreter(shell_env):
    result = subprocess.run(
        [
            "bash",
            "-c",
            "python -c 'import sys; print(sys.executable)'; python3 -c 'import sys; print(sys.prefix)'",
        ],
        env=shell_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [sys.executable, sys.prefix]


@pytest.mark.parametrize("doc,index", PYTHON_BLOCKS)
@pytest.mark.slow
def test_python_blocks(doc, index):
    code = blocks("python", doc)[index]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("doc", [doc for doc in DOCS if doc not in SESSIONS and blocks("bash", doc)])
def test_bash_blocks_in_order(doc, tmp_path, shell_env):
    port = str(free_port())
    ran = 0
    for body in blocks("bash", doc):
        if "pytest" in body:  # the test command: this suite
            continue
        script = sandboxed(body, tmp_path, port)
        if script:
            run_bash(script, shell_env)
            ran += 1
    assert ran >= 1


@pytest.mark.slow
@pytest.mark.parametrize("doc", SESSIONS)
def test_session_guide_runs_in_order(doc, tmp_path, shell_env):
    """Every python and bash block of `doc` in order in `tmp_path`, consecutive python blocks as
    one script."""
    port, python, ran = str(free_port()), [], []

    def run_python():
        if python:
            result = subprocess.run(
                [sys.executable, "-c", "\n".join(python)],
                cwd=tmp_path,
                env=shell_env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert result.returncode == 0, result.stderr[-3000:]
            ran.append("python")
            python.clear()

    for language, body in BLOCK.findall((ROOT / doc).read_text()):
        if language == "python":
            python.append(body)
        elif language == "bash":
            run_python()
            script = sandboxed(body, tmp_path, port)
            if script:
                run_bash(script, shell_env)
                ran.append("bash")
    run_python()
    assert "python" in ran


@pytest.mark.slow
def test_text_blocks_show_what_commands_print(tmp_path, shell_env):
    checked = 0
    for body in blocks("text"):
        if not body.startswith("$ "):
            continue
        for chunk in body.split("$ ")[1:]:
            command, *expected = chunk.rstrip("\n").split("\n")
            result = subprocess.run(
                ["bash", "-c", command.replace("runs/", f"{tmp_path}/runs/")],
                cwd=ROOT,
                env=shell_env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            shown = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
            assert shown == expected, command
            checked += 1
    assert checked >= 2


@pytest.mark.slow
def test_own_task_from_the_guide_trains_from_outside_the_repository(tmp_path):
    """docs/adding_a_task.md's task module, in a package of its own on PYTHONPATH, and its config
    file train through the launcher with nothing in qkv_jax edited."""
    files = {file_names(body): body for body in blocks("python", "docs/adding_a_task.md") if file_names(body)}
    assert set(files) == {"my_tasks/lookup.py", "my_lookup.py"}
    for name, code in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(code)
    workdir = tmp_path / "runs" / "lookup"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--config", str(tmp_path / "my_lookup.py")]
        + ["--workdir", str(workdir), "--config.train.steps=300", cache_flag()],
        cwd=ROOT,
        env=launcher_env(PYTHONPATH=f"{ROOT}:{tmp_path}"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["experiment"] == "lookup" and summary["steps"] == 300
    assert summary["eval_mse"] < 0.5 * summary["untrained"]["eval_mse"]
