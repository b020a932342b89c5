"""Sweeps over config grids and the studies built on them (see docs/experiments.md).

They live beside the launchers in a checkout, on top of the library: the installed qkv_jax
does not carry or import them.
"""
