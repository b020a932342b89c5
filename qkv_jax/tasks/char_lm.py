"""The character-level language model as a task: config -> corpus, model, pure functions.

Metrics (nats and bits per character):
  train_loss / train_bits_per_char   the training objective, on fresh training windows;
  val_loss / val_bits_per_char       next-character loss on validation windows with the
                                     causal mask: honest even for a model trained without it;
  val_unmasked_bits_per_char         (model.causal=False only) the validation windows as the
                                     model was trained, seeing the characters it predicts;
  unigram_bits_per_char              the validation text under the training unigram distribution;
  head_* [layer, head]               `qkv_jax.diagnostics` of validation windows, and
                                     head_induction on a repeated random sequence;
  head_ablation [layer, head]        validation bits/char with the head's output zeroed
                                     (`head_mask`) minus without, on the first
                                     `eval.ablation_examples` validation windows (0 = not
                                     measured): one forward pass per head.
`save_examples` writes `tokenizer.json` and `samples.txt` (generated from
`eval.sample_prompt` before and after training) into the workdir.

A run started from another (`train.init_from`) reads its text with the
source's tokenizer.json, when the source has one, so that every character id
means what it meant to the source's embeddings (characters new to it become
id 0).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qkv_jax import text
from qkv_jax.diagnostics import (
    head_diagnostics,
    induction_scores,
    repeated_sequence,
)
from qkv_jax.finetune import head_ablation_masks
from qkv_jax.generation import Sampling, sample
from qkv_jax.lm import TransformerLM
from qkv_jax.tasks.transformer import (
    causal_model,
    check_sequence_length,
    cross_entropy,
    init_params,
    layer_attention,
    make_model,
    training_logits,
)
from qkv_jax.training import validate
from qkv_jax.training.checkpoints import NoCheckpointError, locate_run
from qkv_jax.training.setup import AttentionView, Setup
from qkv_jax.training.validate import ConfigError
from qkv_jax.training.workdir import write_atomic, write_json

__all__ = [
    "TOKENIZER_FILE",
    "SAMPLES_FILE",
    "CharLM",
    "build",
    "validate_config",
    "load_corpus",
    "read_run",
]

TOKENIZER_FILE = text.TOKENIZER_FILE
SAMPLES_FILE = "samples.txt"
NATS_PER_BIT = math.log(2.0)
DIAGNOSTIC_EXAMPLES = 16  # validation windows (and repeated sequences) for the head diagnostics
DEFAULT_INSPECT_TEXT = "def forward(self, x):\n    return self.scale * x + self.bias"
REPORT_TEXT_LENGTH = 64  # characters of each text the explorer page shows


def validate_config(config: Any) -> None:
    """The task's own sections (task, data, eval) and the model section at the largest
    vocabulary `data.max_vocab_size` allows (the corpus, read later, sets the real one)."""
    validate.require_positive_int(config, "task.seq_len", "data.max_vocab_size")
    model = make_model(config["model"], config["data"]["max_vocab_size"])
    check_sequence_length(model, config["task"]["seq_len"], "task.seq_len")
    data, evaluation = config["data"], config["eval"]
    if data["path"] is not None and not _is_file(data["path"]):
        raise ConfigError(f"data.path={data['path']!r}: not a readable file")
    validate.require_fraction(config, "data.validation_fraction")
    if data["validation_fraction"] == 0:
        raise ConfigError("data.validation_fraction=0: must be in (0, 1)")
    validate.require_positive_int(config, "eval.num_samples", "eval.sample_length")
    validate.require_nonnegative_int(config, "eval.ablation_examples")
    if data["max_vocab_size"] < 2:
        raise ConfigError(f"data.max_vocab_size={data['max_vocab_size']}: must be >= 2")
    if not isinstance(evaluation["sample_prompt"], str) or not evaluation["sample_prompt"]:
        raise ConfigError(f"eval.sample_prompt={evaluation['sample_prompt']!r}: must be a non-empty string")
    if isinstance(evaluation["temperature"], bool) or not evaluation["temperature"] >= 0:
        raise ConfigError(f"eval.temperature={evaluation['temperature']!r}: must be >= 0")
    decoded = len(evaluation["sample_prompt"]) + evaluation["sample_length"] - 1
    if decoded > model.config.max_len:
        raise ConfigError(
            f"eval.sample_length={evaluation['sample_length']}: with the {len(evaluation['sample_prompt'])}"
            f"-character eval.sample_prompt it decodes {decoded} positions, past "
            f"model.max_len={model.config.max_len}"
        )


def _is_file(path: Any) -> bool:
    try:
        return isinstance(path, str) and pathlib.Path(path).is_file()
    except OSError:  # a name longer than the filesystem allows, say
        return False


def load_corpus(
    data_config: dict, tokenizer: text.CharTokenizer | None = None
) -> tuple[text.CharTokenizer, np.ndarray, np.ndarray]:
    """(tokenizer, training ids, validation ids) for `data.path` or the standard library.

    The tokenizer (unless given) keeps the `data.max_vocab_size - 1` most frequent
    training characters.
    """
    path = data_config["path"]
    documents = text.read_documents(path) if path is not None else text.stdlib_documents()
    train, validation = text.split_documents(documents, data_config["validation_fraction"])
    if tokenizer is None:
        tokenizer = text.CharTokenizer.from_text(train, data_config["max_vocab_size"])
    return tokenizer, tokenizer.encode(train), tokenizer.encode(validation)


def _check_corpus(config: dict, train_ids: np.ndarray, validation_ids: np.ndarray) -> None:
    window = config["task"]["seq_len"] + 1
    for name, ids in (("training", train_ids), ("validation", validation_ids)):
        if len(ids) < window:
            raise ConfigError(
                f"task.seq_len={config['task']['seq_len']}: the {name} text has only {len(ids)} "
                f"characters (data.path={config['data']['path']!r}); use a shorter task.seq_len"
            )


# Jitted with the model static, so that one evaluation traces each (model, shape) once: the
# training and validation losses of a causal model, the head ablation's masks and its baseline.
@functools.partial(jax.jit, static_argnums=0)
def _mean_loss(
    model: TransformerLM, params: Any, batch: dict, head_mask: jax.Array | None = None
) -> jax.Array:
    """Cross-entropy (nats) of `model` on `batch` ("inputs", "targets" `[B, T]`), with
    `head_mask` `[L, N]` (1 keeps a head's output, 0 zeroes it) when given."""
    logits = model.apply({"params": params}, batch["inputs"], head_mask=head_mask)  # (B, T, V)
    return cross_entropy(jnp.asarray(logits), batch["targets"])


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: jit keys on its bound methods
class CharLM:
    """The char LM's pure functions (`Setup`'s fields are its bound methods).

    `model` trains; `honest`, the same parameters with the causal mask, is how
    validation loss and samples are computed even for a model trained without it.
    """

    model: TransformerLM
    tokenizer: text.CharTokenizer
    seq_len: int
    batch_size: int
    evaluation: dict

    @property
    def honest(self) -> TransformerLM:
        return causal_model(self.model)

    def init(self, key: jax.Array) -> Any:
        return init_params(self.model, self.seq_len, key)

    def windows(self, key: jax.Array, tokens: jax.Array, batch_size: int) -> dict:
        chunk = text.random_windows(key, tokens, batch_size, self.seq_len + 1)  # (B, T + 1)
        return {"inputs": chunk[:, :-1], "targets": chunk[:, 1:]}  # (B, T) each

    def sample_batch(self, key: jax.Array, data: dict) -> dict:
        return self.windows(key, data["train"], self.batch_size)

    def loss(self, params: Any, batch: dict, rng: jax.Array) -> tuple[jax.Array, dict]:
        logits = training_logits(self.model, params, batch["inputs"], rng)  # (B, T, V)
        return cross_entropy(logits, batch["targets"]), {}

    def evaluate(self, params: Any, key: jax.Array, data: dict) -> tuple[dict, dict]:
        train_key, validation_key, sample_key = jax.random.split(key, 3)
        size = self.evaluation["num_examples"]
        train_batch = self.windows(train_key, data["train"], size)
        validation_batch = self.windows(validation_key, data["validation"], size)

        metrics = {"train_loss": _mean_loss(self.model, params, train_batch)}
        metrics["val_loss"] = _mean_loss(self.honest, params, validation_batch)
        if not self.model.config.causal:
            metrics["val_unmasked_loss"] = _mean_loss(self.model, params, validation_batch)
        metrics.update(
            {n.replace("loss", "bits_per_char"): v / NATS_PER_BIT for n, v in list(metrics.items())}
        )
        metrics["unigram_bits_per_char"] = data["unigram_bits_per_char"]
        metrics.update(self.head_metrics(params, validation_batch["inputs"], sample_key))
        if self.evaluation["ablation_examples"]:
            metrics["head_ablation"] = self.head_ablation(params, validation_batch)
        return metrics, {"samples": self.samples(params, sample_key)}

    def head_ablation(self, params: Any, batch: dict) -> jax.Array:
        """`[L, N]`: bits/char on the first `eval.ablation_examples` windows of `batch` (all of
        them if it has fewer) with head (l, n)'s output zeroed, minus the bits/char with every
        head (the causal model). One forward pass per head (`lax.map`: the memory of one)."""
        size = min(self.evaluation["ablation_examples"], batch["inputs"].shape[0])
        inputs, targets = batch["inputs"][:size], batch["targets"][:size]  # (size, T) each
        layers, heads = self.model.config.num_layers, self.model.config.num_heads

        shown = {"inputs": inputs, "targets": targets}
        bits_per_char = lambda head_mask: _mean_loss(self.honest, params, shown, head_mask) / NATS_PER_BIT
        ablated = lax.map(bits_per_char, head_ablation_masks(layers, heads))  # (L * N,)
        return ablated.reshape(layers, heads) - bits_per_char(jnp.ones((layers, heads)))

    def samples(self, params: Any, key: jax.Array) -> jax.Array:
        """`[num_samples, sample_length]` tokens generated after `eval.sample_prompt`."""
        prompt = self.tokenizer.encode(self.evaluation["sample_prompt"])
        prompts = jnp.tile(jnp.asarray(prompt), (self.evaluation["num_samples"], 1))
        sampling = Sampling(jnp.float32(self.evaluation["temperature"]), jnp.float32(1.0))
        return sample(self.honest, params, prompts, key, sampling, self.evaluation["sample_length"])

    def head_metrics(self, params: Any, tokens: jax.Array, key: jax.Array) -> dict:
        """Per layer and head ([L, N] each) on validation text, and induction scores."""
        stats = [
            head_diagnostics(w, sinks=self.model.config.use_sinks)
            for w in layer_attention(self.model, params, tokens[:DIAGNOSTIC_EXAMPLES])
        ]
        repeat = self.seq_len // 2  # induction: a random sequence of this length, then again
        vocab_size = self.tokenizer.vocab_size
        repeated = repeated_sequence(key, DIAGNOSTIC_EXAMPLES, repeat, vocab_size)
        metrics = {f"head_{name}": jnp.stack([s[name] for s in stats]) for name in stats[0]}
        metrics["head_induction"] = jnp.stack(
            [induction_scores(w, repeat) for w in layer_attention(self.model, params, repeated)]
        )
        return metrics

    def inspect(self, params: Any, text_input: str | None) -> AttentionView:
        """Attention maps of every block on `text_input` (default: a line of Python)."""
        shown = (text_input or DEFAULT_INSPECT_TEXT)[: self.model.config.max_len]
        tokens = jnp.asarray(self.tokenizer.encode(shown))[None, :]  # (1, T)
        weights = jax.jit(layer_attention, static_argnums=0)(self.model, params, tokens)
        labels = [repr(c)[1:-1] for c in shown]
        return AttentionView({f"block {i}": w[0] for i, w in enumerate(weights)}, labels, labels, [])

    def explorer_inputs(self, data: dict, prompt: str | None) -> list[tuple[str, str]]:
        """`prompt` (when given) and three windows of validation text, spread over the split."""
        validation = np.asarray(data["validation"])
        length = min(REPORT_TEXT_LENGTH, self.model.config.max_len, len(validation))
        starts = np.linspace(0, len(validation) - length, 3).astype(int)
        windows = [
            (f"validation text {i + 1}", self.tokenizer.decode(validation[s : s + length]))
            for i, s in enumerate(starts)
        ]
        return ([("prompt", prompt)] if prompt else []) + windows

    def save_examples(self, workdir: str | pathlib.Path, stage: str, examples: dict) -> dict:
        """tokenizer.json (before training) and the samples, into samples.txt; both written
        atomically, so a reader (generation from a run still training) never sees half a file."""
        workdir = pathlib.Path(workdir)
        if stage == "before":
            write_json(workdir / TOKENIZER_FILE, {"chars": self.tokenizer.chars})
        prompt = self.evaluation["sample_prompt"]
        texts = [prompt + self.tokenizer.decode(row) for row in examples["samples"]]
        heading = {"before": "untrained", "after": "trained"}[stage]
        samples = workdir / SAMPLES_FILE
        earlier = samples.read_text() if stage == "after" and samples.is_file() else ""
        written = f"#### {heading} model, temperature {self.evaluation['temperature']}\n"
        written += "".join(f"--- sample {i}\n{sample}\n" for i, sample in enumerate(texts))
        write_atomic(samples, lambda file: file.write(earlier + written))
        return {f"samples_{stage}": texts}


def source_tokenizer(config: dict) -> text.CharTokenizer | None:
    """The tokenizer.json of the run `train.init_from` names, if it is set and has one (found
    from the path alone: a resumed fine-tune reads it even if the source kept no checkpoint)."""
    source = config["train"]["init_from"]
    if source is None:
        return None
    try:
        path = locate_run(source).workdir / TOKENIZER_FILE
    except NoCheckpointError:
        path = pathlib.Path(source) / TOKENIZER_FILE
    return text.CharTokenizer.load(path) if path.is_file() else None


def build(config: Any) -> Setup:
    """The char LM's Setup: the corpus read and split, its tokenizer, the TransformerLM."""
    validate_config(config)
    tokenizer, train_ids, validation_ids = load_corpus(config["data"], source_tokenizer(config))
    _check_corpus(config, train_ids, validation_ids)
    task = CharLM(
        model=make_model(config["model"], tokenizer.vocab_size),
        tokenizer=tokenizer,
        seq_len=config["task"]["seq_len"],
        batch_size=config["train"]["batch_size"],
        evaluation=dict(config["eval"]),
    )
    unigram = text.unigram_bits_per_char(train_ids, validation_ids, tokenizer.vocab_size)
    data = {
        "train": jnp.asarray(train_ids),
        "validation": jnp.asarray(validation_ids),
        "unigram_bits_per_char": jnp.float32(unigram),
    }
    return Setup.from_methods(task, model=task.model, data=data, outputs=(TOKENIZER_FILE, SAMPLES_FILE))


def read_run(workdir: str | pathlib.Path) -> tuple[dict, text.CharTokenizer, TransformerLM]:
    """(config, tokenizer, model) of the char_lm run in `workdir`, from its
    `config.json` and `tokenizer.json` (host only: nothing is computed; its
    parameters are `qkv_jax.training.read_params(workdir)`)."""
    workdir = pathlib.Path(workdir)
    for name in ("config.json", TOKENIZER_FILE):
        if not (workdir / name).is_file():
            raise ValueError(f"workdir={str(workdir)!r}: no {name}; is it a char_lm run?")
    config = json.loads((workdir / "config.json").read_text())
    tokenizer = text.CharTokenizer.load(workdir / TOKENIZER_FILE)
    return config, tokenizer, make_model(config["model"], tokenizer.vocab_size)
