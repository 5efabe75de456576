"""Schedule combinators: warmup in front, per-epoch steps, and lists of values.

With them every MindSpore ``nn.dynamic_lr`` list function is
``to_list(per_epoch(schedule, steps_per_epoch), total_steps)`` of a
``gradtools.schedules`` formula. They are importable from
``gradtools.schedules`` too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradtools import _checks
from gradtools import _tree


def _is_schedule(name: str, value: Any) -> None:
    if not callable(value):
        raise TypeError(f"{name}={value!r} must be a schedule: a callable step -> value")


__all__ = ["from_list", "per_epoch", "to_list", "with_warmup"]


def with_warmup(
    schedule: optax.Schedule, warmup_steps: int, init_value: float = 0.0
) -> optax.Schedule:
    """Warms up linearly into ``schedule``, which then starts from its step 0.

    ``out(step) = init_value + (schedule(0) - init_value) * step / warmup_steps``
    for ``step < warmup_steps``, else ``schedule(step - warmup_steps)``. With
    ``init_value=0`` the first ``warmup_steps`` values are MindSpore's
    ``warmup_lr(schedule(0), warmup_steps, 1, warmup_steps)``.

    Args:
      schedule: any schedule (``step -> value``), e.g. ``cosine_decay``.
      warmup_steps: an int >= 1.
      init_value: the value at step 0; finite, >= 0.

    Returns:
      The schedule.

    Raises:
      TypeError: if ``schedule`` is not callable.
      ValueError: if ``warmup_steps`` is not an int >= 1, or ``init_value`` is
        negative or not finite.

    Example:
      >>> s = gradtools.schedules.with_warmup(gradtools.schedules.cosine_decay(0.0, 0.1, 2), 2)
      >>> [round(float(s(i)), 7) for i in range(5)]
      [0.0, 0.05, 0.1, 0.05, 0.0]

    References:
      ``optax.warmup_cosine_decay_schedule``; PyTorch ``SequentialLR``.
    """
    _is_schedule("schedule", schedule)
    _checks.positive_int("warmup_steps", warmup_steps)
    _checks.finite_non_negative("init_value", init_value)

    def out(step):
        step = jnp.asarray(step)
        frac = _tree.f32(jnp.minimum(step, warmup_steps)) / warmup_steps
        rising = init_value + (_tree.f32(schedule(0)) - init_value) * frac
        after = _tree.f32(schedule(jnp.maximum(step - warmup_steps, 0)))
        return jnp.where(step < warmup_steps, rising, after).astype(jnp.float32)

    return out


def per_epoch(schedule: optax.Schedule, steps_per_epoch: int) -> optax.Schedule:
    """Evaluates ``schedule`` at the epoch: ``schedule(step // steps_per_epoch)``.

    ``schedule``'s own step arguments (``decay_steps``, ``warmup_steps``) then
    count epochs, as the ``decay_epoch`` arguments of MindSpore's
    ``nn.dynamic_lr`` functions do.

    Args:
      schedule: any schedule of the epoch.
      steps_per_epoch: an int >= 1.

    Returns:
      The schedule of the step.

    Raises:
      TypeError: if ``schedule`` is not callable.
      ValueError: if ``steps_per_epoch`` is not an int >= 1.

    Example:
      >>> s = gradtools.schedules.per_epoch(gradtools.schedules.exponential_decay(0.1, 0.9, 1), 2)
      >>> [round(float(s(i)), 8) for i in range(6)]
      [0.1, 0.1, 0.09, 0.09, 0.081, 0.081]

    References:
      MindSpore ``nn.dynamic_lr`` (``step_per_epoch``).
    """
    _is_schedule("schedule", schedule)
    _checks.positive_int("steps_per_epoch", steps_per_epoch)

    def out(step):
        return _tree.f32(schedule(jnp.asarray(step) // steps_per_epoch))

    return out


def to_list(schedule: optax.Schedule, total_steps: int) -> list[float]:
    """The values of ``schedule`` at steps ``0 .. total_steps - 1``.

    Args:
      schedule: any jit-able schedule.
      total_steps: an int >= 1.

    Returns:
      A list of ``total_steps`` Python floats (float32 values), in the form
      MindSpore's ``nn.dynamic_lr`` functions return.

    Raises:
      TypeError: if ``schedule`` is not callable.
      ValueError: if ``total_steps`` is not an int >= 1.

    Example:
      >>> s = gradtools.schedules.warmup(0.1, 2)
      >>> gradtools.schedules.to_list(gradtools.schedules.per_epoch(s, 2), 6)
      [0.0, 0.0, 0.05000000074505806, 0.05000000074505806, 0.10000000149011612, 0.10000000149011612]

    References:
      MindSpore ``nn.dynamic_lr``.
    """
    _is_schedule("schedule", schedule)
    _checks.positive_int("total_steps", total_steps)
    steps = jnp.arange(int(total_steps), dtype=jnp.int32)
    return np.asarray(jax.jit(jax.vmap(schedule))(steps), np.float32).tolist()


def from_list(values: Sequence[float]) -> optax.Schedule:
    """Looks the step up in ``values``; the last value holds past the end.

    ``schedule(step) = values[min(step, len(values) - 1)]``.

    Args:
      values: one learning rate per step; non-empty, finite, >= 0.

    Returns:
      The schedule.

    Raises:
      ValueError: if ``values`` is empty, not 1-D or not numbers, or a value is
        negative or not finite.

    Example:
      >>> s = gradtools.schedules.from_list([0.5, 0.25, 0.125])
      >>> [round(float(s(i)), 8) for i in (0, 2, 7)]
      [0.5, 0.125, 0.125]

    References:
      A list as ``learning_rate=`` of a MindSpore ``nn.Optimizer``.
    """
    try:
        table = np.asarray(values)
    except (TypeError, ValueError):  # ragged
        raise ValueError(f"values={values!r} must be a non-empty 1-D sequence of numbers") from None
    if table.dtype.kind not in "iuf":
        kind = {"U": "strings", "S": "bytes", "b": "bools", "c": "complex numbers"}
        raise ValueError(
            f"values={values!r} must be a non-empty 1-D sequence of real numbers, not of "
            + kind.get(table.dtype.kind, "other objects")
        )
    table = table.astype(np.float64)
    if table.ndim != 1 or table.size == 0:
        raise ValueError(f"values={values!r} must be a non-empty 1-D sequence")
    with np.errstate(over="ignore"):
        table = table.astype(np.float32)  # the values' dtype: inf where float32 overflows
    if not (np.isfinite(table).all() and (table >= 0).all()):
        raise ValueError(f"values={values!r} must all be finite numbers >= 0 in float32")

    def schedule(step):
        return jnp.asarray(table)[jnp.clip(jnp.asarray(step), 0, table.size - 1).astype(jnp.int32)]

    return schedule
