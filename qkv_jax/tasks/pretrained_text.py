"""Fine-tuning a pretrained Hugging Face model on a text file: the task, and exporting the result.

  python -m experiments.train --config configs/pretrained_text.py --workdir W \
    --config.train.init_from=DIR --config.data.path=FILE [--config.model.lora_rank=4]
  python -m experiments.export --workdir W --out DIR2

`train.init_from` names a Hugging Face directory (config.json, safetensors, tokenizer.json) or
a workdir of this task (or one of its checkpoints): its config is the model section's base
(`transformer_config(base=)`: each model field the config sets replaces the checkpoint's,
e.g. `model.lora_rank=4`, `model.num_kv_heads=2` with `train.convert_kv_heads=True`), its
parameters the starting point (`qkv_jax.training.init_from`), its tokenizer.json the
tokenizer. `data.path`, a UTF-8 text file, is cut into documents at `data.separator`; the
last `data.validation_fraction` of them validate (a single document: the end of its text).
Each document is encoded as the tokenizer encodes a text (a Llama's BOS first, say), the
documents are concatenated and cut into rows of `task.seq_len + 1` tokens (consecutive rows
share one token, so every next-token pair is in exactly one row), and every token carries
its document's number as a segment id: attention never crosses a document boundary,
positions restart at each document's start in a row, and a pair whose tokens belong to two
documents is not a target (the last row's padding, segment 0, neither).

Metrics (nats per token, weighted by the targets): train_loss on `eval.num_examples` random
training rows, val_loss and val_perplexity on the first `eval.num_examples` validation rows.

`save_examples` writes `pretrained/` into the workdir when the run starts: the config.json
of the model without its adapters (as the family of the source writes it) and the source's
tokenizer.json. `export_run` (`experiments.export`) reads the newest verified checkpoint,
merges the adapters and saves a directory transformers loads, with that tokenizer.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from qkv_jax import text
from qkv_jax.lm import TransformerConfig, TransformerLM
from qkv_jax.lora import merge_lora
from qkv_jax.pretrained.io import is_pretrained_directory, load_config
from qkv_jax.pretrained.save import pick_family, save_pretrained
from qkv_jax.pretrained.tokenizer import TOKENIZER_FILE, PretrainedTokenizer, load_tokenizer
from qkv_jax.sharding import check_mesh, param_shardings
from qkv_jax.tasks.transformer import init_params, make_model, token_cross_entropy, training_logits
from qkv_jax.training import validate
from qkv_jax.training.setup import Setup
from qkv_jax.training.validate import ConfigError
from qkv_jax.training.workdir import write_atomic, write_json

__all__ = [
    "PRETRAINED_DIR",
    "PretrainedText",
    "build",
    "source_directory",
    "split_documents",
    "pack_documents",
    "without_adapters",
    "read_run",
    "is_run",
    "read_merged",
    "export_run",
]

# The workdir's copy of what the run started from: config.json (the model without adapters),
# tokenizer.json and, when the source has one, generation_config.json (its end-of-text ids).
PRETRAINED_DIR = "pretrained"
GENERATION_CONFIG = "generation_config.json"
_ADAPTER_DEFAULTS: dict[str, Any] = {
    f.name: f.default
    for f in dataclasses.fields(TransformerConfig)
    if f.name in ("lora_alpha", "lora_targets")
}


def source_directory(init_from: Any) -> pathlib.Path:
    """The directory holding the config.json and tokenizer.json `train.init_from` starts from: a
    Hugging Face directory itself, or the `pretrained/` of a workdir of this task (named by the
    workdir, its checkpoints/ or one step directory). ConfigError when it is neither."""
    if not isinstance(init_from, str) or not init_from:
        raise ConfigError(
            f"train.init_from={init_from!r}: the pretrained_text task starts from a Hugging Face model "
            "directory (config.json, model.safetensors, tokenizer.json) or a workdir of this task"
        )
    if is_pretrained_directory(init_from):
        return pathlib.Path(init_from)
    from qkv_jax.training.checkpoints import NoCheckpointError, locate_run  # orbax: see read_merged

    try:
        workdir = locate_run(init_from).workdir
    except NoCheckpointError:
        raise ConfigError(
            f"train.init_from={init_from!r}: neither a Hugging Face model directory (config.json beside "
            "model.safetensors) nor a run's workdir or checkpoint"
        ) from None
    if not (workdir / PRETRAINED_DIR / "config.json").is_file():
        raise ConfigError(
            f"train.init_from={init_from!r}: a run of another task ({workdir / PRETRAINED_DIR}/config.json "
            "is missing); start from a Hugging Face model directory or a pretrained_text run"
        )
    return workdir / PRETRAINED_DIR


def without_adapters(config: TransformerConfig) -> TransformerConfig:
    """`config` with no LoRA adapters (and the adapter fields at their defaults): the config of
    the merged model, as a config.json reads back."""
    return dataclasses.replace(config, lora_rank=0, **_ADAPTER_DEFAULTS)


def _read_text(path: str) -> str:
    """The text of `data.path`; ConfigError naming the file when it is not UTF-8 or holds nothing."""
    try:
        raw = pathlib.Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"data.path={path!r}: not readable ({error.strerror})") from None
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"data.path={path!r}: not UTF-8 text (byte 0x{raw[error.start]:02x} at offset {error.start})"
        ) from None
    if not content.strip():
        raise ConfigError(f"data.path={path!r}: the file is empty; the task trains on its text")
    return content


def split_documents(content: str, separator: str, validation_fraction: float) -> tuple[list[str], list[str]]:
    """(training documents, validation documents) of a text: its documents (`separator`-split,
    blank ones dropped; '' = the whole text is one) in order, the last
    ceil(fraction * count) of them validating (at least one document trains); a single
    document is cut where `qkv_jax.text.split_documents` cuts it."""
    documents = [d for d in (content.split(separator) if separator else [content]) if d.strip()]
    if len(documents) == 1:
        train, validation = text.split_documents([("text", documents[0])], validation_fraction)
        return [train], [validation]
    held = min(len(documents) - 1, max(1, math.ceil(len(documents) * validation_fraction)))
    return documents[:-held], documents[-held:]


def pack_documents(documents: list[np.ndarray], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, segment ids), int32 `[R, seq_len + 1]` each: the documents' ids concatenated and
    cut into rows of seq_len + 1 that overlap by one token (row r starts at token r * seq_len);
    document i's tokens have segment id i + 1, the last row's padding token 0 in segment 0."""
    stream = np.concatenate(documents).astype(np.int32)
    segments = np.concatenate([np.full(len(d), i + 1, np.int32) for i, d in enumerate(documents)])
    rows = max(1, math.ceil((len(stream) - 1) / seq_len))
    padding = rows * seq_len + 1 - len(stream)
    stream, segments = (np.pad(a, (0, padding)) for a in (stream, segments))
    index = np.arange(rows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]  # (R, T + 1)
    return stream[index], segments[index]


def _targets_of(tokens: jax.Array, segments: jax.Array) -> dict:
    """A batch of rows `[B, T + 1]`: inputs, targets and their segments `[B, T]`, and weights
    (1 where input and target are of one document)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    before, after = segments[:, :-1], segments[:, 1:]
    weights = ((before == after) & (before > 0)).astype(jnp.float32)
    return {"inputs": inputs, "targets": targets, "segments": before, "weights": weights}


def _copy_text(source: pathlib.Path, target: pathlib.Path) -> None:
    text = source.read_text(encoding="utf-8")
    write_atomic(target, lambda file: file.write(text))


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: jit keys on its bound methods
class PretrainedText:
    """The task's pure functions (`Setup`'s fields are its bound methods)."""

    model: TransformerLM
    tokenizer: PretrainedTokenizer
    seq_len: int
    batch_size: int
    num_examples: int
    source: pathlib.Path  # the directory with the config.json and tokenizer.json started from
    hf_config: dict  # config.json of the model without adapters

    def init(self, key: jax.Array) -> Any:
        return init_params(self.model, self.seq_len, key)

    def rows(self, key: jax.Array, data: dict, split: str, size: int) -> dict:
        chosen = jax.random.randint(key, (size,), 0, data[f"{split}_tokens"].shape[0])  # (B,)
        return _targets_of(data[f"{split}_tokens"][chosen], data[f"{split}_segments"][chosen])

    def sample_batch(self, key: jax.Array, data: dict) -> dict:
        return self.rows(key, data, "train", self.batch_size)

    def token_loss(self, logits: jax.Array, batch: dict) -> jax.Array:
        """Mean cross-entropy (nats) over the batch's targets."""
        losses = token_cross_entropy(logits, batch["targets"]) * batch["weights"]  # (B, T)
        return losses.sum() / jnp.maximum(batch["weights"].sum(), 1.0)

    def loss(self, params: Any, batch: dict, rng: jax.Array) -> tuple[jax.Array, dict]:
        logits = training_logits(self.model, params, batch["inputs"], rng, segment_ids=batch["segments"])
        return self.token_loss(logits, batch), {}

    def evaluate(self, params: Any, key: jax.Array, data: dict) -> tuple[dict, dict]:
        def mean_loss(batch: dict) -> jax.Array:
            logits = self.model.apply({"params": params}, batch["inputs"], segment_ids=batch["segments"])
            return self.token_loss(jnp.asarray(logits), batch)

        size = min(self.num_examples, data["validation_tokens"].shape[0])
        validation = _targets_of(data["validation_tokens"][:size], data["validation_segments"][:size])
        metrics = {"train_loss": mean_loss(self.rows(key, data, "train", self.num_examples))}
        metrics["val_loss"] = mean_loss(validation)
        metrics["val_perplexity"] = jnp.exp(metrics["val_loss"])
        return metrics, {}

    def save_examples(self, workdir: str | pathlib.Path, stage: str, examples: dict) -> dict:
        """`pretrained/` (config.json of the model without adapters, the source's tokenizer.json
        and generation_config.json when it has one), written atomically file by file when the run
        starts."""
        del examples
        if stage == "before":
            directory = pathlib.Path(workdir) / PRETRAINED_DIR
            directory.mkdir(exist_ok=True)
            for name in (TOKENIZER_FILE, GENERATION_CONFIG):
                if name == TOKENIZER_FILE or (self.source / name).is_file():
                    _copy_text(self.source / name, directory / name)
            write_json(directory / "config.json", self.hf_config)
        return {}


def _source_config(
    source: pathlib.Path, init_from: str
) -> tuple[TransformerConfig, str, PretrainedTokenizer]:
    """(config, model_type, tokenizer) of the directory `train.init_from` names."""
    try:
        base, model_type = load_config(source)
        tokenizer = load_tokenizer(source, vocab_size=base.vocab_size)
    except ValueError as error:  # PretrainedError, a missing or unreadable tokenizer.json
        raise ConfigError(f"train.init_from={init_from!r}: {error}") from None
    return base, model_type, tokenizer


def _config_json(config: TransformerConfig, model_type: str) -> dict:
    """The config.json the merged model is exported with (the source's family); ConfigError when
    the family cannot hold the model the config asks for."""
    try:
        return pick_family(without_adapters(config), model_type)[1]
    except ValueError as error:
        raise ConfigError(
            f"model: the fine-tuned model cannot be exported as {model_type!r} ({error})"
        ) from None


def _encode(tokenizer: PretrainedTokenizer, documents: list[str], path: str) -> list[np.ndarray]:
    try:
        return [tokenizer.encode(document) for document in documents]
    except ValueError as error:  # a token outside the model's vocabulary
        raise ConfigError(f"data.path={path!r}: {error}") from None


def _check_split(name: str, segments: np.ndarray, path: str) -> None:
    if not (segments[:, 1:] == segments[:, :-1]).any():
        raise ConfigError(
            f"data.path={path!r}: the {name} split has no document of two tokens or more to predict; "
            "give a longer text or change data.validation_fraction"
        )


def validate_config(config: Any) -> None:
    """The task's own fields (those that need no file read)."""
    validate.require_positive_int(config, "task.seq_len", "eval.num_examples")
    validate.require_fraction(config, "data.validation_fraction")
    data = config["data"]
    if data["validation_fraction"] == 0:
        raise ConfigError("data.validation_fraction=0: must be in (0, 1)")
    if not isinstance(data["separator"], str):
        raise ConfigError(f"data.separator={data['separator']!r}: must be a string ('' = one document)")
    path = data["path"]
    if not isinstance(path, str) or not pathlib.Path(path).is_file():
        raise ConfigError(f"data.path={path!r}: not a readable file (the text to fine-tune on)")
    if config["train"]["convert_kv_heads"] and config["model"].get("num_kv_heads") is None:
        raise ConfigError("train.convert_kv_heads=True: set model.num_kv_heads, the K/V heads to pool into")


def build(config: Any) -> Setup:
    """The task's Setup: the source's config, tokenizer and model; the text read, split, packed."""
    validate_config(config)
    init_from, data_config = config["train"]["init_from"], config["data"]
    source = source_directory(init_from)
    base, model_type, tokenizer = _source_config(source, init_from)
    model = make_model(config["model"], base.vocab_size, base=base)
    seq_len = config["task"]["seq_len"]
    if seq_len > model.config.max_len:
        raise ConfigError(
            f"task.seq_len={seq_len}: longer than the model's {model.config.max_len} positions "
            f"(max_position_embeddings of {source / 'config.json'})"
        )
    shards = config["mesh"]["model"]
    if isinstance(shards, int) and shards > 1 and model.config.num_heads % shards:
        raise ConfigError(
            f"mesh.model={shards}: does not divide the model's {model.config.num_heads} heads "
            f"({source / 'config.json'})"
        )
    hf_config = _config_json(model.config, model_type)
    path = data_config["path"]
    splits = split_documents(_read_text(path), data_config["separator"], data_config["validation_fraction"])
    data = {}
    for name, documents in zip(("train", "validation"), splits, strict=True):
        tokens, segments = pack_documents(_encode(tokenizer, documents, path), seq_len)
        _check_split(name, segments, path)
        data[f"{name}_tokens"], data[f"{name}_segments"] = jnp.asarray(tokens), jnp.asarray(segments)
    task = PretrainedText(
        model=model,
        tokenizer=tokenizer,
        seq_len=seq_len,
        batch_size=config["train"]["batch_size"],
        num_examples=config["eval"]["num_examples"],
        source=source,
        hf_config=hf_config,
    )
    return Setup.from_methods(task, model=model, data=data, outputs=(PRETRAINED_DIR,))


def read_run(workdir: str | pathlib.Path) -> tuple[TransformerConfig, str]:
    """(the model's TransformerConfig, adapters included; its model_type) of the pretrained_text
    run in `workdir`, from its config.json and pretrained/config.json (nothing is computed).
    ValueError naming the workdir when it is not such a run."""
    workdir = pathlib.Path(workdir)
    for name in ("config.json", f"{PRETRAINED_DIR}/config.json"):
        if not (workdir / name).is_file():
            raise ValueError(
                f"--workdir={str(workdir)!r}: no {name}; is it a pretrained_text run that trained?"
            )
    run_config = json.loads((workdir / "config.json").read_text())
    base, model_type = load_config(workdir / PRETRAINED_DIR)
    model_config = make_model(run_config["model"], base.vocab_size, base=base).config
    return model_config, model_type


def is_run(path: str | pathlib.Path) -> bool:
    """Whether `path` is the workdir of a run of this task (config.json and pretrained/config.json)."""
    path = pathlib.Path(path)
    return (path / "config.json").is_file() and (path / PRETRAINED_DIR / "config.json").is_file()


def read_merged(workdir: str | pathlib.Path, mesh: Mesh | None = None) -> tuple[TransformerConfig, Any, int]:
    """(the model's config without adapters, its parameters with the adapters merged into the
    kernels, the checkpoint's step) of the run's newest verified checkpoint: the model
    `export_run` writes, read in place as `load_pretrained` reads the export (the config's
    `dtype` and `param_dtype` the parameters', the arrays on the default device). ValueError,
    one line, for a workdir without a run or a checkpoint.

    With `mesh` (a `jax.sharding.Mesh` with axes "data" and "model") the parameters are global
    jax.Arrays split as `load_pretrained(mesh=...)` splits the export's
    (`qkv_jax.sharding.param_shardings`), the same values as on one device; the mesh is checked
    against the model (`qkv_jax.sharding.check_mesh`, one-line ValueError) before the checkpoint
    is read. Each process holds the whole merged model on its host while placing it (one host
    is the main case; under `jax.distributed` each process places its own devices' blocks)."""
    workdir = pathlib.Path(workdir)
    config, _ = read_run(workdir)
    if mesh is not None:
        check_mesh(mesh, config)
    if not (workdir / "checkpoints").is_dir():
        raise ValueError(f"--workdir={str(workdir)!r}: has no checkpoints/ (the run has not saved one yet)")
    # Imported here: orbax costs about 0.2 s, which a checkpoint directory's readers
    # (`is_run`, `read_run`) and the generate command line's first token do not pay.
    from qkv_jax.training.checkpoints import NoCheckpointError, read_params

    try:
        saved = read_params(workdir)
    except NoCheckpointError as error:
        raise ValueError(f"--workdir={str(workdir)!r}: {error}") from None
    host = jax.tree.map(np.asarray, merge_lora(saved.tree, config.lora_alpha))
    stored = np.dtype(jax.tree.leaves(host)[0].dtype)
    merged = dataclasses.replace(without_adapters(config), dtype=stored, param_dtype=stored)
    return merged, _placed(host, mesh), saved.step


def _placed(host: Any, mesh: Mesh | None) -> Any:
    """Host arrays on the default device, uncommitted, as `load_pretrained` places the export's
    (not on the training mesh the checkpoint was restored onto: another input sharding, another
    compile); with `mesh`, global arrays split by `qkv_jax.sharding`'s rules, each process
    filling its own devices' blocks from its host copy (`jax.device_put` cannot reach the
    devices of other processes)."""
    if mesh is None:
        return jax.tree.map(jax.device_put, host)

    def split(array: np.ndarray, sharding: Any) -> jax.Array:
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    return jax.tree.map(split, host, param_shardings(host, mesh))


def export_run(
    workdir: str | pathlib.Path, out: str | pathlib.Path
) -> tuple[pathlib.Path, int, TransformerConfig]:
    """Writes the run's newest verified checkpoint, adapters merged, as a Hugging Face directory
    `out` (with the source's tokenizer.json, and generation_config.json when it has one) through
    `save_pretrained`; returns (its path, the
    checkpoint's step, the trained model's config, adapters included). ValueError, one line, for
    a workdir without a run or a checkpoint, and for an `out` that is not empty (nothing is
    overwritten)."""
    workdir = pathlib.Path(workdir)
    config, model_type = read_run(workdir)
    if not (workdir / "checkpoints").is_dir():
        raise ValueError(f"--workdir={str(workdir)!r}: has no checkpoints/ to export")
    _, params, step = read_merged(workdir)
    files = [workdir / PRETRAINED_DIR / name for name in (TOKENIZER_FILE, GENERATION_CONFIG)]
    files = [path for path in files if path.name == TOKENIZER_FILE or path.is_file()]
    path = save_pretrained(out, without_adapters(config), params, model_type=model_type, files=files)
    return path, step, config
