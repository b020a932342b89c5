r"""Loading a random Llama-shaped checkpoint of about 1B parameters, bfloat16, sharded by
transformers: qkv_jax.load_pretrained against transformers' from_pretrained.

  python benchmarks/pretrained_load.py [--rounds 2] [--max-shard-size 500MB]

transformers writes the checkpoint (Llama 3.2 1B's shape: 16 layers, d_model 2048, GQA 32/8,
MLP 8192, a 128256-token vocabulary, tied embeddings; random weights) into a temporary
directory. Then, each in a fresh process and alternating for `--rounds` rounds, qkv_jax and
transformers (`dtype=torch.bfloat16`) load it; each process reports its load's wall time and
its peak resident memory (VmHWM) above its resident memory after imports (VmRSS). The files
are read once beforehand, so every load reads them from the page cache. Prints a markdown
table and writes benchmarks/results/pretrained_load.json (docs/benchmarks.md is rendered from
it by `python -m benchmarks.report`). The goals: one device, qkv_jax's time at most 2x
transformers' with every parameter read, its peak at most 1.1x the checkpoint's bytes above the
baseline; 2 processes x 4 simulated devices on a (2, 4) mesh, each process's peak at most 0.6x.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.common import PYTHON, ROOT, median, write_results  # noqa: E402

# Llama 3.2 1B's shape (transformers' LlamaConfig fields).
SHAPE = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
)
# qkv_jax; transformers as from_pretrained returns (its weights memory-mapped from the files, read
# when first used); transformers with every parameter then read once, as a first forward pass does.
# qkv_jax_mesh: two processes of 4 CPU devices each loading onto a (2, 4) mesh of all 8 (each
# process's peak: it reads and holds only its devices' blocks, half of every matrix).
LOADERS = ("qkv_jax", "transformers", "transformers_touched", "qkv_jax_mesh")


def status_bytes(field: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def write_checkpoint(directory: pathlib.Path, max_shard_size: str) -> None:
    """transformers writes a random bfloat16 Llama of SHAPE into `directory`, sharded."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPE)
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, max_shard_size=max_shard_size)


def load(loader: str, directory: str) -> dict:
    """In this (fresh) process: imports, the baseline, then one load; its time and peak."""
    if loader in ("qkv_jax", "qkv_jax_mesh"):
        import jax

        import qkv_jax

        mesh = None
        if loader == "qkv_jax_mesh":  # one of 2 processes x 4 CPU devices: a (2, 4) mesh of all 8
            jax.config.update("jax_num_cpu_devices", 4)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            process = int(os.environ["PRETRAINED_LOAD_PROCESS"])
            jax.distributed.initialize(os.environ["PRETRAINED_LOAD_COORDINATOR"], 2, process)
            from qkv_jax.training.sharding import make_mesh

            mesh = make_mesh(2, 4)
        jax.devices()  # the CPU client exists before the baseline

        def run():
            config, params = qkv_jax.load_pretrained(directory, mesh=mesh)
            jax.block_until_ready(params)
            return sum(leaf.size for leaf in jax.tree.leaves(params))
    else:
        import torch
        import transformers
        from transformers.models.llama import modeling_llama  # noqa: F401 (imported before the baseline)

        def run():
            model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
            if loader == "transformers_touched":
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.sum()  # reads every byte, allocating nothing of its size
            return sum(p.numel() for p in model.parameters())

    baseline = status_bytes("VmRSS")
    started = time.perf_counter()
    parameters = run()
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "baseline_bytes": baseline,
        "peak_above_baseline_bytes": status_bytes("VmHWM") - baseline,
        "parameters": parameters,
    }


def child(loader: str, directory: pathlib.Path) -> dict:
    result = subprocess.run(
        [PYTHON, __file__, "--child", loader, str(directory)], cwd=ROOT, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"{loader} load failed:\n{result.stderr[-3000:]}")
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


def mesh_child(directory: pathlib.Path) -> dict:
    """Both processes of a 2 x 4-device load: the slower one's time, the larger peak."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    processes = [
        subprocess.Popen(
            [PYTHON, __file__, "--child", "qkv_jax_mesh", str(directory)],
            cwd=ROOT,
            env={
                **os.environ,
                "PRETRAINED_LOAD_PROCESS": str(i),
                "PRETRAINED_LOAD_COORDINATOR": f"127.0.0.1:{port}",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=1800) for p in processes]
    if any(p.returncode for p in processes):
        raise RuntimeError(f"mesh load failed:\n{outputs[0][1][-3000:]}\n{outputs[1][1][-3000:]}")
    runs = [json.loads([line for line in out.splitlines() if line.startswith("{")][-1]) for out, _ in outputs]
    return {
        "seconds": max(r["seconds"] for r in runs),
        "baseline_bytes": max(r["baseline_bytes"] for r in runs),
        "peak_above_baseline_bytes": max(r["peak_above_baseline_bytes"] for r in runs),
        "parameters": runs[0]["parameters"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-shard-size", default="500MB")
    parser.add_argument("--child", nargs=2, metavar=("LOADER", "DIRECTORY"), help=argparse.SUPPRESS)
    parser.add_argument("--write", metavar="DIRECTORY", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(load(*args.child)))
        return
    if args.write:
        write_checkpoint(pathlib.Path(args.write), args.max_shard_size)
        return
    with tempfile.TemporaryDirectory(prefix="pretrained_load_") as folder:
        directory = pathlib.Path(folder) / "llama"
        subprocess.run(  # in a process of its own, whose memory is gone before the loads
            [PYTHON, __file__, "--write", str(directory), "--max-shard-size", args.max_shard_size],
            cwd=ROOT,
            check=True,
        )
        files = sorted(directory.glob("*.safetensors"))
        stored = sum(path.stat().st_size for path in files)
        for path in files:  # into the page cache, for both loaders alike
            path.read_bytes()
        runs: dict[str, list[dict]] = {loader: [] for loader in LOADERS}
        for _ in range(args.rounds):
            for loader in LOADERS:
                runs[loader].append(
                    mesh_child(directory) if loader == "qkv_jax_mesh" else child(loader, directory)
                )
        load_average = os.getloadavg()[1]  # over the last 5 minutes: the loads' time
    summary = {
        loader: {
            "seconds": median([r["seconds"] for r in results]),
            "peak_above_baseline_bytes": max(r["peak_above_baseline_bytes"] for r in results),
            "parameters": results[0]["parameters"],
        }
        for loader, results in runs.items()
    }
    gib = 2**30
    table = [
        f"Checkpoint: {summary['qkv_jax']['parameters'] / 1e9:.2f}B parameters, {stored / gib:.2f} GiB in "
        f"{len(files)} bfloat16 shards of at most {args.max_shard_size}, written by transformers "
        f"(Llama 3.2 1B's shape, random weights); each load in a fresh process, median time and "
        f"largest peak of {args.rounds} rounds, files in the page cache; the machine's load average "
        f"during the loads was {load_average:.1f} on {os.cpu_count()} cores. transformers maps the "
        "files into memory and reads a weight when it is first used; the third row reads every "
        "parameter once after from_pretrained, as a first forward pass would.",
        "",
        "| loader | load time (s) | peak resident above baseline (GiB) | peak / checkpoint bytes |",
        "|---|---|---|---|",
        *(
            f"| {name} | {s['seconds']:.2f} | {s['peak_above_baseline_bytes'] / gib:.2f} | "
            f"{s['peak_above_baseline_bytes'] / stored:.2f}x |"
            for name, s in (
                ("qkv_jax.load_pretrained", summary["qkv_jax"]),
                ("transformers from_pretrained(dtype=bfloat16)", summary["transformers"]),
                ("the same, then every parameter read once", summary["transformers_touched"]),
                (
                    "qkv_jax.load_pretrained, 2 processes x 4 devices, (2, 4) mesh (per process)",
                    summary["qkv_jax_mesh"],
                ),
            )
        ),
    ]
    ratios = {
        "qkv_jax peak resident above baseline / checkpoint bytes (goal <= 1.1)": (
            summary["qkv_jax"]["peak_above_baseline_bytes"] / stored
        ),
        "qkv_jax, 2 processes x 4 devices: a process's peak above baseline / checkpoint (goal <= 0.6)": (
            summary["qkv_jax_mesh"]["peak_above_baseline_bytes"] / stored
        ),
        "transformers peak resident above baseline / checkpoint bytes": (
            summary["transformers"]["peak_above_baseline_bytes"] / stored
        ),
        "qkv_jax load time / transformers load time": summary["qkv_jax"]["seconds"]
        / summary["transformers"]["seconds"],
        "qkv_jax load time / transformers load time with every parameter read (goal <= 2.0)": (
            summary["qkv_jax"]["seconds"] / summary["transformers_touched"]["seconds"]
        ),
    }
    print("\n".join(table))
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    path = write_results(
        "pretrained_load",
        f"python benchmarks/pretrained_load.py --rounds {args.rounds} --max-shard-size {args.max_shard_size}",
        {
            "title": "Loading a 1B-parameter bfloat16 Llama checkpoint (CPU)",
            "table": table,
            "ratios": ratios,
            "checkpoint_bytes": stored,
            "shards": len(files),
            "load_average_5min": load_average,
            "summary": summary,
            "runs": runs,
        },
    )
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
