"""What every launcher shares: the allocator, clean command-line errors, the JAX cache.

Import this module before jax: `use_tcmalloc()` may re-execute the process.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
from collections.abc import Callable
from typing import Any

TCMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)
DEFAULT_CACHE_DIR = pathlib.Path.home() / ".cache" / "qkv_jax" / "jax_compilation_cache"


def use_tcmalloc() -> None:
    """Re-executes the launcher with tcmalloc preloaded, when it is installed.

    glibc returns large freed buffers to the kernel after every call, and JAX
    then spends much of its CPU time on page faults; tcmalloc keeps them. Opt
    out with QKV_JAX_TCMALLOC=0. Debian/Ubuntu: apt-get install libtcmalloc-minimal4.
    """
    if os.environ.get("QKV_JAX_TCMALLOC", "1") == "0" or "tcmalloc" in os.environ.get("LD_PRELOAD", ""):
        return
    library = next((p for p in TCMALLOC_PATHS if os.path.exists(p)), None)
    if library is None or "jax" in sys.modules:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = f"{library} {env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else library
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


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


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing that turns every parse or config error into one line."""
    from absl import flags

    try:
        remaining = flags.FLAGS(argv)
        for name in ("config",):
            if name in flags.FLAGS and flags.FLAGS[name].present:
                config = flags.FLAGS[name].value
                config.to_dict()  # a config file that failed to load raises here
    except flags.Error as error:
        fail(str(error).split("\n")[0], code=2)
    except Exception as error:  # noqa: BLE001 - any config-loading failure becomes one line
        fail(_describe_parse_error(error, argv), code=2)
    missing = [n for n in ("config", "workdir") if n in flags.FLAGS and flags.FLAGS[n].value is None]
    if missing:
        fail(f"--{missing[0]} is required", code=2)
    return remaining


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


def run_main(main: Callable[[list[str]], Any]) -> None:
    """`absl.app.run` with one-line errors for bad flags and configs."""
    from absl import app

    _quiet_libraries()
    app.run(main, flags_parser=parse_flags)


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
