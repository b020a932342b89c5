"""The one process-level trick the launchers play: tcmalloc instead of glibc's malloc.

glibc returns large freed buffers to the kernel after every call, and JAX then
spends much of its CPU time on page faults; tcmalloc keeps them
(benchmarks/attention.py and benchmarks/lm.py measure both allocators). A
library user gets the same with `LD_PRELOAD` (README, "Use qkv_jax in your
project").
"""

from __future__ import annotations

import os
import sys

TCMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)


def reexec_with_tcmalloc() -> None:
    """Re-executes a `python -m experiments.<launcher>` process with tcmalloc preloaded.

    Only when tcmalloc is installed (Debian/Ubuntu: apt-get install
    libtcmalloc-minimal4), JAX is not imported yet, and the process was started
    as a launcher (importing `experiments` from a test or a notebook never
    re-executes). Opt out with QKV_JAX_TCMALLOC=0.
    """
    launched = sys.orig_argv[1:3]
    if len(launched) < 2 or launched[0] != "-m" or not launched[1].startswith("experiments."):
        return
    if os.environ.get("QKV_JAX_TCMALLOC", "1") == "0" or "tcmalloc" in os.environ.get("LD_PRELOAD", ""):
        return
    library = next((p for p in TCMALLOC_PATHS if os.path.exists(p)), None)
    if library is None or "jax" in sys.modules:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = f"{library} {env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else library
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
