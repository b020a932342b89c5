"""Runs train_and_evaluate on simulated CPU devices (a subprocess of tests/training/test_sharding.py).

  python tests/multidevice.py '{"devices": 8, "runs": [{"workdir": ..., "config": "flag_retrieval:multihead",
                                                       "overrides": {"mesh.data": 4, ...}}]}'

The device count has to be set before JAX starts, hence a separate process.
"""

import json
import os
import sys

import jax

spec = json.loads(sys.argv[1])
jax.config.update("jax_num_cpu_devices", spec["devices"])
if os.environ.get("QKV_JAX_COMPILATION_CACHE"):  # the test session's (tests/launch.py)
    jax.config.update("jax_compilation_cache_dir", os.environ["QKV_JAX_COMPILATION_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)

import importlib  # noqa: E402

from qkv_jax.training import train_and_evaluate  # noqa: E402

for run in spec["runs"]:
    module, _, variant = run["config"].partition(":")
    config = importlib.import_module(f"configs.{module}").get_config(variant or None)
    for field, value in run["overrides"].items():
        section, name = field.split(".")
        config[section][name] = value
    train_and_evaluate(config, run["workdir"])
print("ok")
