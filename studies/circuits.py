"""Three studies of what the learned projections learn, each followed through training.

  flag_reader(base, workdir, seeds)   the flag task's learned query: the one direction of input
                                      space it reads, r = W_K (q W_Q)^T, against the flag
                                      channel, and W_QK = W_Q W_K^T's singular values and
                                      effective rank.
  induction_composition(base, workdir, seeds)
                                      the repeat task's LM: K-composition between the
                                      previous-token head and the induction head, against the
                                      induction score: the step at which each has risen.
  kv_views(base, workdir, cells, seeds)
                                      the char LM with 8 query heads and shared K/V heads (MHA,
                                      GQA, MQA, MLA): each head's W_QK effective rank, and the
                                      number of distinct attention patterns per layer on
                                      held-out text.

Each trains through the sweep launcher (`run_sweep`: seeds vmapped, cells resumable) with a
probe measured before training and after every compiled chunk. The pieces the probes and
the tables are made of (`flag_reader_geometry`, `pattern_divergence`, `distinct_patterns`,
`risen_at`) are pure functions. `STUDIES` holds each study's entry for the launcher.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qkv_jax.interpretability.capture import run_with_cache
from qkv_jax.interpretability.circuits import (
    HeadWeights,
    composition_scores,
    effective_rank,
    head_weights,
    qk_singular_values,
)
from qkv_jax.interpretability.patching import patching_sweep
from qkv_jax.lm import TransformerLM
from qkv_jax.models import FlagReader
from qkv_jax.tasks.sequences import repeat_batch
from qkv_jax.tasks.transformer import layer_attention, make_model
from qkv_jax.training.setup import Setup
from qkv_jax.training.validate import ConfigError
from studies.grid import apply_overrides
from studies.language_model import arm_name
from studies.mechanisms import FORMED, induction_probe
from studies.results import Study
from studies.stats import format_interval, mean_interval, paired_difference
from studies.sweep import run_sweep

__all__ = [
    "STUDIES",
    "flag_reader_geometry",
    "flag_reader_probe",
    "flag_reader",
    "risen_at",
    "steepest_at",
    "induction_composition_probe",
    "induction_composition",
    "pattern_divergence",
    "distinct_patterns",
    "kv_views_probe",
    "kv_views",
    "KV_VIEW_CELLS",
]

HIGHEST = lax.Precision.HIGHEST
ALIGNED = 0.9  # the flag reader is aligned once cos(r, e_flag) passes this
HALF = 0.5  # a curve has risen once it has covered this share of its change over training
VIEW_WINDOWS = 8  # held-out windows the attention patterns are compared on
DISTINCT = 0.3  # nats: two heads' patterns are distinct when their mean JS divergence exceeds this
THRESHOLDS = (0.1, 0.2, 0.3, 0.4)  # the distinct-pattern count is reported at each of these too
PATCH_SEQUENCES = 32  # clean/corrupted pairs the patching shares are measured on
PATCH_NAMES = (
    "patch_induction_head",
    "patch_previous_token_head",
    "patch_induction_layer_others",
    "patch_other_heads",
)
KV_VIEW_CELLS: list[
    dict[str, Any]
] = [  # of configs/char_lm.py:study's K/V sweep (8 query heads): MHA, GQA-2, MQA, MLA
    {"model.num_kv_heads": 8, "model.kv_latent_dim": None},
    {"model.num_kv_heads": 2, "model.kv_latent_dim": None},
    {"model.num_kv_heads": 1, "model.kv_latent_dim": None},
    {"model.num_kv_heads": 8, "model.kv_latent_dim": 32},
]
FLAG_SCALARS = (
    "cos_flag",
    "cos_flag_key",
    "flag_logit",
    "content_logit_std",
    "effective_rank",
    "top_share",
    "top_value",
    "rest_norm",
    "query_alignment",
    "flag_alignment",
)


# --- The flag reader -------------------------------------------------------------------------


def flag_reader_geometry(attention: Mapping[str, Any], scale: float) -> dict[str, jax.Array]:
    """What a `LearnedQueryAttention` reads, the flag being its last input channel.

    `attention`: its parameters, query `[D]` and the W_query and W_key kernels `[D, d_k]`;
    `scale`: the logits' factor. A token x gets the logit scale (q W_Q).(x W_K) = scale x.r
    with r = W_K (q W_Q)^T `[D]`: r is the one direction of input space the query reads.
    Returns scalars (cos_flag^2 is the share of |r|^2 on the flag channel):
      cos_flag            cos(r, e_flag)
      cos_flag_key        cos(q W_Q, e_flag W_K): the same in key space
      flag_logit          scale r_flag: what the flag adds to its token's logit
      content_logit_std   scale |r without the flag|: the spread of a token's logit over its
                          content, for content drawn from N(0, I)
      effective_rank      of W_QK = W_Q W_K^T `[D, D]`
      top_share           its largest singular value over their sum
      top_value           its largest singular value
      rest_norm           the Frobenius norm of the rest, sqrt(sum_{i > 1} sigma_i^2): what
                          W_QK holds beyond its top direction
      query_alignment     |cos(u_1, q)|, u_1 W_QK's top left singular vector
      flag_alignment      |v_1[flag]|, v_1 its top right singular vector
    and singular_values `[min(D, d_k)]` (descending).
    """
    query, W_Q, W_K = attention["query"], attention["W_query"]["kernel"], attention["W_key"]["kernel"]
    in_key_space = jnp.matmul(query, W_Q, precision=HIGHEST)  # (d_k,)
    read = jnp.matmul(W_K, in_key_space, precision=HIGHEST)  # (D,)
    W_QK = jnp.matmul(W_Q, W_K.T, precision=HIGHEST)  # (D, D)
    left, values, right = jnp.linalg.svd(W_QK)  # (D, D), (D,), (D, D): one matrix, one call
    values = values[: min(W_Q.shape)]  # (min(D, d_k),): the rest are zero
    norm = lambda x: jnp.sqrt(jnp.sum(jnp.square(x)))
    return {
        "cos_flag": read[-1] / norm(read),
        "cos_flag_key": jnp.dot(in_key_space, W_K[-1], precision=HIGHEST)
        / (norm(in_key_space) * norm(W_K[-1])),
        "flag_logit": scale * read[-1],
        "content_logit_std": scale * norm(read[:-1]),
        "effective_rank": effective_rank(values),
        "top_share": values[0] / jnp.sum(values),
        "top_value": values[0],
        "rest_norm": norm(values[1:]),
        "query_alignment": jnp.abs(jnp.dot(left[:, 0], query, precision=HIGHEST)) / norm(query),
        "flag_alignment": jnp.abs(right[0, -1]),
        "singular_values": values,
    }


def flag_reader_probe(setup: Setup) -> Any:
    """probe(params) -> `flag_reader_geometry` of the flag task's learned-query model."""
    reader = setup.model
    if not isinstance(reader, FlagReader) or reader.kind != "learned_query" or reader.num_flags != 1:
        raise ConfigError(
            "the flag reader study needs the flag task with model.kind='learned_query' and "
            f"task.num_flags=1, got model {reader!r}"
        )
    scale = reader.d_k**-0.5 if reader.scaled else 1.0
    return lambda params: flag_reader_geometry(params["attention"], scale)


def flag_reader(base: dict, workdir: pathlib.Path, seeds: list[int]) -> dict:
    """The flag task's learned query over `seeds`: every quantity of `flag_reader_geometry`
    before and after training (95% intervals, and the paired change), and per seed the step
    at which cos(r, e_flag) first passes ALIGNED."""
    (row,) = run_sweep(base, workdir / "sweep", [{}], seeds, probe_for=flag_reader_probe)
    probes, steps = row["probes"], row["probes"]["step"]
    cos = np.asarray(probes["cos_flag"])  # (steps, seeds)
    aligned: list[int | None] = [
        next((steps[t] for t in range(len(steps)) if cos[t, i] > ALIGNED), None) for i in range(len(seeds))
    ]
    reached = [step for step in aligned if step is not None]
    return {
        "study": "flag_reader",
        "seeds": row["seeds"],
        "steps": steps,
        "d_model": base["model"]["d_model"],
        "d_k": base["model"]["d_k"],
        "train_steps": base["train"]["steps"],
        "aligned_threshold": ALIGNED,
        "wall_time_s": row["wall_time_s"],
        "probes": {name: probes[name] for name in (*FLAG_SCALARS, "singular_values")},
        "summary": {
            name: {
                "before": mean_interval(probes[name][0]),
                "after": mean_interval(probes[name][-1]),
                "change": paired_difference(probes[name][-1], probes[name][0]),
            }
            for name in FLAG_SCALARS
        },
        "aligned_at_step": aligned,
        "aligned_at": mean_interval(reached) if reached else None,
        "aligned_minus_loss_below_1e-2": (  # paired: negative = aligned before the loss fell below 1e-2
            paired_difference(reached, row["steps_to_loss_below_1e-2"])
            if len(reached) == len(aligned)
            else None
        ),
        "steps_to_loss_below_1e-2": row["steps_to_loss_below_1e-2"],
        "accuracy_per_seed": row["eval_accuracy"],
        "accuracy": mean_interval(row["eval_accuracy"]),
    }


# --- Induction heads: K-composition against the induction score -------------------------------


def _lm_head_weights(model: TransformerLM, params: Any) -> HeadWeights:
    """The model's per-head matrices with each attention LayerNorm folded in (LoRA merged)."""
    config = model.config
    return head_weights(
        params, lora_alpha=config.lora_alpha if config.lora_rank else None, fold_layer_norm=True
    )


def patching_pair(model: TransformerLM) -> dict[str, jax.Array]:
    """Fixed clean and corrupted inputs `[PATCH_SEQUENCES, 2 * length]` of the repeat task
    (`repeat_batch`, length = half the model's positions): clean as the task makes them, a
    segment that appears in the first half and again in the second; corrupted with every
    first-half token redrawn, so the copy in the second half is no longer predictable. With
    the clean `targets` and the task's `answer_mask` (the copy's predictable tokens)."""
    config = model.config
    length = config.max_len // 2
    batch_key, corrupt_key = jax.random.split(jax.random.PRNGKey(20260004))
    clean = repeat_batch(batch_key, PATCH_SEQUENCES, length, config.vocab_size)
    redrawn = jax.random.randint(corrupt_key, clean["inputs"].shape, 0, config.vocab_size)  # (B, 2L)
    first_half = jnp.arange(2 * length)[None, :] < length  # (1, 2L): the first copy lies in it
    corrupted = jnp.where(first_half, redrawn, clean["inputs"])
    return {
        "clean": clean["inputs"],
        "corrupted": corrupted,
        **{k: clean[k] for k in ("targets", "answer_mask")},
    }


def head_patching(model: TransformerLM, params: Any, pair: dict[str, jax.Array]) -> jax.Array:
    """`[L, N]`: the share of the answers' log-probability (mean over `pair`'s answer_mask) that
    patching each head's clean output (hook_z, every position) into the corrupted run restores,
    (patched - corrupted) / (clean - corrupted). Log-probabilities, not raw logits: a logit can
    rise for every token in the context at once."""
    mask = pair["answer_mask"].astype(jnp.float32)  # (B, T)

    def answer_log_prob(logits: jax.Array) -> jax.Array:
        log_probs = jax.nn.log_softmax(logits, axis=-1)  # (B, T, V)
        picked = jnp.take_along_axis(log_probs, pair["targets"][..., None], axis=-1)[..., 0]  # (B, T)
        return jnp.sum(picked * mask) / jnp.sum(mask)

    variables = {"params": params}
    clean_logits, cache = run_with_cache(
        model, variables, pair["clean"], names_filter=lambda name: name.endswith("attn.hook_z")
    )
    corrupted_value = answer_log_prob(cast(jax.Array, model.apply(variables, pair["corrupted"])))
    patched = patching_sweep(model, variables, pair["corrupted"], cache, answer_log_prob)  # (L, N)
    return (patched - corrupted_value) / (answer_log_prob(clean_logits) - corrupted_value)


def induction_composition_probe(setup: Setup) -> Any:
    """probe(params) -> `induction_probe`'s scores (`[L, N]`), the Q-, K- and V-composition
    of every head pair (`Q_composition` ... `[L, N, L, N]`, LayerNorms folded in) and each
    head's `head_patching` share (`patch_restored` `[L, N]`)."""
    scores = induction_probe(setup)  # a ConfigError unless the task's model is a TransformerLM
    model = cast(TransformerLM, setup.model)
    modes: tuple[Literal["Q", "K", "V"], ...] = ("Q", "K", "V")
    pair = patching_pair(model)

    def probe(params: Any) -> dict:
        weights = _lm_head_weights(model, params)
        compositions = {f"{mode}_composition": composition_scores(weights, mode) for mode in modes}
        restored = head_patching(model, params, pair)
        return {**scores(params), **compositions, "patch_restored": restored}

    return probe


def risen_at(steps: Sequence[int], curve: Sequence[float], share: float = HALF) -> int | None:
    """The first of `steps` at which `curve` (one value per step) has covered `share` of its
    change from its first value to its last; None when it did not rise."""
    if len(steps) != len(curve) or len(steps) < 2:
        raise ValueError(
            f"risen_at: steps and curve must match, 2 or more; got {len(steps)} and {len(curve)}"
        )
    start, end = curve[0], curve[-1]
    if end <= start:
        return None
    level = start + share * (end - start)
    return next(step for step, value in zip(steps, curve, strict=True) if value >= level)


def steepest_at(steps: Sequence[int], curve: Sequence[float]) -> int:
    """The step that ends the interval between two consecutive `steps` over which `curve` (one
    value per step) rose the most: where it grew fastest, without a threshold."""
    if len(steps) != len(curve) or len(steps) < 2:
        raise ValueError(
            f"steepest_at: steps and curve must match, 2 or more; got {len(steps)} and {len(curve)}"
        )
    return steps[1 + int(np.argmax(np.diff(np.asarray(curve, dtype=float))))]


def _timing(per_seed: list[dict], measure: str) -> dict:
    """`measure` ("risen_at" or "steepest_at") of the induction score and the K-composition over the
    seeds where both are defined: 95% intervals and the paired difference, composition minus induction
    (negative = the composition first)."""
    both = [r for r in per_seed if None not in (r[f"induction_{measure}"], r[f"composition_{measure}"])]
    induction, composition = ([r[f"{name}_{measure}"] for r in both] for name in ("induction", "composition"))
    return {
        "seeds": len(both),
        "induction": mean_interval(induction) if both else None,
        "composition": mean_interval(composition) if both else None,
        "composition_minus_induction": paired_difference(composition, induction) if both else None,
    }


def _composition_of_seed(steps: list[int], probes: dict[str, np.ndarray], seed: int) -> dict:
    """One seed's circuit: its strongest later-layer induction head, the strongest previous-token
    head below it, the K-composition between the two and when each curve rose."""
    final = probes["induction"][-1, seed].copy()  # (L, N)
    final[0] = -np.inf  # a first-layer head has no earlier head to compose with
    layer, head = np.unravel_index(int(np.argmax(final)), final.shape)
    previous = probes["previous_token"][-1, seed, :layer]  # (layer, N)
    p_layer, p_head = np.unravel_index(int(np.argmax(previous)), previous.shape)
    into = {
        mode: probes[f"{mode}_composition"][:, seed, :layer, :, layer, head] for mode in "QKV"
    }  # (steps, layer, N)
    pair = into["K"][:, p_layer, p_head]  # (steps,)
    others = np.delete(into["K"].reshape(len(steps), -1), p_layer * into["K"].shape[2] + p_head, axis=1)
    strongest = np.unravel_index(int(np.argmax(into["K"][-1])), into["K"].shape[1:])
    induction = probes["induction"][:, seed, layer, head]  # (steps,)
    restored = probes["patch_restored"][:, seed]  # (steps, L, N)
    return {
        "patch_induction_head": float(restored[-1, layer, head]),
        "patch_previous_token_head": float(restored[-1, p_layer, p_head]),
        "patch_induction_layer_others": float(np.delete(restored[-1, layer], head).mean()),
        "patch_other_heads": float(
            np.delete(
                restored[-1].reshape(-1),
                [layer * restored.shape[2] + head, p_layer * restored.shape[2] + p_head],
            ).mean()
        ),
        "induction_head": [int(layer), int(head)],
        "previous_token_head": [int(p_layer), int(p_head)],
        "previous_token_score": float(previous[p_layer, p_head]),
        "strongest_k_composer": [int(strongest[0]), int(strongest[1])],
        "induction_score": [float(induction[0]), float(induction[-1])],
        "k_composition": [float(pair[0]), float(pair[-1])],
        "k_composition_other_heads": float(np.mean(others[-1])),
        "q_composition": float(into["Q"][-1, p_layer, p_head]),
        "v_composition": float(into["V"][-1, p_layer, p_head]),
        "formed_at_step": next((steps[t] for t in range(len(steps)) if induction[t] > FORMED), None),
        "induction_risen_at": risen_at(steps, induction.tolist()),
        "composition_risen_at": risen_at(steps, pair.tolist()),
        "induction_steepest_at": steepest_at(steps, induction.tolist()),
        "composition_steepest_at": steepest_at(steps, pair.tolist()),
        "curves": {
            "induction": induction.tolist(),
            "k_composition": pair.tolist(),
            "k_composition_other_heads": others.mean(axis=1).tolist(),  # mean over the other earlier heads
            "patch_induction_head": restored[:, layer, head].tolist(),
            "patch_previous_token_head": restored[:, p_layer, p_head].tolist(),
        },
    }


def _patching_summary(per_seed: list[dict]) -> dict:
    """95% intervals of the share restored by each head of the circuit alone and by the other heads
    (their mean), and the paired difference induction head minus previous-token head."""
    shares = {name: [r[name] for r in per_seed] for name in PATCH_NAMES}
    return {
        **{name: mean_interval(values) for name, values in shares.items()},
        "patch_induction_minus_previous": paired_difference(
            shares["patch_induction_head"], shares["patch_previous_token_head"]
        ),
    }


def induction_composition(base: dict, workdir: pathlib.Path, seeds: list[int]) -> dict:
    """The repeat task's LM over `seeds`: per seed the circuit of `_composition_of_seed`; over
    seeds, when the induction score and the K-composition rose (`risen_at`: half their change
    covered) and grew fastest (`steepest_at`), with 95% intervals and paired differences."""
    (row,) = run_sweep(base, workdir / "sweep", [{}], seeds, probe_for=induction_composition_probe)
    steps = row["probes"]["step"]
    names = (
        "induction",
        "previous_token",
        "Q_composition",
        "K_composition",
        "V_composition",
        "patch_restored",
    )
    probes = {name: np.asarray(row["probes"][name]) for name in names}  # (steps, seeds, ...)
    per_seed = [
        {"seed": seed, **_composition_of_seed(steps, probes, i)} for i, seed in enumerate(row["seeds"])
    ]
    return {
        "study": "induction_composition",
        "rows": per_seed,
        "steps": steps,
        "risen": _timing(per_seed, "risen_at"),
        "steepest": _timing(per_seed, "steepest_at"),
        "k_composition_before": mean_interval([r["k_composition"][0] for r in per_seed]),
        "k_composition_after": mean_interval([r["k_composition"][1] for r in per_seed]),
        "k_composition_other_heads": mean_interval([r["k_composition_other_heads"] for r in per_seed]),
        "q_composition": mean_interval([r["q_composition"] for r in per_seed]),
        "v_composition": mean_interval([r["v_composition"] for r in per_seed]),
        "strongest_is_previous_token_head": sum(
            r["strongest_k_composer"] == r["previous_token_head"] for r in per_seed
        ),
        "pair_minus_other_heads": paired_difference(
            [r["k_composition"][1] for r in per_seed], [r["k_composition_other_heads"] for r in per_seed]
        ),
        **_patching_summary(per_seed),
        "accuracy": mean_interval(row["eval_accuracy"]),
        "train_steps": base["train"]["steps"],
        "half": HALF,
        "formed_threshold": FORMED,
        "wall_time_s": row["wall_time_s"],
    }


# --- Shared K/V heads: how many distinct patterns ---------------------------------------------


def pattern_divergence(weights: jax.Array) -> jax.Array:
    """Mean Jensen-Shannon divergence (nats, natural log) between every two heads' attention
    rows: weights `[B, N, T, S]` (rows summing to 1) -> `[N, N]`, symmetric, zero diagonal,
    each entry in [0, ln 2], averaged over the B x T rows."""
    rows = jnp.swapaxes(jnp.asarray(weights, jnp.float32), 0, 1)  # (N, B, T, S)

    def relative_entropy(p: jax.Array, m: jax.Array) -> jax.Array:  # sum p log(p / m) over S
        # Term by term rather than as entropies' difference: no cancellation, and exactly 0 for
        # a head against itself (m = p, so each log is log 1), whatever order XLA sums in.
        positive = p > 0  # m >= p / 2 > 0 there
        ratio = jnp.where(positive, p, 1.0) / jnp.where(positive, m, 1.0)
        return jnp.sum(jnp.where(positive, p * jnp.log(ratio), 0.0), axis=-1)

    def against_every_head(head: jax.Array) -> jax.Array:  # (B, T, S) -> (N,)
        mixture = 0.5 * (head[None] + rows)  # (N, B, T, S)
        divergence = 0.5 * (relative_entropy(head[None], mixture) + relative_entropy(rows, mixture))
        return jnp.maximum(divergence, 0.0).mean(axis=(1, 2))

    return lax.map(against_every_head, rows)  # (N, N)


def distinct_patterns(divergence: Any, threshold: float = DISTINCT) -> int:
    """The number of distinct attention patterns among N heads: the size of the largest set of
    heads whose patterns differ pairwise, every pair's divergence `[N, N]` (e.g.
    `pattern_divergence`) above `threshold`. 1 when every head attends alike, N when all differ;
    it does not depend on the heads' order."""
    divergence = np.asarray(divergence, dtype=float)
    if divergence.ndim != 2 or divergence.shape[0] != divergence.shape[1]:
        raise ValueError(f"distinct_patterns: divergence must be [N, N], got shape {divergence.shape}")
    if not threshold > 0:
        raise ValueError(f"distinct_patterns: threshold must be > 0, got {threshold}")
    apart = np.minimum(divergence, divergence.T) > threshold  # (N, N)

    def largest(candidates: tuple[int, ...]) -> int:  # the largest pairwise-apart set among candidates
        if not candidates:
            return 0
        first, rest = candidates[0], candidates[1:]
        with_first = 1 + largest(tuple(head for head in rest if apart[first, head]))
        return max(with_first, largest(rest)) if len(rest) > with_first else with_first

    return largest(tuple(range(divergence.shape[0])))


def held_out_windows(setup: Setup, study: str, seed: int, count: int) -> tuple[TransformerLM, jax.Array]:
    """The char LM task's model and `count` fixed windows `[count, T]` cut from its held-out text as
    training batches are cut from the training text; ConfigError naming `study` for another task."""
    model = setup.model
    if not isinstance(model, TransformerLM) or "validation" not in setup.data:
        raise ConfigError(f"{study} needs the char LM task, got model {type(model).__name__}")
    held_out = {**setup.data, "train": setup.data["validation"]}
    return model, setup.sample_batch(jax.random.PRNGKey(seed), held_out)["inputs"][:count]


def kv_views_probe(setup: Setup) -> Any:
    """probe(params) -> each head's W_QK effective rank `qk_effective_rank` `[L, N]` (LayerNorms
    folded in) and `pattern_divergence` `[L, N, N]` per layer on the first VIEW_WINDOWS of a
    fixed batch cut from the held-out text as training batches are cut from the training text
    (the char LM's `data["validation"]`)."""
    model, windows = held_out_windows(setup, "the K/V views study", 20260005, VIEW_WINDOWS)  # (W, T)

    def probe(params: Any) -> dict:
        layers = layer_attention(model, params, windows)  # [(B, N, T, T) per block]
        weights = _lm_head_weights(model, params)
        values = qk_singular_values(weights)  # (L, N, H)
        return {
            "qk_effective_rank": effective_rank(values),
            "pattern_divergence": jnp.stack([pattern_divergence(w) for w in layers]),  # (L, N, N)
        }

    return probe


def _cell_model(base: dict, cell: dict) -> TransformerLM:
    """The char LM's TransformerLM with a sweep cell's overrides (its shape: the vocabulary at its cap)."""
    config = apply_overrides(base, cell)
    return make_model(config["model"], config["data"]["max_vocab_size"])


def _views_of_cell(model: TransformerLM, row: dict) -> dict:
    """One variant's per-seed numbers: distinct patterns per layer through training (at DISTINCT
    and at THRESHOLDS), mean pairwise divergence and mean W_QK effective rank at the end."""
    divergence = np.asarray(row["probes"]["pattern_divergence"])  # (steps, seeds, L, N, N)
    steps, seeds, layers, heads, _ = divergence.shape
    counts = {
        threshold: np.array(
            [
                [
                    [distinct_patterns(divergence[t, s, layer], threshold) for layer in range(layers)]
                    for s in range(seeds)
                ]
                for t in range(steps)
            ]
        )  # (steps, seeds, L)
        for threshold in THRESHOLDS
    }
    pairs = ~np.eye(heads, dtype=bool)  # (N, N): off the diagonal
    mean_divergence = divergence[..., pairs].mean(axis=-1)  # (steps, seeds, L)
    rank = np.asarray(row["probes"]["qk_effective_rank"])  # (steps, seeds, L, N)
    return {
        "arm": arm_name(model),
        "num_kv_heads": model.config.num_kv_heads,
        "kv_latent_dim": model.config.kv_latent_dim,
        "seeds": row["seeds"],
        "num_heads": heads,
        "head_dim": model.config.d_model // heads,
        "steps": row["probes"]["step"],
        "views_per_layer": counts[DISTINCT][-1].tolist(),  # [seed][layer]
        "views_per_layer_interval": [
            mean_interval(counts[DISTINCT][-1, :, layer]) for layer in range(layers)
        ],
        "views_through_training": counts[DISTINCT].sum(axis=-1).tolist(),  # [step][seed]
        "views": {str(t): counts[t][-1].sum(axis=-1).tolist() for t in THRESHOLDS},  # per seed, all layers
        "mean_divergence": mean_divergence[-1].mean(axis=-1).tolist(),  # per seed
        "qk_effective_rank": rank[-1].mean(axis=(-2, -1)).tolist(),  # per seed
        "qk_effective_rank_before": rank[0].mean(axis=(-2, -1)).tolist(),
        "qk_effective_rank_change": (rank[-1] - rank[0]).mean(axis=(-2, -1)).tolist(),
        "mean_divergence_before": mean_divergence[0].mean(axis=-1).tolist(),
        "val_bits_per_char": row["eval_val_bits_per_char"],
    }


def kv_views(base: dict, workdir: pathlib.Path, cells: list[dict], seeds: list[int]) -> dict:
    """The K/V variants (`cells`, e.g. configs/char_lm.py:study's sweep) over `seeds` through the
    sweep launcher, each cell's seeds trained together; per variant `_views_of_cell`'s numbers
    with 95% intervals and the paired differences from MHA (same seeds, same batches)."""
    rows = run_sweep(
        base, workdir / "sweep", cells, seeds, metric="eval_val_bits_per_char", probe_for=kv_views_probe
    )
    results = [_views_of_cell(_cell_model(base, row["cell"]), row) for row in rows if row["status"] == "done"]
    mha = next((r for r in results if r["arm"].startswith("mha")), None)
    if mha is None:
        raise ConfigError("the K/V views study compares with MHA: give a cell with num_kv_heads = num_heads")
    measures = (
        "mean_divergence",
        "mean_divergence_before",
        "qk_effective_rank",
        "qk_effective_rank_before",
        "qk_effective_rank_change",
        "val_bits_per_char",
    )
    for result in results:
        result["intervals"] = {
            **{name: mean_interval(result[name]) for name in measures},
            **{f"views_{t}": mean_interval(v) for t, v in result["views"].items()},
        }
        result["minus_mha"] = {
            **{name: paired_difference(result[name], mha[name]) for name in measures},
            **{f"views_{t}": paired_difference(v, mha["views"][t]) for t, v in result["views"].items()},
        }
    return {
        "study": "kv_views",
        "threshold": DISTINCT,
        "thresholds": list(THRESHOLDS),
        "windows": VIEW_WINDOWS,
        "rows": results,
        "wall_time_s": sum(row["wall_time_s"] for row in rows),
    }


# --- Tables and plots -------------------------------------------------------------------------


def _change(stats: dict | None) -> str:
    """A paired difference's mean [95% CI], signed."""
    return format_interval(stats, 3, signed=True)


FLAG_LABELS = {
    "cos_flag": "cos(r, e_flag), r = W_K (q W_Q)^T",
    "cos_flag_key": "cos(q W_Q, e_flag W_K), in key space",
    "flag_logit": "logit the flag adds, scale r_flag",
    "content_logit_std": "logit spread from the content, scale x norm(r_content)",
    "effective_rank": "effective rank of W_QK",
    "top_share": "largest singular value / sum",
    "top_value": "largest singular value",
    "rest_norm": "norm of W_QK beyond its top direction",
    "query_alignment": "top left singular vector against q, abs cos",
    "flag_alignment": "top right singular vector on the flag channel, abs",
}


def _flag_reader_table(results: dict) -> list[str]:
    lines = [
        f"Mean [95% CI] over {len(results['seeds'])} seeds:",
        "",
        "| quantity | before training | after training | after minus before (paired) |",
        "|---|---|---|---|",
    ]
    for name, label in FLAG_LABELS.items():
        s = results["summary"][name]
        label += f" (at most {min(results['d_model'], results['d_k'])})" if name == "effective_rank" else ""
        lines.append(
            f"| {label} | {format_interval(s['before'])} | {format_interval(s['after'])} | "
            f"{_change(s['change'])} |"
        )
    lines += [
        "",
        f"| seed | cos(r, e_flag) first above {ALIGNED} at step | loss first below 1e-2 at step | accuracy |",
        "|---|---|---|---|",
    ]
    for i, seed in enumerate(results["seeds"]):
        aligned = results["aligned_at_step"][i]
        lines.append(
            f"| {seed} | {'never' if aligned is None else aligned} | "
            f"{results['steps_to_loss_below_1e-2'][i]:.0f} | {results['accuracy_per_seed'][i]:.4f} |"
        )
    return lines


def _flag_reader_plot(results: dict, axes: Any) -> None:
    steps = results["steps"]
    cos = np.asarray(results["probes"]["cos_flag"])  # (steps, seeds)
    rank = np.asarray(results["probes"]["effective_rank"]).mean(axis=1)  # (steps,), mean over seeds
    values = np.asarray(results["probes"]["singular_values"]).mean(axis=1)  # (steps, k), mean over seeds
    for i in range(cos.shape[1]):
        axes[0].plot(steps, cos[:, i], color=f"C{i}", lw=1)
    axes[0].axhline(ALIGNED, color="gray", ls=":", lw=0.8)
    rank_axis = axes[0].twinx()
    rank_axis.plot(steps, rank, color="black", ls="--", lw=1.5)
    rank_axis.set(ylabel="effective rank of W_QK, mean over seeds (dashed)")
    axes[0].set(xlabel="step", ylabel="cos(r, e_flag), per seed", title="the direction the query reads")
    for k in range(values.shape[1]):
        axes[1].plot(steps, values[:, k], color="C0" if k == 0 else "gray", lw=1.5 if k == 0 else 1)
    axes[1].set(
        yscale="log",
        xlabel="step",
        ylabel="singular value, mean over seeds",
        title="W_QK's singular values (the largest in blue)",
    )
    for ax in axes:
        ax.set_xscale("symlog", linthresh=10)
        ax.set_xlim(0, steps[-1])


def _induction_composition_table(results: dict) -> list[str]:
    lines = [
        "| seed | induction head | previous-token head | strongest K-composer into it | induction score "
        "| K-composition of the pair | other earlier heads' K-composition | Q-, V-composition of the pair "
        "| risen at step: induction, K-composition | steepest at step: induction, K-composition |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        arrow = lambda pair: f"{pair[0]:.3f} -> {pair[1]:.3f}"
        lines.append(
            f"| {r['seed']} | {tuple(r['induction_head'])} | {tuple(r['previous_token_head'])} "
            f"| {tuple(r['strongest_k_composer'])} | {arrow(r['induction_score'])} "
            f"| {arrow(r['k_composition'])} "
            f"| {r['k_composition_other_heads']:.3f} | {r['q_composition']:.3f}, {r['v_composition']:.3f} "
            f"| {r['induction_risen_at']}, {r['composition_risen_at']} "
            f"| {r['induction_steepest_at']}, {r['composition_steepest_at']} |"
        )
    lines += [
        "",
        "Scores before -> after training. Risen: the first probed step at which a curve has covered "
        f"{HALF:g} of its change from before training to the end; steepest: the step ending the probe "
        "interval over which it rose the most. Mean [95% CI] over every seed in which both are defined:",
        "",
        "| timing | seeds | induction score | K-composition | K-composition minus induction (paired) |",
        "|---|---|---|---|---|",
    ]
    for name, label in (("risen", "risen (half the change)"), ("steepest", "steepest rise")):
        t = results[name]
        lines.append(
            f"| {label} | {t['seeds']} | {format_interval(t['induction'], 4)} | "
            f"{format_interval(t['composition'], 4)} "
            f"| {_change(t['composition_minus_induction'])} |"
        )
    if "patch_induction_head" not in results:
        return lines
    return lines + [
        "",
        "Share of the copy's answers' log-probability restored by patching one head's clean output "
        "into the corrupted run (1 = all of the clean run's advantage), after training, mean [95% CI] "
        "over seeds:",
        "",
        "| induction head alone | previous-token head alone | each other head of the induction head's layer "
        "(mean) | each other head (mean) "
        "| induction minus previous-token head (paired) |",
        "|---|---|---|---|---|",
        "| "
        + " | ".join(format_interval(results[name]) for name in PATCH_NAMES)
        + f" | {_change(results['patch_induction_minus_previous'])} |",
    ]


def _induction_composition_plot(results: dict, axes: Any) -> None:
    steps = results["steps"]
    for i, r in enumerate(results["rows"]):
        for name, style in (("induction", "-"), ("k_composition", "--")):
            curve = np.asarray(r["curves"][name])
            span = curve[-1] - curve[0]
            axes[0].plot(steps, (curve - curve[0]) / (span if span else 1.0), style, color=f"C{i}", lw=1)
        axes[1].plot(steps, r["curves"]["k_composition"], color=f"C{i}", lw=1, label=f"seed {r['seed']}")
        axes[1].plot(steps, r["curves"]["k_composition_other_heads"], ":", color=f"C{i}", lw=1)
    axes[0].axhline(HALF, color="gray", ls=":", lw=0.8)
    axes[0].set(
        xlabel="step",
        ylabel="share of the change over training",
        title="induction score (solid) and K-composition (dashed)",
    )
    axes[1].set(
        xlabel="step",
        ylabel="K-composition",
        title="previous-token head -> induction head (solid); other heads (dotted)",
    )
    axes[1].title.set_fontsize(9)
    axes[1].legend(fontsize=6)


def _through(intervals: dict, name: str) -> str:
    """'before -> after training' of a measure with `<name>_before` and `<name>` intervals."""
    return f"{format_interval(intervals[f'{name}_before'])} -> {format_interval(intervals[name])}"


def _kv_views_table(results: dict) -> list[str]:
    threshold = results["threshold"]
    first = results["rows"][0]
    layers = len(first["views_per_layer_interval"])
    lines = [
        f"| arm | distinct patterns per layer (of {first['num_heads']}; JS > {threshold:g} nats), layer "
        + ", ".join(str(layer) for layer in range(layers))
        + " | all layers, minus MHA (paired) | mean pairwise JS divergence (nats), before -> after training "
        "| after, minus MHA "
        f"| W_QK effective rank per head (of {first['head_dim']}), before -> after training "
        "| its change in training, minus MHA | val bits/char |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        intervals, minus = r["intervals"], r["minus_mha"]
        per_layer = "; ".join(format_interval(s, 3) for s in r["views_per_layer_interval"])
        lines.append(
            f"| {r['arm']} | {per_layer} | {_change(minus[f'views_{threshold}'])} "
            f"| {_through(intervals, 'mean_divergence')} | {_change(minus['mean_divergence'])} "
            f"| {_through(intervals, 'qk_effective_rank')} | {_change(minus['qk_effective_rank_change'])} "
            f"| {format_interval(intervals['val_bits_per_char'], 4)} |"
        )
    lines += [
        "",
        "Distinct patterns over all layers at other thresholds, minus MHA (paired):",
        "",
        "| arm | " + " | ".join(f"JS > {t:g}: count; minus MHA" for t in results["thresholds"]) + " |",
        "|---|" + "---|" * len(results["thresholds"]),
    ]
    for r in results["rows"]:
        cells = [
            f"{format_interval(r['intervals'][f'views_{t}'])}; {_change(r['minus_mha'][f'views_{t}'])}"
            for t in results["thresholds"]
        ]
        lines.append(f"| {r['arm']} | " + " | ".join(cells) + " |")
    return lines


def _kv_views_plot(results: dict, axes: Any) -> None:
    for i, r in enumerate(results["rows"]):
        views = np.asarray(r["views_through_training"])  # (steps, seeds)
        axes[0].plot(r["steps"], views.mean(axis=1), marker="o", ms=3, color=f"C{i}", label=r["arm"])
        rank, divergence = r["intervals"]["qk_effective_rank"], r["intervals"]["mean_divergence"]
        axes[1].errorbar(
            rank["mean"],
            divergence["mean"],
            xerr=[[rank["mean"] - rank["low"]], [rank["high"] - rank["mean"]]],
            yerr=[[divergence["mean"] - divergence["low"]], [divergence["high"] - divergence["mean"]]],
            fmt="o",
            color=f"C{i}",
        )
        axes[1].annotate(r["arm"], (rank["mean"], divergence["mean"]), fontsize=7)
    axes[0].set(
        xlabel="step",
        ylabel=f"distinct patterns, all layers (JS > {results['threshold']:g})",
        title="distinct attention patterns (mean over seeds)",
    )
    axes[0].legend(fontsize=7)
    axes[1].set(
        xlabel="W_QK effective rank per head (95% CI)",
        ylabel="mean pairwise JS divergence (nats, 95% CI)",
        title="after training",
    )


STUDIES = {
    "flag_reader": Study(
        "What W_Q and W_K learn on the flag task",
        lambda base, workdir, options: flag_reader(base, workdir, options["seeds"]),
        _flag_reader_table,
        _flag_reader_plot,
    ),
    "induction_composition": Study(
        "K-composition against the induction score",
        lambda base, workdir, options: induction_composition(base, workdir, options["seeds"]),
        _induction_composition_table,
        _induction_composition_plot,
    ),
    "kv_views": Study(
        "Shared K/V heads: W_QK rank and distinct attention patterns",
        lambda base, workdir, options: kv_views(base, workdir, KV_VIEW_CELLS, options["seeds"]),
        _kv_views_table,
        _kv_views_plot,
    ),
}
