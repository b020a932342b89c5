"""Reading the residual stream: logit lens and direct logit attribution, from a cache of activations.

Every function takes `cache`, a mapping from TransformerLens hook names to
arrays (`cache.HOOK_SHAPES` lists them: `hook_embed`, `blocks.{l}.hook_resid_pre`,
`blocks.{l}.attn.hook_z`, `ln_final.hook_scale`, ...), with any leading batch
dims `[..., T, ...]`, and the TransformerLM's parameters:

  accumulated_resid         the residual stream before each layer (and after the last)
                            `[C, ..., T, D]` with labels "0_pre", "1_pre", ..., "final_post".
  logit_lens                each of those through the final LayerNorm (its own statistics)
                            and the head: `[C, ..., T, V]`; the last row is the logits.
  head_results              each head's write to the residual stream, z W_O per head
                            `[..., T, N, D]` (TransformerLens's hook_result).
  residual_decomposition    the final residual stream as a sum of components
                            `[C, ..., T, D]`: embed, pos_embed (learned positions), then per layer each head
                            ("L{l}H{h}"), the attention output bias ("{l}_attn_bias"),
                            the MLP ("{l}_mlp_out").
  direct_logit_attribution  each component's share of the logit of `answer` (minus that
                            of `contrast`) `[C + 1, ..., T]`, with the final LayerNorm's
                            scale frozen at its value on the whole stream; the last row,
                            "final_norm_bias", is the LayerNorm's bias term, so the rows
                            sum to the logit (difference).

The cache can come from TransformerLens's `run_with_cache` on the converted
model (`qkv_jax.interpretability.tl`), with its tensors as NumPy arrays.

`config` (the model's TransformerConfig; None: its defaults, a LayerNorm of
eps 1e-6 and no soft cap) says which final norm the parameters hold: "layernorm",
"rms" (x / s * gamma, no centring, no bias) or "rms_offset" (x / s * (1 + gamma)),
its epsilon, and final_logit_soft_cap. Without it, a final norm without bias (an RMS
kind, which one the parameters do not say) is refused. A tied head (no `head`
parameter) reads the token embedding's transpose; `hook_embed` already carries
embedding_scale. With a soft cap the logit lens applies it (its last row is the
logits) and direct logit attribution's rows sum to the logit before the cap.
Blocks with norms after their sublayers (norm_placement "post" or "sandwich")
are refused by the decomposition: their heads' results do not add to the
residual stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from qkv_jax.interpretability.circuits import _model_params, head_weights, num_layers, unembedding
from qkv_jax.norms import normalize

Array = jax.Array

__all__ = [
    "LAYER_NORM_EPS",
    "layer_norm",
    "accumulated_resid",
    "logit_lens",
    "head_results",
    "residual_decomposition",
    "direct_logit_attribution",
]

HIGHEST = lax.Precision.HIGHEST
# flax.linen.LayerNorm's default epsilon, which every LayerNorm of a TransformerLM uses.
LAYER_NORM_EPS = 1e-6


def _get(cache: Mapping[str, Any], name: str) -> Array:
    if name not in cache:
        raise ValueError(f"cache has no {name!r} (it holds {len(cache)} names, e.g. {sorted(cache)[:4]})")
    return jnp.asarray(cache[name])


def _last_axis(vector: Array, ndim: int) -> Array:
    """`vector` `[D]` as `[1, ..., 1, D]` of rank `ndim`, to broadcast along the last axis."""
    return vector.reshape((1,) * (ndim - 1) + (-1,))


def layer_norm(x: Array, scale: Array, bias: Array) -> Array:
    """flax.linen.LayerNorm (eps `LAYER_NORM_EPS`) of `x` `[..., D]` with `scale`, `bias` `[D]`."""
    centred = x - jnp.mean(x, axis=-1, keepdims=True)  # (..., D)
    std = jnp.sqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True) + LAYER_NORM_EPS)  # (..., 1)
    return centred / std * _last_axis(scale, x.ndim) + _last_axis(bias, x.ndim)


def _final_norm(params: Mapping[str, Any], config: Any, caller: str) -> tuple[str, float, Array, Array]:
    """The final norm's kind, epsilon, gain `[D]` (1 + scale for "rms_offset") and bias `[D]` (zeros
    for the RMS kinds). ValueError for an RMS norm without `config`, which says which."""
    norm = params["final_norm"]
    if config is None:
        if "bias" not in norm:
            raise ValueError(
                f"{caller}: the final norm has no bias (norm='rms' or 'rms_offset', which the parameters "
                "do not tell apart); pass config= (the model's TransformerConfig: norm, norm_epsilon, "
                "final_logit_soft_cap)"
            )
        kind, epsilon = "layernorm", LAYER_NORM_EPS
    else:
        kind, epsilon = config.norm, float(config.norm_epsilon)
    scale = jnp.asarray(norm["scale"])
    gain = 1.0 + scale if kind == "rms_offset" else scale
    bias = jnp.asarray(norm["bias"]) if kind == "layernorm" and "bias" in norm else jnp.zeros_like(scale)
    return kind, epsilon, gain, bias


def _soft_cap(config: Any) -> float | None:
    return None if config is None else config.final_logit_soft_cap


def accumulated_resid(
    cache: Mapping[str, Any], num_layers: int, *, incl_mid: bool = False
) -> tuple[Array, list[str]]:
    """The residual stream at the input of each layer and after the last: `[C, ..., T, D]`, labels.

    Rows: `blocks.{l}.hook_resid_pre` ("{l}_pre"), with `incl_mid` also
    `blocks.{l}.hook_resid_mid` ("{l}_mid"), for l < num_layers, then
    `blocks.{L-1}.hook_resid_post` ("final_post"), TransformerLens's order and labels.
    """
    rows, labels = [], []
    for layer in range(num_layers):
        rows.append(_get(cache, f"blocks.{layer}.hook_resid_pre"))
        labels.append(f"{layer}_pre")
        if incl_mid:
            rows.append(_get(cache, f"blocks.{layer}.hook_resid_mid"))
            labels.append(f"{layer}_mid")
    rows.append(_get(cache, f"blocks.{num_layers - 1}.hook_resid_post"))
    labels.append("final_post")
    return jnp.stack(rows), labels


def logit_lens(
    cache: Mapping[str, Any], params: Mapping[str, Any], *, incl_mid: bool = False, config: Any = None
) -> tuple[Array, list[str]]:
    """Logits read off the residual stream before each layer: `[C, ..., T, V]`, labels.

    Each row of `accumulated_resid` goes through the final norm (`config.norm`)
    with its own statistics, then the head (or the tied embedding) and the
    final soft cap, if any (the logit lens, nostalgebraist 2020); the last row
    ("final_post") is the model's logits.
    """
    params = _model_params(params)
    stack, labels = accumulated_resid(cache, num_layers(params), incl_mid=incl_mid)  # (C, ..., T, D)
    kind, epsilon, _, _ = _final_norm(params, config, "logit_lens")
    norm = params["final_norm"]
    normalised = normalize(
        stack,
        kind=kind,
        epsilon=epsilon,
        scale=norm["scale"],
        bias=norm.get("bias") if kind == "layernorm" else None,
    )  # (C, ..., T, D)
    logits = jnp.matmul(normalised, unembedding(params), precision=HIGHEST)  # (C, ..., T, V)
    cap = _soft_cap(config)
    return (logits if cap is None else cap * jnp.tanh(logits / cap)), labels


def head_results(cache: Mapping[str, Any], W_O: Array, layer: int) -> Array:
    """Head n's write to the residual stream at layer `layer`, `[..., T, N, D]`.

    `blocks.{layer}.attn.hook_result` when the cache holds it, else z_n W_O^n
    from `blocks.{layer}.attn.hook_z` `[..., T, N, Hv]` and `W_O` `[N, Hv, D]`
    (one layer's out kernel, e.g. `head_weights(params).W_O[layer]`). The
    layer's attention output is their sum over N plus its bias b_O.
    """
    name = f"blocks.{layer}.attn.hook_result"
    if name in cache:
        return jnp.asarray(cache[name])
    z = _get(cache, f"blocks.{layer}.attn.hook_z")  # (..., T, N, Hv)
    return jnp.einsum("...nv,nvd->...nd", z, W_O, precision=HIGHEST)  # (..., T, N, D)


def residual_decomposition(
    cache: Mapping[str, Any], params: Mapping[str, Any], *, lora_alpha: float | None = None
) -> tuple[Array, list[str]]:
    """The final residual stream split into what wrote it: `[C, ..., T, D]`, labels.

    Rows: "embed" (`hook_embed`), "pos_embed" (`hook_pos_embed`; learned
    positions only, no row without a `position_embedding`), then for each
    layer l each head "L{l}H{h}" (`head_results`), "{l}_attn_bias" (b_O) and
    "{l}_mlp_out" (`blocks.{l}.hook_mlp_out`); C = 2 + L (N + 2) (1 + L (N + 2)
    without positions). The rows sum
    to `blocks.{L-1}.hook_resid_post` (a parallel block's too). ValueError for
    norms after the sublayers (norm_placement "post", "sandwich"): the
    attention's output is then a norm of the heads' sum, not the sum.
    `lora_alpha`: as for `head_weights`.
    """
    params = _model_params(params)
    post = sorted(
        {name for layer in range(num_layers(params)) for name in params[f"block_{layer}"]}
        & {"attention_post_norm", "mlp_post_norm"}
    )
    if post:
        raise ValueError(
            f"residual_decomposition: the blocks have {', '.join(post)} (norm_placement 'post' or "
            "'sandwich'): the heads' results and the MLP's output pass a norm before the residual "
            "stream, so they are not its components"
        )
    weights = head_weights(params, lora_alpha=lora_alpha)
    embed = _get(cache, "hook_embed")  # (..., T, D)
    rows, labels = [embed], ["embed"]
    if "position_embedding" in params:
        rows.append(jnp.broadcast_to(_get(cache, "hook_pos_embed"), embed.shape))
        labels.append("pos_embed")
    for layer in range(weights.W_O.shape[0]):
        results = head_results(cache, weights.W_O[layer], layer)  # (..., T, N, D)
        rows.extend(jnp.moveaxis(results, -2, 0))  # N x (..., T, D)
        rows.append(jnp.broadcast_to(weights.b_O[layer], embed.shape))
        rows.append(_get(cache, f"blocks.{layer}.hook_mlp_out"))
        labels.extend(f"L{layer}H{head}" for head in range(results.shape[-2]))
        labels.extend([f"{layer}_attn_bias", f"{layer}_mlp_out"])
    return jnp.stack(rows), labels


def _token_directions(W_U: Array, tokens: Any, name: str, batch_rank: int) -> Array:
    """W_U's columns for `tokens` (int, or int array `[..., T]` of rank `batch_rank`): `[..., T, D]`,
    or `[1, ..., 1, D]` for one token."""
    tokens = jnp.asarray(tokens)
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(
            f"direct_logit_attribution: {name} must hold integer tokens, got dtype {tokens.dtype}"
        )
    if tokens.ndim == 0:
        return W_U.T[tokens].reshape((1,) * batch_rank + (-1,))  # (1, ..., 1, D)
    if tokens.ndim != batch_rank:
        raise ValueError(
            f"direct_logit_attribution: {name} must be one token or an array over the cache's "
            f"batch and position dims (rank {batch_rank}, size-1 dims broadcast), got shape {tokens.shape}"
        )
    return jnp.take(W_U.T, tokens, axis=0)  # (..., T, D)


def direct_logit_attribution(
    cache: Mapping[str, Any],
    params: Mapping[str, Any],
    answer: Any,
    contrast: Any = None,
    *,
    lora_alpha: float | None = None,
    config: Any = None,
) -> tuple[Array, list[str]]:
    """Each component's direct effect on the logit of `answer` (minus `contrast`'s): `[C + 1, ..., T]`.

    With the final norm's scale s frozen (`ln_final.hook_scale` `[..., T, 1]`
    from the cache, else computed from the final residual stream), the logit
    of token a is sum_c (c - mean(c)) / s * gamma . W_U[:, a] + beta . W_U[:, a]
    over the rows c of `residual_decomposition` (RMS norms: c / s, no mean;
    "rms_offset": gain 1 + gamma): one attribution per row, and a last row
    "final_norm_bias" for the bias term beta . W_U[:, a] (zero for the RMS
    kinds, which have none). The rows sum to the logit (to logit(answer) -
    logit(contrast) with `contrast`), before the final soft cap if the model has one.

    Args:
      cache: activations by hook name (see `residual_decomposition`).
      params: the TransformerLM's parameters.
      answer, contrast: one token id, or int arrays over the cache's batch and
        position dims `[..., T]` (size-1 dims broadcast, e.g. `[B, 1]` for one
        answer per sequence).
      lora_alpha: as for `head_weights`.
      config: the model's TransformerConfig (the final norm's kind and
        epsilon; see the module's doc). Needed for an RMS final norm.

    Returns:
      attributions `[C + 1, ..., T]` and their labels.
    """
    params = _model_params(params)
    kind, epsilon, gain, shift = _final_norm(params, config, "direct_logit_attribution")
    stack, labels = residual_decomposition(cache, params, lora_alpha=lora_alpha)  # (C, ..., T, D)
    W_U = unembedding(params)  # (D, V)
    batch_rank = stack.ndim - 2
    direction = _token_directions(W_U, answer, "answer", batch_rank)  # (..., T, D)
    if contrast is not None:
        direction = direction - _token_directions(W_U, contrast, "contrast", batch_rank)
    centre = kind == "layernorm"
    if "ln_final.hook_scale" in cache:
        scale = jnp.asarray(cache["ln_final.hook_scale"])  # (..., T, 1)
    else:
        final = jnp.sum(stack, axis=0)  # (..., T, D)
        if centre:
            final = final - jnp.mean(final, axis=-1, keepdims=True)
        scale = jnp.sqrt(jnp.mean(jnp.square(final), axis=-1, keepdims=True) + epsilon)  # (..., T, 1)
    centred = stack - jnp.mean(stack, axis=-1, keepdims=True) if centre else stack  # (C, ..., T, D)
    normalised = centred / scale[None]  # (C, ..., T, D)
    gain, shift = (_last_axis(vector, direction.ndim) for vector in (gain, shift))  # (1, ..., 1, D)
    attributions = jnp.sum(normalised * (gain * direction)[None], axis=-1)  # (C, ..., T)
    bias = jnp.sum(shift * direction, axis=-1)  # (..., T) or (1, ..., 1)
    bias = jnp.broadcast_to(bias, attributions.shape[1:])  # (..., T)
    return jnp.concatenate([attributions, bias[None]]), [*labels, "final_norm_bias"]
