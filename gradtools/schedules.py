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

The MindSpore, optax and PyTorch spellings of each are tabled on the
schedules page of the docs (``docs/api/schedules.md``).

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
``hyperparam_dtype=jnp.float32`` to ``inject_hyperparams``. It calls every
callable argument with the step count, as a schedule: name a weight-decay
mask in ``static_args``, as in ``optax.inject_hyperparams(optax.adamw,
static_args=('mask',))(learning_rate=schedule, mask=gradtools.decay_mask)``.
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
from gradtools import _tree
from gradtools.schedule_lists import from_list
from gradtools.schedule_lists import per_epoch
from gradtools.schedule_lists import to_list
from gradtools.schedule_lists import with_warmup

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


def _check_decay(learning_rate: Any, decay_rate: Any, decay_steps: Any, staircase: Any) -> None:
    _checks.finite_non_negative("learning_rate", learning_rate)
    _checks.finite_positive("decay_rate", decay_rate)
    _checks.positive_int("decay_steps", decay_steps)
    _checks.is_bool("staircase", staircase)


def _progress(step: Any, decay_steps: Any, staircase: bool) -> jax.Array:
    """``step / decay_steps`` in float32, floored with ``staircase``."""
    step = jnp.asarray(step)
    if staircase:
        return _tree.f32(step // decay_steps)
    return _tree.f32(step) / decay_steps


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
        return _tree.f32(
            learning_rate * jnp.exp(log_rate * _progress(step, decay_steps, staircase))
        )

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
        p = _tree.f32((step // decay_steps) * decay_steps if staircase else step)
        return _tree.f32(learning_rate * jnp.exp(-decay_rate * p))

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
        return _tree.f32(
            learning_rate / (1.0 + decay_rate * _progress(step, decay_steps, staircase))
        )

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
        left = _tree.f32(decay_steps - jnp.minimum(jnp.asarray(step), decay_steps)) / decay_steps
        return _tree.f32(min_lr + (max_lr - min_lr) * jnp.sin(0.5 * math.pi * left) ** 2)

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
            left = _tree.f32(gap) / (_tree.f32(step) + _tree.f32(gap))
        else:
            step = jnp.minimum(step, decay_steps)
            left = _tree.f32(decay_steps - step) / _tree.f32(decay_steps)
        return _tree.f32((learning_rate - end_learning_rate) * left**power + end_learning_rate)

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
        return _tree.f32(
            learning_rate * (_tree.f32(jnp.minimum(step, warmup_steps)) / warmup_steps)
        )

    return schedule
