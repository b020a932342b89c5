r"""A decode step's attention on CPU: one query over a long KV cache, side by side with torch.

  python benchmarks/decode_attention.py [--rounds 15]

Attention alone, float32, one query (T = 1) over S cached keys, all of them visible: the
attention of Qwen2.5-0.5B (14 query heads and 2 K/V heads of 64) at batch 1 and 8, S from
128 to 16384. Side by side in one process, each call after a warm-up, interleaved in rounds,
medians:
  qkv_jax        qkv_jax.dot_product_attention(q, k, v, is_causal=True, query_offset=S - 1),
                 implementation=None (on CPU the chunked path, its tiles by `block_sizes`)
  one tile       the same call, in a second process that runs the same cases, under the
                 chunked path's previous tile rule, which made this one tile of all S keys:
                 it counted the tile's logits, not its copies of K and V
  jax.nn         jax.jit(jax.nn.dot_product_attention) on the same arrays
  torch          torch's scaled_dot_product_attention in its [B, N, T, H] layout (enable_gqa),
                 on as many threads as JAX has cores

Then a whole decode step of a Qwen2.5-0.5B-shaped TransformerLM (random weights, 24 layers,
float32, batch 8) by cache length: `qkv_jax.generation.linen_step` on a cache of that many
positions, with today's tile rule and with the one-tile rule it replaced (the chunked path's
`block_sizes` called without the copies' width). Writes benchmarks/results/decode_attention.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import write_results  # noqa: E402
from benchmarks.versus_transformers import SHAPE  # noqa: E402

BATCHES, LENGTHS = (1, 8), (128, 1024, 4096, 16384)
N, K, H = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], 64  # Qwen2.5-0.5B's attention
STEP_LENGTHS = (128, 1024, 4096)
QWEN = dict(SHAPE, model_type="qwen2", architectures=["Qwen2ForCausalLM"])  # a config.json of it


def timed(call, rounds: int) -> float:
    """Median seconds of `call()` over `rounds` calls after a warm-up (each blocks until done)."""
    call()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@contextlib.contextmanager
def previous_rule():
    """The chunked path's tile rule before it counted the tile's copies of K and V: `block_sizes`
    without `key_width` (read when a call is traced)."""
    from qkv_jax.attention import chunked

    rule = chunked.block_sizes
    chunked.block_sizes = lambda *args, key_width=None, **keywords: rule(*args, **keywords)
    try:
        yield
    finally:
        chunked.block_sizes = rule


def attention_calls(batch: int, length: int) -> dict:
    """The calls of one case (qkv_jax's, jax.nn's and torch's), each returning when its result is
    ready."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from qkv_jax.attention.function import dot_product_attention

    rng = np.random.default_rng(0)
    q = rng.standard_normal((batch, 1, N, H), np.float32)
    k, v = (rng.standard_normal((batch, length, K, H), np.float32) for _ in range(2))
    arrays = [jnp.asarray(x) for x in (q, k, v)]
    offset = jnp.int32(length - 1)
    ours = jax.jit(lambda q, k, v, o: dot_product_attention(q, k, v, is_causal=True, query_offset=o))
    plain = jax.jit(jax.nn.dot_product_attention)
    tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v))  # [B, N|K, T|S, H]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return {
        "qkv_jax": lambda: ours(*arrays, offset).block_until_ready(),
        "jax.nn": lambda: plain(*arrays).block_until_ready(),
        "torch": lambda: sdpa(tq, tk, tv, enable_gqa=True),
    }


def attention_cases(rounds: int) -> dict:
    """Median ms of each call per (batch, cache length), the calls interleaved round by round."""
    results = {}
    for batch in BATCHES:
        for length in LENGTHS:
            calls = attention_calls(batch, length)
            for call in calls.values():
                call()  # compile
            times = {name: [] for name in calls}
            for _ in range(rounds):
                for name, call in calls.items():
                    times[name].append(timed(call, 1))
            results[f"B{batch} S{length}"] = {name: 1e3 * statistics.median(t) for name, t in times.items()}
            print(batch, length, json.dumps(results[f"B{batch} S{length}"]), flush=True)
    return results


def decode_step_ms(rounds: int) -> dict:
    """ms of one decode step of the Qwen2.5-0.5B-shaped model at batch 8 by cache length."""
    import jax
    import jax.numpy as jnp

    from qkv_jax import generation
    from qkv_jax.lm import TransformerLM
    from qkv_jax.pretrained.io import load_config

    with tempfile.TemporaryDirectory() as folder:
        pathlib.Path(folder, "config.json").write_text(json.dumps(QWEN))
        config, _ = load_config(folder)
    model = TransformerLM(config)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"]
    step = jax.jit(generation.linen_step(model, params), donate_argnums=0)  # in place, as in generate
    token, results = jnp.ones((8, 1), jnp.int32), {}
    for length in STEP_LENGTHS:
        filled = length - rounds - 2  # slots written so far (zeros serve): every step adds one
        state = {"cache": generation.zeroed_cache(model, 8, length)}
        state["cache"] = jax.tree_util.tree_map_with_path(
            lambda path, x, filled=filled: jnp.full_like(x, filled) if path[-1].key == "cache_index" else x,
            state["cache"],
        )

        def call(state=state):
            state["cache"] = jax.block_until_ready(step(state["cache"], token)[1])

        results[length] = 1e3 * timed(call, rounds)
        print("decode step", length, f"{results[length]:.1f} ms", flush=True)
    return results


def key_blocks(case: str) -> tuple[int, int]:
    """The chunked path's key block for a case ("B8 S4096") under today's tile rule and before."""
    from qkv_jax.attention.chunked import block_sizes

    batch, length = (int(part[1:]) for part in case.split())
    today = block_sizes(batch * N, 1, length, key_width=batch * K * 2 * H)[1]
    return today, block_sizes(batch * N, 1, length)[1]


def table(runs: dict) -> tuple[list[str], dict]:
    """The markdown table and the ratios of the two processes' results (`runs[rule]`)."""
    ours, before = runs["qkv_jax"]["attention"], runs["one tile"]["attention"]
    cases = [f"B{batch} S{length}" for batch in BATCHES for length in LENGTHS]
    attention = {case: {**ours[case], "one tile": before[case]["qkv_jax"]} for case in cases}
    steps = {rule: run["steps"] for rule, run in runs.items()}
    lines = [
        "| batch, cache length | key block (today, before) | qkv_jax (ms) | one tile (ms) | jax.nn (ms) "
        "| torch (ms) | qkv_jax / torch | qkv_jax / one tile |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ratios, same_program = {}, []
    for case, ms in attention.items():
        today, before = key_blocks(case)
        times = " | ".join(f"{ms[name]:.3f}" for name in ("qkv_jax", "one tile", "jax.nn", "torch"))
        lines.append(
            f"| {case} | {today}, {before} | {times} | {ms['qkv_jax'] / ms['torch']:.2f} "
            f"| {ms['qkv_jax'] / ms['one tile']:.2f} |"
        )
        ratios[f"attention {case}: qkv_jax / torch"] = ms["qkv_jax"] / ms["torch"]
        ratios[f"attention {case}: qkv_jax / one tile"] = ms["qkv_jax"] / ms["one tile"]
        if today == before:
            same_program.append(ms["qkv_jax"] / ms["one tile"])
    if same_program:
        lines += [
            "",
            "Where both rules choose the same key block, the two columns time one program in two "
            f"processes: their ratios, {min(same_program):.2f} to {max(same_program):.2f}, are this "
            "machine's spread between processes.",
        ]
    lines += [
        "",
        "A decode step of the Qwen2.5-0.5B-shaped model (24 layers, float32, batch 8, random weights):",
        "",
        "| cache length | qkv_jax (ms) | one tile (ms) | ratio |",
        "|---|---|---|---|",
    ]
    for length in STEP_LENGTHS:
        ours, before = steps["qkv_jax"][str(length)], steps["one tile"][str(length)]
        lines.append(f"| {length} | {ours:.1f} | {before:.1f} | {ours / before:.2f} |")
        ratios[f"decode step, cache {length}: qkv_jax / one tile"] = ours / before
    return lines, ratios


def child(args) -> None:
    """One process under one tile rule: the attention cases and the decode steps; prints them as
    JSON on its last line."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    # Both processes run the peers too: torch's threads keep spinning after its calls, and the
    # JAX calls beside them must meet the same neighbours under either rule.
    with contextlib.nullcontext() if args.rule == "qkv_jax" else previous_rule():
        attention = attention_cases(args.rounds)
        steps = decode_step_ms(max(args.rounds // 3, 3))
    print(json.dumps({"attention": attention, "steps": steps}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--rule", choices=("qkv_jax", "one tile"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rule:
        child(args)
        return
    import subprocess

    runs = {}
    for rule in ("qkv_jax", "one tile"):  # a process each: JAX keeps what it traced under a rule
        command = [sys.executable, __file__, "--rounds", str(args.rounds), "--rule", rule]
        output = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout
        runs[rule] = json.loads(output.strip().splitlines()[-1])
    lines, ratios = table(runs)
    print("\n".join(lines))
    path = write_results(
        "decode_attention",
        f"python benchmarks/decode_attention.py --rounds {args.rounds}",
        {
            "title": "A decode step's attention over a long cache (CPU)",
            "table": [__doc__.split("\n\n")[1].replace("\n", " "), "", *lines],
            "ratios": ratios,
            "runs": runs,
        },
    )
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
