r"""Sweep a config over a grid of overrides, every cell over several seeds.

  python -m experiments.sweep --config configs/flag_retrieval.py:multihead --workdir runs/sweep \
    --sweep model.d_k=2,4,8,16 --sweep model.num_heads=1,2,4 --seeds 8 [--config.a.b=v ...]

The seeds of a cell train together in one compiled program (jax.vmap over the
init and data keys). Without --sweep, the config file's `get_sweep(arg)` gives
the grid. Cells that fail the config check are reported as skipped with the
reason; a cell that raises anything else (its task's build, its model's init or
compile, ...) is reported as failed with a one-line reason (the traceback is
kept in cells/<cell>.traceback.txt) while the other cells train, and the
launch then exits 1 naming the failed cells. Re-running the same command skips
finished cells and retries the failed and unfinished ones.

Many machines: start N launches with --shard 0/N ... --shard N-1/N on one
(shared) workdir, e.g. a SLURM array (README, "Sweeps and studies"); each
claims its cells, and the last to finish writes results.*.
"""

import pathlib

from absl import flags
from ml_collections import config_flags

from experiments import common

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "Experiment config file, optionally with ':variant'.", lock_config=True
)
flags.DEFINE_string("workdir", None, "Directory for the sweep's cells, results and plots.")
flags.DEFINE_multi_string("sweep", [], "field=v1,v2,...; repeat for a grid (cartesian product).")
flags.DEFINE_integer("seeds", 4, "Seeds per cell (0, 1, ..., seeds - 1), trained together.")
flags.DEFINE_string(
    "shard",
    None,
    "I/N: run only the cells whose index is I mod N (N launches, e.g. a SLURM array, share one "
    "workdir; the last to finish writes the results).",
)
flags.DEFINE_string(
    "metric",
    None,
    "Metric for the table and plots (default: the config's get_sweep_metric(arg), else final_loss).",
)
common.define_common_flags()


def main(argv):
    del argv  # run_main refuses positional arguments
    from qkv_jax.training import ConfigError
    from qkv_jax.training.setup import to_dict
    from studies.grid import grid, parse_shard, parse_sweep_arg
    from studies.sweep import CellsFailed, run_sweep

    config = to_dict(FLAGS.config)
    module, arg = common.config_file_module()
    with common.training_errors():
        if FLAGS.sweep:
            sweep = dict(parse_sweep_arg(text, config) for text in FLAGS.sweep)
        elif hasattr(module, "get_sweep"):
            sweep = common.config_sweep(module, arg)
        else:
            raise ConfigError("no --sweep given and the config file has no get_sweep()")
        if FLAGS.seeds <= 0:
            raise ConfigError(f"--seeds={FLAGS.seeds}: must be a positive integer")
        metric = FLAGS.metric or getattr(module, "get_sweep_metric", lambda a: "final_loss")(arg)
        shard = parse_shard(FLAGS.shard)
        common.enable_compilation_cache(FLAGS.compilation_cache)
        failed = None
        try:
            rows = run_sweep(
                config,
                FLAGS.workdir,
                sweep,
                list(range(FLAGS.seeds)),
                metric=metric,
                overwrite=config["train"]["overwrite"],
                shard=shard,
                log=lambda line: print(line, flush=True),
            )
        except CellsFailed as error:
            rows, failed = error.rows, error
        results = pathlib.Path(FLAGS.workdir, "results.md")
        if results.exists() and len(rows) == len(grid(sweep)):
            statuses = [r["status"] for r in rows]
            count = {status: statuses.count(status) for status in ("done", "skipped", "failed")}
            print(
                f"{count['done']} of {len(rows)} cells done, {count['skipped']} skipped, {count['failed']} "
                f"failed; wrote {results}"
            )
            print(results.read_text())
        if failed is not None:
            raise failed


if __name__ == "__main__":
    common.run_main(main)
