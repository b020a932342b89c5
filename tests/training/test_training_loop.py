"""train_and_evaluate end to end on shrunken configs: outputs, resume, NaN guard."""

import json

import chex
import jax
import numpy as np
import pytest
from saved_state import final_state

from configs import flag_retrieval
from qkv_jax.tasks.flag_retrieval import flag_retrieval_batch
from qkv_jax.training import (
    Checkpoints,
    ConfigError,
    build_setup,
    init_train_state,
    make_optimizer,
    make_train_chunk,
    seed_keys,
    train_and_evaluate,
)


def small_config(variant=None, **overrides):
    config = flag_retrieval.get_config(variant)
    config.train.steps = 20
    config.train.batch_size = 8
    config.train.log_every = 5
    config.train.checkpoint_every = 10
    config.train.cpu_optimization_level = 0  # a tiny model: compile time is most of each run
    config.eval.num_examples = 64
    config.eval.num_plot_examples = 3
    for field, value in overrides.items():
        section, name = field.split("__")
        config[section][name] = value
    return config


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("flag")
    summary = train_and_evaluate(small_config(), workdir)
    return workdir, summary


def test_workdir_holds_every_output(small_run):
    workdir, summary = small_run
    saved_config = json.loads((workdir / "config.json").read_text())
    assert saved_config == small_config().to_dict()
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 5, 10, 15, 19]
    assert all(np.isfinite(r["loss"]) for r in records)
    on_disk = json.loads((workdir / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    for field in ("final_loss", "eval_accuracy", "eval_mse", "steps", "wall_time_s"):
        assert field in on_disk, field
    for field in ("eval_accuracy", "eval_mse", "eval_entropy"):
        assert field in on_disk["untrained"], field
    assert on_disk["steps"] == 20 and on_disk["final_loss"] == records[-1]["loss"]
    assert 0.0 <= on_disk["eval_accuracy"] <= 1.0
    assert Checkpoints(workdir / "checkpoints").all_steps() == [10, 20]
    for name in ("attention_before.png", "attention_after.png"):
        assert (workdir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_training_reduces_the_loss(small_run):
    workdir, summary = small_run
    assert summary["eval_mse"] < summary["untrained"]["eval_mse"]


@pytest.mark.reliability(
    "Checkpoints",
    "a run stopped and resumed (also with more steps)",
    "ends with bit-identical parameters and the same metrics.jsonl as an uninterrupted run",
)
def test_resume_gives_identical_parameters(tmp_path, small_run):
    straight, _ = small_run  # the uninterrupted run: small_config() trained straight to step 20
    resumed = tmp_path / "resumed"
    first = train_and_evaluate(small_config(train__steps=10), resumed)
    assert first["steps"] == 10
    second = train_and_evaluate(small_config(), resumed)
    assert second["resumed_from_step"] == 10 and second["steps"] == 20

    step_a, state_a = final_state(straight, small_config())
    step_b, state_b = final_state(resumed, small_config())
    assert step_a == step_b == 20
    jax.tree.map(np.testing.assert_array_equal, state_a, state_b)
    metrics = [(tmp / "metrics.jsonl").read_text() for tmp in (straight, resumed)]
    assert metrics[0] == metrics[1]


def test_cpu_optimization_levels_compile_the_same_run(tmp_path, small_run):
    """train.cpu_optimization_level changes how XLA compiles the run, not what it computes: the run
    of level 0 (small_config's), stopped at step 10 and resumed at the default level 1, ends as the
    uninterrupted one to float32 rounding; a level outside 0-2 is refused before any work."""
    straight, summary = small_run
    resumed = tmp_path / "resumed"
    train_and_evaluate(small_config(train__steps=10), resumed)
    second = train_and_evaluate(small_config(train__cpu_optimization_level=1), resumed)
    assert second["resumed_from_step"] == 10
    np.testing.assert_allclose(second["eval_mse"], summary["eval_mse"], rtol=1e-4)
    (_, state_a), (_, state_b) = (final_state(w, small_config()) for w in (straight, resumed))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), state_a, state_b)
    with pytest.raises(ConfigError, match=r"^train.cpu_optimization_level=True: must be 0, 1 or 2$"):
        train_and_evaluate(small_config(train__cpu_optimization_level=True), tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


@pytest.mark.reliability(
    "Training",
    "loss blows up before the first checkpoint",
    "`FloatingPointError` naming the step and window; no checkpoint and no summary are written",
)
def test_non_finite_loss_stops_the_run_and_keeps_the_last_checkpoint(tmp_path):
    config = small_config(train__optimizer="sgd", train__learning_rate=1e30)
    with pytest.raises(FloatingPointError, match=r"at step \d+ \(in the window of steps \d+-\d+\)"):
        train_and_evaluate(config, tmp_path)
    assert not (tmp_path / "summary.json").exists()
    assert Checkpoints(tmp_path / "checkpoints").all_steps() == []  # nothing non-finite saved


@pytest.fixture(scope="module")
def chunk_of_five():
    """(setup, initial state, data key, a jitted 5-step chunk that fails if it is traced twice):
    the tests below share its compilation."""
    config = small_config().to_dict()
    setup = build_setup(config)
    state = init_train_state(setup, make_optimizer(config["train"]), seed_keys(0)["init"])
    chunk = jax.jit(chex.assert_max_traces(make_train_chunk(setup, 5), n=1))
    return setup, state, seed_keys(0)["data"], chunk


def test_train_chunk_compiles_once(chunk_of_five):
    setup, state, data_key, chunk = chunk_of_five
    state, losses = chunk(state, data_key, setup.data)
    state, losses = chunk(state, data_key, setup.data)
    assert losses.shape == (5,) and int(state.step) == 10


def test_batches_depend_only_on_seed_and_step(chunk_of_five):
    """Step s's batch is a function of fold_in(data_key, s): chunks replay exactly."""
    setup, state, data_key, five = chunk_of_five
    ten = jax.jit(make_train_chunk(setup, 10))
    one_go, losses_10 = ten(state, data_key, setup.data)
    half, losses_a = five(state, data_key, setup.data)
    two_halves, losses_b = five(half, data_key, setup.data)
    np.testing.assert_array_equal(losses_10, np.concatenate([losses_a, losses_b]))
    jax.tree.map(np.testing.assert_array_equal, one_go.params, two_halves.params)


class TestFlagTask:
    def test_seed_definition(self):
        batch = flag_retrieval_batch(jax.random.PRNGKey(0), 64, seq_len=5, d_model=8)
        inputs, targets, positions = batch["inputs"], batch["targets"], batch["flag_positions"]
        assert inputs.shape == (64, 5, 8) and targets.shape == (64, 7) and positions.shape == (64, 1)
        flags = np.asarray(inputs[..., 7])
        np.testing.assert_array_equal(flags, np.eye(5)[positions[:, 0]])
        np.testing.assert_array_equal(targets, inputs[np.arange(64), positions[:, 0], :7])

    def test_positions_are_uniform_and_content_is_standard_normal(self):
        batch = flag_retrieval_batch(jax.random.PRNGKey(1), 20000, seq_len=5, d_model=8)
        counts = np.bincount(np.asarray(batch["flag_positions"][:, 0]), minlength=5) / 20000
        np.testing.assert_allclose(counts, 0.2, atol=0.015)
        content = np.asarray(batch["inputs"][..., :7])
        assert abs(content.mean()) < 0.01 and abs(content.std() - 1.0) < 0.01

    def test_two_flags_mark_distinct_positions(self):
        batch = flag_retrieval_batch(jax.random.PRNGKey(2), 256, seq_len=5, d_model=8, num_flags=2)
        positions = np.asarray(batch["flag_positions"])
        assert (positions[:, 0] != positions[:, 1]).all()
        inputs = np.asarray(batch["inputs"])
        for flag in range(2):
            np.testing.assert_array_equal(inputs[..., 6 + flag], np.eye(5)[positions[:, flag]])
            np.testing.assert_array_equal(
                batch["targets"][:, 6 * flag : 6 * (flag + 1)],
                inputs[np.arange(256), positions[:, flag], :6],
            )

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="num_flags=6, seq_len=5"):
            flag_retrieval_batch(jax.random.PRNGKey(0), 2, seq_len=5, d_model=8, num_flags=6)


@pytest.mark.slow
def test_default_run_learns_the_flag(tmp_path):
    """As the PyTorch reference loop does: loss ~0 by step 400, the flagged position top-attended
    on fresh examples (and not before training)."""
    summary = train_and_evaluate(flag_retrieval.get_config(), tmp_path)
    records = {
        r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
    }
    assert records[400] < 1e-2
    assert summary["final_loss"] < 1e-3
    assert summary["eval_accuracy"] >= 0.999
    assert summary["untrained"]["eval_accuracy"] < 0.5


@pytest.mark.slow
def test_static_baseline_stays_near_chance(tmp_path):
    summary = train_and_evaluate(flag_retrieval.get_config("static"), tmp_path)
    assert summary["params"] == summary["trainable_params"] == 0
    assert summary["eval_accuracy"] == summary["untrained"]["eval_accuracy"]
    assert summary["eval_accuracy"] < 0.35  # chance is 1/seq_len = 0.2
