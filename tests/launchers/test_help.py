"""Every launcher's help: -h, --help, --helpshort and --helpfull exit 0 and print what the launcher
does, an example command and its own flags before anyone else's."""

import ast
import json
import subprocess
import sys

import pytest
from in_process import launch_train
from launch import ROOT, launcher_env

HELP_FLAGS = ("-h", "--help", "--helpshort", "--helpfull")
LAUNCHERS = sorted(
    f"experiments.{path.stem}"
    for path in (ROOT / "experiments").glob("*.py")
    if "\ndef main(" in path.read_text()
)

# One process runs every launcher's main in turn: each launcher's flags (and the shared ones it
# defines again) are removed before the next one is imported.
EVERY_LAUNCHER = """
import contextlib, importlib, io, json, sys
from absl import flags
from experiments import common

found = {}
help_flags, launchers = json.loads(sys.argv[1]), sys.argv[2:]
for name in launchers:
    before = set(flags.FLAGS)
    module = importlib.import_module(name)
    for flag in help_flags:
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            try:
                common.run_main(module.main, argv=[name, flag])
                code = None
            except SystemExit as error:
                code = error.code
        found[f"{name} {flag}"] = [code, stdout.getvalue()]
    for flag in set(flags.FLAGS) - before:
        delattr(flags.FLAGS, flag)
    sys.modules.pop(name)
print(json.dumps(found))
"""


def assert_help(name: str, text: str, full: bool) -> None:
    """The docstring's first line, an example command, the launcher's flags before the shared ones."""
    source = (ROOT / "experiments" / f"{name.split('.')[1]}.py").read_text()
    purpose = ast.get_docstring(ast.parse(source)).splitlines()[0]
    assert text.splitlines()[0] == purpose
    assert f"python -m {name} " in text, f"{name}: no example command"
    own, shared = text.index(f"flags of {name}:"), text.index("flags every launcher takes")
    assert own < shared
    assert ("absl.app:" in text) == full


def test_train_help_in_process():
    for flag in HELP_FLAGS:
        result = launch_train(flag)
        assert (result.code, result.stderr) == (0, ""), flag
        assert_help("experiments.train", result.stdout, full=flag == "--helpfull")
        assert "--workdir: Directory for config.json" in result.stdout


def test_a_flag_value_is_not_a_help_request():
    result = launch_train("--workdir", "-h")
    assert (result.code, result.error_lines) == (2, ["error: --config is required"])


@pytest.mark.slow
def test_every_launcher_help():
    assert len(LAUNCHERS) >= 7 and {"experiments.train", "experiments.generate"} <= set(LAUNCHERS)
    result = subprocess.run(
        [sys.executable, "-c", EVERY_LAUNCHER, json.dumps(HELP_FLAGS), *LAUNCHERS],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    for name in LAUNCHERS:
        for flag in HELP_FLAGS:
            code, text = found[f"{name} {flag}"]
            assert code == 0, f"{name} {flag}"
            assert_help(name, text, full=flag == "--helpfull")
