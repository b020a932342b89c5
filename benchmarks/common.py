"""Shared by the benchmark scripts: machine description, medians, result files."""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time

RESULTS = pathlib.Path(__file__).parent / "results"
ROOT = pathlib.Path(__file__).resolve().parents[1]


def machine() -> dict:
    """CPU model, core count, memory, Python and library versions."""
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    try:
        info.update(cpu_identity(pathlib.Path("/proc/cpuinfo").read_text()))
        meminfo = pathlib.Path("/proc/meminfo").read_text().split()
        info["memory_gib"] = round(int(meminfo[meminfo.index("MemTotal:") + 1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    for name in ("jax", "jaxlib", "flax", "optax", "torch"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    info["LD_PRELOAD"] = os.environ.get("LD_PRELOAD", "")
    info["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "")
    info["GLIBC_TUNABLES"] = os.environ.get("GLIBC_TUNABLES", "")
    return info


def cpu_identity(cpuinfo: str) -> dict:
    """The first CPU's model name, family/model numbers and widest vector ISA, from /proc/cpuinfo.

    A virtual machine's model name can be as vague as "AMD EPYC": the family and model numbers
    tell its generations apart (family 25 model 1 is Zen 3, model 17 Zen 4), and AVX-512 changes
    both XLA's and torch's CPU kernels, so results from two such machines are not comparable.
    """
    fields = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    info = {}
    if "model name" in fields:
        info["cpu"] = fields["model name"]
    if "cpu family" in fields and "model" in fields:
        info["cpu_model"] = f"family {fields['cpu family']} model {fields['model']}"
    flags = set(fields.get("flags", "").split())
    isa = next((name for name in ("avx512f", "avx2", "avx", "sse4_2") if name in flags), None)
    if isa:
        info["cpu_isa"] = isa
    return info


def median(values):
    return statistics.median(values)


def write_results(name: str, command: str, data: dict) -> pathlib.Path:
    """Writes benchmarks/results/<name>.json with the command that made it (prefixed with the
    GLIBC_TUNABLES it ran under, which change the allocator's behaviour for the process)."""
    if os.environ.get("GLIBC_TUNABLES"):
        command = f"GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']} {command}"
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    record = {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        **data,
    }
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path


def run_timed(args: list[str], env: dict | None = None, cwd: pathlib.Path = ROOT) -> tuple[float, str]:
    """Runs a command; returns (wall seconds, stdout). Raises on failure."""
    started = time.perf_counter()
    result = subprocess.run(args, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{result.stderr[-2000:]}")
    return elapsed, result.stdout


def last_json_line(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


PYTHON = sys.executable


def hlo_op_names(hlo_text: str) -> dict[str, list[str]]:
    """Each instruction of a compiled module's text (`Compiled.as_text()`) -> the `op_name`
    metadata of it and, for a fusion, of every instruction of the computation it calls.

    The names of the events a `jax.profiler` trace records for XLA:CPU are these
    instruction names, so the JAX name stack (module paths, `jax.named_scope`s)
    tells what each event computes.
    """
    instruction = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
    computation_ops: dict[str, list[str]] = {}
    calls: dict[str, tuple[str | None, str | None]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            header = re.match(r"^(?:ENTRY )?%?([\w.\-]+)", line)
            current = header.group(1) if header else None
            continue
        match = instruction.match(line)
        if not match:
            continue
        op_name = re.search(r'op_name="([^"]*)"', line)
        called = re.search(r"calls=%([\w.\-]+)", line)
        if op_name and current is not None:
            computation_ops.setdefault(current, []).append(op_name.group(1))
        calls[match.group(1)] = (op_name.group(1) if op_name else None, called.group(1) if called else None)
    names = {}
    for name, (op_name, called) in calls.items():
        names[name] = ([op_name] if op_name else []) + computation_ops.get(called or "", [])
    return names


def profile_events(run, trace_dir: str) -> tuple[dict[str, float], float]:
    """Runs `run()` under `jax.profiler.trace`; returns (seconds per XLA:CPU event name, summed
    over the run; seconds the executor was busy, summed over the program's executions)."""
    import jax

    with jax.profiler.trace(trace_dir):
        run()
    (path,) = sorted(pathlib.Path(trace_dir).glob("plugins/profile/*/*.trace.json.gz"))[-1:]
    events = [e for e in json.loads(gzip.decompress(path.read_bytes()))["traceEvents"] if e.get("ph") == "X"]
    busy = sum(e["dur"] for e in events if e["name"] == "ThunkExecutor::Execute (wait for completion)")
    seconds: dict[str, float] = {}
    for event in events:
        seconds[event["name"]] = seconds.get(event["name"], 0.0) + event["dur"] / 1e6
    return seconds, busy / 1e6
