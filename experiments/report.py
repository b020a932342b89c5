r"""Pictures and head diagnostics of a finished run or sweep.

  python -m experiments.report --workdir runs/flag

A run: loss.png, the experiment's attention pictures of the newest checkpoint,
report.json with the evaluation metrics and per-head diagnostics (entropy,
attention on the flagged position or, for LMs, distance, previous/first
token and induction scores). A sweep: loss_curves.png and the table plots.
"""

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "A run's or a sweep's workdir.")
common.define_common_flags()


def main(argv):
    del argv  # run_main refuses positional arguments
    common.enable_compilation_cache(FLAGS.compilation_cache)
    from qkv_jax.training import ConfigError
    from qkv_jax.training.report import is_sweep, report_run, report_sweep

    try:
        if is_sweep(FLAGS.workdir):
            result = report_sweep(FLAGS.workdir)
            print(f"{FLAGS.workdir}: loss_curves.png ({result['plotted']} cells) and the table plots")
            return
        report = report_run(FLAGS.workdir)
    except ConfigError as error:
        common.fail(str(error), code=2)
    print(f"checkpoint step {report['step']}; wrote {FLAGS.workdir}/loss.png, report.json and pictures")
    for name, value in report.items():
        if name.startswith("eval_"):
            shown = value if isinstance(value, list) else f"{value:.4g}"
            print(f"  {name:28s} {shown}")


if __name__ == "__main__":
    common.run_main(main)
