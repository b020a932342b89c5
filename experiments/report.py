r"""Pictures, head diagnostics and the attention explorer page of a finished run or sweep.

  python -m experiments.report --workdir runs/flag
  python -m experiments.report --workdir runs/char_lm --prompt "def forward(self, x):"

A run: loss.png, the experiment's attention pictures of the newest checkpoint,
report.json with the evaluation metrics and per-head diagnostics (entropy,
attention on the flagged position or, for LMs, distance, previous/first
token and induction scores), and report.html: one self-contained page (open
it from disk in any browser) with every layer's and head's attention on a
few inputs, at every saved checkpoint, the diagnostics table, the loss curves
and the config. A sweep: loss_curves.png, the table plots, each cell's
report.html (its first seed) and results.html linking to them.
"""

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "A run's or a sweep's workdir.")
flags.DEFINE_string("prompt", None, "Language models: a text the explorer page shows too.")
common.define_common_flags()


def main(argv):
    del argv  # run_main refuses positional arguments
    common.enable_compilation_cache(FLAGS.compilation_cache)
    from qkv_jax.report.run import is_sweep, report_run
    from qkv_jax.studies.results import report_sweep
    from qkv_jax.training import ConfigError

    try:
        if is_sweep(FLAGS.workdir):
            result = report_sweep(FLAGS.workdir, FLAGS.prompt)
            print(
                f"{FLAGS.workdir}: loss_curves.png ({result['plotted']} cells), the table plots, "
                f"results.html and {result['pages']} cell pages"
            )
            return
        report = report_run(FLAGS.workdir, FLAGS.prompt)
    except ConfigError as error:
        common.fail(str(error), code=2)
    page = " and report.html" if "page" in report else ""
    print(f"checkpoint step {report['step']}; wrote {FLAGS.workdir}/loss.png, report.json, pictures{page}")
    for name, value in report.items():
        if name.startswith("eval_"):
            shown = value if isinstance(value, list) else f"{value:.4g}"
            print(f"  {name:28s} {shown}")


if __name__ == "__main__":
    common.run_main(main)
