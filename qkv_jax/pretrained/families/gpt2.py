"""GPT-2: pre-LayerNorm blocks with learned positions, a GELU MLP, biases everywhere and the head
tied to the token embedding.

Tensors (`GPT2LMHeadModel.save_pretrained`; the Hub's original checkpoints have no
`transformer.` prefix): `wte`, `wpe`, per layer `h.{i}.ln_1`, `attn.c_attn` (query, key and
value fused along the output: a Conv1D weight `[D, 3D]`, already `[in, out]`), `attn.c_proj`,
`ln_2`, `mlp.c_fc`, `mlp.c_proj`, then `ln_f`; the stored causal-mask buffers `attn.bias` and
`attn.masked_bias` are skipped.

Refused: `scale_attn_by_inverse_layer_idx` and `reorder_and_upcast_attn` (True), and
`add_cross_attention`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

import qkv_jax.pretrained.families.common as common
from qkv_jax.lm import TransformerConfig
from qkv_jax.pretrained.families.common import ConfigReader, Field, Tensor, TensorSource

MODEL_TYPES = ("gpt2",)
ACTIVATION_DEFAULT = "gelu_new"
# config.json fields read and written as they are (the others are in to_config and hf_config).
FIELDS = {
    "vocab_size": Field("vocab_size"),
    "n_layer": Field("num_layers"),
    "n_embd": Field("d_model"),
    "n_head": Field("num_heads"),
    "n_inner": Field("mlp_dim", None),
    "n_positions": Field("max_len", 1024),
    "layer_norm_epsilon": Field("norm_epsilon", 1e-5),
    "tie_word_embeddings": Field("tie_embeddings", True),
    "attn_pdrop": Field("attention_dropout_rate", 0.1),
    "resid_pdrop": Field("residual_dropout_rate", 0.1),
}


def to_config(hf: ConfigReader) -> TransformerConfig:
    """The TransformerConfig of a GPT-2 config.json."""
    hf.accept("scale_attn_by_inverse_layer_idx", False)
    hf.accept("reorder_and_upcast_attn", False)
    hf.accept("add_cross_attention", False)
    for name in ("summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels"):
        hf.get(name)  # the sequence-summary head of GPT2DoubleHeadsModel, not the language model
    hf.get("summary_first_dropout")
    hf.get("embd_pdrop")  # the embeddings' dropout; qkv_jax's residual dropout covers them
    hf.get("n_ctx")  # the original files' context length, which transformers does not read
    return TransformerConfig(
        **common.read_fields(hf, FIELDS),
        positions="learned",
        norm="layernorm",
        mlp_activation=common.activation(hf, "activation_function", ACTIVATION_DEFAULT),
        attention_scale=None if hf.accept("scale_attn_weights", True, False) else 1.0,
    )


def _prefix(tensors: TensorSource) -> str:
    """ "transformer." (save_pretrained's names) or "" (the Hub's original GPT-2 files)."""
    return "transformer." if tensors.has("transformer.wte.weight") else ""


def _tensors(config: TransformerConfig, prefix: str) -> list[Tensor]:
    """Every parameter but the fused query/key/value, with its Hugging Face name and layout."""
    N = config.num_heads
    table = [
        Tensor("token_embedding/embedding", f"{prefix}wte.weight"),
        Tensor("position_embedding", f"{prefix}wpe.weight"),
    ]
    for i in range(config.num_layers):
        block, layer = f"block_{i}", f"{prefix}h.{i}"
        table += common.norm_tensors(f"{block}/attention_norm", f"{layer}.ln_1", True)
        table += common.dense_tensors(
            f"{block}/attention/out", f"{layer}.attn.c_proj", True, "conv1d_heads_out", N
        )
        table += common.norm_tensors(f"{block}/mlp_norm", f"{layer}.ln_2", True)
        table += common.dense_tensors(f"{block}/mlp_in", f"{layer}.mlp.c_fc", True, "conv1d")
        table += common.dense_tensors(f"{block}/mlp_out", f"{layer}.mlp.c_proj", True, "conv1d")
    table += common.norm_tensors("final_norm", f"{prefix}ln_f", True)
    return table if config.tie_embeddings else [*table, Tensor("head/kernel", "lm_head.weight", "linear")]


def from_hf(config: TransformerConfig, tensors: TensorSource) -> Iterator[tuple[str, np.ndarray]]:
    """The linen parameters of a GPT-2 checkpoint."""
    prefix, N = _prefix(tensors), config.num_heads
    buffers = [
        f"{prefix}h.{i}.attn.{name}" for i in range(config.num_layers) for name in ("bias", "masked_bias")
    ]
    common.skip_stored(tensors, config, "lm_head.weight", buffers)
    yield from common.read_tensors(_tensors(config, prefix), tensors)
    for i in range(config.num_layers):
        weight = tensors.get(f"{prefix}h.{i}.attn.c_attn.weight")  # (D, 3 N*H)
        bias = tensors.get(f"{prefix}h.{i}.attn.c_attn.bias")  # (3 N*H,)
        for part, name in enumerate(("query", "key", "value")):
            columns = np.split(weight, 3, axis=1)[part]  # (D, N*H)
            yield f"block_{i}/attention/{name}/kernel", columns.reshape(weight.shape[0], N, -1)  # (D, N, H)
            yield f"block_{i}/attention/{name}/bias", np.split(bias, 3)[part].reshape(N, -1)  # (N, H)


def to_hf(config: TransformerConfig, params: Mapping[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """The Hugging Face tensors (save_pretrained's names) of a GPT-2-shaped model."""
    yield from common.write_tensors(_tensors(config, "transformer."), params)
    for i in range(config.num_layers):
        kernels = common.qkv_arrays(params, i, "kernel")  # (D, N, H)
        biases = common.qkv_arrays(params, i, "bias")  # (N, H)
        yield (
            f"transformer.h.{i}.attn.c_attn.weight",
            np.concatenate([k.reshape(k.shape[0], -1) for k in kernels], 1),
        )
        yield f"transformer.h.{i}.attn.c_attn.bias", np.concatenate([b.reshape(-1) for b in biases])


def hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The config.json of `config` as GPT-2."""
    return dict(
        model_type="gpt2",
        architectures=["GPT2LMHeadModel"],
        **common.write_fields(config, FIELDS),
        activation_function=common.hf_activation(config),
        scale_attn_weights=config.attention_scale is None,
        embd_pdrop=config.residual_dropout_rate,
    )
