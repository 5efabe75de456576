"""A flax ``TrainState`` whose ``apply_gradients`` takes ``tx.update``'s extra arguments.

This is the one module that imports flax; ``gradtools.TrainState`` imports it
on first use, so the rest of gradtools needs only jax, optax and numpy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax.training import train_state

from gradtools import _checks
from gradtools.training import apply_gradients

__all__ = ["TrainState"]


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` stepping through :func:`gradtools.apply_gradients`.

    Everything but :meth:`apply_gradients` is flax's: build it with
    ``TrainState.create(apply_fn=..., params=..., tx=...)``, subclass it to
    add fields (``batch_stats``), checkpoint it as usual. Its
    ``apply_gradients`` computes::

      params, opt_state = gradtools.apply_gradients(
          tx, grads, opt_state, params, **update_kwargs)
      step = step + 1

    so it takes ``tx.update``'s extra arguments (:func:`gradtools.accumulate`'s
    ``flush`` and ``weight``, ``value`` for ``optax.contrib.reduce_on_plateau``)
    and a loss scaler applies the updates inside its skip branch. As in flax,
    ``params`` may hold fp8 meta (``_overwrite_with_gradient`` beside
    ``params``): ``tx`` steps on ``params['params']`` and the meta takes the
    gradients' values (:func:`gradtools.apply_gradients` says how).

    ``step`` counts calls, skipped steps and accumulation micro-steps
    included; the optimizer's own count, which its schedules read, counts the
    applied updates.

    Attributes:
      step: the number of ``apply_gradients`` calls (int).
      apply_fn: usually ``model.apply`` (not a pytree node).
      params: the parameters.
      tx: the optimizer, e.g. ``gradtools.dynamic_loss_scale(optax.adam(1e-3))``
        (not a pytree node).
      opt_state: ``tx``'s state.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> tx = gradtools.accumulate(optax.sgd(1.0), every_k=4)
      >>> state = gradtools.TrainState.create(
      ...     apply_fn=None, params={'w': jnp.zeros(2)}, tx=tx)
      >>> grads = {'w': jnp.ones(2)}
      >>> state = state.apply_gradients(grads=grads)   # a micro-step: no update
      >>> state = state.apply_gradients(grads=grads, update_kwargs={'flush': True})
      >>> state.params['w'], int(state.step)
      (Array([-1., -1.], dtype=float32), 2)

    References:
      flax ``flax.training.train_state.TrainState``.
    """

    def apply_gradients(
        self, *, grads: Any, update_kwargs: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> TrainState:
        """One optimizer step: new ``params`` and ``opt_state``, ``step + 1``, ``kwargs`` replaced.

        Args:
          grads: gradients with the structure of ``params`` (scaled by
            :func:`gradtools.scale_loss` when ``tx`` holds a loss scaler).
          update_kwargs: extra arguments for ``tx.update``, e.g.
            ``{'flush': True}`` to close a partial accumulation window; a traced
            value does not recompile a jitted step. Default: none.
          **kwargs: other fields to ``replace``, as in flax (e.g.
            ``batch_stats=...``).

        Returns:
          The new state.

        Raises:
          TypeError: if ``update_kwargs`` is not a dict.
        """
        _checks.update_kwargs(update_kwargs)
        # fp8 meta (flax's _overwrite_with_gradient) is handled there: tx steps on
        # params['params'], the meta takes the gradients' values
        params, opt_state = apply_gradients(
            self.tx, grads, self.opt_state, self.params, **(update_kwargs or {})
        )
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **kwargs)
