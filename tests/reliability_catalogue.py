"""Renders docs/reliability.md from the tests marked `reliability(area, case, behaviour)`, and the
launcher fuzzer's recorded run (docs/launcher_fuzz.json, written by tests/launchers/test_launcher_fuzz.py).

Regenerate: python -m docs.generate reliability
"""

import json
import pathlib

FUZZ_RECORD = pathlib.Path(__file__).resolve().parents[1] / "docs" / "launcher_fuzz.json"

AREAS = (
    "Config and command line",
    "Attention inputs",
    "Modules",
    "Training",
    "Checkpoints",
    "Preemption",
    "Concurrency",
    "Shared workdirs",
    "Damaged workdir files",
    "Memory",
    "Disk",
    "Finished runs",
    "Sweeps",
    "Determinism",
    "Pretrained checkpoints",
    "Decoding",
)

HEADER = """# Reliability

What qkv_jax does with bad input, killed runs, corrupt checkpoints and awkward
numerics, and the test that proves each case. This file is generated from the
tests' `@pytest.mark.reliability(area, case, behaviour)` marks by
`python -m docs.generate reliability`; `tests/launchers/test_reliability.py` fails when it
is out of date. Every test listed runs in CI.
"""


def rows(cases: list[dict]) -> list[dict]:
    """One row per (area, case, behaviour); variants of one case (dtypes, say) share a row."""
    grouped: dict[tuple, set] = {}
    for c in cases:
        grouped.setdefault((c["area"], c["case"], c["behaviour"]), set()).add(c["test"])
    return [{"area": a, "case": c, "behaviour": b, "tests": sorted(t)} for (a, c, b), t in grouped.items()]


def fuzz_summary(record: dict) -> list[str]:
    """The launcher fuzzer's recorded run, as a paragraph."""
    codes = ", ".join(f"{count:,} exit {code}" for code, count in record["exit_codes"].items())
    return [
        "## The launcher, fuzzed",
        "",
        f"`tests/launchers/test_launcher_fuzz.py` at {record['cases']:,} cases (seed {record['seed']}, "
        f"{record['seconds']:.0f} s on {record['machine']}): {codes}; {record['tracebacks']} tracebacks; "
        f"{record['distinct_error_lines']:,} distinct error lines of {record['distinct_error_kinds']} kinds. "
        "Recorded by `QKV_JAX_FUZZ_CASES=20000 QKV_JAX_FUZZ_RECORD=docs/launcher_fuzz.json python -m pytest "
        "-p no:xdist tests/launchers/test_launcher_fuzz.py -k 'fuzzed_command_lines and not subprocess'`; "
        "every CI run "
        f"runs {record['default_cases']:,} cases with a new seed.",
        "",
    ]


def render(cases: list[dict]) -> str:
    """The catalogue as markdown, grouped by area in a fixed order, then the fuzzer's recorded run."""
    unknown = sorted({c["area"] for c in cases} - set(AREAS))
    if unknown:
        raise ValueError(f"unknown reliability areas {unknown}; add them to AREAS")
    table = rows(cases)
    lines = [HEADER, f"{len(table)} cases.", ""]
    number = 0
    for area in AREAS:
        chosen = sorted((r for r in table if r["area"] == area), key=lambda r: (r["tests"], r["case"]))
        if not chosen:
            continue
        lines += [f"## {area}", "", "| # | case | behaviour | test |", "|---|---|---|---|"]
        for row in chosen:
            number += 1
            tests = "<br>".join(f"`{t}`" for t in row["tests"])
            lines.append(f"| {number} | {row['case']} | {row['behaviour']} | {tests} |")
        lines.append("")
    if FUZZ_RECORD.exists():
        lines += fuzz_summary(json.loads(FUZZ_RECORD.read_text()))
    return "\n".join(lines)
