"""One table from benchmarks/gpu_check.sh's outputs: what passed, what failed (by name), and
every attention option's time against cuDNN's plain causal time and the peers' for that option.
Reads only what the check wrote; a step cut off at its limit shows what it had done.

    python benchmarks/gpu_summary.py OUT_DIR     # prints Markdown (gpu_check.sh saves it)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def _json_lines(path: Path, prefix: str = "") -> list[dict]:
    """The JSON objects a program printed one a line (after `prefix`), as far as it got."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            if line.startswith(prefix + "{"):
                try:
                    rows.append(json.loads(line[len(prefix) :]))
                except json.JSONDecodeError:
                    pass
    return rows


def tests_row(path: Path, name: str) -> str:
    """`| name | result | failures |` from a pytest log, finished or cut off."""
    if not path.exists():
        return f"| {name} | not run | |"
    text = path.read_text()
    failed = sorted(set(re.findall(r"(?:FAILED|ERROR) (tests/\S+)", text)))
    final = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$", text, re.MULTILINE)
    if final:
        result = final[-1]
    else:
        done = len(re.findall(r"\b(?:PASSED|FAILED|SKIPPED|ERROR) tests/", text))
        result = f"cut off at its limit after {done} tests"
    return f"| {name} | {result} | {', '.join(failed) or '-'} |"


def check_row(path: Path, name: str) -> str:
    """`| name | n of m pass | failed cases |` from a check's PASS/FAIL lines."""
    rows = _json_lines(path, "PASS ") + _json_lines(path, "FAIL ")
    if not rows:
        return f"| {name} | not run | |"
    failed = [f"{row['case']} ({row.get('error') or row.get('errors')})" for row in rows if not row["ok"]]
    passed = f"{len(rows) - len(failed)} of {len(rows)} match the reference"
    return f"| {name} | {passed} | {'; '.join(failed) or '-'} |"


def timing_table(path: Path) -> list[str]:
    """Every option's forward and forward + backward ms, with the latter over cuDNN's plain
    causal time and over torch flex_attention's time for the same option."""
    rows = [row for row in _json_lines(path) if "train_ms" in row]
    if not rows:
        return ["(no timings)"]
    by = {(row["name"], row["option"], row["dtype"]): row for row in rows}
    cudnn = by.get(("jax.nn[cudnn]", "causal", "bfloat16"), {}).get("train_ms")
    lines = [
        "| path | option | dtype | fwd ms | fwd+bwd ms | / cuDNN plain causal | / flex same option |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        flex = by.get(("torch.flex_attention(compiled)", row["option"], row["dtype"]), {}).get("train_ms")
        over_cudnn = f"{row['train_ms'] / cudnn:.2f}" if cudnn else "-"
        over_flex = f"{row['train_ms'] / flex:.2f}" if flex else "-"
        lines.append(
            f"| {row['name']} | {row['option']} | {row['dtype']} | {row['forward_ms']:.3f} | "
            f"{row['train_ms']:.3f} | {over_cudnn} | {over_flex} |"
        )
    return lines


def main(out: Path) -> None:
    print("| step | result | failures |")
    print("|---|---|---|")
    print(tests_row(out / "pytest.txt", "fast tier on the GPU"))
    print(tests_row(out / "pytest_peers.txt", "jax.nn's attention tests"))
    print(check_row(out / "kernel_check.txt", "Pallas kernel vs reference"))
    print(check_row(out / "cudnn_check.txt", "cuDNN cases vs reference"))
    print()
    print("\n".join(timing_table(out / "probe.txt")))
    lm = out / "lm_gpu.txt"
    if lm.exists():
        print()
        print("\n".join(line for line in lm.read_text().splitlines() if line.startswith(("|", "Device"))))
    environment = out / "environment.txt"
    if environment.exists():
        print()
        print("Environment: " + "; ".join(environment.read_text().splitlines()[-3:]))


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        raise SystemExit("usage: python benchmarks/gpu_summary.py OUT_DIR")
    main(Path(sys.argv[1]))
