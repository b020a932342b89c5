r"""Peak memory of qkv_jax's run_with_cache on a random Qwen2.5-0.5B-shaped model, float32 on the
CPU: one layer's hook_pattern, every hook name, TransformerLens's default names, and
transformers' forward with hidden states and attentions.

  python benchmarks/cache_memory.py [--tokens 512] [--layer 12]

transformers writes the checkpoint (benchmarks/versus_transformers.py's SHAPE: 24 layers,
d_model 896, 14/2 heads of 64, MLP 4864, a 151936-token vocabulary) into a temporary
directory and reads it once into the page cache; qkv_jax reads it with
`qkv_jax.load_pretrained`. Each case runs in a fresh process: imports, its resident memory
(VmRSS, the baseline), the load, a first call (qkv_jax: its compile), a second call once the
first call's arrays are released (`versus_transformers.settle`); reported
is the peak resident memory of the whole process (VmHWM) above the baseline, beside the
parameters' bytes and the bytes the call returns.

  one_pattern   jax.jit(run_with_cache, names_filter="blocks.{layer}.attn.hook_pattern")
  every_hook    jax.jit(run_with_cache) with every hook name (hook_result and
                hook_pre_linear included)
  lens_default  every hook name but hook_result (TransformerLens computes it only with
                use_attn_result set)
  as_transformers   the arrays transformers returns below: every layer's hook_resid_pre,
                the last layer's hook_resid_post and every hook_pattern (49 arrays; the last
                hidden state transformers returns is after the final norm, ours before it)
  transformers  the eager forward (`attn_implementation="eager"`, `torch.no_grad()`) with
                `output_hidden_states=True, output_attentions=True`

The goals: one_pattern's peak at most the parameters + 1.2x the returned arrays + 1 GiB;
every_hook's peak at most 1.5x transformers'. Writes benchmarks/results/cache_memory.json
(docs/benchmarks.md is rendered from it by `python -m benchmarks.report`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.common import PYTHON, ROOT, last_json_line, write_results  # noqa: E402
from benchmarks.versus_transformers import (  # noqa: E402
    SHAPE,
    settle,
    status_bytes,
    tokens_of,
    transformers_cache,
    write_checkpoint,
)

CASES = ("one_pattern", "every_hook", "lens_default", "as_transformers", "transformers")
GIB = 2**30


def names_filter(case: str, layer: int):
    if case == "one_pattern":
        return f"blocks.{layer}.attn.hook_pattern"
    if case == "lens_default":
        return lambda name: not name.endswith("hook_result")
    if case == "as_transformers":
        last = f"blocks.{SHAPE['num_hidden_layers'] - 1}.hook_resid_post"
        return lambda name: name.endswith(("hook_resid_pre", "hook_pattern")) or name == last
    return None


def qkv_jax_call(case: str, directory: str, tokens, layer: int):
    import functools

    import jax

    import qkv_jax
    from qkv_jax.interpretability import run_with_cache

    config, params = qkv_jax.load_pretrained(directory)
    variables = {"params": params}
    run = jax.jit(
        functools.partial(
            run_with_cache, qkv_jax.TransformerLM(config), names_filter=names_filter(case, layer)
        )
    )

    def call() -> dict:
        logits, cache = jax.block_until_ready(run(variables, tokens))
        return {
            "parameter_bytes": sum(a.nbytes for a in jax.tree.leaves(params)),
            "names": len(cache),
            "output_bytes": logits.nbytes + sum(a.nbytes for a in cache.values()),
        }

    return call


def measure(case: str, directory: str, count: int, layer: int) -> dict:
    """In this (fresh) process: imports, the baseline, the load and two calls; the peak above it."""
    if case == "transformers":
        import transformers  # noqa: F401
        from transformers.models.qwen2 import modeling_qwen2  # noqa: F401
    else:
        import jax

        import qkv_jax.interpretability  # noqa: F401

        jax.devices()  # the CPU client exists before the baseline
    tokens = tokens_of(count, SHAPE["vocab_size"])
    baseline = status_bytes("VmRSS")
    call = (
        transformers_cache(directory, tokens)[0]
        if case == "transformers"
        else qkv_jax_call(case, directory, tokens, layer)
    )
    call()
    settle()  # the first call's arrays released: the peak is one call's, not two overlapping
    info = call()
    return {**info, "peak_above_baseline_bytes": status_bytes("VmHWM") - baseline}


def child(args: list[str]) -> dict:
    result = subprocess.run([PYTHON, __file__, *args], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])} failed:\n{result.stderr[-3000:]}")
    return last_json_line(result.stdout)


def report(args, runs: dict[str, dict]) -> None:
    def gib(value: float) -> str:
        return f"{value / GIB:.2f}"

    one, every, theirs = runs["one_pattern"], runs["every_hook"], runs["transformers"]
    one_allowed = one["parameter_bytes"] + 1.2 * one["output_bytes"] + GIB
    table = [
        f"One forward pass of {args.tokens} tokens (batch 1) on a random Qwen2.5-0.5B-shaped checkpoint "
        "written by transformers (24 layers, d_model 896, 14/2 heads of 64, MLP 4864, 151936-token "
        "vocabulary), float32, read by qkv_jax.load_pretrained; each case in a fresh process, its peak "
        "resident memory (load, compile, two calls, the second once the first call's arrays are released) "
        "above its memory after imports. one_pattern: "
        f'names_filter="blocks.{args.layer}.attn.hook_pattern"; every_hook: every hook name; '
        "lens_default: every name but hook_result (TransformerLens's default); as_transformers: every "
        "hook_resid_pre, the last hook_resid_post and every hook_pattern (what transformers returns); "
        "transformers: the eager "
        "forward with output_hidden_states and output_attentions.",
        "",
        "| case | arrays returned | parameters (GiB) | returned (GiB) | peak (GiB) "
        "| peak - parameters - returned (GiB) |",
        "|---|---|---|---|---|---|",
        *(
            f"| {case} | {r['names']} | {gib(r['parameter_bytes'])} | {gib(r['output_bytes'])} | "
            f"{gib(r['peak_above_baseline_bytes'])} | "
            f"{gib(r['peak_above_baseline_bytes'] - r['parameter_bytes'] - r['output_bytes'])} |"
            for case, r in runs.items()
        ),
    ]
    ratios = {
        "one_pattern peak / (parameters + 1.2x returned + 1 GiB) (goal <= 1)": one[
            "peak_above_baseline_bytes"
        ]
        / one_allowed,
        "every_hook peak / transformers' (goal <= 1.5)": every["peak_above_baseline_bytes"]
        / theirs["peak_above_baseline_bytes"],
        "as_transformers peak / transformers' (the same arrays)": (
            runs["as_transformers"]["peak_above_baseline_bytes"] / theirs["peak_above_baseline_bytes"]
        ),
        "lens_default peak / transformers'": (
            runs["lens_default"]["peak_above_baseline_bytes"] / theirs["peak_above_baseline_bytes"]
        ),
        "every_hook returned / transformers' returned": every["output_bytes"] / theirs["output_bytes"],
        "every_hook's floor (parameters + returned) / transformers' peak": (
            (every["parameter_bytes"] + every["output_bytes"]) / theirs["peak_above_baseline_bytes"]
        ),
    }
    print("\n".join(table))
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    command = f"python benchmarks/cache_memory.py --tokens {args.tokens} --layer {args.layer}"
    title = "run_with_cache's peak memory: one hook, every hook, and transformers (CPU)"
    path = write_results(
        "cache_memory", command, {"title": title, "table": table, "ratios": ratios, "runs": runs}
    )
    print(f"wrote {path.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--layer", type=int, default=12)
    parser.add_argument("--child", nargs=2, metavar=("CASE", "DIRECTORY"), help=argparse.SUPPRESS)
    parser.add_argument("--write", metavar="DIRECTORY", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], args.tokens, args.layer)))
        return
    if args.write:
        write_checkpoint(pathlib.Path(args.write))
        return
    with tempfile.TemporaryDirectory(prefix="cache_memory_") as folder:
        directory = str(pathlib.Path(folder) / "qwen2")
        subprocess.run([PYTHON, __file__, "--write", directory], cwd=ROOT, check=True)
        for path in pathlib.Path(directory).glob("*.safetensors"):  # into the page cache, for every case
            path.read_bytes()
        runs = {}
        for case in CASES:
            runs[case] = child(
                ["--child", case, directory, "--tokens", str(args.tokens), "--layer", str(args.layer)]
            )
            print(case, f"{runs[case]['peak_above_baseline_bytes'] / GIB:.2f} GiB", flush=True)
    report(args, runs)


if __name__ == "__main__":
    main()
