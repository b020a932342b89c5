"""One of two processes with 4 simulated CPU devices each, loading a checkpoint onto a (2, 4) mesh
of all 8 (a subprocess of tests/pretrained/test_pretrained_mesh.py and, with "workdir",
tests/pretrained/test_pretrained_finetune.py).

  python tests/pretrained/two_process_worker.py '{"coordinator": "127.0.0.1:PORT", "process": 0,
                                                  "directory": DIR, "tokens": [[...]], "out": DIR}'

"directory" is a Hugging Face checkpoint (`load_pretrained(mesh=...)`); "workdir" instead, a
fine-tuning run's newest checkpoint merged (`pretrained_text.read_merged(mesh=...)`). Writes
`out`/process_{i}.json: per parameter, the processes owning its shards on this process, the
bytes this process holds, whether it is a global array (not fully addressable) and whether its
sharding is `qkv_jax.sharding.param_shardings`'s; the logits (gathered) and the refusal of a mesh
over some of each process's devices. With "directory", process 0 also writes the directory that
`save_pretrained` wrote from the global arrays (every process gathering each tensor with it).
With "dies": PROCESS, that process dies at its first tensor and the other prints "loaded" after
its own load, then waits at a collective; both send their stderr through the launchers' filter
(`experiments.common.filter_peer_failures`).
"""

import json
import os
import pathlib
import sys

import jax

spec = json.loads(sys.argv[1])
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
if "dies" in spec:  # stderr through the launchers' filter, as experiments.common sets it up
    from experiments.common import filter_peer_failures

    filter_peer_failures()
jax.distributed.initialize(
    coordinator_address=spec["coordinator"],
    num_processes=2,
    process_id=spec["process"],
    heartbeat_timeout_seconds=spec.get("heartbeat_seconds", 100),
)

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from qkv_jax import lm, load_pretrained, save_pretrained  # noqa: E402
from qkv_jax.pretrained import io as pretrained_io  # noqa: E402
from qkv_jax.sharding import param_shardings  # noqa: E402
from qkv_jax.tasks.pretrained_text import read_merged  # noqa: E402
from qkv_jax.training.sharding import make_mesh  # noqa: E402

mesh = make_mesh(2, 4)
if "dies" in spec:  # that process dies at its first tensor; the other loads, then meets a collective
    if spec["process"] == spec["dies"]:
        pretrained_io.place = lambda *args: os._exit(3)
    load_pretrained(spec["directory"], mesh=mesh)
    print("loaded", flush=True)
    multihost_utils.process_allgather(np.zeros(1))
    sys.exit(0)


def load(mesh):
    """(config, parameters) of the checkpoint or the run's merged model, placed on `mesh`."""
    if "workdir" in spec:
        config, params, _ = read_merged(spec["workdir"], mesh=mesh)
        return config, params
    return load_pretrained(spec["directory"], mesh=mesh)


out = pathlib.Path(spec["out"])
config, params = load(mesh)
held = {}
rules = jax.tree.leaves(param_shardings(params, mesh))
for (path, leaf), rule in zip(jax.tree_util.tree_leaves_with_path(params), rules, strict=True):
    shards = {str(shard.index): shard.data.nbytes for shard in leaf.addressable_shards}  # distinct blocks
    held["/".join(str(k.key) for k in path)] = {
        "owners": sorted({shard.device.process_index for shard in leaf.addressable_shards}),
        "bytes": sum(shards.values()),
        "whole": leaf.nbytes,
        "global": isinstance(leaf, jax.Array) and not leaf.is_fully_addressable,
        "as_rules": leaf.sharding == rule,
    }
tokens = np.asarray(spec["tokens"], np.int32)
global_tokens = jax.make_array_from_callback(
    tokens.shape, NamedSharding(mesh, P("data")), lambda i: tokens[i]
)
logits = jax.jit(lm.TransformerLM(config).apply)({"params": params}, global_tokens)
logits = np.asarray(multihost_utils.process_allgather(logits, tiled=True))
if "directory" in spec:
    save_pretrained(out / "saved", config, params)
try:  # a mesh over 4 of the 8 devices, 2 of each process: refused before any tensor is read
    load(Mesh(np.asarray(jax.devices()[2:6]).reshape(2, 2), ("data", "model")))
except ValueError as refusal:
    refused = str(refusal)
result = {"process": jax.process_index(), "devices": jax.device_count(), "held": held, "refused": refused}
result["logits"] = logits.tolist()
(out / f"process_{jax.process_index()}.json").write_text(json.dumps(result))
print("ok")
