"""Learning-rate schedules that give MindSpore's values, as optax schedules.

Every schedule here is an optax ``Schedule``: a jit-able function from the step
(an int32 count, traced or not) to a float32 scalar, so it can be passed
straight to any optax optimizer, ``optax.sgd(gradtools.schedules.cosine_decay(
1e-4, 1e-2, 1000))``. The values equal those of MindSpore's
``nn.learning_rate_schedule`` classes (a schedule of the step) and, through
:func:`per_epoch` and :func:`to_list`, of its ``nn.dynamic_lr`` list functions
(a list with one value per step, constant within an epoch)::

    to_list(per_epoch(exponential_decay(lr, rate, decay_epoch, staircase=s),
                      step_per_epoch), total_step)
    == exponential_decay_lr(lr, rate, total_step, step_per_epoch, decay_epoch, s)

except ``piecewise_constant_lr(milestone, values)``, whose milestones count
steps: it is ``to_list(piecewise_constant(milestone, values), milestone[-1])``.

.. list-table:: MindSpore, optax and PyTorch spellings
   :header-rows: 1

   * - gradtools
     - MindSpore ``nn.dynamic_lr`` / ``nn.learning_rate_schedule``
     - closest optax / PyTorch (``torch.optim.lr_scheduler``)
   * - ``piecewise_constant(milestones, values)``
     - ``piecewise_constant_lr(milestone, learning_rates)``
     - optax ``piecewise_constant_schedule`` / ``MultiStepLR`` (both multiply
       at each boundary instead of listing values)
   * - ``exponential_decay(lr, rate, decay_steps, staircase=s)``
     - ``exponential_decay_lr`` / ``ExponentialDecayLR``
     - optax ``exponential_decay(lr, decay_steps, rate, staircase=s)`` /
       ``ExponentialLR`` (``decay_steps=1``), ``StepLR`` (staircase)
   * - ``natural_exp_decay(lr, rate, decay_steps, staircase=s)``
     - ``natural_exp_decay_lr`` / ``NaturalExpDecayLR``
     - optax ``exponential_decay(lr, 1, exp(-rate))`` / ``ExponentialLR(gamma=exp(-rate))``
       (without staircase)
   * - ``inverse_time_decay(lr, rate, decay_steps, staircase=s)``
     - ``inverse_decay_lr`` / ``InverseDecayLR``
     - none / ``LambdaLR(lambda t: 1 / (1 + rate * t / decay_steps))``
   * - ``cosine_decay(min_lr, max_lr, decay_steps)``
     - ``cosine_decay_lr`` / ``CosineDecayLR``
     - optax ``cosine_decay_schedule(max_lr, decay_steps, alpha=min_lr / max_lr)`` /
       ``CosineAnnealingLR(T_max=decay_steps, eta_min=min_lr)`` (until ``T_max``)
   * - ``polynomial_decay(lr, end_lr, decay_steps, power, update_decay_steps=u)``
     - ``polynomial_decay_lr`` / ``PolynomialDecayLR``
     - optax ``polynomial_schedule(lr, end_lr, power, decay_steps)`` /
       ``PolynomialLR`` (``end_lr=0``); neither has ``update_decay_steps``
   * - ``warmup(lr, warmup_steps)``
     - ``warmup_lr`` / ``WarmUpLR``
     - optax ``linear_schedule(0, lr, warmup_steps)`` / ``LinearLR`` (whose
       ``start_factor`` must be > 0)
   * - ``with_warmup(schedule, warmup_steps, init_value)``
     - ``warmup_lr(...) + cosine_decay_lr(...)`` (list concatenation)
     - optax ``join_schedules``, ``warmup_cosine_decay_schedule`` /
       ``SequentialLR([LinearLR, ...])``
   * - ``per_epoch(schedule, steps_per_epoch)``
     - the ``step_per_epoch`` and ``*_epoch`` arguments of ``nn.dynamic_lr``
     - none / calling ``scheduler.step()`` once per epoch
   * - ``to_list(schedule, total_steps)``
     - the lists ``nn.dynamic_lr`` returns
     - none
   * - ``from_list(values)``
     - a list passed as ``learning_rate=`` to an ``nn.Optimizer``
     - none / ``LambdaLR`` over a list

Step counting: an optax optimizer calls its schedule with its own count of
*applied* updates. Inside :func:`gradtools.dynamic_loss_scale` a skipped
(non-finite) step leaves the inner state, and so that count, unchanged: the
schedule does not advance. Inside ``gradtools.accumulate(inner, k)`` the inner
optimizer runs once per window, so the schedule advances once per ``k``
micro-batches: count ``decay_steps`` in optimizer updates.

To read the learning rate, build the optimizer with
``optax.inject_hyperparams``; :func:`gradtools.metrics` then reports the rate
the last applied update used (``schedule(0)`` before the first)::

    tx = gradtools.dynamic_loss_scale(
        optax.inject_hyperparams(optax.sgd)(learning_rate=schedule))
    gradtools.metrics(opt_state)['learning_rate']

The hyperparameter takes the params' dtype; with bf16 params pass
``hyperparam_dtype=jnp.float32`` to ``inject_hyperparams``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradtools import _checks

__all__ = [
    "cosine_decay",
    "exponential_decay",
    "from_list",
    "inverse_time_decay",
    "natural_exp_decay",
    "per_epoch",
    "piecewise_constant",
    "polynomial_decay",
    "to_list",
    "warmup",
    "with_warmup",
]


def _f32(x: Any) -> jax.Array:
    return jnp.asarray(x).astype(jnp.float32)


def _is_schedule(name: str, value: Any) -> None:
    if not callable(value):
        raise TypeError(f"{name}={value!r} must be a schedule: a callable step -> value")


def _check_decay(learning_rate: Any, decay_rate: Any, decay_steps: Any, staircase: Any) -> None:
    _checks.finite_non_negative("learning_rate", learning_rate)
    _checks.finite_positive("decay_rate", decay_rate)
    _checks.positive_int("decay_steps", decay_steps)
    _checks.is_bool("staircase", staircase)


def _progress(step: Any, decay_steps: Any, staircase: bool) -> jax.Array:
    """``step / decay_steps`` in float32, floored with ``staircase``."""
    step = jnp.asarray(step)
    if staircase:
        return _f32(step // decay_steps)
    return _f32(step) / decay_steps


def piecewise_constant(milestones: Sequence[int], values: Sequence[float]) -> optax.Schedule:
    """A constant value on each interval between milestones.

    ``schedule(step) = values[t]`` for ``milestones[t-1] <= step < milestones[t]``,
    counting from 0 before the first milestone. The last value also holds past
    the last milestone, which is only the length of MindSpore's list.

    Args:
      milestones: non-decreasing ints > 0, one per value.
      values: the learning rates; finite, >= 0.

    Returns:
      The schedule.

    Raises:
      TypeError: if ``milestones`` or ``values`` is not a sequence.
      ValueError: if the lengths differ or are 0, a milestone is not an int
        > 0 or is smaller than the one before, or a value is negative or not finite.

    Example:
      >>> s = gradtools.schedules.piecewise_constant([2, 5, 10], [0.1, 0.05, 0.01])
      >>> [round(float(s(i)), 8) for i in (0, 1, 2, 4, 5, 9, 12)]
      [0.1, 0.1, 0.05, 0.05, 0.01, 0.01, 0.01]

    References:
      MindSpore ``nn.piecewise_constant_lr``.
    """
    for name, seq in (("milestones", milestones), ("values", values)):
        if isinstance(seq, (str, bytes)) or not np.iterable(seq):
            raise TypeError(f"{name}={seq!r} must be a sequence (a list or a 1-D array)")
    milestones, values = list(milestones), list(values)
    if not milestones or len(milestones) != len(values):
        raise ValueError(
            f"milestones={milestones} and values={values} must be non-empty and of one length"
        )
    for t, m in enumerate(milestones):
        _checks.positive_int(f"milestones[{t}]", m)
        if t and m < milestones[t - 1]:
            raise ValueError(f"{milestones=} must not decrease (milestones[{t}]={m})")
    for t, v in enumerate(values):
        _checks.finite_non_negative(f"values[{t}]", v)
    bounds = np.asarray(milestones[:-1], np.int32)
    table = np.asarray(values, np.float32)

    def schedule(step):
        return jnp.asarray(table)[jnp.searchsorted(bounds, jnp.asarray(step), side="right")]

    return schedule


def exponential_decay(
    learning_rate: float, decay_rate: float, decay_steps: int, *, staircase: bool = False
) -> optax.Schedule:
    """Multiplies the rate by ``decay_rate`` every ``decay_steps`` steps.

    ``schedule(step) = learning_rate * decay_rate ** p`` with
    ``p = step / decay_steps``, or ``floor(step / decay_steps)`` with ``staircase``.

    Args:
      learning_rate: the rate at step 0; finite, >= 0.
      decay_rate: the factor per ``decay_steps``; finite, > 0.
      decay_steps: steps per factor; an int >= 1.
      staircase: decay in whole steps of ``decay_steps``.

    Returns:
      The schedule.

    Raises:
      ValueError: if ``learning_rate < 0``, ``decay_rate <= 0`` (or either is
        not finite), ``decay_steps`` is not an int >= 1 or ``staircase`` is not a bool.

    Example:
      >>> s = gradtools.schedules.exponential_decay(0.1, 0.9, 4)
      >>> round(float(s(2)), 8)
      0.09486833

    References:
      MindSpore ``nn.ExponentialDecayLR`` and ``nn.exponential_decay_lr``.
    """
    _check_decay(learning_rate, decay_rate, decay_steps, staircase)
    log_rate = jnp.log(decay_rate) if _checks.traced(decay_rate) else math.log(decay_rate)

    def schedule(step):
        return _f32(learning_rate * jnp.exp(log_rate * _progress(step, decay_steps, staircase)))

    return schedule


def natural_exp_decay(
    learning_rate: float, decay_rate: float, decay_steps: int, *, staircase: bool = False
) -> optax.Schedule:
    """Multiplies the rate by ``exp(-decay_rate)`` every step, as MindSpore's code does.

    ``schedule(step) = learning_rate * exp(-decay_rate * p)`` with ``p = step``,
    or ``p = floor(step / decay_steps) * decay_steps`` with ``staircase``: so
    ``decay_steps`` matters only with ``staircase``. This is what MindSpore's
    ``NaturalExpDecayLR`` and ``natural_exp_decay_lr`` compute; the class's
    docstring states ``p = step / decay_steps`` instead. For that formula (also
    TensorFlow's ``natural_exp_decay``), pass ``decay_rate / decay_steps``.

    Args:
      learning_rate: the rate at step 0; finite, >= 0.
      decay_rate: the decay per step; finite, > 0.
      decay_steps: the stair width with ``staircase``; an int >= 1.
      staircase: decay in whole steps of ``decay_steps``.

    Returns:
      The schedule.

    Raises:
      ValueError: if ``learning_rate < 0``, ``decay_rate <= 0`` (or either is
        not finite), ``decay_steps`` is not an int >= 1 or ``staircase`` is not a bool.

    Example:
      >>> s = gradtools.schedules.natural_exp_decay(0.1, 0.5, 4, staircase=True)
      >>> [round(float(s(i)), 8) for i in (3, 4)]  # 0.1 * exp(-0.5 * 4)
      [0.1, 0.01353353]

    References:
      MindSpore ``nn.NaturalExpDecayLR`` and ``nn.natural_exp_decay_lr`` (code).
    """
    _check_decay(learning_rate, decay_rate, decay_steps, staircase)

    def schedule(step):
        step = jnp.asarray(step)
        p = _f32((step // decay_steps) * decay_steps if staircase else step)
        return _f32(learning_rate * jnp.exp(-decay_rate * p))

    return schedule


def inverse_time_decay(
    learning_rate: float, decay_rate: float, decay_steps: int, *, staircase: bool = False
) -> optax.Schedule:
    """Divides the rate by ``1 + decay_rate * step / decay_steps``.

    ``schedule(step) = learning_rate / (1 + decay_rate * p)`` with
    ``p = step / decay_steps``, or ``floor(step / decay_steps)`` with ``staircase``.

    Args:
      learning_rate: the rate at step 0; finite, >= 0.
      decay_rate: finite, > 0.
      decay_steps: an int >= 1.
      staircase: decay in whole steps of ``decay_steps``.

    Returns:
      The schedule.

    Raises:
      ValueError: if ``learning_rate < 0``, ``decay_rate <= 0`` (or either is
        not finite), ``decay_steps`` is not an int >= 1 or ``staircase`` is not a bool.

    Example:
      >>> s = gradtools.schedules.inverse_time_decay(0.1, 0.5, 1)
      >>> [round(float(s(i)), 8) for i in range(4)]
      [0.1, 0.06666667, 0.05, 0.04]

    References:
      MindSpore ``nn.InverseDecayLR`` and ``nn.inverse_decay_lr``.
    """
    _check_decay(learning_rate, decay_rate, decay_steps, staircase)

    def schedule(step):
        return _f32(learning_rate / (1.0 + decay_rate * _progress(step, decay_steps, staircase)))

    return schedule


def cosine_decay(min_lr: float, max_lr: float, decay_steps: int) -> optax.Schedule:
    """Half a cosine from ``max_lr`` down to ``min_lr``, then ``min_lr``.

    ``schedule(step) = min_lr + 0.5 * (max_lr - min_lr) * (1 + cos(pi * p / decay_steps))``
    with ``p = min(step, decay_steps)``. It is evaluated as
    ``min_lr + (max_lr - min_lr) * sin(pi/2 * (decay_steps - p) / decay_steps) ** 2``,
    which is the same number without float32 cancellation near the end.

    Args:
      min_lr: the final rate; finite, >= 0.
      max_lr: the rate at step 0; finite, > ``min_lr``.
      decay_steps: steps to decay over; an int >= 1.

    Returns:
      The schedule.

    Raises:
      ValueError: if ``min_lr < 0``, ``max_lr`` is not finite,
        ``min_lr >= max_lr`` or ``decay_steps`` is not an int >= 1.

    Example:
      >>> s = gradtools.schedules.cosine_decay(0.01, 0.1, 4)
      >>> [round(float(s(i)), 7) for i in (0, 2, 4, 9)]  # GPUs' cos: 0.055000007
      [0.1, 0.055, 0.01, 0.01]

    References:
      Loshchilov & Hutter, `SGDR: Stochastic Gradient Descent with Warm Restarts
      <https://arxiv.org/abs/1608.03983>`_, 2017. MindSpore ``nn.CosineDecayLR``
      and ``nn.cosine_decay_lr``.
    """
    _checks.finite_non_negative("min_lr", min_lr)
    _checks.finite_positive("max_lr", max_lr)
    _checks.positive_int("decay_steps", decay_steps)
    if not (_checks.traced(min_lr) or _checks.traced(max_lr)) and float(min_lr) >= float(max_lr):
        raise ValueError(f"{min_lr=} must be < {max_lr=}")

    def schedule(step):
        left = _f32(decay_steps - jnp.minimum(jnp.asarray(step), decay_steps)) / decay_steps
        return _f32(min_lr + (max_lr - min_lr) * jnp.sin(0.5 * math.pi * left) ** 2)

    return schedule


def polynomial_decay(
    learning_rate: float,
    end_learning_rate: float,
    decay_steps: int,
    power: float = 1.0,
    *,
    update_decay_steps: bool = False,
) -> optax.Schedule:
    """A polynomial from ``learning_rate`` to ``end_learning_rate``.

    ``schedule(step) = (learning_rate - end_learning_rate) * (1 - p / d) ** power
    + end_learning_rate`` with ``p = min(step, decay_steps)`` and
    ``d = decay_steps``. With ``update_decay_steps``, ``p = step`` and
    ``d = decay_steps * max(ceil(step / decay_steps), 1)``: each time the end is
    reached, the decay starts over towards a later end, from a lower value.

    Args:
      learning_rate: the rate at step 0; finite, >= 0.
      end_learning_rate: the final rate; finite, >= 0.
      decay_steps: steps to decay over; an int >= 1.
      power: the exponent; finite, > 0. 1.0 is linear.
      update_decay_steps: extend ``d`` past the end, as above.

    Returns:
      The schedule.

    Raises:
      ValueError: if ``learning_rate < 0``, ``end_learning_rate < 0``,
        ``power <= 0`` (or any is not finite), ``decay_steps`` is not an int >= 1
        or ``update_decay_steps`` is not a bool.

    Example:
      >>> s = gradtools.schedules.polynomial_decay(0.1, 0.01, 4, 0.5)
      >>> [round(float(s(i)), 8) for i in (0, 2, 4, 9)]
      [0.1, 0.07363961, 0.01, 0.01]

    References:
      MindSpore ``nn.PolynomialDecayLR`` and ``nn.polynomial_decay_lr``.
    """
    _checks.finite_non_negative("learning_rate", learning_rate)
    _checks.finite_non_negative("end_learning_rate", end_learning_rate)
    _checks.positive_int("decay_steps", decay_steps)
    _checks.finite_positive("power", power)
    _checks.is_bool("update_decay_steps", update_decay_steps)

    def schedule(step):
        step = jnp.asarray(step)
        if update_decay_steps:
            # d = decay_steps * max(ceil(step / decay_steps), 1), through d - step,
            # which cannot overflow int32 as d can near 2**31
            gap = jnp.where(step > 0, (-step) % decay_steps, decay_steps - step)
            left = _f32(gap) / (_f32(step) + _f32(gap))
        else:
            step = jnp.minimum(step, decay_steps)
            left = _f32(decay_steps - step) / _f32(decay_steps)
        return _f32((learning_rate - end_learning_rate) * left**power + end_learning_rate)

    return schedule


def warmup(learning_rate: float, warmup_steps: int) -> optax.Schedule:
    """Rises linearly from 0 to ``learning_rate``, then holds.

    ``schedule(step) = learning_rate * min(step, warmup_steps) / warmup_steps``.
    To warm up into another schedule, use :func:`with_warmup`.

    Args:
      learning_rate: the rate from ``warmup_steps`` on; finite, >= 0.
      warmup_steps: an int >= 1.

    Returns:
      The schedule.

    Raises:
      ValueError: if ``learning_rate`` is negative or not finite, or
        ``warmup_steps`` is not an int >= 1.

    Example:
      >>> s = gradtools.schedules.warmup(0.1, 2)
      >>> [round(float(s(i)), 8) for i in range(4)]
      [0.0, 0.05, 0.1, 0.1]

    References:
      Goyal et al., `Accurate, Large Minibatch SGD
      <https://arxiv.org/abs/1706.02677>`_, 2017. MindSpore ``nn.WarmUpLR`` and
      ``nn.warmup_lr``.
    """
    _checks.finite_non_negative("learning_rate", learning_rate)
    _checks.positive_int("warmup_steps", warmup_steps)

    def schedule(step):
        return _f32(learning_rate * (_f32(jnp.minimum(step, warmup_steps)) / warmup_steps))

    return schedule


def with_warmup(
    schedule: optax.Schedule, warmup_steps: int, init_value: float = 0.0
) -> optax.Schedule:
    """Warms up linearly into ``schedule``, which then starts from its step 0.

    ``out(step) = init_value + (schedule(0) - init_value) * step / warmup_steps``
    for ``step < warmup_steps``, else ``schedule(step - warmup_steps)``. With
    ``init_value=0`` the first ``warmup_steps`` values are MindSpore's
    ``warmup_lr(schedule(0), warmup_steps, 1, warmup_steps)``.

    Args:
      schedule: any schedule (``step -> value``), e.g. :func:`cosine_decay`.
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
        frac = _f32(jnp.minimum(step, warmup_steps)) / warmup_steps
        rising = init_value + (_f32(schedule(0)) - init_value) * frac
        after = _f32(schedule(jnp.maximum(step - warmup_steps, 0)))
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
        return _f32(schedule(jnp.asarray(step) // steps_per_epoch))

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
