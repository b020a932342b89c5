"""The studies' pieces: confidence intervals, the repeat task, probes through training."""

import jax
import numpy as np
import pytest
from scipy import stats

from configs import flag_retrieval, sequences
from qkv_jax.tasks.sequences import repeat_batch
from qkv_jax.training import build_setup, train_seeds
from studies.mechanisms import induction_probe, thermostat_probe
from studies.stats import mean_interval, paired_difference
from studies.sweep import run_sweep


def test_intervals_against_scipy():
    values = [3.1, 3.3, 3.2, 3.5, 3.0]
    interval = mean_interval(values)
    low, high = stats.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=stats.sem(values))
    assert interval["low"] == pytest.approx(low) and interval["high"] == pytest.approx(high)
    a, b = [3.20, 3.25, 3.18, 3.30], [3.10, 3.16, 3.07, 3.22]
    difference = paired_difference(a, b)
    assert difference["mean"] == pytest.approx(np.mean(np.subtract(a, b)))
    assert difference["p"] == pytest.approx(stats.ttest_rel(a, b).pvalue)
    assert difference["significant"] and difference["low"] > 0
    assert (
        difference["detectable"] > difference["high"] - difference["mean"]
    )  # 80% power needs more than the CI
    noise = paired_difference([1.0, 2.0, 3.0], [1.5, 1.5, 3.2])
    assert not noise["significant"] and noise["low"] < 0 < noise["high"]


def test_repeat_task_answers_are_the_earlier_copy():
    batch = repeat_batch(jax.random.PRNGKey(0), 64, length=10, vocab_size=20)
    inputs, targets, mask = (np.asarray(batch[k]) for k in ("inputs", "targets", "answer_mask"))
    sequence = np.concatenate([inputs, targets[:, -1:]], axis=1)  # (B, 2L + 1)
    offsets = set()
    for row in range(64):
        answers = np.flatnonzero(mask[row])  # target positions t: sequence token t + 1
        assert len(answers) == 4 and np.array_equal(
            answers, answers[0] + np.arange(4)
        )  # segment 5: 4 answers
        second = answers[0]  # the copy starts at sequence position `second`, its answers after it
        matches = [
            first
            for first in range(0, 6)
            if np.array_equal(sequence[row, first : first + 5], sequence[row, second : second + 5])
        ]
        assert matches, row  # the segment appeared before, in the first half
        assert 10 <= second <= 16
        offsets.add(second - matches[0])
    assert len(offsets) > 4  # the distance between the copies varies: no positional shortcut


@pytest.fixture(scope="module")
def thermostat_setups():
    def setup(scaled):
        config = flag_retrieval.get_config("thermostat")
        config.model.d_k, config.model.scaled = 1024, scaled
        return build_setup(config)

    return {scaled: setup(scaled) for scaled in (True, False)}


@pytest.mark.slow
def test_thermostat_probe_at_large_d_k(thermostat_setups):
    """At initialisation (3 seeds), d_k = 1024: unscaled logits give peaked rows, and the softmax
    passes back less gradient per unit of logit scale (the softmax saturates); yet the raw gradient
    at W_q and W_k is larger, because the scale divides the gradient as it divides the logits."""
    for seed in range(3):
        measured = {}
        for scaled, setup in thermostat_setups.items():
            params = jax.jit(setup.init)(jax.random.PRNGKey(seed))
            measured[scaled] = jax.device_get(jax.jit(thermostat_probe(setup))(params))
        unscaled, scaled = measured[False], measured[True]
        assert unscaled["entropy"] < scaled["entropy"] and unscaled["max_weight"] > scaled["max_weight"]
        assert 0 < unscaled["grad_query_per_scale"] < scaled["grad_query_per_scale"]
        assert unscaled["grad_query"] > scaled["grad_query"] and unscaled["grad_key"] > scaled["grad_key"]


@pytest.mark.slow
def test_probes_follow_vmapped_training_and_resume(tmp_path):
    config = sequences.get_config("repeat")
    config.model.update(num_layers=2, d_model=16, num_heads=2)
    config.task.update(length=4, vocab_size=8)
    config.train.update(cpu_optimization_level=0, steps=12, log_every=4, checkpoint_every=8, batch_size=8)
    config.eval.num_examples = 16
    setup = build_setup(config)
    probe = induction_probe(setup)
    straight = train_seeds(config, [0, 1], setup=setup, probe=probe)
    assert straight["probes"]["step"] == [0, 4, 8, 12]
    scores = np.asarray(straight["probes"]["induction"])  # (steps, seeds, L, N)
    assert scores.shape == (4, 2, 2, 2) and np.all((scores >= 0) & (scores <= 1))
    config.train.steps = 8
    train_seeds(config, [0, 1], setup=setup, workdir=tmp_path, probe=probe)  # stops at step 8 (checkpoint)
    config.train.steps = 12
    resumed = train_seeds(config, [0, 1], setup=setup, workdir=tmp_path, probe=probe)
    assert resumed["probes"]["step"] == [0, 4, 8, 12]
    np.testing.assert_allclose(np.asarray(resumed["probes"]["induction"]), scores, atol=1e-6)
    np.testing.assert_allclose(resumed["curves"], straight["curves"], atol=1e-6)
    (row,) = run_sweep(
        config, tmp_path / "sweep", [{}], [0, 1], probe_for=induction_probe, log=lambda *_: None
    )
    assert row["probes"]["step"] == [0, 4, 8, 12]  # a sweep cell's row carries its probe too
