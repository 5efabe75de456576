"""A PNG of a demo run: one panel per metric (loss, accuracy, learning rate, ...)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

__all__ = ["Panel", "plot_history"]


class Panel(NamedTuple):
    """One panel of :func:`plot_history`.

    Attributes:
      keys: the series drawn in it. A key of ``history`` is drawn as a line
        against ``history['step']``; a key of one of its sub-dicts (such as
        ``history['epoch']``) with dots against that sub-dict's ``'step'``; a
        key ending in ``/`` stands for every key of ``history`` it begins.
      label: the y-axis label.
      log: whether the y axis is logarithmic.
    """

    keys: tuple[str, ...]
    label: str
    log: bool = False


def _series(history: dict[str, Any], key: str) -> list[tuple[str, list[Any], list[Any], bool]]:
    """``(name, steps, values, per_step)`` of each series ``key`` stands for."""
    if key.endswith("/"):
        names = sorted(k for k in history if k.startswith(key))
        return [(k[len(key) :], history["step"], history[k], True) for k in names]
    if key in history:
        return [(key, history["step"], history[key], True)]
    for sub in history.values():
        if isinstance(sub, dict) and key in sub:
            return [(key, sub["step"], sub[key], False)]
    return []


def plot_history(
    history: dict[str, Any],
    path: str | os.PathLike[str],
    panels: Sequence[Panel],
    title: str,
    xlabel: str,
) -> str:
    """Draws ``history`` against the step and writes it to ``path`` as a PNG.

    Uses matplotlib's Agg canvas directly, so it works without a display and
    leaves pyplot's global state alone. A panel none of whose keys is in
    ``history`` (a transform the run did not use) says so.

    Args:
      history: ``{'step': [...], key: [...], 'epoch': {'step': [...], key:
        [...]}}`` as the demos' training loops record it: per-step metrics,
        and sub-dicts of metrics taken now and then (per epoch, per evaluation).
      path: the PNG to write; its directory must exist.
      panels: what to draw, top to bottom.
      title: the figure's title.
      xlabel: the x-axis label.

    Returns:
      The absolute path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 2.2 * len(panels)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels):
        ax.set_ylabel(panel.label)
        ax.grid(alpha=0.3)
        series = [s for key in panel.keys for s in _series(history, key)]
        for name, steps, values, per_step in series:
            ax.plot(steps, values, lw=0.8 if per_step else 1.2, marker=None if per_step else "o")
            ax.lines[-1].set_label(name)
        if len(series) > 1:
            ax.legend(loc="upper right", fontsize="small")
        if not series:
            ax.text(
                0.5,
                0.5,
                "not used in this run",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="gray",
            )
        elif panel.log:
            ax.set_yscale("log")
    axes[-1].set_xlabel(xlabel)
    fig.suptitle(title)
    path = os.path.abspath(path)
    fig.savefig(path, dpi=100)
    return path
