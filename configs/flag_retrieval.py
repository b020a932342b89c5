r"""Flag retrieval: learned Q/K/V attention finds a flagged token; static attention cannot.

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

  thermostat the learned-query model at d_k=256, where the 1/sqrt(d_k) scale matters:
             python -m experiments.train --config configs/flag_retrieval.py:thermostat \
               --workdir runs/thermostat --config.model.scaled=False
  logit_scale  one MultiHeadAttention head at d_k=256, the base of the logit_scale study
             (no scale, 1/sqrt(d_k), QK-norm, a soft cap; see experiments/study.py):
             python -m experiments.train --config configs/flag_retrieval.py:logit_scale \
               --workdir runs/flag_qk_norm --config.model.scaled=False --config.model.normalize_qk=rms

Any field can be overridden, e.g. --config.train.steps=500 --config.model.d_k=4.

Sweeps (`get_sweep(variant)` gives each variant's grid; see docs/experiments.md):

  python -m experiments.sweep --config configs/flag_retrieval.py:two_flag \
      --workdir runs/two_flag_heads --seeds 4
"""

import ml_collections

from configs import common

# variant -> what it trains (`--list_configs` shows these); the first is the default.
VARIANTS = {
    "learned_query": "one learned query vector with W_q, W_k, W_v (the main job)",
    "static": "nothing trainable: Q = K = V = X, the mean token as the query (the baseline)",
    "multihead": "MultiHeadAttention with a learned query token and W_O",
    "two_flag": "two flag channels; the target is both flagged contents",
    "thermostat": "the learned-query model at d_k=256, where the 1/sqrt(d_k) scale matters",
    "logit_scale": "one MultiHeadAttention head at d_k=256, the base of the logit_scale study",
}
# The logit_scale study's ways of keeping the attention logits in range, as model overrides:
# no scale, 1/sqrt(d_k), QK-norm (RMS) without and with the scale, a soft cap at 5 without it.
LOGIT_SCALE_ARMS = tuple(
    {"model.scaled": scaled, "model.normalize_qk": norm, "model.attn_logits_soft_cap": cap}
    for scaled, norm, cap in [
        (False, "none", None),
        (True, "none", None),
        (False, "rms", None),
        (True, "rms", None),
        (False, "none", 5.0),
    ]
)


def get_config(arg=None):
    variant = arg or "learned_query"
    if variant not in VARIANTS:
        raise ValueError(
            f"configs/flag_retrieval.py:{variant}: unknown variant; choose one of {tuple(VARIANTS)}"
        )
    config = common.base("flag_retrieval")

    config.model = ml_collections.ConfigDict()
    multihead = {"multihead", "two_flag", "logit_scale"}
    # learned_query (one learned query vector with W_q, W_k, W_v), static (no parameters) or multihead.
    config.model.kind = (
        "static" if variant == "static" else "multihead" if variant in multihead else "learned_query"
    )
    # Token width: content channels plus task.num_flags flag channels.
    config.model.d_model = 8
    # Total query/key width, split evenly over the heads.
    config.model.d_k = 256 if variant in ("thermostat", "logit_scale") else 8
    # Total value width (multihead only), split over the heads; unset = model.d_k. two_flag
    # sets it to the target width (2 x 6 content channels), enough to carry both contents.
    config.model.d_v = ml_collections.config_dict.placeholder(int)
    if variant == "two_flag":
        config.model.d_v = 12
    # Attention heads (multihead only; the others have one).
    config.model.num_heads = 2 if variant in ("multihead", "two_flag") else 1
    # Divide logits by sqrt(head depth) (the softmax's thermostat); False = unscaled.
    config.model.scaled = True
    # Matmul precision (flax's `precision`): default, high or highest; unset = JAX's default.
    config.model.precision = ml_collections.config_dict.placeholder(str)
    # multihead only: normalize each head's queries and keys over its depth: none, layernorm or rms.
    config.model.normalize_qk = "none"
    # multihead only: soft-cap the attention logits at c, c * tanh(logits / c); unset = off.
    config.model.attn_logits_soft_cap = ml_collections.config_dict.placeholder(float)

    config.task = common.task("qkv_jax.tasks.flag_retrieval", "flag_retrieval")
    # Tokens per example.
    config.task.seq_len = 5
    # Flag channels; the target is the content at every flagged position.
    config.task.num_flags = 2 if variant == "two_flag" else 1

    # Adam at the PyTorch reference loop's learning rate (benchmarks/flag_retrieval_torch.py).
    config.train = common.train(steps=2000, batch_size=32, learning_rate=0.01)
    config.mesh = common.mesh()

    config.eval = ml_collections.ConfigDict()
    # Fresh examples for the final (and untrained) evaluation.
    config.eval.num_examples = 10000
    # Examples drawn in attention_before.png / attention_after.png.
    config.eval.num_plot_examples = 8
    return config


def get_sweep(arg=None):
    """The grid `python -m experiments.sweep` runs for each variant when no --sweep is given."""
    variant = arg or "learned_query"
    if variant == "learned_query":  # the smallest d_k that solves the one-flag task
        return {"model.d_k": [1, 2, 4, 8]}
    if variant == "two_flag":  # heads at equal total query/key (and value) width
        return {"model.d_k": [4, 8, 16], "model.num_heads": [1, 2, 4]}
    if variant == "thermostat":  # with and without 1/sqrt(d_k), at small and large d_k
        return {"model.d_k": [8, 64, 256, 1024], "model.scaled": [True, False]}
    if variant == "logit_scale":  # each way of keeping the logits in range, at each d_k
        return [{"model.d_k": d_k, **arm} for d_k in (16, 64, 256, 1024) for arm in LOGIT_SCALE_ARMS]
    if variant == "multihead":
        return {"model.d_k": [2, 4, 8, 16], "model.num_heads": [1, 2, 4]}
    raise ValueError(f"configs/flag_retrieval.py:{variant}: no sweep defined for this variant")


def get_sweep_metric(arg=None):
    """The metric the sweep's table and plots show."""
    return "eval_decode_accuracy" if arg == "two_flag" else "eval_accuracy"
