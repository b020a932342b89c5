"""Next-token tasks with a known right answer, as pure JAX functions of a PRNG key.

Each returns `inputs` and `targets` `[batch, L]` int32 (the sequence and its
shift by one) and `answer_mask` `[batch, L]` bool: the target positions whose
token is determined by the earlier ones. A model is scored on those.

  copy_batch     random symbols, a separator, the same symbols again: the copy
                 is determined (an induction head solves it).
  bracket_batch  a random prefix of opening and closing brackets of several
                 types, '=', then the closing brackets that complete it,
                 innermost first, then an end token: needs a stack.
  repeat_batch   random tokens in which a segment appears twice, at random
                 places: the repeat is predictable only by looking the current
                 token up earlier in the sequence (an induction head), since
                 where the copies are changes from sequence to sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "copy_batch",
    "bracket_batch",
    "repeat_batch",
    "BRACKET_PAD",
    "BRACKET_EQUALS",
    "COPY_SEPARATOR",
]

COPY_SEPARATOR = 0
BRACKET_PAD = 0  # also the end of a completion
BRACKET_EQUALS = 1


def _shifted(sequence: jax.Array, answer_mask: jax.Array) -> dict[str, jax.Array]:
    return {
        "inputs": sequence[:, :-1].astype(jnp.int32),  # (B, L)
        "targets": sequence[:, 1:].astype(jnp.int32),  # (B, L)
        "answer_mask": answer_mask,  # (B, L)
    }


def copy_batch(key: jax.Array, batch_size: int, length: int, vocab_size: int) -> dict[str, jax.Array]:
    """Sequences `x, SEP, x` of `2 length + 1` tokens; x is `length` uniform symbols in
    `[1, vocab_size)`, SEP is 0. Inputs and targets `[batch, 2 length]`; the
    answers are the `length` targets after SEP."""
    if length < 1 or vocab_size < 2:
        raise ValueError(f"copy_batch: need length >= 1 and vocab_size >= 2, got {length}, {vocab_size}")
    symbols = jax.random.randint(key, (batch_size, length), 1, vocab_size)  # (B, n)
    separator = jnp.full((batch_size, 1), COPY_SEPARATOR, symbols.dtype)
    sequence = jnp.concatenate([symbols, separator, symbols], axis=1)  # (B, 2n + 1)
    answer_mask = jnp.arange(2 * length) >= length  # (2n,)
    return _shifted(sequence, jnp.broadcast_to(answer_mask, (batch_size, 2 * length)))


def _bracket_prefix(key: jax.Array, prefix_len: int, num_types: int):
    """One random prefix: (tokens [P], the stack of open types [P], its depth)."""

    def step(carry, keys):
        stack, depth = carry
        open_key, type_key = keys
        opens = (depth == 0) | jax.random.bernoulli(open_key)
        kind = jax.random.randint(type_key, (), 0, num_types)
        top = stack[jnp.maximum(depth - 1, 0)]
        token = jnp.where(opens, 2 + kind, 2 + num_types + top)
        stack = jnp.where(opens, stack.at[depth].set(kind), stack)
        return (stack, jnp.where(opens, depth + 1, depth - 1)), token

    keys = jax.random.split(key, 2 * prefix_len).reshape(prefix_len, 2, -1)  # (P, 2, key)
    initial = (jnp.zeros(prefix_len, jnp.int32), jnp.zeros((), jnp.int32))
    (stack, depth), tokens = lax.scan(step, initial, (keys[:, 0], keys[:, 1]))
    return tokens, stack, depth  # (P,), (P,), ()


def bracket_batch(
    key: jax.Array, batch_size: int, prefix_len: int, num_types: int = 3
) -> dict[str, jax.Array]:
    """Bracket completion: `prefix, '=', completion` of `2 prefix_len + 1` tokens.

    Vocabulary `2 + 2 num_types`: 0 pad/end, 1 '=', `2 + t` opens type t,
    `2 + num_types + t` closes it. The prefix is a random walk (open with
    probability 1/2, a random type; close the innermost open bracket
    otherwise; always open at depth 0). The completion closes the d brackets
    still open, innermost first, then pads. Inputs and targets
    `[batch, 2 prefix_len]`; the answers are the d closers and the end token.
    """
    if prefix_len < 1 or num_types < 1:
        raise ValueError(
            f"bracket_batch: need prefix_len >= 1 and num_types >= 1, got {prefix_len}, {num_types}"
        )
    keys = jax.random.split(key, batch_size)
    prefix, stack, depth = jax.vmap(_bracket_prefix, in_axes=(0, None, None))(keys, prefix_len, num_types)
    steps = jnp.arange(prefix_len)  # (P,)
    innermost_first = depth[:, None] - 1 - steps  # (B, P) stack index of completion step j
    closers = 2 + num_types + jnp.take_along_axis(stack, jnp.maximum(innermost_first, 0), axis=1)
    completion = jnp.where(innermost_first >= 0, closers, BRACKET_PAD)  # (B, P)
    equals = jnp.full((batch_size, 1), BRACKET_EQUALS, prefix.dtype)
    sequence = jnp.concatenate([prefix, equals, completion], axis=1)  # (B, 2P + 1)
    answers = steps[None, :] <= depth[:, None]  # (B, P): the closers and the end token
    answer_mask = jnp.concatenate([jnp.zeros_like(answers), answers], axis=1)  # (B, 2P)
    return _shifted(sequence, answer_mask)


def repeat_batch(key: jax.Array, batch_size: int, length: int, vocab_size: int) -> dict[str, jax.Array]:
    """`2 length + 1` uniform random tokens from `[0, vocab_size)` in which a segment of
    `length // 2` tokens appears twice: first starting anywhere in the first half, again
    starting anywhere in the second half (both starts random per sequence), so the repeat is
    predictable only by finding the current token earlier in the sequence (an induction
    head), not by its position. Inputs and targets `[batch, 2 length]`; the answers are the
    tokens of the second copy after its first."""
    if length < 2 or vocab_size < 2:
        raise ValueError(f"repeat_batch: need length >= 2 and vocab_size >= 2, got {length}, {vocab_size}")
    segment = length // 2
    token_key, first_key, second_key = jax.random.split(key, 3)
    tokens = jax.random.randint(token_key, (batch_size, 2 * length + 1), 0, vocab_size)  # (B, 2L + 1)
    first = jax.random.randint(first_key, (batch_size, 1), 0, length - segment + 1)  # (B, 1)
    second = jax.random.randint(second_key, (batch_size, 1), length, 2 * length + 2 - segment)  # (B, 1)
    positions = jnp.arange(2 * length + 1)  # (2L + 1,)
    in_copy = (positions >= second) & (positions < second + segment)  # (B, 2L + 1)
    source = jnp.where(in_copy, positions - second + first, positions)  # the copy reads the first
    sequence = jnp.take_along_axis(tokens, source, axis=1)
    targets = jnp.arange(2 * length)  # target t is sequence token t + 1
    answer_mask = (targets >= second) & (targets < second + segment - 1)  # (B, 2L): copy tokens 1 ..
    return _shifted(sequence, answer_mask)
