"""What every launcher shares: one-line errors, quiet logs, config files, devices, the JAX cache.

A launcher's output is its results: stdout holds them, and stderr holds
nothing but one line per warning (`warning: ...`) and, when it fails, one
line saying why (`error: ...`), in this project's words. Exit codes: 0 done
(and after -h, --help, --helpshort or --helpfull printed the launcher's help),
1 a failure while running (the loss stopped being finite, a full disk, a
sweep cell that failed, ...), 2 a command that cannot run as given (a bad
flag, config or workdir; nothing was written), 75 stopped by SIGTERM/SIGINT
after saving a checkpoint (run the same command to resume), 130 interrupted
by SIGINT without one. absl's and the libraries' INFO logs are off unless
`--verbosity` asks for them (`--verbosity=0`: INFO).

(The allocator re-exec happens once, in `experiments/__init__.py`.)
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import os
import pathlib
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

from experiments.allocator import TCMALLOC_PATHS

__all__ = [
    "TCMALLOC_PATHS",
    "EXIT_CONFIG",
    "EXIT_INTERRUPTED",
    "fail",
    "parse_flags",
    "one_source",
    "training_errors",
    "config_file_module",
    "config_sweep",
    "run_main",
    "define_common_flags",
    "launcher_help",
]

DEFAULT_CACHE_DIR = pathlib.Path.home() / ".cache" / "qkv_jax" / "jax_compilation_cache"
EXIT_CONFIG = 2  # a command that cannot run as given; nothing was written
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def fail(message: str, code: int = 1) -> None:
    """Exits with one line on stderr."""
    print("error: " + " ".join(str(message).split()), file=sys.stderr)
    sys.exit(code)


# --- Flags and config files -------------------------------------------------------------------

_OVERRIDE = re.compile(r"^--?(no)?config\.(?P<name>[^=]*)", re.DOTALL)
_FIELD_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# What a field's type accepts, as an error says it.
_EXPECTED = {int: "an integer", float: "a number", bool: "True or False", str: "a string"}


def _config_argument(argv: Sequence[str]) -> str | None:
    """The value of --config on the command line (the last one), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg in ("--config", "-config") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(("--config=", "-config=")):
            value = arg.split("=", 1)[1]
    return value


def _config_file_problem(argument: str) -> str | None:
    """Why the file part of `--config=<file>[:<variant>]` cannot be a config file, or None."""
    path = pathlib.Path(argument.split(":", 1)[0])
    if not str(path) or not os.path.lexists(path):
        return "no such file"
    if path.is_dir():
        return "a directory, not a config file"
    if not os.access(path, os.R_OK):
        return "not readable by this user"
    return None


def _suggest(name: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _field(config: Any, name: str) -> tuple[Any, str] | str:
    """(section, key) of the field `name` ('train.steps') in `config`, or what is wrong with
    `--config.<name>`: not a field name, no such section, no such field, a field used as a
    section."""
    from ml_collections import ConfigDict

    flag = f"--config.{name}"
    if not _FIELD_PATH.match(name):
        return f"{flag}: not a field name; overrides read --config.<section>.<field>=<value>"
    *sections, key = name.split(".")
    node = config
    for depth, part in enumerate(sections):
        here = ".".join(sections[:depth])
        keys = list(node.keys())
        if part not in keys:
            where = f" in section {here}" if here else ""
            return f"{flag}: no config section {part}{where}{_suggest(part, keys)}"
        node = node[part]
        if not isinstance(node, (ConfigDict, dict)):
            path = ".".join(sections[: depth + 1])
            kind = _EXPECTED.get(type(node), f"a {type(node).__name__}")
            return f"{flag}: {path} is a field ({kind}), not a section"
    if key not in node.keys():
        return f"{flag}: no such config field{_suggest(key, list(node.keys()))}"
    return node, key


def _value_problem(config: Any, name: str, value: str) -> str | None:
    """What a value absl could not parse for `--config.<name>` should have been."""
    from ml_collections import ConfigDict

    found = _field(config, name)
    if isinstance(found, str):
        return found
    section, key = found
    shown = f"--config.{name}={value}"
    if isinstance(section[key], (ConfigDict, dict)):
        return f"{shown}: {name} is a section; set its fields one by one (--config.{name}.<field>=...)"
    try:
        kind = section.get_type(key)  # a placeholder's declared type too
    except (AttributeError, KeyError, TypeError):
        kind = type(section[key])
    if kind not in _EXPECTED:
        return None
    if not value.strip():
        return f"{shown}: no value; expected {_EXPECTED[kind]}"
    return f"{shown}: not {_EXPECTED[kind]}"


def _describe_parse_error(error: Exception, argv: Sequence[str]) -> str:
    """One line, in this project's words, for an exception raised while parsing the flags."""
    from absl import flags
    from ml_collections import ConfigDict, config_flags
    from ml_collections.config_flags.config_flags import ConfigFileFlagParser

    text = " ".join(str(error).split())
    if "config" in flags.FLAGS:
        argument = _config_argument(argv)
        if argument is None:
            try:
                argument = config_flags.get_config_filename(flags.FLAGS["config"])
            except Exception:  # noqa: BLE001 - no default config file either
                return "--config is required"
        if (problem := _config_file_problem(argument)) is not None:
            return f"--config={argument}: {problem}"
        if "Error whilst parsing config file" in str(error):  # get_config(variant) refused
            last = [line for line in str(error).splitlines() if line.strip()][-1].strip()
            return "--config: " + re.sub(r"^\w+(Error|Exception): ", "", last)
        try:
            config = ConfigFileFlagParser("config", lock_config=False).parse(argument)
        except Exception as load_error:  # noqa: BLE001 - any failure of the user's file
            if isinstance(load_error, AttributeError) and "get_config" in str(load_error):
                return f"--config={argument}: has no function get_config()"
            reason = " ".join(str(load_error).split()) or "no message"
            return f"--config={argument}: loading it raised {type(load_error).__name__}: {reason}"
        if not isinstance(config, ConfigDict):
            return f"--config={argument}: get_config() returned {type(config).__name__}, not a ConfigDict"
        rejected = re.match(r"flag --config\.([^=]*)=", text)
        if isinstance(error, flags.IllegalFlagValueError) and rejected is not None:
            name = rejected.group(1)
            values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--config.{name}=")]
            problem = _value_problem(config, name, values[-1] if values else "")
            if problem is not None:
                return problem
        for arg in argv:
            if (match := _OVERRIDE.match(arg)) is not None and isinstance(
                problem := _field(config, match["name"]), str
            ):
                return problem
    if isinstance(error, flags.UnrecognizedFlagError):
        name = str(error.flagname)
        close = difflib.get_close_matches(name.split(".")[0], [n for n in flags.FLAGS if "." not in n], n=1)
        hint = f" (did you mean --{close[0]}{name[len(name.split('.')[0]) :]}?)" if close else ""
        return f"--{name}: no such flag{hint}"
    if (early := re.match(r"Found (\S+) in argv before a value for (--\S+) was specified", text)) is not None:
        return f"{early.group(1)} comes before {early.group(2)}: give {early.group(2)} first"
    if (missing := re.match(r"Missing value for flag (\S+)", text)) is not None:
        return f"{missing.group(1)}: no value given"
    if (order := re.match(r"Flag (--\S+) is provided after (--\S+) and", text)) is not None:
        return f"{order.group(1)} comes after {order.group(2)} and would replace it; give a section first"
    replaced = re.search(r"\w+ is not a valid key or attribute of .*\(in: ([\w.]+)\)", text)
    if replaced is not None:  # an earlier override replaced the whole section
        field, section = replaced.group(1), replaced.group(1).rsplit(".", 1)[0]
        return f"--config.{field}: no such config field once --config.{section} replaced that section"
    if (value := re.match(r"flag (--[^=]+)=(.*?): (.*)$", text)) is not None:
        reason = "not True or False" if "Non-boolean argument" in value.group(3) else value.group(3)
        return f"{value.group(1)}={value.group(2)}: {reason}"
    return text.strip("'\"") or type(error).__name__


# --- Help -------------------------------------------------------------------------------------

_SHORT_HELP = ("h", "help", "helpshort", "?")
_FULL_HELP = ("helpfull",)


def _help_asked(argv: Sequence[str]) -> str | None:
    """ "short" or "full" when `argv` asks for help (-h, --help, --helpshort, -?, --helpfull) before
    any `--`, else None; a flag's value (`--prompt -h`) is not a request."""
    from absl import flags

    takes_value = False
    for arg in argv[1:]:
        if arg == "--":
            return None
        name = arg.lstrip("-")
        if arg.startswith("-") and not takes_value:
            if name in _SHORT_HELP:
                return "short"
            if name in _FULL_HELP:
                return "full"
        known = "=" not in name and name in flags.FLAGS and not flags.FLAGS[name].boolean
        takes_value = arg.startswith("-") and not takes_value and known
    return None


def _module_flags(key: str) -> list[str]:
    """absl's help lines for the flags `key` (a module's name or file) defines, without its heading."""
    from absl import flags

    return [line for line in flags.FLAGS.module_help(key).splitlines() if line.startswith(" ")]


def launcher_help(module: ModuleType, full: bool = False) -> str:
    """A launcher's help: its docstring (what it does, example commands), then its own flags, then
    the flags every launcher takes, then with `full` every other module's (absl's, JAX's)."""
    from absl import flags

    by_module = flags.FLAGS.flags_by_module_dict()
    own = next((k for k in (module.__name__, getattr(module, "__file__", "")) if k in by_module), None)
    shared = __name__
    name = module.__spec__.name if module.__spec__ is not None else module.__name__
    lines = [(module.__doc__ or f"python -m {name}").strip(), "", f"flags of {name}:"]
    lines += _module_flags(own) if own else ["  (none)"]
    lines += ["", f"flags every launcher takes ({shared}):", *_module_flags(shared), ""]
    if not full:
        return "\n".join([*lines, "--helpfull lists absl's and the libraries' flags too."])
    for key in sorted(set(by_module) - {own, shared}):
        lines += [f"{key}:", *_module_flags(key), ""]
    return "\n".join(lines)


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing that turns every parse or config error into one line (exit 2)."""
    from absl import flags

    try:
        remaining = flags.FLAGS(argv)
        if "config" in flags.FLAGS and flags.FLAGS["config"].value is not None:
            flags.FLAGS["config"].value.to_dict()  # a config file that failed to load raises here
    except Exception as error:  # noqa: BLE001 - any parsing or config-loading failure becomes one line
        fail(_describe_parse_error(error, argv), code=EXIT_CONFIG)
    if "list_configs" in flags.FLAGS and flags.FLAGS.list_configs:
        return remaining  # needs neither --config nor --workdir
    for name in ("config", "workdir"):
        if name == "workdir" and "pretrained" in flags.FLAGS:
            continue  # the launcher reads one of --workdir and --pretrained (`one_source`)
        if name in flags.FLAGS and flags.FLAGS[name].value in (None, ""):
            fail(f"--{name} is required" + (" (and not empty)" if flags.FLAGS[name].present else ""), 2)
    return remaining


def one_source() -> str:
    """ "workdir" or "pretrained": which of the two flags of a launcher that reads either a run or
    a Hugging Face directory was given; exits 2 with one line unless exactly one was."""
    from absl import flags

    given = [name for name in ("workdir", "pretrained") if flags.FLAGS[name].value not in (None, "")]
    if len(given) != 1:
        which = "not both" if given else "one is required"
        fail(
            f"give --workdir (a run) or --pretrained (a Hugging Face checkpoint directory), {which}",
            code=EXIT_CONFIG,
        )
    return given[0]


def config_file_module(flag_name: str = "config") -> tuple[ModuleType, str | None]:
    """The config file of `--<flag_name>` as a module (for its `get_sweep`, say), and
    the text after ':' in the flag (None without one)."""
    from absl import flags
    from ml_collections import config_flags

    path, _, arg = config_flags.get_config_filename(flags.FLAGS[flag_name]).partition(":")
    spec = importlib.util.spec_from_file_location(f"{flag_name}_file", path)
    if spec is None or spec.loader is None:
        fail(f"--{flag_name}={path}: not a Python file", code=EXIT_CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, arg or None


def config_sweep(module: ModuleType, variant: str | None) -> Any:
    """The config file's `get_sweep(variant)`; a ConfigError when it refuses the variant."""
    from qkv_jax.training import ConfigError

    if not hasattr(module, "get_sweep"):
        raise ConfigError("--config: the config file has no get_sweep() giving the cells to train")
    try:
        return module.get_sweep(variant)
    except ValueError as error:
        raise ConfigError(f"--config: {error}") from None


# --- Errors while running ---------------------------------------------------------------------


# A collective whose peer process is gone: its connection closed, or it never came to set one up.
_PEER_GONE = re.compile(
    r"Gloo .*(Connection closed by peer|Connection reset by peer|GetKeyValue\(\) timed out)"
)


@contextlib.contextmanager
def training_errors() -> Iterator[None]:
    """What a training command can meet, each as one line and an exit code: 2 for a bad config
    or workdir, 75 (EX_TEMPFAIL) when stopped by SIGTERM/SIGINT after saving a checkpoint, 130
    when SIGINT interrupts it without one (a second Ctrl-C, or one while starting up), 1
    otherwise."""
    import jax

    from qkv_jax.training import CheckpointMismatchError, ConfigError
    from qkv_jax.training.memory import InsufficientMemoryError
    from qkv_jax.training.preemption import EXIT_PREEMPTED, Preempted
    from qkv_jax.training.workdir import DiskFullError, WorkdirBusyError
    from studies.sweep import CellsFailed

    try:
        yield
    except ConfigError as error:
        fail(str(error), code=EXIT_CONFIG)
    except Preempted as error:
        fail(str(error), code=EXIT_PREEMPTED)
    except (
        FloatingPointError,
        CheckpointMismatchError,
        WorkdirBusyError,
        InsufficientMemoryError,
        DiskFullError,
        CellsFailed,
    ) as error:
        fail(str(error))
    except KeyboardInterrupt:
        fail(
            "interrupted by SIGINT without a checkpoint of this moment (a second Ctrl-C, or one while "
            "starting up); the checkpoints saved before are kept: run the same command to resume",
            code=EXIT_INTERRUPTED,
        )
    except jax.errors.JaxRuntimeError as error:
        if _PEER_GONE.search(str(error)):  # met in a collective, before JAX's coordinator noticed
            sys.stderr.write(
                "error: another process of this run stopped (" + str(error).splitlines()[0] + "); "
                "this process stops too\n"
            )
            sys.stderr.flush()
            os._exit(1)  # JAX's exit handler would wait at a shutdown barrier the dead process never meets
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        reason = str(error).splitlines()[0].split("RESOURCE_EXHAUSTED:", 1)[-1].strip()
        fail(f"out of memory: {reason}; lower train.batch_size or the model's size")


# --- Devices and the compilation cache ---------------------------------------------------------


def initialize_devices(distributed: bool = True) -> None:
    """Simulated CPU devices and (with `distributed`) jax.distributed, from the flags; before
    any JAX work."""
    import jax
    from absl import flags

    FLAGS = flags.FLAGS
    if FLAGS.num_cpu_devices:
        jax.config.update("jax_num_cpu_devices", FLAGS.num_cpu_devices)
    if FLAGS.coordinator:
        if not 0 <= FLAGS.process_id < FLAGS.num_processes:
            fail(f"--process_id={FLAGS.process_id}: must be in [0, --num_processes={FLAGS.num_processes})", 2)
        if not distributed:
            return
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        filter_peer_failures()
        jax.distributed.initialize(
            coordinator_address=FLAGS.coordinator,
            num_processes=FLAGS.num_processes,
            process_id=FLAGS.process_id,
        )
    elif FLAGS.num_processes != 1:
        fail(f"--num_processes={FLAGS.num_processes} needs --coordinator host:port", 2)


def filter_peer_failures() -> None:
    """Routes this process's stderr through experiments/peer_failure.py, which turns JAX's fatal
    log for another process's death into one line (see that file for why a filter); called
    before `jax.distributed.initialize`. At exit (this handler runs before JAX's own, registered
    when jax was imported) stderr is pointed at /dev/null, so that the filter sees its end and
    writes what it holds (given up to 5 s); what JAX's exit handler logs after that is dropped."""
    import atexit
    import subprocess

    sys.stderr.flush()
    script = pathlib.Path(__file__).with_name("peer_failure.py")
    # -I: the filter imports nothing from this checkout, and no site packages.
    relay = subprocess.Popen(
        [sys.executable, "-I", str(script)], stdin=subprocess.PIPE, stdout=2, close_fds=True
    )
    assert relay.stdin is not None
    os.dup2(relay.stdin.fileno(), 2)
    relay.stdin.close()

    def drain() -> None:  # what JAX's own exit handler logs after this goes nowhere
        sys.stderr.flush()
        with open(os.devnull, "wb") as nowhere:
            os.dup2(nowhere.fileno(), 2)
        try:
            relay.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    atexit.register(drain)


def define_mesh_flag() -> None:
    """--mesh DATA,MODEL: a Hugging Face checkpoint, or a fine-tuning run's merged model, loaded
    split over a ("data", "model") mesh."""
    from absl import flags

    flags.DEFINE_string(
        "mesh",
        None,
        "DATA,MODEL (e.g. 2,4): load the model split over a (data, model) mesh of DATA x MODEL "
        "devices: a Hugging Face checkpoint read in each process's devices' slices, a fine-tuning "
        "run's newest checkpoint merged whole on each host, then split (docs/scaling.md).",
    )


def mesh_from_flag() -> Any:
    """The ("data", "model") mesh --mesh names (None without the flag); one line (exit 2) for a
    value that is not two positive integers or asks for more devices than exist. After
    `initialize_devices`."""
    import jax
    from absl import flags

    value = flags.FLAGS.mesh
    if value is None:
        return None
    parts = value.split(",")
    if len(parts) != 2 or not all(part.strip().isdigit() and int(part) > 0 for part in parts):
        fail(f"--mesh={value!r}: must be DATA,MODEL, two positive integers (e.g. 2,4)", code=2)
    data, model = (int(part) for part in parts)
    if data * model > jax.device_count():
        fail(f"--mesh={value!r}: asks for {data * model} devices; {jax.device_count()} exist", code=2)
    from qkv_jax.training.sharding import make_mesh

    return make_mesh(data, model)


def enable_compilation_cache(directory: str) -> None:
    """Turns on JAX's persistent compilation cache ('' leaves it off)."""
    if not directory:
        return
    import jax

    pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# --- What goes to stderr ----------------------------------------------------------------------


def _no_orbax_info(record: Any) -> bool:
    """orbax logs a dozen INFO lines per checkpoint; its warnings stay."""
    return record.levelno >= 30 or "orbax" not in record.pathname


def _one_line_logs() -> None:
    """Log records and Python warnings as one line each, `<level>: <message>`; absl's INFO off
    unless --verbosity was given; orbax's and JAX's INFO chatter dropped either way."""
    import logging

    from absl import flags
    from absl import logging as absl_logging

    if not flags.FLAGS["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.WARNING)

    class OneLine(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return f"{record.levelname.lower()}: " + " ".join(record.getMessage().split())

    absl_logging.get_absl_handler().setFormatter(OneLine())
    if _no_orbax_info not in logging.getLogger("absl").filters:
        logging.getLogger("absl").addFilter(_no_orbax_info)
    logging.getLogger("jax").setLevel(logging.WARNING)

    def show(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None):
        del filename, lineno, line
        print(f"warning: {' '.join(str(message).split())}", file=file or sys.stderr)

    warnings.showwarning = show


def run_main(main: Callable[[list[str]], Any], positional: int = 0, argv: list[str] | None = None) -> None:
    """`absl.app.run` with one-line errors for bad flags and configs, one-line logs and warnings,
    and refusing more than `positional` arguments that are not flags. `argv` (default
    sys.argv) is what a test passes to run a launcher in-process; ml_collections reads config
    overrides from sys.argv, so it is set to `argv` for the call."""
    from absl import app

    asked = _help_asked(sys.argv if argv is None else argv)
    if asked is not None:
        print(launcher_help(sys.modules[main.__module__], full=asked == "full"))
        sys.exit(0)

    def checked(argv: list[str]) -> Any:
        _one_line_logs()
        if len(argv) - 1 > positional:
            fail(f"unexpected arguments {argv[1 + positional :]}", code=EXIT_CONFIG)
        return main(argv)

    if argv is None:
        app.run(checked, flags_parser=parse_flags)
        return
    saved = sys.argv
    sys.argv = list(argv)
    try:
        app.run(checked, argv=list(argv), flags_parser=parse_flags)
    finally:
        sys.argv = saved


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
