"""`train.init_from`: a run that starts from another run's trained parameters.

`--config.train.init_from=SOURCE` names a run's workdir, its `checkpoints/`
directory, one checkpoint step directory (`W/checkpoints/300`) or a Hugging Face
model directory (config.json and safetensors, read by `qkv_jax.load_pretrained`,
as step 0 of that source). When the
run's own workdir has no checkpoint yet, the trainer starts from the source's
parameters (`checkpoints.read_params`: read-only, verified, the newest usable
checkpoint or the named step) at step 0 with a fresh optimizer state; once the
run has checkpoints of its own it resumes from those and reads the source no
more. The parameters go through `qkv_jax.finetune.fit_params`: shapes checked
(a ConfigError naming the first parameter that does not fit, with both
shapes), the model's LoRA adapters kept as initialised, the source's adapters
merged when this model has none (with the source's `model.lora_alpha` from its
config.json), and with `train.convert_kv_heads=True` the source's K/V heads
mean-pooled into this model's `model.num_kv_heads` groups (MHA -> GQA/MQA
uptraining).

`train.init_from` is not a resumable field: the same workdir started from
another source is another run (`prepare_workdir` refuses it).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
from absl import logging
from jax.sharding import Mesh, NamedSharding

from qkv_jax.finetune import fit_params
from qkv_jax.pretrained.io import is_pretrained_directory, load_pretrained
from qkv_jax.training.checkpoints import NoCheckpointError, RunLocation, Saved, read_params
from qkv_jax.training.validate import ConfigError

__all__ = ["read_source", "fitted_params", "initial_params"]


def read_source(config: dict, mesh: Mesh | None = None) -> Saved:
    """The parameters `train.init_from` names (host arrays, or a Hugging Face checkpoint's
    arrays at step 0, split over `mesh` when given: each process reads only its devices'
    slices); ConfigError when none is usable."""
    source = config["train"]["init_from"]
    if is_pretrained_directory(source):
        try:
            _, params = load_pretrained(source, mesh=mesh)
        except ValueError as error:  # PretrainedError: the file and the tensor
            raise ConfigError(f"train.init_from={source!r}: {error}") from None
        path = pathlib.Path(source).absolute()
        return Saved(params, 0, RunLocation(checkpoints=path, step=0, workdir=path))
    try:
        return read_params(source)
    except NoCheckpointError as error:
        raise ConfigError(
            f"train.init_from={source!r}: {error} (nor is it a Hugging Face checkpoint: no config.json "
            "beside a model.safetensors)"
        ) from None


def _source_lora_alpha(source: Saved) -> float | None:
    path = source.location.workdir / "config.json"
    if not path.is_file() or is_pretrained_directory(source.location.workdir):
        return None  # a Hugging Face config.json has no adapters
    return (json.loads(path.read_text()).get("model") or {}).get("lora_alpha")


def fitted_params(config: dict, source: Saved, target: Any) -> Any:
    """`target` (freshly initialised parameters) filled from `source` as `train.init_from` and
    `train.convert_kv_heads` ask (`qkv_jax.finetune.fit_params`); ConfigError when they do not
    fit. Pure, so it also runs under `jax.vmap` over a seed axis of `target` (each seed keeps
    its own fresh adapters)."""
    train, model = config["train"], config.get("model", {})
    num_kv_heads = None
    if train["convert_kv_heads"]:
        num_kv_heads = model.get("num_kv_heads") or model.get("num_heads")
        if num_kv_heads is None:
            raise ConfigError("train.convert_kv_heads=True: the model has no model.num_heads to convert to")
    try:
        return fit_params(
            source.tree, target, source_lora_alpha=_source_lora_alpha(source), num_kv_heads=num_kv_heads
        )
    except ValueError as error:  # ParamMismatchError, or a conversion that cannot pool
        hint = ""
        if model.get("num_kv_heads") is not None and not train["convert_kv_heads"]:
            hint = " (train.convert_kv_heads=True mean-pools the source's K/V heads into model.num_kv_heads)"
        raise ConfigError(f"train.init_from={train['init_from']!r}: {error}{hint}") from None


def initial_params(config: dict, target: Any, vmapped: bool) -> Any:
    """`target` (the run's fresh parameters; with `vmapped`, one set per seed) filled from
    `train.init_from`, placed as `target` is (a Hugging Face source is read onto `target`'s
    mesh, so no process holds the whole model)."""
    shardings = [leaf.sharding for leaf in jax.tree.leaves(target)]
    mesh = shardings[0].mesh if shardings and isinstance(shardings[0], NamedSharding) else None
    source = read_source(config, mesh if isinstance(mesh, Mesh) and mesh.size > 1 else None)
    fit = lambda params: fitted_params(config, source, params)
    params = jax.vmap(fit)(target) if vmapped else fit(target)
    params = jax.tree.map(lambda new, old: jax.device_put(new, old.sharding), params, target)
    logging.info("%s", f"starting from the parameters of step {source.step} in {source.location.checkpoints}")
    return params
