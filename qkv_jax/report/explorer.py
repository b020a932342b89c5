"""Self-contained HTML pages for exploring a run's attention and a sweep's results.

`write_run_page(path, data)` writes one HTML file (inline CSS and JS, nothing
fetched, opens from disk) with a head view (hover or click a query token to
see where one head, or every head, sends it), a checkpoint slider and a strip
of the selected head at every checkpoint, a sortable head-diagnostics table
whose rows select a head, the loss curves (SVG, log-y toggle) and the config.
`write_sweep_page(path, rows, metric, link_for_cell)` writes a sweep's
results table, sortable, each cell linking to its run's page.

The run page's `data` (checked by `validate_run_data`, which raises a
ValueError naming the bad key):

    title: str
    subtitle: str                       e.g. "checkpoint step 2000"
    config: dict                        the run's config (JSON-able), shown as a tree
    curves: {name: [[step, value], ...]}  loss curves; non-finite values are left out
    layers: [str]                       layer names, e.g. ["block 0", "block 1"]
    num_heads: int
    examples: [{"name": str,
                "query_tokens": [str],  T labels (the last T of the S key positions)
                "key_tokens": [str],    S labels
                "marks": [int]}]        key positions to mark (e.g. the flag); may be empty
    checkpoints: [{"step": int,
                   "attention": [num_examples][num_layers][num_heads][T][S] floats in [0, 1]}]
                                        T and S are per example; a list of arrays, one per
                                        example, or one array when every example has the same
    diagnostics: {"columns": [str],
                  "rows": [{"layer": int, "head": int, <column>: float | None, ...}],
                  "labels": {<column>: str}}  optional: what a None shows as in that
                                        column (e.g. "full" for a global layer's window);
                                        elsewhere None shows empty. None sorts last.
    notes: [str]                        shown at the top, e.g. "6 of 11 checkpoints shown"
    circuits: {                         optional (`qkv_jax.report.circuits.circuit_data`); C is
                                        len(checkpoints), L len(layers), N num_heads
        "notes": [str],                 what the view covers for this model, what it leaves out
        "qk": {"label": str,            e.g. "W_QK = W_Q W_K^T"; or None: not defined
               "values": [C][L][N][k],  singular values, finite, >= 0 (k the same for all)
               "effective_rank": [C][L][N]} in [1, k]
        "ov": the same for W_OV (its own k), or None
        "composition": {"Q" | "K" | "V": [C][L][N][L][N] in [0, 1]} or None
        "patching": {"step": int,       the checkpoint patched (the newest)
                     "clean": [str], "corrupted": [str],  token labels, the same length
                     "answer": str, "contrast": str,       the two tokens compared
                     "clean_difference": float, "corrupted_difference": float,
                                        logit(answer) - logit(contrast) at the last position
                     "restored": [L][N] float | None}     the share of that difference each
                                        head's clean output restores in the corrupted run
                    or None, and then
        "patching_note": str}           says why there is no heat map, or how to get one

Attention weights travel quantised to uint8 (`round(weight * 255)`), base64
per checkpoint and example, so 3 examples of 64 tokens, 2 layers, 4 heads and
11 checkpoints make a page of about 1.5 MB. The page shows `q / 255`;
`page_attention` returns those same numbers on the Python side.
"""

from __future__ import annotations

import base64
import html
import json
import math
import pathlib
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import numpy as np

from qkv_jax.training.workdir import write_atomic

__all__ = [
    "LEVELS",
    "decode_attention",
    "encode_attention",
    "page_attention",
    "validate_run_data",
    "write_run_page",
    "write_sweep_page",
    "swept_fields",
    "format_value",
]

# Attention weights are stored as round(weight * LEVELS) in one byte.
LEVELS = 255
# Weights outside [0, 1] by more than this are an error; within it they are clipped (float32 softmax).
_TOLERANCE = 1e-3
_RUN_KEYS: dict[str, tuple[type, ...]] = {
    "title": (str,),
    "subtitle": (str,),
    "config": (dict,),
    "curves": (dict,),
    "layers": (list,),
    "num_heads": (int, np.integer),
    "examples": (list,),
    "checkpoints": (list,),
    "diagnostics": (dict,),
    "notes": (list,),
}


def encode_attention(weights: Any) -> str:
    """Base64 of the weights `[...]` in [0, 1] quantised to uint8 (C order)."""
    quantised = np.rint(np.clip(np.asarray(weights, np.float64), 0.0, 1.0) * LEVELS).astype(np.uint8)
    return base64.b64encode(quantised.tobytes()).decode("ascii")


def decode_attention(blob: str, shape: Sequence[int]) -> np.ndarray:
    """The weights `shape` that `blob` (from `encode_attention`) holds, as the page shows them: q / 255."""
    quantised = np.frombuffer(base64.b64decode(blob), np.uint8)
    return quantised.reshape(tuple(shape)).astype(np.float64) / LEVELS


def page_attention(data: dict, checkpoint: int, example: int) -> np.ndarray:
    """The weights `[num_layers, num_heads, T, S]` the page shows for one checkpoint and example."""
    tokens = data["examples"][example]
    shape = (len(data["layers"]), data["num_heads"], len(tokens["query_tokens"]), len(tokens["key_tokens"]))
    weights = np.asarray(data["checkpoints"][checkpoint]["attention"][example], np.float64)
    return decode_attention(encode_attention(weights), shape)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _check_examples(examples: list) -> None:
    for e, example in enumerate(examples):
        where = f"data['examples'][{e}]"
        if not isinstance(example, dict):
            raise ValueError(f"{where}: expected a dict, got {type(example).__name__}")
        for key in ("name", "query_tokens", "key_tokens", "marks"):
            if key not in example:
                raise ValueError(f"{where}: missing key {key!r}")
        if not isinstance(example["name"], str):
            raise ValueError(f"{where}['name']: expected a str, got {example['name']!r}")
        for key in ("query_tokens", "key_tokens"):
            tokens = example[key]
            if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
                raise ValueError(f"{where}[{key!r}]: expected a non-empty list of str")
        num_queries, num_keys = len(example["query_tokens"]), len(example["key_tokens"])
        if num_queries > num_keys:
            raise ValueError(f"{where}: {num_queries} query tokens but only {num_keys} key tokens")
        for mark in example["marks"]:
            if not isinstance(mark, (int, np.integer)) or not 0 <= mark < num_keys:
                raise ValueError(f"{where}['marks']: {mark!r} is not a key position in [0, {num_keys})")


def _check_checkpoints(data: dict) -> None:
    if not data["checkpoints"]:
        raise ValueError("data['checkpoints']: at least one checkpoint is needed")
    for c, checkpoint in enumerate(data["checkpoints"]):
        where = f"data['checkpoints'][{c}]"
        if not isinstance(checkpoint, dict) or not {"step", "attention"} <= checkpoint.keys():
            raise ValueError(f"{where}: expected a dict with keys 'step' and 'attention'")
        if not isinstance(checkpoint["step"], (int, np.integer)):
            raise ValueError(f"{where}['step']: expected an int, got {checkpoint['step']!r}")
        if len(checkpoint["attention"]) != len(data["examples"]):
            raise ValueError(
                f"{where}['attention']: {len(checkpoint['attention'])} examples, "
                f"data['examples'] has {len(data['examples'])}"
            )
        for e, example in enumerate(data["examples"]):
            weights = np.asarray(checkpoint["attention"][e], np.float64)
            expected = (
                len(data["layers"]),
                data["num_heads"],
                len(example["query_tokens"]),
                len(example["key_tokens"]),
            )
            if weights.shape != expected:
                raise ValueError(
                    f"{where}['attention'][{e}]: shape {weights.shape}, expected "
                    f"[num_layers, num_heads, T, S] = {expected}"
                )
            if (
                not np.all(np.isfinite(weights))
                or weights.min() < -_TOLERANCE
                or weights.max() > 1 + _TOLERANCE
            ):
                raise ValueError(f"{where}['attention'][{e}]: weights must be finite and in [0, 1]")


def _check_curves(curves: dict) -> None:
    for name, points in curves.items():
        if not isinstance(name, str):
            raise ValueError(f"data['curves']: curve names must be str, got {name!r}")
        for point in points:
            if len(point) != 2 or not all(_is_number(v) for v in point):
                raise ValueError(
                    f"data['curves'][{name!r}]: {point!r} is not a [step, value] pair of numbers"
                )


def _check_diagnostics(data: dict) -> None:
    diagnostics = data["diagnostics"]
    columns = diagnostics.get("columns")
    if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
        raise ValueError("data['diagnostics']['columns']: expected a list of str")
    if not isinstance(diagnostics.get("rows"), list):
        raise ValueError("data['diagnostics']['rows']: expected a list of dicts")
    for r, row in enumerate(diagnostics["rows"]):
        where = f"data['diagnostics']['rows'][{r}]"
        for key, size in (("layer", len(data["layers"])), ("head", data["num_heads"])):
            if not isinstance(row.get(key), (int, np.integer)) or not 0 <= row[key] < size:
                raise ValueError(f"{where}[{key!r}]: {row.get(key)!r} is not in [0, {size})")
        for column in columns:
            if column not in row:
                raise ValueError(f"{where}: missing column {column!r}")
            if row[column] is not None and not _is_number(row[column]):
                raise ValueError(f"{where}[{column!r}]: expected a number or None, got {row[column]!r}")
    labels = diagnostics.get("labels", {})
    if not isinstance(labels, dict) or not all(
        column in columns and isinstance(label, str) for column, label in labels.items()
    ):
        raise ValueError(
            f"data['diagnostics']['labels']: expected {{column: str}} over the columns, got {labels!r}"
        )


def _check_numbers(value: Any, where: str, shape: tuple[int | None, ...], low: float, high: float) -> None:
    """`value` holds finite numbers in [low, high] (within _TOLERANCE) of `shape` (None: any size)."""
    try:
        array = np.asarray(value, np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected a nested list of numbers of shape {shape}") from None
    if array.ndim != len(shape) or any(n not in (None, m) for n, m in zip(shape, array.shape, strict=True)):
        raise ValueError(f"{where}: shape {array.shape}, expected {shape}")
    if not np.all(np.isfinite(array)) or array.min() < low - _TOLERANCE or array.max() > high + _TOLERANCE:
        raise ValueError(f"{where}: values must be finite and in [{low}, {high}]")


def _check_spectrum(spectrum: Any, where: str, heads: tuple[int, int, int]) -> None:
    """A `qk` or `ov` entry: label, values [C][L][N][k] >= 0 and effective ranks in [1, k]."""
    if not isinstance(spectrum, dict) or set(spectrum) != {"label", "values", "effective_rank"}:
        raise ValueError(f"{where}: expected None or a dict with keys 'label', 'values', 'effective_rank'")
    if not isinstance(spectrum["label"], str):
        raise ValueError(f"{where}['label']: expected a str, got {spectrum['label']!r}")
    _check_numbers(spectrum["values"], f"{where}['values']", (*heads, None), 0.0, math.inf)
    rank = np.asarray(spectrum["values"]).shape[-1]
    _check_numbers(spectrum["effective_rank"], f"{where}['effective_rank']", heads, 1.0, rank)


def _check_patching(patching: Any, shape: tuple[int, int]) -> None:
    where = "data['circuits']['patching']"
    keys = ("step", "clean", "corrupted", "answer", "contrast", "clean_difference", "corrupted_difference")
    if not isinstance(patching, dict) or set(patching) != {*keys, "restored"}:
        raise ValueError(f"{where}: expected None or a dict with keys {[*keys, 'restored']}")
    if not isinstance(patching["step"], (int, np.integer)):
        raise ValueError(f"{where}['step']: expected an int, got {patching['step']!r}")
    for key in ("clean", "corrupted"):
        tokens = patching[key]
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise ValueError(f"{where}[{key!r}]: expected a non-empty list of str")
    if len(patching["clean"]) != len(patching["corrupted"]):
        raise ValueError(
            f"{where}: {len(patching['clean'])} clean tokens but {len(patching['corrupted'])} corrupted ones"
        )
    for key in ("answer", "contrast"):
        if not isinstance(patching[key], str):
            raise ValueError(f"{where}[{key!r}]: expected a str, got {patching[key]!r}")
    for key in ("clean_difference", "corrupted_difference"):
        if not _is_number(patching[key]) or not math.isfinite(patching[key]):
            raise ValueError(f"{where}[{key!r}]: expected a finite number, got {patching[key]!r}")
    try:  # None (a share that is not a number) travels as null and shows empty
        restored = np.asarray([[math.nan if v is None else v for v in row] for row in patching["restored"]])
        numeric = restored.astype(np.float64).shape == shape
    except (TypeError, ValueError):
        numeric = False
    if not numeric:
        raise ValueError(
            f"{where}['restored']: expected [num_layers][num_heads] = {list(shape)} numbers or None"
        )


def _check_circuits(data: dict) -> None:
    circuits = data["circuits"]
    where = "data['circuits']"
    keys = {"notes", "qk", "ov", "composition", "patching", "patching_note"}
    if not isinstance(circuits, dict) or set(circuits) != keys:
        raise ValueError(f"{where}: expected a dict with keys {sorted(keys)}")
    if not isinstance(circuits["notes"], list) or not all(isinstance(n, str) for n in circuits["notes"]):
        raise ValueError(f"{where}['notes']: expected a list of str")
    if not isinstance(circuits["patching_note"], str):
        raise ValueError(f"{where}['patching_note']: expected a str")
    heads = (len(data["checkpoints"]), len(data["layers"]), data["num_heads"])
    for name in ("qk", "ov"):
        if circuits[name] is not None:
            _check_spectrum(circuits[name], f"{where}[{name!r}]", heads)
    composition = circuits["composition"]
    if composition is not None:
        if not isinstance(composition, dict) or set(composition) != {"Q", "K", "V"}:
            raise ValueError(f"{where}['composition']: expected None or a dict with keys 'Q', 'K', 'V'")
        for mode, scores in composition.items():
            _check_numbers(scores, f"{where}['composition'][{mode!r}]", (*heads, *heads[1:]), 0.0, 1.0)
    if circuits["patching"] is not None:
        _check_patching(circuits["patching"], heads[1:])


def validate_run_data(data: dict) -> None:
    """Raises ValueError, naming the key, when `data` does not follow the module docstring's schema."""
    if not isinstance(data, dict):
        raise ValueError(f"data: expected a dict, got {type(data).__name__}")
    for key, kinds in _RUN_KEYS.items():
        if key not in data:
            raise ValueError(f"data: missing key {key!r}")
        if not isinstance(data[key], kinds) or isinstance(data[key], bool):
            raise ValueError(f"data[{key!r}]: expected {kinds[0].__name__}, got {type(data[key]).__name__}")
    if data["num_heads"] < 1:
        raise ValueError(f"data['num_heads']: expected at least 1, got {data['num_heads']}")
    if not data["layers"] or not all(isinstance(name, str) for name in data["layers"]):
        raise ValueError("data['layers']: expected a non-empty list of str")
    if not data["examples"]:
        raise ValueError("data['examples']: at least one example is needed")
    if not all(isinstance(note, str) for note in data["notes"]):
        raise ValueError("data['notes']: expected a list of str")
    _check_examples(data["examples"])
    _check_checkpoints(data)
    _check_curves(data["curves"])
    _check_diagnostics(data)
    if "circuits" in data:
        _check_circuits(data)


def _plain(value: Any) -> Any:
    """`value` as JSON: numpy scalars as Python numbers, non-finite floats as None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


def _payload(data: dict) -> dict:
    """What the page's script reads: `data` with the attention encoded."""
    payload = {key: _plain(data[key]) for key in _RUN_KEYS if key != "checkpoints"}
    payload["circuits"] = _plain(data["circuits"]) if "circuits" in data else None
    payload["levels"] = LEVELS
    payload["checkpoints"] = [
        {"step": int(c["step"]), "attention": [encode_attention(weights) for weights in c["attention"]]}
        for c in data["checkpoints"]
    ]
    return payload


def _script_json(value: Any) -> str:
    """JSON to embed in a <script> element. '<', '>', '&', '/' and '=' only occur inside JSON
    strings, so escaping them everywhere keeps '</script>', URLs and 'src=' out of the page."""
    text = json.dumps(value, allow_nan=False, separators=(",", ":"))
    for char, escape in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("/", "\\/"),
        ("=", "\\u003d"),
    ):
        text = text.replace(char, escape)
    return text


def _text(value: Any) -> str:
    """HTML text or attribute value; '/' and '=' escaped too, so no URL or 'src=' appears literally."""
    return html.escape(str(value)).replace("/", "&#47;").replace("=", "&#61;")


def _asset(name: str) -> str:
    return resources.files("qkv_jax.report").joinpath("explorer_assets", name).read_text(encoding="utf-8")


def _document(title: str, body: str, scripts: Sequence[str]) -> str:
    script_tags = "".join(f"<script>\n{script}\n</script>\n" for script in scripts)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{_text(title)}</title>\n"
        f"<style>\n{_asset('explorer.css')}\n</style>\n</head>\n<body>\n{body}\n{script_tags}</body>\n</html>\n"
    )


def write_run_page(path: str | pathlib.Path, data: dict) -> pathlib.Path:
    """Writes the run explorer for `data` (schema in the module docstring) to `path`; returns the path."""
    validate_run_data(data)
    payload = f'<script type="application/json" id="run-data">{_script_json(_payload(data))}</script>'
    page = _document(
        data["title"],
        _asset("run_page.html") + payload,
        [_asset("sortable_table.js"), _asset("run_page.js")],
    )
    path = pathlib.Path(path)
    write_atomic(path, lambda f: f.write(page))  # a browser or copy never sees half a page
    return path


def _relative_link(link: Any, cell: dict) -> str | None:
    if link is None:
        return None
    link = str(link)
    if "://" in link or link.startswith(("/", "\\")) or ":" in link.split("/")[0]:
        raise ValueError(f"link_for_cell: {link!r} for cell {cell!r} is not a relative link")
    return link


def swept_fields(rows: list[dict]) -> list[str]:
    """The fields the rows' cells set, in first-seen order."""
    fields: list[str] = []
    for row in rows:
        fields += [f for f in row["cell"] if f not in fields]
    return fields


def format_value(value: Any) -> str:
    """A table entry: floats to 4 significant digits."""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def _stats_cell(stats: dict | None) -> tuple[str, Any]:
    """The text of a `mean ± std [min, max]` cell and its sort value ('' sorts last)."""
    if stats is None:
        return "-", ""
    mean, std, low, high = (format_value(stats[key]) for key in ("mean", "std", "min", "max"))
    text = f"{mean} ± {std} [{low}, {high}]"
    return text, stats["mean"] if _is_number(stats["mean"]) and math.isfinite(stats["mean"]) else ""


def _sweep_row(row: dict, fields: list[str], columns: list[str], link: str | None) -> str:
    """One <tr> of the sweep table, each entry linked to `link`. A cell's data-value is what it
    sorts by: a number, or '' (sorts last); without one it sorts by its text."""

    def cell(text: str, value: Any = None) -> str:
        shown = f'<a href="{_text(link)}">{_text(text)}</a>' if link and text else _text(text)
        sort_value = "" if value is None else f' data-value="{_text(value)}"'
        return f"<td{sort_value}>{shown}</td>"

    values = [row["cell"].get(field, "") for field in fields]
    cells = [cell(format_value(value), value if _is_number(value) else None) for value in values]
    if row["status"] != "done":
        cells += [cell(f"{row['status']}: {row.get('reason', '')}", "")] + ["<td></td>"] * (len(columns) + 1)
    else:
        cells += [cell(*_stats_cell(row.get(f"{column}_stats"))) for column in columns]
        cells += [cell(str(len(row["seeds"])), len(row["seeds"]))]
        cells += [cell(f"{row['wall_time_s']:.1f}", row["wall_time_s"])]
    return "<tr>" + "".join(cells) + "</tr>"


def write_sweep_page(
    path: str | pathlib.Path,
    rows: list[dict],
    metric: str,
    link_for_cell: Callable[[dict], str | None],
    *,
    extra: Sequence[str] = (),
) -> pathlib.Path:
    """Writes a `results.html`-style page: a sweep's results table (as
    the checkout's `studies.results.results_table`), sortable by any column, each cell's entries
    linking to its run's page.

    `rows` are a sweep's result rows (done, skipped or failed); `link_for_cell` maps a
    row's cell (its dict of overrides) to a relative link, or None for no page.
    Returns the path."""
    fields, columns = swept_fields(rows), [metric, *extra]
    header = fields + [f"{c} mean ± std [min, max]" for c in columns] + ["seeds", "time (s)"]
    body = []
    for row in rows:
        link = _relative_link(link_for_cell(row["cell"]), row["cell"])
        body.append(_sweep_row(row, fields, columns, link))
    table = (
        '<table id="results" class="sortable"><thead><tr>'
        + "".join(f'<th scope="col">{_text(h)}</th>' for h in header)
        + "</tr></thead><tbody>\n"
        + "\n".join(body)
        + "\n</tbody></table>"
    )
    heading = f"<h1>Sweep results</h1>\n<p>Metric: {_text(metric)}. Click a column header to sort.</p>\n"
    page = _document(
        f"Sweep results: {metric}",
        f"<main>\n{heading}{table}\n</main>",
        [_asset("sortable_table.js"), 'makeSortable(document.getElementById("results"));'],
    )
    path = pathlib.Path(path)
    write_atomic(path, lambda f: f.write(page))  # a browser or copy never sees half a page
    return path
