"""The circuit studies' pieces against float64 NumPy and hand-made inputs, and each study end to end."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import char_lm, flag_retrieval, sequences
from qkv_jax.training import ConfigError, build_setup
from qkv_jax.training.setup import to_dict
from studies.circuits import (
    PATCH_SEQUENCES,
    STUDIES,
    distinct_patterns,
    flag_reader,
    flag_reader_geometry,
    flag_reader_probe,
    head_patching,
    induction_composition,
    induction_composition_probe,
    kv_views,
    kv_views_probe,
    patching_pair,
    pattern_divergence,
    risen_at,
    steepest_at,
)
from studies.results import write_study_results

geometry = jax.jit(flag_reader_geometry, static_argnums=1)
divergence = jax.jit(pattern_divergence)


def reader_params(query, W_Q, W_K):
    as_f32 = lambda x: jnp.asarray(x, jnp.float32)
    return {"query": as_f32(query), "W_query": {"kernel": as_f32(W_Q)}, "W_key": {"kernel": as_f32(W_K)}}


def test_flag_reader_geometry_against_float64_numpy():
    rng = np.random.default_rng(0)
    query, W_Q, W_K = rng.normal(size=5), rng.normal(size=(5, 3)), rng.normal(size=(5, 3))
    measured = jax.device_get(geometry(reader_params(query, W_Q, W_K), 0.5))
    read = W_K @ (query @ W_Q)  # (D,): a token x scores x . read
    values = np.linalg.svd(W_Q @ W_K.T, compute_uv=False)[:3]
    p = values / values.sum()
    expected = {
        "cos_flag": read[-1] / np.linalg.norm(read),
        "cos_flag_key": (query @ W_Q) @ W_K[-1] / np.linalg.norm(query @ W_Q) / np.linalg.norm(W_K[-1]),
        "flag_logit": 0.5 * read[-1],
        "content_logit_std": 0.5 * np.linalg.norm(read[:-1]),
        "effective_rank": np.exp(-np.sum(p * np.log(p))),
        "top_share": p[0],
        "top_value": values[0],
        "rest_norm": np.linalg.norm(values[1:]),
        "singular_values": values,
    }
    for name, value in expected.items():
        np.testing.assert_allclose(measured[name], value, rtol=2e-5, err_msg=name)
    # the singular vectors' entries, checked through the rank-one part they span
    u, _, vt = np.linalg.svd(W_Q @ W_K.T)
    np.testing.assert_allclose(
        measured["query_alignment"], abs(u[:, 0] @ query) / np.linalg.norm(query), rtol=2e-5
    )
    np.testing.assert_allclose(measured["flag_alignment"], abs(vt[0, -1]), rtol=2e-5)


def test_a_rank_one_flag_reader_reads_the_flag_alone():
    """W_Q = q a^T / |q|^2 and W_K = e_flag a^T: W_QK = |a|^2 q e_flag^T / |q|^2 is rank one, its
    top left singular vector along q and top right one the flag channel; r = |a|^2 e_flag."""
    query, a = np.array([1.0, -2.0, 0.5, 3.0]), np.array([0.3, -0.4])
    flag = np.eye(4)[-1]
    measured = geometry(reader_params(query, np.outer(query, a) / (query @ query), np.outer(flag, a)), 1.0)
    for name in (
        "cos_flag",
        "cos_flag_key",
        "effective_rank",
        "top_share",
        "query_alignment",
        "flag_alignment",
    ):
        np.testing.assert_allclose(measured[name], 1.0, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(measured["flag_logit"], a @ a, rtol=1e-5)
    np.testing.assert_allclose([measured["content_logit_std"], measured["rest_norm"]], 0.0, atol=1e-6)


def test_pattern_divergence_against_float64_numpy():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 3, 4, 4)) + np.where(
        np.tril(np.ones((4, 4))) > 0, 0.0, -np.inf
    )  # (B, N, T, S)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)  # causal rows: zeros above the diagonal
    measured = np.asarray(divergence(jnp.asarray(weights, jnp.float32)))

    def kl(p, q):  # rows (..., S) -> (...)
        return np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0) / np.where(q > 0, q, 1.0)), 0.0), -1)

    expected = np.zeros((3, 3))
    for n, m in itertools.product(range(3), repeat=2):
        p, q = weights[:, n], weights[:, m]
        expected[n, m] = np.mean(0.5 * kl(p, (p + q) / 2) + 0.5 * kl(q, (p + q) / 2))
    np.testing.assert_allclose(measured, expected, atol=1e-6)
    assert np.all(np.diag(measured) == 0.0) and np.all(measured[~np.eye(3, dtype=bool)] > 0)


def test_pattern_divergence_of_alike_half_and_fully_disjoint_heads():
    """Rows uniform over keys {0, 1} (heads 0 and 1), {2, 3} (head 2) and {1, 2} (head 3): alike
    heads are 0 apart, disjoint ones ln 2, half-overlapping ones ln 2 / 2."""
    support = [(0, 1), (0, 1), (2, 3), (1, 2)]
    rows = np.zeros((1, 4, 3, 4))  # (B, N, T, S)
    for head, keys in enumerate(support):
        rows[0, head, :, keys] = 0.5
    measured = np.asarray(divergence(jnp.asarray(rows, jnp.float32)))
    ln2 = math.log(2)
    expected = [
        [0, 0, ln2, ln2 / 2],
        [0, 0, ln2, ln2 / 2],
        [ln2, ln2, 0, ln2 / 2],
        [ln2 / 2, ln2 / 2, ln2 / 2, 0],
    ]
    np.testing.assert_allclose(measured, expected, atol=1e-6)
    assert distinct_patterns(measured, 0.5) == 2 and distinct_patterns(measured, 0.3) == 3


@pytest.mark.parametrize(
    "apart, expected",
    [
        (np.zeros((4, 4), bool), 1),  # every head alike: one pattern
        (~np.eye(4, dtype=bool), 4),  # every head apart
        (np.array([[0, 0, 1], [0, 0, 0], [1, 0, 0]], bool), 2),  # 0 ~ 1 ~ 2 but 0 and 2 apart: two patterns
        (np.kron(~np.eye(2, dtype=bool), np.ones((3, 3), bool)), 2),  # two groups of three alike heads
    ],
)
def test_distinct_patterns_counts_the_largest_pairwise_distinct_set(apart, expected):
    matrix = np.where(apart, 0.3, 0.01)
    np.fill_diagonal(matrix, 0.0)
    assert distinct_patterns(matrix, 0.1) == expected
    for order in itertools.islice(
        itertools.permutations(range(len(matrix))), 12
    ):  # the heads' order is no matter
        assert distinct_patterns(matrix[np.ix_(order, order)], 0.1) == expected
    assert distinct_patterns(matrix, 0.5) == 1  # nothing is that far apart


def test_distinct_patterns_is_the_largest_set_found_by_trying_every_subset():
    rng = np.random.default_rng(2)
    for _ in range(20):
        matrix = rng.uniform(0.0, 0.4, size=(7, 7))
        matrix = np.triu(matrix, 1) + np.triu(matrix, 1).T  # (7, 7): symmetric, zero diagonal
        largest = max(
            len(subset)
            for size in range(1, 8)
            for subset in itertools.combinations(range(7), size)
            if all(matrix[a, b] > 0.2 for a, b in itertools.combinations(subset, 2))
        )
        assert distinct_patterns(matrix, 0.2) == largest


def test_distinct_patterns_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"divergence must be \[N, N\], got shape \(2, 3\)"):
        distinct_patterns(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="threshold must be > 0, got 0"):
        distinct_patterns(np.zeros((2, 2)), 0)


def test_risen_at_is_the_step_half_the_change_is_covered():
    steps = [0, 10, 20, 30, 40]
    assert risen_at(steps, [0.2, 0.25, 0.55, 0.7, 0.8]) == 20  # half of 0.2 -> 0.8 is 0.5
    assert risen_at(steps, [0.2, 0.25, 0.55, 0.7, 0.8], share=0.9) == 40
    assert risen_at(steps, [0.2, 0.9, 0.3, 0.3, 0.25]) == 10  # judged against the end, not the peak
    assert risen_at(steps, [0.5, 0.4, 0.3, 0.3, 0.2]) is None  # it fell
    with pytest.raises(ValueError, match="steps and curve must match, 2 or more; got 5 and 4"):
        risen_at(steps, [0.0, 1.0, 2.0, 3.0])


def test_steepest_at_ends_the_interval_of_the_largest_rise():
    steps = [0, 10, 20, 30, 40]
    assert steepest_at(steps, [0.2, 0.25, 0.55, 0.7, 0.8]) == 20  # +0.30 over 10 -> 20
    assert steepest_at(steps, [0.9, 0.5, 0.4, 0.45, 0.44]) == 30  # falling elsewhere: the one rise
    with pytest.raises(ValueError, match="steps and curve must match, 2 or more; got 1 and 1"):
        steepest_at([0], [1.0])


def test_each_probe_refuses_the_wrong_task():
    setup = build_setup(sequences.get_config("copy"))
    with pytest.raises(ConfigError, match="model.kind='learned_query' and task.num_flags=1"):
        flag_reader_probe(setup)
    with pytest.raises(ConfigError, match="needs the char LM task, got model TransformerLM"):
        kv_views_probe(setup)
    with pytest.raises(ConfigError, match="needs a TransformerLM task, got FlagReader"):
        induction_composition_probe(build_setup(flag_retrieval.get_config()))


@pytest.mark.slow
def test_head_patching_is_one_patched_run_per_head_as_a_share_of_the_clean_advantage():
    """Entry (l, h) of head_patching is (patched - corrupted) / (clean - corrupted) of the mean
    log-probability of the repeat task's answers, with head h of layer l's clean hook_z in the
    corrupted run; the corrupted inputs differ from the clean ones in the first half only."""
    from qkv_jax.interpretability import replace, run_with_cache, run_with_hooks
    from qkv_jax.lm import TransformerConfig, TransformerLM

    model = TransformerLM(TransformerConfig(vocab_size=8, num_layers=2, d_model=16, num_heads=2, max_len=8))
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    pair = jax.device_get(patching_pair(model))
    clean, corrupted, mask = pair["clean"], pair["corrupted"], pair["answer_mask"]
    assert clean.shape == corrupted.shape == mask.shape == (PATCH_SEQUENCES, 8)
    np.testing.assert_array_equal(clean[:, 4:], corrupted[:, 4:])
    assert np.any(clean[:, :4] != corrupted[:, :4]) and not np.any(mask[:, :4]) and np.all(mask.sum(1) > 0)
    shares = head_patching(model, params, pair)

    def answers(logits):
        log_probs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        picked = np.take_along_axis(log_probs, pair["targets"][..., None], -1)[..., 0]
        return picked[mask].mean()

    variables = {"params": params}
    _, cache = run_with_cache(model, variables, clean)
    low, high = answers(model.apply(variables, corrupted)), answers(model.apply(variables, clean))
    for layer, head in [(0, 1), (1, 0)]:
        name = f"blocks.{layer}.attn.hook_z"
        hooks = {name: replace(cache[name], heads=head)}
        patched = answers(run_with_hooks(model, variables, corrupted, hooks=hooks))
        np.testing.assert_allclose(shares[layer, head], (patched - low) / (high - low), rtol=1e-4, atol=1e-5)


# --- Each study end to end, shrunk ---------------------------------------------------------------


def render(study, results, tmp_path):
    record = write_study_results(tmp_path, results, f"python -m experiments.study {study}", STUDIES[study])
    assert (tmp_path / f"{study}.png").exists() and record["table"]
    return record


@pytest.mark.slow
def test_flag_reader_study_aligns_the_reader(tmp_path):
    config = flag_retrieval.get_config()
    config.train.update(cpu_optimization_level=0, steps=200, log_every=20, checkpoint_every=200)
    config.eval.num_examples = 256
    results = flag_reader(to_dict(config), tmp_path, [0, 1])
    assert results["steps"] == list(range(0, 201, 20))
    assert results["summary"]["cos_flag"]["after"]["mean"] > 0.9
    assert all(step is not None and step <= 200 for step in results["aligned_at_step"])
    render("flag_reader", results, tmp_path)


@pytest.mark.slow
def test_induction_composition_study_runs(tmp_path):
    config = sequences.get_config("repeat")
    config.model.update(d_model=16, num_heads=2)
    config.task.update(length=4, vocab_size=8)
    config.train.update(cpu_optimization_level=0, steps=12, log_every=4, checkpoint_every=12, batch_size=8)
    config.eval.num_examples = 16
    results = induction_composition(to_dict(config), tmp_path, [0, 1])
    assert results["steps"] == [0, 4, 8, 12] and len(results["rows"]) == 2
    for row in results["rows"]:
        assert row["induction_head"][0] == 1 and row["previous_token_head"][0] == 0
        assert 0 < row["k_composition"][1] < 1 and len(row["curves"]["k_composition"]) == 4
        assert len(row["curves"]["patch_induction_head"]) == 4 and np.isfinite(row["patch_induction_head"])
    assert set(results["patch_induction_minus_previous"]) >= {"mean", "low", "high"}
    render("induction_composition", results, tmp_path)


@pytest.mark.slow
def test_kv_views_study_pairs_each_variant_with_mha(tmp_path):
    corpus = tmp_path / "code.txt"
    corpus.write_text("".join(f"def add_{i}(x):\n    return x + {i % 10}\n\n" for i in range(400)))
    config = char_lm.get_config("study")
    config.data.path = str(corpus)
    config.model.update(num_layers=1, d_model=16, num_heads=4, max_len=32)
    config.task.seq_len = 32
    config.train.update(cpu_optimization_level=0, steps=10, log_every=5, checkpoint_every=10, batch_size=8)
    config.eval.update(num_examples=8, sample_length=8, ablation_examples=0)
    cells = [{"model.num_kv_heads": 4}, {"model.num_kv_heads": 1}]
    results = kv_views(to_dict(config), tmp_path, cells, [0, 1])
    mha, mqa = results["rows"]
    assert (mha["arm"], mqa["arm"]) == ("mha_kv4", "mqa_kv1")
    assert mha["minus_mha"]["mean_divergence"]["mean"] == 0.0
    assert all(1 <= views <= 4 for views in mqa["views"][str(results["threshold"])])
    render("kv_views", results, tmp_path)
