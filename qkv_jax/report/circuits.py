"""The explorer page's circuits view: each head's learned matrices at every checkpoint shown.

  circuit_data(model, frames)   the page's `circuits` entry (schema in
                                `qkv_jax.report.explorer`) for `frames` [(step, params)]:
                                per checkpoint, layer and head the singular values of
                                W_QK and W_OV and their effective rank, and for a
                                TransformerLM of two or more layers the Q-, K- and
                                V-composition of every head pair; `notes` say what the
                                view covers for this model and what it leaves out.

A TransformerLM's matrices come from `qkv_jax.interpretability.circuits` with each
block's attention LayerNorm folded in (`fold_layer_norm=True`: the heads read the
normalised residual; an RMS norm, a Llama's, is not folded), LoRA adapters merged,
grouped K/V heads repeated and an MLA latent folded into W_K and W_V. The flag task's
models have one layer: the learned
query's (`LearnedQueryAttention`, one head) W_QK = W_query W_key^T and, having no
W_O, its value map W_value; the multi-head reader's W_QK and W_OV per head. The
static reader learns nothing, and a model that normalises its queries and keys
has no one W_QK: the view says so.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qkv_jax.interpretability.circuits import (
    composition_scores,
    effective_rank,
    head_weights,
    ov_singular_values,
    per_matrix,
    qk_singular_values,
)
from qkv_jax.lm import TransformerLM
from qkv_jax.models import FlagReader
from qkv_jax.text import TOKENIZER_FILE, CharTokenizer
from qkv_jax.training.validate import ConfigError

__all__ = [
    "circuit_data",
    "flag_reader_spectra",
    "lm_circuits",
    "patching_data",
    "PromptReader",
    "read_patching_prompts",
    "read_prompt",
    "run_prompts",
    "head_patching",
]

HIGHEST = lax.Precision.HIGHEST
COMPOSITION_MODES: tuple[Literal["Q", "K", "V"], ...] = ("Q", "K", "V")

Measure = Callable[[Any], dict[str, jax.Array]]


def lm_circuits(model: TransformerLM, params: Any) -> dict[str, jax.Array]:
    """A TransformerLM's circuits: `qk` `[L, N, H]` and `ov` `[L, N, Hv]` singular values
    (descending), their effective ranks `qk_rank`, `ov_rank` `[L, N]`, and with two or more
    layers `Q`, `K`, `V` composition scores `[L, N, L, N]`; LayerNorms folded in (an RMS norm,
    whose statistics are not centred, is not)."""
    config = model.config
    weights = head_weights(
        params,
        lora_alpha=config.lora_alpha if config.lora_rank else None,
        fold_layer_norm=config.norm == "layernorm",
    )
    qk, ov = qk_singular_values(weights), ov_singular_values(weights)  # (L, N, H), (L, N, Hv)
    measured = {"qk": qk, "qk_rank": effective_rank(qk), "ov": ov, "ov_rank": effective_rank(ov)}
    if config.num_layers > 1:
        measured.update({mode: composition_scores(weights, mode) for mode in COMPOSITION_MODES})
    return measured


def _leading_values(matrices: jax.Array, rank: int) -> jax.Array:
    """The `rank` largest singular values of `matrices` `[..., m, n]` -> `[..., rank]` (the rest
    are zero: the matrices are products through `rank` dimensions)."""
    return per_matrix(lambda m: jnp.linalg.svd(m, compute_uv=False), matrices)[..., :rank]


def flag_reader_spectra(model: FlagReader, params: Any) -> dict[str, jax.Array]:
    """The learned-query or multi-head flag reader's `qk`, `ov` `[1, N, k]` singular values
    and `qk_rank`, `ov_rank` `[1, N]` (one layer). Learned query: W_QK = W_query W_key^T
    `[D, D]` and W_value `[D, d_v]` (it has no W_O); multi-head: per head W_Q W_K^T `[D, D]`
    and W_V W_O `[D, out_features]`."""
    attention = params["attention"]
    if model.kind == "learned_query":
        W_Q, W_K, W_V = (attention[name]["kernel"] for name in ("W_query", "W_key", "W_value"))  # (D, k)
        W_QK = jnp.matmul(W_Q, W_K.T, precision=HIGHEST)[None]  # (1, D, D)
        W_OV, ov_rank = W_V[None], min(W_V.shape)  # (1, D, d_v)
    else:
        W_Q, W_K, W_V = (attention[name]["kernel"] for name in ("query", "key", "value"))  # (D, N, H)
        W_QK = jnp.einsum("dnh,enh->nde", W_Q, W_K, precision=HIGHEST)  # (N, D, D)
        W_O = attention["out"]["kernel"]  # (N, Hv, out)
        W_OV = jnp.einsum("dnv,nvo->ndo", W_V, W_O, precision=HIGHEST)  # (N, D, out)
        ov_rank = min(W_V.shape[0], W_V.shape[2], W_O.shape[2])
    qk = _leading_values(W_QK, min(W_Q.shape[0], W_Q.shape[-1]))[None]  # (1, N, k)
    ov = _leading_values(W_OV, ov_rank)[None]  # (1, N, k_ov)
    return {"qk": qk, "qk_rank": effective_rank(qk), "ov": ov, "ov_rank": effective_rank(ov)}


_NORMALIZED_QK = (
    "model.normalize_qk={value!r}: the queries and keys are normalised before their dot product, so no "
    "one matrix W_QK gives the logits; no circuits shown"
)


def _what_applies(model: Any) -> tuple[Measure | None, dict[str, str], list[str]]:
    """(the jittable measurement of `model`'s circuits or None, the labels of its W_QK and W_OV,
    notes on what the view shows for it)."""
    if isinstance(model, TransformerLM):
        config = model.config
        if config.normalize_qk:
            return None, {}, [_NORMALIZED_QK.format(value=config.normalize_qk)]
        notes = [
            "each block's attention LayerNorm is folded into W_Q, W_K and W_V (the heads read the "
            "normalised residual stream)"
            if config.norm == "layernorm"
            else f"the blocks' {config.norm} norms are not folded in: W_Q, W_K and W_V read the residual "
            "stream after its norm's scale"
        ]
        if config.positions == "rope":
            notes.append(
                "RoPE rotates queries and keys by their positions: W_QK is the bilinear form of a "
                "query and a key at the same position"
            )
        if config.num_layers == 1:
            notes.append("one layer: no head reads another's output, so there is no composition")
        labels = {"qk": "W_QK = W_Q W_K^T", "ov": "W_OV = W_V W_O"}
        return (lambda params: lm_circuits(model, params)), labels, notes
    if isinstance(model, FlagReader) and model.normalize_qk:
        return None, {}, [_NORMALIZED_QK.format(value=model.normalize_qk)]
    if isinstance(model, FlagReader) and model.kind in ("learned_query", "multihead"):
        learned = model.kind == "learned_query"
        labels = {
            "qk": "W_QK = W_query W_key^T" if learned else "W_QK = W_Q W_K^T",
            "ov": "W_value (no W_O)" if learned else "W_OV = W_V W_O",
        }
        notes = [
            "one attention layer: no composition"
            + (
                "; the learned query q scores token x as (q W_query)(x W_key)^T = q W_QK x^T, and the "
                "head's output is the weighted x W_value (it has no W_O)"
                if learned
                else ""
            )
        ]
        return (lambda params: flag_reader_spectra(model, params)), labels, notes
    if isinstance(model, FlagReader):
        return None, {}, [f"the {model.kind} reader learns no W_Q, W_K or W_V: no circuits to show"]
    covered = f"the circuits view covers TransformerLM and FlagReader models, not {type(model).__name__}"
    return None, {}, [covered]


def circuit_data(model: Any, frames: Sequence[tuple[int, Any]]) -> dict:
    """The page's `circuits` entry for `model` at each of `frames` [(step, params)] (see
    `qkv_jax.report.explorer`'s schema): `qk`/`ov` {"label", "values" [C][L][N][k],
    "effective_rank" [C][L][N]} and `composition` {"Q", "K", "V": [C][L][N][L][N]}, each None
    where it does not apply, and `notes`. The patching entries are added by the caller."""
    measure, labels, notes = _what_applies(model)
    data: dict[str, Any] = {"notes": notes, "qk": None, "ov": None, "composition": None}
    if measure is None:
        return data
    measure = jax.jit(measure)
    measured = [jax.device_get(measure(params)) for _, params in frames]
    for name in ("qk", "ov"):
        data[name] = {
            "label": labels[name],
            "values": [np.asarray(m[name]).tolist() for m in measured],
            "effective_rank": [np.asarray(m[f"{name}_rank"]).tolist() for m in measured],
        }
    if COMPOSITION_MODES[0] in measured[0]:
        data["composition"] = {
            mode: [np.asarray(m[mode]).tolist() for m in measured] for mode in COMPOSITION_MODES
        }
    return data


# --- Activation patching ---------------------------------------------------------------------

PATCHING_COMMAND = 'python -m experiments.report --workdir <the run> --clean "..." --corrupted "..."'
PATCHING_RULE = (
    "the answer is the model's most likely next token after the clean prompt and the contrast its most "
    "likely after the corrupted one; each head's output on the clean prompt (its z, before W_O, at every "
    "position) replaces its output in the corrupted run, and the heat map shows the share of "
    "logit(answer) - logit(contrast) at the last position that this restores"
)


@dataclasses.dataclass(frozen=True)
class PromptReader:
    """How a report reads the prompts given on its command line: `read(text, flag)` -> (`[T]` int32
    token ids, their labels), a ConfigError naming `flag` (e.g. "--clean") for a text the model
    cannot read; `label(id)` a token's label; `command` the command that adds a patching heat map
    (for the page's note)."""

    read: Callable[[str, str], tuple[np.ndarray, list[str]]]
    label: Callable[[int], str]
    command: str = PATCHING_COMMAND


def check_prompt_length(model: TransformerLM, ids: np.ndarray, text: str, flag: str) -> None:
    """ConfigError unless `ids` fill 1 to max_len positions."""
    if not 1 <= len(ids) <= model.config.max_len:
        raise ConfigError(f"{flag}={text!r}: {len(ids)} tokens; the model reads 1 to {model.config.max_len}")


def read_prompt(
    model: TransformerLM, tokenizer: CharTokenizer | None, text: str, flag: str
) -> tuple[np.ndarray, list[str]]:
    """A prompt given on the command line as the run reads text: `[T]` int32 token ids and their
    labels. With the run's `tokenizer` (the char LM's tokenizer.json) characters, each of which
    must be in its vocabulary; without one whitespace-separated token ids in [0, vocab_size).
    `flag` (e.g. "--clean") names the prompt in a ConfigError."""
    if tokenizer is not None:
        unknown = sorted({c for c in text if c not in tokenizer.chars[1:]})
        if unknown:
            raise ConfigError(f"{flag}={text!r}: characters {unknown} are not in the run's vocabulary")
        ids, labels = tokenizer.encode(text), list(text)
    else:
        words = text.split()
        vocab = model.config.vocab_size
        if not all(w.isdecimal() and int(w) < vocab for w in words):
            raise ConfigError(
                f"{flag}={text!r}: expected whitespace-separated token ids in [0, {vocab}) (this run has no "
                "tokenizer.json to read characters with)"
            )
        ids, labels = np.array([int(w) for w in words], np.int32), words
    check_prompt_length(model, ids, text, flag)
    return ids, labels


def run_prompts(model: TransformerLM, workdir: str | pathlib.Path) -> PromptReader:
    """How a run in `workdir` reads prompts (`read_prompt`): characters with its tokenizer.json
    (a char LM's), token ids without one."""
    path = pathlib.Path(workdir) / TOKENIZER_FILE
    tokenizer = CharTokenizer.load(path) if path.is_file() else None
    label = str if tokenizer is None else lambda token: tokenizer.chars[token]
    return PromptReader(lambda text, flag: read_prompt(model, tokenizer, text, flag), label)


def head_patching(model: TransformerLM, params: Any, clean: np.ndarray, corrupted: np.ndarray) -> dict:
    """Patches each head's clean output into the corrupted run, one (layer, head) at a time.

    `clean`, `corrupted`: `[T]` token ids. Returns the answer and contrast token ids (the most
    likely next token after each prompt), the logit difference logit(answer) - logit(contrast)
    at the last position on the clean and on the corrupted prompt, and `restored` `[L, N]`:
    (patched - corrupted) / (clean - corrupted) per head. ConfigError when both prompts give
    the same most likely next token (the difference is then zero on both).
    """
    from qkv_jax.interpretability import patching_sweep, run_with_cache

    variables = {"params": params}
    logits = jax.device_get(model.apply(variables, jnp.stack([clean, corrupted])))[:, -1]  # (2, V)
    answer, contrast = (int(i) for i in np.argmax(logits, axis=-1))
    if answer == contrast:
        raise ConfigError(
            f"--corrupted: the clean and the corrupted prompt both make token {answer} the most likely next "
            "one; choose a corruption that changes the prediction"
        )
    difference = lambda logits: logits[..., -1, answer] - logits[..., -1, contrast]  # (B, T, V) -> (B,)
    clean_difference, corrupted_difference = (float(d) for d in difference(logits[:, None]))
    _, cache = run_with_cache(
        model, variables, clean[None], names_filter=lambda name: name.endswith("hook_z")
    )
    patched = patching_sweep(
        model, variables, corrupted[None], cache, lambda logits: difference(logits)[0], hook="attn.hook_z"
    )  # (L, N)
    restored = (np.asarray(patched) - corrupted_difference) / (clean_difference - corrupted_difference)
    return {
        "answer": answer,
        "contrast": contrast,
        "clean_difference": clean_difference,
        "corrupted_difference": corrupted_difference,
        "restored": restored,
    }


def read_patching_prompts(
    reader: PromptReader, prompts: tuple[str, str]
) -> tuple[tuple[np.ndarray, list[str]], tuple[np.ndarray, list[str]]]:
    """The (clean, corrupted) prompts' (ids, labels), read by `reader`; ConfigError unless they
    have as many tokens."""
    (clean, clean_labels), (corrupted, corrupted_labels) = (
        reader.read(text, flag) for text, flag in zip(prompts, ("--clean", "--corrupted"), strict=True)
    )
    if len(clean) != len(corrupted):
        raise ConfigError(
            f"--corrupted={prompts[1]!r}: {len(corrupted)} tokens, but --clean has {len(clean)}; patching "
            "replaces each position's activation, so the two must be the same length"
        )
    return (clean, clean_labels), (corrupted, corrupted_labels)


def patching_data(
    model: Any, frame: tuple[int, Any], prompts: tuple[str, str] | None, reader: PromptReader | None
) -> dict:
    """The page's `patching` and `patching_note` entries: for a TransformerLM and `prompts` =
    (clean, corrupted) text (read by `reader`, the same number of tokens), `head_patching` at
    `frame` = (step, params), the newest checkpoint; otherwise None and a note saying why."""
    if not isinstance(model, TransformerLM) or reader is None:
        name = type(model).__name__
        return {
            "patching": None,
            "patching_note": f"Activation patching needs a language model, not a {name}.",
        }
    if prompts is None:
        note = f"No patching heat map: `{reader.command}` adds one for two prompts of as many tokens"
        return {"patching": None, "patching_note": f"{note} ({PATCHING_RULE})."}
    (clean, clean_labels), (corrupted, corrupted_labels) = read_patching_prompts(reader, prompts)
    step, params = frame
    measured = head_patching(model, params, clean, corrupted)
    return {
        "patching": {
            "step": int(step),
            "clean": clean_labels,
            "corrupted": corrupted_labels,
            "answer": reader.label(measured["answer"]),
            "contrast": reader.label(measured["contrast"]),
            "clean_difference": measured["clean_difference"],
            "corrupted_difference": measured["corrupted_difference"],
            "restored": measured["restored"].tolist(),
        },
        "patching_note": PATCHING_RULE,
    }
