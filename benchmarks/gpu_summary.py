"""One table from benchmarks/gpu_check.sh's outputs: what passed, what failed (by name), and
every attention option's time against cuDNN's plain causal time and the peers' for that option.
Reads only what the check wrote; a step cut off at its limit shows what it had done.

    python benchmarks/gpu_summary.py OUT_DIR [--write]   # prints Markdown; --write also writes
                                                         # benchmarks/results/gpu_check_gpu.json
    python benchmarks/gpu_summary.py OUT_DIR --record    # qkv_jax/attention/gpu_checked.py from
                                                         # the checks' logs (the dispatch reads it)
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
    # pytest -v names a test before its outcome, and under xdist after it (ids may hold spaces).
    after = re.findall(r"(?:PASSED|FAILED|SKIPPED|ERROR) (tests/.+?)\s*$", text, re.MULTILINE)
    before = re.findall(r"^(tests/.+?) (?:PASSED|FAILED|SKIPPED|ERROR)\b", text, re.MULTILINE)
    failed = sorted(
        set(re.findall(r"(?:FAILED|ERROR) (tests/.+?)\s*$", text, re.MULTILINE))
        | set(re.findall(r"^(tests/.+?) (?:FAILED|ERROR)\b", text, re.MULTILINE))
    )
    final = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$", text, re.MULTILINE)
    if final:
        result = final[-1]
    else:
        done = len(after) + len(before)
        last = (text.strip().splitlines() or ["an empty log"])[-1][:200]
        result = f"cut off at its limit after {done} tests" if done else f"did not run: {last}"
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


def ratios(path: Path) -> dict[str, float]:
    """Each path's forward + backward time over cuDNN's plain causal time and over flex_attention's
    for the same option, by `path/option/dtype`."""
    rows = [row for row in _json_lines(path) if "train_ms" in row]
    by = {(row["name"], row["option"], row["dtype"]): row["train_ms"] for row in rows}
    cudnn = by.get(("jax.nn[cudnn]", "causal", "bfloat16"))
    result = {}
    for (name, option, dtype), ms in by.items():
        if cudnn:
            result[f"{name}/{option}/{dtype}/over_cudnn_plain_causal"] = ms / cudnn
        flex = by.get(("torch.flex_attention(compiled)", option, dtype))
        if flex and not name.startswith("torch"):
            result[f"{name}/{option}/{dtype}/over_flex"] = ms / flex
    return result


def summary(out: Path) -> list[str]:
    lines = [
        "| step | result | failures |",
        "|---|---|---|",
        tests_row(out / "pytest.txt", "fast tier on the GPU"),
        tests_row(out / "pytest_peers.txt", "jax.nn's attention tests"),
        tests_row(out / "pytest_pallas.txt", "Pallas kernels' tests (all)"),
        check_row(out / "kernel_check.txt", "Pallas kernel vs reference"),
        check_row(out / "cudnn_check.txt", "cuDNN cases vs reference"),
        "",
        "Attention at B4 T4096 N16 H128 (float32: H64), ms per call, forward and forward plus backward:",
        "",
        *timing_table(out / "probe.txt"),
    ]
    lm = out / "lm_gpu.txt"
    if lm.exists():
        lines += ["", *(line for line in lm.read_text().splitlines() if line.startswith(("|", "Device")))]
    generate = out / "generate_gpu.txt"  # benchmarks/gpu_generate.py
    if generate.exists():
        kept = ("|", "Device", "Greedy")  # with the blank line that opens its table
        text = generate.read_text().splitlines()
        lines += ["", *(line for line in text if line.startswith(kept) or not line)]
    return lines


def main(out: Path, write: bool) -> None:
    lines = summary(out)
    print("\n".join(lines))
    if write:  # benchmarks/results/gpu_check_gpu.json, for docs/benchmarks.md's GPU section
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import jax

        from benchmarks.common import write_results

        path = write_results(
            "gpu_check_gpu",
            "bash benchmarks/gpu_check.sh",
            {
                "title": "The GPU check (benchmarks/gpu_check.sh)",
                "device": str(jax.devices()[0].device_kind),
                "table": lines,
                "ratios": ratios(out / "probe.txt"),
            },
        )
        print(f"wrote {path}")


RECORD = Path(__file__).resolve().parents[1] / "qkv_jax" / "attention" / "gpu_checked.py"


def record(out: Path) -> dict:
    """What each check showed, by kernel: its passed and failed case names, and the jax version,
    device and date of the run (from the check's own JSON), for the dispatch rule."""
    checked = {}
    for kernel, name in (("cudnn", "cudnn_check"), ("pallas", "kernel_check")):
        rows = _json_lines(out / f"{name}.txt", "PASS ") + _json_lines(out / f"{name}.txt", "FAIL ")
        if not rows:
            continue
        meta = json.loads((out / f"{name}.json").read_text()) if (out / f"{name}.json").exists() else {}
        environment = (out / "environment.txt").read_text() if (out / "environment.txt").exists() else ""
        jax_version = re.search(r"^jax (\S+)", environment, re.MULTILINE)
        checked[kernel] = {
            "jax": jax_version[1] if jax_version else meta.get("jax", "unknown"),
            "device": meta.get("device", "unknown"),
            "date": meta.get("date", "unknown"),
            "passed": sorted(row["case"] for row in rows if row["ok"]),
            "failed": sorted(row["case"] for row in rows if not row["ok"]),
        }
    return checked


def write_record(out: Path) -> None:
    text = RECORD.read_text()
    head = text[: text.index("CHECKED: dict[str, dict] = ")]
    body = json.dumps(record(out), indent=4, sort_keys=True)
    RECORD.write_text(f"{head}CHECKED: dict[str, dict] = {body}\n")
    print(f"wrote {RECORD}")


if __name__ == "__main__":
    flags = {"--write", "--record"}
    arguments = [a for a in sys.argv[1:] if a not in flags]
    if len(arguments) != 1 or not Path(arguments[0]).is_dir():
        raise SystemExit("usage: python benchmarks/gpu_summary.py OUT_DIR [--write] [--record]")
    if "--record" in sys.argv:
        write_record(Path(arguments[0]))
    else:
        main(Path(arguments[0]), "--write" in sys.argv)
