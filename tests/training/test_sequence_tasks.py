"""The TransformerLM on the synthetic tasks: metrics, config checks, shrunken runs."""

import jax
import numpy as np
import pytest

from configs import sequences
from qkv_jax.tasks.sequences import answer_metrics
from qkv_jax.training import ConfigError, build_setup, train_and_evaluate


def test_answer_metrics_against_numpy():
    logits = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (4, 6, 5)), np.float64)
    targets = np.array(jax.random.randint(jax.random.PRNGKey(1), (4, 6), 0, 5))
    mask = np.zeros((4, 6), bool)
    mask[:, 3:] = True
    targets[0, 3:] = logits[0, 3:].argmax(-1)  # sequence 0 entirely right
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]  # (B, L)
    right = logits.argmax(-1) == targets
    got = answer_metrics(logits.astype(np.float32), {"targets": targets, "answer_mask": mask})
    assert float(got["loss"]) == pytest.approx(-picked[mask].mean(), rel=1e-5)
    assert float(got["accuracy"]) == pytest.approx(right[mask].mean())
    assert float(got["sequence_accuracy"]) == pytest.approx(np.all(right | ~mask, axis=-1).mean())
    assert float(got["sequence_accuracy"]) >= 0.25


def small_config(variant, **overrides):
    config = sequences.get_config(variant)
    config.task.length = 4
    config.model.num_layers = 1
    config.model.d_model = 16
    config.train.steps = 2
    config.train.log_every = 1
    config.train.checkpoint_every = 2
    config.train.warmup_steps = 1
    config.train.cpu_optimization_level = 0  # a tiny model: compile time is most of each run
    config.eval.num_examples = 16
    for field, value in overrides.items():
        section, name = field.split("__")
        config[section][name] = value
    return config


def test_max_len_follows_the_task_length():
    config = small_config("copy")
    assert config.model.max_len == 8
    config.task.length = 6
    assert config.model.max_len == 12  # lazy: an override of task.length carries over
    config.model.max_len = 10
    with pytest.raises(
        ConfigError, match=r"model.max_len=10: shorter than the training sequences \(2 \* task.length=12\)"
    ):
        build_setup(config)
    with pytest.raises(ConfigError, match="task.vocab_size=1: must be >= 2"):
        build_setup(small_config("copy", task__vocab_size=1))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["copy", "brackets"])
def test_shrunken_run(tmp_path, variant):
    summary = train_and_evaluate(small_config(variant), tmp_path)
    assert summary["steps"] == 2
    for field in ("eval_loss", "eval_accuracy", "eval_sequence_accuracy"):
        assert np.isfinite(summary[field]) and np.isfinite(summary["untrained"][field]), field
    assert 0.0 <= summary["eval_accuracy"] <= 1.0
