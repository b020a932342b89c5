"""Pictures of attention (matplotlib, Agg backend; imported only when plotting)."""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

__all__ = ["plot_flag_attention"]


def plot_flag_attention(weights, flag_positions, path, title: str = "") -> pathlib.Path:
    """Heatmap of attention weights `[examples, heads, S]`, one panel per head.

    Each row is one example; white markers show its flagged positions (a ring
    for flag 0, a square for flag 1, ...).
    """
    weights = np.asarray(weights, np.float32)
    flag_positions = np.asarray(flag_positions).reshape(len(weights), -1)
    num_examples, num_heads, seq_len = weights.shape
    fig, axes = plt.subplots(
        1, num_heads, figsize=(1.2 + 0.55 * seq_len * num_heads, 0.9 + 0.4 * num_examples),
        squeeze=False,
    )
    for head, ax in enumerate(axes[0]):
        image = ax.imshow(weights[:, head, :], vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        for flag, marker in zip(range(flag_positions.shape[1]), "osD^v"):
            ax.scatter(flag_positions[:, flag], np.arange(num_examples), s=180, marker=marker,
                       facecolors="none", edgecolors="white", linewidths=2)
        ax.set_xticks(range(seq_len))
        ax.set_yticks(range(num_examples))
        ax.set_xlabel("position")
        if head == 0:
            ax.set_ylabel("example")
        ax.set_title(f"head {head}" if num_heads > 1 else "attention weights")
    fig.colorbar(image, cax=fig.add_axes([0.87, 0.2, 0.025, 0.62]), label="weight")
    if title:
        fig.suptitle(title)
    fig.subplots_adjust(left=0.12, right=0.84, bottom=0.2, top=0.82, wspace=0.25)
    path = pathlib.Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
