r"""Seed 001: a small character-level causal language model on the Python standard library.

Train (a few minutes on 2 CPU cores; reads the installed standard library's .py
files, no download), then sample from the newest checkpoint:

  python -m experiments.train --config configs/char_lm.py --workdir runs/char_lm
  python -m experiments.generate --workdir runs/char_lm --prompt "def " --max_new_tokens 200

Any text file instead of the standard library (its last 10% validates):

  python -m experiments.train --config configs/char_lm.py --workdir runs/my_text \
    --config.data.path=/path/to/file.txt

Grouped-query, multi-query and latent attention (seed 001's K/V variants):

  python -m experiments.train --config configs/char_lm.py --workdir runs/char_lm_mqa \
    --config.model.num_kv_heads=1
  python -m experiments.train --config configs/char_lm.py --workdir runs/char_lm_mla \
    --config.model.kv_latent_dim=16

Without the causal mask (training sees the answers; `val_bits_per_char` is
still measured with the mask):

  python -m experiments.train --config configs/char_lm.py --workdir runs/char_lm_unmasked \
    --config.model.causal=False

Variant `study`: the base of experiments/lm_studies.py (8 heads, 128-character
windows, 300 steps; about a minute a run). Its `get_sweep` is the K/V study's
grid (MHA, GQA, MQA and two MLA latents), trained through the sweep launcher:

  python -m experiments.lm_studies kv_heads --workdir runs/kv_heads --seeds 2
"""

import ml_collections
from ml_collections import config_dict

VARIANTS = ("default", "study")


def get_config(arg=None):
    variant = arg or "default"
    if variant not in VARIANTS:
        raise ValueError(f"configs/char_lm.py:{variant}: unknown variant; choose one of {VARIANTS}")
    study = variant == "study"
    config = ml_collections.ConfigDict()
    # What this config is; a workdir holding another experiment's run is refused.
    config.experiment = "char_lm"
    # Seeds parameter init, training batches, evaluation windows and samples.
    config.seed = 0

    config.model = ml_collections.ConfigDict()
    # Transformer blocks.
    config.model.num_layers = 2
    # Residual stream width (token and position embeddings too).
    config.model.d_model = 128
    # Query heads; head depth is d_model // num_heads.
    config.model.num_heads = 8 if study else 4
    # Key/value heads, dividing num_heads (GQA; 1 = MQA); unset = num_heads (MHA).
    config.model.num_kv_heads = config_dict.placeholder(int)
    # MLA: per-token latent width the cache stores, K and V rebuilt from it; unset = off.
    config.model.kv_latent_dim = config_dict.placeholder(int)
    # dot_product_attention's path: reference, xla or chunked; unset = its dispatch rule.
    config.model.attention_implementation = config_dict.placeholder(str)
    # MLP hidden width; unset = 4 * d_model.
    config.model.mlp_dim = config_dict.placeholder(int)
    # Positions the model (and its decode cache) holds; generation needs prompt + new - 1 <= this.
    config.model.max_len = 128 if study else 256
    # Causal mask on; False trains a model that sees the characters it predicts.
    config.model.causal = True
    # Dropout on the residual branches and embeddings.
    config.model.dropout_rate = 0.0
    # Dropout on the attention weights.
    config.model.attention_dropout_rate = 0.0

    config.task = ml_collections.ConfigDict()
    # The experiment (qkv_jax/training/run.py TASKS).
    config.task.name = "char_lm"
    # Characters per training window (the model predicts each one's successor).
    config.task.seq_len = 128 if study else 256

    config.data = ml_collections.ConfigDict()
    # A UTF-8 text file to train on; unset = the standard library's .py files.
    config.data.path = config_dict.placeholder(str)
    # Share held out: whole files of the standard library, the end of a single file.
    config.data.validation_fraction = 0.1
    # Vocabulary: the most frequent training characters, id 0 for all others.
    config.data.max_vocab_size = 128

    config.train = ml_collections.ConfigDict()
    # Optimizer steps.
    config.train.steps = 300 if study else 500
    # Windows per step.
    config.train.batch_size = 16
    # Peak learning rate of the schedule.
    config.train.learning_rate = 3e-3
    # adam, adamw or sgd.
    config.train.optimizer = "adamw"
    # AdamW's decoupled weight decay.
    config.train.weight_decay = 0.01
    # Clip the global gradient norm to this.
    config.train.grad_clip_norm = 1.0
    # Linear warmup steps before the schedule.
    config.train.warmup_steps = 50
    # constant or cosine (decays to 0 at train.steps).
    config.train.schedule = "cosine"
    # Write a metrics.jsonl line every this many steps (steps per compiled call).
    config.train.log_every = 50
    # Save an orbax checkpoint every this many steps (and at the end).
    config.train.checkpoint_every = 300 if study else 250
    # Replace a workdir that holds a different config's run (old files are moved aside).
    config.train.overwrite = False

    config.mesh = ml_collections.ConfigDict()
    # Devices the batch is split over (-1 = all devices not used by mesh.model).
    config.mesh.data = -1
    # Devices the attention heads and MLP hidden units are split over (divides num_heads).
    config.mesh.model = 1

    config.eval = ml_collections.ConfigDict()
    # Windows of task.seq_len characters for the train and validation losses.
    config.eval.num_examples = 256
    # Samples.txt: text generated after this prompt ...
    config.eval.sample_prompt = "def "
    # ... this many of them ...
    config.eval.num_samples = 2
    # ... each this many characters long ...
    config.eval.sample_length = 100 if study else 200
    # ... at this temperature (0 = greedy).
    config.eval.temperature = 0.8
    return config


def get_sweep(arg=None):
    """The K/V-sharing study's cells (num_heads is 8 in the study variant)."""
    if arg != "study":
        raise ValueError("configs/char_lm.py: only the study variant defines a sweep")
    return [
        {"model.num_kv_heads": 8, "model.kv_latent_dim": None},  # MHA
        {"model.num_kv_heads": 4, "model.kv_latent_dim": None},  # GQA
        {"model.num_kv_heads": 2, "model.kv_latent_dim": None},  # GQA
        {"model.num_kv_heads": 1, "model.kv_latent_dim": None},  # MQA
        {"model.num_kv_heads": 8, "model.kv_latent_dim": 64},  # MLA
        {"model.num_kv_heads": 8, "model.kv_latent_dim": 32},  # MLA
    ]


def get_sweep_metric(arg=None):
    """The metric the sweep's table and plots show."""
    return "eval_val_bits_per_char"
