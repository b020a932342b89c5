r"""Attention time and memory: our paths against jax.nn, Flax and PyTorch.

  python benchmarks/attention.py                            # the full CPU run (1-2 hours on 2 cores)
  python benchmarks/attention.py --lengths 128,512 --quick  # a few minutes
  python benchmarks/attention.py --tune-blocks --lengths 1024,2048
  python benchmarks/attention.py --gpu [--dry-run]          # benchmarks/gpu.sh; --dry-run: tiny, any device

CPU run: batch 8, 8 heads, head dim 64, float32, T = S in --lengths (default
64, the dispatch threshold, and the issue's 128 to 8192), causal
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

Writes benchmarks/results/attention.json (attention_blocks.json with
--tune-blocks, attention_gpu.json with --gpu); `python -m benchmarks.report`
renders docs/benchmarks.md from them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import time

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
GPU_PEAK_TFLOPS = {"bfloat16": 989.0, "float32": 67.0}  # H200 SXM, dense
GPU_IMPLS = ("default", "chunked", "xla", "jax.nn", "jax.nn-cudnn")


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
    """The issue's acceptance figures: time ratios (above 1: the first is slower) and peaks."""

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
    title = "Attention on CPU" + ("" if args.name == "attention" else f" ({args.name})")
    path = write_results(
        args.name, command.strip(), {"title": title, **data, "table": table, "ratios": ratios}
    )
    print(f"wrote {path.relative_to(ROOT)}")


# ----------------------------------------------------------------------------- tile sizes


def tune_blocks(args) -> None:
    """Times the chunked path's tile sizes against each other, interleaved, in this process."""
    import functools

    import jax

    from qkv_jax.chunked import chunked_attention

    sizes = [(128, 128), (256, 256), (256, 512), (512, 512), (512, 1024), (1024, 1024)]
    runners = {}
    for T in args.lengths:
        inputs = jax_inputs(T, T)
        for causal in (False, True):
            for pass_ in PASSES:
                for bq, bk in sizes:
                    attend = functools.partial(chunked_attention, is_causal=causal, block_q=bq, block_k=bk)
                    step = jax_step(attend, pass_)
                    run = lambda s=step, x=inputs: jax.block_until_ready(s(*x))
                    runners[(T, causal, pass_, (bq, bk))] = run
    times = interleaved_medians(runners, args.rounds, group=len(sizes))
    median = {case: statistics.median(t) for case, t in times.items()}
    header = " | ".join(f"{bq} x {bk}" for bq, bk in sizes)
    table = [f"| T = S | mask | pass | {header} |", "|---|---|---|" + "---|" * len(sizes)]
    best = {}
    for T in args.lengths:
        for causal in (False, True):
            for pass_ in PASSES:
                cells = " | ".join(f"{median[(T, causal, pass_, b)] * 1000:.0f} ms" for b in sizes)
                table.append(f"| {T} | {'causal' if causal else 'none'} | {pass_} | {cells} |")
        total = {b: sum(median[(T, c, p, b)] for c in (False, True) for p in PASSES) for b in sizes}
        fastest = min(total, key=total.get)
        best[f"T={T}: fastest block_q x block_k over the four cases"] = f"{fastest[0]} x {fastest[1]}"
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


def gpu_case(impl, dtype, T, causal, pass_, rounds, shape) -> dict:
    """Median seconds of one case on the default device, or the error it raised."""
    import jax

    batch, heads, head_dim = shape
    try:
        step = jax_step(jax_attention(impl, causal, T, T), pass_)
        inputs = jax_inputs(T, T, dtype, batch, heads, head_dim)
        run = lambda: jax.block_until_ready(step(*inputs))
        run()
        times = [timed(run) for _ in range(rounds)]
    except Exception as error:  # noqa: BLE001 - an unsupported kernel is a result, not a crash
        first_line = (str(error).splitlines() or [""])[0]
        return {"error": f"{type(error).__name__}: {first_line}"}
    return {"median_s": statistics.median(times), "times_s": times}


def gpu_cell(record: dict, shape) -> str:
    if "median_s" not in record:
        return record.get("skipped") or "n/a: " + record["error"][:70]
    flops = useful_flops(record["T"], record["T"], record["causal"], record["pass_"], *shape)
    tflops = flops / record["median_s"] / 1e12
    share = 100 * tflops / GPU_PEAK_TFLOPS[record["dtype"]]
    return f"{record['median_s'] * 1000:.2f} ms ({tflops:.3g} TFLOP/s, {share:.2g}%)"


def gpu_main(args) -> None:
    """Our paths against jax.nn's XLA and cuDNN kernels on one accelerator, bf16 and fp32.

    Stops adding cases once --budget-s seconds have passed (benchmarks/gpu.sh
    must finish in 5 minutes). The default in float32 on a GPU is XLA for short
    and chunked for long inputs; materialising cases that would not fit in
    --max-gib are skipped. --dry-run: tiny sizes on whatever device there is (on
    CPU, cuDNN fails and says so), no results file.
    """
    import jax

    started = time.perf_counter()
    shape = (2, 2, 64) if args.dry_run else (BATCH, HEADS, HEAD_DIM)
    lengths = [64, 128] if args.dry_run else args.lengths
    records = []
    for dtype in ("bfloat16", "float32"):
        for T in lengths:
            for causal in (False, True):
                for pass_ in PASSES:
                    for impl in GPU_IMPLS:
                        record = dict(dtype=dtype, T=T, causal=causal, pass_=pass_, impl=impl)
                        materialising = impl in ("xla", "jax.nn") or (impl, dtype) == ("default", "float32")
                        if time.perf_counter() - started > args.budget_s:
                            record["skipped"] = "time budget"
                        elif materialising and materialised_gib(T, pass_, *shape[:2]) > args.max_gib:
                            record["skipped"] = "memory"
                        else:
                            record.update(gpu_case(impl, dtype, T, causal, pass_, args.rounds, shape))
                        records.append(record)
                        print(record, file=sys.stderr)
    device = jax.devices()[0]
    peaks = ", ".join(f"{k} {v:.0f} TFLOP/s" for k, v in GPU_PEAK_TFLOPS.items())
    table = [
        f"**{device.device_kind}** ({device.platform}), batch {shape[0]}, {shape[1]} heads, head dim "
        f"{shape[2]}: median ms (TFLOP/s, share of the H200's dense peak: {peaks}).",
        "",
        "| dtype | T = S | mask | pass | " + " | ".join(GPU_IMPLS) + " |",
        "|---|---|---|---|" + "---|" * len(GPU_IMPLS),
    ]
    index = {(r["dtype"], r["T"], r["causal"], r["pass_"], r["impl"]): r for r in records}
    ratios = {}
    for dtype in ("bfloat16", "float32"):
        for T in lengths:
            for causal in (False, True):
                for pass_ in PASSES:
                    row = [index[(dtype, T, causal, pass_, impl)] for impl in GPU_IMPLS]
                    mask = "causal" if causal else "none"
                    table.append(
                        f"| {dtype} | {T} | {mask} | {pass_} | "
                        + " | ".join(gpu_cell(r, shape) for r in row)
                        + " |"
                    )
                    default, cudnn = row[0], row[-1]
                    if "median_s" in default and "median_s" in cudnn:
                        name = f"{dtype} T={T} {mask} {pass_}: default time / cuDNN"
                        ratios[name] = default["median_s"] / cudnn["median_s"]
    print("\n".join(table))
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    if args.dry_run:
        return
    command = "bash benchmarks/gpu.sh  # python benchmarks/attention.py " + " ".join(sys.argv[1:])
    path = write_results(
        "attention_gpu",
        command,
        {
            "title": f"Attention on {device.device_kind}",
            "device": str(device),
            "records": records,
            "table": table,
            "ratios": ratios,
        },
    )
    print(f"wrote {path.relative_to(ROOT)}")


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
        "--name", default="attention", help="CPU run: writes benchmarks/results/NAME.json (a focused rerun)"
    )
    parser.add_argument(
        "--allocators",
        type=lambda t: t.split(","),
        help="tcmalloc,glibc (default both when tcmalloc is installed)",
    )
    parser.add_argument("--tune-blocks", action="store_true", help="time the chunked path's tile sizes")
    parser.add_argument("--gpu", action="store_true", help="accelerator run (benchmarks/gpu.sh)")
    parser.add_argument("--dry-run", action="store_true", help="with --gpu: tiny sizes on any device")
    parser.add_argument("--budget-s", type=float, default=200.0, help="with --gpu: no new case after this")
    parser.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # T,causal(0|1),pass,impl
    args = parser.parse_args(argv)
    unknown = sorted(set(args.impls) - set(CPU_IMPLS))
    if unknown:
        parser.error(f"--impls: unknown {unknown}; choose from {list(CPU_IMPLS)}")
    if args.lengths is None:
        args.lengths = [2048, 8192] if args.gpu else [64, 128, 512, 2048, 4096, 8192]
    if args.rounds is None:
        args.rounds = 3 if args.quick else 7
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
    elif args.gpu:
        gpu_main(args)
    elif args.tune_blocks:
        tune_blocks(args)
    else:
        cpu_main(args)


if __name__ == "__main__":
    main()
