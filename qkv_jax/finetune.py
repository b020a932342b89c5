"""Starting one model from another's parameters: fitting, K/V head conversion, head ablation.

  fit_params           a source's parameters put into a target's structure: the shapes
                       checked (ParamMismatchError naming the first parameter that does
                       not fit, and both shapes), the target's extra LoRA adapters kept
                       as initialised, the source's adapters merged where the target has
                       none.
  convert_kv_heads     multi-head attention parameters turned into grouped-query (GQA) or
                       multi-query (MQA) ones: each group's key and value heads (kernels
                       and biases) mean-pooled into one, as Ainslie et al. (2023, "GQA")
                       convert a trained MHA checkpoint before uptraining it.
  head_ablation_masks  the `[L * N, L, N]` head masks that each switch one head off
                       (`TransformerLM(..., head_mask=)`).

The functions work on plain parameter trees (nested dicts of arrays, as
`TransformerLM.init(...)["params"]`); `qkv_jax.lora.merge_lora` folds adapters
into their kernels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qkv_jax.lora import ADAPTER_NAMES, merge_lora

__all__ = ["ParamMismatchError", "fit_params", "convert_kv_heads", "head_ablation_masks"]


class ParamMismatchError(ValueError):
    """A source's parameters do not fit the target model; the message names the parameter."""


def _names(path: tuple) -> str:
    return "/".join(str(getattr(entry, "key", getattr(entry, "idx", entry))) for entry in path)


def _flat(params: Any) -> dict[str, Any]:
    """{'block_0/attention/query/kernel': leaf, ...} in the tree's (sorted) order."""
    return {_names(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def _merge_unmatched_adapters(source: Any, target: Any, alpha: float | None, path: str = "") -> Any:
    """`source` with each adapter that has no counterpart in `target` folded into its kernel."""
    if not isinstance(source, Mapping):
        return source
    target = target if isinstance(target, Mapping) else {}
    if "lora_a" in source and "lora_a" not in target:
        if alpha is None:
            raise ParamMismatchError(
                f"the source has a LoRA adapter at {path}lora_a that this model lacks, and no "
                "lora_alpha to merge it with"
            )
        return merge_lora(source, alpha)
    return {
        name: _merge_unmatched_adapters(value, target.get(name), alpha, f"{path}{name}/")
        for name, value in source.items()
    }


def fit_params(
    source: Any, target: Any, *, source_lora_alpha: float | None = None, num_kv_heads: int | None = None
) -> Any:
    """`target`'s structure filled with `source`'s values (cast to the target's dtypes).

    Rules, checked in the target's (sorted) parameter order, the first failure
    raising ParamMismatchError with the parameter's path and both shapes:
      * a parameter of both must have the same shape;
      * a target parameter the source lacks is an error, unless it is a LoRA
        adapter factor (`lora_a`, `lora_b`): it keeps its value in `target`
        (B = 0 at initialisation, so the model starts as the source);
      * a source parameter the target lacks is an error, except a LoRA adapter
        where the target has none: it is merged into its kernel first
        (`merge_lora` with `source_lora_alpha`, the source's `lora_alpha`).
    `num_kv_heads`: convert the source's attention K/V heads to this many
    groups first (`convert_kv_heads`), to start a GQA/MQA model from an MHA one.
    """
    source = _merge_unmatched_adapters(source, target, source_lora_alpha)
    if num_kv_heads is not None:
        source = convert_kv_heads(source, num_kv_heads)
    flat_source = _flat(source)
    fitted = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(target):
        name = _names(path)
        if name not in flat_source:
            if name.rsplit("/", 1)[-1] not in ADAPTER_NAMES:
                raise ParamMismatchError(f"parameter {name} {list(np.shape(leaf))} is not in the source")
            fitted.append(leaf)
            continue
        value = flat_source.pop(name)
        if np.shape(value) != np.shape(leaf):
            raise ParamMismatchError(
                f"parameter {name} is {list(np.shape(value))} in the source but {list(np.shape(leaf))} "
                "in this model"
            )
        fitted.append(jnp.asarray(value, dtype=leaf.dtype))
    if flat_source:
        name = next(iter(flat_source))
        raise ParamMismatchError(
            f"parameter {name} {list(np.shape(flat_source[name]))} of the source has no place in this model"
        )
    return jax.tree.unflatten(jax.tree.structure(target), fitted)


def _pool_heads(projection: Mapping[str, Any], num_kv_heads: int, path: str) -> dict:
    """One key or value projection (kernel `[D, K, H]`, bias `[K, H]`) with each group of
    K / num_kv_heads consecutive heads replaced by their mean: kernel `[D, num_kv_heads, H]`."""
    if any(name in projection for name in ADAPTER_NAMES):
        raise ValueError(f"convert_kv_heads: {path} has a LoRA adapter; merge_lora the parameters first")
    kernel = jnp.asarray(projection["kernel"])
    width, heads, depth = kernel.shape
    if heads % num_kv_heads:
        raise ValueError(
            f"convert_kv_heads: num_kv_heads={num_kv_heads} does not divide {path}'s {heads} heads"
        )
    group = heads // num_kv_heads
    pooled = {
        "kernel": kernel.reshape(width, num_kv_heads, group, depth).mean(axis=2).astype(kernel.dtype)
    }  # (D, K', H)
    if "bias" in projection:
        bias = jnp.asarray(projection["bias"])
        pooled["bias"] = bias.reshape(num_kv_heads, group, depth).mean(axis=1).astype(bias.dtype)  # (K', H)
    return pooled


def convert_kv_heads(params: Any, num_kv_heads: int, path: str = "") -> Any:
    """`params` with every attention's key and value heads mean-pooled into `num_kv_heads` groups.

    An attention is a dict holding `query`, `key` and `value` projections
    (`MultiHeadAttention`'s layout; with MLA the key and value up-projections
    `[C, K, H]` are pooled the same way, the latent is kept). Query head n
    reads kv head n // (N / K), so group g pools heads g * G .. g * G + G - 1
    (G = K / num_kv_heads): with num_kv_heads = K the parameters come back
    unchanged, and a model whose heads within each group are equal computes
    the same outputs after conversion. The result loads into the same model
    with `num_kv_heads` set (e.g. `TransformerLM(dataclasses.replace(config, num_kv_heads=2))`).
    ValueError when num_kv_heads does not divide a layer's K/V heads, a K/V
    projection has a LoRA adapter, or `params` holds no attention.
    """
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads <= 0:
        raise ValueError(f"convert_kv_heads: num_kv_heads must be a positive int, got {num_kv_heads!r}")
    if not path and not _has_attention(params):
        raise ValueError("convert_kv_heads: no attention (query/key/value projections) in the parameters")
    if not isinstance(params, Mapping):
        return params
    if {"query", "key", "value"} <= set(params):
        return {
            name: _pool_heads(value, num_kv_heads, f"{path}{name}") if name in ("key", "value") else value
            for name, value in params.items()
        }
    return {name: convert_kv_heads(value, num_kv_heads, f"{path}{name}/") for name, value in params.items()}


def _has_attention(params: Any) -> bool:
    if not isinstance(params, Mapping):
        return False
    return {"query", "key", "value"} <= set(params) or any(_has_attention(v) for v in params.values())


def head_ablation_masks(num_layers: int, num_heads: int) -> jax.Array:
    """`[L * N, L, N]` float32 masks: mask i is all ones but head (i // N, i % N), which is 0."""
    return 1.0 - jnp.eye(num_layers * num_heads, dtype=jnp.float32).reshape(-1, num_layers, num_heads)
