r"""Attention time and memory: our paths against jax.nn, Flax and PyTorch.

  python benchmarks/attention.py --library-user [--quick] [--shard-map]  # as `import qkv_jax` meets it
  python benchmarks/attention.py                            # the full CPU run (1-2 hours on 2 cores)
  python benchmarks/attention.py --lengths 128,512 --quick  # a few minutes
  python benchmarks/attention.py --tune-blocks --lengths 1024,2048
  python benchmarks/attention.py --window                   # local window vs full causal (minutes)
  python benchmarks/attention.py --gpu [--dry-run]          # benchmarks/gpu.sh; --dry-run: tiny, any device
  python benchmarks/attention.py --gpu-check [--dry-run] [--out FILE]  # benchmarks/gpu_check.sh

CPU run: batch 8, 8 heads, head dim 64, float32, T = S in --lengths (default
64, the dispatch threshold, and 128 to 8192), causal
and not, forward and forward+backward (the gradient of half the output's
squared norm with respect to query, key and value: training needs the output,
and the gradient of a plain sum would let XLA skip the forward's last matmul):
  default    qkv_jax.dot_product_attention (implementation=None)
  chunked, reference, xla   the same with that implementation
  jax.nn     jax.nn.dot_product_attention
  flax       flax.linen.dot_product_attention (causal as a boolean mask)
  torch      torch.nn.functional.scaled_dot_product_attention in its [B, N, T, H]
             layout, torch.set_num_threads equal to the CPU threads JAX uses.
Lengths below --long-from run in one process, interleaved: after one compiling
call of every case, each round times one call of every case (the
implementations of a case in a new random order, every call after 0.5 s of
rest); medians over rounds. Each longer case runs in a fresh process (a warm-up call, then
--long-rounds timed calls) that reports its peak resident memory (ru_maxrss);
a case whose T x S buffers would not fit in --max-gib is skipped and says so.
All of it runs with tcmalloc preloaded (as the launchers do) and with glibc's
malloc, when tcmalloc is installed. GFLOP/s count useful work: forward
4 B N T S H times the share of allowed (query, key) pairs, backward 2.5 times
that, recomputation not counted. The ceiling is the measured float32 matmul
rate (2048 x 2048) of JAX and of PyTorch on the same threads.

Library-user run (--library-user): what a researcher who does `import qkv_jax`
in their own program gets, in this one process with whatever allocator and
XLA flags it was started with (glibc's malloc and none, unless the environment
says otherwise; the results record both) and JAX's one CPU device. B8 N8 H64
float32, T = S in --lengths (default 128, 512, 2048, 4096, 8192; --quick: 128,
512, 2048, about 2 minutes; the full set about 15), causal and not, forward
and forward+backward, side by side:
  qkv_jax    qkv_jax.dot_product_attention(q, k, v, is_causal=...) as it comes
             (it jits itself); the backward through an eager `jax.vjp`,
             pulling back the output as the cotangent
  jax.nn     jax.jit(jax.nn.dot_product_attention), the same way; up to T 2048
             (512 with --quick) and where its T x S buffers fit in memory
  torch      torch's SDPA, [B, N, T, H], on as many threads as JAX has cores
and at T <= 128 also qkv_jax's other paths (implementation="reference", "xla",
"chunked"), for the ratio to the fastest JAX path. Each case's calls run
interleaved in a new random order per round after a warm-up call each (3
rounds, 5x that at T <= 128, 2x at T 512, at most 2 from T 4096 on); medians,
and every time as a ratio to torch's.
Writes benchmarks/results/attention_library_user.json. With --shard-map the
process gets one CPU device per core and the default also runs inside
`jax.shard_map` over heads (the one lever that puts XLA:CPU's second core to
work inside a single attention call; attention_library_user_shard_map.json).

GPU run (--gpu): the cases that matter first (bf16 causal forward+backward at
T 4096 and 16384 with B4 N16 H128, then forward, full attention, B8 T1024 N16
H64, padding by lengths, a bias, a boolean mask, causal T != S, float32), each
through our default path, jax.nn's cuDNN kernel called directly with the same
masking, and torch's SDPA on CUDA in the same process; every time is per call
with dispatch amortised (calls queued back to back in each timed region).
TFLOP/s and the share of the H200's dense peak per cell; new cases stop after
--budget-s. --gpu-check: every kind of call the dispatch rule sends to cuDNN,
outputs and gradients against the reference path on the device.

Local-window run (--window): the chunked path, causal, with
`local_window_size=(256, 0)` against without, B1 N8 H64 float32 at T = S in
--lengths (default 2048, 8192), forward and forward+backward, in this one
process: the window's tiles are all the kernel computes, so its cost grows as
T x 256 instead of T^2 / 2. Each timed region queues 3 calls; medians over 5
interleaved rounds.

Writes benchmarks/results/attention.json (attention_blocks.json with
--tune-blocks, attention_gpu.json with --gpu, attention_window.json with
--window); `python -m benchmarks.report` renders docs/benchmarks.md from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.common import PYTHON, ROOT, last_json_line, write_results  # noqa: E402
from experiments.common import TCMALLOC_PATHS  # noqa: E402

BATCH, HEADS, HEAD_DIM = 8, 8, 64
CPU_IMPLS = ("default", "chunked", "reference", "xla", "jax.nn", "flax", "torch")
OURS = ("default", "chunked", "reference", "xla")
MATERIALISING = ("reference", "xla", "jax.nn", "flax")  # hold [B, N, T, S] buffers
PASSES = ("fwd", "fwd+bwd")
# Peak resident memory of the materialising paths in float32 [B, N, T, S] buffers: jax.nn
# peaked at 5.7 GiB forward and 11.3 GiB with backward at T = 2048 (1 GiB per buffer).
BUFFERS_NEEDED = {"fwd": 6, "fwd+bwd": 12}


# ----------------------------------------------------------------------------- measuring


def useful_flops(T, S, causal, pass_, batch=BATCH, heads=HEADS, head_dim=HEAD_DIM) -> float:
    """4 B N T S H times the share of allowed pairs; backward counts 2.5x forward."""
    allowed = sum(max(0, min(S, t + 1 + S - T)) for t in range(T)) if causal else T * S
    return 4.0 * batch * heads * head_dim * allowed * (3.5 if pass_ == "fwd+bwd" else 1.0)


def materialised_gib(T: int, pass_: str, batch=BATCH, heads=HEADS) -> float:
    """Memory a path that holds float32 [B, N, T, T] buffers needs, in GiB."""
    return BUFFERS_NEEDED[pass_] * batch * heads * T * T * 4 / 2**30


def cpu_threads() -> int:
    return len(os.sched_getaffinity(0))


def peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


PAUSE_S = 0.5  # rest before each timed call: a call right after PyTorch's backward ran 1.7x slower


def timed(run) -> float:
    """Seconds one call of `run` takes, after PAUSE_S of rest.

    Thread pools stay busy for a few hundred milliseconds after their work; on
    a 2-core machine that slows whatever runs next.
    """
    time.sleep(PAUSE_S)
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def jax_attention(impl: str, causal: bool, T: int, S: int):
    """f(query, key, value) in jax.nn's [B, T, N, H] layout."""
    import functools

    import flax.linen as nn
    import jax

    import qkv_jax

    if impl in OURS:
        implementation = None if impl == "default" else impl
        return functools.partial(
            qkv_jax.dot_product_attention, is_causal=causal, implementation=implementation
        )
    if impl in ("jax.nn", "jax.nn-cudnn"):
        backend = "cudnn" if impl == "jax.nn-cudnn" else None
        return functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation=backend)
    if impl == "flax":
        mask = qkv_jax.causal_mask(T, S)[None, None] if causal else None  # (1, 1, T, S)
        return lambda q, k, v: nn.dot_product_attention(q, k, v, mask=mask, deterministic=True)
    raise ValueError(f"unknown JAX implementation {impl!r}")


def half_square_sum(output):
    import jax.numpy as jnp

    return 0.5 * jnp.sum(jnp.square(output.astype(jnp.float32)))


def jax_step(attend, pass_: str):
    """`attend` jitted, or the jitted gradient of half_square_sum(attend) w.r.t. q, k, v."""
    import jax

    if pass_ == "fwd":
        return jax.jit(attend)
    return jax.jit(jax.grad(lambda q, k, v: half_square_sum(attend(q, k, v)), (0, 1, 2)))


def jax_inputs(T, S, dtype="float32", batch=BATCH, heads=HEADS, head_dim=HEAD_DIM):
    """Standard normal query, key, value, `[B, T|S, N, H]`."""
    import jax

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    shapes = [(batch, n, heads, head_dim) for n in (T, S, S)]
    return [jax.random.normal(k, shape, dtype) for k, shape in zip(keys, shapes, strict=True)]


def torch_runner(causal: bool, pass_: str, T: int):
    """A zero-argument callable running PyTorch's SDPA once, as the JAX steps do."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(cpu_threads())
    generator = torch.Generator().manual_seed(0)
    query, key, value = (
        torch.randn(BATCH, HEADS, T, HEAD_DIM, generator=generator, requires_grad=True) for _ in range(3)
    )  # (B, N, T, H), its native layout

    def forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(query, key, value, is_causal=causal)

    def forward_backward():
        for x in (query, key, value):
            x.grad = None
        output = F.scaled_dot_product_attention(query, key, value, is_causal=causal)
        (0.5 * output.square().sum()).backward()

    return forward if pass_ == "fwd" else forward_backward


def make_runner(impl: str, causal: bool, pass_: str, T: int):
    """A zero-argument callable that runs one case once and waits for it."""
    if impl == "torch":
        return torch_runner(causal, pass_, T)
    import jax

    step, inputs = jax_step(jax_attention(impl, causal, T, T), pass_), jax_inputs(T, T)
    return lambda: jax.block_until_ready(step(*inputs))


def matmul_gflops(rounds: int = 5, n: int = 2048) -> dict:
    """Measured float32 n x n matmul rate of JAX and of PyTorch, median of rounds."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n))
    matmul = jax.jit(jnp.matmul)
    runners = {"jax": lambda: jax.block_until_ready(matmul(a, a))}
    try:
        import torch

        torch.set_num_threads(cpu_threads())
        b = torch.randn(n, n)
        runners["torch"] = lambda: b @ b
    except ImportError:
        pass
    rates = {}
    for name, run in runners.items():
        run()
        rates[name] = 2 * n**3 / statistics.median(timed(run) for _ in range(rounds)) / 1e9
    return rates


def interleaved_medians(runners: dict, rounds: int, group: int) -> dict:
    """Times every runner once per round; returns the list of times for each.

    Runners come in groups of `group` (the implementations of one case); each
    round runs a group in a new random order, so none always follows the same one.
    """
    cases = list(runners)
    for case in cases:
        runners[case]()  # compile and warm up
    times = {case: [] for case in cases}
    order = random.Random(0)
    for _ in range(rounds):
        for start in range(0, len(cases), group):
            block = cases[start : start + group]
            for case in order.sample(block, len(block)):
                times[case].append(timed(runners[case]))
    return times


# ----------------------------------------------------------------------------- workers


def short_worker(args) -> dict:
    """Every case of the short lengths in this process, interleaved."""
    runners = {
        (T, causal, pass_, impl): make_runner(impl, causal, pass_, T)
        for T in args.lengths
        for causal in (False, True)
        for pass_ in PASSES
        for impl in args.impls
    }
    times = interleaved_medians(runners, args.rounds, group=len(args.impls))
    cases = [
        dict(T=T, causal=causal, pass_=pass_, impl=impl, times_s=times[(T, causal, pass_, impl)])
        for T, causal, pass_, impl in runners
    ]
    return {"cases": cases, "matmul_gflops": matmul_gflops(), "threads": cpu_threads()}


def long_worker(args) -> dict:
    """One case in this fresh process: a warm-up call, timed calls, peak memory."""
    T, causal, pass_, impl = args.case
    run = make_runner(impl, causal, pass_, T)
    run()
    times = [timed(run) for _ in range(args.long_rounds)]
    return dict(T=T, causal=causal, pass_=pass_, impl=impl, times_s=times, peak_rss_gib=peak_rss_gib())


def baseline_worker(args) -> dict:
    """Peak memory of a process that imports JAX and qkv_jax and makes the inputs."""
    import jax

    import qkv_jax  # noqa: F401

    jax.block_until_ready(jax_inputs(args.lengths[0], args.lengths[0]))
    return {"peak_rss_gib": peak_rss_gib()}


WORKERS = {"short": short_worker, "long": long_worker, "baseline": baseline_worker}


# ----------------------------------------------------------------------------- CPU driver


def tcmalloc_path() -> str | None:
    return next((p for p in TCMALLOC_PATHS if os.path.exists(p)), None)


def run_worker(worker_args: list[str], allocator: str) -> dict:
    """Runs this script as a worker under `allocator`; its JSON line, or {"error": ...}."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QKV_JAX_TCMALLOC": "0"}
    env.pop("LD_PRELOAD", None)
    if allocator == "tcmalloc":
        env["LD_PRELOAD"] = tcmalloc_path()
    command = [PYTHON, __file__, *worker_args]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode == 0:
        return last_json_line(result.stdout)
    killed = result.returncode in (-9, 137)
    last_line = (result.stderr.strip().splitlines() or [""])[-1]
    return {"error": "killed (out of memory?)" if killed else f"exit {result.returncode}: {last_line}"}


def needs_too_much(impl: str, T: int, pass_: str, max_gib: float) -> bool:
    """Whether a materialising path's T x T buffers would exceed max_gib."""
    import jax

    from qkv_jax.attention import select_implementation

    path = impl
    if impl == "default":
        shape = jax.ShapeDtypeStruct((BATCH, T, HEADS, HEAD_DIM), "float32")
        path = select_implementation(shape, shape, shape, platform="cpu")
    return path in MATERIALISING and materialised_gib(T, pass_) > max_gib


def available_gib() -> float:
    meminfo = pathlib.Path("/proc/meminfo").read_text().split()
    return int(meminfo[meminfo.index("MemAvailable:") + 1]) / 2**20


def shared_worker_args(args) -> list[str]:
    rounds = ["--rounds", str(args.rounds), "--long-rounds", str(args.long_rounds)]
    return ["--impls", ",".join(args.impls), *rounds]


def measure_long(args, allocator: str, T: int) -> list[dict]:
    """The cases of one long length, each in its own worker process."""
    records = []
    for causal in (False, True):
        for pass_ in PASSES:
            for impl in args.impls:
                record = dict(T=T, causal=causal, pass_=pass_, impl=impl)
                if needs_too_much(impl, T, pass_, args.max_gib):
                    record["skipped"] = f"needs about {materialised_gib(T, pass_):.0f} GiB"
                else:
                    case = f"{T},{int(causal)},{pass_},{impl}"
                    record.update(
                        run_worker(["--worker", "long", "--case", case, *shared_worker_args(args)], allocator)
                    )
                records.append(record)
                outcome = record.get("skipped") or record.get("error") or cell(record)
                print(f"[{allocator}] T={T} causal={causal} {pass_} {impl}: {outcome}", file=sys.stderr)
    return records


def measure(args, allocator: str) -> tuple[list[dict], dict]:
    """All cases under one allocator: the case records and facts about the run."""
    short = [T for T in args.lengths if T < args.long_from]
    long = [T for T in args.lengths if T >= args.long_from]
    records, facts = [], {}
    if short:
        lengths = ",".join(map(str, short))
        out = run_worker(["--worker", "short", "--lengths", lengths, *shared_worker_args(args)], allocator)
        if "error" in out:
            raise SystemExit(f"the short cases under {allocator} failed: {out['error']}")
        records += out["cases"]
        facts.update(matmul_gflops=out["matmul_gflops"], threads=out["threads"])
    if long:
        baseline = run_worker(["--worker", "baseline", "--lengths", str(long[0])], allocator)
        facts["baseline_rss_gib"] = baseline.get("peak_rss_gib")
    for T in long:
        records += measure_long(args, allocator, T)
    return records, facts


def median_s(record: dict) -> float | None:
    return statistics.median(record["times_s"]) if record.get("times_s") else None


def cell(record: dict | None) -> str:
    """'12.3 ms (45 GFLOP/s, 0.61 GiB)' or why there is no number."""
    if record is None:
        return "-"
    if "skipped" in record:
        return f"skipped ({record['skipped']})"
    if "error" in record:
        return f"failed ({record['error']})"
    seconds = median_s(record)
    rate = useful_flops(record["T"], record["T"], record["causal"], record["pass_"]) / seconds / 1e9
    memory = f", {record['peak_rss_gib']:.2f} GiB" if "peak_rss_gib" in record else ""
    return f"{seconds * 1000:.1f} ms ({rate:.0f} GFLOP/s{memory})"


def time_table(records: list[dict], impls: list[str]) -> list[str]:
    lines = ["| T = S | mask | pass | " + " | ".join(impls) + " |", "|---|---|---|" + "---|" * len(impls)]
    index = {(r["T"], r["causal"], r["pass_"], r["impl"]): r for r in records}
    for T in sorted({r["T"] for r in records}):
        for causal in (False, True):
            for pass_ in PASSES:
                cells = " | ".join(cell(index.get((T, causal, pass_, impl))) for impl in impls)
                lines.append(f"| {T} | {'causal' if causal else 'none'} | {pass_} | {cells} |")
    return lines


def acceptance_ratios(records: list[dict], allocator: str) -> dict:
    """The headline figures: time ratios (above 1: the first is slower) and peaks."""

    def key(r):
        return r["T"], r["causal"], r["pass_"], r["impl"]

    seconds = {key(r): median_s(r) for r in records if median_s(r)}
    peaks = {key(r): r["peak_rss_gib"] for r in records if "peak_rss_gib" in r}
    ratios = {}

    def put(name, value):
        if value is not None:
            ratios[f"{allocator}: {name}"] = value

    def over(a, b, T, causal, pass_):
        ta, tb = seconds.get((T, causal, pass_, a)), seconds.get((T, causal, pass_, b))
        return ta / tb if ta and tb else None

    put("T=4096 causal fwd+bwd chunked time / torch", over("chunked", "torch", 4096, True, "fwd+bwd"))
    put("T=4096 causal fwd+bwd chunked peak GiB", peaks.get((4096, True, "fwd+bwd", "chunked")))
    put("T=4096 causal fwd+bwd torch peak GiB", peaks.get((4096, True, "fwd+bwd", "torch")))
    for causal in (False, True):
        mask = "causal" if causal else "full"
        for first, second in (("jax.nn", "default"), ("default", "torch")):
            name = f"T=2048 {mask} fwd+bwd {first} time / {second}"
            put(name, over(first, second, 2048, causal, "fwd+bwd"))
        for pass_ in PASSES:
            jax_paths = [
                seconds[(128, causal, pass_, i)]
                for i in MATERIALISING + ("chunked",)
                if (128, causal, pass_, i) in seconds
            ]
            default = seconds.get((128, causal, pass_, "default"))
            if default and jax_paths:
                put(f"T=128 {mask} {pass_} default time / fastest JAX path", default / min(jax_paths))
    return ratios


def cpu_main(args) -> None:
    data = {"batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32", "allocators": {}}
    table, ratios = [], {}
    for allocator in args.allocators:
        records, facts = measure(args, allocator)
        data["allocators"][allocator] = {"records": records, **facts}
        preload = tcmalloc_path() if allocator == "tcmalloc" else ""
        ceiling = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in facts.get("matmul_gflops", {}).items())
        baseline = facts.get("baseline_rss_gib")
        table += [
            f"**{allocator}** (`LD_PRELOAD={preload}`): median ms (useful GFLOP/s; peak resident GiB "
            f"for T >= {args.long_from}, each in a fresh process)."
            + (f" Float32 matmul ceiling: {ceiling}." if ceiling else "")
            + (
                f" A process that only imports and makes the inputs peaks at {baseline:.2f} GiB."
                if baseline
                else ""
            ),
            "",
            *time_table(records, args.impls),
            "",
        ]
        ratios.update(acceptance_ratios(records, allocator))
    print("\n".join(table))
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    command = "python benchmarks/attention.py " + " ".join(sys.argv[1:])
    title = "Attention on CPU" + ("" if args.name == args.default_name else f" ({args.name})")
    path = write_results(
        args.name, command.strip(), {"title": title, **data, "table": table, "ratios": ratios}
    )
    print(f"wrote {path.relative_to(ROOT)}")


# ----------------------------------------------------------------------------- library user

LIBRARY_LENGTHS = [128, 512, 2048, 4096, 8192]
LIBRARY_QUICK_LENGTHS = [128, 512, 2048]
LIBRARY_IMPLS = ("qkv_jax", "jax.nn", "torch")
SHORT_PATHS = ("reference", "xla", "chunked")  # qkv_jax's explicit paths, timed at T <= 128
SHARD_MAP = "qkv_jax shard_map"  # --shard-map: the default inside jax.shard_map over heads
LIBRARY_PAUSE_S = 0.2  # rest before each timed call (see PAUSE_S)


def library_runner(impl: str, causal: bool, pass_: str, T: int):
    """One call as a library user writes it: a zero-argument callable that waits for it."""
    if impl == "torch":
        return torch_runner(causal, pass_, T)
    import functools

    import jax

    import qkv_jax

    inputs = jax_inputs(T, T)
    if impl == "jax.nn":
        attend = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=causal))
    elif impl == SHARD_MAP:  # heads split over the process's CPU devices, as a user would write it
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = jax.make_mesh((jax.device_count(),), ("heads",))
        spec = P(None, None, "heads", None)
        call = functools.partial(qkv_jax.dot_product_attention, is_causal=causal)
        attend = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
        inputs = [jax.device_put(x, NamedSharding(mesh, spec)) for x in inputs]
    else:
        implementation = None if impl == "qkv_jax" else impl
        attend = functools.partial(
            qkv_jax.dot_product_attention, is_causal=causal, implementation=implementation
        )
    if pass_ == "fwd":
        return lambda: jax.block_until_ready(attend(*inputs))

    def forward_backward():
        output, pullback = jax.vjp(attend, *inputs)
        jax.block_until_ready(pullback(output))

    return forward_backward


def library_rounds(rounds: int, T: int) -> int:
    """More rounds where calls take milliseconds (T <= 128: 5x, T 512: 2x), at most 2 from T 4096 on."""
    if T <= 128:
        return 5 * rounds
    if T <= 512:
        return 2 * rounds
    return rounds if T < 4096 else min(rounds, 2)


def library_impls(T: int, pass_: str, args) -> list[str]:
    """The implementations timed at one length: jax.nn while it is cheap enough to run and to hold."""
    impls = ["qkv_jax", *([SHARD_MAP] if args.shard_map else []), "torch"]
    if T <= args.library_nn_max and materialised_gib(T, pass_) <= args.max_gib:
        impls.insert(1, "jax.nn")
    if T <= 128:
        impls += [p for p in SHORT_PATHS if materialised_gib(T, pass_) <= args.max_gib]
    return impls


def library_case(T: int, causal: bool, pass_: str, impls: list[str], rounds: int) -> dict:
    """Seconds of each implementation's calls, interleaved in a new random order per round."""
    runners = {impl: library_runner(impl, causal, pass_, T) for impl in impls}
    for run in runners.values():
        run()  # compiles and warms up
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    order = random.Random(T * 4 + 2 * causal + (pass_ == "fwd"))
    for _ in range(rounds):
        for impl in order.sample(impls, len(impls)):
            time.sleep(LIBRARY_PAUSE_S)
            started = time.perf_counter()
            runners[impl]()
            times[impl].append(time.perf_counter() - started)
    return times


def library_report(records: list[dict]) -> tuple[list[str], dict]:
    """Markdown table (median ms, ratio to torch) and the headline ratios."""
    sharded = any(SHARD_MAP in r["times_s"] for r in records)
    columns = ["qkv_jax", *([SHARD_MAP] if sharded else []), "jax.nn", "torch"]
    compared = ["qkv_jax", *([SHARD_MAP] if sharded else []), "jax.nn"]
    lines = [
        "| T = S | mask | pass | "
        + " | ".join(c.replace("torch", "torch SDPA") for c in columns)
        + " | "
        + " | ".join(f"{c} / torch" for c in compared)
        + " | qkv_jax / fastest JAX path |",
        "|---|---|---|" + "---|" * (len(columns) + len(compared) + 1),
    ]
    ratios = {}
    for r in records:
        seconds = {impl: statistics.median(t) for impl, t in r["times_s"].items()}
        torch_s = seconds["torch"]
        cells = [f"{1e3 * seconds[c]:.1f} ms" if c in seconds else "-" for c in columns]
        over_torch = [f"{seconds[c] / torch_s:.2f}" if c in seconds else "-" for c in compared]
        # Other single-device JAX paths (the shard_map variant runs on more devices).
        jax_paths = [s for impl, s in seconds.items() if impl not in ("qkv_jax", "torch", SHARD_MAP)]
        fastest = f"{seconds['qkv_jax'] / min(jax_paths):.2f}" if jax_paths else "-"
        mask = "causal" if r["causal"] else "full"
        lines.append(
            f"| {r['T']} | {mask} | {r['pass_']} | " + " | ".join(cells + over_torch + [fastest]) + " |"
        )
        ratios[f"T={r['T']} {mask} {r['pass_']}: qkv_jax / torch"] = seconds["qkv_jax"] / torch_s
        if SHARD_MAP in seconds:
            ratios[f"T={r['T']} {mask} {r['pass_']}: {SHARD_MAP} / torch"] = seconds[SHARD_MAP] / torch_s
        if r["T"] <= 128 and jax_paths:
            ratios[f"T={r['T']} {mask} {r['pass_']}: qkv_jax / fastest JAX path"] = seconds["qkv_jax"] / min(
                jax_paths
            )
    return lines, ratios


def library_user_main(args) -> None:
    """Attention as a library user meets it (module docstring), in this process."""
    import jax

    if args.shard_map:  # before JAX's backend starts: one CPU device per core
        jax.config.update("jax_num_cpu_devices", os.cpu_count() or 1)

    records = []
    for T in args.lengths:
        rounds = library_rounds(args.rounds, T)
        for causal in (False, True):
            for pass_ in PASSES:
                impls = library_impls(T, pass_, args)
                record = dict(T=T, causal=causal, pass_=pass_)
                record["times_s"] = library_case(T, causal, pass_, impls, rounds)
                records.append(record)
                medians = {
                    impl: f"{1e3 * statistics.median(t):.1f} ms" for impl, t in record["times_s"].items()
                }
                print(f"T={T} causal={causal} {pass_}: {medians}", file=sys.stderr, flush=True)
    table, ratios = library_report(records)
    intro = (
        f"B{BATCH} N{HEADS} H{HEAD_DIM} float32, one process, JAX's {jax.device_count()} CPU device(s), "
        f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '') or 'none'}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '') or 'none'}, torch on {cpu_threads()} threads; "
        f"median of {args.rounds} interleaved rounds (x5 at T <= 128, x2 at T 512, at most 2 from T 4096 "
        "on); forward+backward through an eager "
        "`jax.vjp` (torch: `.backward()`). Ratios above 1: slower than torch."
    )
    print("\n".join([intro, "", *table]))
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    command = "python benchmarks/attention.py " + " ".join(sys.argv[1:])
    title = (
        "Attention on CPU as a library user meets it"
        + (", with jax.shard_map over heads" if args.shard_map else "")
        + ("" if args.name == args.default_name else f" ({args.name})")
    )
    path = write_results(
        args.name,
        command.strip(),
        {"title": title, "records": records, "table": [intro, "", *table], "ratios": ratios},
    )
    print(f"wrote {path.relative_to(ROOT)}")


# ----------------------------------------------------------------------------- local windows

WINDOW_LENGTHS = [2048, 8192]
WINDOW = (256, 0)  # with causal: each query sees itself and the 256 keys before it
WINDOW_BATCH, WINDOW_HEADS = 1, 8  # B1 N8 H64: the full causal fwd+bwd at T 8192 takes seconds on 2 cores
WINDOW_CALLS = 3  # calls per timed region, queued back to back
WINDOW_ROUNDS = 5  # timed regions per case, interleaved; the median is reported


def window_runner(T: int, windowed: bool, pass_: str):
    """WINDOW_CALLS calls of the chunked path, causal, with or without WINDOW, then a wait."""
    import functools

    import jax

    import qkv_jax

    attend = functools.partial(
        qkv_jax.dot_product_attention,
        is_causal=True,
        local_window_size=WINDOW if windowed else None,
        implementation="chunked",
    )
    step = jax_step(attend, pass_)
    inputs = jax_inputs(T, T, batch=WINDOW_BATCH, heads=WINDOW_HEADS)

    def run():
        for _ in range(WINDOW_CALLS):
            result = step(*inputs)
        jax.block_until_ready(result)

    return run


def window_pairs(T: int, windowed: bool) -> int:
    """(query, key) pairs a causal query set attends, with or without WINDOW."""
    left = WINDOW[0] if windowed else T
    return sum(min(t, left) + 1 for t in range(T))


def window_report(times: dict, lengths: list[int]) -> tuple[list[str], dict, list[dict]]:
    """Markdown rows, ratios and records from the times of each (T, pass, windowed) region."""
    lines = [
        f"| T = S | pass | full causal | causal, window {WINDOW} | full / window | window GFLOP/s |",
        "|---|---|---|---|---|---|",
    ]
    ratios, records = {}, []
    for T in lengths:
        for pass_ in PASSES:
            full, windowed = (statistics.median(times[(T, pass_, w)]) / WINDOW_CALLS for w in (False, True))
            flops = 4.0 * WINDOW_BATCH * WINDOW_HEADS * HEAD_DIM * window_pairs(T, True)
            flops *= 3.5 if pass_ == "fwd+bwd" else 1.0
            lines.append(
                f"| {T} | {pass_} | {1e3 * full:.1f} ms | {1e3 * windowed:.1f} ms | {full / windowed:.2f} | "
                f"{flops / windowed / 1e9:.1f} |"
            )
            ratios[f"T={T} {pass_}: full causal / window {WINDOW}"] = full / windowed
            region_s = {name: times[(T, pass_, w)] for name, w in (("full", False), ("window", True))}
            records.append(dict(T=T, pass_=pass_, calls_per_region=WINDOW_CALLS, region_times_s=region_s))
    return lines, ratios, records


def window_main(args) -> None:
    """The chunked path with a causal local window against full causal attention (it skips
    the tiles outside the window, forward and backward), in this process."""
    load = [os.getloadavg()[0]]  # other work on the machine slows both sides alike
    runners = {
        (T, pass_, windowed): window_runner(T, windowed, pass_)
        for T in args.lengths
        for pass_ in PASSES
        for windowed in (False, True)
    }
    times = interleaved_medians(runners, WINDOW_ROUNDS, group=2)  # each (T, pass): full, window
    load.append(os.getloadavg()[0])
    lines, ratios, records = window_report(times, args.lengths)
    intro = (
        f'B{WINDOW_BATCH} N{WINDOW_HEADS} H{HEAD_DIM} float32, `implementation="chunked"`, causal, with and '
        f"without `local_window_size={WINDOW}`, default tiles; time per call, the median over "
        f"{WINDOW_ROUNDS} interleaved rounds of {WINDOW_CALLS} calls each (forward+backward: the "
        "jitted gradient of half the output's squared norm). GFLOP/s count the window's allowed "
        f"pairs (4 B N H each, 3.5x that forward+backward). The 1-minute load average was {load[0]:.1f} "
        f"at the start and {load[1]:.1f} at the end, on {cpu_threads()} cores: other processes slowed "
        "both columns, interleaved round by round, so the ratios hold better than the times."
    )
    print("\n".join([intro, "", *lines]))
    command = "python benchmarks/attention.py --window " + " ".join(
        a for a in sys.argv[1:] if a != "--window"
    )
    title = "Chunked attention with a local window on CPU" + (
        "" if args.name == args.default_name else f" ({args.name})"
    )
    data = {"title": title, "records": records, "load_average": load, "table": [intro, "", *lines]}
    path = write_results(args.name, command.strip(), {**data, "ratios": ratios})
    print(f"wrote {path.relative_to(ROOT)}")


# ----------------------------------------------------------------------------- tile sizes


BLOCK_CANDIDATES = [(64, 64), (128, 64), (256, 64), (512, 64), (128, 128), (256, 128), (512, 32)]


def tune_blocks(args) -> None:
    """Times the chunked path's tile sizes against each other, interleaved, in this process.

    An explicit (block_q, block_k) tiles both passes; the forward's time ranks the
    forward tiles and forward+backward less forward the backward's. The default
    rule (`qkv_jax.attention.block_sizes`) runs beside them as "default".
    """
    import functools

    import jax

    from qkv_jax.attention import block_sizes, chunked_attention

    sizes = [*BLOCK_CANDIDATES, None]
    runners = {}
    for T in args.lengths:
        inputs = jax_inputs(T, T)
        for causal in (False, True):
            for pass_ in PASSES:
                for size in sizes:
                    blocks = {} if size is None else dict(block_q=size[0], block_k=size[1])
                    attend = functools.partial(chunked_attention, is_causal=causal, **blocks)
                    step = jax_step(attend, pass_)
                    run = lambda s=step, x=inputs: jax.block_until_ready(s(*x))
                    runners[(T, causal, pass_, size)] = run
    times = interleaved_medians(runners, args.rounds, group=len(sizes))
    median = {case: statistics.median(t) for case, t in times.items()}
    label = lambda size: "default" if size is None else f"{size[0]} x {size[1]}"
    header = " | ".join(label(size) for size in sizes)
    table = [f"| T = S | mask | pass | {header} |", "|---|---|---|" + "---|" * len(sizes)]
    best = {}
    for T in args.lengths:
        for causal in (False, True):
            for pass_ in PASSES:
                cells = " | ".join(f"{median[(T, causal, pass_, b)] * 1000:.0f} ms" for b in sizes)
                table.append(f"| {T} | {'causal' if causal else 'none'} | {pass_} | {cells} |")
        forward = {b: sum(median[(T, c, "fwd", b)] for c in (False, True)) for b in BLOCK_CANDIDATES}
        backward = {
            b: sum(median[(T, c, "fwd+bwd", b)] - median[(T, c, "fwd", b)] for c in (False, True))
            for b in BLOCK_CANDIDATES
        }
        rule = block_sizes(BATCH * HEADS, T, T), block_sizes(BATCH * HEADS, T, T, backward=True)
        best[f"T={T}: fastest forward tiles (causal + full)"] = label(min(forward, key=forward.get))
        best[f"T={T}: fastest backward tiles (causal + full)"] = label(min(backward, key=backward.get))
        best[f"T={T}: the default rule's forward, backward tiles"] = f"{label(rule[0])}, {label(rule[1])}"
    print("\n".join(table))
    print(best)
    command = "python benchmarks/attention.py " + " ".join(sys.argv[1:])
    path = write_results(
        "attention_blocks",
        command,
        {
            "title": "Chunked attention tile sizes on CPU",
            "table": table,
            "ratios": best,
            "times_s": {str(case): t for case, t in times.items()},
        },
    )
    print(f"wrote {path.relative_to(ROOT)}")


# ----------------------------------------------------------------------------- GPU

# Dense peaks of the H200 SXM, from NVIDIA's H200 datasheet (nvidia.com/en-us/data-center/h200):
# BF16/FP16 Tensor Core 1,979 TFLOP/s is quoted with 2:4 sparsity, so 989 dense; FP32 67.
GPU_PEAK_TFLOPS = {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}
GPU_PEAK_SOURCE = "NVIDIA H200 SXM datasheet: BF16 1,979 TFLOP/s with sparsity = 989 dense; FP32 67"
GPU_IMPLS = ("default", "cudnn", "torch", "chunked", "jax.nn")
GPU_IMPL_NAMES = {
    "default": "qkv_jax default",
    "cudnn": 'jax.nn "cudnn"',
    "torch": "torch SDPA",
    "chunked": "qkv_jax chunked",
    "jax.nn": 'jax.nn "xla"',
}
GPU_TIMED_REGION_S = 0.05  # calls per timed region: enough to fill this many seconds
GPU_ROUNDS = 5  # timed regions per case; the median is reported


@dataclasses.dataclass(frozen=True)
class GpuCase:
    """One GPU attention case: inputs `[B, T|S, N, H]` in `dtype`, a masking, a pass."""

    dtype: str
    batch: int
    heads: int
    head_dim: int
    T: int
    S: int
    causal: bool
    masking: str  # "none", "lengths" (key_value_seq_lengths), "bias" or "mask" ([B, 1, T, S])
    pass_: str
    impls: tuple[str, ...]

    def key_lengths(self) -> list[int]:
        """Key lengths from S down to S/2 across the batch (the "lengths" masking)."""
        return [self.S - (self.S // 2) * b // max(self.batch - 1, 1) for b in range(self.batch)]

    def pairs(self) -> float:
        """(query, key) pairs computed per batch element and head: causal and lengths
        leave some out; a bias or a mask does not (cuDNN computes every pair)."""
        lengths = self.key_lengths() if self.masking == "lengths" else [self.S] * self.batch
        rows = np.arange(self.T)
        total = 0
        for length in lengths:
            seen = np.minimum(rows + 1 + self.S - self.T, length) if self.causal else np.full(self.T, length)
            total += int(np.clip(seen, 0, None).sum())
        return total / self.batch

    def flops(self) -> float:
        """4 B N H per pair forward; forward+backward counts 3.5x that."""
        return (
            4.0
            * self.batch
            * self.heads
            * self.head_dim
            * self.pairs()
            * (3.5 if self.pass_ == "fwd+bwd" else 1)
        )

    def describe(self) -> dict:
        fields = dataclasses.asdict(self)
        fields.pop("impls")
        return fields


def gpu_cases(dry_run: bool) -> list[GpuCase]:
    """The cases in order of importance (the budget cuts the tail): bf16 causal training
    at 4096 and 16384, bf16 forward, full attention, the masked variants, then float32."""
    long = (2, 2, 64) if dry_run else (4, 16, 128)  # batch, heads, head_dim
    short = (2, 2, 64) if dry_run else (8, 16, 64)
    T1, T2, T_short = (64, 128, 32) if dry_run else (4096, 16384, 1024)
    peers = ("default", "cudnn", "torch")
    cases = []

    def add(shape, T, S, causal, masking, impls, dtype="bfloat16", passes=PASSES[::-1]):
        for pass_ in passes:
            cases.append(GpuCase(dtype, *shape, T, S, causal, masking, pass_, impls))

    add(long, T1, T1, True, "none", (*peers, "chunked"))
    add(long, T2, T2, True, "none", peers)
    add(long, T1, T1, False, "none", peers)
    add(short, T_short, T_short, False, "none", peers)
    add(short, T_short, T_short, True, "none", peers)
    add(long, T1, T1, False, "lengths", peers)
    add(long, T1, T1, True, "lengths", peers)
    add(long, T1, T1, False, "bias", peers)
    add(long, T1, T1, False, "mask", peers)
    add(long, T1 // 8, T1, True, "none", peers)  # causal T != S: bottom-right, as a mask for cuDNN
    add(long, T1, T1, True, "none", ("default", "torch", "jax.nn"), dtype="float32")
    return cases


def jax_masking(case: GpuCase, ours: bool) -> dict:
    """Keyword arguments of the case's masking, for qkv_jax (`ours`) or for jax.nn.

    Causal with T != S is aligned bottom-right (the queries as the last T of the S keys, as
    when decoding; torch's `causal_lower_right`): qkv_jax's `query_offset=S - T`, and for
    jax.nn, whose causal mask is top-left, that triangle as a boolean mask (which cuDNN then
    reads as a bias).
    """
    import jax
    import jax.numpy as jnp

    import qkv_jax

    kwargs: dict = {"is_causal": case.causal, **({"query_offset": case.S - case.T} if ours else {})}
    shape = (case.batch, 1, case.T, case.S)
    if case.masking == "lengths":
        kwargs["key_value_seq_lengths"] = jnp.asarray(case.key_lengths(), jnp.int32)
    elif case.masking == "bias":
        kwargs["bias"] = jax.random.normal(jax.random.PRNGKey(1), shape, case.dtype)
    elif case.masking == "mask":
        kwargs["mask"] = jax.random.bernoulli(jax.random.PRNGKey(1), 0.9, shape)
    if case.causal and case.T != case.S and not ours:
        bottom_right = qkv_jax.causal_mask(case.T, case.S, query_offset=case.S - case.T)  # (T, S)
        kwargs.update(is_causal=False, mask=bottom_right[None, None])
    return kwargs


def jax_gpu_step(case: GpuCase, impl: str):
    """A zero-argument callable running one jitted call of the case, a wait, and the path taken."""
    import functools

    import jax

    import qkv_jax

    inputs = jax_inputs(case.T, case.S, case.dtype, case.batch, case.heads, case.head_dim)
    precision = "highest" if case.dtype == "float32" else None  # float32 as float32: no TF32
    masking = jax_masking(case, ours=impl in ("default", "chunked"))
    if impl in ("default", "chunked"):
        implementation = None if impl == "default" else "chunked"
        attend = functools.partial(
            qkv_jax.dot_product_attention, implementation=implementation, precision=precision, **masking
        )
        path = implementation or qkv_jax.select_implementation(
            *inputs,
            masking.get("bias"),
            masking.get("mask"),
            is_causal=case.causal,
            query_offset=masking["query_offset"],
        )
    else:
        backend = "cudnn" if impl == "cudnn" else "xla"
        call = functools.partial(jax.nn.dot_product_attention, implementation=backend, **masking)

        def attend(*arrays):  # jax.nn has no precision argument: set it while jit traces
            with jax.default_matmul_precision(precision or "default"):
                return call(*arrays)

        path = backend
    step = jax_step(attend, case.pass_)
    return (lambda: step(*inputs)), jax.block_until_ready, path


def torch_gpu_step(case: GpuCase):
    """The same case through torch.nn.functional.scaled_dot_product_attention, in its
    native `[B, N, T, H]` layout, on CUDA when there is one."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, case.dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    B, N, H = case.batch, case.heads, case.head_dim
    query, key, value = (
        torch.randn(B, N, n, H, device=device, dtype=dtype, generator=generator, requires_grad=True)
        for n in (case.T, case.S, case.S)
    )
    shape = (B, 1, case.T, case.S)
    attn_mask = None
    if case.masking == "lengths":  # torch has no lengths: a boolean padding mask
        lengths = torch.tensor(case.key_lengths(), device=device)
        attn_mask = (torch.arange(case.S, device=device) < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
    elif case.masking == "bias":
        attn_mask = torch.randn(*shape, device=device, dtype=dtype, generator=generator)
    elif case.masking == "mask":
        attn_mask = torch.rand(*shape, device=device, generator=generator) < 0.9
    options: dict = {"attn_mask": attn_mask, "is_causal": case.causal}
    if case.causal and attn_mask is not None:  # torch takes one or the other
        bottom_right = torch.ones(case.T, case.S, device=device, dtype=torch.bool).tril(case.S - case.T)
        options = {"attn_mask": attn_mask & bottom_right}
    elif case.causal and case.T != case.S:  # torch's is_causal is top-left, like cuDNN's
        options = {"attn_mask": causal_lower_right(case.T, case.S)}

    def forward():
        with torch.no_grad():
            return F.scaled_dot_product_attention(query, key, value, **options)

    def forward_backward():
        output = F.scaled_dot_product_attention(query, key, value, **options)
        return torch.autograd.grad(0.5 * output.float().square().sum(), (query, key, value))

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return forward if case.pass_ == "fwd" else forward_backward, lambda _: sync(), f"torch ({device})"


def seconds_per_call(run, wait) -> float:
    """Median over GPU_ROUNDS timed regions of the time per call, each region queueing
    enough calls back to back (no wait between them) to fill GPU_TIMED_REGION_S: the
    device runs them one after another while Python dispatches ahead, so the time per
    call is the device's, not the dispatch's."""
    wait(run())  # compile, warm up
    started = time.perf_counter()
    wait(run())
    once = time.perf_counter() - started
    calls = int(min(max(GPU_TIMED_REGION_S / max(once, 1e-6), 3), 200))
    times = []
    for _ in range(GPU_ROUNDS):
        started = time.perf_counter()
        for _ in range(calls):
            result = run()
        wait(result)
        times.append((time.perf_counter() - started) / calls)
    return statistics.median(times)


def measure_gpu_case(case: GpuCase, impl: str) -> dict:
    """Seconds per call of one implementation of a case, or the error it raised."""
    try:
        run, wait, path = torch_gpu_step(case) if impl == "torch" else jax_gpu_step(case, impl)
        seconds = seconds_per_call(run, wait)
    except Exception as error:  # noqa: BLE001 - an unsupported kernel is a result, not a crash
        first_line = (str(error).strip().splitlines() or [""])[0]
        return {"error": f"{type(error).__name__}: {first_line[:200]}"}
    finally:
        release_torch_memory()
    tflops = case.flops() / seconds / 1e12
    share = tflops / GPU_PEAK_TFLOPS[case.dtype]
    return {"seconds": seconds, "tflops": tflops, "peak_share": share, "path": path}


def release_torch_memory() -> None:
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gpu_cell(record: dict | None) -> str:
    if record is None:
        return "-"
    if "seconds" not in record:
        return record.get("skipped") or "n/a: " + record["error"][:60]
    share = 100 * record["peak_share"]
    return f"{record['seconds'] * 1000:.3g} ms ({record['tflops']:.3g} TFLOP/s, {share:.2g}%)"


def case_label(case: GpuCase) -> str:
    mask = {"none": "causal" if case.causal else "full"}.get(case.masking, case.masking)
    if case.masking != "none" and case.causal:
        mask += " + causal"
    return (
        f"{case.dtype} B{case.batch} N{case.heads} H{case.head_dim} T{case.T} S{case.S} {mask} {case.pass_}"
    )


def gpu_report(cases: list[GpuCase], records: list[dict]) -> tuple[list[str], dict]:
    """Markdown table (one row per case) and the headline ratios."""
    index = {(r["case"], r["impl"]): r for r in records}
    header = "| case | default path | " + " | ".join(GPU_IMPL_NAMES[i] for i in GPU_IMPLS) + " |"
    table = [header, "|---|---|" + "---|" * len(GPU_IMPLS)]
    ratios: dict = {}
    for case in cases:
        label = case_label(case)
        row = {impl: index.get((label, impl)) for impl in case.impls}
        path = (row.get("default") or {}).get("path", "-")
        table.append(f"| {label} | {path} | " + " | ".join(gpu_cell(row.get(i)) for i in GPU_IMPLS) + " |")
        seconds = {impl: r["seconds"] for impl, r in row.items() if r and "seconds" in r}
        for peer in ("cudnn", "torch", "jax.nn"):
            if "default" in seconds and peer in seconds:
                ratios[f"{label}: default / {GPU_IMPL_NAMES[peer]}"] = seconds["default"] / seconds[peer]
    return table, ratios


def padded_ratios(records: list[dict]) -> dict:
    """Padded (lengths) default against unmasked cuDNN at the same shape, causality and pass."""

    def seconds(case_fields, impl):
        for r in records:
            if r["impl"] == impl and "seconds" in r and all(r[k] == v for k, v in case_fields.items()):
                return r["seconds"]
        return None

    ratios = {}
    for r in records:
        if r["masking"] == "lengths" and r["impl"] == "default" and "seconds" in r:
            fields = {k: r[k] for k in ("dtype", "batch", "heads", "head_dim", "T", "S", "causal", "pass_")}
            unmasked = seconds({**fields, "masking": "none"}, "cudnn")
            if unmasked:
                name = f"{r['dtype']} T{r['T']} lengths{' + causal' if r['causal'] else ''} {r['pass_']}"
                ratios[f"{name}: default / unmasked cuDNN"] = r["seconds"] / unmasked
    return ratios


def gpu_main(args) -> None:
    """Our default path against jax.nn's cuDNN kernel and torch's SDPA on one GPU.

    Cases run in order of importance and stop once --budget-s seconds have
    passed (benchmarks/gpu.sh must finish in 5 minutes). --dry-run: tiny sizes on
    whatever device there is (on CPU cuDNN fails and says so), no results file.
    """
    import jax

    started = time.perf_counter()
    cases = gpu_cases(args.dry_run)
    records = []
    for case in cases:
        for impl in case.impls:
            record = {"case": case_label(case), **case.describe(), "impl": impl}
            if time.perf_counter() - started > args.budget_s:
                record["skipped"] = "time budget"
            else:
                record.update(measure_gpu_case(case, impl))
            records.append(record)
            print(f"{case_label(case)} {impl}: {gpu_cell(record)}", file=sys.stderr, flush=True)
    device = jax.devices()[0]
    table, ratios = gpu_report(cases, records)
    ratios.update(padded_ratios(records))
    intro = (
        f"**{device.device_kind}** ({device.platform}): time per call, each the median of "
        f"{GPU_ROUNDS} timed regions of calls queued back to back (so Python's dispatch is "
        f"amortised); TFLOP/s count 4 B N H per computed (query, key) pair forward and 3.5x "
        f"that forward+backward (causal and lengths leave pairs out, a bias or mask does not); "
        f"% = share of the dense peak ({GPU_PEAK_SOURCE} TFLOP/s). float32 runs at precision "
        f"'highest' (no TF32) on both sides. torch SDPA uses its [B, N, T, H] layout; padding "
        f"by lengths is a boolean mask for torch."
    )
    print("\n".join([intro, "", *table]))
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    if args.dry_run:
        return
    command = "bash benchmarks/gpu.sh  # python benchmarks/attention.py " + " ".join(sys.argv[1:])
    data = {"title": f"Attention on {device.device_kind}", "device": str(device), "records": records}
    path = write_results("attention_gpu", command, {**data, "table": [intro, "", *table], "ratios": ratios})
    print(f"wrote {path.relative_to(ROOT)}")


# ----------------------------------------------------------------------------- cuDNN check


@dataclasses.dataclass(frozen=True)
class CheckCase:
    """A kind of call `select_implementation` sends to cuDNN on a GPU, or (`explicit`) one it does
    not send there yet, asked for with `implementation="cudnn"`, whose meaning on cuDNN is to be
    proven equal to the reference's before the rule may send it."""

    name: str
    batch: tuple[int, ...]
    T: int
    S: int
    N: int
    K: int
    H: int
    dtype: str = "bfloat16"
    causal: bool = False
    mask: tuple[int, ...] | None = None  # shape; row 1 of the first example fully masked
    bias: tuple[int, ...] | None = None  # shape; row 2 of the first entry -inf
    query_lengths: tuple | None = None
    key_lengths: tuple | None = None
    nan_beyond_lengths: bool = False  # NaN keys past each key length: must not leak
    bottom_right: bool = False  # query_offset = S - T (cuDNN gets the causal mask as a bias)
    window: tuple[int, int] | None = None  # local_window_size
    segments: bool = False  # packed segment ids (two segments per example, one id the keys lack)
    explicit: bool = False  # implementation="cudnn": the rule does not choose cuDNN for it (yet)


def cudnn_check_cases(dry_run: bool) -> list[CheckCase]:
    """Every kind of call the rule routes to cuDNN: dtypes, head depths, GQA/MQA, causal with
    T = S, T < S and T > S (jax.nn's top-left, cuDNN's own mask) and bottom-right (a bias),
    masks and biases of each broadcast shape, lengths (zero ones too), their mixtures, batch
    layouts, a decode step, and NaN in the padding. Then the calls the rule keeps away from
    cuDNN until they pass here: local windows (those jax.nn hands cuDNN as its sliding window,
    and one folded into the bias) and segment ids (a bias), asked for explicitly."""
    T, S, H = (8, 12, 8) if dry_run else (256, 512, 64)
    window = 3 if dry_run else 64
    return [
        CheckCase("causal T = S, GQA, H 128", (2,), S, S, 8, 2, 8 if dry_run else 128, causal=True),
        CheckCase("full, MQA, float16", (2,), T, S, 4, 1, H, dtype="float16"),
        CheckCase("causal T < S", (2,), T, S, 4, 4, H, causal=True),
        CheckCase("causal T > S", (2,), S, T, 4, 2, H, causal=True),
        CheckCase("causal T < S, bottom-right (a bias)", (2,), T, S, 4, 2, H, causal=True, bottom_right=True),
        CheckCase("causal T > S, bottom-right (a bias)", (2,), S, T, 4, 2, H, causal=True, bottom_right=True),
        CheckCase("mask [B, 1, T, S]", (2,), T, S, 4, 2, H, mask=(2, 1, T, S)),
        CheckCase("mask [T, S], causal", (2,), S, S, 4, 2, H, causal=True, mask=(S, S)),
        CheckCase("mask [B, N, T, S]", (2,), T, S, 4, 2, H, mask=(2, 4, T, S)),
        CheckCase("bias [B, 1, T, S] with -inf", (2,), T, S, 4, 2, H, bias=(2, 1, T, S)),
        CheckCase("bias [N, T, S]", (2,), T, S, 4, 2, H, bias=(4, T, S)),
        CheckCase("bias [T, S], float16", (2,), T, S, 4, 2, H, dtype="float16", bias=(T, S)),
        CheckCase("key lengths, one zero", (3,), T, S, 4, 2, H, key_lengths=(S, 0, S // 2)),
        CheckCase(
            "lengths, causal",
            (2,),
            S,
            S,
            4,
            2,
            H,
            causal=True,
            query_lengths=(S, S // 3),
            key_lengths=(S // 2, S),
        ),
        CheckCase(
            "mask + bias + lengths + causal T < S",
            (2,),
            T,
            S,
            4,
            2,
            H,
            causal=True,
            mask=(2, 1, T, S),
            bias=(4, T, S),
            query_lengths=(T, T // 2),
            key_lengths=(S - 2, S),
        ),
        CheckCase("unbatched", (), T, S, 4, 2, H, causal=True),
        CheckCase("batch dims (2, 3)", (2, 3), T, T, 2, 1, H, causal=True),
        CheckCase("decode: T = 1", (2,), 1, S, 4, 2, H),
        CheckCase(
            "NaN beyond key lengths",
            (2,),
            T,
            S,
            4,
            2,
            H,
            key_lengths=(S // 2, S - 2),
            nan_beyond_lengths=True,
        ),
        # Not chosen by the rule yet: cuDNN's meaning of these is what this run checks.
        CheckCase("window (w, 0)", (2,), S, S, 4, 2, H, window=(window, 0), explicit=True),
        CheckCase(
            "causal window (w, 0)", (2,), S, S, 4, 2, H, causal=True, window=(window, 0), explicit=True
        ),
        CheckCase(
            "causal window (w, 0), T < S", (2,), T, S, 4, 2, H, causal=True, window=(window, 0), explicit=True
        ),
        CheckCase(
            "causal window (w, 3)", (2,), S, S, 4, 2, H, causal=True, window=(window, 3), explicit=True
        ),
        CheckCase("window (w, w): a bias", (2,), T, S, 4, 2, H, window=(window, window), explicit=True),
        CheckCase("segments, causal: a bias", (2,), S, S, 4, 2, H, causal=True, segments=True, explicit=True),
        CheckCase(
            "segments, key lengths: a bias",
            (2,),
            T,
            S,
            4,
            2,
            H,
            segments=True,
            key_lengths=(S, S // 2),
            explicit=True,
        ),
    ]


def check_inputs(case: CheckCase, seed: int = 0):
    """Query, key, value in the case's dtype, and the keyword arguments of its masking."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    arrays = [
        rng.normal(size=(*case.batch, n, heads, case.H))
        for n, heads in ((case.T, case.N), (case.S, case.K), (case.S, case.K))
    ]
    query, key, value = (jnp.asarray(x, case.dtype) for x in arrays)
    kwargs: dict = {"is_causal": case.causal}
    if case.mask:
        mask = rng.random(case.mask) < 0.7
        mask.reshape(-1, *case.mask[-2:])[0, min(1, case.mask[-2] - 1)] = False
        kwargs["mask"] = mask
    if case.bias:
        bias = rng.normal(size=case.bias).astype(np.float32)
        bias.reshape(-1, *case.bias[-2:])[0, min(2, case.bias[-2] - 1)] = -np.inf
        kwargs["bias"] = bias
    for name, lengths in (
        ("query_seq_lengths", case.query_lengths),
        ("key_value_seq_lengths", case.key_lengths),
    ):
        if lengths is not None:
            kwargs[name] = np.array(lengths, np.int32)
    if case.nan_beyond_lengths:
        beyond = np.arange(case.S)[None, :] >= np.array(case.key_lengths)[:, None]  # (B, S)
        key = jnp.where(jnp.asarray(beyond)[:, :, None, None], jnp.nan, key)
    kwargs["query_offset"] = case.S - case.T if case.bottom_right else 0
    if case.window is not None:
        kwargs["local_window_size"] = case.window
    if case.segments:  # batch (2,): two packed segments per example, split at n/3 and at 2n/3
        for name, n in (("query_segment_ids", case.T), ("key_segment_ids", case.S)):
            kwargs[name] = (np.arange(n)[None, :] >= np.array([[n // 3], [2 * n // 3]])).astype(np.int32)
        kwargs["key_segment_ids"][:, -1] = 7  # an id no query holds
    return (query, key, value), kwargs


def check_one(case: CheckCase, on_gpu: bool) -> dict:
    """Outputs and gradients of the default path against the reference path on the same
    inputs (the reference computes in float32 and rounds its output to the dtype)."""
    import functools

    import jax
    import jax.numpy as jnp

    import qkv_jax

    inputs, kwargs = check_inputs(case)
    selecting = {k: v for k, v in kwargs.items() if k not in ("query_seq_lengths", "key_value_seq_lengths")}
    rule = qkv_jax.select_implementation(*inputs, **selecting, platform="gpu")
    asked = "cudnn" if case.explicit else None
    implementation = asked if on_gpu else "xla"  # on CPU: the same call through jax.nn's XLA kernel

    def run(implementation, *inputs):
        def loss(*inputs):
            out = qkv_jax.dot_product_attention(*inputs, implementation=implementation, **kwargs)
            weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
            return jnp.sum(out.astype(jnp.float32) * weights), out

        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(*inputs)

    ours = jax.jit(functools.partial(run, implementation))
    program = ours.lower(*inputs).as_text()
    (_, out), grads = ours(*inputs)
    (_, want), want_grads = jax.jit(functools.partial(run, "reference"))(*inputs)
    out_tol, grad_tol = (2e-2, 5e-2) if case.dtype == "bfloat16" else (4e-3, 1e-2)
    result = {"case": case.name, "rule": rule, "cudnn_in_program": "cudnn" in program.lower()}
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    result["output_error"] = float(np.nanmax(np.abs(out - want))) if out.size else 0.0
    result["output_nan_pattern_ok"] = bool((np.isnan(out) == np.isnan(want)).all())
    errors = []
    for g, e in zip(grads, want_grads, strict=True):
        g, e = np.asarray(g, np.float32), np.asarray(e, np.float32)
        errors.append(
            float(np.max(np.abs(g - e)) / max(np.max(np.abs(e)), 1e-3)) if np.isfinite(g).all() else np.inf
        )
    result["gradient_errors"] = errors
    # An explicit case is asked for as implementation="cudnn": whether the rule already sends it
    # there follows from the record of earlier checks (qkv_jax/attention/gpu_checked.py).
    result["ok"] = (
        (case.explicit or rule == "cudnn")
        and (result["cudnn_in_program"] or not on_gpu)
        and result["output_error"] <= out_tol
        and result["output_nan_pattern_ok"]
        and max(errors) <= grad_tol
    )
    return result


def gpu_check_main(args) -> None:
    """Every kind of call the rule sends to cuDNN, and the windows and segment ids it does not
    send there yet (asked for as `implementation="cudnn"`), checked against the reference on
    this device (benchmarks/gpu_check.sh). On CPU (--dry-run): the same calls through jax.nn's
    XLA kernel ("xla") at tiny sizes. Exits 1 if any case fails."""
    import jax

    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.dry_run:
        raise SystemExit("--gpu-check needs a GPU (jax.default_backend() is not 'gpu'); add --dry-run on CPU")
    results = []
    # The calls the rule keeps from cuDNN first: what they show decides the rule's next step.
    for case in sorted(cudnn_check_cases(args.dry_run), key=lambda case: not case.explicit):
        try:
            result = check_one(case, on_gpu)
        except Exception as error:  # noqa: BLE001 - report every case, then fail
            result = {"case": case.name, "ok": False, "error": f"{type(error).__name__}: {str(error)[:300]}"}
        results.append(result)
        print(("PASS " if result["ok"] else "FAIL ") + json.dumps(result), flush=True)
    failed = [r["case"] for r in results if not r["ok"]]
    summary = {
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "cases": len(results),
        "failed": failed,
        "results": results,
    }
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"{len(results) - len(failed)} of {len(results)} cuDNN cases match the reference"
        + (f"; failed: {failed}" if failed else "")
    )
    if failed:
        raise SystemExit(1)


# ----------------------------------------------------------------------------- entry


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    comma_ints = lambda text: [int(x) for x in text.split(",")]
    parser.add_argument("--lengths", type=comma_ints, help="T = S values, comma-separated")
    parser.add_argument("--impls", type=lambda t: t.split(","), default=list(CPU_IMPLS))
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 7; 3 with --quick)")
    parser.add_argument("--long-rounds", type=int, help="timed calls per long case (3; 1 with --quick)")
    parser.add_argument("--long-from", type=int, default=2048, help="lengths from here: a process per case")
    parser.add_argument("--max-gib", type=float, help="memory budget (default 85%% of what is available)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument(
        "--name",
        help="CPU run: writes benchmarks/results/NAME.json (default attention, attention_library_user)",
    )
    parser.add_argument(
        "--allocators",
        type=lambda t: t.split(","),
        help="tcmalloc,glibc (default both when tcmalloc is installed)",
    )
    parser.add_argument("--tune-blocks", action="store_true", help="time the chunked path's tile sizes")
    parser.add_argument(
        "--window",
        action="store_true",
        help="the chunked path with a causal local window against full causal",
    )
    parser.add_argument(
        "--library-user", action="store_true", help="qkv_jax, jax.nn and torch SDPA in this one process"
    )
    parser.add_argument(
        "--library-nn-max", type=int, help="--library-user: longest T for jax.nn (2048; 512 with --quick)"
    )
    parser.add_argument(
        "--shard-map",
        action="store_true",
        help="--library-user: one CPU device per core, and the default inside jax.shard_map over heads too",
    )
    parser.add_argument("--gpu", action="store_true", help="accelerator run (benchmarks/gpu.sh)")
    parser.add_argument(
        "--gpu-check", action="store_true", help="cuDNN cases against the reference (benchmarks/gpu_check.sh)"
    )
    parser.add_argument("--out", help="with --gpu-check: write the results as JSON here")
    parser.add_argument(
        "--dry-run", action="store_true", help="with --gpu/--gpu-check: tiny sizes, any device"
    )
    parser.add_argument("--budget-s", type=float, default=200.0, help="with --gpu: no new case after this")
    parser.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # T,causal(0|1),pass,impl
    args = parser.parse_args(argv)
    unknown = sorted(set(args.impls) - set(CPU_IMPLS))
    if unknown:
        parser.error(f"--impls: unknown {unknown}; choose from {list(CPU_IMPLS)}")
    args.default_name = (
        "attention_window"
        if args.window
        else "attention"
        if not args.library_user
        else "attention_library_user" + ("_shard_map" if args.shard_map else "")
    )
    if args.name is None:
        args.name = args.default_name
    if args.lengths is None and args.window:
        args.lengths = WINDOW_LENGTHS
    if args.lengths is None and args.library_user:
        args.lengths = LIBRARY_QUICK_LENGTHS if args.quick else LIBRARY_LENGTHS
    if args.lengths is None:
        args.lengths = [2048, 8192] if args.gpu else [64, 128, 512, 2048, 4096, 8192]
    if args.library_nn_max is None:
        args.library_nn_max = 512 if args.quick else 2048
    if args.rounds is None:
        args.rounds = 3 if args.quick or args.library_user else 7
    if args.long_rounds is None:
        args.long_rounds = 1 if args.quick else 3
    if args.allocators is None:
        args.allocators = ["tcmalloc", "glibc"] if tcmalloc_path() else ["glibc"]
    if "tcmalloc" in args.allocators and not tcmalloc_path():
        parser.error("--allocators: tcmalloc is not installed (apt-get install libtcmalloc-minimal4)")
    if args.max_gib is None:
        args.max_gib = 120.0 if args.gpu else 0.85 * available_gib()
    if args.case:
        T, causal, pass_, impl = args.case.split(",")
        args.case = (int(T), causal == "1", pass_, impl)
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args)))
    elif args.gpu_check:
        gpu_check_main(args)
    elif args.library_user:
        library_user_main(args)
    elif args.window:
        window_main(args)
    elif args.gpu:
        gpu_main(args)
    elif args.tune_blocks:
        tune_blocks(args)
    else:
        cpu_main(args)


if __name__ == "__main__":
    main()
