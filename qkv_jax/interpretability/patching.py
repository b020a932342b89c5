"""Activation patching: hook functions that replace or ablate named activations, and sweeps.

  activation_axes  where the positions and the heads are in a named activation
  replace          a hook: the activation of another run where selected (heads, positions)
  ablate           a hook: zero, or the mean over the batch, where selected
  patching_sweep   a metric of the output with one (layer, head) or (layer, position)
                   patched from a clean run at a time: an `[L, N]` or `[L, T]` matrix
                   from one compiled program (`jax.vmap`, or `jax.lax.map` in batches)

Hooks are `fn(activation, name) -> activation` (`qkv_jax.interpretability.capture`);
selections may be Python ints, int arrays, boolean masks, or traced values
(a sweep maps over them). Layouts by name (TransformerLens's): hook_q, hook_k,
hook_v, hook_z and hook_result are `[..., T, heads, d]`, hook_attn_scores and
hook_pattern `[..., heads, T, S]` (positions = queries), every other name
`[..., T, d]` (no head axis).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from qkv_jax.interpretability.capture import HookFn, _nothing, _Spec, run_split, split_model

Array = jax.Array

__all__ = ["activation_axes", "replace", "ablate", "patching_sweep"]

_HEADS_THEN_DEPTH = ("hook_q", "hook_k", "hook_v", "hook_z", "hook_result")  # [..., T, heads, d]
_PATTERNS = ("hook_attn_scores", "hook_pattern")  # [..., heads, T, S]


def activation_axes(name: str) -> tuple[int, int | None]:
    """(position axis, head axis or None) of the activation `name`, as negative axes:
    (-3, -2) for hook_q/k/v/z/result, (-2, -3) for hook_attn_scores/hook_pattern, (-2, None) else."""
    last = name.rpartition(".")[2]
    if last in _HEADS_THEN_DEPTH:
        return -3, -2
    if last in _PATTERNS:
        return -2, -3
    return -2, None


def _selected(which: Any, size: int, argument: str, name: str) -> Array:
    """Boolean `[size]`: True at the selected indices (None: all; ints, int array, or a boolean
    mask of `size`). Indices outside [0, size) select nothing."""
    if which is None:
        return jnp.ones((size,), jnp.bool_)
    which = jnp.asarray(which)
    if which.dtype == jnp.bool_:
        if which.shape != (size,):
            raise ValueError(
                f"{argument}: a boolean mask must have shape ({size},) for {name}, got {which.shape}"
            )
        return which
    if not jnp.issubdtype(which.dtype, jnp.integer):
        raise TypeError(f"{argument} must be ints, an int array or a boolean mask, got dtype {which.dtype}")
    return jnp.any(jnp.arange(size)[:, None] == which.reshape(1, -1), axis=-1)  # (size,)


def _mask(name: str, shape: tuple[int, ...], heads: Any, positions: Any) -> Array:
    """Boolean of rank len(shape), True where both selections hold (size 1 along other axes)."""
    position_axis, head_axis = activation_axes(name)
    if heads is not None and head_axis is None:
        raise ValueError(f"heads={heads!r}: the activation {name} has no head axis")
    mask = jnp.ones((1,) * len(shape), jnp.bool_)
    for axis, which, argument in ((position_axis, positions, "positions"), (head_axis, heads, "heads")):
        if axis is None or which is None:
            continue
        selected = _selected(which, shape[axis], argument, name)  # (size,)
        mask = mask & selected.reshape((1,) * (len(shape) + axis) + (-1,) + (1,) * (-axis - 1))
    return mask


def replace(source: Any, heads: Any = None, positions: Any = None) -> HookFn:
    """A hook that puts `source` (another run's activation of the same name and shape) in place of
    the activation where `heads` and `positions` select (None: all), leaving the rest.

    E.g. `{"blocks.1.attn.hook_z": replace(clean_cache["blocks.1.attn.hook_z"], heads=3)}`
    patches head 3's output at every position.
    """

    def hook(x: Array, name: str) -> Array:
        if jnp.shape(source) != x.shape:
            raise ValueError(f"replace: source of shape {jnp.shape(source)} for {name} of shape {x.shape}")
        return jnp.where(_mask(name, x.shape, heads, positions), jnp.asarray(source, x.dtype), x)

    return hook


def ablate(kind: str = "zero", heads: Any = None, positions: Any = None) -> HookFn:
    """A hook that sets the activation to 0 (`kind="zero"`) or to its mean over the batch axes
    (`kind="mean"`: every axis before the position and head axes) where `heads` and `positions`
    select (None: all)."""
    if kind not in ("zero", "mean"):
        raise ValueError(f"ablate: kind={kind!r} must be 'zero' or 'mean'")

    def hook(x: Array, name: str) -> Array:
        position_axis, head_axis = activation_axes(name)
        batch = x.ndim + min(position_axis, head_axis if head_axis is not None else 0)
        if kind == "mean" and batch == 0:
            raise ValueError(f"ablate: kind='mean' averages over the batch, and {name} {x.shape} has none")
        value = jnp.zeros_like(x) if kind == "zero" else jnp.mean(x, axis=tuple(range(batch)), keepdims=True)
        return jnp.where(_mask(name, x.shape, heads, positions), value, x)

    return hook


def _layer_of(name: str) -> int:
    block = re.match(r"blocks\.(\d+)\.", name)
    return int(block[1]) if block else 0


def _sweep(
    static: Any,
    sites: tuple[str, ...],
    metric: Callable[[Any], Array],
    over: str,
    batch_size: int | None,
    kwargs: dict,
    state: Any,
    inputs: tuple,
    clean: Mapping[str, Array],
) -> Array:
    """`patching_sweep`'s traced body: metric(output) for every (site, index), `[L, M, ...]`."""
    position_axis, head_axis = activation_axes(sites[0])
    axis = position_axis if head_axis is None or over == "positions" else head_axis
    size = clean[sites[0]].shape[axis]
    selection = "heads" if over == "heads" else "positions"

    def patched(site: Array, index: Array) -> Array:
        hooks = {
            name: replace(clean[name], **{selection: jnp.where(site == i, index, -1)})
            for i, name in enumerate(sites)
        }
        output, _ = run_split(
            "patching_sweep", static, state, inputs, kwargs, _Spec.of(_nothing, None, hooks)
        )
        return metric(output)

    pairs = jnp.repeat(jnp.arange(len(sites)), size), jnp.tile(jnp.arange(size), len(sites))  # (L M,), (L M,)
    if batch_size is None:
        values = jax.vmap(patched)(*pairs)
    else:
        values = lax.map(lambda pair: patched(*pair), pairs, batch_size=batch_size)
    return values.reshape(len(sites), size, *values.shape[1:])  # (L, M, ...)


def patching_sweep(
    model: Any,
    variables: Any,
    inputs: Any,
    clean_cache: Mapping[str, Any],
    metric: Callable[[Any], Array],
    *,
    hook: str = "attn.hook_z",
    over: str = "heads",
    batch_size: int | None = None,
    **kwargs: Any,
) -> Array:
    """Activation patching of one (layer, head) or (layer, position) at a time: `[L, M, ...]`.

    The model runs on `inputs` (the corrupted input) once for every layer l
    and index m, with the activation `hook` of layer l at head m (`over="heads"`,
    every position) or at position m (`over="positions"`, every head)
    replaced by its value in `clean_cache` (`run_with_cache` on the clean
    input, with at least those names); entry [l, m] is `metric(output)`.
    TransformerLens's `get_act_patch_attn_head_out_all_pos` is `hook="attn.hook_z"`,
    `over="heads"`; its `get_act_patch_resid_pre` is `hook="hook_resid_pre"`,
    `over="positions"`.

    Args:
      model, variables: as for `run_with_cache` (variables None for nnx).
      inputs: the model's input, or a tuple of its positional inputs.
      clean_cache: activations by hook name; the layers are its names equal
        to `hook` or ending in "." + `hook` (`blocks.{l}.attn.hook_z`), in
        layer order.
      metric: output -> an array (a scalar, or a fixed shape).
      hook: the hook name within a layer: "attn.hook_z" (each head's output),
        "attn.hook_q", "attn.hook_pattern" (with every head's pattern in the
        clean cache), "hook_resid_pre", ...
      over: "heads" (the activation's head axis) or "positions".
      batch_size: None maps every pair at once (`jax.vmap`: one batch of
        L M runs); an int runs them `batch_size` at a time (`jax.lax.map`).
      **kwargs: the model call's keyword arguments.

    Returns:
      `[L, M, ...]`: metric per layer and head (M = the activation's heads)
      or position (M = T), from one compiled program.
    """
    if over not in ("heads", "positions"):
        raise ValueError(f"patching_sweep: over={over!r} must be 'heads' or 'positions'")
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
    ):
        raise ValueError(f"patching_sweep: batch_size={batch_size!r} must be a positive int or None")
    sites = tuple(sorted((n for n in clean_cache if n == hook or n.endswith("." + hook)), key=_layer_of))
    if not sites:
        raise ValueError(
            f"patching_sweep: clean_cache has no {hook!r} activation (names ending in {hook!r}); run "
            f"run_with_cache with a names_filter that keeps them (it has {sorted(clean_cache)[:4]} ...)"
        )
    if over == "heads" and activation_axes(hook)[1] is None:
        raise ValueError(f"patching_sweep: over='heads', and {hook} has no head axis; use over='positions'")
    static, state = split_model(model, variables)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    sweep = jax.jit(functools.partial(_sweep, static, sites, metric, over, batch_size, kwargs))
    return sweep(state, inputs, {name: jnp.asarray(clean_cache[name]) for name in sites})
