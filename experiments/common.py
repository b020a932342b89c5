"""What every launcher shares: clean command-line errors, config files, devices, the JAX cache.

(The allocator re-exec happens once, in `experiments/__init__.py`.)
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import re
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from experiments.allocator import TCMALLOC_PATHS

__all__ = [
    "TCMALLOC_PATHS",
    "fail",
    "parse_flags",
    "training_errors",
    "config_file_module",
    "run_main",
    "define_common_flags",
]

DEFAULT_CACHE_DIR = pathlib.Path.home() / ".cache" / "qkv_jax" / "jax_compilation_cache"


def fail(message: str, code: int = 1) -> None:
    """Exits with one line on stderr."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def _describe_parse_error(error: Exception, argv: list[str]) -> str:
    """One line for an exception raised while parsing flags and config overrides."""
    text = " ".join(str(error).replace("\\", "").split())
    unknown = re.search(r"'([A-Za-z_]\w*)'", text)
    if isinstance(error, (AttributeError, KeyError)) and unknown:
        name = unknown.group(1)
        fields = [a.split("=", 1)[0] for a in argv if a.startswith("--config.")]
        override = next((f for f in fields if f.rsplit(".", 1)[-1] == name), f"--config...{name}")
        suggestion = re.search(r'Did you mean "(\w+)"', text)
        hint = f" (did you mean {suggestion.group(1)}?)" if suggestion else ""
        return f"{override}: no such config field{hint}"
    return text.strip("'\"")


def _config_file_reason(text: str) -> str | None:
    """The exception line of ml_collections' "Error whilst parsing config file:" + traceback, if any."""
    if "Error whilst parsing config file" not in text:
        return None
    last = [line for line in text.splitlines() if line.strip()][-1].strip()
    return re.sub(r"^\w+(Error|Exception): ", "", last)


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing that turns every parse or config error into one line."""
    from absl import flags

    try:
        remaining = flags.FLAGS(argv)
        if "config" in flags.FLAGS and flags.FLAGS["config"].present:
            flags.FLAGS["config"].value.to_dict()  # a config file that failed to load raises here
    except flags.Error as error:
        reason = _config_file_reason(str(error))
        fail(f"--config: {reason}" if reason else str(error).split("\n")[0], code=2)
    except Exception as error:  # noqa: BLE001 - any config-loading failure becomes one line
        fail(_describe_parse_error(error, argv), code=2)
    missing = [n for n in ("config", "workdir") if n in flags.FLAGS and flags.FLAGS[n].value is None]
    if missing:
        fail(f"--{missing[0]} is required", code=2)
    return remaining


@contextlib.contextmanager
def training_errors() -> Iterator[None]:
    """What a training command can meet, each as one line and an exit code: 2 for a bad config,
    75 (EX_TEMPFAIL) when stopped by SIGTERM/SIGINT after saving a checkpoint, 1 otherwise."""
    import jax

    from qkv_jax.training import CheckpointMismatchError, ConfigError
    from qkv_jax.training.memory import InsufficientMemoryError
    from qkv_jax.training.preemption import EXIT_PREEMPTED, Preempted
    from qkv_jax.training.workdir import DiskFullError, WorkdirBusyError

    try:
        yield
    except ConfigError as error:
        fail(str(error), code=2)
    except Preempted as error:
        fail(str(error), code=EXIT_PREEMPTED)
    except (
        FloatingPointError,
        CheckpointMismatchError,
        WorkdirBusyError,
        InsufficientMemoryError,
        DiskFullError,
    ) as error:
        fail(str(error))
    except jax.errors.JaxRuntimeError as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        reason = str(error).splitlines()[0].split("RESOURCE_EXHAUSTED:", 1)[-1].strip()
        fail(f"out of memory: {reason}; lower train.batch_size or the model's size")


def config_file_module(flag_name: str = "config") -> tuple[ModuleType, str | None]:
    """The config file of `--<flag_name>` as a module (for its `get_sweep`, say), and
    the text after ':' in the flag (None without one)."""
    from absl import flags
    from ml_collections import config_flags

    path, _, arg = config_flags.get_config_filename(flags.FLAGS[flag_name]).partition(":")
    spec = importlib.util.spec_from_file_location(f"{flag_name}_file", path)
    if spec is None or spec.loader is None:
        fail(f"--{flag_name}={path}: not a Python file", code=2)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, arg or None


def initialize_devices() -> None:
    """Simulated CPU devices and jax.distributed, from the flags; before any JAX work."""
    import jax
    from absl import flags

    FLAGS = flags.FLAGS
    if FLAGS.num_cpu_devices:
        jax.config.update("jax_num_cpu_devices", FLAGS.num_cpu_devices)
    if FLAGS.coordinator:
        if not 0 <= FLAGS.process_id < FLAGS.num_processes:
            fail(f"--process_id={FLAGS.process_id}: must be in [0, --num_processes={FLAGS.num_processes})", 2)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=FLAGS.coordinator,
            num_processes=FLAGS.num_processes,
            process_id=FLAGS.process_id,
        )
    elif FLAGS.num_processes != 1:
        fail(f"--num_processes={FLAGS.num_processes} needs --coordinator host:port", 2)


def enable_compilation_cache(directory: str) -> None:
    """Turns on JAX's persistent compilation cache ('' leaves it off)."""
    if not directory:
        return
    import jax

    pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _quiet_libraries() -> None:
    """Drops orbax's and JAX's INFO chatter (a dozen lines per checkpoint, backend
    probing); their warnings stay."""
    import logging

    logging.getLogger("absl").addFilter(
        lambda record: record.levelno >= logging.WARNING or "orbax" not in record.pathname
    )
    logging.getLogger("jax").setLevel(logging.WARNING)


def run_main(main: Callable[[list[str]], Any], positional: int = 0) -> None:
    """`absl.app.run` with one-line errors for bad flags and configs, and for more than
    `positional` arguments that are not flags."""
    from absl import app

    def checked(argv: list[str]) -> Any:
        if len(argv) - 1 > positional:
            fail(f"unexpected arguments {argv[1 + positional :]}", code=2)
        return main(argv)

    _quiet_libraries()
    app.run(checked, flags_parser=parse_flags)


def define_common_flags() -> None:
    from absl import flags

    flags.DEFINE_string(
        "coordinator",
        None,
        "host:port of process 0 for a multi-process run (jax.distributed.initialize); with "
        "--num_processes and --process_id",
    )
    flags.DEFINE_integer("num_processes", 1, "Processes in a multi-process run.")
    flags.DEFINE_integer("process_id", 0, "This process's index in a multi-process run.")
    flags.DEFINE_integer(
        "num_cpu_devices",
        None,
        "Split the CPU into this many JAX devices (jax_num_cpu_devices), to try sharding on one machine.",
    )

    flags.DEFINE_string(
        "compilation_cache",
        os.environ.get("QKV_JAX_COMPILATION_CACHE", str(DEFAULT_CACHE_DIR)),
        "Directory of JAX's persistent compilation cache ('' turns it off; env "
        "QKV_JAX_COMPILATION_CACHE sets the default).",
    )
