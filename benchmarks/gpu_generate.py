r"""Greedy generation on the GPU: qkv_jax beside transformers' `generate`, and both against the
bound of reading the weights once per decode step (benchmarks/gpu_check.sh's generation step).

  python benchmarks/gpu_generate.py [--out DIR] [--batches 1,16] [--new 128] [--dry-run]

transformers writes the random Qwen2.5-0.5B-shaped checkpoint of benchmarks/versus_transformers.py
in bfloat16 (`--dry-run`: a 2-layer model of the same family, 8 new tokens, any device). Both
libraries read it in bfloat16 onto the default device: `qkv_jax.load_pretrained(dir,
dtype=jnp.bfloat16)` and `qkv_jax.generate(..., temperature=0.0)` against transformers'
`AutoModelForCausalLM.from_pretrained(dir, dtype=torch.bfloat16).to("cuda")` and
`generate(do_sample=False)`, both with no end-of-text, 16-token prompts, `--new` new tokens. Each
call runs once (qkv_jax compiles), then `--steps` timed calls; new tokens/s = batch * new tokens
/ the median call (the prefill included).

The bound: a decode step reads every weight once, so at most `bandwidth / weight bytes` steps/s,
`batch` tokens each. The bandwidth is measured here: the median time of `x + 1` on a 2 GiB
bfloat16 array (one read and one write of it) on the same device. Prints a table (its lines
start with "|" or "Device", as gpu_summary.py reads them) and writes DIR/generate_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # room for torch beside jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

PROMPT = 16
DRY_SHAPE = dict(num_hidden_layers=2, hidden_size=112, intermediate_size=256, vocab_size=1024)


def write_model(directory: pathlib.Path, dry_run: bool) -> None:
    """The Qwen2.5-0.5B-shaped random checkpoint in bfloat16 (`dry_run`: DRY_SHAPE's fields)."""
    import torch
    import transformers

    from benchmarks.versus_transformers import SHAPE

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**{**SHAPE, **(DRY_SHAPE if dry_run else {})})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)


def bandwidth(dry_run: bool) -> float:
    """Bytes/s of the default device: `x + 1` on a bfloat16 array (2 GiB; dry run 64 MiB) reads
    and writes it once; the median of 10 calls."""
    import jax
    import jax.numpy as jnp

    size = (64 if dry_run else 2048) << 20
    x = jnp.zeros(size // 2, jnp.bfloat16)
    add = jax.jit(lambda x: x + 1)
    add(x).block_until_ready()
    times = []
    for _ in range(10):
        started = time.perf_counter()
        add(x).block_until_ready()
        times.append(time.perf_counter() - started)
    return 2 * size / statistics.median(times)


def timed(call, steps: int) -> dict:
    """The first call's seconds and the median of `steps` more."""
    started = time.perf_counter()
    first = call()
    first_s = time.perf_counter() - started
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return {"first_s": first_s, "seconds": statistics.median(times), "tokens": first}


def qkv_jax_runs(directory: str, prompts: dict, new: int, steps: int) -> tuple[dict, int]:
    """qkv_jax's timings per batch, and the bytes of its weights."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import qkv_jax

    config, params = qkv_jax.load_pretrained(directory, dtype=jnp.bfloat16)
    params = jax.device_put(params)
    model = qkv_jax.TransformerLM(config)
    weight_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
    runs = {}
    for batch, tokens in prompts.items():
        runs[batch] = timed(
            lambda tokens=tokens: np.asarray(qkv_jax.generate(model, params, tokens, new, temperature=0.0)),
            steps,
        )
        rate = batch * new / runs[batch]["seconds"]  # printed as it comes, should a timeout cut the rest
        print(
            f"qkv_jax batch {batch}: {rate:.0f} new tokens/s, first call {runs[batch]['first_s']:.1f} s",
            flush=True,
        )
    return runs, weight_bytes


def transformers_runs(directory: str, prompts: dict, new: int, steps: int) -> dict:
    """transformers' timings per batch on CUDA (empty without CUDA or transformers)."""
    try:
        import torch
        import transformers
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    model = model.to("cuda").eval()

    def call(tokens):
        inputs = torch.from_numpy(tokens).long().to("cuda")
        with torch.no_grad():
            out = model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                eos_token_id=None,
                pad_token_id=0,
            )
        torch.cuda.synchronize()
        return out[:, tokens.shape[1] :].cpu().numpy()

    return {batch: timed(lambda tokens=tokens: call(tokens), steps) for batch, tokens in prompts.items()}


def table(
    device: str, bytes_per_s: float, weight_bytes: int, new: int, ours: dict, theirs: dict
) -> list[str]:
    """The summary lines: tokens/s per batch, beside transformers' and the bound."""
    steps_bound = bytes_per_s / weight_bytes  # decode steps/s when each reads the weights once
    lines = [
        f"Device {device}: measured bandwidth {bytes_per_s / 1e9:.0f} GB/s, weights "
        f"{weight_bytes / 1e6:.1f} MB (bfloat16), so at most {steps_bound:.0f} decode steps/s",
        "",
        "| greedy generation, bfloat16 | qkv_jax tokens/s | transformers tokens/s | bound tokens/s "
        "| qkv_jax / bound | qkv_jax / transformers | qkv_jax first call (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch, run in ours.items():
        rate = batch * new / run["seconds"]
        peer = batch * new / theirs[batch]["seconds"] if batch in theirs else None
        bound = batch * steps_bound
        peer_cells = f"{peer:.0f} | " if peer else "not run | "
        ratio = f"{rate / peer:.2f}x" if peer else "-"
        lines.append(
            f"| batch {batch}, {new} new tokens | {rate:.0f} | {peer_cells}{bound:.0f} | "
            f"{rate / bound:.1%} | {ratio} | {run['first_s']:.1f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="the folder for generate_gpu.json")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--new", type=int, default=128, help="new tokens per row")
    parser.add_argument("--steps", type=int, default=3, help="timed calls after the first")
    parser.add_argument("--dry-run", action="store_true", help="a 2-layer model, 8 new tokens")
    args = parser.parse_args()
    import jax
    import numpy as np

    new = 8 if args.dry_run else args.new
    vocab = DRY_SHAPE["vocab_size"] if args.dry_run else 151936
    rng = np.random.default_rng(1)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = {b: rng.integers(0, vocab, size=(b, PROMPT), dtype=np.int32) for b in batches}
    with tempfile.TemporaryDirectory(prefix="gpu_generate_") as directory:
        write_model(pathlib.Path(directory), args.dry_run)
        ours, weight_bytes = qkv_jax_runs(directory, prompts, new, args.steps)
        theirs = transformers_runs(directory, prompts, new, args.steps)
    agree = {b: bool(np.array_equal(ours[b]["tokens"], theirs[b]["tokens"])) for b in theirs}
    device = str(jax.devices()[0].device_kind)
    lines = table(device, bandwidth(args.dry_run), weight_bytes, new, ours, theirs)
    lines += ["", f"Greedy tokens equal transformers' (greedy, bfloat16), by batch: {agree or 'not run'}"]
    print("\n".join(lines))
    drop = {"tokens"}
    record = {
        "device": device,
        "table": lines,
        "qkv_jax": {b: {k: v for k, v in r.items() if k not in drop} for b, r in ours.items()},
        "transformers": {b: {k: v for k, v in r.items() if k not in drop} for b, r in theirs.items()},
        "weight_bytes": weight_bytes,
        "tokens_equal": agree,
    }
    pathlib.Path(args.out, "generate_gpu.json").write_text(json.dumps(record, indent=2, default=str))


if __name__ == "__main__":
    main()
