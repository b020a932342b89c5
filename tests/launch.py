"""Starting the launchers in a subprocess, as a user would from the repository root."""

import os
import pathlib

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
