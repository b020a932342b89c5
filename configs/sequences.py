r"""The char LM's TransformerLM on synthetic next-token tasks with a known answer.

  copy      random symbols, a separator, the same symbols again (about 20 s on 2 CPU cores):
            python -m experiments.train --config configs/sequences.py:copy --workdir runs/copy
  brackets  a random bracket prefix, "=", the closing brackets that complete it (about a minute):
            python -m experiments.train --config configs/sequences.py:brackets --workdir runs/brackets
  repeat    a random segment of random length, repeated (induction heads form to predict it;
            python -m experiments.study induction ... follows them):
            python -m experiments.train --config configs/sequences.py:repeat --workdir runs/repeat

eval_accuracy is the share of answer tokens predicted right (argmax), eval_sequence_accuracy
the share of sequences with every answer right. Any field can be overridden,
e.g. --config.task.length=16 --config.model.num_kv_heads=1.
"""

import ml_collections

from configs import common

# variant -> its task fields (qkv_jax/training/sequences.py SEQUENCE_TASKS) and training steps.
TASKS = {
    # Symbols to copy (sequences are 2 * length tokens); tokens: the separator 0, symbols 1 .. vocab_size - 1.
    "copy": ({"length": 8, "vocab_size": 16}, 400),
    # Brackets in the prefix; bracket types (vocabulary: pad, '=', an opener and a closer per type).
    "brackets": ({"length": 12, "num_types": 3}, 1500),
    # The longest repeated segment (sequences are 2 * length tokens); tokens 0 .. vocab_size - 1.
    "repeat": ({"length": 16, "vocab_size": 32}, 1500),
}
# variant -> its task (`--list_configs` shows these); the first is the default.
VARIANTS = {
    "copy": "random symbols, a separator, the same symbols again",
    "brackets": "a random bracket prefix, '=', the closing brackets that complete it",
    "repeat": "a random segment of random length, repeated (induction heads form)",
}


def get_config(arg=None):
    variant = arg or "copy"
    if variant not in TASKS:
        raise ValueError(f"configs/sequences.py:{variant}: unknown variant; choose one of {tuple(VARIANTS)}")
    fields, steps = TASKS[variant]
    config = common.base(f"lm_{variant}")
    config.task = common.task("qkv_jax.tasks.sequences", variant)
    # The task's size: symbols to copy, brackets in the prefix, or the longest repeated segment.
    config.task.length = fields["length"]
    if "vocab_size" in fields:
        # Tokens: copy's separator 0 and symbols 1 .. vocab_size - 1; repeat's 0 .. vocab_size - 1.
        config.task.vocab_size = fields["vocab_size"]
    if "num_types" in fields:
        # Bracket types (vocabulary: pad, '=', an opener and a closer per type).
        config.task.num_types = fields["num_types"]
    # Positions: the sequence length, 2 * task.length (lazy, follows overrides).
    config.model = common.transformer(
        num_layers=2, d_model=64, num_heads=4, max_len=config.task.get_ref("length") * 2
    )
    config.train = common.lm_train(
        steps=steps, batch_size=64, warmup_steps=100, log_every=100, checkpoint_every=500
    )
    config.mesh = common.mesh()

    config.eval = ml_collections.ConfigDict()
    # Fresh sequences for the final (and untrained) evaluation.
    config.eval.num_examples = 1024
    return config
