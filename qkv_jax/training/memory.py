"""Will the compiled step fit? Its memory needs, from XLA, against what the device or host has.

`check_fits(compiled, ...)` runs before a compiled program's first call: XLA's
ahead-of-time `memory_analysis()` gives the bytes the program needs per device
(arguments, outputs, temporaries); on a GPU or TPU the device reports its free
memory, on the CPU the host's available memory counts (the least of
`MemAvailable`, the cgroup's limit and the address-space limit, `ulimit -v`).
A program that cannot fit raises `InsufficientMemoryError` with both numbers
and the config fields that drive them, instead of the allocator's
RESOURCE_EXHAUSTED traceback minutes later.
"""

from __future__ import annotations

import pathlib
import resource
from typing import Any

import jax

__all__ = ["InsufficientMemoryError", "needed_bytes", "available_bytes", "check_fits", "DRIVING_FIELDS"]

# Config fields that set a step's memory, named in the message when present.
DRIVING_FIELDS = ("train.batch_size", "task.seq_len", "model.max_len", "model.d_model", "model.num_layers")


class InsufficientMemoryError(MemoryError):
    """A compiled program needs more memory than the device or host has."""


def needed_bytes(compiled: Any) -> int | None:
    """Bytes one call of `compiled` needs on each device (None when the backend does not say)."""
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, jax.errors.JaxRuntimeError):
        return None
    if stats is None:
        return None
    parts = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes")
    total = sum(getattr(stats, name, 0) for name in parts) - getattr(stats, "alias_size_in_bytes", 0)
    return total + getattr(stats, "generated_code_size_in_bytes", 0)


def _meminfo_available() -> int | None:
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_available() -> int | None:
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = pathlib.Path(limit_file).read_text().strip()
            usage = int(pathlib.Path(usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            return int(limit) - usage
    return None


def _address_space_available() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return soft - int(line.split()[1]) * 1024
    return soft


def available_bytes(device: Any) -> int | None:
    """Free bytes for one more program on `device` (None when unknown)."""
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        return None
    known = [
        n for n in (_meminfo_available(), _cgroup_available(), _address_space_available()) if n is not None
    ]
    return min(known) if known else None


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def check_fits(compiled: Any, what: str, config: dict) -> None:
    """InsufficientMemoryError when `compiled` (run on every local device) cannot fit."""
    per_device = needed_bytes(compiled)
    devices = jax.local_devices()
    if per_device is None or not devices:
        return
    on_host = devices[0].platform == "cpu"  # simulated CPU devices share the host's memory
    needed = per_device * len(devices) if on_host else per_device
    available = available_bytes(devices[0])
    if available is None or needed <= available:
        return
    drivers = []
    for field in DRIVING_FIELDS:
        section, name = field.split(".")
        if name in (config.get(section) or {}):
            drivers.append(f"{field}={config[section][name]}")
    where = "the host has" if on_host else f"{devices[0].device_kind} has"
    raise InsufficientMemoryError(
        f"{what} needs {_gb(needed)} of memory but {where} {_gb(available)} available; "
        f"it grows with {', '.join(drivers) or 'the batch and the model'}"
    )
