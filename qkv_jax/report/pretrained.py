"""A Hugging Face checkpoint read as a report reads a run: head diagnostics and the explorer page.

  open_pretrained(directory)            (TransformerLM, tokenizer) from config.json and
                                        tokenizer.json, no tensor read
  load_params(directory, mesh=None)     (TransformerLM, params): `load_pretrained`, or a
                                        run's `read_merged`; split over `mesh` when given
  read_text(tokenizer, model, text, flag)  `[T]` token ids and their labels
  report_pretrained(directory, out, prompt, patching=None)
                                        out/report.json and out/report.html
  checkpoint_files(directory)           where config.json, tokenizer.json and
                                        generation_config.json are

Each takes a Hugging Face directory or a fine-tuning run's workdir
(`qkv_jax.tasks.pretrained_text`), read as the directory its export writes: the run's
tokenizer and its newest checkpoint with the adapters merged.

The page is `qkv_jax.report.run`'s (`page_data`, `write_run_page`) with the checkpoint's
weights as its one checkpoint (shown as step 0) and no loss curves. Its diagnostics are
`qkv_jax.diagnostics` of the prompt's attention (entropy, distance, previous and first
token, max weight) and induction scores on a repeated random sequence; text is read with the
checkpoint's tokenizer.json (special tokens as it adds them: a Llama's "<s>", say), and each
token is labelled by its own text in the tokenizer's vocabulary ("▁the", "Ġthe").
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qkv_jax.diagnostics import head_diagnostics, induction_scores, repeated_sequence
from qkv_jax.lm import TransformerLM
from qkv_jax.pretrained.io import is_pretrained_directory, load_config, load_pretrained
from qkv_jax.pretrained.tokenizer import PretrainedTokenizer, load_tokenizer
from qkv_jax.report.circuits import PromptReader, check_prompt_length, read_patching_prompts
from qkv_jax.tasks import pretrained_text
from qkv_jax.tasks.transformer import layer_attention
from qkv_jax.training.setup import AttentionView
from qkv_jax.training.validate import ConfigError
from qkv_jax.training.workdir import check_workdir_path, plain, write_json

__all__ = [
    "INDUCTION_LENGTH",
    "PATCHING_COMMAND",
    "checkpoint_files",
    "open_pretrained",
    "load_params",
    "read_text",
    "prompt_diagnostics",
    "report_pretrained",
]

INDUCTION_LENGTH = 32  # tokens of the random sequence repeated for the induction scores (at most)
INDUCTION_EXAMPLES = 16
PATCHING_COMMAND = (
    'python -m experiments.report --pretrained <the directory> --out <dir> --prompt "..." '
    '--clean "..." --corrupted "..."'
)


def checkpoint_files(directory: str | pathlib.Path) -> pathlib.Path:
    """Where a checkpoint's config.json, tokenizer.json and generation_config.json (its
    end-of-text ids, when it has one) are: a Hugging Face directory itself, or a fine-tuning
    run's `pretrained/` (the source's, as its export writes them)."""
    path = pathlib.Path(directory)
    return path / pretrained_text.PRETRAINED_DIR if pretrained_text.is_run(path) else path


def open_pretrained(directory: str | pathlib.Path) -> tuple[TransformerLM, PretrainedTokenizer]:
    """The TransformerLM of `directory`'s config.json (float32; no tensor is read) and its
    tokenizer.json; ConfigError, one line, for a directory that is not a Hugging Face
    checkpoint, a config.json qkv_jax does not compute, or a missing or broken tokenizer.

    A fine-tuning run's workdir (`qkv_jax.tasks.pretrained_text`) reads as the model its export
    writes: its model without adapters and the tokenizer.json it trained with."""
    path = pathlib.Path(directory)
    if pretrained_text.is_run(path):
        try:
            config, _ = pretrained_text.read_run(path)
            tokenizer = load_tokenizer(checkpoint_files(path), vocab_size=config.vocab_size)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return TransformerLM(pretrained_text.without_adapters(config)), tokenizer
    if not path.is_dir():
        raise ConfigError(f"--pretrained={str(path)!r}: no such directory")
    if not is_pretrained_directory(path):
        raise ConfigError(
            f"--pretrained={str(path)!r}: not a Hugging Face checkpoint (no config.json beside "
            "model.safetensors or model.safetensors.index.json)"
        )
    try:
        config, _ = load_config(path)
        tokenizer = load_tokenizer(path, vocab_size=config.vocab_size)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return TransformerLM(config), tokenizer


def load_params(directory: str | pathlib.Path, mesh: Any = None) -> tuple[TransformerLM, Any]:
    """(TransformerLM, params) of `directory` (`load_pretrained`), or of a fine-tuning run's newest
    checkpoint with its adapters merged (`pretrained_text.read_merged`), split over `mesh` when
    given (the same values as on one device); ConfigError for a bad file or a mesh the model
    cannot be split over (checked before any weight is read)."""
    try:
        if pretrained_text.is_run(directory):
            config, params, _ = pretrained_text.read_merged(directory, mesh=mesh)
        else:
            config, params = load_pretrained(directory, mesh=mesh)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return TransformerLM(config), params


def read_text(
    tokenizer: PretrainedTokenizer, model: TransformerLM, text: str, flag: str
) -> tuple[np.ndarray, list[str]]:
    """`text` as the checkpoint reads it: `[T]` int32 ids and each token's label. ConfigError
    naming `flag` for an empty text, a token outside the model's vocabulary, or more tokens
    than the model's positions."""
    if not text:
        raise ConfigError(f"{flag}: empty; give a text")
    try:
        ids = tokenizer.encode(text)
    except ValueError as error:
        raise ConfigError(f"{flag}: {error}") from None
    check_prompt_length(model, ids, text, flag)
    return ids, tokenizer.token_strings(ids)


def prompt_diagnostics(model: TransformerLM, params: Any, ids: np.ndarray, key: jax.Array) -> dict:
    """`head_<statistic>` `[L, N]` of the attention on the prompt `ids` `[T]`
    (`qkv_jax.diagnostics.head_diagnostics`), and `head_induction` on INDUCTION_EXAMPLES random
    sequences of up to INDUCTION_LENGTH tokens, each followed by itself."""
    per_layer = [
        head_diagnostics(weights, sinks=model.config.use_sinks)
        for weights in layer_attention(model, params, jnp.asarray(ids)[None])
    ]
    metrics = {f"head_{name}": np.stack([layer[name] for layer in per_layer]) for name in per_layer[0]}
    length = min(INDUCTION_LENGTH, model.config.max_len // 2)
    repeated = repeated_sequence(key, INDUCTION_EXAMPLES, length, model.config.vocab_size)
    metrics["head_induction"] = np.stack(
        [induction_scores(weights, length) for weights in layer_attention(model, params, repeated)]
    )
    return metrics


def _described(directory: pathlib.Path) -> tuple[dict, str, str]:
    """(the config.json, the page's subtitle, its first note) of a Hugging Face directory or of a
    fine-tuning run (its pretrained/config.json)."""
    hf_config = json.loads((checkpoint_files(directory) / "config.json").read_text())
    if pretrained_text.is_run(directory):
        subtitle = f"{directory.resolve()}: the run's newest checkpoint, its adapters merged"
        note = (
            "a fine-tuning run: its newest checkpoint is the one shown (as step 0); its loss is in loss.png"
        )
        return hf_config, subtitle, note
    note = (
        "a pretrained checkpoint: its weights are the one checkpoint shown (as step 0), and it has no "
        "loss curves here"
    )
    return hf_config, f"{directory.resolve()}: the checkpoint's weights", note


def prompt_reader(tokenizer: PretrainedTokenizer, model: TransformerLM) -> PromptReader:
    """How the page reads prompts: `read_text` with the checkpoint's tokenizer, each token
    labelled by its own text."""
    return PromptReader(
        lambda text, flag: read_text(tokenizer, model, text, flag),
        lambda token: tokenizer.token_strings([token])[0],
        PATCHING_COMMAND,
    )


def report_pretrained(
    directory: str | pathlib.Path,
    out: str | pathlib.Path,
    prompt: str,
    patching: tuple[str, str] | None = None,
    extra: dict | None = None,
    mesh: Any = None,
) -> dict:
    """out/report.json (`extra`, the prompt's tokens, its head diagnostics, and with `patching` =
    (clean, corrupted) the patching result) and out/report.html, the explorer page; `out` is
    created if missing and nothing else in it is touched. Returns report.json's content. Every
    prompt is read (ConfigError naming its flag) before a tensor is. `directory` is a Hugging
    Face directory or a fine-tuning run's workdir (`open_pretrained`); `mesh` (a ("data",
    "model") jax Mesh) loads either split over it (`load_params`)."""
    # The page's modules bring the trainer's (orbax, optax: 0.2 s); the readers above do without.
    from qkv_jax.report.explorer import write_run_page
    from qkv_jax.report.run import PageSource, page_data

    directory, out = pathlib.Path(directory), pathlib.Path(out)
    shape, tokenizer = open_pretrained(directory)  # the model's shape: positions and vocabulary
    reader = prompt_reader(tokenizer, shape)
    ids, labels = reader.read(prompt, "--prompt")
    if patching is not None:
        read_patching_prompts(reader, patching)  # before any tensor is read
    check_workdir_path(out)
    model, params = load_params(directory, mesh)
    metrics = prompt_diagnostics(model, params, ids, jax.random.PRNGKey(0))

    def inspect(params: Any, text: str | None) -> AttentionView:
        shown, shown_labels = (ids, labels) if text is None else reader.read(text, "--prompt")
        weights = layer_attention(model, params, jnp.asarray(shown)[None])
        return AttentionView(
            {f"block {i}": w[0] for i, w in enumerate(weights)}, shown_labels, shown_labels, []
        )

    hf_config, subtitle, note = _described(directory)
    source = PageSource(
        title=f"{directory.name} ({hf_config.get('model_type', 'pretrained')})",
        subtitle=subtitle,
        config=hf_config,
        model=model,
        inspect=inspect,
        curves={},
        prompts=reader,
    )
    notes = [
        note,
        f"head diagnostics of the prompt's {len(ids)} tokens; induction scores on {INDUCTION_EXAMPLES} "
        f"random sequences of {min(INDUCTION_LENGTH, model.config.max_len // 2)} tokens, each repeated",
    ]
    data = page_data(source, [("prompt", prompt)], [(0, params)], metrics, notes, patching)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        **(extra or {}),
        "checkpoint": str(directory.resolve()),
        "model_type": hf_config.get("model_type"),
        "prompt": prompt,
        "prompt_ids": ids.tolist(),
        "prompt_tokens": labels,
        **plain(metrics),
        "patching": data["circuits"]["patching"],
    }
    write_json(out / "report.json", report)
    write_run_page(out / "report.html", data)
    return report
