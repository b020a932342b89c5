r"""The char LM: KV-cache decoding against recomputation, and training speed against PyTorch.

  python benchmarks/lm.py [--steps 10] [--rounds 3]
  python benchmarks/lm.py --gpu [--dry-run]   # benchmarks/gpu.sh's LM step (lm_gpu.json)

Every measurement runs in a fresh subprocess of this script (`--worker ...`),
once with glibc malloc and once with tcmalloc preloaded
(LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4) when it is installed:

  decode       configs/char_lm.py's model (random weights), batch 1 and 8: greedy
               `generate` of 256 new tokens after a 1-token prompt with the KV cache,
               against a compiled loop that reruns the full causal forward pass over
               the 256-position buffer for every token (both must agree token for token).
  jax-train    tokens/s of `make_train_chunk` (the launcher's compiled chunk, here of
               --steps steps) compiled as `compile_for_platform` does, at XLA CPU
               backend optimization levels 1 (the launcher's) and 2 (XLA's default).
  torch-train  the same architecture in eager PyTorch (AdamW, clipping, same
               corpus windows), tokens/s, with torch's default threads and with 1
               (on a busy machine 2 OpenMP threads can be several times slower than 1).
Models: `char_lm` (configs/char_lm.py: 2 layers, d_model 128, 4 heads,
sequence 256, batch 16) and `small_lm` (issue 6: 2 layers, d_model 128, 4
heads, sequence 128, batch 32, AdamW). Medians over interleaved rounds.
Writes benchmarks/results/lm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.common import PYTHON, ROOT, last_json_line, median, run_timed, write_results  # noqa: E402

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
MODELS = ("char_lm", "small_lm")
NEW_TOKENS = 256
DECODE_BATCHES = (1, 8)


def model_config(name: str) -> dict:
    """configs/char_lm.py, or its issue-6 small-LM shape."""
    from configs import char_lm

    config = char_lm.get_config()
    if name == "small_lm":
        config.task.seq_len = 128
        config.model.max_len = 128
        config.train.batch_size = 32
        config.eval.sample_length = 64
    return config.to_dict()


def timed_median(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return median(times)


def recompute_generate(model, params, prompt, new_tokens: int):
    """Greedy decoding without a cache: every token reruns the full causal pass over the
    `[B, max_len]` buffer and reads the logits at the last filled position."""
    import jax
    import jax.numpy as jnp

    batch, prompt_length = prompt.shape
    buffer = jnp.zeros((batch, model.config.max_len), jnp.int32).at[:, :prompt_length].set(prompt)

    def step(buffer, position):
        logits = model.apply({"params": params}, buffer)  # (B, L, V)
        token = jnp.argmax(logits[:, position - 1], axis=-1).astype(jnp.int32)  # (B,)
        return buffer.at[:, position].set(token, mode="drop"), token

    positions = prompt_length + jnp.arange(new_tokens)
    _, tokens = jax.lax.scan(step, buffer, positions)  # (new_tokens, B)
    return tokens.T  # (B, new_tokens)


def worker_decode() -> dict:
    import jax
    import numpy as np

    from qkv_jax.lm import TransformerLM, generate
    from qkv_jax.training.transformer import make_model

    config = model_config("char_lm")
    model: TransformerLM = make_model(config["model"], vocab_size=config["data"]["max_vocab_size"])
    params = jax.jit(model.init)(jax.random.PRNGKey(0), np.zeros((1, model.config.max_len), np.int32))[
        "params"
    ]
    recompute = jax.jit(recompute_generate, static_argnums=(0, 3))
    results = {}
    for batch in DECODE_BATCHES:
        prompt = np.asarray(jax.random.randint(jax.random.PRNGKey(batch), (batch, 1), 1, model.vocab_size))

        def cached(prompt=prompt):
            return generate(model, params, prompt, NEW_TOKENS, rng=jax.random.PRNGKey(0), temperature=0.0)

        def full(prompt=prompt):
            return recompute(model, params, prompt, NEW_TOKENS)

        same = np.array_equal(np.asarray(cached()), np.asarray(full()))  # compiles both
        cached_s = timed_median(lambda: cached().block_until_ready(), 3)
        full_s = timed_median(lambda: full().block_until_ready(), 3)
        results[f"batch{batch}"] = {
            "kv_cache_s": cached_s,
            "recompute_s": full_s,
            "kv_cache_tokens_per_s": batch * NEW_TOKENS / cached_s,
            "recompute_tokens_per_s": batch * NEW_TOKENS / full_s,
            "speedup": full_s / cached_s,
            "same_tokens": bool(same),
        }
    return results


def initial_training(name: str):
    """(config, setup, data key, initial TrainState) of a model's launcher run."""
    import jax

    from qkv_jax.training import build_setup, init_train_state, make_optimizer, seed_keys

    config = model_config(name)
    setup = build_setup(config)
    tx = make_optimizer(config["train"])
    keys = seed_keys(config["seed"])
    state = jax.jit(lambda key: init_train_state(setup, tx, key))(keys["init"])
    return config, setup, keys["data"], state


def worker_jax_train(name: str, steps: int) -> dict:
    import jax

    from qkv_jax.training import make_train_chunk
    from qkv_jax.training.compiled import CPU_COMPILER_OPTIONS

    config, setup, data_key, state = initial_training(name)
    tokens_per_step = config["train"]["batch_size"] * config["task"]["seq_len"]
    results = {
        "num_params": int(sum(x.size for x in jax.tree.leaves(state.params))),
        "launcher_compiler_options": CPU_COMPILER_OPTIONS,
    }
    for level in (1, 2):
        lowered = jax.jit(make_train_chunk(setup, steps)).lower(state, data_key, setup.data)
        started = time.perf_counter()
        chunk = lowered.compile(compiler_options={"xla_backend_optimization_level": level})
        compile_s = time.perf_counter() - started
        warm, losses = chunk(state, data_key, setup.data)  # the first call pays one-time costs
        losses.block_until_ready()
        run_s = timed_median(
            lambda chunk=chunk, warm=warm: chunk(warm, data_key, setup.data)[1].block_until_ready(), 2
        )
        results[f"opt_level_{level}"] = {
            "compile_s": compile_s,
            "step_s": run_s / steps,
            "tokens_per_s": tokens_per_step * steps / run_s,
        }
    return results


def worker_torch_train(name: str, steps: int, threads: int | None) -> dict:
    import numpy as np
    import torch

    if threads:
        torch.set_num_threads(threads)

    from benchmarks.lm_torch import TorchLM, train_step
    from qkv_jax.training.char_lm import load_corpus

    config = model_config(name)
    _, train_ids, _ = load_corpus(config["data"])
    corpus = torch.from_numpy(train_ids.astype(np.int64))
    model_fields, train = config["model"], config["train"]
    model = TorchLM(
        vocab_size=config["data"]["max_vocab_size"],
        num_layers=model_fields["num_layers"],
        d_model=model_fields["d_model"],
        num_heads=model_fields["num_heads"],
        max_len=model_fields["max_len"],
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=train["learning_rate"], weight_decay=train["weight_decay"]
    )
    batch, seq_len = train["batch_size"], config["task"]["seq_len"]
    generator = torch.Generator().manual_seed(0)

    def run(n):
        for _ in range(n):
            train_step(model, optimizer, corpus, batch, seq_len, train["grad_clip_norm"], generator)

    run(2)  # warm-up
    run_s = timed_median(lambda: run(steps), 2)
    return {
        "num_params": sum(p.numel() for p in model.parameters()),
        "step_s": run_s / steps,
        "tokens_per_s": batch * seq_len * steps / run_s,
        "threads": torch.get_num_threads(),
    }


def gpu_run(steps: int, dry_run: bool) -> None:
    """benchmarks/gpu.sh's LM step: training tokens/s of both models and KV-cache
    decoding, in this process on the default device (plain `jax.jit`; the CPU
    compiler options do not apply). Writes benchmarks/results/lm_gpu.json unless
    `dry_run` (2 steps, any device, nothing written)."""
    import jax
    import numpy as np

    from qkv_jax.lm import generate
    from qkv_jax.training import make_train_chunk
    from qkv_jax.training.transformer import make_model

    steps = 2 if dry_run else steps
    device = jax.devices()[0]
    lines = [
        f"Device: {device.device_kind} ({jax.default_backend()}); float32 parameters; "
        f"{steps} training steps per timed call, median of 3 calls.",
        "",
        "| measurement | tokens/s |",
        "|---|---|",
    ]
    ratios: dict = {}
    for name in MODELS:
        config, setup, data_key, state = initial_training(name)
        chunk = jax.jit(make_train_chunk(setup, steps))
        warm, losses = chunk(state, data_key, setup.data)  # compiles
        losses.block_until_ready()

        def call(chunk=chunk, warm=warm, data_key=data_key, data=setup.data):
            return chunk(warm, data_key, data)[1].block_until_ready()

        run_s = timed_median(call, 3)
        tokens = config["train"]["batch_size"] * config["task"]["seq_len"] * steps
        lines.append(f"| {name} training | {tokens / run_s:.0f} |")
        ratios[f"{name}_training_tokens_per_s"] = tokens / run_s
    config = model_config("char_lm")
    model = make_model(config["model"], vocab_size=config["data"]["max_vocab_size"])
    params = jax.jit(model.init)(jax.random.PRNGKey(0), np.zeros((1, model.config.max_len), np.int32))[
        "params"
    ]
    new_tokens = 8 if dry_run else NEW_TOKENS
    for batch in DECODE_BATCHES:
        prompt = np.ones((batch, 1), np.int32)

        def decode(prompt=prompt):
            return generate(model, params, prompt, new_tokens, rng=jax.random.PRNGKey(0), temperature=0.0)

        decode().block_until_ready()  # compiles
        seconds = timed_median(lambda decode=decode: decode().block_until_ready(), 3)
        lines.append(f"| char_lm KV-cache decoding, batch {batch} | {batch * new_tokens / seconds:.0f} |")
        ratios[f"char_lm_decode_batch{batch}_tokens_per_s"] = batch * new_tokens / seconds
    print("\n".join(lines))
    if dry_run:
        print("dry run: nothing written")
        return
    path = write_results(
        "lm_gpu",
        f"python benchmarks/lm.py --gpu --steps {steps}",
        {"title": "LM on a GPU (benchmarks/gpu.sh)", "table": lines, "ratios": ratios},
    )
    print(f"wrote {path}")


def spawn(args: list[str], tcmalloc: bool) -> dict:
    env = {"PYTHONPATH": str(ROOT), "LD_PRELOAD": TCMALLOC if tcmalloc else ""}
    _, out = run_timed([PYTHON, "benchmarks/lm.py", *args], env=env)
    return last_json_line(out)


def one_round(tcmalloc: bool, steps: int, have_torch: bool) -> dict:
    """Every measurement once, each in its own subprocess."""
    results = {"decode": spawn(["--worker", "decode"], tcmalloc)}
    for name in MODELS:
        args = ["--model", name, "--steps", str(steps)]
        results[name] = {"jax": spawn(["--worker", "jax-train", *args], tcmalloc)}
        if have_torch:
            results[name]["torch"] = spawn(["--worker", "torch-train", *args], tcmalloc)
            results[name]["torch_1_thread"] = spawn(
                ["--worker", "torch-train", *args, "--threads", "1"], tcmalloc
            )
    return results


def tree_median(rounds: list) -> dict:
    """The per-leaf median of equally shaped result dicts (non-numbers from the first)."""
    first = rounds[0]
    if isinstance(first, dict):
        return {key: tree_median([r[key] for r in rounds]) for key in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return median(rounds)
    return first


def table(results: dict, allocators: list[str], have_torch: bool) -> list[str]:
    """Markdown: one row per measurement, one column per allocator."""
    rows = []  # (label, path into a per-allocator result, format)
    for batch in DECODE_BATCHES:
        decode = ("decode", f"batch{batch}")
        label = f"decode {NEW_TOKENS} tokens, batch {batch}"
        rows += [
            (f"{label}: KV cache (tokens/s)", (*decode, "kv_cache_tokens_per_s"), "{:.0f}"),
            (f"{label}: recompute per token (tokens/s)", (*decode, "recompute_tokens_per_s"), "{:.0f}"),
            (f"{label}: KV-cache speedup", (*decode, "speedup"), "{:.1f}x"),
        ]
    for name in MODELS:
        for level in (1, 2):
            level_key = (name, "jax", f"opt_level_{level}")
            rows += [
                (
                    f"{name} training, qkv_jax opt level {level} (tokens/s)",
                    (*level_key, "tokens_per_s"),
                    "{:.0f}",
                ),
                (
                    f"{name} training, qkv_jax opt level {level} compile (s)",
                    (*level_key, "compile_s"),
                    "{:.1f}",
                ),
            ]
        peers = (
            (("torch", "eager PyTorch"), ("torch_1_thread", "eager PyTorch, 1 thread")) if have_torch else ()
        )
        rows += [
            (f"{name} training, {label} (tokens/s)", (name, peer, "tokens_per_s"), "{:.0f}")
            for peer, label in peers
        ]

    def get(tree, path):
        for key in path:
            tree = tree[key]
        return tree

    lines = ["| measurement | " + " | ".join(allocators) + " |", "|---|" + "---|" * len(allocators)]
    for label, path, fmt in rows:
        lines.append(
            f"| {label} | " + " | ".join(fmt.format(get(results[a], path)) for a in allocators) + " |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps per timed call")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--worker", choices=("decode", "jax-train", "torch-train"))
    parser.add_argument("--model", choices=MODELS, default="char_lm")
    parser.add_argument("--threads", type=int, help="torch-train: torch.set_num_threads")
    parser.add_argument("--gpu", action="store_true", help="benchmarks/gpu.sh's step, in-process")
    parser.add_argument("--dry-run", action="store_true", help="with --gpu: 2 steps, any device, no file")
    args = parser.parse_args()
    if args.gpu:
        gpu_run(args.steps, args.dry_run)
        return
    if args.worker == "decode":
        print(json.dumps(worker_decode()))
        return
    if args.worker == "jax-train":
        print(json.dumps(worker_jax_train(args.model, args.steps)))
        return
    if args.worker == "torch-train":
        print(json.dumps(worker_torch_train(args.model, args.steps, args.threads)))
        return

    allocators = ["glibc"] + (["tcmalloc"] if os.path.exists(TCMALLOC) else [])
    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
    rounds = []
    for round_ in range(args.rounds):  # interleaved, so that a busy spell hits every row alike
        rounds.append({a: one_round(a == "tcmalloc", args.steps, have_torch) for a in allocators})
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    results = tree_median(rounds)

    ratios = {}
    for allocator in allocators:
        r = results[allocator]
        for batch in DECODE_BATCHES:
            ratios[f"{allocator}/decode_kv_cache_speedup_batch{batch}"] = r["decode"][f"batch{batch}"][
                "speedup"
            ]
        for name in MODELS:
            jax_level_1 = r[name]["jax"]["opt_level_1"]
            ratios[f"{allocator}/{name}_opt_level_1_over_2_tokens_per_s"] = (
                jax_level_1["tokens_per_s"] / r[name]["jax"]["opt_level_2"]["tokens_per_s"]
            )
            if have_torch:
                for peer in ("torch", "torch_1_thread"):
                    ratios[f"{allocator}/{name}_jax_over_{peer}_tokens_per_s"] = (
                        jax_level_1["tokens_per_s"] / r[name][peer]["tokens_per_s"]
                    )
    if "tcmalloc" in results:
        for name in MODELS:
            ratios[f"{name}_jax_tcmalloc_over_glibc_tokens_per_s"] = (
                results["tcmalloc"][name]["jax"]["opt_level_1"]["tokens_per_s"]
                / results["glibc"][name]["jax"]["opt_level_1"]["tokens_per_s"]
            )
    lines = table(results, allocators, have_torch)
    print("\n".join(lines))
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    path = write_results(
        "lm",
        f"python benchmarks/lm.py --steps {args.steps} --rounds {args.rounds}",
        {
            "table": lines,
            "ratios": ratios,
            "results": results,
            "rounds": rounds,
            "new_tokens": NEW_TOKENS,
            "steps": args.steps,
        },
    )
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
