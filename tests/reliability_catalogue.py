"""Renders docs/reliability.md from the tests marked `reliability(area, case, behaviour)`.

Regenerate: python -m docs.generate reliability
"""

AREAS = (
    "Config and command line",
    "Attention inputs",
    "Modules",
    "Training",
    "Checkpoints",
    "Preemption",
    "Concurrency",
    "Memory",
    "Disk",
    "Finished runs",
    "Sweeps",
    "Determinism",
    "Decoding",
)

HEADER = """# Reliability

What qkv_jax does with bad input, killed runs, corrupt checkpoints and awkward
numerics, and the test that proves each case. This file is generated from the
tests' `@pytest.mark.reliability(area, case, behaviour)` marks by
`python -m docs.generate reliability`; `tests/test_reliability.py` fails when it
is out of date. Every test listed runs in CI.
"""


def rows(cases: list[dict]) -> list[dict]:
    """One row per (area, case, behaviour); variants of one case (dtypes, say) share a row."""
    grouped: dict[tuple, set] = {}
    for c in cases:
        grouped.setdefault((c["area"], c["case"], c["behaviour"]), set()).add(c["test"])
    return [{"area": a, "case": c, "behaviour": b, "tests": sorted(t)} for (a, c, b), t in grouped.items()]


def render(cases: list[dict]) -> str:
    """The catalogue as markdown, grouped by area in a fixed order."""
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
    return "\n".join(lines)
