r"""Seed 000, section 4: learned Q/K/V attention finds a flagged token; static attention cannot.

The main job (about 5 s on 2 CPU cores):

  python -m experiments.train --config configs/flag_retrieval.py --workdir runs/flag

Variants (`--config configs/flag_retrieval.py:<variant>`):

  static     nothing trainable (Q = K = V = X, the mean token as query):
             python -m experiments.train --config configs/flag_retrieval.py:static \
               --workdir runs/flag_static
  multihead  MultiHeadAttention with a learned query token and W_O:
             python -m experiments.train --config configs/flag_retrieval.py:multihead \
               --workdir runs/flag_mh --config.model.num_heads=4
  two_flag   two flag channels, the target is both flagged contents:
             python -m experiments.train --config configs/flag_retrieval.py:two_flag \
               --workdir runs/two_flag --config.model.num_heads=2

Any field can be overridden, e.g. --config.train.steps=500 --config.model.d_k=4.
"""

import ml_collections

VARIANTS = ("learned_query", "static", "multihead", "two_flag")


def get_config(arg=None):
    variant = arg or "learned_query"
    if variant not in VARIANTS:
        raise ValueError(f"configs/flag_retrieval.py:{variant}: unknown variant; choose one of {VARIANTS}")
    config = ml_collections.ConfigDict()
    # What this config is; a workdir holding another experiment's run is refused.
    config.experiment = "flag_retrieval"
    # Seeds parameter init, training batches and evaluation examples.
    config.seed = 0

    config.model = ml_collections.ConfigDict()
    # learned_query (seed 000's module), static (no parameters) or multihead.
    config.model.kind = "multihead" if variant in ("multihead", "two_flag") else variant
    # Token width: content channels plus task.num_flags flag channels.
    config.model.d_model = 8
    # Total query/key width, split evenly over the heads.
    config.model.d_k = 8
    # Attention heads (multihead only; the others have one).
    config.model.num_heads = 2 if variant in ("multihead", "two_flag") else 1
    # Divide logits by sqrt(head depth), seed 002's thermostat; False = unscaled.
    config.model.scaled = True

    config.task = ml_collections.ConfigDict()
    # The synthetic task (qkv_jax/tasks).
    config.task.name = "flag_retrieval"
    # Tokens per example.
    config.task.seq_len = 5
    # Flag channels; the target is the content at every flagged position.
    config.task.num_flags = 2 if variant == "two_flag" else 1

    config.train = ml_collections.ConfigDict()
    # Optimizer steps.
    config.train.steps = 2000
    # Examples per step.
    config.train.batch_size = 32
    # Adam's learning rate, as in the seed.
    config.train.learning_rate = 0.01
    # adam, adamw or sgd.
    config.train.optimizer = "adam"
    # Write a metrics.jsonl line every this many steps (steps per compiled call).
    config.train.log_every = 100
    # Save an orbax checkpoint every this many steps (and at the end).
    config.train.checkpoint_every = 1000
    # Replace a workdir that holds a different config's run (old files are moved aside).
    config.train.overwrite = False

    config.eval = ml_collections.ConfigDict()
    # Fresh examples for the final (and untrained) evaluation.
    config.eval.num_examples = 10000
    # Examples drawn in attention_before.png / attention_after.png.
    config.eval.num_plot_examples = 8
    return config
