r"""`train.cpu_optimization_level` 0, 1 and 2: compile time against step time on CPU.

  python benchmarks/compile_levels.py [--rounds 3] [--steps 10]

Two char LMs through the launcher's own programs (`make_train_chunk` of --steps
steps and the task's evaluation, compiled as `compile_for_platform` compiles
them for each level):

  tiny     the shape the shrunk end-to-end tests and quick tries train: 2 layers,
           d_model 16, 2 heads, 32-character windows, batch 8, 8 evaluation windows;
  char_lm  configs/char_lm.py as it is (2 layers, d_model 128, 4 heads,
           256-character windows, batch 16, 256 evaluation windows).

For each, in interleaved rounds in this one process (each compile starts from
the lowered program; no compilation cache): the seconds to compile the chunk and
the evaluation, and the seconds per training step of the compiled chunk (its
first call excluded). Medians. Writes benchmarks/results/compile_levels.json.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from benchmarks.common import median, write_results  # noqa: E402
from configs import char_lm  # noqa: E402
from qkv_jax.training import build_setup, init_train_state, make_optimizer, make_train_chunk, seed_keys  # noqa: E402
from qkv_jax.training.compiled import CPU_COMPILER_OPTIONS, compile_for_platform, cpu_compiler_options  # noqa: E402
from qkv_jax.training.setup import to_dict  # noqa: E402

LEVELS = tuple(CPU_COMPILER_OPTIONS)


def model_config(name: str) -> dict:
    config = char_lm.get_config()
    if name == "tiny":
        config.model.update(num_layers=2, d_model=16, num_heads=2, max_len=32)
        config.task.seq_len = 32
        config.train.batch_size = 8
        config.eval.update(num_examples=8, sample_length=8)
    return to_dict(config)


def measure(setup, state, data_key, steps: int, level: int) -> dict:
    chunk = jax.jit(make_train_chunk(setup, steps))
    started = time.perf_counter()
    chunk = compile_for_platform(chunk, state, data_key, setup.data, cpu_optimization_level=level)
    compile_chunk = time.perf_counter() - started
    started = time.perf_counter()
    # A new function each time: jax reuses the lowering (and then the executable) of one it has seen.
    evaluate = jax.jit(lambda params, key, data: setup.evaluate(params, key, data))
    compile_for_platform(evaluate, state.params, data_key, setup.data, cpu_optimization_level=level)
    compile_evaluate = time.perf_counter() - started
    warm, losses = chunk(state, data_key, setup.data)  # the first call pays one-time costs
    losses.block_until_ready()
    started = time.perf_counter()
    chunk(warm, data_key, setup.data)[1].block_until_ready()
    return {
        "compile_chunk_s": compile_chunk,
        "compile_evaluate_s": compile_evaluate,
        "step_s": (time.perf_counter() - started) / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    results: dict = {}
    for name in ("tiny", "char_lm"):
        config = model_config(name)
        setup = build_setup(config)
        tx = make_optimizer(config["train"])
        keys = seed_keys(config["seed"])
        state = jax.jit(functools.partial(init_train_state, setup, tx))(keys["init"])
        runs: dict = {level: [] for level in LEVELS}
        for _ in range(args.rounds):
            for level in LEVELS:
                runs[level].append(measure(setup, state, keys["data"], args.steps, level))
        results[name] = {
            f"level_{level}": {key: median([r[key] for r in rs]) for key in rs[0]}
            for level, rs in runs.items()
        }
    table = [
        "| model | level | compile chunk (s) | compile evaluation (s) | step (ms) |",
        "|---|---|---|---|---|",
    ]
    ratios = {}
    for name, by_level in results.items():
        for level in LEVELS:
            r = by_level[f"level_{level}"]
            table.append(
                f"| {name} | {level} | {r['compile_chunk_s']:.2f} | {r['compile_evaluate_s']:.2f} "
                f"| {1000 * r['step_s']:.1f} |"
            )
        one, zero = by_level["level_1"], by_level["level_0"]
        compile_one = one["compile_chunk_s"] + one["compile_evaluate_s"]
        ratios[f"{name}_compile_level_1_over_0"] = compile_one / (
            zero["compile_chunk_s"] + zero["compile_evaluate_s"]
        )
        ratios[f"{name}_step_level_0_over_1"] = zero["step_s"] / one["step_s"]
    command = f"python benchmarks/compile_levels.py --rounds {args.rounds} --steps {args.steps}"
    path = write_results(
        "compile_levels",
        command,
        {
            "title": "XLA:CPU optimization levels: compile time against step time",
            "compiler_options": {str(k): cpu_compiler_options(k) for k in CPU_COMPILER_OPTIONS},
            "results": results,
            "table": table,
            "ratios": ratios,
        },
    )
    print("\n".join(table))
    print(ratios)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
