"""Benchmarks: scripts run side by side with their peers, reporting ratios."""
