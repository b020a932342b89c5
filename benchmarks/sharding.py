r"""The same training command on 1, 2, 4 and 8 simulated CPU devices.

  python benchmarks/sharding.py [--config char_lm] [--steps 200]

Each device count runs in a fresh process (the count is fixed when JAX
starts) through `train_and_evaluate`, with the batch split over all devices
(mesh.data = N). On 2 real cores no speed-up is expected: the point is that
the same command scales out and stays correct. Also the per-device memory of
the parameters and the optimizer state with mesh.model = 1 against 4.
Writes benchmarks/results/sharding.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.common import PYTHON, ROOT, write_results  # noqa: E402


def load_config(name: str, overrides: dict):
    module, _, variant = name.partition(":")
    config = importlib.import_module(f"configs.{module}").get_config(variant or None)
    for field, value in overrides.items():
        section, key = field.split(".")
        config[section][key] = value
    return config


def worker(spec: dict) -> None:
    """In a fresh process: train on `devices` simulated devices, print timings and memory."""
    import jax

    jax.config.update("jax_num_cpu_devices", spec["devices"])
    from qkv_jax.training import build_setup, init_train_state, make_optimizer, seed_keys, train_and_evaluate
    from qkv_jax.training.sharding import make_mesh, mesh_shape, state_shardings

    config = load_config(spec["config"], spec["overrides"])
    result = {"devices": spec["devices"]}
    if spec.get("train", True):
        summary = train_and_evaluate(config, spec["workdir"])
        result["steps_per_s"] = config.train.steps / summary["timings"]["train_loop_s"]
        result["final_loss"] = summary["final_loss"]
    flat = config.to_dict()
    setup = build_setup(flat)
    tx = make_optimizer(flat["train"])
    mesh = make_mesh(*mesh_shape(flat))
    shardings = state_shardings(
        jax.eval_shape(lambda k: init_train_state(setup, tx, k), seed_keys(0)["init"]), mesh
    )
    state = jax.jit(lambda k: init_train_state(setup, tx, k), out_shardings=shardings)(seed_keys(0)["init"])

    def per_device_bytes(tree):
        return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))

    result["params_bytes_per_device"] = per_device_bytes(state.params)
    result["opt_state_bytes_per_device"] = per_device_bytes(state.opt_state)
    print(json.dumps(result))


def spawn(spec: dict) -> dict:
    out = subprocess.run(
        [PYTHON, __file__, "--worker", json.dumps(spec)], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="flag_retrieval:multihead")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    common = {
        "train.steps": args.steps,
        "train.batch_size": args.batch_size,
        "train.log_every": 100,
        "train.checkpoint_every": args.steps,
        "model.num_heads": args.num_heads,
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for devices in (1, 2, 4, 8):
            rows.append(
                spawn(
                    {
                        "devices": devices,
                        "config": args.config,
                        "workdir": f"{tmp}/{devices}",
                        "overrides": {**common, "mesh.data": devices, "mesh.model": 1},
                    }
                )
            )
        memory = {
            model: spawn(
                {
                    "devices": 4,
                    "config": args.config,
                    "train": False,
                    "overrides": {**common, "mesh.data": 4 // model, "mesh.model": model},
                }
            )
            for model in (1, 4)
        }
    table = ["| devices (mesh.data) | steps/s | final loss |", "|---|---|---|"]
    table += [f"| {r['devices']} | {r['steps_per_s']:.1f} | {r['final_loss']:.4g} |" for r in rows]
    table += [
        "",
        "| mesh.model (4 devices) | params bytes per device | optimizer state bytes per device |",
        "|---|---|---|",
    ]
    table += [
        f"| {model} | {m['params_bytes_per_device']:,} | {m['opt_state_bytes_per_device']:,} |"
        for model, m in memory.items()
    ]
    ratios = {
        "steps_per_s_8_devices_over_1": rows[-1]["steps_per_s"] / rows[0]["steps_per_s"],
        "params_bytes_model_4_over_1": memory[4]["params_bytes_per_device"]
        / memory[1]["params_bytes_per_device"],
        "opt_state_bytes_model_4_over_1": memory[4]["opt_state_bytes_per_device"]
        / memory[1]["opt_state_bytes_per_device"],
    }
    print("\n".join(table))
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    command = f"python benchmarks/sharding.py --config {args.config} --steps {args.steps}"
    path = write_results(
        "sharding", command, {"table": table, "ratios": ratios, "rows": rows, "memory": memory}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
