"""The blocked attention kernel's old home: it lives in `qkv_jax.attention.chunked`, whose
names (and `window_pair`) stay importable from here."""

from qkv_jax.attention import chunked as _moved
from qkv_jax.attention.chunked import *  # noqa: F403 (the names of its __all__)
from qkv_jax.attention.visibility import window_pair

__all__ = [*_moved.__all__, "window_pair"]
