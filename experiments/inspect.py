r"""Per-layer, per-head attention heatmaps of a trained checkpoint on one input.

  python -m experiments.inspect --workdir runs/flag [--input 3]
  python -m experiments.inspect --workdir runs/char_lm --input "def forward(self, x):"

What --input means depends on the experiment: the flag task takes a seed for
a fresh example, a language model takes text. Writes attention_maps.png.
"""

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "A run's workdir.")
flags.DEFINE_string("input", None, "The input to look at (default: the experiment's own example).")
common.define_common_flags()


def main(argv):
    del argv  # run_main refuses positional arguments
    common.enable_compilation_cache(FLAGS.compilation_cache)
    from qkv_jax.report.run import inspect_run
    from qkv_jax.training import ConfigError

    try:
        path = inspect_run(FLAGS.workdir, FLAGS.input)
    except (ConfigError, ValueError) as error:
        common.fail(str(error), code=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    common.run_main(main)
