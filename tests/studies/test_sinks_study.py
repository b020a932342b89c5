"""The sinks study: its per-head measures against NumPy, and the study end to end, shrunk."""

import jax
import numpy as np
import pytest

from configs import char_lm
from qkv_jax.training.setup import to_dict
from studies.catalogue import STUDIES
from studies.results import write_study_results
from studies.sinks import FIRST_QUERY, head_measures, sinks


def test_head_measures_are_first_token_share_entropy_and_sink_mass_of_the_later_queries():
    rng = np.random.default_rng(0)
    weights = rng.uniform(0.0, 1.0, (2, 3, 12, 12)) * np.tril(np.ones((12, 12)))  # causal rows
    weights /= weights.sum(-1, keepdims=True) / rng.uniform(0.5, 1.0, (2, 3, 12, 1))  # rows sum to < 1
    measured = jax.device_get(head_measures(weights.astype(np.float32)))
    rows = weights[:, :, FIRST_QUERY:]
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.nansum(np.where(rows > 0, rows * np.log(rows), 0.0), axis=-1)
    np.testing.assert_allclose(measured["first_token"], rows[..., 0].mean(axis=(0, 2)), rtol=1e-5)
    np.testing.assert_allclose(measured["entropy"], entropy.mean(axis=(0, 2)), rtol=1e-5)
    np.testing.assert_allclose(measured["sink_mass"], (1 - rows.sum(-1)).mean(axis=(0, 2)), rtol=1e-4)
    assert np.all(measured["sink_mass"] > 0.05)  # the comparison is not of zeros


@pytest.mark.slow
def test_sinks_study_pairs_each_arm_with_plain_softmax(tmp_path):
    corpus = tmp_path / "code.txt"
    corpus.write_text("".join(f"def add_{i}(x):\n    return x + {i % 10}\n\n" for i in range(400)))
    config = char_lm.get_config("study")
    config.data.path = str(corpus)
    config.model.update(num_layers=1, d_model=16, num_heads=2, max_len=32)
    config.task.seq_len = 32
    config.train.update(cpu_optimization_level=0, steps=10, log_every=5, checkpoint_every=10, batch_size=8)
    config.eval.update(num_examples=8, sample_length=8, ablation_examples=0)
    results = sinks(to_dict(config), tmp_path, [0, 1])
    assert [r["arm"] for r in results["rows"]] == ["softmax", "sinks", "soft cap 5", "sinks + soft cap 5"]
    for row in results["rows"]:
        assert row["steps"] == [0, 5, 10] and len(row["first_token"]) == 2
        assert (row["arm"].startswith("sinks")) == (min(row["sink_mass"]) > 1e-3)
    plain = results["rows"][0]["minus_softmax"]["first_token"]
    assert plain["mean"] == 0.0
    record = write_study_results(tmp_path, results, "python -m experiments.study sinks", STUDIES["sinks"])
    assert (tmp_path / "sinks.png").exists() and len(record["table"]) == 2 + 4 + 2
