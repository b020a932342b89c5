"""Pretrained checkpoints loaded onto meshes of simulated CPU devices against one device (a
subprocess of tests/pretrained/test_pretrained_mesh.py: the device count is set before JAX starts).

  python tests/pretrained/mesh_worker.py '{"devices": 8, "meshes": [[4, 2], ...],
                                            "directories": {"llama": DIR, ...}, "out": FILE}'

For each directory, the one-device load (mesh=None) computes the reference: the logits and every
hook of `run_with_cache`, a patching sweep over (layer, head) of `attn.hook_z`, one LoRA step (the
adapters' gradient and the loss after it), greedy tokens of `lm.generate` and the logits after
an MHA -> GQA conversion (`convert_kv_heads`), each where the family's workflows ask. Then on each mesh,
`load_pretrained(mesh=...)` and the same computations, with the batch split over "data". Writes,
per directory and mesh, each parameter's PartitionSpec and where its shards live, the cache's
specs, and the largest difference of each result over the largest reference value.
"""

import contextlib
import dataclasses
import functools
import json
import os
import sys

import jax

spec = json.loads(sys.argv[1])
jax.config.update("jax_num_cpu_devices", spec["devices"])
if os.environ.get("QKV_JAX_COMPILATION_CACHE"):  # the test session's (tests/launch.py)
    jax.config.update("jax_compilation_cache_dir", os.environ["QKV_JAX_COMPILATION_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from qkv_jax import generation, lm  # noqa: E402
from qkv_jax.finetune import convert_kv_heads  # noqa: E402
from qkv_jax.interpretability import patching_sweep, run_with_cache  # noqa: E402
from qkv_jax.pretrained import placement as placing  # noqa: E402
from qkv_jax.pretrained.io import load_pretrained  # noqa: E402
from qkv_jax.training.sharding import make_mesh  # noqa: E402

BATCH, T, PROMPT, NEW = 8, 12, 4, 6
compile_once = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


SMALL_ON_DEVICE = placing.ON_DEVICE_BYTES


def with_adapters(params, adapters):
    """`params` with the LoRA factors of `adapters` added beside their kernels."""
    if not isinstance(adapters, dict):
        return params
    merged = dict(params)
    for key, value in adapters.items():
        merged[key] = with_adapters(params[key], value) if key in params else value
    return merged


def only_adapters(tree):
    """The LoRA factors of a parameter tree (empty dicts pruned)."""
    if not isinstance(tree, dict):
        return None
    kept = {k: (v if k in ("lora_a", "lora_b") else only_adapters(v)) for k, v in tree.items()}
    return {k: v for k, v in kept.items() if v is not None and not (isinstance(v, dict) and not v)}


def computations(config):
    """The compiled computations of a config (compiled once per mesh: the shardings differ)."""
    model = lm.TransformerLM(config)
    lora = lm.TransformerLM(dataclasses.replace(config, lora_rank=2))

    @compile_once
    def cached_and_swept(params, clean, corrupted):
        logits, cache = run_with_cache(model, {"params": params}, clean)
        metric = lambda logits: logits[:, -1, 0].sum()  # noqa: E731
        z = {name: value for name, value in cache.items() if name.endswith("attn.hook_z")}
        return logits, cache, patching_sweep(model, {"params": params}, corrupted, z, metric)

    @compile_once
    def lora_step(params, adapters, tokens):
        def loss(adapters):
            logits = lora.apply({"params": with_adapters(params, adapters)}, tokens[:, :-1])
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))
            return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

        grads = jax.grad(loss)(adapters)
        moved = jax.tree.map(lambda a, g: a - 0.5 * g, adapters, grads)
        return grads, loss(moved)

    return model, cached_and_swept, lora_step


def run(directory, mesh, tokens, adapters, workflows):
    """The results of `workflows` after one load (mesh None: one device), and where the
    parameters and the cached activations live. On a family's own mesh every tensor takes the
    large-tensor path (converted on the devices by one program, as on accelerators), whose
    results must equal the one-device load's (small tensors converted by numpy, transposed ones
    on the host); on the other meshes transposed tensors are copied on the host, block by block."""
    own = mesh is not None and workflows
    placing.ON_DEVICE_BYTES = 0 if own else SMALL_ON_DEVICE
    placing.HOST_TRANSPOSES = not own
    config, params = load_pretrained(directory, mesh=mesh)
    placement = {
        "/".join(str(k.key) for k in path): {
            "spec": [a for a in leaf.sharding.spec] if mesh is not None else [],
            "shape": list(leaf.shape),
        }
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }
    if workflows is None:
        return {"params": params}, placement, {}
    model, cached_and_swept, lora_step = computations(config)
    if mesh is not None:
        tokens = jax.device_put(tokens, NamedSharding(mesh, P("data")))
        adapters = jax.device_put(adapters, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        logits, cache, sweep = cached_and_swept(params, tokens, jnp.roll(tokens, 1, axis=1))
    cache_specs = {  # each axis's mesh axis ("None": whole)
        k: [str(a) for a in (*v.sharding.spec, *[None] * (v.ndim - len(v.sharding.spec)))]
        for k, v in cache.items()
        if mesh is not None
    }
    results = {
        "logits": np.asarray(logits),
        "cache": {k: np.asarray(v) for k, v in cache.items()},
        "sweep": np.asarray(sweep),
    }
    if "lora" in workflows:
        grads, loss = lora_step(params, adapters, tokens)
        results.update(lora_grads=[np.asarray(g) for g in jax.tree.leaves(grads)], lora_loss=np.asarray(loss))
    if "gqa" in workflows:  # MHA -> GQA: K/V heads mean-pooled in pairs, on the parameters as placed
        pooled = convert_kv_heads(params, config.num_heads // 2)
        gqa = lm.TransformerLM(dataclasses.replace(config, num_kv_heads=config.num_heads // 2))
        results["gqa_logits"] = np.asarray(compile_once(gqa.apply)({"params": pooled}, tokens))
    if "generate" in workflows:
        prompt = np.asarray(tokens)[:, :PROMPT]
        results["greedy"] = np.asarray(lm.generate(model, params, prompt, NEW, temperature=0.0))
        if mesh is not None:  # the decode cache generate makes on the mesh the params are on
            placed = jax.jit(lambda: generation.zeroed_cache(model, BATCH, 16, generation.mesh_of(params)))()
            key = placed["block_0"]["attention"]["cached_key"]
            cache_specs["decode:cached_key"] = [
                str(a) for a in (*key.sharding.spec, *[None] * (4 - len(key.sharding.spec)))
            ]
    return results, placement, cache_specs


def error(ours, reference):
    """Largest |difference| over the largest finite |reference| (masked scores: equal -infs)."""
    ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
    with np.errstate(invalid="ignore"):  # -inf - -inf
        difference = np.where(ours == reference, 0.0, np.abs(ours - reference))
    scale = np.max(np.abs(np.where(np.isfinite(reference), reference, 0.0)), initial=1e-30)
    return float(np.max(difference) / scale)


def compare(results, reference):
    """The largest relative difference per result (greedy: whether the tokens are equal)."""
    errors = {
        "logits": error(results["logits"], reference["logits"]),
        "cache": max(error(results["cache"][k], v) for k, v in reference["cache"].items()),
        "cache_names": sorted(results["cache"]) == sorted(reference["cache"]),
        "sweep": error(results["sweep"], reference["sweep"]),
    }
    if "lora_loss" in reference:
        pairs = zip(results["lora_grads"], reference["lora_grads"], strict=True)
        errors["lora_grads"] = max(error(a, b) for a, b in pairs)
        errors["lora_loss"] = error(results["lora_loss"], reference["lora_loss"])
    if "gqa_logits" in reference:
        errors["gqa_logits"] = error(results["gqa_logits"], reference["gqa_logits"])
    if "greedy" in reference:
        errors["greedy_equal"] = bool(np.array_equal(results["greedy"], reference["greedy"]))
    return errors


def main():
    """Every family on every mesh: the placement; on its own mesh, the workflows too."""
    out = {}
    for name, directory in spec["directories"].items():
        workflows, own_mesh = spec["workflows"][name], tuple(spec["own_mesh"][name])
        config, one_device = load_pretrained(directory)
        tokens = np.random.default_rng(0).integers(0, config.vocab_size, (BATCH, T)).astype(np.int32)
        with_lora = lm.TransformerLM(dataclasses.replace(config, lora_rank=2))
        fresh = with_lora.init(jax.random.PRNGKey(1), tokens[:1])
        adapters = jax.tree.map(lambda a: a + 0.1, only_adapters(fresh["params"]))  # B moved off 0
        reference, _, _ = run(directory, None, tokens, adapters, workflows)
        out[name] = {}
        for data, model in spec["meshes"]:
            own = (data, model) == own_mesh
            mesh = make_mesh(data, model)
            asked = workflows if own else None
            results, placement, cache_specs = run(directory, mesh, tokens, adapters, asked)
            pairs = (
                []
                if own
                else zip(jax.tree.leaves(results["params"]), jax.tree.leaves(one_device), strict=True)
            )
            out[name][f"{data}x{model}"] = {
                "errors": compare(results, reference) if own else {},
                "params_equal": all(
                    np.array_equal(ours, theirs) for ours, theirs in pairs
                ),  # the host's copies
                "placement": placement,
                "cache_specs": cache_specs,
            }
    try:  # a model axis of 3 divides neither 8 heads nor 2 K/V heads: refused before any read
        load_pretrained(spec["directories"]["llama"], mesh=make_mesh(2, 3))
    except ValueError as refusal:
        out["refused"] = str(refusal)
    with open(spec["out"], "w") as f:
        json.dump(out, f)
    print("ok")


main()
