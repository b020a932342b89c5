r"""A small character-level causal language model on the Python standard library.

Train (a few minutes on 2 CPU cores; reads the installed standard library's .py
files, no download), then sample from the newest checkpoint:

  python -m experiments.train --config configs/char_lm.py --workdir runs/char_lm
  python -m experiments.generate --workdir runs/char_lm --prompt "def " --max_new_tokens 200

Any text file instead of the standard library (its last 10% validates):

  python -m experiments.train --config configs/char_lm.py --workdir runs/my_text \
    --config.data.path=/path/to/file.txt

Grouped-query, multi-query and latent attention (fewer or compressed K/V heads):

  python -m experiments.train --config configs/char_lm.py --workdir runs/char_lm_mqa \
    --config.model.num_kv_heads=1
  python -m experiments.train --config configs/char_lm.py --workdir runs/char_lm_mla \
    --config.model.kv_latent_dim=16

Without the causal mask (training sees the answers; `val_bits_per_char` is
still measured with the mask):

  python -m experiments.train --config configs/char_lm.py --workdir runs/char_lm_unmasked \
    --config.model.causal=False

Fine-tuning: start from runs/char_lm's parameters (and its tokenizer) on
another text, with LoRA adapters of rank 4 on W_Q and W_V (only they train),
or uptrain it as grouped-query attention (its K/V heads mean-pooled into 2):

  python -m experiments.train --config configs/char_lm.py --workdir runs/char_lm_lora \
    --config.train.init_from=runs/char_lm --config.model.lora_rank=4 \
    --config.model.lora_targets=query,value --config.data.path=/path/to/file.txt
  python -m experiments.train --config configs/char_lm.py --workdir runs/char_lm_gqa \
    --config.train.init_from=runs/char_lm --config.train.convert_kv_heads=True \
    --config.model.num_kv_heads=2 --config.train.steps=50

Variant `tiny`: the same model at width 32 on 64-character windows, 40 steps, a small
evaluation, compiled for compile speed (`train.cpu_optimization_level=0`): seconds a run on a
CPU, for trying the commands (the guides use it); it learns little.

  python -m experiments.train --config configs/char_lm.py:tiny --workdir runs/char_lm_tiny

Variant `gpu`: the LM whose training step benchmarks/gpu.sh times (6 layers, d_model 768,
12 heads, 1024-character windows, batch 16, bfloat16 compute with float32
parameters), for an accelerator:

  python -m experiments.train --config configs/char_lm.py:gpu --workdir runs/char_lm_gpu

Variant `study`: the base of experiments/study.py (8 heads, 128-character
windows, 300 steps; about a minute a run). Its `get_sweep` is the K/V study's
grid (MHA, GQA, MQA and two MLA latents), trained through the sweep launcher:

  python -m experiments.study kv_heads --workdir runs/kv_heads --seeds 2
"""

import ml_collections
from ml_collections import config_dict

from configs import common

# variant -> its sizes: the model, the training windows, steps and checkpoints, the samples' length.
SIZES = {
    "default": dict(layers=2, width=128, heads=4, seq_len=256, steps=500, checkpoint_every=250, sample=200),
    "tiny": dict(layers=2, width=32, heads=4, seq_len=64, steps=40, checkpoint_every=40, sample=40),
    "study": dict(layers=2, width=128, heads=8, seq_len=128, steps=300, checkpoint_every=300, sample=100),
    # The GPU-sized shape (an accelerator's: bf16 compute; minutes on a CPU per step).
    "gpu": dict(layers=6, width=768, heads=12, seq_len=1024, steps=2000, checkpoint_every=500, sample=200),
}
# variant -> what it is for (`--list_configs` shows these); the first is the default.
VARIANTS = {
    "default": "2 layers at width 128 on 256-character windows, 500 steps (a few minutes on a CPU)",
    "tiny": "width 32, 64-character windows, 40 steps: seconds a run, for trying the commands",
    "study": "8 heads, 128-character windows, 300 steps: the base of experiments.study",
    "gpu": "6 layers, d_model 768, 1024-character windows, bfloat16: for an accelerator",
}


def get_config(arg=None):
    variant = arg or "default"
    if variant not in VARIANTS:
        raise ValueError(f"configs/char_lm.py:{variant}: unknown variant; choose one of {tuple(VARIANTS)}")
    sizes = SIZES[variant]
    config = common.base("char_lm")
    config.model = common.transformer(
        num_layers=sizes["layers"], d_model=sizes["width"], num_heads=sizes["heads"], max_len=sizes["seq_len"]
    )
    if variant == "gpu":
        config.model.dtype = "bfloat16"  # float32 parameters, bf16 matmuls and attention (cuDNN)

    config.task = common.task("qkv_jax.tasks.char_lm", "char_lm")
    # Characters per training window (the model predicts each one's successor).
    config.task.seq_len = sizes["seq_len"]

    config.data = ml_collections.ConfigDict()
    # A UTF-8 text file to train on; unset = the standard library's .py files.
    config.data.path = config_dict.placeholder(str)
    # Share held out: whole files of the standard library, the end of a single file.
    config.data.validation_fraction = 0.1
    # Vocabulary: the most frequent training characters, id 0 for all others.
    config.data.max_vocab_size = 128

    config.train = common.lm_train(
        steps=sizes["steps"],
        batch_size=16,
        warmup_steps=50,
        log_every=50,
        checkpoint_every=sizes["checkpoint_every"],
    )
    if variant == "tiny":
        config.train.cpu_optimization_level = 0  # its runs are mostly compilation
    config.mesh = common.mesh()

    config.eval = ml_collections.ConfigDict()
    # Windows of task.seq_len characters for the train and validation losses.
    config.eval.num_examples = 256
    # Samples.txt: text generated after this prompt ...
    config.eval.sample_prompt = "def "
    # ... this many of them ...
    config.eval.num_samples = 2
    # ... each this many characters long ...
    config.eval.sample_length = sizes["sample"]
    # ... at this temperature (0 = greedy).
    config.eval.temperature = 0.8
    # Head ablation (eval_head_ablation [layers, heads]): validation windows (at most eval.num_examples),
    # one forward pass per head; 0 = off.
    config.eval.ablation_examples = 32
    if variant == "tiny":
        config.eval.update(num_examples=64, ablation_examples=16)
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
