"""The char_lm experiment: config checks, and a shrunken train + generate run end to end."""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from launch import cache_flag, launcher_env
from small_char_lm import small_config

from qkv_jax.lm import generate
from qkv_jax.tasks.char_lm import read_run
from qkv_jax.training import ConfigError, build_setup, read_params, train_and_evaluate
from studies import language_model
from studies.catalogue import STUDIES
from studies.results import write_study_results

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEXT = "".join(f"def add_{i}(x):\n    return x + {i % 10}\n\n" for i in range(400))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "code.txt"
    path.write_text(TEXT)
    return path


@pytest.mark.reliability(
    "Config and command line",
    "language-model config a machine cannot run: task.seq_len beyond model.max_len, num_kv_heads not "
    "dividing num_heads, heads not dividing d_model, a sample longer than max_len, an unreadable "
    "data.path, an unknown schedule or attention implementation",
    "`ConfigError` naming the field and value before any work (the command line prints it as one line)",
)
@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(task__seq_len=64), "model.max_len=48: shorter than the training sequences (task.seq_len=64)"),
        (dict(model__num_kv_heads=3), "model.num_kv_heads=3 must divide model.num_heads=4"),
        (dict(model__num_heads=3), "model.num_heads=3 must divide model.d_model=32"),
        (dict(model__kv_latent_dim=0), "model.kv_latent_dim=0 must be a positive int"),
        (
            dict(eval__sample_length=46),
            "eval.sample_length=46: with the 4-character eval.sample_prompt it decodes 49 positions, past",
        ),
        (dict(data__path="/nonexistent.txt"), "data.path='/nonexistent.txt': not a readable file"),
        (dict(train__schedule="linear"), "train.schedule='linear': unknown; choose one of constant, cosine"),
        (dict(data__validation_fraction=0.0), "data.validation_fraction=0: must be in (0, 1)"),
        (
            dict(model__attention_implementation="flash"),
            "model.attention_implementation='flash': unknown; choose one of reference, xla, cudnn, chunked",
        ),
    ],
)
def test_bad_configs_fail_before_any_work(text_file, overrides, message):
    with pytest.raises(ConfigError) as info:
        build_setup(small_config(text_file, **overrides))
    assert message in str(info.value)


def test_a_text_shorter_than_a_window_is_refused(tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("x" * 100)
    with pytest.raises(ConfigError, match="the validation text has only 10 characters"):
        build_setup(small_config(tiny))


@pytest.fixture(scope="module")
def trained(text_file, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("char_lm")
    return workdir, train_and_evaluate(small_config(text_file), workdir)


@pytest.mark.slow
def test_training_beats_the_unigram_baseline(trained):
    workdir, summary = trained
    fields = ("train_loss", "train_bits_per_char", "val_loss", "val_bits_per_char", "unigram_bits_per_char")
    for field in fields:
        assert np.isfinite(summary[f"eval_{field}"]), field
    assert summary["eval_val_bits_per_char"] == pytest.approx(summary["eval_val_loss"] / np.log(2))
    assert summary["eval_val_bits_per_char"] < summary["eval_unigram_bits_per_char"] - 0.5
    assert summary["untrained"]["eval_val_bits_per_char"] > summary["eval_unigram_bits_per_char"]
    assert "eval_val_unmasked_bits_per_char" not in summary  # causal: nothing to compare
    samples = (workdir / "samples.txt").read_text()
    assert "#### untrained model" in samples and "#### trained model" in samples
    assert len(summary["samples_after"]) == 2
    assert all(sample.startswith("def ") and len(sample) == 24 for sample in summary["samples_after"])


@pytest.mark.slow
def test_generate_from_the_latest_checkpoint(trained):
    workdir, _ = trained
    config, tokenizer, model = read_run(workdir)
    assert config == json.loads((workdir / "config.json").read_text())
    saved = read_params(workdir)
    params, step = saved.tree, saved.step
    assert step == 60
    prompt = np.tile(tokenizer.encode("def "), (2, 1))
    tokens = generate(model, params, prompt, 30, rng=jax.random.PRNGKey(0), temperature=0.0)
    text = tokenizer.decode(tokens[0])
    assert "\n" in text and text == tokenizer.decode(tokens[1])  # greedy: both rows alike


def run_generate(*args):
    return subprocess.run(  # noqa: PLW1510 - the tests read returncode
        [sys.executable, "-m", "experiments.generate", cache_flag(), *args],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_generate_command_line(trained):
    workdir, _ = trained
    ok = run_generate(
        "--workdir", str(workdir), "--prompt", "def ", "--max_new_tokens", "20", "--temperature", "0"
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("--- sample 0 (checkpoint step 60, temperature 0.0)\ndef ")
    too_long = run_generate("--workdir", str(workdir), "--max_new_tokens", "46")
    assert too_long.returncode == 2 and too_long.stderr.strip().splitlines() == [
        "error: generate: a prompt of 4 tokens and max_new_tokens=46 decode 49 positions, "
        "past the model's max_len=48"
    ]
    missing = run_generate("--workdir", str(workdir / "nothing"))
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"error: workdir='{workdir / 'nothing'}': no config.json; is it a char_lm run?"
    ]


def study_config(text_file) -> dict:
    """A few steps of the small config: enough for a study's files, not for learning."""
    return small_config(
        text_file,
        train__steps=4,
        train__log_every=2,
        train__checkpoint_every=4,
        eval__num_examples=8,
        eval__sample_length=8,
    ).to_dict()


@pytest.mark.slow
def test_causal_mask_study_writes_its_results(text_file, tmp_path):
    base = study_config(text_file)
    results = language_model.causal_mask(base, tmp_path)
    record = write_study_results(
        tmp_path, results, "python -m experiments.study causal_mask", STUDIES[results["study"]]
    )
    causal, unmasked = record["rows"]
    summaries = {
        arm: json.loads((tmp_path / arm / "summary.json").read_text()) for arm in ("causal", "unmasked")
    }
    assert causal["honest_val_bits_per_char"] == summaries["causal"]["eval_val_bits_per_char"]
    assert unmasked["unmasked_val_bits_per_char"] == summaries["unmasked"]["eval_val_unmasked_bits_per_char"]
    assert causal["unmasked_val_bits_per_char"] is None
    assert json.loads((tmp_path / "results.json").read_text()) == record
    markdown = (tmp_path / "results.md").read_text()
    assert f"| unmasked | {unmasked['final_training_loss_nats']:.3f} |" in markdown
    assert (tmp_path / "causal_mask.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_kv_heads_study_through_the_sweep(text_file, tmp_path):
    base = study_config(text_file)
    cells = [  # MQA and MLA; the cache sizes of the others are tests/lm/test_lm.py's
        {"model.num_kv_heads": 1, "model.kv_latent_dim": None},
        {"model.num_kv_heads": 4, "model.kv_latent_dim": 8},
    ]
    results = language_model.kv_heads(base, tmp_path, cells, seeds=[0, 1])
    record = write_study_results(
        tmp_path, results, "python -m experiments.study kv_heads", STUDIES[results["study"]]
    )
    mqa, mla = record["rows"]
    assert [r["arm"] for r in record["rows"]] == ["mqa_kv1", "mla_latent8"]
    # Cache bytes per token: K and V of every layer (float32) or MLA's latent alone.
    assert mqa["kv_cache_bytes_per_token"] == 2 * 1 * 8 * 4
    assert mla["kv_cache_bytes_per_token"] == 8 * 4
    assert json.loads((tmp_path / "results.json").read_text()) == record
    cell = json.loads(
        (tmp_path / "sweep" / "cells" / "model.num_kv_heads=1,model.kv_latent_dim=None.json").read_text()
    )
    assert cell["seeds"] == [0, 1] and mqa["val_bits_per_char_per_seed"] == cell["eval_val_bits_per_char"]
    assert mqa["val_bits_per_char"]["mean"] == pytest.approx(cell["eval_val_bits_per_char_stats"]["mean"])
    assert (
        mqa["val_bits_per_char"]["low"] < mqa["val_bits_per_char"]["mean"] < mqa["val_bits_per_char"]["high"]
    )
    assert mqa["difference_from_mha"] is None  # no MHA cell to pair with
    assert all(
        r[f"decode_tokens_per_s_batch{b}"] > 0 for r in record["rows"] for b in language_model.DECODE_BATCHES
    )
