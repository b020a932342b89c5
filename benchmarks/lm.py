r"""The char LM: KV-cache decoding against recomputation, and training speed against PyTorch.

  python benchmarks/lm.py [--steps 10] [--rounds 3]
  python benchmarks/lm.py --library-user [--quick]   # one process, as `import qkv_jax` meets it
  python benchmarks/lm.py --gpu [--dry-run]   # benchmarks/gpu.sh's LM step (lm_gpu.json)

--library-user: the training step a researcher writes around the library, in
this one process with whatever allocator and XLA flags it was started with
(glibc's malloc and none, unless the environment says otherwise; the results
record both): `TransformerLM` (2 layers, d_model 128, 4 heads, T 128, batch 32,
vocab 256) with optax AdamW in one `jax.jit` step (state donated), against the
same architecture in eager PyTorch (`F.scaled_dot_product_attention`, AdamW,
torch's default threads), interleaved rounds of --steps steps, medians. Then a
`jax.profiler` trace of the step, each XLA:CPU event attributed by its HLO
name stack: the attention kernel, the dense layers' matmuls, the rest of the
MLP and blocks, layer norm, embedding, cross-entropy, the optimizer, and the
host's share (wall time the executor was not busy). Writes
benchmarks/results/lm_library_user.json.

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
sequence 256, batch 16) and `small_lm` (2 layers, d_model 128, 4 heads,
sequence 128, batch 32, AdamW). Medians over interleaved rounds.
Writes benchmarks/results/lm.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import random
import re
import resource
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    PYTHON,
    ROOT,
    hlo_op_names,
    last_json_line,
    median,
    profile_events,
    run_timed,
    write_results,
)

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
MODELS = ("char_lm", "small_lm")
NEW_TOKENS = 256
DECODE_BATCHES = (1, 8)


def model_config(name: str) -> dict:
    """configs/char_lm.py, or its `small_lm` shape (sequence 128, batch 32)."""
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
    from qkv_jax.tasks.transformer import make_model

    config = model_config("char_lm")
    model: TransformerLM = make_model(config["model"], vocab_size=config["data"]["max_vocab_size"])
    params = jax.jit(model.init)(jax.random.PRNGKey(0), np.zeros((1, model.config.max_len), np.int32))[
        "params"
    ]
    recompute = jax.jit(recompute_generate, static_argnums=(0, 3))
    results = {}
    for batch in DECODE_BATCHES:
        prompt = np.asarray(
            jax.random.randint(jax.random.PRNGKey(batch), (batch, 1), 1, model.config.vocab_size)
        )

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
    results["same_cache_bytes"] = same_cache_decode()
    return results


# The K/V study's arms with equal cache bytes per token (configs/char_lm.py:study, 8 heads):
# GQA with 2 K/V heads, and MLA with a 64-wide latent, absorbed (the default) or rebuilding K and V.
SAME_CACHE_ARMS = {
    "gqa_kv2": {"num_kv_heads": 2},
    "mla_latent64": {"kv_latent_dim": 64},
    "mla_latent64_rebuilt": {"kv_latent_dim": 64, "absorb_latent": False},
}
SAME_CACHE_BATCHES = (1, 32)


def same_cache_decode() -> dict:
    """tokens/s of KV-cache decoding (a 1-token prompt, 127 new) for SAME_CACHE_ARMS."""
    import jax
    import numpy as np

    from configs import char_lm
    from qkv_jax.lm import kv_cache_bytes_per_token
    from qkv_jax.tasks.transformer import make_model
    from studies.language_model import decode_tokens_per_second

    study = char_lm.get_config("study").to_dict()
    results = {}
    for arm, fields in SAME_CACHE_ARMS.items():
        model = make_model(study["model"], study["data"]["max_vocab_size"], **fields)
        params = jax.jit(model.init)(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"]
        results[arm] = {"cache_bytes_per_token": kv_cache_bytes_per_token(model)}
        for batch in SAME_CACHE_BATCHES:
            results[arm][f"batch{batch}"] = decode_tokens_per_second(model, params, batch)
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
    from qkv_jax.tasks.char_lm import load_corpus

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


# The LM training step on a GPU, against torch eager and torch.compile.
GPU_LM = {"vocab_size": 256, "num_layers": 6, "d_model": 768, "num_heads": 12, "max_len": 1024}
GPU_LM_DRY = {"vocab_size": 256, "num_layers": 2, "d_model": 64, "num_heads": 4, "max_len": 64}
GPU_BATCH = 16
DENSE_BF16_PEAK = 989e12  # NVIDIA H200 (SXM) datasheet: 1,979 TFLOP/s bf16 with sparsity, half dense


def lm_flops_per_token(shape: dict) -> float:
    """Training FLOPs per token (PaLM, appendix B): 6 x the non-embedding parameters (the
    matmuls forward and backward, the head included) + 12 x layers x width x sequence length
    (the attention's Q K^T and weights x V, forward and backward)."""
    layers, width, length = shape["num_layers"], shape["d_model"], shape["max_len"]
    matmul_params = layers * 12 * width**2 + shape["vocab_size"] * width  # q, k, v, o, mlp (4x); head
    return 6 * matmul_params + 12 * layers * width * length


def jax_lm_step_s(shape: dict, steps: int) -> float:
    """Seconds per step of TransformerLM (bf16 compute, float32 parameters) with optax AdamW in
    a plain `jax.jit` step with the state donated; `steps` steps queued, then one sync."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax.training.train_state import TrainState

    from qkv_jax.lm import TransformerConfig, TransformerLM
    from qkv_jax.tasks.transformer import cross_entropy

    model = TransformerLM(TransformerConfig(**shape, dtype=jnp.bfloat16))
    tokens = jax.random.randint(
        jax.random.PRNGKey(0), (GPU_BATCH, shape["max_len"] + 1), 0, shape["vocab_size"]
    )
    params = jax.jit(model.init)(jax.random.PRNGKey(1), tokens[:, :-1])["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(3e-4, weight_decay=0.01))

    def loss(params, tokens):
        return cross_entropy(model.apply({"params": params}, tokens[:, :-1]), tokens[:, 1:])

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, tokens):
        value, grads = jax.value_and_grad(loss)(state.params, tokens)
        return state.apply_gradients(grads=grads), value

    for _ in range(2):  # compiles, then one warm step
        state, value = step(state, tokens)
    value.block_until_ready()
    started = time.perf_counter()
    for _ in range(steps):
        state, value = step(state, tokens)
    value.block_until_ready()
    return (time.perf_counter() - started) / steps


def torch_lm_step_s(shape: dict, steps: int, compiled: bool) -> float:
    """The same architecture in PyTorch: bf16 autocast, fused AdamW, eager or torch.compile."""
    import torch
    import torch.nn.functional as F

    from benchmarks.lm_torch import TorchLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = TorchLM(
        shape["vocab_size"], shape["num_layers"], shape["d_model"], shape["num_heads"], shape["max_len"]
    )
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, fused=device == "cuda")
    forward = torch.compile(model) if compiled else model
    tokens = torch.randint(0, shape["vocab_size"], (GPU_BATCH, shape["max_len"] + 1), device=device)

    def step():
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    for _ in range(3):  # compiles (torch.compile), then warm steps
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss.item()  # one sync
    return (time.perf_counter() - started) / steps


def gpu_run(steps: int, dry_run: bool) -> None:
    """benchmarks/gpu.sh's LM step: ms per training step of the GPU-sized LM (6 layers, d_model
    768, 12 heads, T 1024, batch 16, vocab 256, bf16 compute, AdamW) in JAX and in torch eager
    and torch.compile, with TFLOP/s and model FLOPs utilisation; then KV-cache decoding of the
    char LM. Writes benchmarks/results/lm_gpu.json unless `dry_run` (tiny shapes, any device)."""
    import jax

    shape, steps = (GPU_LM_DRY, 2) if dry_run else (GPU_LM, steps)
    flops = lm_flops_per_token(shape) * GPU_BATCH * shape["max_len"]
    device = jax.devices()[0]
    lines = [
        f"Device: {device.device_kind} ({jax.default_backend()}). TransformerLM {shape}, batch {GPU_BATCH}, "
        f"bf16 compute with float32 parameters, AdamW; {steps} steps queued, then one sync. Model FLOPs "
        f"per step {flops / 1e12:.3g} T (6 N + 12 L d T per token); MFU against {DENSE_BF16_PEAK / 1e12:.0f} "
        "TFLOP/s (H200 dense bf16).",
        "",
        "| implementation | ms / step | TFLOP/s | MFU |",
        "|---|---|---|---|",
    ]
    seconds = {"qkv_jax (jax.jit)": jax_lm_step_s(shape, steps)}
    try:
        seconds["torch eager"] = torch_lm_step_s(shape, steps, compiled=False)
        seconds["torch.compile"] = torch_lm_step_s(shape, steps, compiled=True)
    except Exception as error:  # noqa: BLE001 - the peer is optional: say why it is missing
        lines.insert(1, f"(torch peer not measured: {type(error).__name__}: {str(error).splitlines()[0]})")
    for name, s in seconds.items():
        lines.append(
            f"| {name} | {1e3 * s:.2f} | {flops / s / 1e12:.1f} | {flops / s / DENSE_BF16_PEAK:.1%} |"
        )
    ratios = {f"lm_step_ms/{name}": 1e3 * s for name, s in seconds.items()}
    for peer in ("torch eager", "torch.compile"):
        if peer in seconds:
            ratios[f"lm_step_qkv_jax_over_{peer.replace(' ', '_')}"] = (
                seconds["qkv_jax (jax.jit)"] / seconds[peer]
            )
    lines += ["", *decode_lines(dry_run, ratios)]
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


def decode_lines(dry_run: bool, ratios: dict) -> list[str]:
    """KV-cache decoding tokens/s of configs/char_lm.py's model on the default device."""
    import jax
    import numpy as np

    from qkv_jax.lm import generate
    from qkv_jax.tasks.transformer import make_model

    config = model_config("char_lm")
    model = make_model(config["model"], vocab_size=config["data"]["max_vocab_size"])
    length = np.zeros((1, model.config.max_len), np.int32)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), length)["params"]
    new_tokens = 8 if dry_run else NEW_TOKENS
    lines = ["| char_lm KV-cache decoding | tokens/s |", "|---|---|"]
    for batch in DECODE_BATCHES:
        prompt = np.ones((batch, 1), np.int32)

        def decode(prompt=prompt):
            return generate(model, params, prompt, new_tokens, rng=jax.random.PRNGKey(0), temperature=0.0)

        decode().block_until_ready()  # compiles
        seconds = timed_median(lambda decode=decode: decode().block_until_ready(), 3)
        lines.append(f"| batch {batch} | {batch * new_tokens / seconds:.0f} |")
        ratios[f"char_lm_decode_batch{batch}_tokens_per_s"] = batch * new_tokens / seconds
    return lines


# ----------------------------------------------------------------------------- library user

LIBRARY_LM = {"vocab_size": 256, "num_layers": 2, "d_model": 128, "num_heads": 4, "max_len": 128}
LIBRARY_BATCH = 32
# (part, pattern over an event's HLO op names), first match wins; "matmul" parts count dots only.
PROFILE_PARTS = (
    ("optimizer (AdamW)", r"/optimizer/"),
    ("cross-entropy", r"/cross_entropy/"),
    ("attention kernel", r"jit\(_attention\)|dot_product_attention"),
    ("q/k/v/out matmuls", r"/attention/(attention\._keys_and_values/)?(query|key|value|out)/.*dot_general"),
    ("MLP matmuls", r"/mlp_(in|out)/.*dot_general"),
    ("head matmul", r"/head/.*dot_general"),
    ("layer norm", r"_norm/"),
    ("embedding", r"_embedding/"),
    ("q/k/v/out bias and reshapes", r"/attention/"),
    ("MLP bias, GELU, residual adds", r"/block_\d+/|/mlp_"),
)


def library_jax_step(shape: dict, batch: int):
    """(run(n): n training steps then a sync, the jitted step, its arguments): a user's step."""
    import jax
    import optax

    from qkv_jax.lm import TransformerConfig, TransformerLM
    from qkv_jax.tasks.transformer import cross_entropy

    model = TransformerLM(TransformerConfig(**shape))
    tokens = jax.random.randint(jax.random.PRNGKey(0), (batch, shape["max_len"] + 1), 0, shape["vocab_size"])
    params = jax.jit(model.init)(jax.random.PRNGKey(1), tokens[:, :-1])["params"]
    tx = optax.adamw(3e-4, weight_decay=0.01)

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])  # (B, T, V)
        with jax.named_scope("cross_entropy"):
            return cross_entropy(logits, tokens[:, 1:])

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        with jax.named_scope("optimizer"):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

    state = [params, tx.init(params)]

    def run(n: int) -> None:
        for _ in range(n):
            state[0], state[1], loss = step(state[0], state[1], tokens)
        loss.block_until_ready()

    return run, step, (state, tokens)


def library_torch_step(shape: dict, batch: int, threads: int | None = None):
    """run(n): n steps of the same architecture in eager PyTorch with AdamW, then a sync, on
    torch's default threads or on `threads` (set for the run, then restored)."""
    import torch
    import torch.nn.functional as F

    from benchmarks.lm_torch import TorchLM

    default_threads = torch.get_num_threads()
    torch.manual_seed(0)
    model = TorchLM(
        shape["vocab_size"], shape["num_layers"], shape["d_model"], shape["num_heads"], shape["max_len"]
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    tokens = torch.randint(0, shape["vocab_size"], (batch, shape["max_len"] + 1))

    def run(n: int) -> None:
        torch.set_num_threads(threads or default_threads)
        for _ in range(n):
            logits = model(tokens[:, :-1])  # (B, T, V)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        loss.item()
        torch.set_num_threads(default_threads)

    return run


def faults_per_step(run, steps: int) -> float:
    """Minor page faults per step (fresh pages the allocator maps in and the kernel zeroes)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    run(steps)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps


def step_profile(run, step, arguments, steps: int) -> tuple[list[tuple[str, float]], float, float]:
    """([(part, op seconds per step)], wall seconds per step, executor-busy seconds per step)
    of the JAX step from a profiler trace of `steps` steps."""
    state, tokens = arguments
    names = hlo_op_names(step.lower(state[0], state[1], tokens).compile().as_text())
    with tempfile.TemporaryDirectory() as trace_dir:
        started = time.perf_counter()
        seconds, busy = profile_events(lambda: run(steps), trace_dir)
        wall = time.perf_counter() - started
    parts: dict[str, float] = {}
    for event, total in seconds.items():
        if event not in names or re.match(r"(while|cond|conditional|call)\b", event):
            continue  # not an XLA op, or control flow around the ops it runs
        text = " ".join(names[event])
        part = next((p for p, pattern in PROFILE_PARTS if re.search(pattern, text)), "other")
        parts[part] = parts.get(part, 0.0) + total / steps
    return sorted(parts.items(), key=lambda item: -item[1]), wall / steps, busy / steps


def library_user_run(args) -> None:
    """The LM step as a library user meets it (see the module docstring)."""
    shape, batch = LIBRARY_LM, LIBRARY_BATCH
    rounds = args.rounds if args.rounds else (3 if args.quick else 7)
    jax_run, step, arguments = library_jax_step(shape, batch)
    timed = {
        "qkv_jax (jax.jit)": jax_run,
        "torch eager": library_torch_step(shape, batch),
        "torch eager, 1 thread": library_torch_step(shape, batch, threads=1),
    }
    for run in timed.values():
        run(2)  # compiles, warms up
    times: dict[str, list[float]] = {name: [] for name in timed}
    order = random.Random(0)
    for _ in range(rounds):
        for name in order.sample(list(timed), len(timed)):
            started = time.perf_counter()
            timed[name](args.steps)
            times[name].append((time.perf_counter() - started) / args.steps)
    step_s = {name: median(t) for name, t in times.items()}
    tokens = batch * shape["max_len"]
    faults = {name: faults_per_step(run, args.steps) for name, run in timed.items()}
    profile, traced_s, busy_s = step_profile(jax_run, step, arguments, args.steps)
    op_s = sum(s for _, s in profile)
    lines = [
        f"TransformerLM {shape}, batch {batch}, AdamW, float32, one `jax.jit` step against eager "
        f"PyTorch (its default threads, and 1: on a busy machine 2 OpenMP threads can be several "
        f"times slower), in one process (LD_PRELOAD={os.environ.get('LD_PRELOAD', '') or 'none'}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '') or 'none'}, "
        f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '') or 'none'}); median of {rounds} interleaved "
        f"rounds of {args.steps} steps.",
        "",
        "| implementation | ms / step | tokens/s | page faults / step |",
        "|---|---|---|---|",
        *(
            f"| {name} | {1e3 * s:.1f} | {tokens / s:.0f} | {faults[name]:.0f} |"
            for name, s in step_s.items()
        ),
        "",
        f"Where the qkv_jax step's time goes, from a `jax.profiler` trace of {args.steps} steps "
        f"({1e3 * traced_s:.1f} ms per step while traced; the executor was busy "
        f"{1e3 * busy_s:.1f} ms of it, the host's dispatch and Python the other "
        f"{1e3 * max(traced_s - busy_s, 0.0):.1f} ms). XLA:CPU runs independent ops side by side, "
        "so the ops' times add up to more than the busy time; shares are of their sum:",
        "",
        "| part | op ms / step | share of op time |",
        "|---|---|---|",
        *(f"| {part} | {1e3 * s:.1f} | {s / op_s:.0%} |" for part, s in profile),
    ]
    ratios = {
        **{
            f"qkv_jax tokens/s / {peer} tokens/s": step_s[peer] / step_s["qkv_jax (jax.jit)"]
            for peer in ("torch eager", "torch eager, 1 thread")
        },
        **{f"step ms/{name}": 1e3 * s for name, s in step_s.items()},
    }
    print("\n".join(lines))
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    path = write_results(
        args.name,
        "python benchmarks/lm.py " + " ".join(sys.argv[1:]),
        {
            "title": "LM training step as a library call (CPU, one process"
            + (f", GLIBC_TUNABLES={tunables})" if (tunables := os.environ.get("GLIBC_TUNABLES")) else ")")
            + ("" if args.name == "lm_library_user" else f" ({args.name})"),
            "table": lines,
            "ratios": ratios,
            "times_s": times,
            "profile_ms": {part: 1e3 * s for part, s in profile},
            "profile_step_ms": {"traced": 1e3 * traced_s, "executor busy": 1e3 * busy_s},
            "page_faults_per_step": faults,
        },
    )
    print(f"wrote {path.relative_to(ROOT)}")


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
    for arm in SAME_CACHE_ARMS:
        for batch in SAME_CACHE_BATCHES:
            label = f"decode at GQA-2's cache bytes, {arm}, batch {batch} (tokens/s)"
            rows.append((label, ("decode", "same_cache_bytes", arm, f"batch{batch}"), "{:.0f}"))
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
    parser.add_argument(
        "--library-user", action="store_true", help="the LM step and its profile in this one process"
    )
    parser.add_argument("--quick", action="store_true", help="with --library-user: 3 rounds")
    parser.add_argument(
        "--name", default="lm_library_user", help="with --library-user: writes benchmarks/results/NAME.json"
    )
    args = parser.parse_args()
    if args.library_user:
        if "--rounds" not in sys.argv:
            args.rounds = 0  # library_user_run's default: 7, or 3 with --quick
        library_user_run(args)
        return
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
        same_cache = r["decode"]["same_cache_bytes"]
        for batch in SAME_CACHE_BATCHES:  # the aim at equal cache bytes: GQA-2 / absorbed MLA <= 1.25
            ratios[f"{allocator}/decode_gqa2_over_mla64_absorbed_batch{batch}"] = (
                same_cache["gqa_kv2"][f"batch{batch}"] / same_cache["mla_latent64"][f"batch{batch}"]
            )
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
