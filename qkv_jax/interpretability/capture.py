"""Reading and changing a model's activations by name, with flax's own mechanisms.

  run_with_cache       (output, {hook name: activation}) for the names a filter picks
  run_with_hooks       the output with hook functions changing named activations
  generate_with_cache  a TransformerLM's sampled tokens (KV cache) with the activations
                       of the prefill and of every decode step

Every function takes `model, variables, *inputs` and calls the model as it is
called: a linen module (TransformerLM, TransformerBlock, MultiHeadAttention,
the single-head modules, FlagReader) as `model.apply(variables, *inputs,
**kwargs)`, a `qkv_jax.nnx` module (TransformerLM, TransformerBlock,
MultiHeadAttention) as `model(*inputs, **kwargs)` with `variables=None` (it
holds its own state). Hook names are TransformerLens's (`cache.HOOK_SHAPES`,
`cache.hook_name`).

A hook function is `fn(activation, name) -> activation` (TransformerLens's
`(tensor, hook)` with the name in place of the hook object); what it returns
flows on, and a capture of the same name sees it.
`qkv_jax.interpretability.patching` builds them (`replace`, `ablate`).

How: linen runs `model.apply(..., capture_intermediates=f,
mutable=["intermediates"])` with f picking the `HookPoint`s the filter names,
inside `nn.intercept_methods`, whose interceptor calls a hooked point on
fn(x) and answers the attention modules' `interpretability_request()`
(patterns for the requested heads, per-head results). nnx sets each
`qkv_jax.nnx.HookPoint`'s static `capture` and `hook` and each attention's
`request` before the call, runs `nnx.capture(model, nnx.Intermediate)`, and
resets them after. Names, filters and hooks are Python values fixed at trace
time: under `jax.jit` close over them (`functools.partial(run_with_cache,
model, names_filter=...)`); hook points nobody reads or changes are
identities that XLA removes. Under a ("data", "model") mesh set with `jax.set_mesh`, every
cached activation stays split as computed: its batch over "data", its heads over "model"
(`cache.activation_spec`), never gathered onto one device.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from qkv_jax import generation, lm
from qkv_jax.hooks import HookPoint
from qkv_jax.interpretability.cache import activation_spec, hook_name
from qkv_jax.modules import AttentionRequest

Array = jax.Array
HookFn = Callable[[Array, str], Array]
NamesFilter = None | str | Iterable[str] | Callable[[str], bool]
PatternHeads = None | Sequence[int] | Mapping[int | str, Sequence[int]]

__all__ = ["HookFn", "run_with_cache", "run_with_hooks", "generate_with_cache"]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _attention_prefix(key: int | str) -> str:
    """A `pattern_heads` key as the hook-name prefix of an attention: layer l -> `blocks.l.attn`."""
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise ValueError(f"pattern_heads: keys must be layer numbers or hook-name prefixes, got {key!r}")
    return f"blocks.{key}.attn" if isinstance(key, int) else key


class _Spec(NamedTuple):
    """A run's names filter, requested pattern heads and hooks, normalised to hashable values
    (static arguments of a jitted function).

    pattern_heads: pairs (attention prefix, or None for every attention; heads).
    """

    names_filter: None | str | tuple[str, ...] | Callable[[str], bool]
    pattern_heads: tuple[tuple[str | None, tuple[int, ...]], ...]
    hooks: tuple[tuple[str, HookFn], ...]

    @classmethod
    def of(cls, names_filter: NamesFilter, pattern_heads: PatternHeads, hooks: Mapping[str, HookFn] | None):
        if names_filter is not None and not (isinstance(names_filter, str) or callable(names_filter)):
            names_filter = tuple(names_filter)
        if pattern_heads is None:
            heads: tuple = ()
        elif isinstance(pattern_heads, Mapping):
            heads = tuple((_attention_prefix(k), tuple(v)) for k, v in pattern_heads.items())
        else:
            heads = ((None, tuple(pattern_heads)),)
        hooks = dict(hooks or {})
        for name, fn in hooks.items():
            if not callable(fn):
                raise TypeError(f"hooks[{name!r}] must be a function (activation, name) -> activation")
        return cls(names_filter, heads, tuple(hooks.items()))

    def wants(self, name: str) -> bool:
        """Whether the names filter picks `name` (TransformerLens's rule: None all, a name, names,
        or a predicate)."""
        if self.names_filter is None:
            return True
        if isinstance(self.names_filter, str):
            return name == self.names_filter
        if isinstance(self.names_filter, tuple):
            return name in self.names_filter
        return bool(self.names_filter(name))

    def heads(self, prefix: str, num_heads: int) -> tuple[int, ...]:
        """The pattern heads of the attention at `prefix`: those given for it, else for every
        attention, else all `num_heads`."""
        for key, heads in self.pattern_heads:
            if key == prefix or key is None:
                return heads
        return tuple(range(num_heads))

    def request(self, prefix: str, num_heads: int) -> AttentionRequest:
        """What the attention at `prefix` computes for this run: the pattern of its pattern heads
        when hook_attn_scores or hook_pattern is read or hooked, per-head results for hook_result."""
        hooked = {name for name, _ in self.hooks}

        def used(suffix: str) -> bool:
            name = _join(prefix, suffix)
            return self.wants(name) or name in hooked

        patterns = used("hook_attn_scores") or used("hook_pattern")
        return AttentionRequest(self.heads(prefix, num_heads) if patterns else (), used("hook_result"))

    def check(self, owner: str, available: set[str], attentions: set[str]) -> None:
        """ValueError naming the filter's names, hooks and pattern_heads keys the model lacks."""
        named = {self.names_filter} if isinstance(self.names_filter, str) else self.names_filter
        problems = []
        if isinstance(named, (set, tuple)):
            problems.append(("names_filter", sorted(set(named) - available)))
        problems.append(("hooks", sorted({name for name, _ in self.hooks} - available)))
        keys = {key for key, _ in self.pattern_heads if key is not None}
        problems.append(("pattern_heads", sorted(keys - attentions)))
        for argument, unknown in problems:
            if unknown:
                raise ValueError(
                    f"{owner}: {argument} names {unknown}, which this model does not have; its names "
                    f"are e.g. {sorted(available)[:6]} (attention prefixes {sorted(attentions)})"
                )


def _collections(mutable: Any) -> list[str]:
    if mutable is None or mutable is False:
        return []
    return [mutable] if isinstance(mutable, str) else list(mutable)


def _run_linen(
    model: nn.Module, variables: Any, inputs: tuple, kwargs: dict, spec: _Spec
) -> tuple[Any, dict[str, Array], set[str], set[str]]:
    """`model.apply` with the spec's captures, hooks and requests: (output, captured, the hook
    names the run met, the attention prefixes it met)."""
    if "capture_intermediates" in kwargs:
        raise ValueError("run_with_cache: capture_intermediates is set by the run; leave it out")
    mutable = kwargs.pop("mutable", False)
    hooks, seen, attentions = dict(spec.hooks), set(), set()

    def capture(module: nn.Module, method: str) -> bool:
        if not (isinstance(module, HookPoint) and method == "__call__"):
            return False
        name = hook_name(module.path)
        seen.add(name)
        return spec.wants(name)

    def intercept(next_fun, args, kw, context):
        module, method = context.module, context.method_name
        if method == "interpretability_request":
            prefix = hook_name(module.path)
            attentions.add(prefix)
            return spec.request(prefix, getattr(module, "num_heads", 1))
        if method == "__call__" and isinstance(module, HookPoint):
            name = hook_name(module.path)
            if name in hooks:
                return next_fun(hooks[name](args[0], name))
        return next_fun(*args, **kw)

    keep = mutable is True or "intermediates" in _collections(mutable)
    collections = True if mutable is True else [*_collections(mutable), "intermediates"]
    with nn.intercept_methods(intercept):
        output, state = model.apply(
            variables, *inputs, capture_intermediates=capture, mutable=collections, **kwargs
        )
    state = dict(state)
    intermediates = state["intermediates"] if keep else state.pop("intermediates", {})
    captured = {
        hook_name(path[:-1]): values[0]
        for path, values in traverse_util.flatten_dict(intermediates).items()
        if path[-1] == "__call__"
    }
    return ((output, state) if mutable else output), captured, seen, attentions


def _run_nnx(model: Any, inputs: tuple, kwargs: dict, spec: _Spec):
    """`model(*inputs, **kwargs)` under `nnx.capture` with the spec's captures, hooks and
    requests set on the hook points and attentions (and reset after): (output, captured, the
    model's hook names, its attention prefixes)."""
    from flax import nnx

    from qkv_jax import nnx as qkv_nnx

    modules = [(hook_name(path), module) for path, module in nnx.iter_modules(model)]
    points = {name: module for name, module in modules if isinstance(module, qkv_nnx.HookPoint)}
    attentions = {name: module for name, module in modules if isinstance(module, qkv_nnx.MultiHeadAttention)}
    hooks = dict(spec.hooks)
    try:
        for name, point in points.items():
            point.capture = spec.wants(name)
            point.hook = None if name not in hooks else functools.partial(_named_hook, hooks[name], name)
        for prefix, attention in attentions.items():
            attention.request = spec.request(prefix, attention.options.num_heads)
        output, state = nnx.capture(model, nnx.Intermediate)(*inputs, **kwargs)
    finally:
        for point in points.values():
            point.capture, point.hook = False, None
        for attention in attentions.values():
            attention.request = AttentionRequest()
    captured = {
        hook_name(path[:-1]): variable.get_value()[0]
        for path, variable in nnx.to_flat_state(state)
        if path[-1] == "activation"
    }
    return output, captured, set(points), set(attentions)


def _named_hook(fn: HookFn, name: str, x: Array) -> Array:
    return fn(x, name)


def _is_nnx(model: Any) -> bool:
    """Whether `model` is a flax.nnx module (flax.nnx is looked up, not imported: it pulls in optax)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(model, nnx.Module)


def _run(owner: str, model: Any, variables: Any, inputs: tuple, kwargs: dict, spec: _Spec):
    """One run of a linen or nnx model with `spec`: (output, captured), names checked."""
    if isinstance(model, nn.Module):
        if variables is None:
            raise TypeError(f"{owner}: a linen {type(model).__name__} needs its variables, got None")
        output, captured, available, attentions = _run_linen(model, variables, inputs, dict(kwargs), spec)
    elif _is_nnx(model):
        if variables is not None:
            raise TypeError(
                f"{owner}: an nnx {type(model).__name__} holds its own state; pass variables=None, "
                f"got {type(variables).__name__}"
            )
        output, captured, available, attentions = _run_nnx(model, inputs, kwargs, spec)
    else:
        raise TypeError(f"{owner}: model must be a flax linen or nnx module, got {type(model).__name__}")
    spec.check(owner, available, attentions)
    return output, _placed(captured)


def _placed(captured: dict[str, Array]) -> dict[str, Array]:
    """Under a mesh with axes "data" and "model" (`jax.set_mesh`), each activation constrained
    to stay split as computed (`cache.activation_spec`: batch over "data", heads over "model")
    rather than gathered; without one, as it is."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not {"data", "model"} <= set(mesh.axis_names):
        return captured
    sizes = dict(mesh.shape)
    return {
        name: jax.lax.with_sharding_constraint(
            value, jax.sharding.PartitionSpec(*activation_spec(name, value.shape, sizes))
        )
        for name, value in captured.items()
    }


def run_with_cache(
    model: Any,
    variables: Any,
    *inputs: Any,
    names_filter: NamesFilter = None,
    pattern_heads: PatternHeads = None,
    hooks: Mapping[str, HookFn] | None = None,
    to_host: bool = False,
    **kwargs: Any,
) -> tuple[Any, dict[str, Array]]:
    """The model's output and its activations by hook name: `(output, {name: array})`.

    Args:
      model: a linen module with hook points (its `apply` is called) or a
        `qkv_jax.nnx` module (called; `variables` must be None).
      variables: the linen model's variables (`{"params": ...}`, with
        "cache" when decoding); None for an nnx model.
      *inputs: the model's positional inputs (tokens `[batch..., T]` for a
        TransformerLM).
      names_filter: which names to keep: None (every name), a name, an
        iterable of names (each must exist: ValueError naming the unknown
        ones) or a predicate `name -> bool`.
      pattern_heads: the heads whose hook_attn_scores and hook_pattern are
        computed when the filter asks for them: None (every head), heads for
        every attention (`(0, 3)`), or per attention `{layer: heads}` (or
        `{"blocks.0.attn": heads}`); an attention not in the mapping gives
        every head. Only those heads' `[..., n, T, S]` are built, beside the
        attention's own path (chunked, cuDNN, XLA, absorbed MLA); with every
        head, they give the whole output and the default path is not run.
      hooks: `{name: fn(activation, name) -> activation}` applied in the
        same run (`run_with_hooks`); captures see what they return.
      to_host: each cached activation is moved to host memory as it is
        produced (`jax.memory.Space.Host`; under `jax.jit` XLA schedules the
        copies), so the accelerator holds no cache; the arrays come back in
        the "pinned_host" memory kind, split as they were computed.
      **kwargs: the call's keyword arguments (`deterministic`, `decode`,
        `head_mask`, `segment_ids`, ...; linen's `mutable`, `rngs`). With
        linen's `mutable`, the output is `(output, mutated variables)` as
        `apply` returns it.

    Returns:
      The output as the model returns it, and a dict from each picked hook
      name to its activation (`cache.HOOK_SHAPES`). Traceable: under `jax.jit`
      close over the names (they are static).
    """
    spec = _Spec.of(names_filter, pattern_heads, hooks)
    output, captured = _run("run_with_cache", model, variables, inputs, kwargs, spec)
    if to_host:
        captured = {name: jax.device_put(value, jax.memory.Space.Host) for name, value in captured.items()}
    return output, captured


def _nothing(name: str) -> bool:
    return False


def run_with_hooks(
    model: Any,
    variables: Any,
    *inputs: Any,
    hooks: Mapping[str, HookFn],
    pattern_heads: PatternHeads = None,
    **kwargs: Any,
) -> Any:
    """The model's output with `hooks` `{name: fn(activation, name) -> activation}` changing named
    activations (`run_with_cache`'s arguments; nothing captured). Hooking hook_attn_scores or
    hook_pattern computes the pattern of `pattern_heads` (default every head), which then drives
    those heads' outputs; hooking hook_result makes the output the sum of the per-head results."""
    spec = _Spec.of(_nothing, pattern_heads, hooks)
    output, _ = _run("run_with_hooks", model, variables, inputs, kwargs, spec)
    return output


def split_model(model: Any, variables: Any) -> tuple[Any, Any]:
    """(static part, state) of a model to trace over: (the linen module, its variables), or the
    nnx model's `nnx.split` (graphdef, state)."""
    if _is_nnx(model):
        from flax import nnx

        if variables is not None:
            raise TypeError(f"an nnx {type(model).__name__} holds its own state; pass variables=None")
        return nnx.split(model)
    return model, variables


def run_split(owner: str, static: Any, state: Any, inputs: tuple, kwargs: dict, spec: _Spec):
    """`_run` on `split_model`'s parts (nnx: merged again, a copy): (output, captured)."""
    if isinstance(static, nn.Module):
        return _run(owner, static, state, inputs, kwargs, spec)
    from flax import nnx

    return _run(owner, nnx.merge(static, state), None, inputs, kwargs, spec)


def _sample(static, spec: _Spec, state, prompt, rng, sampling, max_new_tokens: int, top_k):
    """`generate_with_cache`'s traced body: `generation.sample_with_cache` over runs with captures."""
    if isinstance(static, nn.Module):  # linen: the cache is a collection of apply

        def step(cache, tokens):
            variables = {**state, "cache": cache}
            kwargs = {"decode": True, "mutable": ["cache"]}
            (logits, mutated), captured = _run(
                "generate_with_cache", static, variables, (tokens,), kwargs, spec
            )
            return logits, mutated["cache"], captured

        cache = lm.init_cache(static, prompt.shape[0])  # type: ignore[arg-type]
        return generation.sample_with_cache(step, cache, prompt, rng, sampling, max_new_tokens, top_k, True)
    from flax import nnx

    model = nnx.merge(static, state)
    model.init_cache(prompt.shape[0])
    graphdef, cache, rest = nnx.split(model, nnx.Cache, ...)  # type: ignore[misc]

    def nnx_step(cache, tokens):
        decoder = nnx.merge(graphdef, cache, rest)
        logits, captured = _run("generate_with_cache", decoder, None, (tokens,), {"decode": True}, spec)
        return logits, nnx.state(decoder, nnx.Cache), captured

    return generation.sample_with_cache(nnx_step, cache, prompt, rng, sampling, max_new_tokens, top_k, True)


_compiled_sample = jax.jit(_sample, static_argnames=("static", "spec", "max_new_tokens", "top_k"))


def generate_with_cache(
    model: Any,
    variables: Any,
    prompt: Any,
    max_new_tokens: int,
    *,
    rng: Array | None = None,
    names_filter: NamesFilter = None,
    pattern_heads: PatternHeads = None,
    hooks: Mapping[str, HookFn] | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> tuple[Array, dict[str, Array], dict[str, Array]]:
    """`lm.generate` with the activations of every decode call: (tokens, prefill cache, step cache).

    `model`: a linen TransformerLM with `variables` `{"params": ...}`, or a
    `qkv_jax.nnx.TransformerLM` with `variables=None` (left unchanged);
    `prompt` `[B, P]` int; `max_new_tokens`, `rng`, `temperature`, `top_k`,
    `top_p` as `lm.generate`'s: the same checks, and each row draws from
    generate's key for its row and position, so without an end-of-text id the
    tokens are generate's (`qkv_jax.generation.sample_with_cache`).
    `names_filter`, `pattern_heads`, `hooks`: `run_with_cache`'s, applied at
    every call of the KV-cache loop (hooks must hold for both call shapes).

    Returns tokens `[B, max_new_tokens]` int32; the prefill's activations
    `{name: [B, P, ...]}`; the decode steps' `{name: [max_new_tokens - 1, B,
    1, ...]}` (one token a step). In a decode call hook_k, hook_v and
    hook_kv_latent hold its new positions, hook_attn_scores and hook_pattern
    every cache slot (`-inf` / 0 where not yet written; a window's ring buffer
    its slots then the new positions). Compiled once per (model, filters,
    hooks, B, P, max_new_tokens, top_k): pass the same filter and hook
    objects to reuse it.
    """
    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    generation.check_request(model.config, prompt, max_new_tokens, settings)
    rng = generation.decoding_key(rng, temperature, "generate_with_cache")
    sampling = generation.Sampling(jnp.float32(temperature), jnp.float32(1.0 if top_p is None else top_p))
    static, state = split_model(model, variables)
    return _compiled_sample(
        static,
        _Spec.of(names_filter, pattern_heads, hooks),
        state,
        jnp.asarray(prompt, jnp.int32),
        rng,
        sampling,
        max_new_tokens=max_new_tokens,
        top_k=top_k,
    )
