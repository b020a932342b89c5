"""Pictures of attention (matplotlib, Agg backend; imported only when plotting)."""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

__all__ = [
    "plot_flag_attention",
    "plot_sweep_lines",
    "plot_sweep_heatmap",
    "plot_loss_curves",
    "plot_attention_maps",
    "plot_head_ablation",
]


def _save(fig, path) -> pathlib.Path:
    path = pathlib.Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_flag_attention(weights, flag_positions, path, title: str = "") -> pathlib.Path:
    """Heatmap of attention weights `[examples, heads, S]`, one panel per head.

    Each row is one example; white markers show its flagged positions (a ring
    for flag 0, a square for flag 1, ...).
    """
    weights = np.asarray(weights, np.float32)
    flag_positions = np.asarray(flag_positions).reshape(len(weights), -1)
    num_examples, num_heads, seq_len = weights.shape
    fig, axes = plt.subplots(
        1,
        num_heads,
        figsize=(1.6 + 0.55 * seq_len * num_heads, 0.9 + 0.4 * num_examples),
        squeeze=False,
        layout="constrained",  # room for the titles, the labels and the colorbar's label
    )
    for head, ax in enumerate(axes[0]):
        image = ax.imshow(weights[:, head, :], vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        for flag, marker in zip(range(flag_positions.shape[1]), "osD^v", strict=False):
            ax.scatter(
                flag_positions[:, flag],
                np.arange(num_examples),
                s=180,
                marker=marker,
                facecolors="none",
                edgecolors="white",
                linewidths=2,
            )
        ax.set_xticks(range(seq_len))
        ax.set_yticks(range(num_examples))
        ax.set_xlabel("position")
        if head == 0:
            ax.set_ylabel("example")
        ax.set_title(f"head {head}" if num_heads > 1 else "attention weights")
    fig.colorbar(image, ax=axes[0].tolist(), label="weight", fraction=0.05, pad=0.03)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_sweep_lines(points, x_field: str, series_field: str | None, metric: str, path) -> pathlib.Path:
    """`metric` (mean with min-max band) against `x_field`, a line per `series_field` value.

    points: (x, series value or None, {"mean", "min", "max", ...}) per cell.
    """
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    series = sorted(
        {p[1] for p in points}, key=lambda v: (v is None, str(v) if not isinstance(v, (int, float)) else v)
    )
    numeric_x = all(isinstance(p[0], (int, float)) and not isinstance(p[0], bool) for p in points)
    for value in series:
        chosen = sorted((p for p in points if p[1] == value), key=lambda p: p[0] if numeric_x else str(p[0]))
        xs = [p[0] if numeric_x else str(p[0]) for p in chosen]
        means = [p[2]["mean"] for p in chosen]
        label = None if series_field is None else f"{series_field.split('.')[-1]}={value}"
        ax.plot(xs, means, marker="o", label=label)
        ax.fill_between(xs, [p[2]["min"] for p in chosen], [p[2]["max"] for p in chosen], alpha=0.2)
    if numeric_x and all(p[0] > 0 for p in points):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({p[0] for p in points}), labels=[str(x) for x in sorted({p[0] for p in points})])
    ax.set_xlabel(x_field)
    ax.set_ylabel(f"{metric} (mean, min-max band)")
    if series_field is not None:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_sweep_heatmap(values, xs, ys, x_field: str, y_field: str, metric: str, path) -> pathlib.Path:
    """Heatmap of `values` `[len(ys), len(xs)]` (nan = skipped cell), annotated."""
    values = np.asarray(values, dtype=float)
    title = f"{metric} (mean over seeds)"
    width = max(1.6 + 1.0 * len(xs), 1.2 + 0.1 * len(title))  # the title's characters fit
    fig, ax = plt.subplots(figsize=(width, 1.4 + 0.7 * len(ys)))
    image = ax.imshow(np.ma.masked_invalid(values), cmap="viridis", aspect="auto")
    for (row, col), value in np.ndenumerate(values):
        text = "skipped" if np.isnan(value) else f"{value:.3g}"
        ax.text(
            col,
            row,
            text,
            ha="center",
            va="center",
            color="white" if np.isnan(value) else "black",
            fontsize=8,
            bbox={"facecolor": "white", "alpha": 0.6, "linewidth": 0},
        )
    ax.set_xticks(range(len(xs)), labels=[str(x) for x in xs])
    ax.set_yticks(range(len(ys)), labels=[str(y) for y in ys])
    ax.set_xlabel(x_field)
    ax.set_ylabel(y_field)
    ax.set_title(title)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    return _save(fig, path)


def plot_loss_curves(curves: dict, path, title: str = "") -> pathlib.Path:
    """Loss against step on a log scale; `curves` maps a label to (steps, losses)."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for label, (steps, losses) in curves.items():
        ax.plot(steps, losses, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if len(curves) > 1:
        ax.legend(fontsize=7, ncol=2 if len(curves) > 6 else 1)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_attention_maps(maps: dict, query_labels, key_labels, path, title: str = "") -> pathlib.Path:
    """A grid of attention weights, a row per layer and a column per head.

    maps: {layer name: weights `[N, T, S]`}; the labels name the T query and
    S key positions (long label lists are thinned on the axes).
    """
    layers = list(maps)
    num_heads = max(np.shape(w)[0] for w in maps.values())
    T, S = len(query_labels), len(key_labels)
    width = min(max(0.22 * S, 2.0), 4.5)  # inches per panel
    height = min(max(0.22 * T, 1.0), 4.5)
    fig, axes = plt.subplots(
        len(layers),
        num_heads,
        figsize=(0.6 + width * num_heads, 0.8 + (height + 0.4) * len(layers)),
        squeeze=False,
    )
    step_q, step_k = max(1, T // 24), max(1, S // 24)
    for row, layer in enumerate(layers):
        weights = np.asarray(maps[layer], np.float32)
        for head in range(num_heads):
            ax = axes[row][head]
            if head >= weights.shape[0]:
                ax.axis("off")
                continue
            ax.imshow(weights[head], vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
            ax.set_xticks(range(0, S, step_k), labels=key_labels[::step_k], rotation=90, fontsize=6)
            ax.set_yticks(range(0, T, step_q), labels=query_labels[::step_q], fontsize=6)
            ax.set_title(f"{layer} head {head}", fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_head_ablation(increase, path, title: str = "", unit: str = "bits/char") -> pathlib.Path:
    """Each head's ablation cost `[layers, heads]` (the loss increase when its output is
    zeroed) as a grid centred on 0: red = the model is worse without the head."""
    increase = np.asarray(increase, dtype=float).reshape(-1, np.shape(increase)[-1])  # (L, N)
    layers, heads = increase.shape
    limit = max(float(np.abs(increase).max()), 1e-9)
    fig, ax = plt.subplots(figsize=(max(4.5, 1.8 + 0.75 * heads), 1.6 + 0.6 * layers))
    image = ax.imshow(increase, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    for (layer, head), value in np.ndenumerate(increase):
        ax.text(head, layer, f"{value:+.3f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(heads))
    ax.set_yticks(range(layers))
    ax.set(xlabel="head", ylabel="layer")
    ax.set_title(title or "loss increase with the head zeroed", fontsize=9)
    fig.colorbar(image, ax=ax, label=f"+{unit}")
    fig.tight_layout()
    return _save(fig, path)
