"""Shared fixtures. Test data lives in tests/data (a user's clone has no ../shared)."""

import gc
import json
import os
import pathlib
import subprocess
import sys

# XLA:CPU's backend (LLVM) at its lowest optimization level and its fusion emitters off, here
# and in every launcher the tests start (they inherit the environment; a run's own
# train.cpu_optimization_level still decides its compiled training programs). The suite's
# programs are tiny and most are run a few times, so compiling them is most of its time: on the
# fast tier of tests/lm/test_lm.py and tests/modules/test_modules.py level 0 cut the CPU time
# from 59.6 s to 32.1 s; the fusion emitters off then cut tests/attention/test_attention_variants.py,
# tests/peers/test_jax_nn_attention.py and tests/interpretability/test_activation_cache.py from
# 96.5 s to 54.8 s (2 workers). What the tests check does not depend on it (each compares
# programs compiled the same way, or a float64 reference within float32 tolerances); users'
# programs keep XLA's default. jaxlib 0.12's XLA has no fusion emitters' flag, and an unknown
# flag in XLA_FLAGS aborts the process: a child process tries it first (about a second), unless
# XLA_FLAGS holds it already, as the xdist workers' do (they inherit this process's).
LEVEL_0 = "--xla_backend_optimization_level=0"
FUSION_EMITTERS_OFF = "--xla_cpu_use_fusion_emitters=false"


def _xla_takes(flag):
    probe = "import jax; jax.numpy.zeros(1).block_until_ready()"
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=300)
    return result.returncode == 0


_flags = os.environ.get("XLA_FLAGS", "").split()
if LEVEL_0 not in _flags:
    _flags.append(LEVEL_0)
if FUSION_EMITTERS_OFF not in _flags and _xla_takes(FUSION_EMITTERS_OFF):
    _flags.append(FUSION_EMITTERS_OFF)
os.environ["XLA_FLAGS"] = " ".join(_flags)

import jax  # noqa: E402 - after XLA_FLAGS, which the backend reads when it starts
import pytest  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data"

# Float32 matmuls at full float32 precision for the whole session. On Ampere and newer
# GPUs JAX's default precision runs them in TF32 (10-bit mantissa: errors ~6e-4 seen on an
# H200), which the float32 tolerances here (1e-5 against float64 references) are not
# meant to absorb; on CPU this changes nothing. One pin here rather than `precision=`
# in every test: it also covers models, training steps and interop code that the tests
# drive without a precision argument. Tests of `precision=` itself pass other values.
jax.config.update("jax_default_matmul_precision", "highest")
# As jax's own test harness runs: broadcasting only where the code asks for it (an array of
# lower rank never meets a higher one silently), and JAX's internal type checks of traced
# programs (custom VJPs' cotangents, loop carries) on (but see `internal_checks`).
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_enable_checks", True)


@pytest.fixture(autouse=True)
def internal_checks(request):
    """jax_enable_checks is on for every test of the full suite but those marked slow as
    end-to-end runs (a study, a launcher, a training run), which trace the functions the other
    tests check: there the checks cost ~10% of the time (the windows study: 78 s with them, 69 s
    without). The fast tier runs without them (pytest_configure)."""
    end_to_end = request.node.get_closest_marker("slow") is not None and request.node not in REPEATED_CASES
    if not end_to_end or not jax.config.jax_enable_checks:
        yield
        return
    jax.config.update("jax_enable_checks", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_checks", True)


@pytest.fixture(autouse=True)
def empty_gpu_check_record(monkeypatch):
    """Every test sees the dispatch rule of an empty GPU check record: what
    benchmarks/gpu_check.sh has passed on a GPU (qkv_jax/attention/gpu_checked.py) moves calls
    to cuDNN or the fused kernels there, and the tests of that record set it themselves. Here
    rather than in a conftest of tests/attention: a second module named conftest would shadow
    this one for the tests that import it."""
    from qkv_jax.attention import dispatch

    monkeypatch.setattr(dispatch, "CHECKED", {})


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """JAX's persistent compilation cache, fresh for each test session and shared by its
    xdist workers (pytest's session directory): many tests compile the same small
    programs (a 2-layer model's training chunk is ~5 s of XLA:CPU compile, ~1 s from the
    cache). Subprocess launches get it through `tests.launch.CACHE_FLAG`'s variable."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's own
    path = root / "jax-compilation-cache"
    path.mkdir(exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    os.environ["QKV_JAX_TEST_COMPILATION_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def walkthrough():
    """Reference numbers for a six-token self-attention walkthrough ('The cat sat on the mat')."""
    return json.loads((DATA / "cat_sat_mat_walkthrough.json").read_text())


# --- The reliability catalogue (docs/reliability.md) ----------------------------------
# A test marked @pytest.mark.reliability(area, case, behaviour) is one catalogue row.
RELIABILITY_CASES: list[dict] = []
COLLECTED_FILES: set[str] = set()


def pytest_make_parametrize_id(config, val, argname):
    """A string parameter longer than 100 characters is named by its first 100, whatever the
    pytest version: pytest 9.1 started naming such parameters by the argument's name and
    index instead, which changed test ids (and docs/reliability.md, which lists them) with
    the installed version."""
    if isinstance(val, str) and len(val) > 100:
        return val[:100].encode("unicode_escape").decode("ascii")
    return None


def pytest_collection_finish(session):
    """Python's garbage collector, after collection, leaves the objects alive then (the imported
    modules: jax, flax, the tests) out of its scans, collects the young objects every 10,000
    allocations instead of 700, and scans everything a tenth as often: tracing allocates many
    short-lived objects, and each full scan walked the whole heap.
    On the fast tier of tests/lm and tests/modules (2 workers) the collector's time per worker
    fell from 6.1-6.7 s to 3.0 s, and back-to-back runs took 57.8 s against 62.0 s and 50.8 s
    against 53.2 s, at the same peak memory (1.9 GB). Garbage is still collected, less often; only
    what was alive when collection finished is never scanned again."""
    gc.freeze()
    gc.set_threshold(10_000, 10, 100)


def pytest_configure(config):
    config.addinivalue_line("markers", "reliability(area, case, behaviour): a row of docs/reliability.md")
    # The fast tier (-m "not slow") runs without jax_enable_checks, its module fixtures included:
    # they cost 12% of its time (222.5 s with them, 195.3 s without, on 2 cores), and every test
    # it runs runs with them in the full suite, which is what CI runs.
    if (config.getoption("markexpr", "") or "").replace(" ", "") == "notslow":
        jax.config.update("jax_enable_checks", False)


# The fast tier (-m "not slow") runs every test function outside tests/launchers/ (runs through
# the launchers, end to end) that needs no browser, but of a parametrized function only the
# first case: the other cases (another dtype, path or layout of the same check) carry the
# `slow` mark and run in the full suite, as do the tests that drive Chromium (the `browser`
# fixture: a browser process per module, ~1.7 s a test). On 2 CPU cores the first-case rule
# halved the fast tier's test time (812 s -> about 450 s, at three or more cases); two cases
# and the browser tests cut it from 446 s to 385 s; the launchers' tests were a further 25 s.
FAST_TIER_CASES = 2


# The tests mark_slow_outside_the_fast_tier marked that keep jax_enable_checks (not end-to-end runs).
REPEATED_CASES: set = set()


def mark_slow_outside_the_fast_tier(items) -> None:
    cases: dict[tuple, list] = {}
    for item in items:
        key = (item.path, getattr(item, "cls", None), getattr(item, "originalname", item.name))
        cases.setdefault(key, []).append(item)
        if item.path.parent.name == "launchers":  # runs through the launchers: end to end
            item.add_marker(pytest.mark.slow)
        elif "browser" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
            REPEATED_CASES.add(item)
    for group in cases.values():
        if len(group) >= FAST_TIER_CASES:
            for item in group[1:]:
                item.add_marker(pytest.mark.slow)
                REPEATED_CASES.add(item)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Records every reliability case, and marks the fast tier's repeated cases slow, before
    -m/-k deselect anything."""
    mark_slow_outside_the_fast_tier(items)
    RELIABILITY_CASES.clear()
    COLLECTED_FILES.clear()
    for item in items:
        COLLECTED_FILES.add(item.path.name)
        for mark in item.iter_markers("reliability"):
            area, case, behaviour = mark.args
            RELIABILITY_CASES.append(
                {"area": area, "case": case, "behaviour": behaviour, "test": item.nodeid}
            )
    target = os.environ.get("QKV_JAX_RELIABILITY_CATALOGUE")
    if target:
        pathlib.Path(target).write_text(json.dumps(RELIABILITY_CASES, indent=1))
