r"""The flag-retrieval job: our launcher against the same training loop written in plain PyTorch.

  python benchmarks/flag_retrieval.py [--rounds 3]

In interleaved rounds, each a fresh process:
  torch         benchmarks/flag_retrieval_torch.py (the PyTorch reference loop), default threads
  torch-1t      the same with torch.set_num_threads(1)
  ours-cold     python -m experiments.train (defaults) with an empty compilation cache
  ours-warm     the same command again, the cache now filled
  jax-import    python -c "import <what the launcher imports>"
Medians over rounds, ratios against the PyTorch script. Writes
benchmarks/results/flag_retrieval.json (docs/benchmarks.md is built from it).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.common import PYTHON, ROOT, last_json_line, median, run_timed, write_results  # noqa: E402

IMPORTS = "import jax, flax.linen, optax, orbax.checkpoint, ml_collections, absl.app, qkv_jax.training"


def ours(workdir: pathlib.Path, cache: pathlib.Path, env: dict) -> dict:
    wall, _ = run_timed(
        [
            PYTHON,
            "-m",
            "experiments.train",
            "--config",
            "configs/flag_retrieval.py",
            "--workdir",
            str(workdir),
            f"--compilation_cache={cache}",
        ],
        env=env,
    )
    summary = json.loads((workdir / "summary.json").read_text())
    return {
        "process_s": wall,
        "compile_s": summary["timings"]["compile_s"],
        "loop_s": summary["timings"]["train_loop_s"],
        "in_process_s": summary["wall_time_s"],
        "final_loss": summary["final_loss"],
        "accuracy": summary["eval_accuracy"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    env = {"PYTHONPATH": str(ROOT)}
    runs: dict[str, list[dict]] = {
        k: [] for k in ("torch", "torch-1t", "ours-cold", "ours-warm", "jax-import")
    }
    for round_ in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = pathlib.Path(tmp)
            wall, out = run_timed([PYTHON, "benchmarks/flag_retrieval_torch.py"])
            runs["torch"].append({"process_s": wall, **last_json_line(out)})
            wall, out = run_timed([PYTHON, "benchmarks/flag_retrieval_torch.py", "--threads", "1"])
            runs["torch-1t"].append({"process_s": wall, **last_json_line(out)})
            runs["ours-cold"].append(ours(tmp / "cold", tmp / "cache", env))
            runs["ours-warm"].append(ours(tmp / "warm", tmp / "cache", env))
            wall, _ = run_timed([PYTHON, "-c", IMPORTS], env=env)
            runs["jax-import"].append({"process_s": wall})
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)

    med = {
        name: {key: median([r[key] for r in rs]) for key in rs[0] if isinstance(rs[0][key], float)}
        for name, rs in runs.items()
    }
    ratios = {
        "loop_speedup_vs_torch": med["torch"]["loop_s"] / med["ours-cold"]["loop_s"],
        "loop_speedup_vs_torch_1_thread": med["torch-1t"]["loop_s"] / med["ours-cold"]["loop_s"],
        "process_speedup_cold_vs_torch": med["torch"]["process_s"] / med["ours-cold"]["process_s"],
        "process_speedup_warm_vs_torch": med["torch"]["process_s"] / med["ours-warm"]["process_s"],
        "warm_cache_speedup": med["ours-cold"]["process_s"] / med["ours-warm"]["process_s"],
    }
    rows = [
        (
            "PyTorch reference loop, default threads",
            med["torch"]["process_s"],
            med["torch"]["import_s"],
            None,
            med["torch"]["loop_s"],
        ),
        (
            "PyTorch reference loop, 1 thread",
            med["torch-1t"]["process_s"],
            med["torch-1t"]["import_s"],
            None,
            med["torch-1t"]["loop_s"],
        ),
        (
            "qkv_jax, empty compilation cache",
            med["ours-cold"]["process_s"],
            med["jax-import"]["process_s"],
            med["ours-cold"]["compile_s"],
            med["ours-cold"]["loop_s"],
        ),
        (
            "qkv_jax, cache filled",
            med["ours-warm"]["process_s"],
            med["jax-import"]["process_s"],
            med["ours-warm"]["compile_s"],
            med["ours-warm"]["loop_s"],
        ),
    ]
    table = [
        "| run | whole process (s) | import (s) | compile (s) | 2000-step loop (s) |",
        "|---|---|---|---|---|",
    ]
    for name, process, imp, compile_, loop in rows:
        table.append(
            f"| {name} | {process:.2f} | {imp:.2f} | "
            f"{'-' if compile_ is None else f'{compile_:.2f}'} | {loop:.3f} |"
        )
    print("\n".join(table))
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    path = write_results(
        "flag_retrieval",
        f"python benchmarks/flag_retrieval.py --rounds {args.rounds}",
        {"rounds": args.rounds, "medians": med, "ratios": ratios, "table": table, "runs": runs},
    )
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
