"""What benchmarks/gpu_check.sh has shown correct on a GPU: its cuDNN cases and the fused
kernel's cases against the reference path, by name, with the jax version and device they ran
on. Written by `python benchmarks/gpu_summary.py OUT --record` from a check's logs (never by
hand); `qkv_jax.attention.dispatch` sends a call to a path automatically only where the cases
of what the call uses passed here."""

CHECKED: dict[str, dict] = {}
