"""Shared by the benchmark scripts: machine description, medians, result files."""

from __future__ import annotations

import json
import os
import pathlib
import platform
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
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
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
    return info


def median(values):
    return statistics.median(values)


def write_results(name: str, command: str, data: dict) -> pathlib.Path:
    """Writes benchmarks/results/<name>.json with the command that made it."""
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
