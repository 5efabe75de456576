"""One training step: scaled gradients, update, apply, metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from gradtools import _checks
from gradtools.loss_scale import scale_loss
from gradtools.metrics import metrics

__all__ = ["train_step"]


def train_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    *,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, optax.OptState, dict[str, Any]]]:
    """Builds ``step(params, opt_state, *args, **kwargs)`` for a loss function.

    The step computes::

      loss = loss_fn(params, *args, **kwargs)
      grads = grad(scale_loss(loss, opt_state))   # unscaled if no loss scaler
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)

    and returns ``(params, opt_state, metrics)``, where ``metrics`` holds the
    *unscaled* ``loss`` (plus ``aux`` with ``has_aux``) and everything
    :func:`gradtools.metrics` reads from the new ``opt_state``. The loss is
    scaled only when ``opt_state`` holds a loss-scale state. The step is a pure
    function: ``jax.jit`` it, donating params and state.

    Args:
      loss_fn: ``loss_fn(params, *args, **kwargs) -> loss`` (or
        ``(loss, aux)`` with ``has_aux``); ``loss`` is a scalar.
      tx: the optimizer, e.g. ``gradtools.dynamic_loss_scale(optax.adam(1e-3))``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
      The step function.

    Raises:
      TypeError: if ``loss_fn`` is not callable or ``tx`` is not a
        GradientTransformation.
      ValueError: if ``has_aux`` is not a bool.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> tx = gradtools.dynamic_loss_scale(optax.sgd(0.5))
      >>> step = jax.jit(gradtools.train_step(lambda p, x: jnp.sum((p * x) ** 2), tx))
      >>> params = jnp.ones(2)
      >>> params, state, m = step(params, tx.init(params), jnp.ones(2))
      >>> params, m['loss']
      (Array([0., 0.], dtype=float32), Array(2., dtype=float32))

    References:
      MindSpore ``TrainOneStepWithLossScaleCell`` (``TrainOneStepCell``
      without a loss scaler).
    """
    if not callable(loss_fn):
        raise TypeError(f"{loss_fn=} must be callable: loss_fn(params, *args) -> loss")
    _checks.is_transform("tx", tx)
    _checks.is_bool("has_aux", has_aux)

    def step(params, opt_state, *args, **kwargs):
        scaled = bool(optax.tree.get_all_with_path(opt_state, "LossScaleState"))

        def objective(p):
            out = loss_fn(p, *args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            return (scale_loss(loss, opt_state) if scaled else loss), (loss, aux)

        grads, (loss, aux) = jax.grad(objective, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        out = {"loss": loss, **metrics(opt_state)}
        if has_aux:
            out["aux"] = aux
        return params, opt_state, out

    return step
