"""Seed 000's flag-retrieval task, as a pure JAX function.

Each example is `seq_len` tokens of width `d_model`: `d_model - num_flags`
content dimensions drawn fresh from N(0, 1), then `num_flags` flag channels.
Flag channel j is 1 at one position p_j (distinct positions for distinct
channels) and 0 elsewhere. The target is the content at p_0, then at p_1, ...:
nothing about the content tells where the flags are, so raw embedding
similarity carries no signal; only the flag channels do. With one flag this is
the seed's `make_batch`: content ~ N(0, 1), the flag at a uniformly random
position, target = that position's content.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["flag_retrieval_batch"]


def flag_retrieval_batch(
    key: jax.Array, batch_size: int, seq_len: int, d_model: int, num_flags: int = 1
) -> dict[str, jax.Array]:
    """A batch of the flag task.

    Returns:
      inputs `[batch_size, seq_len, d_model]` float32,
      targets `[batch_size, num_flags * (d_model - num_flags)]`,
      flag_positions `[batch_size, num_flags]` int32 (position of each flag).
    """
    if not 1 <= num_flags <= seq_len or num_flags >= d_model:
        raise ValueError(
            f"flag_retrieval_batch: need 1 <= num_flags <= seq_len and num_flags < d_model, got "
            f"num_flags={num_flags}, seq_len={seq_len}, d_model={d_model}"
        )
    # One draw: the content, plus one extra standard normal per position whose
    # top num_flags entries pick the flagged positions (distinct, uniformly random).
    noise = jax.random.normal(key, (batch_size, seq_len, d_model - num_flags + 1))
    content = noise[..., :-1]  # (B, S, C)
    _, flag_positions = jax.lax.top_k(noise[..., -1], num_flags)  # (B, F)
    flag_positions = flag_positions.astype(jnp.int32)
    flags = jax.nn.one_hot(flag_positions, seq_len, axis=1)  # (B, S, F)
    inputs = jnp.concatenate([content, flags], axis=-1)  # (B, S, D)
    targets = jnp.take_along_axis(content, flag_positions[:, :, None], axis=1)  # (B, F, C)
    return {
        "inputs": inputs,
        "targets": targets.reshape(batch_size, -1),  # (B, F * C)
        "flag_positions": flag_positions,
    }
