"""The gradtools optimizer of a LeNet-5 demo run, built from its :class:`Config`.

Every gradtools transform has its place in the chain::

  freeze(                            # --freeze: zero updates, no state
    accumulate(                      # --accum-steps: add micro-batch gradients
      dynamic_loss_scale(            # --loss-scale: unscale, skip a non-finite window
        chain(clip_by_global_norm,   # --clip-norm
              inject_hyperparams(sgd | adam | adamw)(learning_rate=schedule))),
      every_k),
    patterns)

``freeze`` is outermost, so nothing inside it sees the frozen gradients: the
buffer holds no copy of them, the loss scaler does not check them, and XLA
drops the backward pass that only they need. The loss scaler sits inside
``accumulate``, so an overflow in any micro-batch skips its whole window and
backs the scale off once (MindSpore's ``accu_overflow``);
``inject_hyperparams`` puts the learning rate where ``gradtools.metrics``
finds it.
"""

from __future__ import annotations

import math
from typing import Any

import optax

import gradtools
from gradtools.demo.lenet.config import Config

__all__ = ["make_optimizer"]


def _schedule(config: Config, total_updates: int) -> Any:
    """The learning rate: a float, or a gradtools schedule over ``total_updates``."""
    lr, warm, name = config.learning_rate, config.warmup_steps, config.schedule
    if name == "constant" and not warm:
        return lr
    s = gradtools.schedules
    n = max(total_updates - warm, 1)  # the steps after warmup
    if name == "warmup":
        return s.warmup(lr, warm)
    schedule = {
        "constant": lambda: optax.constant_schedule(lr),
        "piecewise_constant": lambda: s.piecewise_constant(
            [max(n // 2, 1), max(3 * n // 4, 2), max(n, 3)], [lr, lr / 10, lr / 100]
        ),
        "exponential_decay": lambda: s.exponential_decay(lr, 0.1, n),
        "natural_exp_decay": lambda: s.natural_exp_decay(lr, math.log(10) / n, 1),
        "inverse_time_decay": lambda: s.inverse_time_decay(lr, 9.0, n),
        "cosine_decay": lambda: s.cosine_decay(0.0, lr, n),
        "polynomial_decay": lambda: s.polynomial_decay(lr, lr / 100, n),
    }[name]()
    return s.with_warmup(schedule, warm) if warm else schedule


def make_optimizer(config: Config, total_updates: int) -> optax.GradientTransformation:
    """The gradtools optimizer for ``config`` (see the module docstring).

    Args:
      config: the run's settings.
      total_updates: optimizer updates in the whole run, for the schedule.

    Returns:
      The transformation; its ``init`` raises ``ValueError`` when a
      ``--freeze`` pattern matches no parameter.
    """
    lr = _schedule(config, total_updates)
    if config.optimizer == "momentum":
        tx = optax.inject_hyperparams(optax.sgd)(learning_rate=lr, momentum=0.9)
    elif config.optimizer == "adam":
        tx = optax.inject_hyperparams(optax.adam)(learning_rate=lr)
    else:  # no weight decay on biases
        adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))
        tx = adamw(learning_rate=lr, weight_decay=1e-4, mask=gradtools.decay_mask)
    if config.clip_norm is not None:
        tx = optax.chain(gradtools.clip_by_global_norm(config.clip_norm), tx)
    if config.loss_scale == "dynamic":
        tx = gradtools.dynamic_loss_scale(tx)
    elif config.loss_scale == "fixed":
        tx = gradtools.fixed_loss_scale(tx)
    if config.accum_steps > 1:
        tx = gradtools.accumulate(tx, config.accum_steps)
    if config.freeze:
        tx = gradtools.freeze(tx, list(config.freeze))
    return tx
