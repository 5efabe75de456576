"""What a run keeps of itself: the metrics of each step, and what it hands back.

* :func:`record` appends the metrics of the steps trained to a run's history
  (which its checkpoints keep and :func:`~gradtools.demo.plot.plot_history`
  draws);
* :class:`RunResult` holds what every demo's ``train_and_evaluate`` returns;
  each demo's ``Result`` adds its own fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["RunResult", "record"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
    """What every demo's ``train_and_evaluate`` returns.

    Attributes:
      step: how far the run trained, in the unit its checkpoints count.
      history: ``{'step': [...], metric: [...], ...}``, the metrics of each
        step, and a sub-dict of the metrics taken now and then (per epoch,
        per evaluation) with its own ``'step'`` list, as
        :func:`~gradtools.demo.plot.plot_history` takes them.
      checkpoint: the directory of the last checkpoint written, or ``None``.
      plot: the PNG written, or ``None``.
    """

    step: int
    history: dict[str, Any]
    checkpoint: str | None
    plot: str | None


def record(
    history: dict[str, Any],
    recorded: list[tuple[int, dict[str, jax.Array]]],
    keys: Callable[[str], bool],
) -> None:
    """Appends the metrics of the steps trained, those whose key ``keys`` accepts, to ``history``.

    Waits for the steps' results; ``history['step']`` gets their steps.
    """
    steps, records = zip(*jax.device_get(recorded)) if recorded else ((), ())
    history["step"].extend(steps)
    for key in records[0] if records else ():
        if keys(key):
            history.setdefault(key, []).extend(float(r[key]) for r in records)
