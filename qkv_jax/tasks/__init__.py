"""Synthetic tasks as pure JAX functions of a PRNG key."""

from qkv_jax.tasks.flag import flag_retrieval_batch

__all__ = ["flag_retrieval_batch"]
