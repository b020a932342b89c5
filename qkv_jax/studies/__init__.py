"""Sweeps over config grids and the studies built on them (see docs/experiments.md)."""
