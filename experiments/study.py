r"""Run one study of learned attention; it writes its own results, table and plot.

  python -m experiments.study causal_mask --workdir runs/causal_mask
  python -m experiments.study kv_heads --workdir runs/kv_heads --seeds 6
  python -m experiments.study thermostat --workdir runs/thermostat --seeds 4 \
    --config configs/flag_retrieval.py:thermostat --config.train.steps=300 --config.train.log_every=10
  python -m experiments.study induction --workdir runs/induction --seeds 4 \
    --config configs/sequences.py:repeat --config.train.keep_checkpoints=0
  python -m experiments.study logit_scale --workdir runs/logit_scale --seeds 4 \
    --config configs/flag_retrieval.py:logit_scale --config.train.steps=300 --config.train.log_every=10
  python -m experiments.study positions --workdir runs/positions --seeds 3 \
    --config configs/sequences.py:repeat --config.task.length=64 --config.model.max_len=512
  python -m experiments.study flag_reader --workdir runs/flag_reader --seeds 8 \
    --config configs/flag_retrieval.py
  python -m experiments.study induction_composition --workdir runs/composition --seeds 8 \
    --config configs/sequences.py:repeat --config.train.log_every=25
  python -m experiments.study kv_views --workdir runs/kv_views --seeds 5
  python -m experiments.study sinks --workdir runs/sinks --seeds 4
  python -m experiments.study windows --workdir runs/windows --seeds 4
  python -m experiments.study lora_finetune --workdir runs/lora --pretrained runs/pretrain --seeds 3
  python -m experiments.study kv_conversion --workdir runs/conversion --pretrained runs/pretrain --seeds 3
  python -m experiments.study head_ablation --workdir runs/ablation --pretrained runs/pretrain --seeds 3

Each study trains `--config` (default configs/char_lm.py:study; any
`--config.<field>=` override applies to every run) and writes
<workdir>/results.json, results.md (a table) and <study>.png. Re-running
resumes: finished runs and sweep cells are read back, not retrained. The studies
themselves are the `studies` package beside this launcher (`studies/catalogue.py`).

  causal_mask    the same model with and without the causal mask: training loss,
                 honest (causal) validation loss, and what generation produces.
  kv_heads       num_heads=8 with num_kv_heads 8, 4, 2, 1 (MHA, GQA, MQA) and MLA
                 at two latent sizes (the config file's `get_sweep` cells): validation
                 loss with 95% intervals and the paired difference from MHA, KV-cache
                 bytes per token, decode tokens/s.
  thermostat     (a flag_retrieval config) per d_k, with and without 1/sqrt(d_k): the
                 gradient reaching W_q and W_k, attention entropy and largest weight,
                 at initialisation and through training.
  induction      (a sequences.py:repeat config) every head's induction score and
                 previous-token weight through training: when induction heads form.
  logit_scale    (configs/flag_retrieval.py:logit_scale, its get_sweep cells) one
                 MultiHeadAttention head at d_k 16 to 1024 with no scale, 1/sqrt(d_k),
                 QK-norm without and with the scale, and a soft cap: steps until the
                 evaluation accuracy reaches 0.95, attention entropy and the gradient at
                 W_q at initialisation and through training, each paired against 1/sqrt(d_k).
  logit_scale_lm the same five arms in the char LM at d_k 128 (1 head) and 16 (8 heads):
                 validation bits/char, held-out bits/char through training, attention
                 entropy and the gradient at W_q, each paired against 1/sqrt(d_k).
  positions      (a sequences.py:repeat config) RoPE, learned and no positions trained at
                 2 * task.length tokens: when the strongest induction score passes 0.5, and
                 loss and accuracy on the repeated half at that length and at 2x and 4x it
                 (model.max_len must hold 4x), each paired against RoPE.
  positions_lm   the same three arms in the char LM (--config.model.max_len=512 for its
                 128-character windows): held-out bits/char at 1x, 2x and 4x the trained
                 length, and the strongest induction score through training.
  flag_reader    (a flag_retrieval config, the learned-query reader) the learned query's
                 direction against the flag channel (cosine) and W_QK's singular values
                 and effective rank through training.
  induction_composition
                 (a sequences.py:repeat config) K-composition between the previous-token
                 head and the induction head against the induction score through
                 training, and the share of the answers' log-probability that patching
                 each head's clean output into a corrupted run restores.
  kv_views       the K/V study's cells: W_QK effective rank and the number of distinct
                 attention patterns per layer, paired against MHA.
  sinks          plain softmax, learned sinks, a soft cap of 5 and both: each head's
                 first-token share, entropy and sink mass through training, bits/char.
  windows        all global, all local at 64/32/16 keys, local/global alternating:
                 bits/char against the decode cache's bytes and decode tokens/s.
  lora_finetune  each seed's model (pre-trained once per seed in --pretrained, shared
                 by the three fine-tuning studies) fine-tuned onto the standard
                 library's docstrings: in full, and with LoRA adapters of rank 1-16.
  kv_conversion  MHA -> GQA-2 / MQA by mean-pooling K/V heads, with uptraining, against
                 the same shape trained from scratch for the same total steps.
  head_ablation  each head's ablation cost against its entropy, previous-token weight
                 and induction score: rank correlations over seeds.
"""

import pathlib
import shlex
import sys

from absl import flags
from ml_collections import config_flags

from experiments import common

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", "configs/char_lm.py:study", "Base config of every run of the study.", lock_config=True
)
flags.DEFINE_string("workdir", None, "Directory for the study's runs and results.")
flags.DEFINE_integer("seeds", 4, "Seeds (0, 1, ..., seeds - 1); sweep cells train theirs together.")
flags.DEFINE_string(
    "pretrained",
    None,
    "Fine-tuning studies: the pre-trained runs' directory (default: <workdir>/pretrained).",
)
common.define_common_flags()


def main(argv):
    from studies.catalogue import STUDIES

    if len(argv) != 2 or argv[1] not in STUDIES:
        common.fail(f"give one study: {', '.join(STUDIES)} (got {argv[1:]})", code=2)
    if FLAGS.seeds < 1:
        common.fail(f"--seeds={FLAGS.seeds}: must be at least 1", code=2)
    common.enable_compilation_cache(FLAGS.compilation_cache)
    from qkv_jax.training.setup import to_dict
    from qkv_jax.training.workdir import make_workdir
    from studies.results import write_study_results

    name, workdir = argv[1], pathlib.Path(FLAGS.workdir)
    study = STUDIES[name]
    module, variant = common.config_file_module()
    with common.training_errors():
        options = {
            "seeds": list(range(FLAGS.seeds)),
            "pretrained": FLAGS.pretrained and pathlib.Path(FLAGS.pretrained),
            "cells": common.config_sweep(module, variant) if study.uses_cells else None,
        }
        make_workdir(workdir)
        results = study.run(to_dict(FLAGS.config), workdir, options)
    command = "python -m experiments.study " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    record = write_study_results(workdir, results, command, study)
    print("\n".join(record["table"]))
    print(f"wrote {workdir}/results.json, results.md, {name}.png")


if __name__ == "__main__":
    common.run_main(main, positional=1)
