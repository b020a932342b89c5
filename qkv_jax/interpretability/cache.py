"""Named activations of a model: the hook-point vocabulary and its names filters.

  HOOK_SHAPES   every hook name of a TransformerLM (TransformerLens's), its shape and meaning
  hook_names    the names of a TransformerLM with `num_layers` blocks, in forward order
  hook_name     the name of a hook point from its module path (`block_0/attention/hook_q`
                -> `blocks.0.attn.hook_q`)
  select_names  the names a `names_filter` picks (None, a name, names, or a predicate)
  activation_spec  where a cached activation lives on a ("data", "model") mesh: batch over
                "data", heads over "model"

Where the names come from. A model passes each named activation through a
`HookPoint` (`qkv_jax.modules`, and its nnx twin in `qkv_jax.nnx`), a
parameter-free identity whose module path is the name: block_l -> blocks.l,
attention -> attn, attention_norm -> ln1, mlp_norm -> ln2,
attention_post_norm -> ln1_post, mlp_post_norm -> ln2_post, final_norm ->
ln_final, mlp_hook_pre/pre_linear/post -> mlp.hook_pre/pre_linear/post
(linen and nnx paths are the same: the nnx attributes carry the linen names). A module run on its own
has the same names without the prefix: a `MultiHeadAttention` has `hook_q`,
..., a `TransformerBlock` `attn.hook_q`, `hook_resid_pre`, ..., a
`FlagReader` `attn.hook_q`, .... Placement:
  TransformerLM: hook_embed after the token embedding; hook_pos_embed (learned
    positions only) broadcast to `[..., T, D]` before the sum.
  TransformerBlock: hook_resid_pre on entry, hook_attn_out on the attention's
    output (after its post norm, if any), hook_resid_mid, mlp.hook_pre (before
    the activation; a gated MLP's gate), mlp.hook_pre_linear (gated MLPs),
    mlp.hook_post, hook_mlp_out, hook_resid_post.
  Norms (`qkv_jax.norms`; "layernorm" has nn.LayerNorm's parameters, so
    checkpoints load unchanged): hook_scale = sqrt(var + eps) (RMS kinds:
    sqrt(mean(x^2) + eps)) `[..., T, 1]` and hook_normalized `[..., T, D]`
    before the gain; patching hook_scale freezes the norm (TransformerLens's
    trick).
  MultiHeadAttention: hook_q (after query_ln and RoPE), hook_k, hook_v (the
    new positions, after key_ln and RoPE, before the decode cache) or MLA's
    hook_kv_latent, hook_z (each head's output after head_mask, the input of
    W_O); on request, hook_attn_scores and hook_pattern for the requested
    heads only, recomputed beside the attention's own path (chunked, cuDNN,
    XLA or absorbed MLA), whose outputs for those heads become pattern @ V;
    and hook_result = z W_O per head, the output their sum plus b_O. A run
    requests them from the names it reads or changes
    (`modules.AttentionRequest`).
  The single-head modules (StaticAttention, SelfAttention(V1),
    LearnedQueryAttention, so FlagReader's readers): hook_q, hook_k, hook_v,
    hook_z with a head axis of 1, and the pattern on request.

`qkv_jax.interpretability.capture` reads and changes them (run_with_cache,
run_with_hooks, generate_with_cache), `qkv_jax.interpretability.patching`
builds hook functions and sweeps.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = ["HOOK_SHAPES", "hook_names", "hook_name", "select_names", "activation_spec"]

# Name (with {l} for the layer) -> shape and meaning. N query heads, K kv heads, H and Hv
# head depths, C the MLA latent width, M the MLP width, T query and S key positions.
HOOK_SHAPES: dict[str, str] = {
    "hook_embed": "[..., T, D] token embedding",
    "hook_pos_embed": "[..., T, D] position embedding",
    "blocks.{l}.hook_resid_pre": "[..., T, D] residual stream entering block l",
    "blocks.{l}.ln1.hook_scale": "[..., T, 1] sqrt(variance + eps) of the attention norm (RMS kinds:"
    " sqrt(mean(x^2) + eps))",
    "blocks.{l}.ln1.hook_normalized": "[..., T, D] (x - mean) / scale (RMS kinds: x / scale), before the"
    " norm's gain",
    "blocks.{l}.attn.hook_q": "[..., T, N, H] queries",
    "blocks.{l}.attn.hook_k": "[..., S, K, H] keys (K kv heads)",
    "blocks.{l}.attn.hook_v": "[..., S, K, Hv] values",
    "blocks.{l}.attn.hook_kv_latent": "[..., S, C] MLA latents (models with kv_latent_dim)",
    "blocks.{l}.attn.hook_attn_scores": "[..., n, T, S] scaled logits before the softmax, -inf where masked"
    " (the n requested heads; all N by default)",
    "blocks.{l}.attn.hook_pattern": "[..., n, T, S] attention weights (the n requested heads)",
    "blocks.{l}.attn.hook_z": "[..., T, N, Hv] each head's output, before W_O",
    "blocks.{l}.attn.hook_result": "[..., T, N, D] each head's output after W_O (no b_O)",
    "blocks.{l}.ln1_post.hook_scale": "[..., T, 1] of the norm after the attention (norm_placement"
    " post or sandwich)",
    "blocks.{l}.ln1_post.hook_normalized": "[..., T, D] the attention output normalized",
    "blocks.{l}.hook_attn_out": "[..., T, D] attention output (sum of hook_result plus b_O)",
    "blocks.{l}.hook_resid_mid": "[..., T, D] residual stream after the attention",
    "blocks.{l}.ln2.hook_scale": "[..., T, 1] sqrt(variance + eps) of the MLP norm",
    "blocks.{l}.ln2.hook_normalized": "[..., T, D] (x - mean) / scale",
    "blocks.{l}.mlp.hook_pre": "[..., T, M] MLP hidden units before the activation (gated: the gate's)",
    "blocks.{l}.mlp.hook_pre_linear": "[..., T, M] gated MLPs: mlp_in's output, which the activated"
    " gate multiplies",
    "blocks.{l}.mlp.hook_post": "[..., T, M] after the activation (gated: times hook_pre_linear)",
    "blocks.{l}.ln2_post.hook_scale": "[..., T, 1] of the norm after the MLP (norm_placement post or"
    " sandwich)",
    "blocks.{l}.ln2_post.hook_normalized": "[..., T, D] the MLP output normalized",
    "blocks.{l}.hook_mlp_out": "[..., T, D] MLP output",
    "blocks.{l}.hook_resid_post": "[..., T, D] residual stream leaving block l",
    "ln_final.hook_scale": "[..., T, 1] sqrt(variance + eps) of the final norm",
    "ln_final.hook_normalized": "[..., T, D] (x - mean) / scale",
}

# Names only a model with an MLA latent has, only a gated MLP, and the pre and post norms' names.
_LATENT_ONLY = ("blocks.{l}.attn.hook_kv_latent",)
_GATED_ONLY = ("blocks.{l}.mlp.hook_pre_linear",)
_PRE_NORMS = tuple(t for t in HOOK_SHAPES if t.startswith(("blocks.{l}.ln1.", "blocks.{l}.ln2.")))
_POST_NORMS = tuple(t for t in HOOK_SHAPES if t.startswith(("blocks.{l}.ln1_post.", "blocks.{l}.ln2_post.")))


def hook_names(
    num_layers: int, *, latent: bool = False, gated: bool = False, norm_placement: str = "pre"
) -> tuple[str, ...]:
    """Every hook name of a TransformerLM with `num_layers` blocks, in forward order.

    `latent`: the model has an MLA latent (`kv_latent_dim`), whose blocks also
    have `attn.hook_kv_latent`; `gated`: a gated MLP (`gated_mlp`), with
    `mlp.hook_pre_linear`; `norm_placement`: the config's ("pre": ln1 and
    ln2; "post": ln1_post and ln2_post; "sandwich": all four).
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"hook_names: num_layers must be a positive int, got {num_layers!r}")
    left_out = {
        *(() if latent else _LATENT_ONLY),
        *(() if gated else _GATED_ONLY),
        *(_PRE_NORMS if norm_placement == "post" else ()),
        *(_POST_NORMS if norm_placement == "pre" else ()),
    }
    templates = [t for t in HOOK_SHAPES if t not in left_out]
    per_layer = [t for t in templates if t.startswith("blocks.")]
    head = [t for t in templates if t.startswith("hook_")]
    tail = [t for t in templates if t.startswith("ln_final.")]
    layers = [t.format(l=layer) for layer in range(num_layers) for t in per_layer]
    return (*head, *layers, *tail)


def select_names(
    names: Iterable[str], names_filter: None | str | Iterable[str] | Callable[[str], bool]
) -> tuple[str, ...]:
    """The names of `names` that `names_filter` picks, in their order.

    `names_filter`: None (all), one name, an iterable of names (each must be
    in `names`: a ValueError names the unknown ones), or a predicate
    `name -> bool` (as TransformerLens's `names_filter`).
    """
    names = tuple(names)
    if names_filter is None:
        return names
    if callable(names_filter):
        return tuple(name for name in names if names_filter(name))
    wanted = {names_filter} if isinstance(names_filter, str) else set(names_filter)
    unknown = sorted(wanted - set(names))
    if unknown:
        raise ValueError(
            f"select_names: names_filter has unknown names {unknown}; the names are e.g. {list(names[:4])}"
        )
    return tuple(name for name in names if name in wanted)


# Module names whose hook names differ (TransformerLens's): a block is `blocks.{l}`.
_RENAMES = {
    "attention": "attn",
    "attention_norm": "ln1",
    "mlp_norm": "ln2",
    "final_norm": "ln_final",
    "attention_post_norm": "ln1_post",
    "mlp_post_norm": "ln2_post",
    "mlp_hook_pre": "mlp.hook_pre",
    "mlp_hook_pre_linear": "mlp.hook_pre_linear",
    "mlp_hook_post": "mlp.hook_post",
}


def hook_name(path: Sequence[Any]) -> str:
    """The hook name of a module path (linen `module.path`, or an nnx attribute path):
    `("block_0", "attention", "hook_q")` -> `"blocks.0.attn.hook_q"`; `()` -> `""`."""
    parts = []
    for part in path:
        block = re.fullmatch(r"block_(\d+)", str(part))
        parts.append(f"blocks.{block[1]}" if block else _RENAMES.get(str(part), str(part)))
    return ".".join(parts)


# HOOK_SHAPES's head axes: split over a mesh's "model" axis.
_HEAD_AXES = ("N", "K", "n")


def activation_spec(name: str, shape: Sequence[int], axis_sizes: Mapping[str, int]) -> tuple[str | None, ...]:
    """Where a cached activation of a ("data", "model") mesh of `axis_sizes` lives: its first
    batch axis over "data" and its head axis (`N`, `K` or `n` in HOOK_SHAPES) over "model",
    each where it divides; every other axis whole. Names not in HOOK_SHAPES stay whole."""
    template = HOOK_SHAPES.get(re.sub(r"^blocks\.\d+\.", "blocks.{l}.", name))
    if template is None:
        return (None,) * len(shape)
    axes = template[template.index("[") + 1 : template.index("]")].split(", ")[1:]  # after "..."
    batch = len(shape) - len(axes)
    named = [None] * batch + ["model" if axis in _HEAD_AXES else None for axis in axes]
    if batch:
        named[0] = "data"
    return tuple(
        axis if axis and axis_sizes.get(axis, 1) > 1 and size % axis_sizes[axis] == 0 else None
        for axis, size in zip(named, shape, strict=True)
    )
