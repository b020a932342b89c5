"""The config sections every experiment shares, each field with its comment, written once.

A config file builds its own `task` (and `data`, `eval`) sections and takes
these; keyword arguments set the experiment's values:

  config.train = common.train(steps=2000, batch_size=32, learning_rate=0.01)
  config.mesh = common.mesh()
  config.model = common.transformer(num_layers=2, d_model=128, num_heads=4, max_len=256)
"""

import ml_collections
from ml_collections import config_dict

from qkv_jax.tasks.transformer import model_fields


def base(experiment: str, seed: int = 0) -> ml_collections.ConfigDict:
    """The top of every config: what it is, and its seed."""
    config = ml_collections.ConfigDict()
    # What this config is; a workdir holding another experiment's run is refused.
    config.experiment = experiment
    # Seeds parameter init, training batches and evaluation data.
    config.seed = seed
    return config


def task(module: str, name: str) -> ml_collections.ConfigDict:
    """The `task` section's two common fields; the config adds the task's own."""
    section = ml_collections.ConfigDict()
    # The module whose build(config) returns the task's Setup (qkv_jax/training/setup.py).
    section.module = module
    # The task's short name (the summary's and the task module's).
    section.name = name
    return section


def train(
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    optimizer: str = "adam",
    weight_decay: float = 1e-4,
    grad_clip_norm: float | None = None,
    warmup_steps: int = 0,
    schedule: str = "constant",
    log_every: int = 100,
    checkpoint_every: int = 1000,
    keep_checkpoints: int = 3,
) -> ml_collections.ConfigDict:
    section = ml_collections.ConfigDict()
    # Optimizer steps.
    section.steps = steps
    # Examples per step.
    section.batch_size = batch_size
    # Peak learning rate of the schedule.
    section.learning_rate = learning_rate
    # adam, adamw or sgd.
    section.optimizer = optimizer
    # AdamW's decoupled weight decay.
    section.weight_decay = weight_decay
    # Clip the global gradient norm to this; unset = no clipping.
    section.grad_clip_norm = config_dict.placeholder(float) if grad_clip_norm is None else grad_clip_norm
    # Linear warmup steps before the schedule.
    section.warmup_steps = warmup_steps
    # constant or cosine (decays to 0 at train.steps).
    section.schedule = schedule
    # Write a metrics.jsonl line every this many steps (steps per compiled call).
    section.log_every = log_every
    # Save an orbax checkpoint every this many steps (and at the end).
    section.checkpoint_every = checkpoint_every
    # Checkpoints kept, the newest ones (0 = every one: to follow training later, e.g. in report.html).
    section.keep_checkpoints = keep_checkpoints
    # Replace a workdir that holds a different config's run (old files are moved aside).
    section.overwrite = False
    # Check every operation of the compiled step for nan and division by zero (slower).
    section.checkify = False
    # On CPU, how hard XLA optimizes the run's compiled programs: 1 (XLA's backend at level 1)
    # suits most runs; 0 (level 0, fusion emitters off where XLA has them) compiles a tiny
    # model's programs about 2x faster, for runs that are mostly compilation, but its steps run
    # 2.5-4x slower; 2 is XLA's default (benchmarks/compile_levels.py).
    section.cpu_optimization_level = 1
    # Start from another run's parameters: its workdir, checkpoints/ or one step directory (read
    # only; newest usable checkpoint; fresh optimizer, step 0). Ignored once this run has its own
    # checkpoints. Not resumable: another source is another run. Unset = fresh initialisation.
    section.init_from = config_dict.placeholder(str)
    # With init_from: mean-pool the source's K/V heads into model.num_kv_heads groups (MHA -> GQA/MQA).
    section.convert_kv_heads = False
    return section


def lm_train(
    *, steps: int, batch_size: int, warmup_steps: int, log_every: int, checkpoint_every: int
) -> ml_collections.ConfigDict:
    """The language models' recipe: AdamW at 3e-3, weight decay 0.01, gradients clipped at
    norm 1, linear warmup then cosine decay."""
    return train(
        steps=steps,
        batch_size=batch_size,
        learning_rate=3e-3,
        optimizer="adamw",
        weight_decay=0.01,
        grad_clip_norm=1.0,
        warmup_steps=warmup_steps,
        schedule="cosine",
        log_every=log_every,
        checkpoint_every=checkpoint_every,
    )


def mesh() -> ml_collections.ConfigDict:
    section = ml_collections.ConfigDict()
    # Devices the batch is split over (-1 = all devices not used by mesh.model).
    section.data = -1
    # Devices the attention heads and MLP hidden units are split over (divides the head counts).
    section.model = 1
    return section


def transformer(*, num_layers: int, d_model: int, num_heads: int, max_len) -> ml_collections.ConfigDict:
    """The `model` section of a TransformerLM (qkv_jax.TransformerConfig's fields): those below with
    their comments, then every other field of TransformerConfig unset (its default; its meaning
    is in TransformerConfig's docstring), e.g. `--config.model.norm=rms`."""
    section = ml_collections.ConfigDict()
    # Transformer blocks.
    section.num_layers = num_layers
    # Residual stream width (token and position embeddings too).
    section.d_model = d_model
    # Query heads; head depth is d_model // num_heads.
    section.num_heads = num_heads
    # Key/value heads, dividing num_heads (GQA; 1 = MQA); unset = num_heads (MHA).
    section.num_kv_heads = config_dict.placeholder(int)
    # MLA: per-token latent width the cache stores, K and V rebuilt from it; unset = off.
    section.kv_latent_dim = config_dict.placeholder(int)
    # dot_product_attention's path: reference, xla, cudnn or chunked; unset = its dispatch rule.
    section.attention_implementation = config_dict.placeholder(str)
    # MLP hidden width; unset = 4 * d_model.
    section.mlp_dim = config_dict.placeholder(int)
    # Positions the model (and its decode cache) holds; generation needs prompt + new - 1 <= this.
    section.max_len = max_len
    # Causal mask on; False trains a model that sees the tokens it predicts.
    section.causal = True
    # Dropout on the residual branches and embeddings.
    section.residual_dropout_rate = 0.0
    # The old name of residual_dropout_rate (works with a DeprecationWarning); unset.
    section.dropout_rate = config_dict.placeholder(float)
    # Dropout on the attention weights.
    section.attention_dropout_rate = 0.0
    # Computation dtype: float32, bfloat16 or float16; unset = the parameters' (float32).
    section.dtype = config_dict.placeholder(str)
    # Matmul precision (flax's `precision`): default, high or highest; unset = JAX's default
    # (TF32 for float32 on recent NVIDIA GPUs; highest = full float32).
    section.precision = config_dict.placeholder(str)
    # LoRA adapters of this rank beside the lora_targets kernels, and only they train; 0 = none.
    section.lora_rank = 0
    # The adapters' update is scaled by lora_alpha / lora_rank.
    section.lora_alpha = 16.0
    # Comma-separated: query, key, value, out (attention), kv_latent (MLA), mlp (mlp_in and mlp_out).
    section.lora_targets = "query,value"
    # Position signal: learned (a table of max_len embeddings), rope (rotary, in each head's queries
    # and keys; not with kv_latent_dim) or none (causal attention infers position).
    section.positions = "learned"
    # RoPE's base: pair i of the r rotated dims turns by position * rope_base^(-2i / r).
    section.rope_base = 10000.0
    # The leading fraction of each head's dims that RoPE rotates (int(head_dim * this), even).
    section.rope_fraction = 1.0
    # Sliding windows per layer, comma-separated and cycled over the layers: an int w = each query
    # sees itself and the w - 1 tokens before it (its decode cache keeps w positions), full = a
    # global layer; e.g. "64,full" alternates local and global layers. Unset = every layer global.
    section.window = config_dict.placeholder(str)
    # Normalize each head's queries and keys over head_dim: none, layernorm or rms.
    section.normalize_qk = "none"
    # Soft-cap the attention logits at c: c * tanh(logits / c); unset = off.
    section.attn_logits_soft_cap = config_dict.placeholder(float)
    # The factor of every attention logit q.k (jax.nn's `scale`); unset = 1/sqrt(head depth),
    # 1.0 = unscaled.
    section.attention_scale = config_dict.placeholder(float)
    # A learned sink logit per head and layer that takes attention weight and gives no value.
    section.use_sinks = False
    # The old name of use_sinks (works with a DeprecationWarning); unset.
    section.sinks = config_dict.placeholder(bool)
    for name, kind in model_fields().items():  # the rest: norms, MLP kinds, biases, RoPE scaling, ...
        if name not in section:
            section[name] = config_dict.placeholder(kind)
    return section
