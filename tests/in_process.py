"""`python -m experiments.train ...` run inside the test process, through the launcher's real parsing.

absl's FLAGS and the config overrides ml_collections defines while parsing are
global to the process: `launch_train` resets them before each call, so calls
are independent. experiments.train is the only launcher imported in a test
process (each launcher defines --workdir; two in one process would clash).
"""

import contextlib
import dataclasses
import io
import os
import sys
import warnings

from absl import flags
from absl import logging as absl_logging

from experiments import common, train


@dataclasses.dataclass(frozen=True)
class Launched:
    code: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def reset_flags() -> None:
    """Every flag back to its default, the config overrides of the last call undefined, and the
    config file's module forgotten (ml_collections loads each into the module `config_config`,
    whose namespace a second load in one process would reuse)."""
    for name in list(flags.FLAGS):
        if name.startswith("config."):
            delattr(flags.FLAGS, name)
    flags.FLAGS.unparse_flags()
    sys.modules.pop("config_config", None)


def launch_train(*args: str) -> Launched:
    """experiments.train with `args`: its exit code and what it printed to stdout and stderr.

    Unless `args` name one, --compilation_cache is the test session's cache (conftest's
    `compilation_cache` fixture), as for the subprocess launches (`launch.launcher_env`): the
    launcher's own default would point this process's JAX at the user's cache."""
    reset_flags()
    cache = os.environ.get("QKV_JAX_TEST_COMPILATION_CACHE")
    if cache is not None:
        flags.FLAGS.set_default("compilation_cache", cache)
    stdout, stderr = io.StringIO(), io.StringIO()
    handler = absl_logging.get_absl_handler().python_handler
    stream = handler.stream
    handler.stream = stderr  # absl's handler keeps the stream it was made with
    quiet = contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), warnings.catch_warnings()
    try:
        with quiet[0], quiet[1], quiet[2]:
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.filterwarnings("ignore", category=category)  # as a fresh interpreter does
            try:
                common.run_main(train.main, argv=["experiments.train", *args])
                code = 0
            except SystemExit as error:
                code = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
    finally:
        handler.stream = stream
    return Launched(code, stdout.getvalue(), stderr.getvalue())
