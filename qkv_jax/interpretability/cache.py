"""Named activations of a TransformerLM: the hook-point vocabulary, and how they are captured.

  HOOK_SHAPES   every hook name (TransformerLens's where one exists), its shape and meaning
  hook_names    the names of a model with `num_layers` blocks, in forward order
  select_names  the names a `names_filter` picks (None, a name, names, or a predicate)

Design of the capture and patching machinery (the next step: it needs hook
points in `qkv_jax/modules.py`, `qkv_jax/lm.py` and `qkv_jax/nnx.py`):

1. Hook points. `modules.HookPoint`, a parameter-free linen module with
`__call__(x) -> x`, and its `nnx.Module` twin in `nnx.py`. A hook point's
name is its module path, renamed: block_l -> blocks.l, attention -> attn,
attention_norm -> ln1, mlp_norm -> ln2, final_norm -> ln_final,
mlp_hook_pre/post -> mlp.hook_pre/post (linen and nnx paths are the same:
the nnx attributes carry the linen names). Placement:
  TransformerLM (lm.py, nnx.py): hook_embed after the token embedding,
    hook_pos_embed (broadcast to [..., T, D]) before the sum.
  TransformerBlock: hook_resid_pre on entry, hook_attn_out on the attention's
    output, hook_resid_mid, mlp_hook_pre (before the GELU), mlp_hook_post,
    hook_mlp_out, hook_resid_post.
  LayerNorm: a `modules.LayerNorm` with nn.LayerNorm's parameters ("scale",
    "bias": checkpoints load unchanged) computing centred / hook_scale(std)
    * scale + bias with hook_normalized(centred / std) in between, so
    patching hook_scale freezes the norm (TransformerLens's trick); the
    blocks' and the final norm use it (nnx: the same with nnx parameters).
  MultiHeadAttention: `AttentionLayers` gains two fields, `hook: (name, x)
    -> x` and `request: AttentionRequest`. Linen's `_layers` sets
    hook = lambda name, x: HookPoint(name=name, parent=self)(x) and nnx's
    routes to its `hooks` dict of HookPoint submodules; the pure functions
    call it: `project_inputs` on hook_q (after query_ln, and after RoPE when
    there is one), hook_k, hook_v, or hook_kv_latent (the T new positions,
    before the decode cache); `attend_entries` on hook_z (after head_mask, the
    input of W_O) and, when `request.head_results`, on hook_result =
    einsum(z, effective W_O) [.., T, N, D], the output then being its sum
    over heads plus b_O (so a patched head result acts).

2. Patterns only for the heads asked for. `request.pattern_heads`, a static
tuple of head indices, default (). The attention computes its output on its
usual path (chunked, cuDNN, XLA, or MLA absorbed); then, for those heads
only, scores = q_h k_(h // G)^T * scale with the masks (-inf where masked;
on the absorbed path from the query's latent projection, plus q_h b_K *
scale so that the scores equal the rebuilt-K path's), hook_attn_scores,
softmax, hook_pattern, and those heads' outputs are replaced by
pattern @ v (so a patched pattern acts, as in TransformerLens). O(T S)
memory per requested head, nothing for the others; `sow_weights` stays as
it is. Linen: `MultiHeadAttention.interpretability_request(self) ->
AttentionRequest` returns the default; run_with_cache answers it through
`nn.intercept_methods`, for the module at (block_l, attention), from the
names filter (hook_pattern or hook_attn_scores of layer l: every head, or
the heads given in `pattern_heads={l: (h, ...)}`; hook_result of layer l:
head_results). nnx: a static `request` attribute of the nnx attention,
set by run_with_cache before tracing.

3. run_with_cache(model, variables, tokens, names_filter=None,
pattern_heads=None, **apply_kwargs) -> (logits, {name: array}):
`model.apply(..., capture_intermediates=f, mutable=["intermediates"])`
inside the interceptor of 2, with f(module, method) true for a HookPoint's
`__call__` whose name `select_names` picks; the captured `.../__call__`
entries are renamed. Names are static (jit with them closed over or static):
unselected hook points are identities XLA removes. nnx:
`nnx.capture(model, nnx.Intermediate)` with each HookPoint sowing only when
its static `capture` flag, set from the filter before tracing, is on.

4. Patching. run_with_hooks(model, variables, tokens, hooks={name: fn}):
an `nn.intercept_methods` interceptor that, for a HookPoint's `__call__`
with a name in `hooks`, calls it on fn(x) instead of x (a capture of the
same call sees the patched value). Builders: `replace(source, heads=None,
positions=None)` = where(mask, source, x) with the mask `[.., T|1, N|1, 1]`
made from boolean or index selections that may be traced, and
`ablate("zero" | "mean")`. A sweep over (layer, head): one traced pair
(l, h), hooks on every layer's hook_z, each where((layer == l) &
(arange(N) == h)[:, None], clean_z[layer], x); `patching_sweep(model,
variables, tokens, clean_cache, metric, hook="attn.hook_z",
over="heads" | "positions", batch_size=None)` maps it with `jax.vmap` over
all L x N (or L x T, on hook_resid_pre) pairs, or `jax.lax.map(...,
batch_size=batch_size)` over chunks, and returns metric(logits) as an
[L, N] (or [L, T]) matrix: one compilation, no Python loop. nnx: HookPoint
holds optional `Patch` variables (replacement, mask): state, so traced and
mapped with `nnx.vmap`.

5. Generation with the KV cache. `lm.sample_with_cache` gains `has_aux`:
`step` then returns (logits, cache, aux) and it returns (tokens, the
prefill's aux, the steps' aux stacked [max_new_tokens - 1, ...] as a
`lax.scan` output). `generate_with_cache(model, params, prompt,
max_new_tokens, names_filter, ...)` passes a step that applies the model
with the capture (and hooks) of 3 and 4 and returns the captures as aux.
In a decode call hook_k/hook_v/hook_kv_latent hold the T new positions,
hook_attn_scores/hook_pattern all L cache slots (-inf / 0 beyond the
filled ones).
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
