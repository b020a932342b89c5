r"""The seeds' claims about learned attention, measured in studies that write their own results.

  python -m experiments.lm_studies causal_mask --workdir runs/causal_mask
  python -m experiments.lm_studies kv_heads --workdir runs/kv_heads --seeds 6
  python -m experiments.lm_studies thermostat --workdir runs/thermostat --seeds 4 \
    --config configs/flag_retrieval.py:thermostat --config.train.steps=300 --config.train.log_every=10
  python -m experiments.lm_studies induction --workdir runs/induction --seeds 4 \
    --config configs/lm_tasks.py:repeat --config.train.keep_checkpoints=0

Each study trains `--config` (default configs/char_lm.py:study; any
`--config.<field>=` override applies to every run): causal_mask once per arm
in <workdir>/<arm>/ (re-running resumes), kv_heads through the sweep launcher
over the config file's `get_sweep` cells with --seeds seeds trained together
(re-running skips finished cells). Both write <workdir>/results.json,
results.md (a table) and PNG plots.

  causal_mask  the same model with and without the causal mask: training loss,
               honest (causal) validation loss, and what generation produces.
  kv_heads     num_heads=8 with num_kv_heads 8, 4, 2, 1 (MHA, GQA, MQA) and MLA
               with two latent sizes: validation loss with 95% intervals and the
               paired difference from MHA, KV-cache bytes per token, decode tokens/s.
  thermostat   (a flag_retrieval config) per d_k, with and without 1/sqrt(d_k): the
               gradient reaching W_q and W_k, attention entropy and largest weight,
               at initialisation and through training.
  induction    (an lm_tasks.py:repeat config) every head's induction score and
               previous-token weight through training: when induction heads form.
"""

import pathlib
import shlex
import sys

from absl import flags
from ml_collections import config_flags

from experiments import common

STUDIES = ("causal_mask", "kv_heads", "thermostat", "induction")
FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", "configs/char_lm.py:study", "Base char_lm config of every run.", lock_config=True
)
flags.DEFINE_string("workdir", None, "Directory for the runs and the results.")
flags.DEFINE_integer("seeds", 4, "kv_heads, thermostat, induction: seeds per cell, trained together.")
common.define_common_flags()


def main(argv):
    if len(argv) != 2 or argv[1] not in STUDIES:
        common.fail(f"give one study: {' or '.join(STUDIES)} (got {argv[1:]})", code=2)
    common.enable_compilation_cache(FLAGS.compilation_cache)
    from qkv_jax.training import attention_studies, lm_studies
    from qkv_jax.training.task import to_dict

    study, workdir = argv[1], pathlib.Path(FLAGS.workdir)
    base = to_dict(FLAGS.config)
    workdir.mkdir(parents=True, exist_ok=True)
    seeds = list(range(FLAGS.seeds))
    with common.training_errors():
        if study == "kv_heads":
            module, variant = common.config_file_module()
            results = lm_studies.kv_heads(base, workdir, module.get_sweep(variant), seeds)
        elif study == "causal_mask":
            results = lm_studies.causal_mask(base, workdir)
        else:
            results = getattr(attention_studies, study)(base, workdir, seeds)
    command = "python -m experiments.lm_studies " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    record = lm_studies.write_results(workdir, results, command)
    print("\n".join(record["table"]))
    print(f"wrote {workdir}/results.json, results.md, {study}.png")


if __name__ == "__main__":
    common.run_main(main, positional=1)
