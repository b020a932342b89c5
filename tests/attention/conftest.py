"""The dispatch rule's expectations here are those of an empty GPU check record: what
benchmarks/gpu_check.sh has passed on a GPU (qkv_jax/attention/gpu_checked.py) moves calls to
cuDNN or the fused kernels there, and the tests of that record set it themselves."""

import pytest

from qkv_jax.attention import dispatch


@pytest.fixture(autouse=True)
def empty_gpu_check_record(monkeypatch):
    monkeypatch.setattr(dispatch, "CHECKED", {})
