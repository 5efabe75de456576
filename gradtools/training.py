"""One training step: scaled gradients, update, apply, metrics."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
import optax

from gradtools import _apply
from gradtools import _checks
from gradtools.loss_scale import scale_loss
from gradtools.metrics import metrics

__all__ = ["apply_gradients", "train_step"]


def apply_gradients(
    tx: optax.GradientTransformation,
    grads: Any,
    opt_state: optax.OptState,
    params: Any,
    **extra_args: Any,
) -> tuple[Any, optax.OptState]:
    """``tx.update`` then ``optax.apply_updates``, in one call: returns the new params and state.

    The result is what these two lines give (to the last bit where XLA fuses
    the additions differently)::

      updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
      params = optax.apply_updates(params, updates)

    Which form runs is decided by ``tx`` itself: a gradtools wrapper
    (:func:`gradtools.dynamic_loss_scale`, :func:`gradtools.fixed_loss_scale`,
    :func:`gradtools.accumulate`, :func:`gradtools.spike_guard`,
    :func:`gradtools.freeze`, :func:`gradtools.param_groups`, one inside the
    other too) carries an update-and-apply form in its ``update``, and then
    the params are updated inside the branch that runs the optimizer: the
    updates never leave it, so XLA needs no parameter-sized buffer for them,
    and a step that runs no optimizer (a skipped step, a micro-step, a frozen
    group) returns the params as they were. Any other ``tx`` (an
    ``optax.chain``, ``optax.inject_hyperparams`` or a wrapper of your own,
    even around a gradtools wrapper) runs the two lines above. The new state is
    the one ``tx.update`` returns, but for an accumulation buffer between
    windows: ``tx.update`` clears it, this leaves the closed window's sum
    there, which the next micro-step replaces. :func:`train_step` and
    :class:`gradtools.TrainState` call this.

    Args:
      tx: any ``optax.GradientTransformation``.
      grads: the gradients (scaled by :func:`gradtools.scale_loss` when ``tx``
        holds a loss scaler).
      opt_state: ``tx``'s state.
      params: the params the gradients belong to.
      **extra_args: passed on to ``tx.update`` (e.g. :func:`gradtools.accumulate`'s
        ``flush`` and ``weight``).

    Returns:
      ``(params, opt_state)`` after the step.

    Raises:
      TypeError: if ``tx`` is not a GradientTransformation.
      ValueError: if ``params`` is ``None``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = gradtools.dynamic_loss_scale(optax.sgd(1.0), init_scale=4.0)
      >>> params = {'w': jnp.ones(2)}
      >>> state = tx.init(params)
      >>> grads = {'w': jnp.full(2, 4.0)}   # scaled by 4: unscaled, 1.0 each
      >>> params, state = gradtools.apply_gradients(tx, grads, state, params)
      >>> params['w']
      Array([0., 0.], dtype=float32)
      >>> overflow = {'w': jnp.array([jnp.inf, 4.0])}   # skipped: params stay
      >>> params, state = gradtools.apply_gradients(tx, overflow, state, params)
      >>> params['w'], gradtools.metrics(state)['skipped_steps']
      (Array([0., 0.], dtype=float32), Array(1, dtype=int32))
    """
    _checks.is_transform("tx", tx)
    if params is None:
        raise ValueError("apply_gradients: params=None; pass the params the gradients belong to")
    return _apply.step(tx, grads, opt_state, params, extra_args, True)


def _split(out: Any, has_aux: bool) -> tuple[Any, Any]:
    """``(loss, aux)`` from what ``loss_fn`` returned, or an error that says what to pass."""
    if has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(
                "train_step: with has_aux=True, loss_fn must return a pair (loss, aux), not"
                f" a {type(out).__name__}"
            )
        return out[0], out[1]
    if isinstance(out, (tuple, list)):
        raise TypeError(
            f"train_step: loss_fn returned a {type(out).__name__} of {len(out)}, not a scalar"
            " loss; if it returns (loss, aux), build the step with"
            " train_step(loss_fn, tx, has_aux=True)"
        )
    return out, None


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
      updates, opt_state = tx.update(grads, opt_state, params, value=loss, **update_kwargs)
      params = optax.apply_updates(params, updates)

    and returns ``(params, opt_state, metrics)``, where ``metrics`` holds the
    *unscaled* ``loss`` (plus ``aux`` with ``has_aux``) and everything
    :func:`gradtools.metrics` reads from the new ``opt_state``. The update and
    apply are one :func:`apply_gradients` call, which for a loss scaler applies
    the updates inside its skip branch. The loss is
    scaled only when ``opt_state`` holds a loss-scale state. The step is a pure
    function: ``jax.jit`` it, donating params and state
    (``donate_argnums=(0, 1)``), so that the update happens in place.

    Positional and keyword arguments go to ``loss_fn``, except the keyword-only
    ``update_kwargs``: a dict of extra arguments for ``tx.update``, such as
    :func:`gradtools.accumulate`'s ``flush`` and ``weight``. ``jax.jit`` traces
    its values, Python bools and numbers as well as arrays, so a changing
    ``flush`` does not recompile the step::

      step = jax.jit(gradtools.train_step(loss_fn, tx), donate_argnums=(0, 1))
      for i, batch in enumerate(batches):   # flush the partial window at the end
          params, opt_state, m = step(params, opt_state, batch,
                                      update_kwargs={'flush': jnp.array(i == last)})

    ``tx.update`` also gets the unscaled loss as ``value`` (optax's name for
    it, which ``optax.contrib.reduce_on_plateau`` reads), unless
    ``update_kwargs`` gives a ``value`` or ``tx`` is a plain
    ``optax.GradientTransformation``, whose ``update`` takes no extra
    arguments. Wrappers pass it on to their inner optimizer (``accumulate``
    the last micro-batch's, when its window closes).

    With a flax ``TrainState`` write the three lines yourself, using
    :class:`gradtools.TrainState`, whose ``apply_gradients`` is
    :func:`apply_gradients` and takes ``update_kwargs`` too::

      def step(state, batch, last):
          def scaled(p):   # drop scale_loss when tx has no loss scaler
              return gradtools.scale_loss(loss_fn(p, batch), state.opt_state)
          grads = jax.grad(scaled)(state.params)
          state = state.apply_gradients(grads=grads, update_kwargs={'flush': last})
          return state, gradtools.metrics(state.opt_state)

    ``state.step`` then counts calls, including skipped steps and
    accumulation micro-steps; the optimizer's own count (and any schedule)
    counts applied updates only. flax's own ``TrainState`` runs the same
    step but cannot pass ``update_kwargs`` (it hands keywords to ``replace``).

    Args:
      loss_fn: ``loss_fn(params, *args, **kwargs) -> loss`` (or
        ``(loss, aux)`` with ``has_aux``); ``loss`` is a scalar.
      tx: the optimizer, e.g. ``gradtools.dynamic_loss_scale(optax.adam(1e-3))``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
      ``step(params, opt_state, *args, update_kwargs=None, **kwargs) ->
      (params, opt_state, metrics)``.

    Raises:
      TypeError: if ``loss_fn`` is not callable or ``tx`` is not a
        GradientTransformation; when ``step`` is called, if ``update_kwargs``
        is not a dict, or if ``loss_fn`` returns a tuple without ``has_aux``
        (or anything but a pair with it).
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

    def step(
        params: Any,
        opt_state: optax.OptState,
        *args: Any,
        update_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> tuple[Any, optax.OptState, dict[str, Any]]:
        if update_kwargs is not None and not isinstance(update_kwargs, Mapping):
            raise TypeError(f"{update_kwargs=} must be a dict of tx.update's extra arguments")
        scaled = bool(optax.tree.get_all_with_path(opt_state, "LossScaleState"))

        def objective(p):
            loss, aux = _split(loss_fn(p, *args, **kwargs), has_aux)
            return (scale_loss(loss, opt_state) if scaled else loss), (loss, aux)

        grads, (loss, aux) = jax.grad(objective, has_aux=True)(params)
        extra = dict(update_kwargs or {})
        if isinstance(tx, optax.GradientTransformationExtraArgs):
            extra.setdefault("value", loss)
        try:
            params, opt_state = apply_gradients(tx, grads, opt_state, params, **extra)
        except TypeError as err:
            if "value" in (update_kwargs or {}) or "'value'" not in str(err):
                raise
            raise TypeError(
                f"train_step: {err}. The step hands tx.update the loss as value=, as optax"
                " does: an update function of a GradientTransformationExtraArgs must take"
                " extra keyword arguments it does not use (add **extra_args to it)"
            ) from err
        out = {"loss": loss, **metrics(opt_state)}
        if has_aux:
            out["aux"] = aux
        return params, opt_state, out

    return step
