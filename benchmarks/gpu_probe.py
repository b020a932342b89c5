"""What the GPU offers for attention options cuDNN lacks, measured before choosing a fused path.

Side by side in one process, at B4 T4096 N16 H128 bf16 (forward, and forward plus backward):
jax.nn's cuDNN and XLA paths, qkv_jax's own paths, tokamax's kernels where tokamax imports
(its Mosaic GPU and Triton implementations), jax's bundled Pallas GPU attention, and torch's
SDPA and compiled flex_attention, for plain causal, a causal left window, a two-sided window
a logit soft cap, two packed segments per row and a sink per head; float32 at H64.
qkv_jax's "pallas" rows also give its largest difference from the reference path (output
and each gradient, relative to the largest entry), a check of the kernel on the GPU, and
other tiles (bf16) and precisions (float32) of it are timed beside its defaults. Each case is
skipped with its reason when it fails, and no case starts after --budget-s.

    python benchmarks/gpu_probe.py --out results.json   # on the GPU machine
    python benchmarks/gpu_probe.py --dry-run            # tiny sizes on any machine
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import qkv_jax  # noqa: E402

OPTIONS = {
    "causal": dict(is_causal=True),
    "window_left_1024_causal": dict(is_causal=True, local_window_size=(1024, 0)),
    "window_512_both": dict(local_window_size=(512, 512)),
    "soft_cap_50_causal": dict(is_causal=True, logits_soft_cap=50.0),
    "segments_causal": dict(is_causal=True),  # two packed segments per row (`option_arrays`)
    "sinks_causal": dict(is_causal=True),  # one sink logit per head (`option_arrays`)
}
# The JAX paths each option is timed on (jax.nn, tokamax and jax's bundled kernel apart).
QKV_PATHS = {option: (None, "xla", "pallas") for option in OPTIONS}
QKV_PATHS["causal"] = (None, "xla", "chunked", "pallas")
QKV_PATHS["sinks_causal"] = (None, "pallas")  # jax.nn's XLA path has no sinks
# Tiles of "pallas" timed beside its defaults at bf16 causal: (block_q, block_k, backward_q,
# backward_k).
PALLAS_BLOCK_VARIANTS = ((64, 64, 32, 32), (128, 128, 64, 64), (64, 64, 64, 64))


def segment_ids(shape):
    """Two packed segments per row, `[B, T]`: the first half of the positions, then the rest."""
    B, T = shape[0], shape[1]
    return np.broadcast_to((np.arange(T) >= T // 2).astype(np.int32), (B, T))


def sink_logits(shape):
    """One sink logit per head `[N]`, spread around 0."""
    return np.linspace(-1.0, 1.0, shape[2]).astype(np.float32)


def option_keywords(option, shape):
    """`dot_product_attention`'s keywords of `option` at `shape` = (B, T, N, H), arrays included."""
    keywords = dict(OPTIONS[option])
    if option == "segments_causal":
        ids = jnp.asarray(segment_ids(shape))
        keywords.update(query_segment_ids=ids, key_segment_ids=ids)
    if option == "sinks_causal":
        keywords["sinks"] = jnp.asarray(sink_logits(shape))
    return keywords


def jax_nn_keywords(option, shape):
    """jax.nn's keywords for `option`, or None where jax.nn has no equivalent."""
    if option in ("soft_cap_50_causal", "sinks_causal"):
        return None
    keywords = dict(OPTIONS[option])
    if option == "segments_causal":
        ids = jnp.asarray(segment_ids(shape))
        keywords["mask"] = (ids[:, :, None] == ids[:, None, :])[:, None]  # (B, 1, T, T)
    return keywords


def time_jax(fn, *args, repeats=3, inner=10):
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times) * 1e3


def forward_and_train(attend):
    fwd = jax.jit(attend)

    def loss(q, k, v, ct):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * ct)

    train = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return fwd, train


def jax_cases(shape, dtype):
    """(name, option, attend) for every JAX path that may take `option`."""
    cases = []
    for option in OPTIONS:
        kw = option_keywords(option, shape)
        for impl in QKV_PATHS[option]:
            cases.append(
                (
                    f"qkv_jax[{impl or 'default'}]",
                    option,
                    lambda q, k, v, kw=kw, impl=impl: qkv_jax.dot_product_attention(
                        q, k, v, implementation=impl, **kw
                    ),
                )
            )
        nn_kw = jax_nn_keywords(option, shape)
        if nn_kw is not None:
            for impl in ("cudnn", "xla"):
                cases.append(
                    (
                        f"jax.nn[{impl}]",
                        option,
                        lambda q, k, v, kw=nn_kw, impl=impl: jax.nn.dot_product_attention(
                            q, k, v, implementation=impl, **kw
                        ),
                    )
                )
        if option in ("segments_causal", "sinks_causal"):
            continue  # tokamax has neither segment ids nor sinks
        try:
            import tokamax

            for impl in ("mosaic", "triton"):
                cases.append(
                    (
                        f"tokamax[{impl}]",
                        option,
                        lambda q, k, v, kw=kw, impl=impl: tokamax.dot_product_attention(
                            q, k, v, implementation=impl, **kw
                        ),
                    )
                )
        except Exception as error:  # noqa: BLE001 - a probe reports what it could not import
            print(f"tokamax unavailable: {type(error).__name__}: {error}")
    try:
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

        cases.append(
            (
                "jax.pallas.ops.gpu.attention.mha",
                "causal",
                lambda q, k, v: pallas_attention.mha(q, k, v, segment_ids=None, causal=True),
            )
        )
    except Exception as error:  # noqa: BLE001
        print(f"jax pallas ops.gpu.attention unavailable: {type(error).__name__}: {error}")
    return cases


def pallas_errors(option, q, k, v, ct, fwd, train):
    """The largest differences of "pallas" (its compiled `fwd` and `train`) from the reference
    path (float32 logits over the whole [T, S]) in the output and in each gradient, relative
    to the largest entry of each."""
    kw = option_keywords(option, q.shape)
    ref_fwd, ref_train = forward_and_train(
        lambda q, k, v: qkv_jax.dot_product_attention(q, k, v, implementation="reference", **kw)
    )
    errors = {}
    got_all, want_all = (fwd(q, k, v), *train(q, k, v, ct)), (ref_fwd(q, k, v), *ref_train(q, k, v, ct))
    for name, got, want in zip(("output", "dq", "dk", "dv"), got_all, want_all, strict=True):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        errors[name] = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
    return errors


def pallas_variants(dtype_name):
    """(name, option, attend) of other tiles (bf16) or precisions (float32) of "pallas"."""
    from qkv_jax.attention.pallas import pallas_attention

    if dtype_name == "float32":
        return [
            (
                f"qkv_jax[pallas,precision={precision}]",
                "causal",
                lambda q, k, v, p=precision: qkv_jax.dot_product_attention(
                    q, k, v, is_causal=True, implementation="pallas", precision=p
                ),
            )
            for precision in ("high", "default")
        ]
    return [
        (
            f"pallas_attention[blocks={','.join(map(str, blocks))}]",
            "causal",
            lambda q, k, v, b=blocks: pallas_attention(q, k, v, is_causal=True, block_sizes=b),
        )
        for blocks in PALLAS_BLOCK_VARIANTS
    ]


def torch_cases(shape, dtype_name):
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as error:  # noqa: BLE001
        print(f"torch unavailable: {type(error).__name__}: {error}")
        return []
    B, T, N, H = shape
    compiled = torch.compile(flex_attention)
    document = (torch.arange(T, device="cuda") >= T // 2).to(torch.int32)  # segment_ids' two segments
    sinks = torch.from_numpy(sink_logits(shape)).to("cuda")
    masks = {
        "causal": lambda b, h, q, k: q >= k,
        "window_left_1024_causal": lambda b, h, q, k: (q >= k) & (q - k <= 1024),
        "window_512_both": lambda b, h, q, k: (q - k <= 512) & (k - q <= 512),
        "soft_cap_50_causal": lambda b, h, q, k: q >= k,
        "segments_causal": lambda b, h, q, k: (q >= k) & (document[q] == document[k]),
        "sinks_causal": lambda b, h, q, k: q >= k,
    }

    def soft_cap(score, b, h, q, k):
        return 50.0 * torch.tanh(score / 50.0)

    def with_sinks(q, k, v, bm):  # out * sigmoid(lse - sink), as qkv_jax's sinks
        out, lse = compiled(q, k, v, block_mask=bm, return_lse=True)
        return out * torch.sigmoid(lse - sinks[None, :, None]).unsqueeze(-1).to(out.dtype)

    cases = []
    for option, mask_mod in masks.items():
        block_mask = create_block_mask(mask_mod, None, None, T, T, device="cuda")
        score_mod = soft_cap if option.startswith("soft_cap") else None
        attend = (
            (lambda q, k, v, bm=block_mask: with_sinks(q, k, v, bm))
            if option == "sinks_causal"
            else (lambda q, k, v, bm=block_mask, sm=score_mod: compiled(q, k, v, score_mod=sm, block_mask=bm))
        )
        cases.append(("torch.flex_attention(compiled)", option, attend))
    cases.append(
        ("torch.sdpa", "causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    )
    return cases


def time_torch(attend, shape, dtype_name, train):
    import torch

    B, T, N, H = shape
    dtype = getattr(torch, dtype_name)
    q, k, v = (torch.randn(B, N, T, H, device="cuda", dtype=dtype, requires_grad=train) for _ in range(3))
    ct = torch.randn(B, N, T, H, device="cuda", dtype=dtype)

    def step():
        out = attend(q, k, v)
        if train:
            torch.autograd.grad(out, (q, k, v), ct)
        return out

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 10)
    return statistics.median(times)


def priority(name, option, dtype_name):
    """The order cases run in, so that a budget cut leaves out the least needed: first what the
    acceptance table compares at bf16 (qkv_jax's default and Pallas paths, cuDNN's plain causal
    time, flex_attention per option), then float32 against jax.nn's XLA path and SDPA, then
    the rest (jax.nn per option, other paths, tiles and precisions)."""
    if dtype_name == "bfloat16":
        if name in ("qkv_jax[default]", "qkv_jax[pallas]", "torch.flex_attention(compiled)"):
            return 0
        if (name, option) == ("jax.nn[cudnn]", "causal"):
            return 0
    elif name in ("qkv_jax[default]", "qkv_jax[pallas]", "jax.nn[xla]", "torch.sdpa"):
        return 1
    return 2 if name.startswith(("jax.nn", "torch")) else 3


def all_cases(args):
    """(priority, dtype name, shape, name, option, attend, is torch) of every case, in order."""
    shapes = [("bfloat16", (4, 4096, 16, 128)), ("float32", (4, 4096, 16, 64))]
    if args.dry_run:
        shapes = [("bfloat16", (1, 128, 2, 32)), ("float32", (1, 128, 2, 16))]
    on_gpu = not args.dry_run and jax.default_backend() == "gpu"
    cases = []
    for dtype_name, shape in shapes:
        jax_side = jax_cases(shape, jnp.dtype(dtype_name)) + pallas_variants(dtype_name)
        torch_side = torch_cases(shape, dtype_name) if on_gpu else []
        for torch, group in ((False, jax_side), (True, torch_side)):
            for name, option, attend in group:
                if dtype_name == "float32" and option != "causal":
                    continue
                cases.append(
                    (priority(name, option, dtype_name), dtype_name, shape, name, option, attend, torch)
                )
    return sorted(cases, key=lambda case: case[0])


def time_case(dtype_name, shape, name, option, attend, torch, arrays):
    """One row: forward and forward + backward ms (or the error), and the compiled functions."""
    row = dict(name=name, option=option, dtype=dtype_name, shape=list(shape))
    compiled = None
    try:
        if torch:
            row["forward_ms"] = time_torch(attend, shape, dtype_name, train=False)
            row["train_ms"] = time_torch(attend, shape, dtype_name, train=True)
        else:
            q, k, v, ct = arrays
            fwd, train = forward_and_train(attend)
            row["forward_ms"] = time_jax(fwd, q, k, v)
            row["train_ms"] = time_jax(train, q, k, v, ct)
            compiled = (fwd, train)
    except Exception as error:  # noqa: BLE001 - a row says why a case has no time
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        if torch:
            traceback.print_exc(limit=2)
    print(json.dumps(row), flush=True)
    return row, compiled


def run(args):
    results, started, inputs = [], time.perf_counter(), {}
    checks = {}  # dtype -> "pallas" rows to check against the reference once every time is taken
    for _, dtype_name, shape, name, option, attend, torch in all_cases(args):
        if time.perf_counter() - started > args.budget_s:
            print(f"budget spent: {name} {option} {dtype_name} not run")
            continue
        if dtype_name not in inputs:
            keys = jax.random.split(jax.random.key(0), 4)
            q, k, v, ct = (jax.random.normal(key, shape, jnp.dtype(dtype_name)) for key in keys)
            inputs[dtype_name] = (q, k, v, ct.astype(jnp.float32))
        row, compiled = time_case(dtype_name, shape, name, option, attend, torch, inputs[dtype_name])
        results.append(row)
        if name == "qkv_jax[pallas]" and compiled is not None:
            checks.setdefault(dtype_name, []).append((row, *compiled))
    for dtype_name, rows in checks.items():
        check_pallas(rows, inputs[dtype_name], started, args.budget_s)
    return results


def check_pallas(checks, arrays, started, budget_s):
    """Adds to each "pallas" row (with its compiled functions) its difference from the
    reference path, while the budget lasts: after the timings, which it must not crowd out."""
    for row, fwd, train in checks:
        if time.perf_counter() - started > budget_s:
            print(f"budget spent: {row['name']} {row['option']} not checked")
            continue
        try:
            row["relative_error_vs_reference"] = pallas_errors(row["option"], *arrays, fwd, train)
        except Exception as error:  # noqa: BLE001
            row["check_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        print(json.dumps(row), flush=True)


def error_note(row):
    """The largest relative difference from the reference path of a row that has one."""
    errors = row.get("relative_error_vs_reference")
    return "" if not errors else f"max rel. error vs reference {max(errors.values()):.2e}"


# (name, dtype, (T, S, H, Hv), keyword arguments) of the fused kernel's check against the
# reference path: every option the kernel claims, one at a time, at B2 N4 K2.
KERNEL_CHECKS = [
    ("causal", "bfloat16", (512, 512, 64, 64), dict(is_causal=True)),
    (
        "causal left window (128, 0)",
        "bfloat16",
        (512, 512, 64, 64),
        dict(is_causal=True, local_window_size=(128, 0)),
    ),
    ("two-sided window (64, 64)", "bfloat16", (512, 512, 64, 64), dict(local_window_size=(64, 64))),
    ("segments, causal", "bfloat16", (512, 512, 64, 64), dict(is_causal=True, segments=True)),
    ("sinks, causal", "bfloat16", (512, 512, 64, 64), dict(is_causal=True, sinks=True)),
    ("soft cap 30, causal", "bfloat16", (512, 512, 64, 64), dict(is_causal=True, logits_soft_cap=30.0)),
    ("float32, causal", "float32", (512, 512, 64, 64), dict(is_causal=True)),
    ("MLA widths H 128, Hv 64", "bfloat16", (512, 512, 128, 64), dict(is_causal=True)),
    ("T < S, query offset", "bfloat16", (256, 512, 64, 64), dict(is_causal=True, query_offset=256)),
    ("H 128, full", "bfloat16", (512, 512, 128, 128), {}),
]


def kernel_check_inputs(dtype_name, dims, kwargs, dry_run, seed=0):
    T, S, H, Hv = dims
    if dry_run:  # tiny sizes of the same kind: T < S where T < S, unequal widths where unequal
        T, S = (16, 32) if T < S else (32, 32)
        H, Hv = (16, 8) if H != Hv else (16, 16)
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(dtype_name)
    query = jnp.asarray(rng.normal(size=(2, T, 4, H)), dtype)
    key = jnp.asarray(rng.normal(size=(2, S, 2, H)), dtype)
    value = jnp.asarray(rng.normal(size=(2, S, 2, Hv)), dtype)
    kwargs = dict(kwargs)
    if kwargs.get("query_offset"):
        kwargs["query_offset"] = S - T
    if kwargs.pop("segments", False):
        for name, n in (("query_segment_ids", T), ("key_segment_ids", S)):
            kwargs[name] = jnp.asarray(
                (np.arange(n)[None, :] >= np.array([[n // 3], [2 * n // 3]])).astype(np.int32)
            )
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = jnp.asarray(rng.normal(size=(4,)), jnp.float32)
    if dry_run and "local_window_size" in kwargs:
        kwargs["local_window_size"] = tuple(min(w, 5) for w in kwargs["local_window_size"])
    return (query, key, value), kwargs


def check_kernel_case(kernel, name, dtype_name, dims, kwargs, dry_run):
    """Outputs and gradients (query, key, value, and sinks where given) of `kernel` against the
    reference path on the same inputs, as errors relative to the reference's largest entry."""
    (query, key, value), kwargs = kernel_check_inputs(dtype_name, dims, kwargs, dry_run)
    sinks = kwargs.pop("sinks", None)

    def run(implementation, q, k, v, sinks):
        def loss(q, k, v, sinks):
            extra = {} if sinks is None else {"sinks": sinks}
            out = qkv_jax.dot_product_attention(q, k, v, implementation=implementation, **kwargs, **extra)
            weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
            return jnp.sum(out.astype(jnp.float32) * weights), out

        argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
        return jax.value_and_grad(loss, argnums=argnums, has_aux=True)(q, k, v, sinks)

    (_, out), grads = jax.jit(functools.partial(run, kernel))(query, key, value, sinks)
    (_, want), want_grads = jax.jit(functools.partial(run, "reference"))(query, key, value, sinks)

    def error(got, expected):
        got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
        if not np.isfinite(got).all():
            return float("inf")
        return float(np.max(np.abs(got - expected)) / max(float(np.max(np.abs(expected))), 1e-6))

    tolerance = 2e-2 if dtype_name == "bfloat16" else 2e-3
    errors = dict(
        output=error(out, want),
        **{f"d{n}": error(g, e) for n, g, e in zip("qkvs", grads, want_grads, strict=False)},
    )
    return dict(
        case=name, dtype=dtype_name, errors=errors, tolerance=tolerance, ok=max(errors.values()) <= tolerance
    )


def check_kernel(args):
    """`--check KERNEL`: every KERNEL_CHECKS case; writes the record the dispatch rule reads."""
    jax.config.update("jax_default_matmul_precision", "highest")  # the reference in float32 proper
    rows = []
    for name, dtype_name, dims, kwargs in KERNEL_CHECKS:
        try:
            row = check_kernel_case(args.check, name, dtype_name, dims, kwargs, args.dry_run)
        except Exception as error:  # noqa: BLE001 - every case is reported, then the verdict
            row = dict(
                case=name, ok=False, error=f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            )
        rows.append(row)
        print(("PASS " if row["ok"] else "FAIL ") + json.dumps(row), flush=True)
    record = dict(
        kernel=args.check,
        jax=jax.__version__,
        device=str(jax.devices()[0].device_kind),
        platform=jax.default_backend(),
        date=time.strftime("%Y-%m-%d"),
        ok=all(row["ok"] for row in rows),
        cases=rows,
    )
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"{sum(r['ok'] for r in rows)} of {len(rows)} {args.check} cases match the reference")
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", metavar="KERNEL", help="check KERNEL (an implementation) against the reference"
    )
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.check:
        raise SystemExit(0 if check_kernel(args)["ok"] else 1)
    rows = run(args)
    meta = dict(jax=jax.__version__, devices=[str(d) for d in jax.devices()], date=time.strftime("%Y-%m-%d"))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"{'name':34s} {'option':26s} {'dtype':9s} {'fwd ms':>8s} {'fwd+bwd ms':>10s}")
    for r in rows:
        print(
            f"{r['name']:34s} {r['option']:26s} {r['dtype']:9s} "
            f"{r.get('forward_ms', float('nan')):8.3f} {r.get('train_ms', float('nan')):10.3f} "
            f"{r.get('error', '')[:60]}{error_note(r)}"
        )


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
