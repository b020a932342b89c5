r"""Seeds trained together (jax.vmap) against one seed alone, same config and steps.

  python benchmarks/seeds_vmap.py [--seeds 8] [--rounds 3] [--variant learned_query]

Interleaved rounds in one process; each call of train_seeds builds and
compiles its program afresh, so `whole` includes compilation. Prints the
ratio (8 seeds) / (1 seed); writes benchmarks/results/seeds_vmap.json.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.common import median, write_results  # noqa: E402
from configs import flag_retrieval  # noqa: E402
from qkv_jax.training import train_seeds  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", default="learned_query")
    args = parser.parse_args()
    config = flag_retrieval.get_config(args.variant)
    times: dict[int, dict[str, list[float]]] = {n: {"train_s": [], "whole_s": []} for n in (1, args.seeds)}
    for _ in range(args.rounds):
        for n in (1, args.seeds):
            result = train_seeds(config, list(range(n)))
            times[n]["train_s"].append(result["train_s"])
            times[n]["whole_s"].append(result["wall_time_s"])
    med = {n: {k: median(v) for k, v in t.items()} for n, t in times.items()}
    ratios = {
        f"train_loop_{args.seeds}_seeds_over_1": med[args.seeds]["train_s"] / med[1]["train_s"],
        f"whole_{args.seeds}_seeds_over_1": med[args.seeds]["whole_s"] / med[1]["whole_s"],
    }
    steps = config.train.steps
    table = [
        f"| seeds | {steps}-step training loop (s) | whole call incl. compile (s) |",
        "|---|---|---|",
        *(f"| {n} | {med[n]['train_s']:.3f} | {med[n]['whole_s']:.2f} |" for n in (1, args.seeds)),
    ]
    print("\n".join(table))
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    path = write_results(
        "seeds_vmap",
        f"python benchmarks/seeds_vmap.py --seeds {args.seeds} --rounds {args.rounds} "
        f"--variant {args.variant}",
        {
            "table": table,
            "ratios": ratios,
            "medians": {str(n): m for n, m in med.items()},
            "runs": {str(n): t for n, t in times.items()},
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
