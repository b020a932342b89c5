"""Data- and head-parallel training on simulated devices and processes equals one device."""

import json
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from launch import cache_flag, free_port, launcher_env, run_together
from saved_state import final_state

from configs import flag_retrieval
from qkv_jax.training import (
    ConfigError,
    build_setup,
    init_train_state,
    make_optimizer,
    seed_keys,
    train_and_evaluate,
)
from qkv_jax.training.sharding import make_mesh, mesh_shape, partition_spec, state_shardings
from qkv_jax.training.workdir import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]
OVERRIDES = {
    "model.num_heads": 4,
    "train.steps": 20,
    "train.batch_size": 16,
    "train.log_every": 5,
    "train.checkpoint_every": 10,
    "eval.num_examples": 64,
    "eval.num_plot_examples": 2,
    "train.cpu_optimization_level": 0,  # tiny programs: compile time is most of each run
}
MESHES = [(1, 1), (8, 1), (4, 2), (2, 4)]


def config_with(**overrides):
    config = flag_retrieval.get_config("multihead")
    for field, value in {**OVERRIDES, **overrides}.items():
        section, name = field.split(".")
        config[section][name] = value
    return config


def run_on_devices(devices, runs):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "multidevice.py"),
            json.dumps({"devices": devices, "runs": runs}),
        ],
        cwd=ROOT,
        env=launcher_env(),  # at the call: the session's compilation cache is set up by then
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def assert_same_run(workdir_a, workdir_b, config, atol=1e-5):
    losses_a = [r["loss"] for r in read_metrics(pathlib.Path(workdir_a) / "metrics.jsonl")]
    losses_b = [r["loss"] for r in read_metrics(pathlib.Path(workdir_b) / "metrics.jsonl")]
    assert len(losses_a) == len(losses_b) > 0
    np.testing.assert_allclose(losses_a, losses_b, atol=atol, rtol=atol)
    (step_a, state_a), (step_b, state_b) = final_state(workdir_a, config), final_state(workdir_b, config)
    assert step_a == step_b

    def compare(path, a, b):
        # A key bias adds the same q.b_k to every logit of a row: the softmax ignores it and its
        # gradient is zero up to rounding, which Adam's normalised step amplifies to O(lr) noise.
        # It cannot change any output (the losses above agree); every other array must.
        if "key" in jax.tree_util.keystr(path) and "bias" in jax.tree_util.keystr(path):
            return
        np.testing.assert_allclose(a, b, atol=atol, rtol=atol, err_msg=jax.tree_util.keystr(path))

    jax.tree_util.tree_map_with_path(compare, state_a, state_b)


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory):
    """The flag task on 8 simulated devices with each mesh, and the first 10 steps of the 4 x 2
    mesh's run (`stopped`, for the resume test), in one subprocess."""
    root = tmp_path_factory.mktemp("meshes")
    runs = [
        {
            "workdir": str(root / f"{d}x{m}"),
            "config": "flag_retrieval:multihead",
            "overrides": {**OVERRIDES, "mesh.data": d, "mesh.model": m},
        }
        for d, m in MESHES
    ]
    runs.append(
        {
            "workdir": str(root / "stopped"),
            "config": "flag_retrieval:multihead",
            "overrides": {**OVERRIDES, "train.steps": 10, "mesh.data": 4, "mesh.model": 2},
        }
    )
    run_on_devices(8, runs)
    return root


@pytest.mark.slow
def test_meshes_match_one_device(mesh_runs):
    # One test for all meshes: the 8-device runs are one fixture, which xdist would
    # otherwise repeat on every worker that draws one of the meshes.
    for data, model in MESHES[1:]:
        summary = json.loads((mesh_runs / f"{data}x{model}" / "summary.json").read_text())
        assert summary["mesh"] == {"data": data, "model": model}
        assert_same_run(mesh_runs / "1x1", mesh_runs / f"{data}x{model}", config_with())


LM_OVERRIDES = {
    "model.num_layers": 1,
    "model.d_model": 32,
    "model.num_heads": 4,
    "model.num_kv_heads": 2,
    "model.max_len": 32,
    "task.seq_len": 32,
    "train.steps": 10,
    "train.batch_size": 16,
    "train.warmup_steps": 2,
    "train.log_every": 5,
    "train.checkpoint_every": 10,
    "eval.num_examples": 16,
    "eval.sample_length": 8,
    "eval.num_samples": 1,
    "train.cpu_optimization_level": 0,
}


@pytest.fixture(scope="module")
def lm_mesh_runs(tmp_path_factory):
    """The char LM (heads and MLP split over "model") on 8 simulated devices, each mesh."""
    root = tmp_path_factory.mktemp("lm_meshes")
    corpus = root / "code.txt"
    corpus.write_text("".join(f"def f_{i}(x):\n    return x * {i % 7}\n\n" for i in range(300)))
    runs = [
        {
            "workdir": str(root / f"{d}x{m}"),
            "config": "char_lm",
            "overrides": {**LM_OVERRIDES, "data.path": str(corpus), "mesh.data": d, "mesh.model": m},
        }
        for d, m in MESHES
    ]
    run_on_devices(8, runs)
    return root, corpus


@pytest.mark.slow
def test_lm_meshes_match_one_device(lm_mesh_runs):
    from configs import char_lm

    root, corpus = lm_mesh_runs
    config = char_lm.get_config()
    for field, value in {**LM_OVERRIDES, "data.path": str(corpus)}.items():
        section, name = field.split(".")
        config[section][name] = value
    for data, model in MESHES[1:]:
        assert_same_run(root / "1x1", root / f"{data}x{model}", config)


@pytest.mark.slow
@pytest.mark.reliability(
    "Checkpoints",
    "resuming on another device count (saved on a 4 x 2 mesh of 8 devices, resumed on 1)",
    "orbax restores onto the new layout; the run ends as an uninterrupted one-device run (1e-5)",
)
def test_resume_from_eight_devices_onto_one(tmp_path, mesh_runs):
    # Saved by the 8-device process of `mesh_runs`; resumed here, in this one-device process.
    assert jax.device_count() == 1
    workdir = shutil.copytree(mesh_runs / "stopped", tmp_path / "moved")
    assert json.loads((workdir / "summary.json").read_text())["mesh"] == {"data": 4, "model": 2}
    train_and_evaluate(config_with(**{"mesh.data": 1, "mesh.model": 1}), workdir)
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["resumed_from_step"] == 10 and summary["mesh"] == {"data": 1, "model": 1}
    assert_same_run(mesh_runs / "1x1", workdir, config_with())


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, mesh_runs):
    """2 processes x 2 devices on 127.0.0.1, through the real command line."""
    port = free_port()
    args = [f"--config.{k}={v}" for k, v in OVERRIDES.items()] + [
        "--config.mesh.data=2",
        "--config.mesh.model=2",
        cache_flag(),
    ]
    commands = [
        [sys.executable, "-m", "experiments.train", "--config", "configs/flag_retrieval.py:multihead"]
        + ["--workdir", str(tmp_path / "two"), "--num_cpu_devices=2", f"--coordinator=127.0.0.1:{port}"]
        + ["--num_processes=2", f"--process_id={i}", *args]
        for i in range(2)
    ]
    processes, outputs = run_together(commands, 600)
    for p, (_, err) in zip(processes, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert "eval_accuracy" in outputs[0][0] and "eval_accuracy" not in outputs[1][0]  # process 0 reports
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["mesh"] == {"data": 2, "model": 2}
    assert_same_run(mesh_runs / "1x1", tmp_path / "two", config_with())


@pytest.mark.reliability(
    "Config and command line",
    "mesh a machine cannot hold: batch not divisible by the data axis, heads "
    "not divisible by the model axis, more devices than exist, two -1 axes",
    "`ConfigError` naming the fields and values, before anything compiles",
)
@pytest.mark.parametrize(
    "overrides,devices,message",
    [
        ({"mesh.data": 3}, 8, "train.batch_size=16 is not divisible by the data axis (mesh.data=3)"),
        (
            {"mesh.data": 2, "mesh.model": 3},
            8,
            "model.num_heads=4 is not divisible by the model axis (mesh.model=3)",
        ),
        (
            {"mesh.data": 4, "mesh.model": 4},
            8,
            "mesh.data=4 x mesh.model=4: asks for more devices than the 8",
        ),
        ({"mesh.data": -1, "mesh.model": -1}, 8, "at most one axis"),
        ({"mesh.model": 0}, 8, "mesh.model=0: must be a positive integer or -1"),
    ],
)
def test_mesh_validation(overrides, devices, message):
    with pytest.raises(ConfigError) as info:
        mesh_shape(config_with(**overrides).to_dict(), num_devices=devices)
    assert message in str(info.value)


def test_layout_rules():
    assert mesh_shape(config_with(**{"mesh.model": 2}).to_dict(), num_devices=8) == (4, 2)
    assert mesh_shape(config_with(**{"mesh.data": 2, "mesh.model": -1}).to_dict(), num_devices=8) == (2, 4)
    path = lambda *names: tuple(jax.tree_util.DictKey(n) for n in names)  # noqa: E731
    assert partition_spec(path("attention", "query", "kernel"), (8, 4, 2), 2) == jax.sharding.PartitionSpec(
        None, "model", None
    )
    assert partition_spec(path("attention", "out", "kernel"), (4, 2, 8), 2) == jax.sharding.PartitionSpec(
        "model", None, None
    )
    assert partition_spec(path("block_0", "mlp_in", "kernel"), (8, 32), 4) == jax.sharding.PartitionSpec(
        None, "model"
    )
    assert (
        partition_spec(path("attention", "key", "kernel"), (8, 1, 2), 2) == jax.sharding.PartitionSpec()
    )  # MQA
    assert partition_spec(path("attention", "query", "kernel"), (8, 4, 2), 1) == jax.sharding.PartitionSpec()
    # The optimizer state follows the parameters: Adam's mu/nu leaves get the same specs.
    config = config_with().to_dict()
    setup = build_setup(config)
    abstract = jax.eval_shape(
        lambda k: init_train_state(setup, make_optimizer(config["train"]), k), seed_keys(0)["init"]
    )
    shardings = state_shardings(abstract, make_mesh(1, 1))
    assert jax.tree.structure(shardings) == jax.tree.structure(abstract)
