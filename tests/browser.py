"""Checks of a run explorer page (qkv_jax.report.explorer) in a real headless Chromium.

`check_page(browser, path, data)` opens a page written by `write_run_page(path, data)`
and checks it against `data`: no console error, no network request, hovering a
query shows that head's weights (the quantised numbers of `page_attention`, and
within half a step of the raw ones), the checkpoint slider switches to the other
checkpoint's numbers, the diagnostics table sorts and selects heads, and the
rendered heatmap and page are not blank, and the circuits view shows the data's
singular values, effective ranks, composition scores and patching shares. The smaller
`check_*` functions are the pieces. Chromium is Debian's (/usr/bin/chromium), driven by
playwright through `executable_path`; `playwright install` is never needed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import pathlib
import shutil
from collections.abc import Iterator

import numpy as np

from qkv_jax.report.explorer import LEVELS, page_attention

CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ACCENT = np.array([33, 102, 172])  # the page's attention colour (run_page.js ACCENT)


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def missing_reason() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed (pip install playwright; .ci/run installs it)"
    if chromium_path() is None:
        return "no chromium on PATH (apt-get install -y chromium; .ci/run installs it)"
    return None


@contextlib.contextmanager
def launch_browser() -> Iterator[object]:
    """Headless Debian Chromium under playwright, with a fresh profile and no background networking."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_FLAGS)
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def open_page(browser, path: str | pathlib.Path) -> Iterator[object]:
    """The page at `path`, loaded; on leaving, asserts it logged no error and requested nothing."""
    url = pathlib.Path(path).resolve().as_uri()
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("request", lambda request: requests.append(request.url) if request.url != url else None)

    def route(route):  # every request but the page itself is recorded (above) and refused
        if route.request.url == url:
            route.continue_()
        else:
            route.abort()

    page.route("**/*", route)
    try:
        page.goto(url)
        page.wait_for_load_state("load")
        yield page
        assert errors == [], f"console errors: {errors}"
        assert requests == [], f"network requests: {requests}"
    finally:
        page.close()


def check_no_external_references(path: str | pathlib.Path) -> None:
    text = pathlib.Path(path).read_text(encoding="utf-8").lower()
    for needle in ("http://", "https://", "src="):
        assert needle not in text, f"{path} contains {needle!r} at {text.index(needle)}"


# ---- Reading the page ---------------------------------------------------------------------


def select(page, example: int, layer: int, head: int | str) -> None:
    page.select_option("#example-select", str(example))
    page.select_option("#layer-select", str(layer))
    page.select_option("#head-select", str(head))


def set_checkpoint(page, data: dict, index: int) -> None:
    """Moves the slider with the keyboard, as a user would, and checks its label."""
    slider = page.locator("#checkpoint-slider")
    slider.focus()
    slider.press("Home")
    for _ in range(index):
        slider.press("ArrowRight")
    label = page.locator("#checkpoint-label")
    assert label.get_attribute("data-step") == str(data["checkpoints"][index]["step"])
    assert f"step {data['checkpoints'][index]['step']}" in label.inner_text()


def key_weights(page) -> np.ndarray:
    """The weights the key tokens show (data-weight), in key order."""
    values = page.locator("#key-column .token").evaluate_all(
        "nodes => nodes.map(n => [Number(n.dataset.index), n.dataset.weight ?? null])"
    )
    assert [index for index, _ in values] == list(range(len(values)))
    assert all(weight is not None for _, weight in values), "a key shows no weight"
    return np.array([float(weight) for _, weight in values])


def assert_shows(page, data: dict, checkpoint: int, example: int, layer: int, head: int, query: int) -> None:
    """The key shading, the lines and the top-weights table show exactly that row of weights."""
    expected = page_attention(data, checkpoint, example)[layer, head, query]
    raw = np.asarray(data["checkpoints"][checkpoint]["attention"][example], np.float64)[layer, head, query]
    shown = key_weights(page)
    np.testing.assert_array_equal(shown, expected)
    np.testing.assert_array_less(np.abs(shown - raw), 0.5 / LEVELS + 1e-9)
    lines = page.locator("#links line").evaluate_all(
        "nodes => nodes.map(n => [Number(n.dataset.key), Number(n.dataset.weight), "
        "Number(n.getAttribute('stroke-opacity'))])"
    )
    assert sorted(key for key, _, _ in lines) == list(np.flatnonzero(expected))
    for key, weight, opacity in lines:
        assert weight == expected[key] and opacity == expected[key]
    top = page.locator("#top-weights tbody tr").evaluate_all(
        "rows => rows.map(r => [Number(r.dataset.key), r.cells[2].textContent])"
    )
    assert len(top) == min(8, len(expected))
    assert [f"{expected[key]:.3f}" for key, _ in top] == [text for _, text in top]
    np.testing.assert_array_equal([expected[key] for key, _ in top], np.sort(expected)[::-1][: len(top)])


def hover_query(page, query: int) -> None:
    page.hover(f'#query-column .token[data-index="{query}"]')


# ---- The checks -------------------------------------------------------------------------------


def check_hover(page, data: dict, checkpoint: int, example: int, layer: int, head: int, query: int) -> None:
    select(page, example, layer, head)
    set_checkpoint(page, data, checkpoint)
    hover_query(page, query)
    assert (
        page.locator(f'#query-column .token[data-index="{query}"]').get_attribute("class") == "token selected"
    )
    assert_shows(page, data, checkpoint, example, layer, head, query)
    marked = page.locator("#key-column .token.marked").evaluate_all(
        "nodes => nodes.map(n => Number(n.dataset.index))"
    )
    assert marked == sorted(set(data["examples"][example]["marks"]))


def check_slider(page, data: dict, example: int, layer: int, head: int, query: int) -> None:
    """Checkpoint 0, then 1 (by the slider), shows each checkpoint's own weights."""
    before, after = (page_attention(data, c, example)[layer, head, query] for c in (0, 1))
    assert not np.array_equal(before, after), "pick a query whose weights differ between checkpoints 0 and 1"
    select(page, example, layer, head)
    hover_query(page, query)
    set_checkpoint(page, data, 0)
    assert_shows(page, data, 0, example, layer, head, query)
    page.locator("#checkpoint-slider").press("ArrowRight")
    assert page.locator("#checkpoint-label").get_attribute("data-step") == str(data["checkpoints"][1]["step"])
    assert_shows(page, data, 1, example, layer, head, query)
    assert page.locator(".strip-item.current").get_attribute("data-checkpoint") == "1"


def diagnostics_column(page, column: str) -> list[float | None]:
    index = ["layer", "head", *_columns(page)].index(column)
    values = page.locator("#diagnostics-table tbody tr").evaluate_all(
        f"rows => rows.map(r => r.cells[{index}].dataset.value ?? r.cells[{index}].textContent)"
    )
    return [None if value == "" else float(value) for value in values]


def _columns(page) -> list[str]:
    return page.locator("#diagnostics-table thead th").all_text_contents()[2:]


def check_diagnostics_sort(page, data: dict, column: str) -> None:
    """Clicking the header sorts ascending, clicking again descending; empty values last."""
    values = [row[column] for row in data["diagnostics"]["rows"]]
    known = sorted(float(v) for v in values if v is not None and math.isfinite(v))
    missing = [None] * (len(values) - len(known))
    header = page.locator("#diagnostics-table thead th").nth(["layer", "head", *_columns(page)].index(column))
    header.click()
    assert header.get_attribute("aria-sort") == "ascending"
    assert diagnostics_column(page, column) == known + missing
    header.click()
    assert header.get_attribute("aria-sort") == "descending"
    assert diagnostics_column(page, column) == known[::-1] + missing


def check_row_selects_head(page, data: dict, example: int, layer: int, head: int) -> None:
    """Clicking a diagnostics row selects its layer and head: the selectors and the weights follow."""
    page.select_option("#example-select", str(example))
    query = len(data["examples"][example]["query_tokens"]) - 1
    page.click(f'#query-column .token[data-index="{query}"]')  # pins the query
    page.mouse.move(0, 0)  # nothing hovered: the pinned query shows
    page.locator(f'#diagnostics-table tbody tr[data-layer="{layer}"][data-head="{head}"]').click()
    assert page.locator("#layer-select").input_value() == str(layer)
    assert page.locator("#head-select").input_value() == str(head)
    selected = page.locator("#diagnostics-table tbody tr.selected")
    assert selected.count() == 1
    assert (selected.get_attribute("data-layer"), selected.get_attribute("data-head")) == (
        str(layer),
        str(head),
    )
    checkpoint = int(page.locator("#checkpoint-slider").input_value())
    assert_shows(page, data, checkpoint, example, layer, head, query)


def _png(image: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(image)).convert("RGB"), dtype=np.int64)


def check_screenshot(page, data: dict) -> None:
    """The page is not blank, and the heatmap's pixels are the current head's weights over white."""
    pixels = _png(page.screenshot(full_page=True))
    colours, counts = np.unique(
        (pixels[..., 0] << 16) | (pixels[..., 1] << 8) | pixels[..., 2], return_counts=True
    )
    drawn = 1 - counts.max() / counts.sum()  # the share of pixels not in the background colour
    assert len(colours) > 50 and drawn > 0.02, f"page looks blank: {len(colours)} colours, {drawn:.1%} drawn"
    example = int(page.locator("#example-select").input_value())
    layer = int(page.locator("#layer-select").input_value())
    head = int(page.locator("#head-select").input_value())
    checkpoint = int(page.locator("#checkpoint-slider").input_value())
    weights = page_attention(data, checkpoint, example)[layer, head]  # (T, S)
    heatmap = page.locator("#heatmap")
    cell = heatmap.evaluate("canvas => canvas.width") // weights.shape[1]
    image = _png(heatmap.screenshot())[1:-1, 1:-1]  # inside the 1 px border
    centres = image[cell // 2 :: cell, cell // 2 :: cell][: weights.shape[0], : weights.shape[1]]  # (T, S, 3)
    expected = 255 - weights[..., None] * (255 - ACCENT)  # rgba(ACCENT, w) over white
    keep = np.ones(weights.shape, bool)
    keep[:, data["examples"][example]["marks"]] = False  # outlined columns
    if cell < 7:  # the selected query's 2 px outline reaches its cells' centres
        keep[int(page.locator("#query-column .token.selected").get_attribute("data-index"))] = False
    assert keep.any()
    assert np.abs(centres[keep] - expected[keep]).max() <= 2, "the heatmap does not show the weights"


# ---- The circuits view --------------------------------------------------------------------


def _numbers(values: list) -> list[float | None]:
    """The data-value texts of cells as numbers (None for an empty one)."""
    return [None if value == "" else float(value) for value in values]


def spectrum_rows(page) -> dict[tuple[str, int], tuple[float, list[float]]]:
    """{(matrix, head): (effective rank, singular values)} as the spectrum table shows them."""
    rows = page.locator("#spectrum-table tbody tr").evaluate_all(
        "rows => rows.map(r => [r.dataset.matrix, Number(r.dataset.head), "
        "r.querySelector('.rank').dataset.value, "
        "Array.from(r.querySelectorAll('.singular-value'), c => c.dataset.value)])"
    )
    return {(matrix, head): (float(rank), _numbers(values)) for matrix, head, rank, values in rows}


def check_spectra(page, data: dict, checkpoint: int, layer: int, head: int | str) -> None:
    """With (layer, head) and the checkpoint selected, the spectrum table shows exactly the data's
    singular values and effective ranks of that head (every head for "all"), and the plot a dot
    per positive value of the current checkpoint."""
    circuits = data["circuits"]
    select(page, 0, layer, head)
    set_checkpoint(page, data, checkpoint)
    heads = range(data["num_heads"]) if head == "all" else [head]
    expected = {
        (matrix, h): (
            circuits[matrix]["effective_rank"][checkpoint][layer][h],
            list(circuits[matrix]["values"][checkpoint][layer][h]),
        )
        for matrix in ("qk", "ov")
        if circuits[matrix] is not None
        for h in heads
    }
    assert spectrum_rows(page) == expected
    dots = sum(int(np.count_nonzero(np.asarray(values) > 0)) for _, values in expected.values())
    assert page.locator("#spectrum-plot circle").count() == dots
    if head != "all":
        text = page.locator("#effective-rank").inner_text()
        for matrix in ("qk", "ov"):
            if circuits[matrix] is not None:
                rank = circuits[matrix]["effective_rank"][checkpoint][layer][head]
                assert f"effective rank {float(f'{rank:.4g}'):g} of" in text, text


def check_composition(page, data: dict, checkpoint: int, mode: str) -> None:
    """At `checkpoint`, the composition table of `mode` holds exactly the data's scores of every
    earlier head into every later one; clicking a cell selects its later head."""
    scores = np.asarray(data["circuits"]["composition"][mode][checkpoint], np.float64)  # (L, N, L, N)
    set_checkpoint(page, data, checkpoint)
    page.check(f'input[name="composition-mode"][value="{mode}"]')
    cells = page.locator("#composition-table td[data-value]").evaluate_all(
        "cells => cells.map(c => [c.dataset.sourceLayer, c.dataset.sourceHead, c.dataset.targetLayer, "
        "c.dataset.targetHead, c.dataset.value].map(Number))"
    )
    layers, heads = scores.shape[:2]
    expected = [
        [l1, h1, l2, h2, scores[l1, h1, l2, h2]]
        for l1 in range(layers - 1)
        for h1 in range(heads)
        for l2 in range(1, layers)
        for h2 in range(heads)
        if l1 < l2
    ]
    assert cells == expected
    l1, h1, l2, h2, _ = expected[-1]
    page.locator(
        f'#composition-table td[data-source-layer="{l1}"][data-source-head="{h1}"]'
        f'[data-target-layer="{l2}"][data-target-head="{h2}"]'
    ).click()
    assert page.locator("#layer-select").input_value() == str(l2)
    assert page.locator("#head-select").input_value() == str(h2)


def check_patching(page, data: dict) -> None:
    """The heat map's cells are exactly the data's restored shares (empty for None), and its text
    names the prompts' answer and contrast; without patching, the page shows the note."""
    patching = data["circuits"]["patching"]
    if patching is None:
        assert page.locator("#patching-table").is_hidden()
        assert page.locator("#patching-text").inner_text() == data["circuits"]["patching_note"]
        return
    cells = page.locator("#patching-table td").evaluate_all(
        "cells => cells.map(c => [Number(c.dataset.layer), Number(c.dataset.head), c.dataset.value])"
    )
    layers, heads = len(patching["restored"]), len(patching["restored"][0])
    assert [(layer, head) for layer, head, _ in cells] == list(np.ndindex(layers, heads))
    assert _numbers([value for _, _, value in cells]) == [v for row in patching["restored"] for v in row]
    text = page.locator("#patching-text").inner_text()
    for key in ("answer", "contrast"):
        assert f'"{visible_token(patching[key])}"' in text, text


def visible_token(text: str) -> str:
    """A token as the page writes it: whitespace as visible symbols (run_page.js visibleToken)."""
    return text.replace(" ", "\u2423").replace("\n", "\u21b5").replace("\t", "\u21e5") or "\u2205"


def check_circuits(page, data: dict) -> None:
    """The circuits view against `data`: its notes, every head's spectra of the last layer at the
    last checkpoint and its last head's at the last and the first, each composition mode at the
    first checkpoint, and the patching heat map or note."""
    circuits = data["circuits"]
    assert page.locator("#circuit-notes li").all_inner_texts() == circuits["notes"]
    last, layer, head = len(data["checkpoints"]) - 1, len(data["layers"]) - 1, data["num_heads"] - 1
    if circuits["qk"] is not None or circuits["ov"] is not None:
        check_spectra(page, data, last, layer, "all")
        for checkpoint in sorted({last, 0}, reverse=True):  # ends on the head view's own selection
            check_spectra(page, data, checkpoint, layer, head)
    else:
        assert page.locator("#spectra").is_hidden()
    if circuits["composition"] is not None:
        for mode in ("Q", "K", "V"):
            check_composition(page, data, 0, mode)
    else:
        assert page.locator("#composition").is_hidden()
    check_patching(page, data)


def check_page(browser, path: str | pathlib.Path, data: dict) -> None:
    """Every check above on the page at `path`, built from `data`; the last example, layer and head."""
    check_no_external_references(path)
    example, layer, head = len(data["examples"]) - 1, len(data["layers"]) - 1, data["num_heads"] - 1
    num_queries = len(data["examples"][example]["query_tokens"])
    with open_page(browser, path) as page:
        for checkpoint in sorted({0, len(data["checkpoints"]) - 1}):
            check_hover(page, data, checkpoint, example, layer, head, num_queries // 2)
        if len(data["checkpoints"]) > 1:
            changed = [
                q
                for q in range(num_queries)
                if not np.array_equal(*(page_attention(data, c, example)[layer, head, q] for c in (0, 1)))
            ]
            assert changed, "checkpoints 0 and 1 show the same weights for every query"
            check_slider(page, data, example, layer, head, changed[-1])
        for column in data["diagnostics"]["columns"]:
            check_diagnostics_sort(page, data, column)
        if data["diagnostics"]["rows"]:
            row = data["diagnostics"]["rows"][0]
            check_row_selects_head(page, data, 0, row["layer"], row["head"])
        if "circuits" in data:
            check_circuits(page, data)
        check_screenshot(page, data)
