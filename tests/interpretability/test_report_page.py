"""`experiments.report`'s explorer page (report.html) for real tiny runs, in headless Chromium.

The page's numbers are checked twice: in the browser against the data the page
was built from (tests/browser.py: hover, slider, sort, screenshot), and that
data against attention weights recomputed here from the run's checkpoints.
"""

import html
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from browser import check_no_external_references, check_page, launch_browser, missing_reason, open_page
from launch import ROOT, launcher_env

from configs import char_lm as char_lm_config
from configs import flag_retrieval
from qkv_jax.report.run import report_run
from qkv_jax.tasks.flag_retrieval import attention_weights, flag_retrieval_batch
from qkv_jax.training import build_setup, read_params, train_and_evaluate
from qkv_jax.training.loop import seed_keys
from studies.results import report_sweep
from studies.sweep import run_sweep

# Every test here trains or reports a real run: the full suite's, not the fast tier's.
pytestmark = pytest.mark.slow

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
    config.train.cpu_optimization_level = 0  # a tiny run: compile time is most of it
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
    config.train.update(keep_checkpoints=0, cpu_optimization_level=0)
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
    # The learned query's one head: W_QK = W_query W_key^T and its value map W_value (no W_O).
    circuits = data["circuits"]
    assert circuits["composition"] is None and circuits["patching"] is None
    assert "needs a language model" in circuits["patching_note"]
    for c, checkpoint in enumerate(data["checkpoints"][1:], start=1):
        attention = checkpoint_params(workdir, config, checkpoint["step"])["attention"]
        W_Q, W_K, W_V = (
            np.asarray(attention[n]["kernel"], np.float64) for n in ("W_query", "W_key", "W_value")
        )
        for name, matrix in (("qk", W_Q @ W_K.T), ("ov", W_V)):
            shown = {key: np.asarray(circuits[name][key][c])[0, 0] for key in ("values", "effective_rank")}
            rank = min(W_Q.shape) if name == "qk" else min(W_V.shape)
            assert_spectrum(shown, np.linalg.svd(matrix, compute_uv=False)[:rank], f"{name} at step {c}")
    check_page(browser, workdir / "report.html", data)


def effective_rank(values):
    """exp(entropy) of singular values `[..., k]` normalised to sum 1, in float64."""
    p = values / values.sum(axis=-1, keepdims=True)
    return np.exp(-np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1))


def assert_spectrum(shown, values, what):
    """A page's singular values (and effective ranks) against float64 ones, within float32 rounding
    of the largest."""
    values = np.asarray(values, np.float64)
    np.testing.assert_allclose(shown["values"], values, rtol=1e-5, atol=1e-5 * values.max(), err_msg=what)
    np.testing.assert_allclose(shown["effective_rank"], effective_rank(values), rtol=1e-5, err_msg=what)


def lm_reference(params):
    """Every head's W_QK and W_OV `[L, N, D, D]` of a TransformerLM in float64, each block's
    attention LayerNorm folded in: kernels scaled by its scale and centred over D."""
    qk, ov = [], []
    for layer in range(sum(name.startswith("block_") for name in params)):
        block = params[f"block_{layer}"]
        scale = np.asarray(block["attention_norm"]["scale"], np.float64)[:, None, None]  # (D, 1, 1)
        W_Q, W_K, W_V = (
            scale * np.asarray(block["attention"][name]["kernel"], np.float64)
            for name in ("query", "key", "value")
        )  # (D, N, H) each
        W_Q, W_K, W_V = (W - W.mean(axis=0) for W in (W_Q, W_K, W_V))
        W_O = np.asarray(block["attention"]["out"]["kernel"], np.float64)  # (N, Hv, D)
        qk.append(np.einsum("dnh,enh->nde", W_Q, W_K))  # (N, D, D)
        ov.append(np.einsum("dnv,nve->nde", W_V, W_O))  # (N, D, D)
    return np.stack(qk), np.stack(ov)


def check_lm_circuits(circuits, frames):
    """The page's spectra and composition scores against float64 NumPy, checkpoint by checkpoint."""
    for c, params in enumerate(frames):
        qk, ov = lm_reference(params)  # (L, N, D, D) each
        head_dim = params["block_0"]["attention"]["query"]["kernel"].shape[-1]
        for name, matrices in (("qk", qk), ("ov", ov)):
            shown = {key: np.asarray(circuits[name][key][c]) for key in ("values", "effective_rank")}
            assert_spectrum(
                shown, np.linalg.svd(matrices, compute_uv=False)[..., :head_dim], f"{name} at {c}"
            )
        norm = lambda m: np.sqrt(np.sum(np.square(m), axis=(-2, -1)))
        for mode, read in (("Q", qk), ("K", np.swapaxes(qk, -1, -2)), ("V", ov)):
            product = np.einsum("lnde,mkef->lnmkdf", ov, read)  # (L, N, L, N, D, D)
            scores = norm(product) / (norm(ov)[:, :, None, None] * norm(read)[None, None])  # (L, N, L, N)
            layers = np.arange(qk.shape[0])
            scores = np.where(layers[:, None, None, None] < layers[None, None, :, None], scores, 0.0)
            np.testing.assert_allclose(circuits["composition"][mode][c], scores, rtol=1e-5, atol=1e-7)


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
    untrained = jax.jit(build_setup(data["config"]).init)(seed_keys(data["config"]["seed"])["init"])
    frames = [untrained] + [checkpoint_params(workdir, None, c["step"]) for c in data["checkpoints"][1:]]
    check_lm_circuits(data["circuits"], frames)
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
    # The page holds the evaluation's metrics, whose shapes do not depend on how many windows they
    # average or how long the samples are (the page's size moves by a few bytes of digits): a
    # small evaluation, 10 s less.
    config["eval"].update(num_examples=16, ablation_examples=4, sample_length=8)
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


def report_command(workdir, *flags):
    """`python -m experiments.report --workdir <workdir> <flags>` from the repository root."""
    command = [sys.executable, "-m", "experiments.report", f"--workdir={workdir}", *flags]
    return subprocess.run(command, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_patching_heat_map_from_the_command_line_is_each_heads_patched_run(lm_run, tmp_path):
    """--clean/--corrupted on a char LM run: the page's shares are (patched - corrupted) /
    (clean - corrupted) of logit(answer) - logit(contrast) at the last position, recomputed here
    with one run_with_hooks per head; bad prompts end in one line and exit 2."""
    from qkv_jax.interpretability import replace, run_with_cache, run_with_hooks
    from qkv_jax.text import CharTokenizer

    workdir = shutil.copytree(lm_run[0], tmp_path / "run")  # the page is rewritten: a copy
    config = json.loads((workdir / "config.json").read_text())
    model = build_setup(config).model
    params = read_params(workdir).tree
    tokenizer = CharTokenizer.load(workdir / "tokenizer.json")
    apply = jax.jit(model.apply)  # the texts below share one length: one compile
    # A corruption of the last character that changes the most likely next token (the heat map
    # needs one; which one does depends on this tiny model's training).
    clean = "def add_7(x):\n    return x + 7"
    predict = lambda text: int(np.argmax(apply({"params": params}, tokenizer.encode(text)[None])[0, -1]))
    corrupted = next(clean[:-1] + c for c in " (:x\n=+r" if predict(clean[:-1] + c) != predict(clean))
    result = report_command(workdir, f"--clean={clean}", f"--corrupted={corrupted}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "warning" not in result.stderr.lower(), result.stderr
    page = (workdir / "report.html").read_text()
    data = json.loads(
        re.search(r'<script type="application/json" id="run-data">(.*?)</script>', page, re.S)[1]
    )
    patching = data["circuits"]["patching"]
    tokens = [np.asarray(tokenizer.encode(text))[None] for text in (clean, corrupted)]
    answer, contrast = (tokenizer.chars.index(patching[key]) for key in ("answer", "contrast"))
    difference = lambda logits: float(logits[0, -1, answer] - logits[0, -1, contrast])
    variables = {"params": params}
    high, low = (difference(apply(variables, t)) for t in tokens)
    np.testing.assert_allclose(
        [patching["clean_difference"], patching["corrupted_difference"]], [high, low], rtol=1e-5
    )
    _, cache = run_with_cache(model, variables, tokens[0])
    want = [
        [
            (
                difference(
                    run_with_hooks(
                        model,
                        variables,
                        tokens[1],
                        hooks={
                            f"blocks.{layer}.attn.hook_z": replace(
                                cache[f"blocks.{layer}.attn.hook_z"], heads=head
                            )
                        },
                    )
                )
                - low
            )
            / (high - low)
            for head in range(2)
        ]
        for layer in range(2)
    ]
    np.testing.assert_allclose(patching["restored"], want, rtol=1e-4, atol=1e-4)
    for flags, message in [
        ([f"--clean={clean}"], "--clean needs the other of --clean and --corrupted"),
        ([f"--clean={clean}", "--corrupted=def"], "--corrupted='def': 3 tokens, but --clean has"),
        ([f"--clean={clean}", "--corrupted=\u00e9"], "are not in the run's vocabulary"),
        ([f"--clean={clean}", f"--corrupted={clean}"], "both make token"),
    ]:
        result = report_command(workdir, *flags)
        assert result.returncode == 2, result.stderr[-2000:]
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], result.stderr
