r"""The char LM's TransformerLM on synthetic next-token tasks with a known answer.

  copy      random symbols, a separator, the same symbols again (about 20 s on 2 CPU cores):
            python -m experiments.train --config configs/lm_tasks.py:copy --workdir runs/copy
  brackets  a random bracket prefix, "=", the closing brackets that complete it (about a minute):
            python -m experiments.train --config configs/lm_tasks.py:brackets --workdir runs/brackets

eval_accuracy is the share of answer tokens predicted right (argmax), eval_sequence_accuracy
the share of sequences with every answer right. Any field can be overridden,
e.g. --config.task.length=16 --config.model.num_kv_heads=1.
"""

import ml_collections
from ml_collections import config_dict

VARIANTS = ("copy", "brackets")


def get_config(arg=None):
    variant = arg or "copy"
    if variant not in VARIANTS:
        raise ValueError(f"configs/lm_tasks.py:{variant}: unknown variant; choose one of {VARIANTS}")
    config = ml_collections.ConfigDict()
    # What this config is; a workdir holding another experiment's run is refused.
    config.experiment = f"lm_{variant}"
    # Seeds parameter init, training batches and evaluation sequences.
    config.seed = 0

    config.task = ml_collections.ConfigDict()
    # copy or brackets (qkv_jax/tasks/sequences.py).
    config.task.name = variant
    # Symbols to copy, or brackets in the prefix; sequences are 2 * length tokens.
    config.task.length = 8 if variant == "copy" else 12
    if variant == "copy":
        # Tokens: the separator 0 and symbols 1 .. vocab_size - 1.
        config.task.vocab_size = 16
    else:
        # Bracket types; the vocabulary is pad, '=', and an opener and a closer per type.
        config.task.num_types = 3

    config.model = ml_collections.ConfigDict()
    # Transformer blocks.
    config.model.num_layers = 2
    # Residual stream width.
    config.model.d_model = 64
    # Query heads.
    config.model.num_heads = 4
    # Key/value heads (GQA/MQA); unset = num_heads.
    config.model.num_kv_heads = config_dict.placeholder(int)
    # MLA latent width; unset = off.
    config.model.kv_latent_dim = config_dict.placeholder(int)
    # dot_product_attention's path: reference, xla or chunked; unset = its dispatch rule.
    config.model.attention_implementation = config_dict.placeholder(str)
    # MLP hidden width; unset = 4 * d_model.
    config.model.mlp_dim = config_dict.placeholder(int)
    # Positions: the sequence length, 2 * task.length (lazy, follows overrides).
    config.model.max_len = config.task.get_ref("length") * 2
    # Causal mask (the answers are in the sequence; without it the task is trivial).
    config.model.causal = True
    # Dropout on the residual branches and embeddings.
    config.model.dropout_rate = 0.0
    # Dropout on the attention weights.
    config.model.attention_dropout_rate = 0.0

    config.train = ml_collections.ConfigDict()
    # Optimizer steps.
    config.train.steps = 400 if variant == "copy" else 1500
    # Sequences per step.
    config.train.batch_size = 64
    # Peak learning rate.
    config.train.learning_rate = 3e-3
    # adam, adamw or sgd.
    config.train.optimizer = "adamw"
    # AdamW's decoupled weight decay.
    config.train.weight_decay = 0.01
    # Clip the global gradient norm to this.
    config.train.grad_clip_norm = 1.0
    # Linear warmup steps.
    config.train.warmup_steps = 100
    # constant or cosine.
    config.train.schedule = "cosine"
    # Write a metrics.jsonl line every this many steps.
    config.train.log_every = 100
    # Save an orbax checkpoint every this many steps (and at the end).
    config.train.checkpoint_every = 500
    # Replace a workdir that holds a different config's run (old files are moved aside).
    config.train.overwrite = False

    config.mesh = ml_collections.ConfigDict()
    # Devices the batch is split over (-1 = all devices not used by mesh.model).
    config.mesh.data = -1
    # Devices the attention heads and MLP hidden units are split over (divides num_heads).
    config.mesh.model = 1

    config.eval = ml_collections.ConfigDict()
    # Fresh sequences for the final (and untrained) evaluation.
    config.eval.num_examples = 1024
    return config
