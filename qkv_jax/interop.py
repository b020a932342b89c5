"""Weight converters between `torch.nn.MultiheadAttention` and `MultiHeadAttention`.

PyTorch stores `Linear` weights as `[out, in]` and stacks the three input
projections into `in_proj_weight` `[3E, E]`; qkv_jax (like flax) stores kernels
`[in, heads, head_dim]` and `out` as `[heads, head_dim, out]`. The converters
only transpose and reshape; nothing is re-initialised.

torch is never imported at module import time: `from_torch_...` accepts any
mapping of arrays (a state dict, or the module itself) and `to_torch_...`
imports torch only when called.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["from_torch_multihead_attention", "to_torch_multihead_attention"]


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def from_torch_multihead_attention(module_or_state_dict: Any, num_heads: int) -> dict:
    """Variables for `MultiHeadAttention(num_heads, use_bias=...)` from a torch MHA.

    Args:
      module_or_state_dict: a `torch.nn.MultiheadAttention` or its `state_dict()`
        (any mapping name -> array); `add_bias_kv` is not supported.
      num_heads: the torch module's `num_heads`.

    Returns:
      `{"params": {"query": ..., "key": ..., "value": ..., "out": ...}}`, to be
      used with `MultiHeadAttention(num_heads=num_heads,
      use_bias=<torch module's bias>)`, called as torch's module is:
      `(query, key, value)` are `(inputs_q, inputs_k, inputs_v)` (their widths
      `embed_dim`, `kdim`, `vdim`). flax.linen's `MultiHeadDotProductAttention`
      takes the same variables, and `qkv_jax.nnx.linen_to_nnx` loads them
      into the nnx module.
    """
    state = module_or_state_dict
    if hasattr(state, "state_dict"):
        state = state.state_dict()
    state = {name: _to_numpy(value) for name, value in state.items()}
    if "bias_k" in state or "bias_v" in state:
        raise ValueError("from_torch_multihead_attention: add_bias_kv=True is not supported")

    if "in_proj_weight" in state:
        w_query, w_key, w_value = np.split(state["in_proj_weight"], 3, axis=0)  # 3 x (E, E)
    elif "q_proj_weight" in state:
        w_query, w_key, w_value = (state[f"{n}_proj_weight"] for n in "qkv")
    else:
        raise ValueError(
            f"from_torch_multihead_attention: no in_proj_weight or q_proj_weight in {sorted(state)}"
        )
    embed_dim = w_query.shape[0]
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"from_torch_multihead_attention: num_heads={num_heads!r} must be a positive int")
    if embed_dim % num_heads:
        raise ValueError(
            f"from_torch_multihead_attention: num_heads={num_heads} does not divide embed_dim={embed_dim}"
        )
    head_dim = embed_dim // num_heads

    def input_kernel(weight):  # (E, D_in) -> (D_in, N, H)
        return jnp.asarray(weight.T.reshape(weight.shape[1], num_heads, head_dim))

    w_out = state["out_proj.weight"]  # (D_out, E)
    params = {
        "query": {"kernel": input_kernel(w_query)},
        "key": {"kernel": input_kernel(w_key)},
        "value": {"kernel": input_kernel(w_value)},
        "out": {"kernel": jnp.asarray(w_out.T.reshape(num_heads, head_dim, w_out.shape[0]))},
    }
    if "in_proj_bias" in state:
        for name, bias in zip(("query", "key", "value"), np.split(state["in_proj_bias"], 3), strict=True):
            params[name]["bias"] = jnp.asarray(bias.reshape(num_heads, head_dim))
    if "out_proj.bias" in state:
        params["out"]["bias"] = jnp.asarray(state["out_proj.bias"])
    return {"params": params}


def to_torch_multihead_attention(variables: Any) -> dict:
    """A `torch.nn.MultiheadAttention` state dict from `MultiHeadAttention` variables.

    Only the layout torch can express converts: `num_kv_heads == num_heads`,
    equal query and value head depth, and input width = N * H (torch's
    `embed_dim`). Load it with `torch_mha.load_state_dict(state_dict)`.
    """
    try:
        import torch
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "to_torch_multihead_attention needs torch: pip install 'qkv_jax[parity]'"
        ) from error
    params = variables.get("params", variables)
    kernels = {name: np.asarray(params[name]["kernel"]) for name in ("query", "key", "value", "out")}
    d_in, num_heads, head_dim = kernels["query"].shape
    for name in ("key", "value"):
        if kernels[name].shape != kernels["query"].shape:
            raise ValueError(
                f"to_torch_multihead_attention: {name} kernel {kernels[name].shape} differs from "
                f"query kernel {kernels['query'].shape}; torch needs num_kv_heads == num_heads"
            )
    if d_in != num_heads * head_dim:
        raise ValueError(
            f"to_torch_multihead_attention: input width {d_in} != num_heads * head_dim = "
            f"{num_heads * head_dim}; torch's embed_dim must equal both"
        )
    state = {
        "in_proj_weight": np.concatenate(
            [kernels[n].reshape(d_in, -1).T for n in ("query", "key", "value")], axis=0
        ),  # (3E, E)
        "out_proj.weight": kernels["out"].reshape(num_heads * head_dim, -1).T,  # (D_out, E)
    }
    if "bias" in params["query"]:
        state["in_proj_bias"] = np.concatenate(
            [np.asarray(params[n]["bias"]).reshape(-1) for n in ("query", "key", "value")]
        )
        state["out_proj.bias"] = np.asarray(params["out"]["bias"])
    return {name: torch.from_numpy(np.array(value)) for name, value in state.items()}
