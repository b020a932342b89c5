r"""Train one experiment: `train_and_evaluate(config, workdir)` from the command line.

  python -m experiments.train --config configs/flag_retrieval.py --workdir runs/flag \
    [--config.model.d_k=4 ...] [--check]
  python -m experiments.train --list_configs

--list_configs lists the config files in configs/ and their variants, one line each;
--check prints every field of the resolved config, its value and its comment from the
config file (* marks those the command line sets).

Re-running the same command resumes from the workdir's newest checkpoint; on a
finished run it changes nothing and prints the run's results. A larger
--config.train.steps continues a finished run (its summary.json is kept as
summary-<steps>.json); a smaller one than the run already has is refused with
exit 2 and nothing changed. --check parses and validates the command (the
config, the task's build, the device mesh, the workdir) and says what the run
would do, then exits: 0 when it would run, 2 with one line when not; nothing
is written or compiled.

Many devices: --config.mesh.data=4 --config.mesh.model=2 (--num_cpu_devices=8
simulates them on a CPU). Many processes: the same command on each host with
--coordinator=HOST:PORT --num_processes=N --process_id=I.
"""

import pathlib
import sys

from absl import flags
from ml_collections import config_flags

from experiments import common

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "Experiment config file, optionally with ':variant'.", lock_config=True
)
flags.DEFINE_string("workdir", None, "Directory for config.json, metrics, checkpoints, pictures.")
flags.DEFINE_bool(
    "check",
    False,
    "Check the command (config, task build, device mesh, workdir), say what the run would do, and "
    "exit without writing or compiling anything; prints every config field with its value and "
    "meaning, * marking those the command line sets.",
)
flags.DEFINE_bool(
    "list_configs", False, "List the config files in configs/ and their :variants, one line each, and exit."
)
common.define_common_flags()


def describe(summary: dict, workdir: str) -> str:
    """What the run found, in a few lines: how it trained (or that it had finished before),
    the training loss, the evaluation, the workdir's files."""
    from qkv_jax.training.workdir import read_metrics

    if summary.get("already_finished"):
        ignored = summary.get("not_applied") or []
        lines = [
            f"{summary['experiment']}: the run had already finished at step {summary['steps']}; nothing "
            f"was trained and {workdir} is left as it was"
            + (f" (not applied: {'; '.join(ignored)})" if ignored else "")
        ]
    else:
        timings = summary["timings"]
        resumed = summary["resumed_from_step"]
        lines = [
            f"{summary['experiment']}: {summary['steps']} steps in {summary['wall_time_s']:.1f} s "
            f"(compile {timings.get('compile_s', 0):.1f} s, training loop "
            f"{timings.get('train_loop_s', 0):.2f} s)" + (f"; resumed from step {resumed}" if resumed else "")
        ]
    if summary.get("trainable_params", summary.get("params")) != summary.get("params"):
        lines.append(
            f"parameters: {summary['params']:,}, of which trainable: {summary['trainable_params']:,}"
        )
    records = read_metrics(f"{workdir}/metrics.jsonl")
    if records:
        shown = records[:: max(1, len(records) // 5)][:5]
        shown += [r for r in records[-1:] if r is not shown[-1]]
        losses = ", ".join(f"step {r['step']} {r['loss']:.3g}" for r in shown)
        lines.append(f"training loss: {losses}")
    lines.append(f"{'evaluation':28s} {'trained':>10s} {'untrained':>10s}")
    untrained = summary["untrained"]
    for name, value in summary.items():
        if name.startswith("eval_") and isinstance(value, (int, float)):
            lines.append(f"  {name:26s} {value:10.4g} {untrained[name]:10.4g}")
    files = sorted(
        p.name + ("/" if p.is_dir() else "") for p in pathlib.Path(workdir).iterdir() if p.name[0] != "."
    )
    lines.append(f"{'in' if summary.get('already_finished') else 'wrote'} {workdir}/: {' '.join(files)}")
    return "\n".join(lines)


def main(argv):
    del argv  # run_main refuses positional arguments
    from experiments import config_catalogue

    if FLAGS.list_configs:
        print(config_catalogue.list_configs())
        return
    if FLAGS.check:
        common.initialize_devices(distributed=False)
        from ml_collections import config_flags

        from qkv_jax.training.run import check_run

        with common.training_errors():
            plan = check_run(FLAGS.config, FLAGS.workdir)
        argument = config_flags.get_config_filename(FLAGS["config"])
        print(f"ok: {plan}; nothing was written")
        print(config_catalogue.describe_config(FLAGS.config, argument, sys.argv))
        return
    common.initialize_devices()
    common.enable_compilation_cache(FLAGS.compilation_cache)
    from qkv_jax.training import train_and_evaluate
    from qkv_jax.training.sharding import is_primary

    with common.training_errors():
        summary = train_and_evaluate(FLAGS.config, FLAGS.workdir, log=lambda line: print(line, flush=True))
    if is_primary():
        print(describe(summary, FLAGS.workdir))


if __name__ == "__main__":
    common.run_main(main)
