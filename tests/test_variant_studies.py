"""The variant studies: logit_scale (its config's refusals and cells, its arms) and positions, each
end to end."""

import math

import jax
import numpy as np
import pytest

from configs import flag_retrieval, sequences
from qkv_jax.studies.catalogue import STUDIES
from qkv_jax.studies.grid import apply_overrides
from qkv_jax.studies.results import write_study_results
from qkv_jax.studies.variants import (
    POSITION_CELLS,
    REFERENCE,
    logit_scale,
    logit_scale_arm,
    logit_scale_probe,
    positions,
)
from qkv_jax.training import ConfigError, build_setup
from qkv_jax.training.setup import to_dict


@pytest.mark.parametrize("variant", ["learned_query", "static", "thermostat"])
@pytest.mark.parametrize(
    "field, value, named",
    [("normalize_qk", "rms", "model.normalize_qk='rms'"), ("attn_logits_soft_cap", 5.0, "cap=5.0")],
)
def test_only_multihead_takes_qk_norm_and_soft_cap(variant, field, value, named):
    config = flag_retrieval.get_config(variant)
    config.model[field] = value
    with pytest.raises(ConfigError, match="only model.kind='multihead'") as refused:
        build_setup(config)
    assert named in str(refused.value) and len(str(refused.value).splitlines()) == 1


@pytest.mark.parametrize(
    "field, value",
    [
        ("normalize_qk", "l2"),
        ("attn_logits_soft_cap", 0.0),
        ("attn_logits_soft_cap", -1.0),
        ("attn_logits_soft_cap", math.inf),
        ("attn_logits_soft_cap", True),
    ],
)
def test_bad_qk_norm_or_soft_cap_values_are_refused(field, value):
    config = to_dict(flag_retrieval.get_config("logit_scale"))
    config["model"][field] = value
    with pytest.raises(ConfigError, match=f"model.{field}="):
        build_setup(config)


def test_logit_scale_cells_are_every_arm_at_every_d_k():
    base = to_dict(flag_retrieval.get_config("logit_scale"))
    assert base["model"]["kind"] == "multihead" and base["model"]["num_heads"] == 1
    cells = flag_retrieval.get_sweep("logit_scale")
    assert len(cells) == 20
    arms: dict[int, list[str]] = {}
    for cell in cells:
        config = apply_overrides(base, cell)
        build_setup(config)  # every cell's config is accepted
        arms.setdefault(config["model"]["d_k"], []).append(logit_scale_arm(config["model"]))
    assert sorted(arms) == [16, 64, 256, 1024]
    # the pairing: at one d_k and seed every arm starts from the same projections and query token
    inits = [
        jax.jit(build_setup(apply_overrides(base, cell)).init)(jax.random.PRNGKey(3))
        for cell in cells
        if cell["model.d_k"] == 16
    ]
    for params in inits[1:]:
        for name in ("query", "key", "value", "out"):
            np.testing.assert_array_equal(
                params["attention"][name]["kernel"], inits[0]["attention"][name]["kernel"]
            )
        np.testing.assert_array_equal(params["query"], inits[0]["query"])
    for names in arms.values():
        assert names == [
            "no scale",
            REFERENCE,
            "QK-norm (rms)",
            "QK-norm (rms) + 1/sqrt(d_k)",
            "soft cap 5",
        ]


@pytest.mark.slow
def test_qk_norm_without_the_scale_starts_peaked_at_large_d_k():
    """RMS-normalised queries and keys have norm sqrt(d_k) each: without 1/sqrt(d_k) the logits at
    initialisation grow with d_k as the unscaled ones do, so the row starts nearly one-hot."""
    base = to_dict(flag_retrieval.get_config("logit_scale"))
    entropy = {}
    for scaled in (False, True):
        config = apply_overrides(
            base, {"model.d_k": 1024, "model.normalize_qk": "rms", "model.scaled": scaled}
        )
        config["eval"]["num_examples"] = 256
        setup = build_setup(config)
        params = jax.jit(setup.init)(jax.random.PRNGKey(0))
        entropy[scaled] = float(jax.jit(logit_scale_probe(setup))(params)["entropy"])
    assert entropy[False] < 0.5 < 1.0 < entropy[True] <= math.log(5) + 1e-6


@pytest.mark.slow
def test_logit_scale_study_end_to_end(tmp_path):
    config = flag_retrieval.get_config("logit_scale")
    config.train.update(steps=20, log_every=10, checkpoint_every=100)
    config.eval.num_examples = 128
    cells = [c for c in flag_retrieval.get_sweep("logit_scale") if c["model.d_k"] == 16][:3]
    results = logit_scale(to_dict(config), tmp_path, cells, [0, 1])
    assert [r["arm"] for r in results["rows"]] == ["no scale", REFERENCE, "QK-norm (rms)"]
    for row in results["rows"]:
        assert row["steps"] == [0, 10, 20] and len(row["steps_to_converge"]) == 2
        assert all(s in (10.0, 20.0) for s in row["steps_to_converge"])  # reached, or the budget
        assert (row["minus_reference"] is None) == (row["arm"] == REFERENCE)
    unscaled = results["rows"][0]
    difference = unscaled["minus_reference"]["entropy_init"]
    expected = [
        a - b for a, b in zip(unscaled["entropy_init"], results["rows"][1]["entropy_init"], strict=True)
    ]
    assert difference["mean"] == pytest.approx(sum(expected) / 2)
    record = write_study_results(
        tmp_path, results, "python -m experiments.study logit_scale", STUDIES["logit_scale"]
    )
    assert any("| 16 | no scale |" in line for line in record["table"])
    assert (tmp_path / "logit_scale.png").exists()


def tiny_repeat(max_len: int = 32) -> dict:
    config = sequences.get_config("repeat")
    config.model.update(num_layers=2, d_model=16, num_heads=2, max_len=max_len)
    config.task.update(length=4, vocab_size=8)
    config.train.update(steps=8, log_every=4, checkpoint_every=8, batch_size=8)
    config.eval.num_examples = 16
    return to_dict(config)


def test_positions_study_refusals(tmp_path):
    with pytest.raises(ConfigError, match=r"model.max_len=16: .* up to 32 tokens"):
        positions(tiny_repeat(max_len=16), tmp_path, [0])
    copy = to_dict(sequences.get_config("copy"))
    with pytest.raises(ConfigError, match="needs the repeat task"):
        positions(copy, tmp_path, [0])
    assert [cell["model.positions"] for cell in POSITION_CELLS] == ["rope", "learned", "none"]


@pytest.mark.slow
def test_positions_study_end_to_end(tmp_path):
    results = positions(tiny_repeat(), tmp_path, [0, 1])
    assert results["lengths"] == [8, 16, 32]
    assert [r["arm"] for r in results["rows"]] == ["rope", "learned", "none"]
    for row in results["rows"]:
        assert row["steps"] == [0, 4, 8] and len(row["formed_at_step"]) == 2
        for n in (8, 16, 32):
            assert all(0 <= a <= 1 for a in row[f"accuracy_{n}"]) and all(x > 0 for x in row[f"loss_{n}"])
        assert (row["minus_reference"] is None) == (row["arm"] == "rope")
    learned = results["rows"][1]
    difference = learned["minus_reference"]["loss_32"]
    expected = np.subtract(learned["loss_32"], results["rows"][0]["loss_32"]).mean()
    assert difference["mean"] == pytest.approx(expected)
    record = write_study_results(
        tmp_path, results, "python -m experiments.study positions", STUDIES["positions"]
    )
    assert any(line.startswith("| learned |") for line in record["table"])
    assert (tmp_path / "positions.png").exists()
