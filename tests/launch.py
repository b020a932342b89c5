"""Starting the launchers in a subprocess, as a user would from the repository root."""

import json
import os
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def launcher_env(**extra: str) -> dict:
    """os.environ with the repository root put in front of PYTHONPATH (what is already there, e.g.
    packages installed with `pip install --target`, stays), the launchers' default
    --compilation_cache pointed at the test session's cache (so a command that names none, as the
    guides' do, reuses what the session compiled), plus `extra`."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    cache = os.environ.get("QKV_JAX_TEST_COMPILATION_CACHE")
    return {
        **os.environ,
        "PYTHONPATH": path,
        **({"QKV_JAX_COMPILATION_CACHE": cache} if cache else {}),
        **extra,
    }


def cache_flag() -> str:
    """The launchers' --compilation_cache pointed at the test session's cache (conftest's
    `compilation_cache` fixture); empty (off) outside a test session."""
    return "--compilation_cache=" + os.environ.get("QKV_JAX_TEST_COMPILATION_CACHE", "")


def free_port() -> int:
    """A TCP port nothing listens on now (a jax.distributed coordinator's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_together(
    commands: list[list[str]], timeout: float
) -> tuple[list[subprocess.Popen], list[tuple[str, str]]]:
    """Every command started at once from the repository root with `launcher_env` (the processes
    of one jax.distributed job), then waited for: (the processes, their (stdout, stderr)). Any
    still running after `timeout` seconds is killed."""
    processes = [
        subprocess.Popen(
            command, cwd=ROOT, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for command in commands
    ]
    try:
        outputs = [p.communicate(timeout=timeout) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    return processes, outputs


def two_processes(
    script: pathlib.Path, spec: dict, timeout: float
) -> tuple[list[subprocess.Popen], list[tuple[str, str]]]:
    """`script` run as processes 0 and 1 of one jax.distributed job, each given `spec` as JSON with
    the coordinator's address and its process id added: (the processes, their (stdout, stderr));
    both killed if they outlive `timeout` seconds."""
    port = free_port()
    commands = [
        [sys.executable, str(script), json.dumps({**spec, "coordinator": f"127.0.0.1:{port}", "process": i})]
        for i in range(2)
    ]
    return run_together(commands, timeout)
