"""The run explorer and sweep results pages (qkv_jax.report.explorer).

The encoding, the schema checks and the page's size are checked in Python; the
page itself in headless Chromium (tests/browser.py), against the numbers of the
synthetic data it was built from. The browser tests skip, saying why, when
playwright or chromium is missing; .ci/run installs both and sets
QKV_JAX_REQUIRE_BROWSER=1, which makes a missing browser a failure instead.
"""

import copy
import json
import os
import re

import numpy as np
import pytest
from browser import (
    assert_shows,
    check_circuits,
    check_composition,
    check_diagnostics_sort,
    check_hover,
    check_no_external_references,
    check_page,
    check_row_selects_head,
    check_screenshot,
    check_slider,
    check_spectra,
    hover_query,
    key_weights,
    launch_browser,
    missing_reason,
    open_page,
    select,
    set_checkpoint,
    spectrum_rows,
)

from qkv_jax.report.explorer import (
    LEVELS,
    decode_attention,
    encode_attention,
    page_attention,
    write_run_page,
    write_sweep_page,
)
from studies.grid import cell_name


def causal_attention(rng, num_layers, num_heads, num_queries, num_keys, sharpness=2.0):
    """Softmax rows of random scores `[L, H, T, S]`; query t sees keys up to its position t + S - T."""
    scores = sharpness * rng.standard_normal((num_layers, num_heads, num_queries, num_keys))
    visible = np.arange(num_keys)[None, :] <= np.arange(num_queries)[:, None] + num_keys - num_queries
    scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


def synthetic_circuits(rng, num_checkpoints, num_layers, num_heads, ranks=(4, 3)):
    """The circuits view's data: descending singular values (one of them zero, which the log plot
    leaves out), effective ranks in [1, k], composition scores zero unless the first layer comes
    first (none for one layer), and a patching heat map with a share that is not a number."""
    heads = (num_checkpoints, num_layers, num_heads)

    def spectrum(label, k):
        values = -np.sort(-rng.uniform(0.01, 3.0, (*heads, k)), axis=-1)  # (C, L, N, k), descending
        values[0, 0, 0, -1] = 0.0
        return {"label": label, "values": values, "effective_rank": rng.uniform(1.0, k, heads)}

    layers = np.arange(num_layers)
    earlier = layers[:, None, None, None] < layers[None, None, :, None]  # (L, 1, L, 1)
    restored = rng.normal(0.2, 0.6, (num_layers, num_heads)).tolist()
    restored[0][0] = None
    return {
        "notes": ["synthetic circuits"],
        "qk": spectrum("W_QK = W_Q W_K^T", ranks[0]),
        "ov": spectrum("W_OV = W_V W_O", ranks[1]),
        "composition": {
            mode: np.where(earlier, rng.uniform(0, 1, (num_checkpoints, *heads[1:], *heads[1:])), 0.0)
            for mode in "QKV"
        }
        if num_layers > 1
        else None,
        "patching": {
            "step": 200,
            "clean": list("ab a"),
            "corrupted": list("ab c"),
            "answer": "b",
            "contrast": " ",
            "clean_difference": 2.5,
            "corrupted_difference": -0.75,
            "restored": restored,
        },
        "patching_note": "synthetic patching",
    }


def synthetic_run_data(
    seed=0, shapes=((6, 6), (4, 7), (9, 9)), layers=("block 0", "block 1"), num_heads=3, steps=(0, 100, 200)
):
    """A run's page data (the schema of qkv_jax.report.explorer) from a seeded generator."""
    rng = np.random.default_rng(seed)
    alphabet = list("abcdefgh ") + ["\n"]
    examples = [
        {
            "name": f"example {e}",
            "query_tokens": [str(rng.choice(alphabet)) for _ in range(num_queries)],
            "key_tokens": [str(rng.choice(alphabet)) for _ in range(num_keys)],
            "marks": [int(rng.integers(num_keys))],
        }
        for e, (num_queries, num_keys) in enumerate(shapes)
    ]
    for example in examples:
        example["query_tokens"] = example["key_tokens"][
            len(example["key_tokens"]) - len(example["query_tokens"]) :
        ]
    checkpoints = [
        {"step": step, "attention": [causal_attention(rng, len(layers), num_heads, t, s) for t, s in shapes]}
        for step in steps
    ]
    columns = ["entropy", "distance", "previous_token"]
    rows = [
        {"layer": layer, "head": head, **{c: float(rng.uniform(0, 3)) for c in columns}}
        for layer in range(len(layers))
        for head in range(num_heads)
    ]
    rows[1]["distance"] = None  # a missing value sorts last
    losses = np.exp(-np.linspace(0, 4, 20)) + 0.01 * rng.random(20)
    return {
        "title": "synthetic run",
        "subtitle": f"checkpoint step {steps[-1]}",
        "config": {
            "seed": seed,
            "model": {"num_layers": len(layers), "num_heads": num_heads},
            "task": {"name": "x"},
        },
        "curves": {
            "training loss": [[10 * i, float(v)] for i, v in enumerate(losses)],
            "eval loss": [[50 * i, float(v)] for i, v in enumerate(losses[::5] * 1.1)]
            + [[200, float("nan")]],
        },
        "layers": list(layers),
        "num_heads": num_heads,
        "examples": examples,
        "checkpoints": checkpoints,
        "diagnostics": {"columns": columns, "rows": rows},
        "notes": ["synthetic data for the explorer tests"],
        "circuits": synthetic_circuits(rng, len(steps), len(layers), num_heads),
    }


@pytest.fixture(scope="module")
def run_data():
    return synthetic_run_data()


@pytest.fixture(scope="module")
def run_page(run_data, tmp_path_factory):
    return write_run_page(tmp_path_factory.mktemp("explorer") / "report.html", run_data)


@pytest.fixture(scope="module")
def browser():
    reason = missing_reason()
    if reason is not None and os.environ.get("QKV_JAX_REQUIRE_BROWSER"):
        pytest.fail(f"QKV_JAX_REQUIRE_BROWSER is set (.ci/run) but {reason}")
    if reason is not None:
        pytest.skip(reason)
    with launch_browser() as launched:
        yield launched


# ---- Python side --------------------------------------------------------------------------


def test_quantised_weights_are_round_weight_times_255_over_255():
    weights = np.random.default_rng(1).random((2, 3, 5, 7))
    weights[0, 0, 0, :3] = [0.0, 1.0, 0.5 / 255]
    decoded = decode_attention(encode_attention(weights), weights.shape)
    np.testing.assert_array_equal(decoded, np.rint(weights * 255) / 255)
    assert np.abs(decoded - weights).max() <= 0.5 / LEVELS
    assert decoded[0, 0, 0, 0] == 0.0 and decoded[0, 0, 0, 1] == 1.0


def test_page_attention_is_the_quantised_data(run_data):
    page = page_attention(run_data, 2, 1)
    raw = run_data["checkpoints"][2]["attention"][1]
    assert page.shape == raw.shape == (2, 3, 4, 7)
    np.testing.assert_array_equal(page, np.rint(raw * 255) / 255)


def _bad(path, value):
    """A mutation of the run data: sets data[path...] = value (or deletes it for value=KeyError)."""

    def mutate(data):
        *parents, last = path
        target = data
        for key in parents:
            target = target[key]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value(target[last]) if callable(value) else value

    return mutate


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_bad(["title"], KeyError), "data: missing key 'title'"),
        (_bad(["num_heads"], "3"), "data['num_heads']: expected int, got str"),
        (_bad(["layers"], []), "data['layers']: expected a non-empty list of str"),
        (
            _bad(["examples", 0, "marks"], [6]),
            r"data['examples'][0]['marks']: 6 is not a key position in [0, 6)",
        ),
        (
            _bad(["examples", 1, "key_tokens"], ["a"]),
            "data['examples'][1]: 4 query tokens but only 1 key tokens",
        ),
        (_bad(["checkpoints", 1, "step"], 1.5), "data['checkpoints'][1]['step']: expected an int"),
        (
            _bad(["checkpoints", 1, "attention"], lambda a: a[:2]),
            "data['checkpoints'][1]['attention']: 2 examples",
        ),
        (
            _bad(["checkpoints", 1, "attention", 2], lambda a: a[:, :2]),
            "data['checkpoints'][1]['attention'][2]: shape (2, 2, 9, 9), "
            "expected [num_layers, num_heads, T, S] = (2, 3, 9, 9)",
        ),
        (
            _bad(["checkpoints", 0, "attention", 0], lambda a: a * 2),
            "data['checkpoints'][0]['attention'][0]: weights",
        ),
        (
            _bad(["curves", "eval loss", 0], [1]),
            "data['curves']['eval loss']: [1] is not a [step, value] pair",
        ),
        (
            _bad(["diagnostics", "rows", 4, "head"], 3),
            "data['diagnostics']['rows'][4]['head']: 3 is not in [0, 3)",
        ),
        (
            _bad(["diagnostics", "rows", 0, "entropy"], KeyError),
            "data['diagnostics']['rows'][0]: missing column",
        ),
        (
            _bad(["diagnostics", "rows", 0, "entropy"], "low"),
            r"data['diagnostics']['rows'][0]['entropy']: expected",
        ),
        (
            _bad(["diagnostics", "labels"], {"window": "full"}),
            "data['diagnostics']['labels']: expected {column: str} over the columns",
        ),
        (_bad(["circuits", "notes"], KeyError), "data['circuits']: expected a dict with keys"),
        (
            _bad(["circuits", "qk", "values"], lambda v: v[:2]),
            "data['circuits']['qk']['values']: shape (2, 2, 3, 4), expected (3, 2, 3, None)",
        ),
        (
            _bad(["circuits", "ov", "values"], lambda v: -v),
            "data['circuits']['ov']['values']: values must be finite and in [0.0, inf]",
        ),
        (
            _bad(["circuits", "qk", "effective_rank"], lambda v: v + 4),
            "data['circuits']['qk']['effective_rank']: values must be finite and in [1.0, 4]",
        ),
        (
            _bad(["circuits", "composition", "K"], lambda v: v * 3),
            "data['circuits']['composition']['K']: values must be finite and in [0.0, 1.0]",
        ),
        (
            _bad(["circuits", "patching", "corrupted"], list("abc")),
            "data['circuits']['patching']: 4 clean tokens but 3 corrupted ones",
        ),
        (
            _bad(["circuits", "patching", "restored"], [[0.5, 0.1, 0.2]]),
            "data['circuits']['patching']['restored']: expected [num_layers][num_heads] = [2, 3]",
        ),
        (
            _bad(["circuits", "patching", "clean_difference"], float("nan")),
            "data['circuits']['patching']['clean_difference']: expected a finite number, got nan",
        ),
    ],
)
def test_bad_data_is_a_value_error_naming_the_key(run_data, tmp_path, mutate, message):
    data = copy.deepcopy(run_data)
    mutate(data)
    with pytest.raises(ValueError, match=re.escape(message)):
        write_run_page(tmp_path / "report.html", data)
    assert not (tmp_path / "report.html").exists()


def test_page_is_self_contained_and_carries_the_data(run_data, tmp_path):
    data = copy.deepcopy(run_data)
    data["title"] = 'see http://example.com/x.js <script src="a.js"></script>'
    data["config"]["data_url"] = "https://example.com/data?src=1"
    path = write_run_page(tmp_path / "report.html", data)
    check_no_external_references(path)
    html = path.read_text()
    assert "<script src" not in html.lower() and "<link" not in html.lower()
    payload = json.loads(
        re.search(r'<script type="application/json" id="run-data">(.*?)</script>', html, re.S)[1]
    )
    assert payload["title"] == data["title"]
    assert payload["config"]["data_url"] == data["config"]["data_url"]
    assert payload["curves"]["eval loss"][-1] == [200, None]  # nan travels as a gap
    shape = page_attention(data, 1, 2).shape
    np.testing.assert_array_equal(
        decode_attention(payload["checkpoints"][1]["attention"][2], shape), page_attention(data, 1, 2)
    )


def test_realistic_page_stays_small(tmp_path):
    """3 examples of 64 tokens, 2 layers, 4 heads, 11 checkpoints: one byte per weight, base64."""
    data = synthetic_run_data(shapes=((64, 64),) * 3, num_heads=4, steps=tuple(range(0, 5500, 500)))
    path = write_run_page(tmp_path / "report.html", data)
    size = path.stat().st_size
    weights = 3 * 64 * 64 * 2 * 4 * 11
    assert weights * 4 / 3 < size < weights * 4 / 3 + 200_000, size  # base64 plus ~50 kB of page
    assert size < 2_000_000


def sweep_rows():
    def done(lr, heads, mean, seconds):
        stats = {"mean": mean, "std": 0.1 * mean, "min": 0.9 * mean, "max": 1.1 * mean}
        return {
            "cell": {"train.learning_rate": lr, "model.num_heads": heads},
            "status": "done",
            "seeds": [0, 1],
            "final_loss_stats": stats,
            "wall_time_s": seconds,
        }

    skipped = {
        "cell": {"train.learning_rate": 0.1, "model.num_heads": 3},
        "status": "skipped",
        "reason": "model.num_heads=3 does not divide d_model=64",
    }
    return [done(0.001, 2, 0.5, 12.0), done(0.01, 2, 0.05, 11.0), skipped, done(0.01, 4, 0.2, 30.5)]


def test_sweep_page_links_only_cells_with_a_report(tmp_path):
    links = {"train.learning_rate=0.01,model.num_heads=2": "runs/a/report.html"}
    path = write_sweep_page(
        tmp_path / "results.html", sweep_rows(), "final_loss", lambda cell: links.get(cell_name(cell))
    )
    check_no_external_references(path)
    rows = re.findall(r"<tr>(<td.*?)</tr>", path.read_text())
    assert len(rows) == 4
    assert [row.count('href="runs&#47;a&#47;report.html"') for row in rows] == [0, 5, 0, 0]
    assert "0.05 ± 0.005 [0.045, 0.055]" in rows[1]
    with pytest.raises(ValueError, match="not a relative link"):
        write_sweep_page(
            tmp_path / "results.html", sweep_rows(), "final_loss", lambda cell: "https://x/report.html"
        )


# ---- In the browser ----------------------------------------------------------------------


def test_page_shows_header_curves_and_config(browser, run_page, run_data):
    with open_page(browser, run_page) as page:
        assert page.locator("#title").inner_text() == run_data["title"]
        assert page.locator("#notes li").all_inner_texts() == run_data["notes"]
        assert "quantised to 1/255" in page.locator("#head-view .hint").inner_text()
        names = page.locator("#curve-plot polyline").evaluate_all("lines => lines.map(l => l.dataset.name)")
        assert names == list(run_data["curves"])
        # The eval curve's nan is left out: 4 points, not 5.
        assert len(page.locator("#curve-plot polyline").nth(1).get_attribute("points").split()) == 4
        page.uncheck("#log-y")
        assert page.locator("#curve-plot polyline").count() == 2
        assert '"x"' in page.locator("#config-tree").inner_text()


@pytest.mark.parametrize(
    ("checkpoint", "example", "layer", "head", "query"), [(2, 0, 0, 0, 5), (1, 1, 1, 2, 0)]
)
def test_hover_shows_the_weights_of_the_data(
    browser, run_page, run_data, checkpoint, example, layer, head, query
):
    with open_page(browser, run_page) as page:
        check_hover(page, run_data, checkpoint, example, layer, head, query)
        hover_query(page, query - 1 if query else 3)  # another query: other numbers
        assert_shows(page, run_data, checkpoint, example, layer, head, query - 1 if query else 3)


def test_all_heads_shows_every_head_and_their_mean(browser, run_page, run_data):
    with open_page(browser, run_page) as page:
        select(page, 2, 1, "all")
        set_checkpoint(page, run_data, 1)
        hover_query(page, 7)
        expected = page_attention(run_data, 1, 2)[1, :, 7]  # (H, S)
        quantised = np.rint(expected * LEVELS)
        np.testing.assert_allclose(key_weights(page), quantised.sum(axis=0) / 3 / LEVELS, rtol=1e-12)
        lines = page.locator("#links line").evaluate_all(
            "nodes => nodes.map(n => [Number(n.dataset.head), Number(n.dataset.key), "
            "Number(n.dataset.weight)])"
        )
        assert len(lines) == np.count_nonzero(expected)
        for head, key, weight in lines:
            assert weight == expected[head, key]


def test_slider_switches_checkpoints(browser, run_page, run_data):
    with open_page(browser, run_page) as page:
        assert page.locator("#checkpoint-label").get_attribute("data-step") == "200"  # starts on the newest
        check_slider(page, run_data, 2, 1, 0, 6)
        page.locator(".strip-item").nth(2).click()
        assert page.locator("#checkpoint-slider").input_value() == "2"
        hover_query(page, 6)
        assert_shows(page, run_data, 2, 2, 1, 0, 6)


def test_diagnostics_sort_and_select_a_head(browser, run_page, run_data):
    with open_page(browser, run_page) as page:
        check_diagnostics_sort(page, run_data, "distance")  # holds a missing value
        check_diagnostics_sort(page, run_data, "entropy")
        check_row_selects_head(page, run_data, 1, 1, 2)
        check_row_selects_head(page, run_data, 1, 0, 1)


def test_screenshot_shows_the_heatmap(browser, run_page, run_data):
    with open_page(browser, run_page) as page:
        select(page, 2, 0, 1)
        check_screenshot(page, run_data)


def test_check_page_on_a_single_layer_page(browser, tmp_path):
    """The whole check, as the lead's real-run tests call it, on a flag-task-like shape."""
    data = synthetic_run_data(
        seed=3, shapes=((1, 12), (1, 12)), layers=("attention",), num_heads=2, steps=(0, 50)
    )
    check_page(browser, write_run_page(tmp_path / "report.html", data), data)


def test_checks_fail_on_wrong_numbers(browser, run_page, run_data, tmp_path):
    """The checks compare numbers: the same steps with the checkpoints' weights swapped must fail."""
    checkpoints = run_data["checkpoints"]
    wrong = dict(
        run_data,
        checkpoints=[
            dict(c, attention=o["attention"]) for c, o in zip(checkpoints, checkpoints[::-1], strict=True)
        ],
    )
    with open_page(browser, run_page) as page:
        with pytest.raises(AssertionError, match="Arrays are not equal"):
            check_hover(page, wrong, 0, 0, 0, 0, 5)
    (tmp_path / "linked.html").write_text('<a href="https://example.com">x</a>')
    with pytest.raises(AssertionError, match="https://"):
        check_no_external_references(tmp_path / "linked.html")


def test_circuits_view_shows_the_data(browser, run_page, run_data):
    """Spectra and effective ranks of one head and of every head, at two checkpoints; each
    composition mode; the patching heat map with its missing share."""
    with open_page(browser, run_page) as page:
        check_circuits(page, run_data)
        check_spectra(page, run_data, 1, 0, 2)
        check_spectra(page, run_data, 0, 0, 0)  # holds the zero singular value: no dot for it
        row = page.locator('#spectrum-table tbody tr[data-matrix="qk"] .singular-value').last
        assert row.get_attribute("data-value") == "0" and row.text_content() == "0"
        page.locator('#patching-table td[data-layer="1"][data-head="2"]').click()
        assert page.locator("#layer-select").input_value() == "1"
        assert page.locator("#head-select").input_value() == "2"
        assert page.locator('#patching-table td[data-layer="0"][data-head="0"]').inner_text() == ""


def test_circuits_view_of_a_model_it_covers_in_part(browser, tmp_path):
    """One layer without W_OV's spectrum or composition, and no patching: the view shows what
    applies and the notes, and says how to get a heat map."""
    data = synthetic_run_data(seed=5, layers=("attention",), num_heads=2, steps=(0, 50))
    data["circuits"].update(ov=None, composition=None, patching=None, patching_note="run it with --clean")
    data["circuits"]["notes"] = ["one attention layer: no composition"]
    with open_page(browser, write_run_page(tmp_path / "report.html", data)) as page:
        check_circuits(page, data)
        assert page.locator("#composition").is_hidden() and page.locator("#patching-table").is_hidden()
        assert list(spectrum_rows(page)) == [("qk", 1)]
    del data["circuits"]
    with open_page(browser, write_run_page(tmp_path / "report.html", data)) as page:
        assert page.locator("#circuits").is_hidden()


def test_circuit_checks_fail_on_wrong_numbers(browser, run_page, run_data):
    """The same shapes with the checkpoints' spectra and the composition modes swapped must fail."""
    wrong = copy.deepcopy(run_data)
    wrong["circuits"]["qk"]["values"] = wrong["circuits"]["qk"]["values"][::-1]
    composition = wrong["circuits"]["composition"]
    composition["K"], composition["Q"] = composition["Q"], composition["K"]
    with open_page(browser, run_page) as page:
        with pytest.raises(AssertionError):
            check_spectra(page, wrong, 0, 1, 1)
        with pytest.raises(AssertionError):
            check_composition(page, wrong, 2, "K")


def test_sweep_page_sorts_and_links(browser, tmp_path):
    links = {"train.learning_rate=0.01,model.num_heads=4": "cells/b/report.html"}
    path = write_sweep_page(
        tmp_path / "results.html", sweep_rows(), "final_loss", lambda cell: links.get(cell_name(cell))
    )
    with open_page(browser, path) as page:
        page.locator("#results th").nth(2).click()  # final_loss mean ± std
        means = page.locator("#results tbody tr").evaluate_all(
            "rows => rows.map(r => r.cells[2].dataset.value)"
        )
        assert means == ["0.05", "0.2", "0.5", ""]  # the skipped cell last
        page.locator("#results th").nth(2).click()
        means = page.locator("#results tbody tr").evaluate_all(
            "rows => rows.map(r => r.cells[2].dataset.value)"
        )
        assert means == ["0.5", "0.2", "0.05", ""]  # still last
        hrefs = page.locator("#results a").evaluate_all("links => links.map(a => a.getAttribute('href'))")
        assert hrefs == ["cells/b/report.html"] * 5


def test_labelled_missing_values_show_their_label_and_sort_last(browser, tmp_path):
    """A language model's window column: a number per local layer, "full" for a global one."""
    data = synthetic_run_data(seed=4)
    data["diagnostics"]["columns"] += ["window", "sink_mass"]
    for row in data["diagnostics"]["rows"]:
        row["window"] = 64 if row["layer"] == 0 else None
        row["sink_mass"] = 0.1 * row["head"] + 0.05 * row["layer"]
    data["diagnostics"]["labels"] = {"window": "full"}
    page_path = write_run_page(tmp_path / "report.html", data)
    with open_page(browser, page_path) as page:
        index = ["layer", "head", *data["diagnostics"]["columns"]].index("window")
        texts = page.locator("#diagnostics-table tbody tr").evaluate_all(
            f"rows => rows.map(r => [r.dataset.layer, r.cells[{index}].textContent])"
        )
        assert texts == [
            [str(row["layer"]), "64" if row["layer"] == 0 else "full"] for row in data["diagnostics"]["rows"]
        ]
        check_diagnostics_sort(page, data, "window")  # "full" (no number) sorts last
        check_diagnostics_sort(page, data, "sink_mass")
