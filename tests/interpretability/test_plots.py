"""Every picture qkv_jax.plots draws holds all its text: each title, label, tick label and colorbar
label lies inside the figure, as saved."""

import matplotlib
import numpy as np
import pytest

from qkv_jax import plots

LABELS = ["<s>", "The", "keys", "and", "the", "queries"]
RNG = np.random.default_rng(0)


def attention(*shape):
    weights = RNG.random(shape)
    return weights / weights.sum(-1, keepdims=True)


# Each picture with small inputs and long titles and labels, as the reports give them.
PICTURES = {
    "flag attention": lambda path: plots.plot_flag_attention(
        attention(8, 2, 5), RNG.integers(0, 5, (8, 1)), path, title="learned_query attention, after training"
    ),
    "flag attention, one head": lambda path: plots.plot_flag_attention(
        attention(8, 1, 5), RNG.integers(0, 5, (8, 2)), path, title="learned_query attention, after training"
    ),
    "sweep lines": lambda path: plots.plot_sweep_lines(
        [(d_k, heads, {"mean": 0.5, "min": 0.4, "max": 0.6}) for d_k in (4, 8) for heads in (1, 2)],
        "model.d_k",
        "model.num_heads",
        "eval_decode_accuracy",
        path,
    ),
    "sweep heatmap": lambda path: plots.plot_sweep_heatmap(
        [[0.5, np.nan], [0.9, 1.0]],
        [4, 8],
        [1, 2],
        "model.d_k",
        "model.num_heads",
        "eval_decode_accuracy",
        path,
    ),
    "loss curves": lambda path: plots.plot_loss_curves(
        {"training loss": ([0, 10, 20], [2.0, 1.0, 0.5])}, path, title="char_lm (checkpoint step 20)"
    ),
    "attention maps": lambda path: plots.plot_attention_maps(
        {"block 0": attention(2, 6, 6), "block 1": attention(2, 6, 6)}, LABELS, LABELS, path, title="char_lm"
    ),
    "head ablation": lambda path: plots.plot_head_ablation(
        RNG.normal(size=(2, 4)), path, title="validation loss increase with each head zeroed\n(step 20)"
    ),
}


def drawn_texts(fig):
    """The figure's texts that are drawn: visible, not empty, and for tick labels only those of
    ticks inside the axis' view (matplotlib keeps labels of the others, undrawn)."""
    ticks, shown = set(), []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                ticks.update({id(tick.label1), id(tick.label2)})
                if low - 1e-9 * abs(high - low) <= tick.get_loc() <= high + 1e-9 * abs(high - low):
                    shown += [tick.label1, tick.label2]
    texts = [t for t in fig.findobj(matplotlib.text.Text) if id(t) not in ticks] + shown
    return [t for t in texts if t.get_visible() and t.get_text().strip()]


def outside(fig) -> list[str]:
    """The drawn texts whose extent leaves the figure (a pixel of rounding allowed)."""
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)  # the layout runs at draw time
    width, height = fig.bbox.width, fig.bbox.height
    found = []
    for text in drawn_texts(fig):
        box = text.get_window_extent(renderer)
        if box.x0 < -1 or box.y0 < -1 or box.x1 > width + 1 or box.y1 > height + 1:
            found.append(f"{text.get_text()!r} at {tuple(round(float(v)) for v in box.extents)}")
    return found


@pytest.mark.parametrize("name", sorted(PICTURES))
def test_every_text_lies_inside_the_picture(name, tmp_path, monkeypatch):
    """Each picture as `_save` gets it (laid out at draw time, as savefig lays it out)."""
    import matplotlib.pyplot as plt

    drawn = []

    def check(fig, path):
        drawn.append(outside(fig))
        plt.close(fig)
        return path

    monkeypatch.setattr(plots, "_save", check)
    PICTURES[name](tmp_path / "picture.png")
    assert drawn == [[]], f"{name}: text outside the figure: {drawn}"
