"""Named activations of a TransformerLM: the hook-point vocabulary, and how they are captured.

  HOOK_SHAPES   every hook name (TransformerLens's where one exists), its shape and meaning
  hook_names    the names of a model with `num_layers` blocks, in forward order
  select_names  the names a `names_filter` picks (None, a name, names, or a predicate)

Design of the capture and patching machinery (phase 2: it needs hook points
in `qkv_jax/modules.py`, `qkv_jax/lm.py` and `qkv_jax/nnx.py`):

Hook points. One parameter-free identity module, `HookPoint` (linen:
`__call__(x) -> x`; NNX: an `nnx.Module` doing the same), placed where each
name of `HOOK_SHAPES` is computed, under the module path that names it:
  TransformerLM:       hook_embed (token embedding), hook_pos_embed (broadcast to
                       [..., T, D]), the final LayerNorm's hook_scale/hook_normalized.
  TransformerBlock:    hook_resid_pre, hook_attn_out, hook_resid_mid, mlp_hook_pre
                       (before the GELU), mlp_hook_post (after it), hook_mlp_out,
                       hook_resid_post.
  LayerNorm:           a qkv_jax `LayerNorm` with nn.LayerNorm's parameters ("scale",
                       "bias", so checkpoints load unchanged) that computes
                       centred / hook_scale(std) * scale + bias and passes
                       hook_normalized (centred / std), so patching hook_scale
                       freezes the norm (attention_norm -> ln1, mlp_norm -> ln2).
  MultiHeadAttention:  hook_q [.., T, N, H], hook_k [.., S, K, H], hook_v [.., S, K, Hv]
                       (after the projections; after RoPE when there is one; grouped
                       K/V stay [K], as TransformerLens keeps them), hook_kv_latent
                       (MLA), hook_attn_scores and hook_pattern [.., n, T, S] for the
                       requested heads only (see below), hook_z [.., T, N, Hv] (the
                       input of W_O, after head_mask), hook_result [.., T, N, D] when
                       requested (the output is then the sum of the hooked per-head
                       results plus b_O, so patching a head's result changes it).
The TransformerLens name of a hook point is its path with the renames block_l
-> blocks.l, attention -> attn, attention_norm -> ln1, mlp_norm -> ln2,
final_norm -> ln_final, mlp_hook_pre/post -> mlp.hook_pre/post.

run_with_cache(model, variables, tokens, names_filter=None, **apply_kwargs)
-> (logits, {name: array}): `model.apply(..., capture_intermediates=f,
mutable=["intermediates"])` with f(module, method) true for a HookPoint's
`__call__` whose name `select_names` picks; the captured
`intermediates/.../hook_q/__call__` entries are renamed. Under `jax.jit` the
names are static (a closure or static argument) and unselected hook points
cost nothing (XLA drops them). NNX: `nnx.capture(model, nnx.Intermediate)`,
each HookPoint sowing `nnx.Intermediate` only when its static `capture` flag,
set from the filter before tracing, is on.

Patterns without materialising them. `MultiHeadAttention` gains one method,
`interpretability_request(self) -> AttentionRequest`, returning by default
`AttentionRequest(pattern_heads=(), head_results=False)` (a frozen dataclass
of static Python values). Before computing the attention it calls it; the
fast path (chunked, cuDNN, XLA, or MLA absorbed) computes the output as
today, and for the heads in `pattern_heads` only, the module computes
scores = q_h k_{h // G}^T * scale (plus masks, bias and the MLA
absorbed path's q b_K term), passes them through hook_attn_scores, softmaxes,
passes hook_pattern, and replaces those heads' outputs by pattern @ v (so a
patched pattern acts, as in TransformerLens). run_with_cache and the patching
functions wrap `model.apply` in `nn.intercept_methods(interceptor)`; the
interceptor answers `interpretability_request` for the module at path
(block_l, attention) from the names filter and a `pattern_heads={l: heads}`
argument (all heads when the filter names the layer's hook_pattern), and
calls the method itself for every other module. Cost: O(T S) memory per
requested head, nothing for the others. NNX: the same request is a static
attribute of the NNX MultiHeadAttention, set by run_with_cache before tracing.

Patching. `run_with_hooks(model, variables, tokens, hooks={name: fn})`: the
interceptor replaces a HookPoint's input x by fn(x) before calling it (and a
capture on the same call sees the patched value). Helpers build the fns:
`replace(source, heads=None, positions=None)` is
where(mask, source, x) with mask `[.., T|1, N|1, 1]` from boolean or index
selections, which may be traced; `ablate(kind="zero"|"mean")`. A sweep over
(layer, head) with a traced pair (l, h): hooks for every layer's hook_z, each
`where((layer == l) & head_onehot(h) [N, 1], clean_z[layer], x)`, so one
program serves every pair; `patching_sweep(model, variables, tokens,
clean_cache, metric, hook="attn.hook_z", over="heads"|"positions",
batch_size=None)` evaluates `jax.vmap` of it over all L x N (or L x T) pairs,
or `jax.lax.map(..., batch_size=batch_size)` over chunks of them, and returns
metric(logits) as a `[L, N]` (or `[L, T]`) matrix: one compilation, no
Python loop over pairs. NNX: HookPoint holds optional `Patch` variables
(replacement, mask; state, so traced and vmappable with `nnx.vmap`).

Generation with the KV cache. `generate_with_cache(model, params, prompt,
max_new_tokens, names_filter, ...)` runs `qkv_jax.lm.sample_tokens`'s loop
with the captured `apply` in the prefill and in the `lax.scan` step, the
step's captures being a scan output: returns (tokens, prefill cache, step
cache with a leading [max_new_tokens - 1] axis). In decode mode hook_k/hook_v
(and hook_kv_latent) hold the T positions computed in the call, hook_pattern
and hook_attn_scores all L cached slots (zero weight / -inf beyond the
filled ones); hooks and patches work the same way in the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

__all__ = ["HOOK_SHAPES", "hook_names", "select_names"]

# Name (with {l} for the layer) -> shape and meaning. N query heads, K kv heads, H and Hv
# head depths, C the MLA latent width, M the MLP width, T query and S key positions.
HOOK_SHAPES: dict[str, str] = {
    "hook_embed": "[..., T, D] token embedding",
    "hook_pos_embed": "[..., T, D] position embedding",
    "blocks.{l}.hook_resid_pre": "[..., T, D] residual stream entering block l",
    "blocks.{l}.ln1.hook_scale": "[..., T, 1] sqrt(variance + eps) of the attention LayerNorm",
    "blocks.{l}.ln1.hook_normalized": "[..., T, D] (x - mean) / scale, before the LayerNorm's affine map",
    "blocks.{l}.attn.hook_q": "[..., T, N, H] queries",
    "blocks.{l}.attn.hook_k": "[..., S, K, H] keys (K kv heads)",
    "blocks.{l}.attn.hook_v": "[..., S, K, Hv] values",
    "blocks.{l}.attn.hook_kv_latent": "[..., S, C] MLA latents (models with kv_latent_dim)",
    "blocks.{l}.attn.hook_attn_scores": "[..., N, T, S] scaled logits before the softmax, -inf where masked",
    "blocks.{l}.attn.hook_pattern": "[..., N, T, S] attention weights",
    "blocks.{l}.attn.hook_z": "[..., T, N, Hv] each head's output, before W_O",
    "blocks.{l}.attn.hook_result": "[..., T, N, D] each head's output after W_O (no b_O)",
    "blocks.{l}.hook_attn_out": "[..., T, D] attention output (sum of hook_result plus b_O)",
    "blocks.{l}.hook_resid_mid": "[..., T, D] residual stream after the attention",
    "blocks.{l}.ln2.hook_scale": "[..., T, 1] sqrt(variance + eps) of the MLP LayerNorm",
    "blocks.{l}.ln2.hook_normalized": "[..., T, D] (x - mean) / scale",
    "blocks.{l}.mlp.hook_pre": "[..., T, M] MLP hidden units before the GELU",
    "blocks.{l}.mlp.hook_post": "[..., T, M] after the GELU",
    "blocks.{l}.hook_mlp_out": "[..., T, D] MLP output",
    "blocks.{l}.hook_resid_post": "[..., T, D] residual stream leaving block l",
    "ln_final.hook_scale": "[..., T, 1] sqrt(variance + eps) of the final LayerNorm",
    "ln_final.hook_normalized": "[..., T, D] (x - mean) / scale",
}

# Names only a model with an MLA latent has.
_LATENT_ONLY = ("blocks.{l}.attn.hook_kv_latent",)


def hook_names(num_layers: int, *, latent: bool = False) -> tuple[str, ...]:
    """Every hook name of a TransformerLM with `num_layers` blocks, in forward order.

    `latent`: the model has an MLA latent (`kv_latent_dim`), whose blocks also
    have `attn.hook_kv_latent`.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"hook_names: num_layers must be a positive int, got {num_layers!r}")
    templates = [t for t in HOOK_SHAPES if latent or t not in _LATENT_ONLY]
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
