"""Pretrained checkpoints on a ("data", "model") mesh of 8 simulated CPU devices equal one device.

Tiny random transformers models of four families, with 8 query heads so that every mesh's
model axis divides them: Llama (2 K/V heads, fewer than a model axis of 4 or 8: replicated
there; biases), Qwen 3 (QK-norm, head_dim != d_model / N, a tied head), Gemma 2 (soft caps,
sandwich norms, windows) and GPT-NeoX (parallel block, the fused query/key/value tensor). One
subprocess (tests/pretrained/mesh_worker.py) loads each onto the meshes (8, 1), (4, 2), (2, 4)
and (1, 8) and onto one device:
  - the logits, every cached activation, a patching sweep, a LoRA step (the adapters'
    gradient and the loss after it) and the logits after an MHA -> GQA conversion equal one
    device's to 1e-5 of the largest value, and greedy tokens are equal exactly (each family
    runs these on one of the meshes, so that every mesh runs them);
  - every parameter's PartitionSpec is the one docs/scaling.md's table gives (written out
    here by hand, not read from `qkv_jax.sharding`), and the cached activations stay split
    over "data" along the batch;
  - a mesh the model cannot be split over is one ValueError line before any tensor is read.
"""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import PartitionSpec as P
from launch import launcher_env, two_processes

from qkv_jax import lm, load_pretrained

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "pretrained" / "two_process_worker.py"
MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]
# Every family is loaded onto every mesh (its placement checked); the workflows run on one mesh
# per family, so that each mesh runs them once (each costs a few compilations).
OWN_MESH = {"llama": (2, 4), "qwen3": (4, 2), "gemma2": (1, 8), "gpt_neox": (8, 1)}
# Beside the logits, the cache and a patching sweep (every family): a LoRA step, greedy decoding,
# and the logits after an MHA -> GQA conversion of GPT-NeoX's 8 heads into 4 K/V heads.
WORKFLOWS = {"llama": ["lora", "generate"], "qwen3": [], "gemma2": [], "gpt_neox": ["lora", "gqa"]}
TOLERANCE = 1e-5
COMMON = dict(vocab_size=64, max_position_embeddings=32, num_hidden_layers=2, intermediate_size=48)
CASES = {
    "llama": (
        transformers.LlamaConfig,
        dict(COMMON, hidden_size=32, num_attention_heads=8, num_key_value_heads=2, attention_bias=True),
    ),
    "qwen3": (
        transformers.Qwen3Config,
        dict(
            COMMON,
            hidden_size=24,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=8,
            tie_word_embeddings=True,
        ),
    ),
    "gemma2": (
        transformers.Gemma2Config,
        dict(
            COMMON,
            hidden_size=24,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=8,
            query_pre_attn_scalar=12,
            sliding_window=4,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=4.0,
        ),
    ),
    "gpt_neox": (
        transformers.GPTNeoXConfig,
        dict(
            COMMON,
            hidden_size=32,
            num_attention_heads=8,
            rope_parameters=dict(rope_type="default", rope_theta=100.0, partial_rotary_factor=0.5),
        ),
    ),
}


def write_checkpoint(name: str, directory: pathlib.Path) -> pathlib.Path:
    """transformers' tiny random `name` model (every parameter moved off its init), saved."""
    config_class, fields = CASES[name]
    config = config_class(**fields, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    generator = torch.Generator().manual_seed(len(name))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(directory / name)
    return directory / name


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh_checkpoints")
    return {name: write_checkpoint(name, root) for name in CASES}


@pytest.fixture(scope="module")
def mesh_results(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh_results") / "results.json"
    spec = {
        "devices": 8,
        "meshes": MESHES,
        "own_mesh": OWN_MESH,
        "workflows": WORKFLOWS,
        "directories": {name: str(path) for name, path in checkpoints.items()},
        "out": str(out),
    }
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "pretrained" / "mesh_worker.py"), json.dumps(spec)],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


# The documented table (docs/scaling.md), by hand: (scope, leaf) -> the mesh axis of each array
# axis where it divides the axis ("data" for d_model, "model" for heads, hidden units, vocabulary).
TABLE = {
    ("token_embedding", "embedding"): ("model", "data"),
    ("query", "kernel"): ("data", "model", None),
    ("key", "kernel"): ("data", "model", None),
    ("value", "kernel"): ("data", "model", None),
    ("query", "bias"): ("model", None),
    ("key", "bias"): ("model", None),
    ("value", "bias"): ("model", None),
    ("out", "kernel"): ("model", None, "data"),
    ("mlp_in", "kernel"): ("data", "model"),
    ("mlp_gate", "kernel"): ("data", "model"),
    ("mlp_in", "bias"): ("model",),
    ("mlp_gate", "bias"): ("model",),
    ("mlp_out", "kernel"): ("model", "data"),
    ("head", "kernel"): ("data", "model"),
    ("head", "bias"): ("model",),
}


def documented_spec(path: str, shape: list[int], data: int, model: int) -> list:
    axes = TABLE.get(tuple(path.split("/")[-2:]))
    if axes is None:
        return []
    sizes = {"data": data, "model": model}
    spec = [
        axis if axis and sizes[axis] > 1 and n % sizes[axis] == 0 else None
        for axis, n in zip(axes, shape, strict=True)
    ]
    return spec if any(spec) else []


@pytest.mark.slow
def test_every_family_on_every_mesh(mesh_results):
    # One test for the one subprocess's results: xdist would otherwise repeat the fixture on
    # every worker that draws one of several tests.
    check_every_workflow_equals_one_device(mesh_results)
    check_every_parameter_has_the_documented_sharding(mesh_results)
    check_a_model_axis_dividing_no_heads_is_refused(mesh_results)
    check_cached_activations_stay_split_over_the_batch_and_heads(mesh_results)


def check_every_workflow_equals_one_device(mesh_results):
    assert sorted(OWN_MESH.values()) == sorted(MESHES)
    for name, (data, model) in OWN_MESH.items():
        errors = mesh_results[name][f"{data}x{model}"]["errors"]
        where = f"{name} on ({data}, {model})"
        assert errors["cache_names"], where
        assert errors.get("greedy_equal", True) is True, where
        lora = ["lora_grads", "lora_loss"] if "lora" in WORKFLOWS[name] else []
        gqa = ["gqa_logits"] if "gqa" in WORKFLOWS[name] else []
        for result in ["logits", "cache", "sweep", *lora, *gqa]:
            assert errors[result] <= TOLERANCE, (where, result, errors[result])
        assert ("greedy_equal" in errors) == ("generate" in WORKFLOWS[name]), where


def check_every_parameter_has_the_documented_sharding(mesh_results):
    split = 0
    for name in CASES:
        for data, model in MESHES:
            placement = mesh_results[name][f"{data}x{model}"]["placement"]
            assert mesh_results[name][f"{data}x{model}"]["params_equal"], (name, data, model)
            for path, leaf in placement.items():
                assert leaf["spec"] == documented_spec(path, leaf["shape"], data, model), (name, path, leaf)
                split += bool(leaf["spec"])
    assert split > 100  # the table splits most matrices on these meshes
    # Llama's 2 K/V heads: split over a model axis of 2, replicated across one of 4 or 8.
    llama = mesh_results["llama"]
    assert llama["4x2"]["placement"]["block_0/attention/key/kernel"]["spec"] == ["data", "model", None]
    assert llama["2x4"]["placement"]["block_0/attention/key/kernel"]["spec"] == ["data", None, None]
    assert llama["1x8"]["placement"]["block_0/attention/key/kernel"]["spec"] == []


def check_a_model_axis_dividing_no_heads_is_refused(mesh_results):
    assert mesh_results["refused"] == (
        "mesh model axis=3: must divide num_heads=8 and divide (or be a multiple of) num_kv_heads=2"
    )


def check_cached_activations_stay_split_over_the_batch_and_heads(mesh_results):
    # Under jax.set_mesh: the batch (8) over "data", the heads (8 query, Llama's 2 K/V) over
    # "model" where it divides them, every other axis whole.
    for name, (data, model) in OWN_MESH.items():
        specs = mesh_results[name][f"{data}x{model}"]["cache_specs"]
        assert specs, name
        for hook, spec in specs.items():
            assert spec[0] == ("data" if data > 1 else "None"), (name, hook, spec)
        if model > 1:
            assert specs["blocks.0.attn.hook_q"] == ["data" if data > 1 else "None", "None", "model", "None"]
            assert specs["blocks.0.attn.hook_pattern"][1] == "model"
    llama_k = mesh_results["llama"]["2x4"]["cache_specs"]["blocks.0.attn.hook_k"]
    assert llama_k == ["data", "None", "None", "None"]  # 2 K/V heads, a model axis of 4
    # generate's decode cache follows the K/V weights: the batch over data, 2 K/V heads replicated
    decode = mesh_results["llama"]["2x4"]["cache_specs"]["decode:cached_key"]
    assert decode == ["data", "None", "None", "None"]


@pytest.mark.parametrize(
    "mesh,message",
    [
        ((2, 4), "mesh=(2, 4): must be a jax.sharding.Mesh with axes ('data', 'model')"),
        (
            jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1), ("batch",)),
            "mesh axes ('batch',): must be ('data', 'model')",
        ),
    ],
    ids=["not a mesh", "other axes"],
)
def test_a_mesh_without_the_two_axes_is_refused(checkpoints, mesh, message, monkeypatch):
    from qkv_jax.pretrained import checkpoint

    monkeypatch.setattr(checkpoint.TensorSource, "read_slice", None)  # no tensor may be read
    with pytest.raises(ValueError) as info:
        load_pretrained(checkpoints["llama"], mesh=mesh)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "kv, latent, sizes, expected",
    [
        (
            2,
            None,
            {"data": 2, "model": 2},
            P("data", None, "model", None),
        ),  # K/V heads split as their weights
        (2, None, {"data": 1, "model": 4}, P()),  # 2 K/V heads on a model axis of 4: replicated
        (4, None, {"data": 4, "model": 2}, P(None, None, "model", None)),  # a batch of 2 over data 4: whole
        (4, 8, {"data": 2, "model": 4}, P("data", None, None)),  # MLA's latents: the batch only
    ],
)
def test_the_decode_cache_follows_its_kv_weights(kv, latent, sizes, expected):
    from qkv_jax.sharding import cache_spec

    config = lm.TransformerConfig(
        vocab_size=16, d_model=16, num_heads=4, num_kv_heads=kv, kv_latent_dim=latent, num_layers=1, max_len=8
    )
    cache = lm.init_cache(lm.TransformerLM(config), 2)
    specs = {
        jax.tree_util.keystr(path): cache_spec(path, leaf.shape, sizes)
        for path, leaf in jax.tree_util.tree_leaves_with_path(cache)
    }
    cached = {name: spec for name, spec in specs.items() if "cached_" in name}
    assert cached and all(spec == expected for spec in cached.values()), specs
    assert all(spec == P() for name, spec in specs.items() if "cache_index" in name)


@pytest.mark.slow
def test_two_processes_each_hold_their_share_and_compute_one_process_logits(checkpoints, tmp_path):
    """2 processes x 4 CPU devices (jax.distributed over gloo), Llama on a (2, 4) mesh: each
    process holds only its own devices' blocks (half of every matrix split over "data"), the
    logits equal one process's, and save_pretrained from the global arrays writes a directory
    transformers loads to the same logits; a mesh over some of each process's devices is one
    ValueError line."""
    directory = checkpoints["llama"]
    tokens = np.random.default_rng(1).integers(0, 64, (4, 10))
    spec = {"directory": str(directory), "tokens": tokens.tolist(), "out": str(tmp_path)}
    processes, outputs = two_processes(WORKER, spec, timeout=600)
    for p, (_, err) in zip(processes, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads((tmp_path / f"process_{i}.json").read_text()) for i in range(2)]
    for i, result in enumerate(results):
        assert result["devices"] == 8
        assert result["refused"] == (
            "mesh of 4 devices over 2 processes: a mesh across processes must hold all 8 devices of "
            "the 2 processes"
        )
        held = result["held"]
        assert all(leaf["owners"] == [i] and leaf["global"] and leaf["as_rules"] for leaf in held.values())
        # Every d_model axis is split over "data" (2): a process holds half of each matrix.
        query = held["block_0/attention/query/kernel"]
        assert query["bytes"] * 2 == query["whole"]
        total = sum(leaf["bytes"] for leaf in held.values())
        whole = sum(leaf["whole"] for leaf in held.values())
        assert total < 0.6 * whole, (total, whole)
    config, params = load_pretrained(directory)
    ours = np.asarray(lm.TransformerLM(config).apply({"params": params}, tokens))
    theirs = np.asarray(results[0]["logits"])
    assert np.max(np.abs(theirs - ours)) <= TOLERANCE * np.max(np.abs(ours))
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="eager")
    with torch.no_grad():
        exported = saved.float()(torch.as_tensor(tokens)).logits.numpy()
    assert np.max(np.abs(exported - ours)) <= TOLERANCE * np.max(np.abs(ours))


@pytest.mark.slow
@pytest.mark.reliability(
    "Concurrency",
    "one process of a two-process run dies while loading a checkpoint onto the mesh",
    "the other stops at its next collective once the coordinator misses the dead one's heartbeats, "
    "with one line on stderr naming that process; nothing hangs",
)
def test_a_process_dying_during_a_load_stops_the_other_without_a_hang(checkpoints):
    """Process 1 dies at its first tensor; process 0 finishes its own load (a load exchanges
    nothing), then stops at its next collective once the coordination service misses process
    1's heartbeats (3 s here), ended by JAX rather than waiting for ever, with one line on
    stderr (the launchers' filter of JAX's fatal log) naming the process that stopped."""
    spec = {"directory": str(checkpoints["llama"]), "dies": 1, "heartbeat_seconds": 3}
    (survivor, dead), ((out, err), _) = two_processes(WORKER, spec, timeout=90)
    assert dead.returncode == 3
    assert "loaded" in out.splitlines(), err[-3000:]
    assert survivor.returncode != 0
    assert err.splitlines() == [
        "error: process 1 of this run stopped sending heartbeats (it died or hung); JAX's distributed "
        "service stops this process too"
    ], err[-3000:]
