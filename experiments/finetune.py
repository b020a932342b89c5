r"""Issue 16's studies: fine-tuning the char LM's learned projections, measured.

  python -m experiments.finetune lora_finetune --workdir runs/lora --pretrained runs/pretrain --seeds 3
  python -m experiments.finetune kv_conversion --workdir runs/conversion --pretrained runs/pretrain --seeds 3
  python -m experiments.finetune head_ablation --workdir runs/ablation --pretrained runs/pretrain --seeds 3

Every study starts from `--config` (default configs/char_lm.py:study; any
`--config.<field>=` override applies to every run) pre-trained on the standard
library once per seed in <pretrained>/seed_<s> (shared by the three studies:
the second finds them finished), then trains its arms with
`train.init_from` in <workdir>/<arm>/seed_<s> (re-running resumes). Each
writes <workdir>/results.json, results.md (a table) and <study>.png.

  lora_finetune  each seed's model fine-tuned onto the standard library's
                 docstrings (validated on those of the files pre-training held
                 out): in full, and with LoRA adapters of rank 1, 2, 4, 8, 16 on
                 W_Q + W_V and on W_Q, W_K, W_V, W_O.
  kv_conversion  MHA -> GQA-2 / MQA by mean-pooling K/V heads: right after the
                 conversion, after uptraining 5% of the pre-training steps, and
                 the same model trained from scratch for the same total steps.
  head_ablation  each head's ablation cost against its entropy, previous-token
                 weight and induction score: rank correlations over seeds.
"""

import pathlib
import shlex
import sys

from absl import flags
from ml_collections import config_flags

from experiments import common

STUDIES = ("lora_finetune", "kv_conversion", "head_ablation")  # finetune_studies.WRITERS
FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", "configs/char_lm.py:study", "Base char_lm config of every run.", lock_config=True
)
flags.DEFINE_string("workdir", None, "Directory for the study's runs and results.")
flags.DEFINE_string("pretrained", None, "Directory of the pre-trained runs (default: <workdir>/pretrained).")
flags.DEFINE_integer("seeds", 3, "Seeds: each one a pre-trained run and its own fine-tunes.")
common.define_common_flags()


def main(argv):
    if len(argv) != 2 or argv[1] not in STUDIES:
        common.fail(f"give one study: {' or '.join(STUDIES)} (got {argv[1:]})", code=2)
    if FLAGS.seeds < 1:
        common.fail(f"--seeds={FLAGS.seeds}: must be at least 1", code=2)
    common.enable_compilation_cache(FLAGS.compilation_cache)
    from qkv_jax.training import finetune_studies, lm_studies
    from qkv_jax.training.task import to_dict

    study, workdir = argv[1], pathlib.Path(FLAGS.workdir)
    pretrained = pathlib.Path(FLAGS.pretrained) if FLAGS.pretrained else workdir / "pretrained"
    workdir.mkdir(parents=True, exist_ok=True)
    with common.training_errors():
        results = getattr(finetune_studies, study)(
            to_dict(FLAGS.config), workdir, pretrained, list(range(FLAGS.seeds))
        )
    command = "python -m experiments.finetune " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    record = lm_studies.write_results(workdir, results, command)
    print("\n".join(record["table"]))
    print(f"wrote {workdir}/results.json, results.md, {study}.png")


if __name__ == "__main__":
    common.run_main(main, positional=1)
