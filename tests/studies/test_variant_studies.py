"""The variant studies: logit_scale (its config's refusals and cells, its arms), its char LM half
(logit_scale_lm), and positions with its char LM half (positions_lm), each end to end."""

import math

import jax
import numpy as np
import pytest

from configs import char_lm, flag_retrieval, sequences
from qkv_jax import lm
from qkv_jax.tasks.transformer import transformer_config
from qkv_jax.training import ConfigError, build_setup
from qkv_jax.training.setup import to_dict
from studies.catalogue import STUDIES
from studies.grid import apply_overrides
from studies.lm_positions import positions_lm
from studies.results import write_study_results
from studies.variants import (
    LM_CELLS,
    POSITION_CELLS,
    REFERENCE,
    logit_scale,
    logit_scale_arm,
    logit_scale_lm,
    logit_scale_lm_arm,
    logit_scale_probe,
    positions,
)


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
    config.train.update(cpu_optimization_level=0, steps=20, log_every=10, checkpoint_every=100)
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
    config.train.update(cpu_optimization_level=0, steps=8, log_every=4, checkpoint_every=8, batch_size=8)
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


# ------------------------------------------------------------------- logit_scale_lm (the char LM)


def tiny_char_lm(tmp_path) -> dict:
    corpus = tmp_path / "code.txt"
    corpus.write_text("".join(f"def add_{i}(x):\n    return x + {i % 10}\n\n" for i in range(400)))
    config = char_lm.get_config("study")
    config.data.path = str(corpus)
    config.model.update(num_layers=1, d_model=16, max_len=32)
    config.task.seq_len = 32
    config.train.update(cpu_optimization_level=0, steps=10, log_every=5, checkpoint_every=10, batch_size=8)
    config.eval.update(num_examples=8, sample_length=8, ablation_examples=0)
    return to_dict(config)


def test_logit_scale_lm_cells_are_the_flag_arms_at_two_head_depths(tmp_path):
    base = tiny_char_lm(tmp_path)
    arms: dict[int, list[str]] = {}
    for cell in LM_CELLS:
        model = transformer_config(apply_overrides(base, cell)["model"], 16)  # every cell is accepted
        d_k = model.d_model // model.num_heads
        arms.setdefault(d_k, []).append(logit_scale_lm_arm(apply_overrides(base, cell)["model"]))
        scale = lm.attention_options(model)["scale"]
        assert (scale is None) == ("1/sqrt(d_k)" in arms[d_k][-1])
    assert sorted(arms) == [2, 16]  # d_model 16: one head of 16, eight of 2
    for names in arms.values():
        assert names == ["no scale", REFERENCE, "QK-norm (rms)", "QK-norm (rms) + 1/sqrt(d_k)", "soft cap 5"]
    # the pairing: at one d_k and seed every arm starts from the same values of the shared parameters
    # (checked for the scale alone and QK-norm alone, which adds query_ln/key_ln: every other arm
    # has the parameters of one of these two, and differs from it only outside them)
    one_head = [cell for cell in LM_CELLS if cell["model.num_heads"] == 1][1:3]
    inits = [jax.jit(build_setup(apply_overrides(base, c)).init)(jax.random.PRNGKey(3)) for c in one_head]
    shared = jax.tree.map(np.asarray, inits[0])
    for params in inits:
        for path, leaf in jax.tree_util.tree_leaves_with_path(shared):
            mine = params
            for key in path:
                mine = mine[key.key]
            np.testing.assert_array_equal(mine, leaf)


@pytest.mark.slow
def test_logit_scale_lm_study_pairs_each_arm_with_the_scale(tmp_path):
    base = tiny_char_lm(tmp_path)
    cells = [cell for cell in LM_CELLS if cell["model.num_heads"] == 1][:3]
    results = logit_scale_lm(base, tmp_path, [0, 1], cells)
    assert [r["arm"] for r in results["rows"]] == ["no scale", REFERENCE, "QK-norm (rms)"]
    for row in results["rows"]:
        assert row["steps"] == [0, 5, 10] and row["d_k"] == 16 and len(row["val_bits_per_char"]) == 2
        assert (row["minus_reference"] is None) == (row["arm"] == REFERENCE)
        assert all(0 < e <= math.log(32) + 1e-5 for e in row["entropy_init"])
    unscaled, scaled = results["rows"][0], results["rows"][1]
    # RMS-normalised or raw, q.k without 1/sqrt(d_k) starts more peaked than with it
    assert max(unscaled["entropy_init"]) < min(scaled["entropy_init"])
    difference = unscaled["minus_reference"]["val_bits_per_char"]
    expected = [
        a - b for a, b in zip(unscaled["val_bits_per_char"], scaled["val_bits_per_char"], strict=True)
    ]
    assert difference["mean"] == pytest.approx(sum(expected) / 2)
    record = write_study_results(
        tmp_path, results, "python -m experiments.study logit_scale_lm", STUDIES["logit_scale_lm"]
    )
    assert any(line.startswith("| 16 (1) | no scale |") for line in record["table"])
    assert (tmp_path / "logit_scale_lm.png").exists()


# --------------------------------------------------------------------- positions_lm (the char LM)


def test_positions_lm_study_refusals(tmp_path):
    base = tiny_char_lm(tmp_path)
    with pytest.raises(ConfigError, match=r"model.max_len=32: .* up to 128 characters"):
        positions_lm(base, tmp_path, [0])  # windows of 32 read at 64 and 128
    with pytest.raises(ConfigError, match="the positions_lm study needs the char LM"):
        positions_lm(tiny_repeat(128), tmp_path, [0])


@pytest.mark.slow
def test_positions_lm_study_pairs_each_arm_with_rope(tmp_path):
    base = tiny_char_lm(tmp_path)
    base["task"]["seq_len"] = 16
    base["model"]["max_len"] = 64
    results = positions_lm(base, tmp_path, [0, 1])
    assert results["lengths"] == [16, 32, 64]
    assert [r["arm"] for r in results["rows"]] == ["rope", "learned", "none"]
    for row in results["rows"]:
        assert row["steps"] == [0, 5, 10] and len(row["bits_per_char_64"]) == 2
        assert all(0.0 <= s <= 1.0 for s in row["final_induction"])
        assert all(0.0 < b < 8.0 for n in (16, 32, 64) for b in row[f"bits_per_char_{n}"])
    learned = results["rows"][1]
    difference = learned["minus_reference"]["bits_per_char_32"]
    expected = [
        a - b
        for a, b in zip(learned["bits_per_char_32"], results["rows"][0]["bits_per_char_32"], strict=True)
    ]
    assert difference["mean"] == pytest.approx(sum(expected) / 2)
    record = write_study_results(
        tmp_path, results, "python -m experiments.study positions_lm", STUDIES["positions_lm"]
    )
    assert any("bits/char, positions 32-63 of 64" in line for line in record["table"])
    assert (tmp_path / "positions_lm.png").exists()
