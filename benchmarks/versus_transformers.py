r"""qkv_jax beside transformers on a random Qwen2.5-0.5B-shaped model, float32 on the CPU: a forward
pass with every activation cached, one LoRA fine-tuning step, and greedy generation.

  pip install peft   # transformers' side of the LoRA step (a benchmark-only dependency)
  python benchmarks/versus_transformers.py [--parts cache,lora] [--rounds 2] [--tokens 512] [--steps 3]

The results in docs/benchmarks.md came from `--parts cache --rounds 1 --steps 2` and `--parts lora
--rounds 1 --steps 2 --tokens 256` (the LoRA step at 256 tokens and one round of each to fit the
time a shared 2-core machine allowed; each results file records its command).

transformers builds the model (Qwen2Config with Qwen2.5-0.5B's fields set explicitly: 24 layers,
d_model 896, 14 query and 2 key/value heads of 64, MLP 4864, a 151936-token vocabulary, tied
embeddings, RoPE theta 1e6, q/k/v biases; random weights) and saves it in safetensors to a
temporary directory; qkv_jax reads it with `qkv_jax.load_pretrained`, so both compute with the
same weights. A check process first compares both libraries' logits on 16 tokens.

The measurements, each case in a fresh process, alternating for `--rounds` rounds:

  cache  qkv_jax: `jax.jit(functools.partial(run_with_cache, model))(variables, tokens)`, every
         hook name (hook_attn_scores and hook_pattern of every head included), as
         docs/interpretability.md shows it. transformers: the eager forward
         (`attn_implementation="eager"`, `torch.no_grad()`) with
         `output_hidden_states=True, output_attentions=True`.
  lora   one step: forward, backward and AdamW on rank-8 adapters (alpha 16) of the q/k/v/o
         projections, next-token cross-entropy on batch 1 of `--tokens` tokens. qkv_jax:
         TransformerConfig(lora_rank=8, lora_targets=("query", "key", "value", "out")), the
         adapters initialised by the model's init (nothing else of it computed), a jitted step
         differentiating the adapters only, optax.adamw, adapters and optimizer state donated.
         transformers: peft's `LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj",
         "k_proj", "v_proj", "o_proj"])` on the model as from_pretrained loads it (its default
         attention), torch.optim.AdamW.
  generate  (`--parts generate` alone; `--disk_dtype bfloat16` writes the checkpoint in bfloat16,
         both libraries read it as float32) greedy generation of 32 new tokens after 16-token
         prompts at each of `--batches`: `qkv_jax.generate` on the model as `load_pretrained`
         reads it (max_len 32768, the cache sized to the request) against transformers'
         `generate(do_sample=False)`, both with no end-of-text; then the command line
         (experiments.generate) twice on the tests' tiny Llama checkpoint with an empty
         persistent compilation cache: the time to the first new token of each run. Writes
         benchmarks/results/generate_vs_transformers.json.

Each process imports its library, notes its resident memory (VmRSS, the baseline), loads the
model, runs the call once (qkv_jax: compile and run; transformers: its first call), then
`--steps` timed calls. Reported: the median call time (median over rounds of each process's
median), the first call's time, and two peaks of resident memory above the baseline: the whole
process (load, compile, calls) and the timed calls alone (VmHWM reset through
/proc/self/clear_refs after the first call). Threads: both libraries get the machine's cores
(2 here): torch by `torch.set_num_threads(os.cpu_count())`, XLA by its default (its CPU client
runs one thread per core; XLA_FLAGS is empty). qkv_jax runs as a library user gets it (glibc's
malloc) and, when tcmalloc is installed, with tcmalloc preloaded as the repository's launchers
do (experiments/allocator.py). Writes benchmarks/results/cache_vs_transformers.json and
benchmarks/results/lora_vs_transformers.json (docs/benchmarks.md is rendered from them by
`python -m benchmarks.report`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.common import PYTHON, ROOT, last_json_line, median, write_results  # noqa: E402

# Qwen2.5-0.5B's shape (transformers' Qwen2Config fields; its defaults are Qwen2-7B-like, so every
# field that differs is set).
SHAPE = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    hidden_act="silu",
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    use_sliding_window=False,
    attention_dropout=0.0,
)
HEAD_DIM = 64  # hidden_size / num_attention_heads; Qwen2's q/k/v projections always have biases
LORA_RANK, LORA_ALPHA, LEARNING_RATE = 8, 16.0, 1e-4
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
CASES = {
    "cache": ("qkv_jax", "qkv_jax_tcmalloc", "transformers"),
    "lora": ("qkv_jax", "qkv_jax_tcmalloc", "transformers"),
    "generate": ("qkv_jax", "transformers"),
}
CHECK_TOKENS = 16
GENERATE_PROMPT, GENERATE_NEW = 16, 32  # greedy generation: prompt tokens, new tokens


def status_bytes(field: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """VmHWM back to the current VmRSS (Linux's clear_refs 5)."""
    pathlib.Path("/proc/self/clear_refs").write_text("5")


def settle(timeout: float = 3.0) -> None:
    """Waits until the previous call's arrays are released: a garbage collection, then until the
    resident memory stops falling (4 readings 50 ms apart within 1 MiB; at most `timeout` s).
    A jax.Array's memory is not all released when its last name goes: part of it waits for the
    garbage collector and part goes a moment later (on this benchmark's 0.5B model with every
    hook, 4.6 GiB resident right after a call, 3.2 after gc.collect(), 2.4 a second later), so
    back-to-back calls overlap and their peak is not one call's."""
    import gc

    gc.collect()
    deadline, readings = time.perf_counter() + timeout, [status_bytes("VmRSS")]
    while time.perf_counter() < deadline and not (
        len(readings) >= 4 and max(readings[-4:]) - min(readings[-4:]) < 1 << 20
    ):
        time.sleep(0.05)
        readings.append(status_bytes("VmRSS"))


def tokens_of(count: int, vocab: int):
    import numpy as np

    return np.random.default_rng(0).integers(0, vocab, size=(1, count), dtype=np.int32)


def write_checkpoint(directory: pathlib.Path, dtype: str = "float32") -> None:
    """transformers writes a random model of SHAPE into `directory` (safetensors), its weights in
    `dtype` (float32 or bfloat16)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**SHAPE)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(getattr(torch, dtype)).save_pretrained(directory, safe_serialization=True)


def set_torch_threads():
    import torch

    torch.set_num_threads(os.cpu_count())
    return torch


def check(directory: str) -> dict:
    """Both libraries' logits on CHECK_TOKENS tokens: the largest difference relative to the
    largest logit."""
    import jax
    import numpy as np
    import transformers

    import qkv_jax

    torch = set_torch_threads()
    tokens = tokens_of(CHECK_TOKENS, SHAPE["vocab_size"])
    config, params = qkv_jax.load_pretrained(directory, dtype=np.float32)  # both in float32
    ours = np.asarray(jax.jit(qkv_jax.TransformerLM(config).apply)({"params": params}, tokens))
    del params
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens).long()).logits.numpy()
    return {
        "tokens": CHECK_TOKENS,
        "max_abs_difference": float(np.abs(ours - theirs).max()),
        "relative_difference": float(np.abs(ours - theirs).max() / np.abs(theirs).max()),
    }


def qkv_jax_cache(directory: str, tokens):
    import functools

    import jax

    import qkv_jax
    from qkv_jax.interpretability import run_with_cache

    config, params = qkv_jax.load_pretrained(directory)
    variables = {"params": params}
    model = qkv_jax.TransformerLM(config)
    run = jax.jit(functools.partial(run_with_cache, model))
    forward = jax.jit(model.apply)

    def call():
        logits, cache = jax.block_until_ready(run(variables, tokens))
        kinds: dict[str, int] = {}
        for name, array in cache.items():
            kind = name.split(".", 2)[-1] if name.startswith("blocks.") else name
            kinds[kind] = kinds.get(kind, 0) + array.nbytes
        return {
            "parameter_bytes": sum(a.nbytes for a in jax.tree.leaves(params)),
            "names": len(cache),
            "output_bytes": logits.nbytes + sum(kinds.values()),
            "bytes_by_kind": {"logits": logits.nbytes, **kinds},
        }

    def plain():
        jax.block_until_ready(forward(variables, tokens))

    return call, plain


def transformers_cache(directory: str, tokens):
    import transformers

    torch = set_torch_threads()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    inputs = torch.from_numpy(tokens).long()

    def call():
        with torch.no_grad():
            out = model(inputs, output_hidden_states=True, output_attentions=True)
        arrays = [out.logits, *out.hidden_states, *out.attentions]
        return {
            "parameter_bytes": sum(p.nbytes for p in model.parameters()),
            "names": len(out.hidden_states) + len(out.attentions),
            "output_bytes": sum(  # each storage once
                {a.untyped_storage().data_ptr(): a.untyped_storage().nbytes() for a in arrays}.values()
            ),
            "bytes_by_kind": {
                "logits": out.logits.nbytes,
                "hidden_states": sum(a.nbytes for a in out.hidden_states),
                "attentions": sum(a.nbytes for a in out.attentions),
            },
        }

    def plain():
        with torch.no_grad():
            model(inputs)

    return call, plain


def qkv_jax_lora(directory: str, tokens):
    import dataclasses
    import functools

    import jax
    import jax.numpy as jnp
    import optax
    from flax import traverse_util

    import qkv_jax
    from qkv_jax.lora import ADAPTER_NAMES

    config, frozen = qkv_jax.load_pretrained(directory)
    config = dataclasses.replace(
        config, lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA, lora_targets=("query", "key", "value", "out")
    )
    model = qkv_jax.TransformerLM(config)

    def adapters_of(tree):
        flat = traverse_util.flatten_dict(tree)
        return traverse_util.unflatten_dict({k: v for k, v in flat.items() if k[-1] in ADAPTER_NAMES})

    # The model's init, its output the adapters alone: XLA drops the rest of it.
    adapters = jax.jit(lambda key: adapters_of(model.init(key, tokens[:, :8])["params"]))(
        jax.random.PRNGKey(0)
    )
    tx = optax.adamw(LEARNING_RATE)
    opt_state = tx.init(adapters)

    def loss_fn(adapters, frozen, tokens):
        params = traverse_util.unflatten_dict(
            {**traverse_util.flatten_dict(frozen), **traverse_util.flatten_dict(adapters)}
        )
        logits = model.apply({"params": params}, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(adapters, opt_state, frozen, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(adapters, frozen, tokens)
        updates, opt_state = tx.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, loss

    state = {"adapters": adapters, "opt_state": opt_state}
    tokens = jnp.asarray(tokens)

    def call():
        state["adapters"], state["opt_state"], loss = jax.block_until_ready(
            step(state["adapters"], state["opt_state"], frozen, tokens)
        )
        return {
            "loss": float(loss),
            "trainable": sum(a.size for a in jax.tree.leaves(state["adapters"])),
            "parameter_bytes": sum(a.nbytes for a in jax.tree.leaves((frozen, state["adapters"]))),
        }

    forward = jax.jit(loss_fn)

    def plain():
        jax.block_until_ready(forward(state["adapters"], frozen, tokens))

    return call, plain


def transformers_lora(directory: str, tokens):
    import peft
    import transformers

    torch = set_torch_threads()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model = peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=LORA_RANK,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        ),
    )
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LEARNING_RATE)
    inputs = torch.from_numpy(tokens).long()

    def call():
        loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {
            "loss": float(loss),
            "trainable": sum(p.numel() for p in trainable),
            "parameter_bytes": sum(p.nbytes for p in model.parameters()),
            "attention": model.config._attn_implementation,
        }

    def plain():
        with torch.no_grad():
            model(input_ids=inputs, labels=inputs)

    return call, plain


def prompts_of(batch: int):
    """`batch` rows of GENERATE_PROMPT random token ids."""
    import numpy as np

    return np.random.default_rng(1).integers(
        0, SHAPE["vocab_size"], size=(batch, GENERATE_PROMPT), dtype=np.int32
    )


def qkv_jax_generate(directory: str, prompts):
    import jax.numpy as jnp
    import numpy as np

    import qkv_jax

    config, params = qkv_jax.load_pretrained(directory, dtype=jnp.float32)  # as is: max_len 32768
    model = qkv_jax.TransformerLM(config)

    def call():
        tokens = np.asarray(qkv_jax.generate(model, params, prompts, GENERATE_NEW, temperature=0.0))
        return {"tokens": tokens.tolist(), "max_len": config.max_len}

    return call, None


def transformers_generate(directory: str, prompts):
    import transformers

    torch = set_torch_threads()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    inputs = torch.from_numpy(prompts).long()

    def call():
        with torch.no_grad():
            out = model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                do_sample=False,
                max_new_tokens=GENERATE_NEW,
                eos_token_id=None,
                pad_token_id=0,
            )
        return {"tokens": out[:, prompts.shape[1] :].tolist(), "attention": model.config._attn_implementation}

    return call, None


BUILDERS = {
    ("cache", "qkv_jax"): qkv_jax_cache,
    ("cache", "transformers"): transformers_cache,
    ("lora", "qkv_jax"): qkv_jax_lora,
    ("lora", "transformers"): transformers_lora,
    ("generate", "qkv_jax"): qkv_jax_generate,
    ("generate", "transformers"): transformers_generate,
}


def measure(part: str, case: str, directory: str, count: int, steps: int) -> dict:
    """In this (fresh) process: imports, the baseline, load, first call, `steps` timed calls."""
    library = "transformers" if case == "transformers" else "qkv_jax"
    compiles: list[str] = []
    if library == "qkv_jax":
        import jax

        import qkv_jax  # noqa: F401
        import qkv_jax.interpretability  # noqa: F401

        jax.devices()  # the CPU client exists before the baseline
        threads = {"xla_cpu_devices": len(jax.devices()), "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
        jax.monitoring.register_event_duration_secs_listener(  # XLA compiles, counted
            lambda event, *_, **__: compiles.append(event) if event == COMPILE_EVENT else None
        )
    else:
        import transformers  # noqa: F401
        from transformers.models.qwen2 import modeling_qwen2  # noqa: F401

        torch = set_torch_threads()
        if part == "lora":
            import peft  # noqa: F401
        threads = {
            "torch_num_threads": torch.get_num_threads(),
            "torch_num_interop_threads": torch.get_num_interop_threads(),
        }
    tokens = prompts_of(count) if part == "generate" else tokens_of(count, SHAPE["vocab_size"])
    baseline = status_bytes("VmRSS")
    started = time.perf_counter()
    call, plain = BUILDERS[(part, library)](directory, tokens)
    load_seconds = time.perf_counter() - started
    started = time.perf_counter()
    first = call()
    first_seconds = time.perf_counter() - started
    load_peak = status_bytes("VmHWM")
    settle()
    reset_peak()
    times, info, compiled_before = [], first, len(compiles)
    for _ in range(steps):
        settle()  # one call's peak: the previous call's arrays released first
        started = time.perf_counter()
        info = call()
        times.append(time.perf_counter() - started)
    steps_peak = status_bytes("VmHWM")
    compiled_in_steps = len(compiles) - compiled_before  # a timed call that compiled is no steady call
    plain_times = []
    if plain is not None:  # (generation has no plain call)
        plain()  # (qkv_jax: compiled here)
        for _ in range(steps):
            started = time.perf_counter()
            plain()
            plain_times.append(time.perf_counter() - started)
    return {
        "plain_seconds": statistics.median(plain_times) if plain_times else None,
        "compiles_in_timed_calls": compiled_in_steps,
        "seconds": statistics.median(times),
        "times": times,
        "first_call_seconds": first_seconds,
        "load_seconds": load_seconds,
        "baseline_bytes": baseline,
        "peak_above_baseline_bytes": max(load_peak, steps_peak) - baseline,
        "steps_peak_above_baseline_bytes": steps_peak - baseline,
        "first": first,
        "last": info,
        "threads": threads,
        "LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
    }


def child(args: list[str], env: dict | None = None) -> dict:
    result = subprocess.run(
        [PYTHON, __file__, *args], cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} failed:\n{result.stderr[-3000:]}")
    return last_json_line(result.stdout)


def environment(case: str) -> dict:
    if case.endswith("_tcmalloc"):
        preload = os.environ.get("LD_PRELOAD", "")
        return {"LD_PRELOAD": f"{TCMALLOC} {preload}".strip()}
    return {}


# jax's monitoring event for one XLA compile (jax._src.dispatch.BACKEND_COMPILE_EVENT)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def summarise(runs: dict[str, list[dict]]) -> dict:
    return {
        case: {
            "seconds": median([r["seconds"] for r in results]),
            "first_call_seconds": median([r["first_call_seconds"] for r in results]),
            "load_seconds": median([r["load_seconds"] for r in results]),
            "peak_above_baseline_bytes": max(r["peak_above_baseline_bytes"] for r in results),
            "steps_peak_above_baseline_bytes": max(r["steps_peak_above_baseline_bytes"] for r in results),
            "plain_seconds": median([r["plain_seconds"] for r in results])
            if "plain_seconds" in results[0]
            else None,
            "last": results[-1]["last"],
        }
        for case, results in runs.items()
        if results
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3, help="timed calls per process")
    parser.add_argument("--parts", default="cache,lora")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--write", metavar="DIRECTORY", help=argparse.SUPPRESS)
    parser.add_argument("--check", metavar="DIRECTORY", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help=argparse.SUPPRESS)
    parser.add_argument("--disk_dtype", default="float32", help="the checkpoint's dtype on disk")
    parser.add_argument("--batches", default="1,8", help="generate: the batch sizes")
    args = parser.parse_args()
    if args.child:
        part, case, directory, count, steps = args.child
        print(json.dumps(measure(part, case, directory, int(count), int(steps))))
        return
    if args.write:
        SHAPE["num_hidden_layers"] = args.layers
        write_checkpoint(pathlib.Path(args.write), args.disk_dtype)
        return
    if args.check:
        print(json.dumps(check(args.check)))
        return
    parts = args.parts.split(",")
    cases = {
        part: [c for c in CASES[part] if not c.endswith("_tcmalloc") or os.path.exists(TCMALLOC)]
        for part in parts
    }
    with tempfile.TemporaryDirectory(prefix="versus_transformers_") as folder:
        directory = pathlib.Path(folder) / "qwen2"
        subprocess.run(  # in a process of its own, whose memory is gone before the measurements
            [PYTHON, __file__, "--write", str(directory), "--layers", str(args.layers)]
            + ["--disk_dtype", args.disk_dtype],
            cwd=ROOT,
            check=True,
        )
        for path in directory.glob("*.safetensors"):  # into the page cache, for every case alike
            path.read_bytes()
        agreement = child(["--check", str(directory)])
        relative = agreement["relative_difference"]
        print(f"logits on {agreement['tokens']} tokens: relative difference {relative:.2e}")
        if agreement["relative_difference"] > 1e-4:
            raise SystemExit("qkv_jax's and transformers' logits differ: the comparison would not be honest")
        if parts == ["generate"]:
            generate_main(args, directory, agreement)
            return
        runs = {part: {case: [] for case in cases[part]} for part in parts}
        load_averages = {}
        for part in parts:
            started = os.getloadavg()
            for _ in range(args.rounds):
                for case in cases[part]:
                    result = child(
                        ["--child", part, case, str(directory), str(args.tokens), str(args.steps)],
                        environment(case),
                    )
                    print(part, case, f"{result['seconds']:.2f} s", flush=True)
                    runs[part][case].append(result)
            load_averages[part] = {"before": started, "after": os.getloadavg()}
    for part in parts:
        report(part, args, runs[part], agreement, load_averages[part])


TITLES = {
    "cache": "qkv_jax run_with_cache against transformers' forward with hidden states and attentions (CPU)",
    "lora": "A LoRA fine-tuning step: qkv_jax against transformers with peft (CPU)",
}
NAMES = {
    "qkv_jax": "qkv_jax (glibc malloc, as imported)",
    "qkv_jax_tcmalloc": "qkv_jax, tcmalloc preloaded",
    "transformers": "transformers",
}


def verdict(ratio: float, more: str, less: str) -> str:
    return f"{ratio:.2f}x, {more}" if ratio > 1 else f"{ratio:.2f}x, {less}"


def report(part: str, args, runs: dict[str, list[dict]], agreement: dict, load: dict) -> None:
    summary = summarise(runs)
    gib = 2**30
    ours, theirs = summary["qkv_jax"], summary["transformers"]
    time_ratio = ours["seconds"] / theirs["seconds"]
    peak_ratio = ours["steps_peak_above_baseline_bytes"] / theirs["steps_peak_above_baseline_bytes"]
    whole_ratio = ours["peak_above_baseline_bytes"] / theirs["peak_above_baseline_bytes"]

    def gb(value: float) -> str:
        return f"{value / gib:.2f}"

    def memory(s: dict, returned: bool) -> str:
        kept = s["last"]["parameter_bytes"] + (s["last"]["output_bytes"] if returned else 0)
        what = "parameters and returned arrays" if returned else "parameters"
        return (
            f"{gb(s['steps_peak_above_baseline_bytes'])} GiB peak = {gb(kept)} GiB of {what} + "
            f"{gb(s['steps_peak_above_baseline_bytes'] - kept)} GiB else"
        )

    if part == "cache":
        what = (
            f"One forward pass of {args.tokens} tokens (batch 1) returning the logits and every activation: "
            f"qkv_jax's jitted run_with_cache with every hook name ({ours['last']['names']} arrays, "
            "hook_attn_scores and hook_pattern of every head included) against transformers' eager forward "
            f"with output_hidden_states and output_attentions ({theirs['last']['names']} arrays)."
        )
        plain = "forward without outputs (s)"
        extra = ("returned (GiB)", lambda s: gb(s["last"]["output_bytes"]))
        kinds = sorted(ours["last"]["bytes_by_kind"].items(), key=lambda item: -item[1])
        where = (
            "Where it goes: the forward alone (no cache, no extra outputs) takes "
            f"{ours['plain_seconds']:.2f} s in qkv_jax (jax.jit of apply) and "
            f"{theirs['plain_seconds']:.2f} s in transformers (eager). "
            f"qkv_jax's cache returns {gb(ours['last']['output_bytes'])} GiB (largest: "
            + ", ".join(f"{kind} {gb(size)}" for kind, size in kinds[:4])
            + f" GiB) against transformers' {gb(theirs['last']['output_bytes'])} GiB ("
            + ", ".join(f"{kind} {gb(size)}" for kind, size in theirs["last"]["bytes_by_kind"].items())
            + f" GiB). qkv_jax: {memory(ours, True)}; transformers: {memory(theirs, True)}."
        )
    else:
        what = (
            f"One training step on batch 1 of {args.tokens} tokens: forward, backward and AdamW "
            f"(learning rate {LEARNING_RATE}) on rank-{LORA_RANK} adapters (alpha {LORA_ALPHA:g}) of the "
            f"q/k/v/o projections ({ours['last']['trainable']:,} trainable parameters in qkv_jax, "
            f"{theirs['last']['trainable']:,} in peft), next-token cross-entropy. qkv_jax: a jitted step "
            "differentiating the adapters only, optax.adamw, adapters and optimizer state donated; "
            "transformers: peft's LoraConfig on from_pretrained's model "
            f"(attention {theirs['last']['attention']}), torch.optim.AdamW."
        )
        plain = "forward of the loss alone (s)"
        extra = ("loss after the timed steps", lambda s: f"{s['last']['loss']:.4f}")
        where = (
            f"Where it goes: the forward of the loss alone takes {ours['plain_seconds']:.2f} s of qkv_jax's "
            f"{ours['seconds']:.2f} s step and {theirs['plain_seconds']:.2f} s of transformers' "
            f"{theirs['seconds']:.2f} s. qkv_jax: {memory(ours, False)} (activations, gradients, "
            f"temporaries); transformers: {memory(theirs, False)}."
        )
    first_losses = ""
    if part == "lora":
        first_losses = (
            " The first step's loss (adapters' B at zero, so the base model's): qkv_jax "
            f"{median([r['first']['loss'] for r in runs['qkv_jax']]):.4f}, transformers "
            f"{median([r['first']['loss'] for r in runs['transformers']]):.4f}."
        )
    threads = runs["transformers"][0]["threads"]
    before = ", ".join(f"{x:.1f}" for x in load["before"])
    after = ", ".join(f"{x:.1f}" for x in load["after"])
    table = [
        f"{what} Model: a random Qwen2.5-0.5B-shaped checkpoint written by transformers "
        f"({args.layers} layers, d_model 896, 14/2 heads of {HEAD_DIM}, MLP 4864, 151936-token vocabulary, "
        "tied embeddings), float32, read by qkv_jax.load_pretrained; on "
        f"{agreement['tokens']} tokens the two libraries' logits differ by "
        f"{agreement['relative_difference']:.1e} of the largest logit.{first_losses} Each case in a fresh "
        f"process, {args.rounds} rounds alternating, {args.steps} timed calls per process after a first "
        "call (qkv_jax: its compile), each after the previous call's arrays are released (garbage "
        "collected, resident memory settled); median time, largest peak resident memory above the "
        "process's memory after imports. Threads: transformers "
        f"torch.set_num_threads({threads['torch_num_threads']}) "
        f"(interop {threads['torch_num_interop_threads']}), qkv_jax XLA's default (one thread per core, "
        f"{os.cpu_count()} cores, XLA_FLAGS empty). Load average (1, 5, 15 min) {before} before and "
        f"{after} after; other work shared the machine, so times are noisy. XLA compiles during "
        f"qkv_jax's timed calls: {sum(r.get('compiles_in_timed_calls', 0) for r in runs['qkv_jax'])} "
        "(each program compiles in the first call).",
        "",
        f"| case | time per call (s) | first call (s) | {plain} | peak during the timed calls (GiB) "
        f"| peak of the whole process (GiB) | {extra[0]} |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {NAMES[case]} | {s['seconds']:.2f} | {s['first_call_seconds']:.2f} | "
            f"{s['plain_seconds']:.2f} | {gb(s['steps_peak_above_baseline_bytes'])} | "
            f"{gb(s['peak_above_baseline_bytes'])} | {extra[1](s)} |"
            for case, s in summary.items()
        ),
        "",
        "Goal stated by the team: no slower and no larger. Measured: qkv_jax's time is "
        f"{verdict(time_ratio, 'slower', 'faster')} than transformers', its peak during the calls "
        f"{verdict(peak_ratio, 'larger', 'smaller')}, its whole process's peak "
        f"{verdict(whole_ratio, 'larger', 'smaller')}.",
        "",
        where,
    ]
    ratios = {
        "qkv_jax / transformers time per call": time_ratio,
        "qkv_jax / transformers peak during the timed calls": peak_ratio,
        "qkv_jax / transformers peak of the whole process": whole_ratio,
        "qkv_jax / transformers first call (qkv_jax: compile)": (
            ours["first_call_seconds"] / theirs["first_call_seconds"]
        ),
    }
    if "qkv_jax_tcmalloc" in summary:
        tc = summary["qkv_jax_tcmalloc"]
        ratios["qkv_jax with tcmalloc / transformers time per call"] = tc["seconds"] / theirs["seconds"]
        ratios["qkv_jax with tcmalloc / transformers peak during the timed calls"] = (
            tc["steps_peak_above_baseline_bytes"] / theirs["steps_peak_above_baseline_bytes"]
        )
    print("\n".join(table))
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    path = write_results(
        f"{part}_vs_transformers",
        f"python benchmarks/versus_transformers.py --parts {part} --rounds {args.rounds} "
        f"--tokens {args.tokens} --steps {args.steps}",
        {
            "title": TITLES[part],
            "table": table,
            "ratios": ratios,
            "tokens": args.tokens,
            "logits_agreement": agreement,
            "load_average": load,
            "threads": {case: results[0]["threads"] for case, results in runs.items()},
            "summary": summary,
            "runs": runs,
        },
    )
    print(f"wrote {path.relative_to(ROOT)}")


def generate_main(args, directory: pathlib.Path, agreement: dict) -> None:
    """The generate part: each batch size in fresh processes, alternating for `--rounds` rounds,
    then the command line's time to first token on its second run; writes the results."""
    batches = [int(b) for b in args.batches.split(",")]
    runs: dict[int, dict[str, list[dict]]] = {b: {"qkv_jax": [], "transformers": []} for b in batches}
    started = os.getloadavg()
    for _ in range(args.rounds):
        for batch in batches:
            for case in CASES["generate"]:
                result = child(["--child", "generate", case, str(directory), str(batch), str(args.steps)])
                print("generate", batch, case, f"{result['seconds']:.2f} s", flush=True)
                runs[batch][case].append(result)
    load = {"before": started, "after": os.getloadavg()}
    report_generate(args, runs, agreement, load, command_line_first_token(), weights_floor(directory))


def weights_floor(directory: pathlib.Path) -> dict:
    """The floor a decode step has on this machine: every weight read once, in float32 (as both
    libraries compute), at the rate a matrix-vector product streams a float32 matrix here
    (`weight_stream_rate`)."""
    import math

    from safetensors import safe_open

    numel = 0
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "np") as tensors:
            numel += sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())
    return {"weight_bytes": 4 * numel, "bytes_per_s": weight_stream_rate()}


def weight_stream_rate() -> float:
    """Bytes/s at which a jitted `w @ x` reads a 2 GiB float32 matrix `w` (16384 x 32768) for
    one vector `x`: a decode step's work per weight, on all cores; the median of 10 calls. An
    elementwise `x + 1` measures XLA:CPU's arithmetic, not the memory, so it is not used here."""
    import jax
    import jax.numpy as jnp

    w = jnp.ones((16384, 32768), jnp.float32)
    x = jnp.ones((32768,), jnp.float32)
    matvec = jax.jit(lambda w, x: w @ x)
    matvec(w, x).block_until_ready()
    times = []
    for _ in range(10):
        started = time.perf_counter()
        matvec(w, x).block_until_ready()
        times.append(time.perf_counter() - started)
    return w.nbytes / statistics.median(times)


def command_line_first_token() -> list[dict]:
    """`experiments.generate` twice on docs/pretrained.md's stand-in (the tests' tiny Llama
    checkpoint) with a fresh compilation cache: each run's time to its first new token."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_checkpoints

    runs = []
    with tempfile.TemporaryDirectory(prefix="generate_cli_") as folder:
        checkpoint = tiny_checkpoints.checkpoint(pathlib.Path(folder) / "llama", "llama")
        for _ in range(2):
            started = time.perf_counter()
            result = subprocess.run(
                [
                    PYTHON,
                    "-m",
                    "experiments.generate",
                    "--pretrained",
                    str(checkpoint),
                    "--prompt",
                    "The keys",
                ]
                + ["--temperature", "0", "--max_new_tokens", "32", f"--compilation_cache={folder}/cache"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            )
            speed = next(line for line in result.stderr.splitlines() if line.startswith("speed: "))
            first = float(speed.split("first new token ")[1].split(" s")[0])
            runs.append({"first_token_seconds": first, "command_seconds": time.perf_counter() - started})
    return runs


def report_generate(args, runs: dict, agreement: dict, load: dict, cli: list[dict], floor: dict) -> None:
    rows, ratios = [], {}
    floor_s = GENERATE_NEW * floor["weight_bytes"] / floor["bytes_per_s"]  # one read per new token
    for batch, cases in runs.items():
        ours, theirs = (median([r["seconds"] for r in cases[c]]) for c in ("qkv_jax", "transformers"))
        firsts = [median([r["first_call_seconds"] for r in cases[c]]) for c in ("qkv_jax", "transformers")]
        same = cases["qkv_jax"][-1]["last"]["tokens"] == cases["transformers"][-1]["last"]["tokens"]
        rows.append(
            f"| {batch} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f} | {firsts[0]:.2f} "
            f"| {firsts[1]:.2f} | {'yes' if same else 'no'} |"
        )
        ratios[f"qkv_jax / transformers time, batch {batch}"] = ours / theirs
        ratios[f"qkv_jax / weights-read floor, batch {batch}"] = ours / floor_s
        ratios[f"transformers / weights-read floor, batch {batch}"] = theirs / floor_s
    ratios["command line, second run: time to first token (s)"] = cli[1]["first_token_seconds"]
    first = next(iter(runs))  # the smallest batch asked for first
    max_len = runs[first]["qkv_jax"][-1]["last"]["max_len"]
    table = [
        f"Greedy generation of {GENERATE_NEW} new tokens after {GENERATE_PROMPT}-token random prompts on a "
        f"random Qwen2.5-0.5B-shaped checkpoint written by transformers in {args.disk_dtype} ({args.layers} "
        "layers, d_model 896, 14/2 heads of 64, MLP 4864, 151936-token vocabulary, tied embeddings), both "
        "libraries computing in float32. qkv_jax: `qkv_jax.generate(model, params, prompts, "
        f"{GENERATE_NEW}, temperature=0.0)` on the model as `load_pretrained` reads it (max_len {max_len}; "
        "the cache sized to the request's bucket). transformers: `model.generate(do_sample=False)` "
        f"(attention {runs[next(iter(runs))]['transformers'][-1]['last']['attention']}). On "
        f"{agreement['tokens']} tokens the two libraries' logits differ by "
        f"{agreement['relative_difference']:.1e} of the largest logit. Each case in a fresh process, "
        f"{args.rounds} rounds alternating, {args.steps} timed calls per process after a first call "
        "(qkv_jax: its compile); median time. Load average (1, 5, 15 min) "
        f"{', '.join(f'{x:.1f}' for x in load['before'])} before and "
        f"{', '.join(f'{x:.1f}' for x in load['after'])} after; other work shared the machine.",
        "",
        "| batch | qkv_jax (s) | transformers (s) | ratio | qkv_jax first call (s) "
        "| transformers first call (s) | same tokens |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"The floor: reading the {floor['weight_bytes'] / 1e9:.2f} GB of float32 weights once per new token, "
        f"at the {floor['bytes_per_s'] / 1e9:.1f} GB/s a matrix-vector product streams a 2 GiB float32 "
        "matrix here, takes "
        f"{floor_s:.2f} s for {GENERATE_NEW} tokens; at batch {first} qkv_jax takes "
        f"{ratios[f'qkv_jax / weights-read floor, batch {first}']:.2f}x that and transformers "
        f"{ratios[f'transformers / weights-read floor, batch {first}']:.2f}x.",
        "",
        "The command line (`python -m experiments.generate --pretrained DIR --prompt 'The keys' "
        "--temperature 0 --max_new_tokens 32`) on docs/pretrained.md's stand-in, a tiny Llama "
        "checkpoint, twice with an empty persistent compilation cache: time from the command's start "
        "to its first new token "
        f"{cli[0]['first_token_seconds']:.2f} s on the first run and {cli[1]['first_token_seconds']:.2f} s "
        f"on the second (whole commands {cli[0]['command_seconds']:.2f} s and "
        f"{cli[1]['command_seconds']:.2f} s, Python's start and imports included).",
    ]
    print("\n".join(table))
    path = write_results(
        "generate_vs_transformers",
        f"python benchmarks/versus_transformers.py --parts generate --rounds {args.rounds} "
        f"--steps {args.steps} --disk_dtype {args.disk_dtype} --batches {args.batches}",
        {
            "title": "Greedy generation: qkv_jax against transformers' generate (CPU)",
            "table": table,
            "ratios": ratios,
            "logits_agreement": agreement,
            "load_average": load,
            "command_line": cli,
            "weights_floor": {**floor, "seconds": floor_s},
            "runs": {str(b): cases for b, cases in runs.items()},
        },
    )
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
