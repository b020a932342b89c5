r"""Fine-tune a pretrained Hugging Face model on a text file (LoRA or full), or uptrain it as GQA/MQA.

DIR is a Hugging Face model directory (config.json, model.safetensors, tokenizer.json: a Llama,
GPT-2, Qwen, ... that qkv_jax.load_pretrained reads) or a workdir of this task; FILE a UTF-8
text file, cut into documents at blank lines (data.separator), its last 10% of documents
validating. The model is DIR's; each model field set here or on the command line replaces
DIR's (all are unset but the adapters').

LoRA adapters of rank 4 on W_Q and W_V (only they train), a full fine-tune, MHA -> GQA with
K/V heads mean-pooled into 2, then a directory transformers loads (adapters merged):

  python -m experiments.train --config configs/pretrained_text.py --workdir runs/ft_lora \
    --config.train.init_from=DIR --config.data.path=FILE --config.model.lora_rank=4
  python -m experiments.train --config configs/pretrained_text.py --workdir runs/ft_full \
    --config.train.init_from=DIR --config.data.path=FILE --config.train.learning_rate=3e-5
  python -m experiments.train --config configs/pretrained_text.py --workdir runs/ft_gqa \
    --config.train.init_from=DIR --config.data.path=FILE \
    --config.train.convert_kv_heads=True --config.model.num_kv_heads=2
  python -m experiments.export --workdir runs/ft_lora --out runs/ft_lora_hf
"""

import ml_collections
from ml_collections import config_dict

from configs import common
from qkv_jax.tasks.transformer import model_fields


def model() -> ml_collections.ConfigDict:
    """The `model` section: every TransformerConfig field unset (the checkpoint's value), but
    the LoRA adapters'."""
    section = ml_collections.ConfigDict()
    # LoRA adapters of this rank beside the lora_targets kernels, and only they train; 0 = none
    # (a full fine-tune).
    section.lora_rank = 0
    # The adapters' update is scaled by lora_alpha / lora_rank.
    section.lora_alpha = 16.0
    # Comma-separated: query, key, value, out (attention), mlp (mlp_in and mlp_out).
    section.lora_targets = "query,value"
    for name, kind in model_fields().items():  # e.g. num_kv_heads, max_len, dtype: unset = the checkpoint's
        if name not in section:
            section[name] = config_dict.placeholder(kind)
    return section


def get_config():
    config = common.base("pretrained_text")
    config.task = common.task("qkv_jax.tasks.pretrained_text", "pretrained_text")
    # Tokens per training row (at most the model's max_position_embeddings).
    config.task.seq_len = 256

    config.data = ml_collections.ConfigDict()
    # The UTF-8 text file to fine-tune on (required).
    config.data.path = config_dict.placeholder(str)
    # Documents are separated by this string (a blank line); '' = the whole file is one document.
    config.data.separator = "\n\n"
    # The last share of the documents validates (one document: the end of its text).
    config.data.validation_fraction = 0.1

    config.model = model()
    config.train = common.train(
        steps=300,
        batch_size=8,
        learning_rate=2e-4,
        optimizer="adamw",
        weight_decay=0.0,
        grad_clip_norm=1.0,
        warmup_steps=20,
        schedule="cosine",
        log_every=20,
        checkpoint_every=100,
    )
    config.mesh = common.mesh()

    config.eval = ml_collections.ConfigDict()
    # Rows of task.seq_len tokens for the train and validation losses (all validation rows when fewer).
    config.eval.num_examples = 64
    return config
