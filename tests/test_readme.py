"""Every code block of README.md runs, so the README cannot drift from the code.

python blocks are executed; bash blocks are run in order (with `runs/` moved to
a temporary directory, and the port of the multi-process example replaced by
a free one); a text block of `$ command` lines must print what it shows. The
two set-up commands are the exception: their `pip install` part is what CI
and tools/fresh-clone-check run, and the test command is this suite itself,
so only the main job's training command is run from them.
"""

import json
import pathlib
import re
import socket
import subprocess
import sys

import pytest
from launch import cache_flag, launcher_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def blocks(language):
    return [body for lang, body in BLOCK.findall((ROOT / "README.md").read_text()) if lang == language]


def commands(body):
    """Shell commands of a bash block, continuation lines joined."""
    return [c.strip() for c in body.replace("\\\n", " ").splitlines() if c.strip() and not c.startswith("#")]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_blocks(index):
    code = blocks("python")[index]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_bash_blocks_in_order(tmp_path):
    env = launcher_env()
    port = str(free_port())
    ran = 0
    for body in blocks("bash"):
        if "pytest" in body:  # the test command: this suite
            continue
        lines = commands(body)
        script = []
        for line in lines:
            if "pip install" in line:
                line = line.split("&&", 1)[1].strip() if "&&" in line else ""
            if line:
                script.append(line.replace("runs/", f"{tmp_path}/runs/").replace("12355", port))
        if script:
            result = subprocess.run(
                ["bash", "-c", "set -e\n" + "\n".join(script) + "\nwait"],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            assert result.returncode == 0, (script, result.stderr[-3000:])
            ran += len(script)
    assert ran >= 5


def test_text_blocks_show_what_commands_print(tmp_path):
    env = launcher_env()
    checked = 0
    for body in blocks("text"):
        if not body.startswith("$ "):
            continue
        for chunk in body.split("$ ")[1:]:
            command, *expected = chunk.rstrip("\n").split("\n")
            result = subprocess.run(
                ["bash", "-c", command.replace("runs/", f"{tmp_path}/runs/")],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            shown = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
            assert shown == expected, command
            checked += 1
    assert checked >= 2


def file_blocks():
    """{file name: code} of the README's python blocks that open with `# <file>.py`."""
    named = {}
    for body in blocks("python"):
        first = body.splitlines()[0]
        if first.startswith("# ") and first.endswith(".py"):
            named[first[2:]] = body
    return named


@pytest.mark.slow
def test_own_task_from_the_readme_trains_from_outside_the_repository(tmp_path):
    """The README's task module, in a package of its own on PYTHONPATH, and its config file
    train through the launcher with nothing in qkv_jax edited."""
    files = file_blocks()
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
