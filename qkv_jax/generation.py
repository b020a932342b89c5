"""Generation shared by the linen and the nnx `TransformerLM`: the cache, the sampling filters,
the stopping rule and the decode loop, composed by `generate`.

  bucket            the static lengths a request compiles for (`Request`, `prepare`): the
                    batch, the prompt width, the output width and the cache length.
  temperature_filter, top_k_filter, top_p_filter   one sampling filter each, in
                    transformers' order and meaning; `choose` draws a token per row.
  finished          the stopping rule: a row ends at its first end-of-text id or at
                    `max_new_tokens`.
  start, advance, finish, decode   the decode loop: a prefill, then `steps` tokens per call
                    of `advance` (the command line streams between calls); `finish` runs them
                    inside one `lax.while_loop` that ends once every row has finished, and
                    `decode` is `start` then `finish` (`generate` compiles the two as separate
                    programs, side by side: `compiled_decode`).
  generate          prompts (a `[B, P]` array, or a list of 1-D sequences of different
                    lengths) -> new tokens, for a linen model and its params; `stream`
                    the same, yielding the tokens every few steps (the command line's).
  sample            the traceable fixed-length loop (a `[B, P]` prompt, a cache of the
                    model's `max_len`, no stopping rule) that training's samples and the
                    activation capture run (`sample_with_cache` over any step function),
                    drawing from `generate`'s keys.
  end_of_text_of    a Hugging Face directory's end-of-text ids (generation_config.json,
                    else config.json).

The cache holds the request, not the model's `max_len`: `cache_length` positions, the prompt
width plus the output width plus one chunk of steps, rounded up by `bucket` (a power of two
from 64 up to 1024, then a multiple of 1024) and never more than the model's positions. A
decode step attends over that many positions, the ones not yet written masked: its attention
work follows the bucket, never the model's `max_len`.

Ragged prompts are never padded into each other's attention: every row is fed the tokens of
its own prompt one position at a time after a common prefill (`prefill_length`: the shortest
prompt floored to a power of two below 16, else to a multiple of 16), as lm1b's sampler
forces its prompt, so a row sees exactly the positions it would see alone. Each row draws
from its own key (`jax.random.fold_in` of `rng` by row, then by position): a row's tokens
never depend on the other rows or on the batch size.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import pathlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

Array = jax.Array
Step = Callable[[Any, Array], tuple[Array, Any]]

__all__ = [
    "CHUNK_STEPS",
    "bucket",
    "prefill_length",
    "Request",
    "prepare",
    "end_of_text_ids",
    "Sampling",
    "temperature_filter",
    "top_k_filter",
    "top_p_filter",
    "choose",
    "finished",
    "DecodeState",
    "start",
    "advance",
    "finish",
    "decode",
    "zeroed_cache",
    "mesh_of",
    "placed",
    "decoding_key",
    "linen_step",
    "compiled_decode",
    "outputs",
    "generate",
    "checked_request",
    "run_request",
    "stream",
    "check_request",
    "row_keys",
    "sample_with_cache",
    "sample",
    "end_of_text_of",
]

# Decode steps per call of `advance` (and per turn of `decode`'s while loop).
CHUNK_STEPS = 4


def bucket(length: int, smallest: int = 64) -> int:
    """`length` rounded up: the next power of two (at least `smallest`) up to 1024, then the next
    multiple of 1024. Requests whose lengths share buckets share a compiled program."""
    length = max(int(length), smallest)
    if length <= 1024:
        return 1 << (length - 1).bit_length()
    return -(-length // 1024) * 1024


def prefill_length(shortest: int) -> int:
    """Prompt positions fed in one call before the token loop: the shortest prompt floored to a
    power of two below 16, else to a multiple of 16 (the rest of each prompt is fed one
    position at a time, forced)."""
    if shortest < 16:
        return 1 << (shortest.bit_length() - 1)
    return shortest // 16 * 16


class Request(NamedTuple):
    """A checked request, padded to its buckets: `prompt` `[Bb, Pb]` int32 (right-padded),
    `lengths` `[Bb]` (0: a padding row), `eos` `[E]` int32 (-1 pads), `rows` (the B asked
    for), `ragged` (prompts came as a list), `prefill`, `out_width` and `cache_length`."""

    prompt: np.ndarray
    lengths: np.ndarray
    eos: np.ndarray
    rows: int
    ragged: bool
    prefill: int
    out_width: int
    cache_length: int


def _rows(prompts: Any) -> tuple[list[np.ndarray], bool]:
    """The prompt rows as 1-D int arrays, and whether they came as a list."""
    if isinstance(prompts, (list, tuple)):
        rows = [np.asarray(row) for row in prompts]
        for i, row in enumerate(rows):
            if row.ndim != 1:
                raise ValueError(f"generate: prompt row {i} must be 1-D, got shape {list(row.shape)}")
        return rows, True
    array = np.asarray(prompts)
    if array.ndim != 2 or array.shape[1] == 0:
        raise ValueError(f"generate: prompt must have shape [batch, length >= 1], got {list(array.shape)}")
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"generate: prompt must hold integer tokens, got dtype {array.dtype}")
    return list(array), False


def _check_row(i: int, row: np.ndarray, vocab_size: int) -> None:
    if row.size == 0:
        raise ValueError(f"generate: prompt row {i} is empty")
    if not np.issubdtype(row.dtype, np.integer):
        raise ValueError(f"generate: prompt row {i} must hold integer tokens, got dtype {row.dtype}")
    bad = row[(row < 0) | (row >= vocab_size)]
    if bad.size:
        raise ValueError(f"generate: prompt row {i} holds token {int(bad[0])}, outside [0, {vocab_size})")


def end_of_text_ids(eos_token_id: Any, vocab_size: int) -> np.ndarray:
    """`eos_token_id` (None, one id or several) as int32 `[E]`, E a multiple of 4 padded with -1."""
    ids = [] if eos_token_id is None else np.atleast_1d(np.asarray(eos_token_id)).tolist()
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ValueError(f"generate: eos_token_id {token!r} must be an int in [0, {vocab_size})")
    width = -(-max(len(ids), 1) // 4) * 4
    return np.array(ids + [-1] * (width - len(ids)), np.int32)


def prepare(
    config: Any, capacity: int | None, prompts: Any, max_new_tokens: int, eos_token_id: Any
) -> Request:
    """`prompts` checked (one ValueError naming the row or the value) and padded to the buckets.
    `config`: the model's `TransformerConfig`; `capacity`: the positions its cache can take
    (None: no limit)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens!r} must be a positive int")
    rows, ragged = _rows(prompts)
    if not rows:
        raise ValueError("generate: prompts holds no rows")
    for i, row in enumerate(rows):
        _check_row(i, row, config.vocab_size)
    longest = max(len(row) for row in rows)
    if capacity is not None and longest + max_new_tokens - 1 > capacity:
        raise ValueError(
            f"generate: a prompt of {longest} tokens and max_new_tokens={max_new_tokens} decode "
            f"{longest + max_new_tokens - 1} positions, past the model's max_len={capacity}"
        )
    batch, width = bucket(len(rows), 1), bucket(longest, 16)
    prompt = np.zeros((batch, width), np.int32)
    lengths = np.zeros(batch, np.int32)
    for i, row in enumerate(rows):
        prompt[i, : len(row)], lengths[i] = row, len(row)
    out_width = bucket(max_new_tokens, 16)
    cache_length = bucket(width + out_width + CHUNK_STEPS)
    if capacity is not None:
        cache_length = min(cache_length, capacity)
    eos = end_of_text_ids(eos_token_id, config.vocab_size)
    prefill = prefill_length(min(len(row) for row in rows))
    return Request(prompt, lengths, eos, len(rows), ragged, prefill, out_width, cache_length)


class Sampling(NamedTuple):
    """The traced sampling settings: `temperature` (0: greedy) and `top_p` (1: off), float32."""

    temperature: Array
    top_p: Array


def temperature_filter(logits: Array, temperature: Array) -> Array:
    """`logits` `[B, V]` / temperature (transformers' TemperatureLogitsWarper), for temperature > 0."""
    return logits / jnp.maximum(temperature, 1e-6)


def top_k_filter(logits: Array, top_k: int) -> Array:
    """-inf below the `top_k`-th largest of each row `[B, V]` (ties kept; TopKLogitsWarper)."""
    kth_largest = lax.top_k(logits, top_k)[0][..., -1:]  # (B, 1)
    return jnp.where(logits < kth_largest, -jnp.inf, logits)


def top_p_filter(logits: Array, top_p: Array) -> Array:
    """Nucleus sampling (TopPLogitsWarper): keeps the most likely tokens of each row `[B, V]` whose
    probability mass before them is below `top_p`, the most likely one always."""
    descending = -jnp.sort(-logits, axis=-1)  # (B, V)
    probs = jax.nn.softmax(descending, axis=-1)  # (B, V)
    before = jnp.cumsum(probs, axis=-1) - probs  # (B, V): the mass ahead of each token
    kept = jnp.maximum(jnp.sum(before < top_p, axis=-1, keepdims=True), 1)  # (B, 1)
    threshold = jnp.take_along_axis(descending, kept - 1, axis=-1)  # (B, 1)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def choose(logits: Array, keys: Array, sampling: Sampling, top_k: int | None) -> Array:
    """One token per row of `logits` `[B, V]` -> `[B]` int32: the argmax at temperature 0, else a
    draw (row b with `keys[b]`) after the temperature, top_k and top_p filters."""

    def sample(logits: Array) -> Array:
        logits = temperature_filter(logits, sampling.temperature)
        if top_k is not None:
            logits = top_k_filter(logits, top_k)
        logits = lax.cond(sampling.top_p < 1.0, top_p_filter, lambda x, _: x, logits, sampling.top_p)
        return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)

    def greedy(logits: Array) -> Array:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    return lax.cond(sampling.temperature > 0, sample, greedy, logits)


def finished(token: Array, count: Array, eos: Array, max_new_tokens: Array) -> Array:
    """The stopping rule: whether a row that just produced its `count`-th new `token` `[B]` is
    done (an end-of-text id of `eos` `[E]`, or `max_new_tokens` reached)."""
    return jnp.any(token[:, None] == eos[None, :], axis=-1) | (count >= max_new_tokens)


class DecodeState(NamedTuple):
    """The decode loop's carry. `token` `[B]`: the token chosen for `position` (not yet fed);
    `tokens`/`logprobs` `[B, W]`: the new tokens and their log-probabilities; `produced` `[B]`:
    new tokens so far; `done` `[B]`."""

    cache: Any
    token: Array
    position: Array
    tokens: Array
    logprobs: Array
    produced: Array
    done: Array


class Inputs(NamedTuple):
    """A request's traced inputs: the padded `prompt` `[B, Pb]`, `lengths` `[B]`, `eos` `[E]`,
    `row_keys` `[B]` (one key per row), `max_new_tokens` and `sampling`."""

    prompt: Array
    lengths: Array
    eos: Array
    row_keys: Array
    max_new_tokens: Array
    sampling: Sampling


def _record(state: DecodeState, logits: Array, inputs: Inputs, top_k: int | None) -> DecodeState:
    """Chooses the token at `state.position + 1` from `logits` `[B, V]` (a prompt's own token while
    the position is inside it) and records it for the rows that are generating."""
    position = state.position + 1
    sampled = choose(logits, _position_keys(inputs.row_keys, position), inputs.sampling, top_k)  # (B,)
    forced = jnp.take(inputs.prompt, jnp.minimum(position, inputs.prompt.shape[1] - 1), axis=1)  # (B,)
    token = jnp.where(position < inputs.lengths, forced, sampled)  # (B,)
    generating = (position >= inputs.lengths) & ~state.done  # (B,)
    slot = jnp.where(generating, state.produced, state.tokens.shape[1])  # (B,): W drops the write
    rows = jnp.arange(token.shape[0])
    logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], axis=-1)[:, 0]  # (B,)
    produced = state.produced + generating
    done = state.done | (generating & finished(token, produced, inputs.eos, inputs.max_new_tokens))
    return state._replace(
        token=token,
        position=position,
        tokens=state.tokens.at[rows, slot].set(token, mode="drop"),
        logprobs=state.logprobs.at[rows, slot].set(logprob, mode="drop"),
        produced=produced,
        done=done,
    )


def start(step: Step, cache: Any, inputs: Inputs, prefill: int, out_width: int) -> DecodeState:
    """The prefill: the first `prefill - 1` positions of every prompt through `step(cache, tokens
    [B, T]) -> (logits [B, T, V], cache)`. Returns a `DecodeState` whose `token` is each prompt's
    token at position `prefill - 1`, which the first decode step feeds: the one-token step is
    then traced and compiled once, in `advance`, not also here."""
    if prefill > 1:  # its logits are unused, so XLA drops the vocabulary head of these positions
        _, cache = step(cache, inputs.prompt[:, : prefill - 1])
    batch = inputs.prompt.shape[0]
    fill = jnp.maximum(inputs.eos[0], 0)  # what follows a row's end-of-text
    return DecodeState(
        cache=cache,
        token=inputs.prompt[:, prefill - 1],
        position=jnp.array(prefill - 1, jnp.int32),
        tokens=jnp.full((batch, out_width), fill, jnp.int32),
        logprobs=jnp.zeros((batch, out_width), jnp.float32),
        produced=jnp.zeros(batch, jnp.int32),
        done=inputs.lengths == 0,  # padding rows
    )


def advance(step: Step, state: DecodeState, inputs: Inputs, steps: int, top_k: int | None) -> DecodeState:
    """`steps` decode steps: feed each row's chosen token, choose the next (`lax.scan`)."""

    def body(state: DecodeState, _: None) -> tuple[DecodeState, None]:
        logits, cache = step(state.cache, state.token[:, None])  # (B, 1, V)
        return _record(state._replace(cache=cache), logits[:, -1], inputs, top_k), None

    return lax.scan(body, state, None, length=steps)[0]


def finish(step: Step, state: DecodeState, inputs: Inputs, top_k: int | None) -> DecodeState:
    """`advance` by `CHUNK_STEPS` inside a `lax.while_loop` until every row has finished (or the
    last position a row needs is chosen). Returns the final `DecodeState`."""
    last = jnp.max(inputs.lengths) + inputs.max_new_tokens - 1  # the last position any row needs

    def running(state: DecodeState) -> Array:
        return ~jnp.all(state.done) & (state.position < last)

    return lax.while_loop(running, lambda s: advance(step, s, inputs, CHUNK_STEPS, top_k), state)


def decode(step: Step, cache: Any, inputs: Inputs, prefill: int, out_width: int, top_k: int | None):
    """`start`, then `finish`: the whole decode as one traced function."""
    return finish(step, start(step, cache, inputs, prefill, out_width), inputs, top_k)


def zeroed_cache(model: Any, batch_size: int, length: int, mesh: Mesh | None = None) -> Any:
    """The zeroed decode cache of a linen `TransformerLM` for `batch_size` rows of `length`
    positions, built from the shapes `model.init(..., decode=True)` would create, without
    computing anything (`qkv_jax.lm.init_cache`); on `mesh`, split as its K/V weights are
    (`qkv_jax.sharding.cache_shardings`)."""
    tokens = jnp.zeros((batch_size, length), jnp.int32)
    init = functools.partial(model.init, decode=True)
    shapes = jax.eval_shape(init, jax.random.PRNGKey(0), tokens)["cache"]
    return placed(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), mesh)


def mesh_of(params: Any) -> Mesh | None:
    """The ("data", "model") mesh `params` are split over (`load_pretrained(mesh=...)`), else
    None."""
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and set(sharding.mesh.axis_names) == {"data", "model"}:
            return sharding.mesh if isinstance(sharding.mesh, Mesh) else None
    return None


def placed(cache: Any, mesh: Mesh | None) -> Any:
    """A decode cache split over `mesh` as its K/V weights are (unchanged without one)."""
    if mesh is None:
        return cache
    from qkv_jax.sharding import cache_shardings

    return lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))


def decoding_key(rng: Array | None, temperature: float, owner: str) -> Array:
    """`rng`, or for greedy decoding (temperature 0) without one a fixed key it never draws
    from; sampling without a key is a one-line ValueError."""
    if rng is not None:
        return rng
    if float(temperature) == 0.0:
        return jax.random.PRNGKey(0)
    raise ValueError(f"{owner}: temperature={temperature} samples, so it needs rng=jax.random.key(...)")


def linen_step(model: Any, params: Any) -> Step:
    """One cached decode call of a linen `TransformerLM`: `(cache, tokens [B, T]) -> (logits [B,
    T, V], cache)`."""

    def step(cache: Any, tokens: Array) -> tuple[Array, Any]:
        logits, state = model.apply(
            {"params": params, "cache": cache}, tokens, decode=True, mutable=["cache"]
        )  # (B, T, V)
        return logits, state["cache"]

    return step


def _finish_linen(model, params, state, inputs, top_k):
    return finish(linen_step(model, params), state, inputs, top_k)  # the donated state, updated in place


_compiled_finish = jax.jit(_finish_linen, static_argnames=("model", "top_k"), donate_argnames="state")


# What `compiled_decode` has compiled side by side already (its `_signature`s): a later call with
# the same signature skips the lowering, which on a tiny model was 1.3 ms of a 4.7 ms call.
_PRECOMPILED: set[tuple] = set()


def _one_device(params: Any) -> SingleDeviceSharding | None:
    """The one device every array of `params` lives on (its sharding), else None."""
    shardings = {leaf.sharding for leaf in jax.tree.leaves(params) if isinstance(leaf, jax.Array)}
    (sharding,) = shardings if len(shardings) == 1 else (None,)
    return sharding if isinstance(sharding, SingleDeviceSharding) else None


def _signature(model: Any, params: Any, inputs: Inputs, device: Any, top_k: Any, static: dict) -> tuple:
    """What the two programs compile for, as far as a call can tell cheaply: a signature missed
    only compiles again (one after the other, on first use), never computes anything else."""
    shapes = tuple((x.shape, x.dtype) for x in jax.tree.leaves(inputs))
    dtypes = frozenset(leaf.dtype for leaf in jax.tree.leaves(params))
    return (model, jax.tree.structure(params), dtypes, shapes, device, top_k, tuple(sorted(static.items())))


def compiled_decode(model: Any, params: Any, inputs: Inputs, *, top_k: int | None, mesh=None, **static):
    """The decode of a linen `TransformerLM` as two compiled programs, the prefill (`start`) and
    the loop (`finish`), compiled side by side on a first call: (tokens, logprobs, produced).

    Why two: XLA:CPU compiles one program on one core. Qwen2.5-0.5B's decode (batch 1, 16
    prompt tokens) compiled as one program in 5.7 s; as these two, 4.9 s one after the other
    and 3.9 s side by side on 2 cores. `static`: prefill, out_width, cache_length."""
    device = _one_device(params)
    # the prefill's outputs are committed to the params' device where the params are (jax
    # compiles a program for committed and uncommitted inputs apart)
    committed = any(getattr(leaf, "committed", False) for leaf in jax.tree.leaves(params))
    signature = _signature(model, params, inputs, (device, committed), top_k, static)
    if device is not None and signature not in _PRECOMPILED:  # else each compiled on first use
        starting = _compiled_start.lower(model, params, inputs, mesh=mesh, **static)
        where = device if committed else None
        state = jax.tree.map(  # the prefill's outputs as the call will pass them
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where, weak_type=s.weak_type),
            starting.out_info,
        )
        finishing = _compiled_finish.lower(model, params, state, inputs, top_k=top_k)
        # Traced here, compiled side by side; jax memoizes both, so a later call costs milliseconds.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for compiling in [pool.submit(program.compile) for program in (starting, finishing)]:
                compiling.result()
        _PRECOMPILED.add(signature)
    state = _compiled_start(model, params, inputs, mesh=mesh, **static)
    state = _compiled_finish(model, params, state, inputs, top_k=top_k)
    return state.tokens, state.logprobs, state.produced


def row_keys(rng: Array, batch: int) -> Array:
    """One key per row `[batch]`: `rng` folded in by the row's index. Row b draws its token at
    position p with `fold_in(row_keys[b], p)`."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, jnp.arange(batch))


def _position_keys(keys: Array, position: Array) -> Array:
    """Each row's key for its token at `position` (`row_keys`)."""
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, position)


def inputs_of(request: Request, rng: Array, max_new_tokens: int, temperature: float, top_p: Any) -> Inputs:
    """The traced inputs of a `Request`."""
    return Inputs(
        prompt=jnp.asarray(request.prompt),
        lengths=jnp.asarray(request.lengths),
        eos=jnp.asarray(request.eos),
        row_keys=row_keys(rng, request.prompt.shape[0]),
        max_new_tokens=jnp.int32(max_new_tokens),
        sampling=Sampling(jnp.float32(temperature), jnp.float32(1.0 if top_p is None else top_p)),
    )


def check_sampling(vocab_size: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    """ValueError naming the value unless temperature >= 0, top_k in [1, V], top_p in (0, 1]."""
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"generate: temperature={temperature!r} must be finite and >= 0")
    if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= vocab_size):
        raise ValueError(f"generate: top_k={top_k!r} must be in [1, {vocab_size}] or None")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"generate: top_p={top_p!r} must be in (0, 1] or None")


def outputs(request: Request, max_new_tokens: int, *results: Array) -> tuple[Any, Any]:
    """The padded results (tokens, logprobs, produced) as `generate` returns them: `[B,
    max_new_tokens]` (array prompts) or a list of each row's tokens up to and including its
    first end-of-text id (list prompts)."""
    tokens, logprobs, produced = (np.asarray(x)[: request.rows] for x in results)
    if not request.ragged:
        return jnp.asarray(tokens[:, :max_new_tokens]), jnp.asarray(logprobs[:, :max_new_tokens])
    rows = zip(tokens, logprobs, produced, strict=True)
    kept = [(jnp.asarray(t[:n]), jnp.asarray(p[:n])) for t, p, n in rows]
    return [t for t, _ in kept], [p for _, p in kept]


def generate(
    model: Any,
    params: Any,
    prompts: Any,
    max_new_tokens: int,
    *,
    rng: Array | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    return_logprobs: bool = False,
) -> Any:
    """New tokens after each prompt of a linen `TransformerLM` (transformers' `generate` meaning).

    `prompts`: a `[B, P]` int array, which returns `[B, max_new_tokens]` int32 (after a row's
    end-of-text, the first of `eos_token_id`), or a list of 1-D token sequences of any lengths,
    which returns a list of 1-D int32 arrays, each ending at and including its row's first
    end-of-text. `temperature` 0 is greedy and needs no `rng`; `top_k`, `top_p` (nucleus)
    filter the distribution as transformers' warpers do, in that order. `eos_token_id`: one id
    or several; the loop ends once every row has finished. `return_logprobs`: also the model's
    log-probability of each chosen token (before the filters), shaped as the tokens.
    Compiled once per bucket of (batch, prompt width, output width, cache length) and top_k
    (`prepare`): another prompt length in the same buckets reuses the program.
    """

    def run(inputs: Inputs, **static: Any) -> tuple[Array, Array, Array]:
        return compiled_decode(model, params, inputs, mesh=mesh_of(params), **static)

    settings = dict(rng=rng, temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id)
    return run_request(model, run, prompts, max_new_tokens, settings, return_logprobs)


def check_request(config: Any, prompts: Any, max_new_tokens: int, settings: dict) -> Request:
    """`generate`'s checks, host-side, before anything is computed (one ValueError naming the row
    or the value), and the request's buckets. `config`: the model's `TransformerConfig`;
    `settings`: temperature, top_k, top_p and eos_token_id (missing ones as `generate`'s
    defaults)."""
    settings = dict(dict(temperature=1.0, top_k=None, top_p=None, eos_token_id=None), **settings)
    check_sampling(config.vocab_size, settings["temperature"], settings["top_k"], settings["top_p"])
    check_causal(config)
    return prepare(config, config.decode_capacity, prompts, max_new_tokens, settings["eos_token_id"])


def checked_request(model: Any, prompts: Any, max_new_tokens: int, settings: dict) -> tuple[Request, Inputs]:
    """The checks of `generate` for either face (one ValueError naming the row or the value), then
    the request's buckets and its traced inputs. `settings`: rng, temperature, top_k, top_p and
    eos_token_id, as `generate`'s keywords."""
    request = check_request(model.config, prompts, max_new_tokens, settings)
    rng = decoding_key(settings["rng"], settings["temperature"], "generate")
    return request, inputs_of(request, rng, max_new_tokens, settings["temperature"], settings["top_p"])


def run_request(
    model: Any,
    run: Callable[..., Any],
    prompts: Any,
    max_new_tokens: int,
    settings: dict,
    return_logprobs: bool,
) -> Any:
    """`generate` for either face: `checked_request`, then `run(inputs, prefill=, out_width=,
    cache_length=, top_k=)` -> (tokens, logprobs, produced), and the results as `outputs`
    shapes them."""
    request, inputs = checked_request(model, prompts, max_new_tokens, settings)
    results = run(
        inputs,
        prefill=request.prefill,
        out_width=request.out_width,
        cache_length=request.cache_length,
        top_k=settings["top_k"],
    )
    tokens, logprobs = outputs(request, max_new_tokens, *results)
    return (tokens, logprobs) if return_logprobs else tokens


def _start_linen(model, params, inputs, prefill, out_width, cache_length, mesh=None):
    cache = zeroed_cache(model, inputs.prompt.shape[0], cache_length, mesh)
    return start(linen_step(model, params), cache, inputs, prefill, out_width)


def _advance_linen(model, params, state, inputs, top_k):
    return advance(linen_step(model, params), state, inputs, CHUNK_STEPS, top_k)


_compiled_start = jax.jit(
    _start_linen, static_argnames=("model", "prefill", "out_width", "cache_length", "mesh")
)
_compiled_advance = jax.jit(_advance_linen, static_argnames=("model", "top_k"), donate_argnames="state")


def stream(model: Any, params: Any, prompts: Any, max_new_tokens: int, **settings: Any) -> Iterator[list]:
    """`generate` of a linen `TransformerLM` a few steps at a time: yields each row's new tokens
    so far (a list of 1-D int32 NumPy arrays, ending at an end-of-text) after every
    `CHUNK_STEPS` decode steps (the first feeds the prefill's last prompt token), until every
    row has finished. `settings`:
    `generate`'s rng, temperature, top_k, top_p and eos_token_id (the checks run before the
    first token)."""
    settings = dict(dict(rng=None, temperature=1.0, top_k=None, top_p=None, eos_token_id=None), **settings)
    request, inputs = checked_request(model, prompts, max_new_tokens, settings)
    top_k = settings["top_k"]
    static = dict(prefill=request.prefill, out_width=request.out_width, cache_length=request.cache_length)
    state = _compiled_start(model, params, inputs, mesh=mesh_of(params), **static)
    last = int(request.lengths.max()) + max_new_tokens - 1  # the last position a row needs
    while True:
        state = _compiled_advance(model, params, state, inputs, top_k=top_k)
        tokens, produced, done, position = jax.device_get(
            (state.tokens, state.produced, state.done, state.position)
        )
        yield [tokens[i, : produced[i]] for i in range(request.rows)]
        if done.all() or position >= last:
            return


def sample_with_cache(
    step: Callable[..., Any],
    cache: Any,
    prompt: Array,
    rng: Array,
    sampling: Sampling,
    max_new_tokens: int,
    top_k: int | None,
    has_aux: bool = False,
) -> Any:
    """`max_new_tokens` tokens after every row of `prompt` `[B, P]`, traceable: the whole prompt
    through `step` at once, then one position per step inside `lax.scan`, with no stopping rule.

    `step(cache, tokens [B, T]) -> (logits [B, T, V], cache)` is one cached decode call (of a
    linen or an nnx model; with `has_aux` it returns `(logits, cache, aux)`). Row b draws its
    token at position p with `generate`'s key, `fold_in(row_keys(rng, B)[b], p)`, through
    `choose`: at the same settings and without an end-of-text id, a row's tokens are
    `generate`'s. Returns `[B, max_new_tokens]` int32; with `has_aux`, (tokens, the prompt
    call's aux, the decode steps' aux stacked `[max_new_tokens - 1, ...]`). The cache takes P +
    max_new_tokens - 1 positions (all but the last token).
    """
    batch, length = prompt.shape
    keys = row_keys(rng, batch)

    def call(cache: Any, tokens: Array) -> tuple[Array, Any, Any]:
        return step(cache, tokens) if has_aux else (*step(cache, tokens), None)

    def pick(logits: Array, position: Array) -> Array:
        return choose(logits[:, -1], _position_keys(keys, position), sampling, top_k)  # (B,)

    logits, cache, prompt_aux = call(cache, prompt)  # (B, P, V)
    first = pick(logits, jnp.int32(length))

    def body(carry: tuple[Array, Any], position: Array) -> tuple[tuple[Array, Any], tuple[Array, Any]]:
        token, cache = carry
        logits, cache, aux = call(cache, token[:, None])  # (B, 1, V)
        token = pick(logits, position)
        return (token, cache), (token, aux)

    positions = length + 1 + jnp.arange(max_new_tokens - 1, dtype=jnp.int32)
    _, (rest, steps_aux) = lax.scan(body, (first, cache), positions)  # rest: (max_new_tokens - 1, B)
    tokens = jnp.concatenate([first[:, None], rest.T], axis=1)  # (B, max_new_tokens)
    return (tokens, prompt_aux, steps_aux) if has_aux else tokens


def sample(
    model: Any,
    params: Any,
    prompt: Array,
    rng: Array,
    sampling: Sampling,
    max_new_tokens: int,
    top_k: int | None = None,
) -> Array:
    """`sample_with_cache` over a linen `TransformerLM` with a zeroed cache of its `max_len`
    positions: `[B, max_new_tokens]` int32 after `prompt` `[B, P]`. Traceable (training's
    samples run it inside their compiled evaluation); `max_new_tokens` and `top_k` are static."""
    cache = zeroed_cache(model, prompt.shape[0], model.config.max_len)
    return sample_with_cache(linen_step(model, params), cache, prompt, rng, sampling, max_new_tokens, top_k)


def end_of_text_of(directory: str | pathlib.Path) -> list[int] | None:
    """The end-of-text ids of a Hugging Face directory: `eos_token_id` (one id or several) of its
    generation_config.json, else of its config.json (or that file's `text_config`); None when
    neither names one. ValueError naming the file for one that is not JSON."""
    directory = pathlib.Path(directory)
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if not path.is_file():
            continue
        try:
            fields = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not JSON ({error})") from None
        eos = fields.get("eos_token_id", fields.get("text_config", {}).get("eos_token_id"))
        if eos is not None:
            return [int(token) for token in np.atleast_1d(eos)]
    return None


def check_causal(config: Any) -> None:
    """ValueError unless the model is causal (a decode cache is)."""
    if not config.causal:
        raise ValueError(
            "generate: the model has causal=False, and decoding with a cache is causal; decode with "
            "model.clone(config=dataclasses.replace(model.config, causal=True))"
        )
