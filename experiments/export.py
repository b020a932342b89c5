r"""Export a pretrained_text run as a Hugging Face directory that transformers loads.

  python -m experiments.export --workdir runs/ft_lora --out runs/ft_lora_hf

Reads the run's newest verified checkpoint, merges its LoRA adapters into the kernels and
writes config.json, model.safetensors and the source's tokenizer.json (and generation_config.json,
its end-of-text ids, when the source has one) into --out (atomically,
through qkv_jax.save_pretrained). An --out that exists and is not empty is refused (exit 2,
nothing overwritten), as is a workdir without a run or a checkpoint.
"""

import pathlib

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "The workdir of a pretrained_text run.")
flags.DEFINE_string("out", None, "A new (or empty) directory to write the Hugging Face model into.")
common.define_common_flags()


def main(argv):
    del argv  # run_main refuses positional arguments
    if not FLAGS.out:
        common.fail("--out is required (a new directory for the Hugging Face model)", code=common.EXIT_CONFIG)
    out = pathlib.Path(FLAGS.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        common.fail(
            f"--out={FLAGS.out}: already exists and is not an empty directory; nothing was written "
            "(choose a new directory)",
            code=common.EXIT_CONFIG,
        )
    from qkv_jax.tasks.pretrained_text import export_run

    try:
        path, step, config = export_run(FLAGS.workdir, out)
    except ValueError as error:
        common.fail(str(error), code=common.EXIT_CONFIG)
    merged = f", its LoRA adapters (rank {config.lora_rank}) merged" if config.lora_rank else ""
    print(f"wrote {path}: step {step} of {FLAGS.workdir}{merged}")


if __name__ == "__main__":
    common.run_main(main)
