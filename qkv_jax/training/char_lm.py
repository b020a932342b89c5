"""The character-level language model as a `Setup`: config -> corpus, model, pure functions.

Metrics (nats and bits per character):
  train_loss / train_bits_per_char   the training objective, on fresh training windows;
  val_loss / val_bits_per_char       next-character loss on validation windows with the
                                     causal mask: honest even for a model trained without it;
  val_unmasked_bits_per_char         (model.causal=False only) the validation windows as the
                                     model was trained, seeing the characters it predicts;
  unigram_bits_per_char              the validation text under the training unigram distribution.
The report writes `tokenizer.json` and `samples.txt` (generated from
`eval.sample_prompt` before and after training) into the workdir.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from qkv_jax import text
from qkv_jax.attention import IMPLEMENTATIONS
from qkv_jax.diagnostics import (
    collect_attention_weights,
    head_diagnostics,
    induction_scores,
    repeated_sequence,
)
from qkv_jax.lm import TransformerLM, sample_tokens
from qkv_jax.training import validate
from qkv_jax.training.checkpoints import Checkpoints
from qkv_jax.training.loop import Setup, TrainState, make_optimizer, validate_train_config
from qkv_jax.training.validate import ConfigError

__all__ = [
    "TOKENIZER_FILE",
    "SAMPLES_FILE",
    "build",
    "validate_config",
    "validate_model_config",
    "make_model",
    "load_corpus",
    "cross_entropy",
    "read_run",
    "restore_params",
]

TOKENIZER_FILE = "tokenizer.json"
SAMPLES_FILE = "samples.txt"
NATS_PER_BIT = math.log(2.0)
DIAGNOSTIC_EXAMPLES = 16  # validation windows (and repeated sequences) for the head diagnostics


def validate_model_config(config: Any, seq_len: int, source: str) -> None:
    """model.* of every TransformerLM experiment; `seq_len`, the training length (`source`
    says where it comes from, e.g. 'task.seq_len'), must fit model.max_len."""
    validate.require_positive_int(
        config, "model.num_layers", "model.d_model", "model.num_heads", "model.max_len"
    )
    validate.require_fraction(config, "model.dropout_rate", "model.attention_dropout_rate")
    validate.require_bool(config, "model.causal")
    model = config["model"]
    for field in ("num_kv_heads", "kv_latent_dim", "mlp_dim"):
        if model[field] is not None:
            validate.require_positive_int(config, f"model.{field}")
    validate.require_divides(config, "model.num_heads", "model.d_model")
    if model.get("attention_implementation") is not None:
        validate.require_choice(config, "model.attention_implementation", IMPLEMENTATIONS)
    if model["num_kv_heads"] is not None:
        validate.require_divides(config, "model.num_kv_heads", "model.num_heads")
    if seq_len > model["max_len"]:
        raise ConfigError(
            f"model.max_len={model['max_len']}: shorter than the training sequences ({source}={seq_len})"
        )


def validate_config(config: Any) -> None:
    validate_train_config(config)
    validate.require_choice(config, "train.schedule", ("constant", "cosine"))
    validate.require_positive_int(config, "task.seq_len")
    validate_model_config(config, config["task"]["seq_len"], "task.seq_len")
    data, evaluation = config["data"], config["eval"]
    if data["path"] is not None and not pathlib.Path(data["path"]).is_file():
        raise ConfigError(f"data.path={data['path']!r}: not a readable file")
    validate.require_fraction(config, "data.validation_fraction")
    if data["validation_fraction"] == 0:
        raise ConfigError("data.validation_fraction=0: must be in (0, 1)")
    validate.require_positive_int(config, "data.max_vocab_size", "eval.num_samples", "eval.sample_length")
    if data["max_vocab_size"] < 2:
        raise ConfigError(f"data.max_vocab_size={data['max_vocab_size']}: must be >= 2")
    if not isinstance(evaluation["sample_prompt"], str) or not evaluation["sample_prompt"]:
        raise ConfigError(f"eval.sample_prompt={evaluation['sample_prompt']!r}: must be a non-empty string")
    if isinstance(evaluation["temperature"], bool) or not evaluation["temperature"] >= 0:
        raise ConfigError(f"eval.temperature={evaluation['temperature']!r}: must be >= 0")
    decoded = len(evaluation["sample_prompt"]) + evaluation["sample_length"] - 1
    if decoded > config["model"]["max_len"]:
        raise ConfigError(
            f"eval.sample_length={evaluation['sample_length']}: with the {len(evaluation['sample_prompt'])}"
            f"-character eval.sample_prompt it decodes {decoded} positions, past "
            f"model.max_len={config['model']['max_len']}"
        )


def make_model(model_config: dict, vocab_size: int, **overrides: Any) -> TransformerLM:
    """The TransformerLM a config's `model` section describes (`overrides`: e.g. causal=True)."""
    fields = {
        name: model_config[name]
        for name in (
            "num_layers",
            "d_model",
            "num_heads",
            "num_kv_heads",
            "max_len",
            "mlp_dim",
            "kv_latent_dim",
            "causal",
            "dropout_rate",
            "attention_dropout_rate",
            "attention_implementation",
        )
        if name in model_config  # configs written before the field existed
    }
    return TransformerLM(vocab_size=vocab_size, **{**fields, **overrides})


def load_corpus(data_config: dict) -> tuple[text.CharTokenizer, np.ndarray, np.ndarray]:
    """(tokenizer, training ids, validation ids) for `data.path` or the standard library.

    The tokenizer keeps the `data.max_vocab_size - 1` most frequent training characters.
    """
    path = data_config["path"]
    documents = text.read_documents(path) if path is not None else text.stdlib_documents()
    train, validation = text.split_documents(documents, data_config["validation_fraction"])
    tokenizer = text.CharTokenizer.from_text(train, data_config["max_vocab_size"])
    return tokenizer, tokenizer.encode(train), tokenizer.encode(validation)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats: logits `[..., T, V]`, targets `[..., T]`."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _check_corpus(config: dict, train_ids: np.ndarray, validation_ids: np.ndarray) -> None:
    window = config["task"]["seq_len"] + 1
    for name, ids in (("training", train_ids), ("validation", validation_ids)):
        if len(ids) < window:
            raise ConfigError(
                f"task.seq_len={config['task']['seq_len']}: the {name} text has only {len(ids)} "
                f"characters (data.path={config['data']['path']!r}); use a shorter task.seq_len"
            )


def build(config: Any) -> Setup:
    validate_config(config)
    tokenizer, train_ids, validation_ids = load_corpus(config["data"])
    _check_corpus(config, train_ids, validation_ids)
    model = make_model(config["model"], tokenizer.vocab_size)
    honest = model.clone(causal=True)  # the same parameters, seeing only the past
    seq_len, evaluation = config["task"]["seq_len"], config["eval"]
    prompt = np.tile(tokenizer.encode(evaluation["sample_prompt"]), (evaluation["num_samples"], 1))
    data = {
        "train": jnp.asarray(train_ids),
        "validation": jnp.asarray(validation_ids),
        "unigram_bits_per_char": jnp.float32(
            text.unigram_bits_per_char(train_ids, validation_ids, tokenizer.vocab_size)
        ),
    }

    def init(key):
        return model.init(key, jnp.zeros((1, seq_len), jnp.int32))["params"]

    def windows(key, tokens, batch_size):
        chunk = text.random_windows(key, tokens, batch_size, seq_len + 1)  # (B, T + 1)
        return {"inputs": chunk[:, :-1], "targets": chunk[:, 1:]}  # (B, T) each

    def loss(params, batch, rng):
        logits = cast(
            jax.Array,
            model.apply({"params": params}, batch["inputs"], deterministic=False, rngs={"dropout": rng}),
        )  # (B, T, V)
        return cross_entropy(logits, batch["targets"]), {}

    def mean_loss(forward, params, batch):
        return cross_entropy(forward({"params": params}, batch["inputs"]), batch["targets"])

    def evaluate(params, key, data):
        train_key, validation_key, sample_key = jax.random.split(key, 3)
        size = evaluation["num_examples"]
        train_batch = windows(train_key, data["train"], size)
        validation_batch = windows(validation_key, data["validation"], size)
        metrics = {
            "train_loss": mean_loss(model.apply, params, train_batch),
            "val_loss": mean_loss(honest.apply, params, validation_batch),
        }
        if not model.causal:
            metrics["val_unmasked_loss"] = mean_loss(model.apply, params, validation_batch)
        metrics.update(
            {
                name.replace("loss", "bits_per_char"): value / NATS_PER_BIT
                for name, value in list(metrics.items())
            }
        )
        metrics["unigram_bits_per_char"] = data["unigram_bits_per_char"]
        metrics.update(head_metrics(params, validation_batch["inputs"], sample_key))
        samples = sample_tokens(
            honest,
            params,
            jnp.asarray(prompt),
            sample_key,
            jnp.float32(evaluation["temperature"]),
            max_new_tokens=evaluation["sample_length"],
            top_k=None,
        )  # (num_samples, sample_length)
        return metrics, {"samples": samples}

    probe = honest.clone(sow_weights=True)
    repeat = seq_len // 2  # induction: a random sequence of this length, then again

    def layer_weights(params, tokens):
        """[attention weights (B, N, T, T) of block 0, block 1, ...] of the causal model."""
        _, state = probe.apply({"params": params}, tokens, mutable=["intermediates"])
        weights = collect_attention_weights(state["intermediates"])
        return [weights[name] for name in sorted(weights, key=lambda n: int(n.split("/")[0].split("_")[1]))]

    def head_metrics(params, tokens, key):
        """Per layer and head ([L, N] each) on validation text, and induction scores."""
        stats = [head_diagnostics(w) for w in layer_weights(params, tokens[:DIAGNOSTIC_EXAMPLES])]
        repeated = repeated_sequence(key, DIAGNOSTIC_EXAMPLES, repeat, tokenizer.vocab_size)
        induction = [induction_scores(w, repeat) for w in layer_weights(params, repeated)]
        metrics = {f"head_{name}": jnp.stack([s[name] for s in stats]) for name in stats[0]}
        metrics["head_induction"] = jnp.stack(induction)
        return metrics

    def inspect(params, text_input):
        """Attention maps of every block on `text_input` (default: a line of Python)."""
        shown = text_input or "def forward(self, x):\n    return self.scale * x + self.bias"
        tokens = jnp.asarray(tokenizer.encode(shown[: model.max_len]))[None, :]  # (1, T)
        weights = jax.jit(layer_weights)(params, tokens)
        labels = [repr(c)[1:-1] for c in shown[: model.max_len]]
        return {f"block {i}": w[0] for i, w in enumerate(weights)}, labels, labels

    def report(workdir, stage, examples):
        workdir = pathlib.Path(workdir)
        if stage == "before":
            tokenizer.save(workdir / TOKENIZER_FILE)
        texts = [evaluation["sample_prompt"] + tokenizer.decode(row) for row in examples["samples"]]
        heading = {"before": "untrained", "after": "trained"}[stage]
        with open(workdir / SAMPLES_FILE, "w" if stage == "before" else "a") as f:
            f.write(f"#### {heading} model, temperature {evaluation['temperature']}\n")
            f.write("".join(f"--- sample {i}\n{sample}\n" for i, sample in enumerate(texts)))
        return {f"samples_{stage}": texts}

    return Setup(
        init=init,
        sample_batch=lambda key, data: windows(key, data["train"], config["train"]["batch_size"]),
        loss=loss,
        evaluate=evaluate,
        apply=model.apply,
        report=report,
        data=data,
        inspect=inspect,
    )


def read_run(workdir: str | pathlib.Path) -> tuple[dict, text.CharTokenizer, TransformerLM]:
    """(config, tokenizer, model) of the char_lm run in `workdir`, from its
    `config.json` and `tokenizer.json` (host only: nothing is computed)."""
    workdir = pathlib.Path(workdir)
    for name in ("config.json", TOKENIZER_FILE):
        if not (workdir / name).is_file():
            raise ValueError(f"workdir={str(workdir)!r}: no {name}; is it a char_lm run?")
    config = json.loads((workdir / "config.json").read_text())
    tokenizer = text.CharTokenizer.load(workdir / TOKENIZER_FILE)
    return config, tokenizer, make_model(config["model"], tokenizer.vocab_size)


def restore_params(workdir: str | pathlib.Path, config: dict, model: TransformerLM) -> tuple[Any, int]:
    """(params, step) of the newest usable checkpoint in `workdir`/checkpoints.

    ValueError when there is none.
    """
    directory = pathlib.Path(workdir) / "checkpoints"
    seq_len = config["task"]["seq_len"]

    def abstract_state():
        params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, seq_len), jnp.int32))["params"]
        state = TrainState.create(apply_fn=model.apply, params=params, tx=make_optimizer(config["train"]))
        return {"step": state.step, "params": state.params, "opt_state": state.opt_state}

    if not directory.is_dir():
        raise ValueError(f"workdir={str(workdir)!r}: no checkpoints/ yet")
    checkpoints = Checkpoints(directory)
    try:
        restored = checkpoints.restore_latest(jax.eval_shape(abstract_state))
    finally:
        checkpoints.close()
    if restored is None:
        raise ValueError(f"workdir={str(workdir)!r}: no usable checkpoint in checkpoints/")
    step, state = restored
    return state["params"], step
