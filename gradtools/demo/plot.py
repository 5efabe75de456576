"""A PNG of a demo run: loss, test accuracy, learning rate, loss scale, gradient norm."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["plot_history"]

# (history key, y label, log scale)
_PANELS = (
    ("loss", "train loss", True),
    ("test_accuracy", "test accuracy (%)", False),
    ("learning_rate", "learning rate", False),
    ("loss_scale", "loss scale", True),
    ("grad_norm", "gradient norm\n(before clipping,\nof the last update)", False),
)


def plot_history(history: dict[str, Any], path: str | os.PathLike[str]) -> str:
    """Draws ``history`` against the step and writes it to ``path`` as a PNG.

    Uses matplotlib's Agg canvas directly, so it works without a display and
    leaves pyplot's global state alone.

    Args:
      history: ``{'step': [...], key: [...], 'epoch': {'step': [...],
        'train_loss': [...], 'test_accuracy': [...]}}`` as the demo's training
        loop records it; keys of transforms that were not used are absent.
      path: the PNG to write; its directory must exist.

    Returns:
      The absolute path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 11), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(_PANELS), 1, sharex=True)
    steps, epochs = history["step"], history["epoch"]
    for ax, (key, label, log) in zip(axes, _PANELS):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if key == "test_accuracy":
            ax.plot(epochs["step"], epochs[key], "o-", color="C2")
        elif key in history:
            ax.plot(steps, history[key], lw=0.8, color="C0")
            if key == "loss":
                ax.plot(epochs["step"], epochs["train_loss"], "o-", color="C1", label="epoch mean")
                ax.legend(loc="upper right")
        else:
            ax.text(
                0.5,
                0.5,
                "not used in this run",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="gray",
            )
        if log and key in history:
            ax.set_yscale("log")
    axes[-1].set_xlabel("step (micro-batches)")
    fig.suptitle("gradtools LeNet-5 demo")
    path = os.path.abspath(path)
    fig.savefig(path, dpi=100)
    return path
