"""`experiments.report`'s explorer page (report.html) for real tiny runs, in headless Chromium.

The page's numbers are checked twice: in the browser against the data the page
was built from (tests/browser.py: hover, slider, sort, screenshot), and that
data against attention weights recomputed here from the run's checkpoints.
"""

import html
import json
import os

import jax
import numpy as np
import pytest
from browser import check_no_external_references, check_page, launch_browser, missing_reason, open_page

from configs import char_lm as char_lm_config
from configs import flag_retrieval
from qkv_jax.report.run import report_run
from qkv_jax.studies.results import report_sweep
from qkv_jax.studies.sweep import run_sweep
from qkv_jax.tasks.flag_retrieval import attention_weights, flag_retrieval_batch
from qkv_jax.training import build_setup, read_params, train_and_evaluate

TEXT = "".join(f"def add_{i}(x):\n    return x + {i % 10}\n\n" for i in range(400))


@pytest.fixture(scope="module")
def browser():
    reason = missing_reason()
    if reason is not None:
        if os.environ.get("QKV_JAX_REQUIRE_BROWSER"):
            pytest.fail(f"browser tests required, but {reason}")
        pytest.skip(reason)
    with launch_browser() as browser:
        yield browser


def flag_config(**train):
    config = flag_retrieval.get_config()
    config.train.update(dict(steps=40, batch_size=16, log_every=10, checkpoint_every=10, keep_checkpoints=0))
    config.train.update(train)
    config.eval.num_examples = 64
    config.eval.num_plot_examples = 2
    return config


@pytest.fixture(scope="module")
def flag_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("flag")
    train_and_evaluate(flag_config(), workdir)
    return workdir, report_run(workdir)


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "code.txt"
    corpus.write_text(TEXT)
    config = char_lm_config.get_config()
    config.data.path = str(corpus)
    config.model.update(num_layers=2, d_model=32, num_heads=2, max_len=48)
    config.task.seq_len = 32
    config.train.update(steps=40, batch_size=8, warmup_steps=5, log_every=10, checkpoint_every=20)
    config.train.keep_checkpoints = 0
    config.eval.update(num_examples=16, sample_length=8)
    workdir = tmp_path_factory.mktemp("char_lm")
    train_and_evaluate(config, workdir)
    return workdir, report_run(workdir, prompt="def add_7(x):")


def test_flag_page_shows_the_runs_attention(flag_run, browser):
    workdir, report = flag_run
    data = report["page"]
    assert [c["step"] for c in data["checkpoints"]] == [0, 10, 20, 30, 40]  # untrained, then every checkpoint
    assert data["layers"] == ["attention"] and data["num_heads"] == 1
    config = json.loads((workdir / "config.json").read_text())
    model = build_setup(config).model
    for checkpoint in data["checkpoints"][1:]:
        params = checkpoint_params(workdir, config, checkpoint["step"])
        for seed, example in enumerate(data["examples"]):  # example i is the fresh example of seed i
            batch = flag_retrieval_batch(jax.random.PRNGKey(seed), 1, 5, 8, 1)
            _, state = model.apply({"params": params}, batch["inputs"], mutable=["intermediates"])
            weights = np.asarray(attention_weights(state["intermediates"]))[0]  # (N, S)
            shown = np.asarray(checkpoint["attention"][seed])  # (L, N, T, S)
            np.testing.assert_allclose(shown[0, :, 0, :], weights, atol=1e-6)
            assert example["marks"] == [int(batch["flag_positions"][0, 0])]
    final = np.asarray(data["checkpoints"][-1]["attention"][0])[0, 0, 0]
    assert int(np.argmax(final)) in data["examples"][0]["marks"]  # the trained head finds the flag
    check_page(browser, workdir / "report.html", data)


def checkpoint_params(workdir, config, step):
    """The parameters of a run's checkpoint `step` (not only the newest)."""
    return read_params(workdir / "checkpoints" / str(step)).tree


def test_lm_page_shows_the_prompt_and_validation_text(lm_run, browser):
    workdir, report = lm_run
    data = report["page"]
    names = [example["name"] for example in data["examples"]]
    assert names == ["prompt", "validation text 1", "validation text 2", "validation text 3"]
    assert "".join(data["examples"][0]["key_tokens"]) == "def add_7(x):"
    assert data["layers"] == ["block 0", "block 1"] and data["num_heads"] == 2
    assert [c["step"] for c in data["checkpoints"]] == [0, 20, 40]
    columns = data["diagnostics"]["columns"]
    assert {"entropy", "previous_token", "induction"} <= set(columns)
    assert len(data["diagnostics"]["rows"]) == 2 * 2
    summary = json.loads((workdir / "summary.json").read_text())
    induction = np.asarray(summary["eval_head_induction"])  # [L, N] of the final evaluation
    shown = [
        [row["induction"] for row in data["diagnostics"]["rows"] if row["layer"] == layer]
        for layer in range(2)
    ]
    np.testing.assert_allclose(shown, induction, rtol=1e-6)
    # Every row of every map is a causal attention distribution.
    for checkpoint in data["checkpoints"]:
        for weights in checkpoint["attention"]:
            weights = np.asarray(weights)
            np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
            assert np.all(np.triu(weights, k=1) == 0)
    check_page(browser, workdir / "report.html", data)


def test_default_char_lm_page_stays_under_five_megabytes(tmp_path):
    """The default char LM config's page at its most (the untrained parameters and 12 checkpoints)."""
    from qkv_jax.report.explorer import write_run_page
    from qkv_jax.report.run import MAX_CHECKPOINTS, run_page_data

    corpus = tmp_path / "code.txt"
    corpus.write_text(TEXT * 4)
    config = char_lm_config.get_config().to_dict()
    config["data"]["path"] = str(corpus)
    setup = build_setup(config)
    params = jax.jit(setup.init)(jax.random.PRNGKey(0))
    metrics, _ = jax.jit(setup.evaluate)(params, jax.random.PRNGKey(1), setup.data)
    frames = [(step, params) for step in range(MAX_CHECKPOINTS + 1)]
    data = run_page_data(config, setup, frames, metrics, tmp_path, prompt="def forward(self, x):")
    path = write_run_page(tmp_path / "report.html", data)
    assert path.stat().st_size < 5_000_000
    assert len(data["examples"]) == 4 and all(len(e["key_tokens"]) <= 64 for e in data["examples"])


def test_lm_page_shows_each_layers_window_and_each_heads_sink_mass(tmp_path, browser):
    """A model with a local layer of 8 keys, a global one and sinks: the diagnostics table gets
    `window` (8, then "full") and `sink_mass`, each head's share of weight its sink takes on the
    page's inputs: 1 minus the row sums of the weights the page shows, averaged."""
    from qkv_jax.report.explorer import write_run_page
    from qkv_jax.report.run import run_page_data

    corpus = tmp_path / "code.txt"
    corpus.write_text(TEXT)
    config = char_lm_config.get_config()
    config.data.path = str(corpus)
    config.model.update(num_layers=2, d_model=16, num_heads=2, max_len=24, window="8,full", sinks=True)
    config.task.seq_len = 16
    config.eval.sample_length = 8
    setup = build_setup(config.to_dict())
    params = jax.jit(setup.init)(jax.random.PRNGKey(0))
    data = run_page_data(config.to_dict(), setup, [(0, params)], {}, tmp_path, prompt="def add_7(x):")
    diagnostics = data["diagnostics"]
    assert diagnostics["columns"] == ["sink_mass", "window"] and diagnostics["labels"] == {"window": "full"}
    assert [row["window"] for row in diagnostics["rows"]] == [8, 8, None, None]
    attention = [np.asarray(weights) for weights in data["checkpoints"][-1]["attention"]]  # [L, N, T, S] each
    expected = np.mean([1 - weights.sum(axis=-1).mean(axis=-1) for weights in attention], axis=0)  # (L, N)
    shown = np.array([row["sink_mass"] for row in diagnostics["rows"]]).reshape(2, 2)
    np.testing.assert_allclose(shown, expected, rtol=1e-5)
    assert np.all(shown > 0.01)  # zero sink logits still take a share
    check_page(browser, write_run_page(tmp_path / "report.html", data), data)


def test_sweep_results_page_links_each_cell_to_its_page(tmp_path, browser):
    config = flag_config(steps=20, checkpoint_every=10)
    run_sweep(config, tmp_path, {"model.d_k": [4, 8]}, [0, 1], metric="eval_accuracy", log=lambda *_: None)
    assert report_sweep(tmp_path)["pages"] == 2
    page = html.unescape((tmp_path / "results.html").read_text())  # the page writes / and = as entities
    for cell in ("model.d_k=4", "model.d_k=8"):
        assert f'href="cells/{cell}/report.html"' in page
        check_no_external_references(tmp_path / "cells" / cell / "report.html")
        with open_page(
            browser, tmp_path / "cells" / cell / "report.html"
        ) as cell_page:  # no errors, no requests
            assert "model.d_k" in cell_page.content()
    check_no_external_references(tmp_path / "results.html")
