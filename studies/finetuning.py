"""Fine-tuning the char LM's learned projections, studied on per-seed `train_and_evaluate` runs.

  pretrain(base, directory, seeds)   the char LM on the standard library, one run per seed in
                                     <directory>/seed_<s>: the source of the three studies
                                     (re-running finds them finished).
  lora_finetune(base, workdir, pretrained, seeds)
                                     each seed's pre-trained model fine-tuned onto the standard
                                     library's docstrings (validated on the docstrings of the
                                     files pre-training held out): in full, and with LoRA
                                     adapters of rank 1..16 on W_Q + W_V and on all four (and
                                     at ranks 1, 4, 16 on all four and the MLP).
  kv_conversion(base, workdir, pretrained, seeds)
                                     MHA -> GQA-2 and MQA by mean-pooling each group's K/V heads:
                                     right after conversion, after uptraining UPTRAIN_FRACTIONS of
                                     the pre-training steps, against the GQA/MQA model trained
                                     from scratch for the same total steps.
  head_ablation(base, workdir, pretrained, seeds)
                                     each head's ablation cost (eval_head_ablation) against its
                                     diagnostics (attention entropy, previous-token weight,
                                     induction score): Spearman correlations per seed.
  STUDIES                            each study's entry for the launcher (experiments/study.py).

Every number is a mean over seeds with a t-based 95% interval (`stats.mean_interval`);
comparisons on the same seeds are paired (`stats.paired_difference`). Fine-tunes run
through `train.init_from`, exactly as from the command line.
"""

from __future__ import annotations

import ast
import copy
import json
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from qkv_jax import text
from qkv_jax.training.run import train_and_evaluate
from studies.grid import apply_overrides
from studies.results import Study
from studies.stats import interval_errors, mean_interval, paired_difference

__all__ = [
    "RANKS",
    "TARGETS",
    "DIAGNOSTICS",
    "pretrain",
    "docstring_corpus",
    "lora_finetune",
    "kv_conversion",
    "head_ablation",
    "STUDIES",
]

RANKS = (1, 2, 4, 8, 16)
# lora_targets -> (short name, what it adapts, ranks): query+value and all four projections, and
# the four with the MLP
TARGETS = {
    "query,value": ("qv", "W_Q, W_V", RANKS),
    "query,key,value,out": ("qkvo", "W_Q, W_K, W_V, W_O", RANKS),
    "query,key,value,out,mlp": ("qkvo_mlp", "W_Q, W_K, W_V, W_O, MLP", (1, 4, 16)),
}
FINETUNE_STEPS = 150  # half the pre-training's 300
# Ainslie et al. (2023) uptrain for 5% of the pre-training steps; 20% shows the trend
UPTRAIN_FRACTIONS = (0.05, 0.2)
KV_HEADS = (2, 1)
ABLATION_EXAMPLES = 128  # validation windows of the pre-trained runs' head ablation
# diagnostic -> the sign of a "special" head (low entropy: focused; high previous-token or induction)
DIAGNOSTICS = {"entropy": -1, "previous_token": 1, "induction": 1}


def _run(base: dict, workdir: pathlib.Path, overrides: dict) -> dict:
    """`base` with the dotted-field `overrides`, trained in `workdir`; a run of this config that
    finished there before is read back without building anything (re-rendering a study)."""
    config = apply_overrides(copy.deepcopy(base), overrides)
    summary_path, config_path = workdir / "summary.json", workdir / "config.json"
    if summary_path.is_file() and config_path.is_file():
        summary = json.loads(summary_path.read_text())
        if json.loads(config_path.read_text()) == json.loads(json.dumps(config)):
            if summary.get("steps") == config["train"]["steps"]:
                return summary
    return train_and_evaluate(config, workdir)


def pretrain(base: dict, directory: pathlib.Path, seeds: list[int]) -> list[dict]:
    """The summaries of `base` trained once per seed in directory/seed_<s>, with the head
    ablation measured on ABLATION_EXAMPLES validation windows (at most eval.num_examples)."""
    examples = min(ABLATION_EXAMPLES, base["eval"]["num_examples"])
    directory = pathlib.Path(directory)
    return [
        _run(base, directory / f"seed_{seed}", {"seed": seed, "eval.ablation_examples": examples})
        for seed in seeds
    ]


def docstring_corpus(path: pathlib.Path, validation_fraction: float) -> float:
    """Writes the docstrings (module, class, function) of the standard library's files into
    `path`: first those of the files pre-training trains on, then those of the files it holds
    out (the same CRC-32 split, `text.split_documents`). Returns the share of the text the
    held-out files' docstrings make up: the fine-tune's data.validation_fraction, so that its
    validation text is docstrings the pre-trained model has never seen."""
    documents = []
    for name, source in text.stdlib_documents():
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docstrings = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds)]
        if any(docstrings):
            documents.append((name, "\n\n".join(d for d in docstrings if d)))
    train, validation = text.split_documents(documents, validation_fraction)
    corpus = f"{train}\n{validation}"
    path.write_text(corpus)
    return len(validation) / len(corpus)


def _seed_stats(values: list[float], reference: list[float] | None = None) -> dict:
    row = {"values": values, **mean_interval(values)}
    if reference is not None:
        row["paired"] = paired_difference(values, reference)
    return row


def lora_finetune(base: dict, workdir: pathlib.Path, pretrained: pathlib.Path, seeds: list[int]) -> dict:
    """Full fine-tuning and LoRA (each of TARGETS at its ranks) of each seed's pre-trained run onto the
    docstrings, FINETUNE_STEPS steps each, in workdir/<arm>/seed_<s>; rows with validation
    bits/char per seed, trainable parameters and the paired difference from full fine-tuning."""
    workdir = pathlib.Path(workdir)
    pretrain(base, pretrained, seeds)
    workdir.mkdir(parents=True, exist_ok=True)
    corpus = workdir / "docstrings.txt"
    fraction = docstring_corpus(corpus, base["data"]["validation_fraction"])
    arms = [("full", 0, None)] + [
        (f"lora_{short}_r{rank}", rank, targets)
        for targets, (short, _, ranks) in TARGETS.items()
        for rank in ranks
    ]
    summaries: dict[str, list[dict]] = {}
    for arm, rank, targets in arms:
        overrides = {
            "data.path": str(corpus.absolute()),
            "data.validation_fraction": fraction,
            "train.steps": FINETUNE_STEPS,
            "train.warmup_steps": FINETUNE_STEPS // 10,
            "train.log_every": max(1, FINETUNE_STEPS // 6),
            "train.checkpoint_every": FINETUNE_STEPS,
            "eval.ablation_examples": 0,
            "model.lora_rank": rank,
            **({"model.lora_targets": targets} if targets else {}),
        }
        summaries[arm] = [
            _run(
                base,
                workdir / arm / f"seed_{seed}",
                {**overrides, "seed": seed, "train.init_from": str((pretrained / f"seed_{seed}").absolute())},
            )
            for seed in seeds
        ]
    return {"study": "lora_finetune", "seeds": seeds, "steps": FINETUNE_STEPS, **_lora_rows(summaries, arms)}


def _lora_rows(summaries: dict[str, list[dict]], arms: list) -> dict:
    full = [s["eval_val_bits_per_char"] for s in summaries["full"]]
    before = [s["untrained"]["eval_val_bits_per_char"] for s in summaries["full"]]
    rows = [
        {
            "arm": "pre-trained (no fine-tuning)",
            "rank": None,
            "targets": None,
            "trainable_params": 0,
            "val_bits_per_char": _seed_stats(before, full),
        }
    ]
    for arm, rank, targets in arms:
        runs = summaries[arm]
        rows.append(
            {
                "arm": arm,
                "rank": rank or None,
                "targets": targets,
                "params": runs[0]["params"],
                "trainable_params": runs[0]["trainable_params"],
                "val_bits_per_char": _seed_stats([s["eval_val_bits_per_char"] for s in runs], full),
            }
        )
    return {"rows": rows, "unigram_bits_per_char": summaries["full"][0]["eval_unigram_bits_per_char"]}


def kv_conversion(base: dict, workdir: pathlib.Path, pretrained: pathlib.Path, seeds: list[int]) -> dict:
    """Per seed: the pre-trained MHA run, converted to each of KV_HEADS (before any training);
    per uptraining length U (UPTRAIN_FRACTIONS of the pre-training steps): the converted model
    uptrained U steps, the MHA run continued U steps (a control), and the GQA/MQA model
    trained from scratch for the pre-training's steps + U. Every run has `base`'s recipe."""
    workdir, pretrained = pathlib.Path(workdir), pathlib.Path(pretrained)
    sources = pretrain(base, pretrained, seeds)
    workdir.mkdir(parents=True, exist_ok=True)
    steps, warmup = base["train"]["steps"], base["train"]["warmup_steps"]
    values: dict[str, list[float]] = {"mha": [s["eval_val_bits_per_char"] for s in sources]}
    lengths = [max(1, round(fraction * steps)) for fraction in UPTRAIN_FRACTIONS]
    for seed in seeds:
        start = {"seed": seed, "train.init_from": str((pretrained / f"seed_{seed}").absolute())}
        for uptrain in lengths:
            continued = _run(
                base, workdir / f"mha_continued_{uptrain}" / f"seed_{seed}", {**_schedule(uptrain), **start}
            )
            values.setdefault(f"mha_continued_{uptrain}", []).append(continued["eval_val_bits_per_char"])
            for heads in KV_HEADS:
                name, convert = _kv_name(heads), {"train.convert_kv_heads": True, "model.num_kv_heads": heads}
                run = _run(
                    base,
                    workdir / f"{name}_uptrained_{uptrain}" / f"seed_{seed}",
                    {**_schedule(uptrain), **start, **convert},
                )
                values.setdefault(f"{name}_uptrained_{uptrain}", []).append(run["eval_val_bits_per_char"])
                if uptrain == lengths[0]:  # before any uptraining: the same for every length
                    values.setdefault(f"{name}_converted", []).append(
                        run["untrained"]["eval_val_bits_per_char"]
                    )
                scratch = _run(
                    base,
                    workdir / f"{name}_scratch_{steps + uptrain}" / f"seed_{seed}",
                    {**_schedule(steps + uptrain, warmup), "seed": seed, "model.num_kv_heads": heads},
                )
                values.setdefault(f"{name}_scratch_{steps + uptrain}", []).append(
                    scratch["eval_val_bits_per_char"]
                )
    rows = _conversion_rows(values, steps, lengths)
    return {"study": "kv_conversion", "seeds": seeds, "steps": steps, "uptrain_steps": lengths, "rows": rows}


def _kv_name(heads: int) -> str:
    return "mqa" if heads == 1 else f"gqa{heads}"


def _schedule(steps: int, warmup: int | None = None) -> dict:
    """Overrides for a run of `steps` steps: one compiled chunk and one checkpoint, at the end; no
    head ablation; a fifth of the steps warm up unless `warmup` is given."""
    return {
        "train.steps": steps,
        "train.warmup_steps": max(1, steps // 5) if warmup is None else warmup,
        "train.log_every": steps,
        "train.checkpoint_every": steps,
        "eval.ablation_examples": 0,
    }


def _conversion_rows(values: dict[str, list[float]], steps: int, lengths: list[int]) -> list[dict]:
    """A row per arm: K/V heads, steps, validation bits/char over seeds, and the paired
    difference from the arm it is compared with (`against`)."""

    def row(arm: str, heads: Any, arm_steps: str, against: str | None) -> dict:
        reference = None if against is None else values[against]
        stats = _seed_stats(values[arm], reference)
        return {
            "arm": arm,
            "kv_heads": heads,
            "steps": arm_steps,
            "against": against,
            "val_bits_per_char": stats,
        }

    rows = [row("mha", "all", f"{steps}", None)]
    rows += [row(f"{_kv_name(h)}_converted", h, f"{steps} + 0", "mha") for h in KV_HEADS]
    for uptrain in lengths:
        total = steps + uptrain
        rows.append(row(f"mha_continued_{uptrain}", "all", f"{steps} + {uptrain}", "mha"))
        for heads in KV_HEADS:
            name = _kv_name(heads)
            rows.append(row(f"{name}_scratch_{total}", heads, f"{total}", None))
            rows.append(
                row(f"{name}_uptrained_{uptrain}", heads, f"{steps} + {uptrain}", f"{name}_scratch_{total}")
            )
    return rows


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    from scipy import stats

    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(stats.spearmanr(a, b).statistic)


def _mean_within_layers(ablation: np.ndarray, values: np.ndarray) -> float:
    """Spearman's rho of `[L, N]` ablation costs and diagnostic values within each layer, averaged
    over the layers where it is defined (nan if none)."""
    rhos = [rho for a, v in zip(ablation, values, strict=True) if not np.isnan(rho := _spearman(a, v))]
    return float(np.mean(rhos)) if rhos else float("nan")


def head_ablation(base: dict, workdir: pathlib.Path, pretrained: pathlib.Path, seeds: list[int]) -> dict:
    """Per seed's pre-trained run: Spearman's rho between the heads' ablation cost and each
    diagnostic, over all heads and within each layer (averaged over layers); the mean ablation
    cost per layer and head; whether each diagnostic's most special head is the costliest."""
    summaries = pretrain(base, pathlib.Path(pretrained), seeds)
    pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)  # for its results: it trains nothing more
    ablation = np.asarray([s["eval_head_ablation"] for s in summaries])  # (seeds, L, N)
    rows = []
    for name, sign in DIAGNOSTICS.items():
        values = np.asarray([s[f"eval_head_{name}"] for s in summaries])  # (seeds, L, N)
        overall = [_spearman(a.ravel(), v.ravel()) for a, v in zip(ablation, values, strict=True)]
        within = [_mean_within_layers(a, v) for a, v in zip(ablation, values, strict=True)]
        top = [
            int(np.argmax(a.ravel()) == np.argmax(sign * v.ravel()))
            for a, v in zip(ablation, values, strict=True)
        ]
        rows.append(
            {
                "diagnostic": name,
                "special": "low" if sign < 0 else "high",
                "rho_all_heads": _seed_stats(overall),
                "rho_within_layer": _seed_stats(within),
                "most_special_is_costliest": top,
                "values_per_seed": values.tolist(),
            }
        )
    return {
        "study": "head_ablation",
        "seeds": seeds,
        "examples": ABLATION_EXAMPLES,
        "ablation_per_seed": ablation.tolist(),
        "layer_share": (ablation.sum(axis=2) / ablation.sum(axis=(1, 2))[:, None]).mean(axis=0).tolist(),
        "rows": rows,
    }


def interval(stats: dict, digits: int = 3) -> str:
    """'mean [low, high]' of a `mean_interval` record."""
    return f"{stats['mean']:.{digits}f} [{stats['low']:.{digits}f}, {stats['high']:.{digits}f}]"


def _header(*columns: str) -> list[str]:
    """A markdown table's header and separator lines."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def _lora_table(results: dict) -> list[str]:
    lines = _header(
        "arm",
        "adapters on",
        "rank",
        "trainable parameters",
        f"val bits/char (mean [95% CI], {len(results['seeds'])} seeds)",
        "minus full fine-tuning (paired)",
    )
    for row in results["rows"]:
        stats = row["val_bits_per_char"]
        paired = "-" if row["arm"] == "full" else interval(stats["paired"])
        adapted = (
            TARGETS[row["targets"]][1]
            if row["targets"]
            else "every parameter"
            if row["arm"] == "full"
            else "-"
        )
        lines.append(
            f"| {row['arm']} | {adapted} | {row['rank'] or '-'} | {row['trainable_params']:,} "
            f"| {interval(stats)} | {paired} |"
        )
    return lines


def _bars(ax: Any, names: list[str], stats: list[dict], **options: Any) -> None:
    """Bars of `mean_interval` records with their 95% intervals."""
    ax.bar(names, [s["mean"] for s in stats], yerr=interval_errors(stats), capsize=3, **options)
    ax.tick_params(axis="x", rotation=60, labelsize=7)


def _lora_plot(results: dict, axes: Any) -> None:
    rows = results["rows"]
    for targets, (_, label, _) in TARGETS.items():
        chosen = [r for r in rows if r["targets"] == targets]
        stats = [r["val_bits_per_char"] for r in chosen]
        axes[0].errorbar(
            [r["trainable_params"] for r in chosen],
            [s["mean"] for s in stats],
            yerr=interval_errors(stats),
            marker="o",
            capsize=3,
            label=f"LoRA on {label}",
        )
    full, before = next(r for r in rows if r["arm"] == "full"), rows[0]
    stats = [full["val_bits_per_char"]]
    axes[0].errorbar(
        [full["trainable_params"]],
        [stats[0]["mean"]],
        yerr=interval_errors(stats),
        fmt="s",
        color="k",
        capsize=3,
        label="full fine-tuning",
    )
    axes[0].axhline(
        before["val_bits_per_char"]["mean"], color="gray", ls="--", label="pre-trained, not fine-tuned"
    )
    axes[0].set(
        xscale="log",
        xlabel="trainable parameters",
        ylabel="validation bits/char (docstrings)",
        title="fine-tuning onto docstrings (95% CI over seeds)",
    )
    axes[0].legend(fontsize=7)
    lora = [r for r in rows if r["rank"]]
    _bars(
        axes[1],
        [r["arm"].removeprefix("lora_") for r in lora],
        [r["val_bits_per_char"]["paired"] for r in lora],
    )
    axes[1].axhline(0, color="k", lw=0.8)
    axes[1].set(ylabel="bits/char minus full fine-tuning", title="LoRA against full fine-tuning (paired)")


def _conversion_table(results: dict) -> list[str]:
    lines = _header(
        "arm",
        "K/V heads",
        "steps (pre-training + after)",
        f"val bits/char (mean [95% CI], {len(results['seeds'])} seeds)",
        "paired difference",
        "against",
    )
    for row in results["rows"]:
        stats = row["val_bits_per_char"]
        paired = interval(stats["paired"]) if row["against"] else "-"
        lines.append(
            f"| {row['arm']} | {row['kv_heads']} | {row['steps']} | {interval(stats)} | {paired} "
            f"| {row['against'] or '-'} |"
        )
    return lines


def _conversion_plot(results: dict, axes: Any) -> None:
    rows = results["rows"]
    stats = [r["val_bits_per_char"] for r in rows]
    kinds = ("converted", "uptrained", "scratch")
    colors = [next((f"C{i}" for i, kind in enumerate(kinds) if kind in r["arm"]), "C7") for r in rows]
    _bars(axes[0], [r["arm"] for r in rows], stats, color=colors)
    means = [s["mean"] for s in stats]
    axes[0].set(
        ylabel="validation bits/char",
        title="MHA -> GQA/MQA (95% CI over seeds)",
        ylim=(min(means) - 0.2, max(means) + 0.1),
    )
    uptrained = [r for r in rows if "uptrained" in r["arm"]]
    _bars(
        axes[1],
        [r["arm"] for r in uptrained],
        [r["val_bits_per_char"]["paired"] for r in uptrained],
        color="C1",
    )
    axes[1].axhline(0, color="k", lw=0.8)
    axes[1].set(
        ylabel="bits/char minus from scratch (same total steps)",
        title="uptrained against trained from scratch (paired)",
    )


def _ablation_table(results: dict) -> list[str]:
    seeds = len(results["seeds"])
    lines = _header(
        "diagnostic",
        "special heads have",
        f"Spearman rho, all heads (mean [95% CI], {seeds} seeds)",
        "rho within a layer",
        "seeds whose most special head is the costliest",
    )
    for row in results["rows"]:
        lines.append(
            f"| {row['diagnostic']} | {row['special']} values | {interval(row['rho_all_heads'], 2)} "
            f"| {interval(row['rho_within_layer'], 2)} | {sum(row['most_special_is_costliest'])} of {seeds} |"
        )
    return lines


def _ablation_plot(results: dict, axes: Any) -> None:
    """Seed 0's cost per head (head indices mean nothing across seeds: each seed's heads learn
    their own roles), and every seed's heads: cost against each diagnostic."""
    ablation = np.asarray(results["ablation_per_seed"])  # (seeds, L, N)
    limit = float(np.abs(ablation[0]).max())
    image = axes[0].imshow(ablation[0], cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    axes[0].set_xticks(range(ablation.shape[2]))
    axes[0].set_yticks(range(ablation.shape[1]))
    axes[0].set(
        xlabel="head",
        ylabel="layer",
        title=f"bits/char lost with the head zeroed (seed {results['seeds'][0]})",
    )
    axes[0].figure.colorbar(image, ax=axes[0])
    for index, row in enumerate(results["rows"]):
        values = np.asarray(row["values_per_seed"]).ravel()  # (seeds * L * N,)
        spread = np.ptp(values) or 1.0
        axes[1].scatter(
            (values - values.min()) / spread,
            ablation.ravel(),
            label=row["diagnostic"],
            marker="os^"[index],
            alpha=0.6,
            s=14,
        )
    axes[1].set(
        xlabel="diagnostic, scaled to [0, 1]",
        ylabel="ablation cost (bits/char)",
        title=f"every head of {len(results['seeds'])} seeds: cost against its diagnostics",
    )
    axes[1].legend(fontsize=7)


# study -> (title, table, plot)
def _with_pretrained(study: Callable[..., dict]) -> Callable[[dict, pathlib.Path, dict], dict]:
    """A study over `options["pretrained"]` (default: <workdir>/pretrained) and its seeds."""

    def run(base: dict, workdir: pathlib.Path, options: dict) -> dict:
        pretrained = options.get("pretrained") or pathlib.Path(workdir) / "pretrained"
        return study(base, workdir, pathlib.Path(pretrained), options["seeds"])

    return run


STUDIES = {
    "lora_finetune": Study(
        "Fine-tuning the char LM: LoRA against full fine-tuning",
        _with_pretrained(lora_finetune),
        _lora_table,
        _lora_plot,
    ),
    "kv_conversion": Study(
        "MHA -> GQA/MQA: conversion and uptraining",
        _with_pretrained(kv_conversion),
        _conversion_table,
        _conversion_plot,
    ),
    "head_ablation": Study(
        "Head ablation against the head diagnostics",
        _with_pretrained(head_ablation),
        _ablation_table,
        _ablation_plot,
    ),
}
