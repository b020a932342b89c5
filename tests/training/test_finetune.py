"""Starting from a trained run: fit_params, MHA -> GQA/MQA conversion, and train.init_from end to end
(LoRA adapters only train, the source is never written, errors name the parameter)."""

import dataclasses
import hashlib
import json
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from launch import launcher_env
from small_char_lm import small_config as char_lm_small_config

from configs import char_lm as char_lm_config
from qkv_jax import lm
from qkv_jax.finetune import ParamMismatchError, convert_kv_heads, fit_params
from qkv_jax.lora import merge_lora
from qkv_jax.tasks.char_lm import read_run
from qkv_jax.training import ConfigError, build_setup, read_params, train_and_evaluate
from qkv_jax.training.checkpoints import Checkpoints, CheckpointWarning, RunLocation, Saved
from qkv_jax.training.init_from import fitted_params, read_source
from qkv_jax.training.loop import seed_keys
from studies import finetuning
from studies.catalogue import STUDIES
from studies.results import write_study_results

ROOT = pathlib.Path(__file__).resolve().parents[2]
VOCAB, LAYERS, D, N, MAX_LEN = 11, 2, 16, 4, 12
TOKENS = jax.random.randint(jax.random.PRNGKey(0), (2, MAX_LEN), 0, VOCAB)
TEXT = "".join(f"def add_{i}(x):\n    return x + {i % 10}\n\n" for i in range(400))


def make_model(**overrides):
    fields = dict(vocab_size=VOCAB, num_layers=LAYERS, d_model=D, num_heads=N, max_len=MAX_LEN)
    return lm.TransformerLM(lm.TransformerConfig(**{**fields, **overrides}))


def noisy(params, seed=3):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(jax.tree.leaves(params)))
    leaves = [
        p + 0.3 * jax.random.normal(k, p.shape) for p, k in zip(jax.tree.leaves(params), keys, strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(params), leaves)


def with_equal_heads_in_groups(params, num_kv_heads):
    """Each group's K/V heads (kernels and biases) set to the group's first head."""

    def equalise(x, axis):
        heads = x.shape[axis]
        first = np.repeat(np.arange(0, heads, heads // num_kv_heads), heads // num_kv_heads)
        return jnp.take(x, first, axis=axis)

    params = jax.tree.map(lambda x: x, params)
    for layer in range(LAYERS):
        attention = params[f"block_{layer}"]["attention"]
        for name in ("key", "value"):
            attention[name] = {
                "kernel": equalise(attention[name]["kernel"], 1),
                "bias": equalise(attention[name]["bias"], 0),
            }
    return params


def decoded_logits(model, params):
    step = jax.jit(
        lambda c, t: model.apply({"params": params, "cache": c}, t, decode=True, mutable=["cache"])
    )
    logits, state = step(lm.init_cache(model, 2), TOKENS[:, :4])
    pieces = [logits]
    for t in range(4, MAX_LEN):
        logits, state = step(state["cache"], TOKENS[:, t : t + 1])
        pieces.append(logits)
    return jnp.concatenate(pieces, axis=1)


@pytest.mark.parametrize("latent", [None, 8], ids=["mha", "mla"])
@pytest.mark.slow
def test_converting_to_as_many_kv_heads_is_the_identity(latent):
    params = noisy(make_model(kv_latent_dim=latent).init(jax.random.PRNGKey(1), TOKENS)["params"])
    converted = convert_kv_heads(params, N)
    assert jax.tree.structure(converted) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(converted), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.reliability(
    "Decoding",
    "MHA parameters converted to GQA-2 and MQA by mean-pooling each group's K/V heads (kernels, biases)",
    "pooling is the group mean; a model whose heads in each group are equal gives the same logits after "
    "conversion, and the converted parameters decode with the plain GQA/MQA cache, equal to their full "
    "pass (1e-5)",
)
@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["gqa2", "mqa"])
@pytest.mark.slow
def test_converted_mha_loads_into_the_gqa_model_and_decodes_with_the_cache(num_kv_heads):
    mha = make_model()
    gqa = mha.clone(config=dataclasses.replace(mha.config, num_kv_heads=num_kv_heads))
    params = noisy(mha.init(jax.random.PRNGKey(1), TOKENS)["params"])
    converted = convert_kv_heads(params, num_kv_heads)
    key = params["block_0"]["attention"]["key"]
    group = N // num_kv_heads
    expected = np.asarray(key["kernel"]).reshape(D, num_kv_heads, group, D // N).mean(axis=2)
    np.testing.assert_allclose(converted["block_0"]["attention"]["key"]["kernel"], expected, atol=1e-7)
    np.testing.assert_allclose(
        converted["block_0"]["attention"]["key"]["bias"],
        np.asarray(key["bias"]).reshape(num_kv_heads, group, -1).mean(axis=1),
        atol=1e-7,
    )
    full = gqa.apply({"params": converted}, TOKENS)
    np.testing.assert_allclose(decoded_logits(gqa, converted), full, atol=1e-5, rtol=1e-5)
    # Heads equal within each group: the GQA model computes what the MHA model did.
    equal = with_equal_heads_in_groups(params, num_kv_heads)
    np.testing.assert_allclose(
        gqa.apply({"params": convert_kv_heads(equal, num_kv_heads)}, TOKENS),
        mha.apply({"params": equal}, TOKENS),
        atol=1e-5,
        rtol=1e-5,
    )
    assert np.abs(np.asarray(full) - np.asarray(mha.apply({"params": params}, TOKENS))).max() > 1e-2


def test_conversion_refuses_what_it_cannot_pool():
    params = make_model().init(jax.random.PRNGKey(1), TOKENS)["params"]
    with pytest.raises(ValueError, match="num_kv_heads=3 does not divide block_0/attention/key's 4 heads"):
        convert_kv_heads(params, 3)
    adapted = make_model(lora_rank=2, lora_targets=("key",)).init(jax.random.PRNGKey(1), TOKENS)["params"]
    with pytest.raises(ValueError, match="block_0/attention/key has a LoRA adapter; merge_lora"):
        convert_kv_heads(adapted, 2)
    with pytest.raises(ValueError, match="no attention"):
        convert_kv_heads({"dense": {"kernel": jnp.ones((2, 2))}}, 1)


@pytest.mark.slow
def test_fit_params_checks_shapes_and_keeps_or_merges_adapters():
    source = noisy(make_model().init(jax.random.PRNGKey(1), TOKENS)["params"])
    adapted = make_model(lora_rank=2, lora_targets=("query", "value"))
    target = adapted.init(jax.random.PRNGKey(2), TOKENS)["params"]
    fitted = fit_params(source, target)
    # Every source parameter taken, the target's adapters as initialised (B = 0): the source's logits.
    np.testing.assert_array_equal(
        fitted["block_1"]["attention"]["query"]["lora_a"], target["block_1"]["attention"]["query"]["lora_a"]
    )
    np.testing.assert_array_equal(fitted["head"]["kernel"], source["head"]["kernel"])
    np.testing.assert_array_equal(
        adapted.apply({"params": fitted}, TOKENS), make_model().apply({"params": source}, TOKENS)
    )
    # A source with adapters into a model without: merged with the source's alpha.
    trained_adapters = noisy(fitted, seed=5)
    merged = fit_params(trained_adapters, source, source_lora_alpha=16.0)
    np.testing.assert_allclose(
        make_model().apply({"params": merged}, TOKENS),
        adapted.apply({"params": trained_adapters}, TOKENS),
        atol=1e-5,
        rtol=1e-5,
    )
    np.testing.assert_array_equal(
        merged["block_0"]["attention"]["query"]["kernel"],
        merge_lora(trained_adapters, 16.0)["block_0"]["attention"]["query"]["kernel"],
    )
    with pytest.raises(ParamMismatchError, match="no lora_alpha"):
        fit_params(trained_adapters, source)
    wider = make_model(d_model=24).init(jax.random.PRNGKey(1), TOKENS)["params"]
    with pytest.raises(
        ParamMismatchError,
        match=r"parameter block_0/attention/key/bias is \[4, 4\] in the source but \[4, 6\] in this model",
    ):
        fit_params(source, wider)
    deeper = make_model(num_layers=3).init(jax.random.PRNGKey(1), TOKENS)["params"]
    with pytest.raises(
        ParamMismatchError, match=r"parameter block_2/attention/key/bias \[4, 4\] is not in the source"
    ):
        fit_params(source, deeper)
    with pytest.raises(
        ParamMismatchError, match=r"parameter block_2/attention/key/bias \[4, 4\] of the source has no place"
    ):
        fit_params(deeper, source)


@pytest.mark.slow
def test_fitted_params_run_vmapped_over_seeds_each_with_its_own_adapters():
    """What a sweep of vmapped seeds needs: `init_from.fitted_params` under jax.vmap gives every seed
    the source's parameters and keeps each seed's own fresh adapters."""
    source = noisy(make_model().init(jax.random.PRNGKey(1), TOKENS)["params"])
    adapted = make_model(lora_rank=2, lora_targets=("query", "value"))
    seeds = jax.vmap(lambda key: adapted.init(key, TOKENS)["params"])(
        jax.random.split(jax.random.PRNGKey(2), 3)
    )
    config = {"train": {"init_from": "W1", "convert_kv_heads": False}, "model": {}}
    saved = Saved(source, 30, RunLocation(pathlib.Path("W1/checkpoints"), None, pathlib.Path("W1")))
    fitted = jax.vmap(lambda p: fitted_params(config, saved, p))(seeds)
    for seed in range(3):
        np.testing.assert_array_equal(fitted["head"]["kernel"][seed], source["head"]["kernel"])
    lora_a = fitted["block_0"]["attention"]["value"]["lora_a"]
    np.testing.assert_array_equal(lora_a, seeds["block_0"]["attention"]["value"]["lora_a"])
    assert np.abs(np.asarray(lora_a[0] - lora_a[1])).max() > 0


# --- train.init_from end to end -------------------------------------------------------------


def small_config(path, **overrides):
    """test_char_lm's small config, shorter: 30 steps of batch 8, a checkpoint at the end."""
    fields = dict(
        train__steps=30,
        train__batch_size=8,
        train__log_every=10,
        train__checkpoint_every=30,
        eval__num_examples=16,
        eval__sample_length=8,
        eval__ablation_examples=4,
    )
    return char_lm_small_config(path, **{**fields, **overrides})


def file_digests(directory):
    """{relative path: sha256} of every file under `directory` (and its directories)."""
    directory = pathlib.Path(directory)
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(directory.rglob("*"))
    }


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    """(text file, workdir) of a small trained char LM (MHA, 4 heads)."""
    root = tmp_path_factory.mktemp("source")
    text = root / "code.txt"
    text.write_text(TEXT)
    summary = train_and_evaluate(small_config(text), root / "W1")
    assert summary["params"] == summary["trainable_params"]
    return text, root / "W1"


@pytest.mark.slow
def test_init_from_refuses_a_missing_source(tmp_path):
    text = tmp_path / "code.txt"
    text.write_text(TEXT)
    with pytest.raises(ConfigError, match=r"train.init_from='/nonexistent': not a directory"):
        train_and_evaluate(small_config(text, train__init_from="/nonexistent"), tmp_path / "W")
    with pytest.raises(ConfigError, match=r"train.convert_kv_heads=True: needs train.init_from"):
        train_and_evaluate(small_config(text, train__convert_kv_heads=True), tmp_path / "W")
    with pytest.raises(ConfigError, match=r"not a run's workdir, its checkpoints/ directory or a checkpoint"):
        train_and_evaluate(small_config(text, train__init_from=str(tmp_path)), tmp_path / "W")


@pytest.mark.reliability(
    "Checkpoints",
    "train.init_from a source whose newest checkpoint is corrupt, with an interrupted save's leftover",
    "the source is read only (every file and the leftover unchanged); the corrupt checkpoint is skipped "
    "with a `CheckpointWarning` and the previous one used; none usable is a ConfigError",
)
def init_from(path):
    return {"train": {"init_from": str(path)}}


def test_the_source_is_read_only_and_verified(tmp_path):
    params = {"dense": {"kernel": jnp.arange(6.0).reshape(2, 3), "bias": jnp.ones(3)}}
    checkpoints = Checkpoints(tmp_path / "W1" / "checkpoints")
    for step in (10, 20):
        tree = {"step": step, "params": jax.tree.map(lambda x, s=step: x + s, params), "opt_state": {}}
        checkpoints.save(step, tree)
    checkpoints.close()
    leftover = tmp_path / "W1" / "checkpoints" / "30.orbax-checkpoint-tmp-1700000000"
    shutil.copytree(tmp_path / "W1" / "checkpoints" / "20", leftover)
    for data_file in (tmp_path / "W1" / "checkpoints" / "20" / "state").rglob("d/*"):
        data_file.write_bytes(bytes(b ^ 0xFF for b in data_file.read_bytes()))
    before = file_digests(tmp_path / "W1")
    with pytest.warns(CheckpointWarning, match="checkpoint step 20"):
        source = read_source(init_from(tmp_path / "W1"))
    assert source.step == 10 and source.location.workdir == tmp_path / "W1"
    np.testing.assert_array_equal(source.tree["dense"]["kernel"], np.arange(6.0).reshape(2, 3) + 10)
    assert read_source(init_from(tmp_path / "W1" / "checkpoints" / "10")).step == 10
    assert file_digests(tmp_path / "W1") == before and leftover.is_dir()
    with pytest.warns(CheckpointWarning), pytest.raises(ConfigError, match="no usable checkpoint"):
        read_source(init_from(tmp_path / "W1" / "checkpoints" / "20"))


@pytest.mark.slow
@pytest.mark.reliability(
    "Checkpoints",
    "a run started from another run's workdir with LoRA adapters on W_Q and W_V, then resumed after "
    "the source lost its checkpoints",
    "starts at the source's evaluation, trains only the adapters (every other parameter bit-identical to "
    "the source's), reports trainable_params; the source's files are byte-identical afterwards; the "
    "resumed run reads its own checkpoint",
)
def test_lora_fine_tune_trains_only_the_adapters_and_never_writes_the_source(source_run, tmp_path):
    text, source = source_run
    before = file_digests(source)
    config = small_config(
        text, train__init_from=str(source), model__lora_rank=4, model__lora_targets="query,value"
    )
    summary = train_and_evaluate(config, tmp_path / "W2")
    assert file_digests(source) == before
    source_summary = json.loads((source / "summary.json").read_text())
    assert summary["untrained"]["eval_val_loss"] == pytest.approx(source_summary["eval_val_loss"], abs=1e-6)
    assert summary["trainable_params"] == 2 * (32 * 4 + 4 * 32) < summary["params"] // 20
    source_params = read_params(source).tree
    saved = read_params(tmp_path / "W2")
    tuned, step = saved.tree, saved.step
    assert step == 30
    frozen = {
        k: v for k, v in jax.tree_util.tree_leaves_with_path(tuned) if k[-1].key not in ("lora_a", "lora_b")
    }
    for path, old in jax.tree_util.tree_leaves_with_path(source_params):
        np.testing.assert_array_equal(frozen[path], old, err_msg=jax.tree_util.keystr(path))
    assert np.abs(np.asarray(tuned["block_0"]["attention"]["query"]["lora_b"])).max() > 0
    assert summary["eval_val_loss"] != summary["untrained"]["eval_val_loss"]
    # Resuming reads the run's own checkpoint, not the source's (which is gone now).
    shutil.rmtree(source / "checkpoints.moved", ignore_errors=True)
    (source / "checkpoints").rename(source / "checkpoints.moved")
    try:
        config.train.steps = 40
        resumed = train_and_evaluate(config, tmp_path / "W2")
    finally:
        (source / "checkpoints.moved").rename(source / "checkpoints")
    assert resumed["resumed_from_step"] == 30 and resumed["steps"] == 40


@pytest.mark.slow
def test_init_from_converts_mha_to_gqa_on_load(source_run, tmp_path):
    text, source = source_run
    with pytest.raises(ConfigError) as info:
        train_and_evaluate(
            small_config(text, train__init_from=str(source), model__num_kv_heads=2), tmp_path / "A"
        )
    assert str(info.value) == (
        f"train.init_from={str(source)!r}: parameter block_0/attention/key/bias is [4, 8] in the source but "
        "[2, 8] in this model (train.convert_kv_heads=True mean-pools the source's K/V heads into "
        "model.num_kv_heads)"
    )
    config = small_config(
        text,
        train__init_from=str(source / "checkpoints" / "30"),
        train__convert_kv_heads=True,
        model__num_kv_heads=2,
        train__steps=10,
    )
    summary = train_and_evaluate(config, tmp_path / "B")
    tokenizer = read_run(source)[1]
    source_params = read_params(source).tree
    assert read_run(tmp_path / "B")[2].config.num_kv_heads == 2
    assert read_run(tmp_path / "B")[1].chars == tokenizer.chars  # the source's vocabulary
    # "untrained" is the converted model: the source's parameters with K/V heads mean-pooled.
    setup = build_setup(config)
    metrics, _ = jax.jit(setup.evaluate)(convert_kv_heads(source_params, 2), seed_keys(0)["eval"], setup.data)
    assert summary["untrained"]["eval_val_loss"] == pytest.approx(float(metrics["val_loss"]), abs=1e-5)
    assert (
        summary["untrained"]["eval_val_loss"]
        > json.loads((source / "summary.json").read_text())["eval_val_loss"]
    )


@pytest.mark.slow
@pytest.mark.reliability(
    "Config and command line",
    "--config.train.init_from= a run whose parameters do not fit the model (another head count)",
    "exit 2 with one line naming the first parameter that does not fit and both shapes",
)
def test_acceptance_command_line(source_run, tmp_path):
    """The issue's command, on the shrunken config: only the adapters train; a mismatching source is one
    line naming the parameter and both shapes (exit 2)."""
    text, source = source_run
    shrink = [
        f"--config.data.path={text}",
        "--config.model.num_layers=1",
        "--config.model.d_model=32",
        "--config.model.max_len=48",
        "--config.task.seq_len=32",
        "--config.train.steps=10",
        "--config.train.batch_size=8",
        "--config.train.log_every=10",
        "--config.train.checkpoint_every=10",
        "--config.eval.num_examples=16",
        "--config.eval.sample_length=8",
        "--config.eval.ablation_examples=4",
        "--config.train.cpu_optimization_level=0",
    ]

    def train(workdir, *extra):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "experiments.train",
                "--config",
                "configs/char_lm.py",
                "--workdir",
                str(workdir),
                *shrink,
                *extra,
            ],
            cwd=ROOT,
            env=launcher_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )

    done = train(
        tmp_path / "W2",
        f"--config.train.init_from={source}",
        "--config.model.lora_rank=4",
        "--config.model.lora_targets=query,value",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "W2" / "summary.json").read_text())
    assert summary["trainable_params"] * 20 < summary["params"]
    wrong = train(tmp_path / "W3", f"--config.train.init_from={source}", "--config.model.num_heads=2")
    assert wrong.returncode == 2
    assert wrong.stderr.strip().splitlines() == [
        f"error: train.init_from={str(source)!r}: parameter block_0/attention/key/bias is [4, 8] in the "
        "source but [2, 16] in this model"
    ]


def fake_run(calls, root):
    """A stand-in for `finetuning._run` that records each run's overrides and returns a summary
    whose numbers say which run it was."""

    def run(base, workdir, overrides):
        calls[str(workdir.relative_to(root))] = overrides
        seed, rank = overrides["seed"], overrides.get("model.lora_rank", 0)
        heads = overrides.get("model.num_kv_heads") or 8
        value = 3.0 + 0.01 * seed + 0.1 * rank + 0.001 * overrides.get("train.steps", 300) + 0.01 * heads
        ablation = np.arange(16.0).reshape(2, 8) + seed
        return {
            "eval_val_bits_per_char": value,
            "untrained": {"eval_val_bits_per_char": value + 1.0},
            "params": 1000,
            "trainable_params": 1000 if not rank else 10 * rank,
            "eval_unigram_bits_per_char": 4.5,
            "eval_head_ablation": ablation.tolist(),
            "eval_head_entropy": (-ablation).tolist(),
            "eval_head_previous_token": ablation.tolist(),
            "eval_head_induction": np.zeros((2, 8)).tolist(),
        }

    return run


@pytest.mark.filterwarnings("ignore:Precision loss occurred")  # the fake runs' differences are exact
def test_the_studies_run_their_arms_and_write_their_results(tmp_path, monkeypatch):
    """The studies' runs (what each trains, from where, for how long) and their results files, with
    the training replaced by `fake_run`: train.init_from and friends are tested end to end above."""
    calls = {}
    monkeypatch.setattr(finetuning, "_run", fake_run(calls, tmp_path))
    monkeypatch.setattr(finetuning, "docstring_corpus", lambda path, fraction: 0.125)
    base = char_lm_config.get_config("study").to_dict()
    pretrained, seeds = tmp_path / "pretrained", [0, 1, 2]
    for study in ("lora_finetune", "kv_conversion", "head_ablation"):
        results = getattr(finetuning, study)(base, tmp_path / study, pretrained, seeds)
        command = f"python -m experiments.study {study}"
        record = write_study_results(tmp_path / study, results, command, STUDIES[study])
        assert (tmp_path / study / f"{study}.png").stat().st_size > 1000
        assert len(record["table"]) == len(record["rows"]) + 2
    assert calls["pretrained/seed_1"] == {"seed": 1, "eval.ablation_examples": 128}
    lora = calls["lora_finetune/lora_qkvo_r8/seed_2"]
    assert lora["train.init_from"] == str((pretrained / "seed_2").absolute())
    assert (lora["model.lora_rank"], lora["model.lora_targets"], lora["train.steps"]) == (
        8,
        "query,key,value,out",
        150,
    )
    assert lora["data.validation_fraction"] == 0.125 and lora["data.path"].endswith("docstrings.txt")
    assert "model.lora_targets" not in calls["lora_finetune/full/seed_0"]
    uptrain = calls["kv_conversion/gqa2_uptrained_15/seed_0"]
    assert (uptrain["train.steps"], uptrain["train.convert_kv_heads"], uptrain["model.num_kv_heads"]) == (
        15,
        True,
        2,
    )
    scratch = calls["kv_conversion/mqa_scratch_360/seed_2"]
    assert (scratch["train.steps"], scratch["model.num_kv_heads"], "train.init_from" in scratch) == (
        360,
        1,
        False,
    )
    rows = {
        r["arm"]: r for r in json.loads((tmp_path / "kv_conversion" / "results.json").read_text())["rows"]
    }
    assert rows["gqa2_uptrained_60"]["against"] == "gqa2_scratch_360"
    assert rows["gqa2_uptrained_60"]["val_bits_per_char"]["paired"]["mean"] == pytest.approx(0.06 - 0.36)
    # The converted model before uptraining: the first uptraining run's "untrained" evaluation.
    assert rows["mqa_converted"]["val_bits_per_char"]["mean"] == pytest.approx(
        3.0 + 0.01 + 0.015 + 0.01 + 1.0
    )
    lora_rows = json.loads((tmp_path / "lora_finetune" / "results.json").read_text())["rows"]
    assert [r["arm"] for r in lora_rows][:3] == ["pre-trained (no fine-tuning)", "full", "lora_qv_r1"]
    assert len(lora_rows) == 2 + 5 + 5 + 3
    ablation = json.loads((tmp_path / "head_ablation" / "results.json").read_text())["rows"]
    assert [r["rho_all_heads"]["mean"] for r in ablation[:2]] == pytest.approx([-1.0, 1.0])
    assert ablation[0]["most_special_is_costliest"] == [1, 1, 1]
