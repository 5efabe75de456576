"""One training step: scaled gradients, update, apply, metrics."""

from __future__ import annotations

import sys
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from gradtools import _apply
from gradtools import _checks
from gradtools import _compat
from gradtools import _fp8
from gradtools import _step_checks
from gradtools import _tree
from gradtools.accumulate import AccumulateState
from gradtools.loss_scale import LossScaleState
from gradtools.loss_scale import scale_loss
from gradtools.metrics import metrics

__all__ = ["LossSum", "apply_gradients", "train_step"]


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

    Which form runs is decided by ``tx`` itself: every gradtools wrapper (a
    transformation that wraps an optimizer, such as
    :func:`gradtools.dynamic_loss_scale` or :func:`gradtools.accumulate`, one
    inside the other too) carries an update-and-apply form in its ``update``,
    and then the params are updated inside the branch that runs the
    optimizer: the updates never leave it, so XLA needs no parameter-sized
    buffer for them, and a step that runs no optimizer (a skipped step, a
    micro-step, a frozen group) returns the params as they were. Any other
    ``tx`` (an ``optax.chain`` or ``optax.inject_hyperparams``, even around a
    gradtools wrapper) runs the two lines above. The new state is the one
    ``tx.update`` returns, but for an accumulation buffer between windows:
    ``tx.update`` clears it, this leaves the closed window's sum there, which
    the next micro-step replaces. :func:`train_step` and
    :class:`gradtools.TrainState` call this.

    **fp8 meta.** Where ``params`` are flax variables holding the scales and
    amax histories of flax's fp8 ops (the collection ``_overwrite_with_gradient``
    beside ``params``), ``tx`` sees ``params['params']`` and ``grads['params']``
    only, from ``opt_state = tx.init(params['params'])``, as in flax's
    ``TrainState``; the meta takes the new values the backward pass returned as
    its gradients, at every call, whatever ``tx`` did (a skip, a micro-step)::

      meta = where(isfinite(grads[meta]), grads[meta], params[meta])
      meta['...output_grad_*'] *= new loss scale / old loss scale   # with a loss scaler

    Args:
      tx: any ``optax.GradientTransformation``.
      grads: the gradients (scaled by :func:`gradtools.scale_loss` when ``tx``
        holds a loss scaler).
      opt_state: ``tx``'s state.
      params: the params the gradients belong to.
      **extra_args: passed on to ``tx.update`` (e.g. :func:`gradtools.accumulate`'s
        ``flush`` and ``weight``). ``flush`` or ``weight`` with no ``accumulate``
        in ``tx``, or a near miss of a gradtools keyword (``flsh``), is warned
        of; other keywords pass on silently, as optax's convention has them.

    Returns:
      ``(params, opt_state)`` after the step.

    Raises:
      TypeError: if ``tx`` is not a GradientTransformation, or a keyword is
        named ``update_kwargs``.
      ValueError: if ``params`` is ``None``; when the step is traced, if
        ``opt_state`` was built for other params (the message names each leaf
        and both shapes), or, with fp8 meta, from the whole variables, or if
        only one of ``params`` and ``grads`` holds the meta.

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
    if _fp8.held(params, grads):  # flax's fp8 meta: tx steps on params['params'] only
        return _fp8.apply(apply_gradients, tx, grads, opt_state, params, extra_args)
    _step_checks.update_keywords(extra_args, bool(_tree.find(opt_state, AccumulateState)))
    try:
        return _apply.step(tx, grads, opt_state, params, extra_args, True)
    except (TypeError, ValueError):
        _step_checks.explain_state("apply_gradients", tx, opt_state, params)  # if it can
        raise


class LossSum(NamedTuple):
    """A loss given as a sum over ``count`` examples (or tokens), for exact weighted means.

    A ``loss_fn`` that returns a ``LossSum`` (or ``(LossSum, aux)`` with
    ``has_aux``) lets :func:`train_step` divide by the count of the whole
    batch rather than average per micro-batch means::

      loss = sum(total_i) / sum(count_i)     # over the micro-batches i
      grads = sum(count_i * grad(scale_loss(total_i / count_i))) / sum(count_i)

    which is the token-weighted mean even when micro-batches hold different
    numbers of valid (unpadded) tokens. A batch with a count of 0 gives zero
    gradients, not NaN. The loss scaler scales each micro-batch's mean, never
    its total, and the weighing by counts is done in float32: a float16 step
    overflows (and a dynamic scale settles) as it would for a mean loss.

    Attributes:
      total: the sum of the per-example (or per-token) losses, a scalar.
      count: how many examples (or tokens) ``total`` sums over, a scalar.
    """

    total: Any
    count: Any


def _split(out: Any, has_aux: bool) -> tuple[Any, Any]:
    """``(loss, aux)`` from what ``loss_fn`` returned, or an error that says what to pass."""
    if has_aux:
        if isinstance(out, LossSum) or not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(
                "train_step: with has_aux=True, loss_fn must return a pair (loss, aux), not"
                f" a {type(out).__name__}"
            )
        return out[0], out[1]
    if isinstance(out, (tuple, list)) and not isinstance(out, LossSum):
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
    micro_batches: int = 1,
) -> Callable[..., tuple[Any, optax.OptState, dict[str, Any]]]:
    """Builds ``step(params, opt_state, *args, **kwargs)`` for a loss function.

    The step computes::

      loss = loss_fn(params, *args, **kwargs)
      grads = grad(scale_loss(loss, opt_state))   # unscaled if no loss scaler
      updates, opt_state = tx.update(grads, opt_state, params, value=loss, **update_kwargs)
      params = optax.apply_updates(params, updates)

    and returns ``(params, opt_state, metrics)``: the *unscaled* ``loss`` (plus
    ``aux`` with ``has_aux``) and everything :func:`gradtools.metrics` reads
    from the new ``opt_state``. The loss is scaled only when ``opt_state``
    holds a loss-scale state; the update and apply are one
    :func:`apply_gradients` call. ``jax.jit`` the step, donating params and
    state (``donate_argnums=(0, 1)``), so that the update happens in place.

    Positional and keyword arguments go to ``loss_fn``, except the keyword-only
    ``update_kwargs``: a dict of extra arguments for ``tx.update``, such as
    :func:`gradtools.accumulate`'s ``flush`` and ``weight`` (traced, so a
    changing ``flush`` does not recompile). ``tx.update`` also gets the
    unscaled loss as ``value`` (which ``optax.contrib.reduce_on_plateau``
    reads), unless ``update_kwargs`` gives one or ``tx`` is a plain
    ``optax.GradientTransformation``.

    **Micro-batches.** With ``micro_batches=k``, every positional argument's
    leaves with a leading axis are split along it into ``k`` equal,
    contiguous micro-batches (keyword arguments and leaves without an axis go
    whole to each), and the gradients are taken one micro-batch after another
    inside the step, in a ``lax.scan``::

      grads = sum(grad(scale_loss(loss_fn(params, *batch_i), opt_state))) / k   # float32 sum
      loss = mean(loss_i)                        # aux: stacked, shape (k, ...)

    then ``tx`` steps once. Only one micro-batch's activations are alive at a
    time, so peak memory falls with ``k``; an overflow in any micro-batch
    makes the step non-finite, and a loss scaler skips it as a whole. A
    ``loss_fn`` returning :class:`LossSum` gets the exact weighted mean over
    micro-batches of unequal counts (padded tokens). To accumulate across
    calls instead, as micro-batches arrive from the host, use
    :func:`gradtools.accumulate`. fp8 meta in ``params`` (see
    :func:`apply_gradients`) is the element-wise maximum over the micro-batches.

    Args:
      loss_fn: ``loss_fn(params, *args, **kwargs) -> loss`` (or
        ``(loss, aux)`` with ``has_aux``); ``loss`` is a scalar, or a
        :class:`LossSum`.
      tx: the optimizer, e.g. ``gradtools.dynamic_loss_scale(optax.adam(1e-3))``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      micro_batches: how many micro-batches to split the batch into (1: none).

    Returns:
      ``step(params, opt_state, *args, update_kwargs=None, **kwargs) ->
      (params, opt_state, metrics)``.

    Raises:
      TypeError: if ``loss_fn`` is not callable or ``tx`` is not a
        GradientTransformation; when ``step`` is called, if ``params`` is a
        ``flax.nnx.Module``, ``update_kwargs`` is not a dict, or ``loss_fn``
        returns a tuple without ``has_aux`` (or anything but a pair with it).
      ValueError: if ``has_aux`` is not a bool or ``micro_batches`` not an
        int >= 1; when the step is traced, if ``micro_batches`` does not
        divide a leading axis.

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
      without a loss scaler); optax ``optax.microbatching``.
    """
    if not callable(loss_fn):
        raise TypeError(f"{loss_fn=} must be callable: loss_fn(params, *args) -> loss")
    _checks.is_transform("tx", tx)
    _checks.is_bool("has_aux", has_aux)
    _checks.positive_int("micro_batches", micro_batches)

    def step(
        params: Any,
        opt_state: optax.OptState,
        *args: Any,
        update_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> tuple[Any, optax.OptState, dict[str, Any]]:
        _checks.update_kwargs(update_kwargs)
        _not_a_module(params)
        grads, loss, aux = _gradients(
            loss_fn, has_aux, micro_batches, params, opt_state, args, kwargs
        )
        extra = dict(update_kwargs or {})
        if isinstance(tx, optax.GradientTransformationExtraArgs):
            extra.setdefault("value", loss)
        params, opt_state = _apply_or_explain(tx, grads, opt_state, params, extra, update_kwargs)
        out = {"loss": loss, **metrics(opt_state)}
        if has_aux:
            out["aux"] = aux
        return params, opt_state, out

    return step


def _gradients(loss_fn, has_aux, micro_batches, params, opt_state, args, kwargs):
    """``(grads, loss, aux)`` of the batch ``args``: scaled gradients, the unscaled loss.

    The scaled quantity is always a mean: a :class:`LossSum` is divided by its
    count before it is scaled (its gradient is then weighed by the count), so a
    sum over many tokens overflows float16 no sooner than their mean would.
    """
    scaled = bool(_tree.find(opt_state, LossScaleState))

    def grads_of(p: Any, batch: tuple[Any, ...]) -> tuple[Any, Any]:
        """``grad(scaled mean)`` and ``(total, count, aux)`` of one (micro-)batch."""

        def objective(p):
            loss, aux = _split(loss_fn(p, *batch, **kwargs), has_aux)
            if isinstance(loss, LossSum):
                total, count = loss.total, jnp.asarray(loss.count, jnp.float32)
                mean = jnp.asarray(total, jnp.float32) * _inverse(count)
            else:
                total, count, mean = loss, None, loss
            return (scale_loss(mean, opt_state) if scaled else mean), (total, count, aux)

        return jax.grad(objective, has_aux=True)(p)

    if micro_batches == 1:
        grads, (loss, count, aux) = grads_of(params, args)
        return grads, loss if count is None else _mean(loss, count), aux
    grads, (loss, count, aux) = _scan(grads_of, params, args, micro_batches)
    return grads, _mean(loss, count), aux


def _apply_or_explain(tx, grads, opt_state, params, extra, update_kwargs):
    """:func:`apply_gradients`, with a hint when an update refuses the ``value`` it is handed."""
    try:
        return apply_gradients(tx, grads, opt_state, params, **extra)
    except TypeError as err:
        # The update that refuses ``value`` may sit anywhere inside ``tx`` (a chain
        # hands every extra argument to every member), so its own error is the only
        # place that says which argument it refused.
        if "value" in (update_kwargs or {}) or not _compat.refused_keyword(err, "value"):
            raise
        raise TypeError(
            f"train_step: {err}. The step hands tx.update the loss as value=, as optax"
            " does: an update function of a GradientTransformationExtraArgs must take"
            " extra keyword arguments it does not use (add **extra_args to it)"
        ) from err


def _inverse(count: jax.Array) -> jax.Array:
    """``1 / count`` in float32, and 0 for a count of 0 (a batch of no tokens weighs nothing)."""
    return jnp.where(count == 0, 0.0, 1.0 / jnp.where(count == 0, 1.0, count))


def _mean(total: Any, count: jax.Array) -> jax.Array:
    """``total / count`` computed in float32, cast back to ``total``'s dtype; 0 / 0 is 0."""
    return (jnp.asarray(total, jnp.float32) * _inverse(count)).astype(jnp.result_type(total))


def _scan(grads_of: Callable, params: Any, args: tuple[Any, ...], k: int) -> tuple[Any, Any]:
    """The weighted mean over ``k`` micro-batches of ``grads_of``'s gradients, the sums of the
    totals and counts.

    A ``lax.scan`` with a static trip count. Each micro-batch's gradient (of
    its mean) is weighed by its count (1 for a mean loss) and summed in
    float32; the sum is divided by the total count in float32 before it is
    cast to the params' dtypes, so a float16 sum never overflows. Auxiliary
    outputs are stacked along a new leading axis.
    """
    batches, rebuild = _micro_batches(args, k)
    summed, meta = _fp8.split(params, "params")  # fp8 meta: a running maximum, never a sum
    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), summed)

    def body(carry, batch):
        grads, (total, count, aux) = grads_of(params, rebuild(batch))
        grads, new_meta = _fp8.split(grads, "grads")
        sums, meta, total_sum, count_sum = carry
        w = jnp.ones([], jnp.float32) if count is None else count  # a mean loss counts as one
        sums = jax.tree.map(lambda s, g: s + g.astype(jnp.float32) * w, sums, grads)
        total_sum = total_sum + jnp.asarray(total, jnp.float32)
        return (sums, _fp8.maximum(meta, new_meta), total_sum, count_sum + w), (total, aux)

    init = (zeros, _fp8.lowest(meta), jnp.zeros([], jnp.float32), jnp.zeros([], jnp.float32))
    (sums, meta, total, count), (totals, aux) = lax.scan(body, init, batches)
    # A division, not a product with 1 / count: XLA:CPU then needs 25 MiB less of
    # temporaries in the benchmark's GPT step (58 against 83 MiB). The sums of a
    # count of 0 are 0, and so is the result.
    divisor = jnp.where(count == 0, 1.0, count)
    grads = jax.tree.map(lambda s, p: (s / divisor).astype(jnp.result_type(p)), sums, summed)
    return _fp8.merge(params, grads, meta), (total.astype(totals.dtype), count, aux)


def _micro_batches(args: tuple[Any, ...], k: int) -> tuple[list[Any], Callable]:
    """Every leaf of ``args`` with a leading axis, reshaped to ``(k, n // k, ...)``.

    Returns the reshaped leaves and a function that puts one micro-batch of
    them back into ``args``' structure (leaves without an axis, such as
    Python numbers, are passed whole).
    """
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(args)
    split = [np.ndim(x) >= 1 for _, x in paths_leaves]
    batches = []
    for (path, x), is_split in zip(paths_leaves, split):
        if not is_split:
            continue
        n = np.shape(x)[0]
        if n % k:
            raise ValueError(
                f"train_step: args{jax.tree_util.keystr(path)} has a leading axis of size {n},"
                f" which micro_batches={k} does not divide: pass a batch whose size is a"
                f" multiple of {k}"
            )
        batches.append(jnp.reshape(x, (k, n // k, *np.shape(x)[1:])))

    def rebuild(batch: list[Any]) -> tuple[Any, ...]:
        it = iter(batch)
        leaves = [next(it) if s else x for (_, x), s in zip(paths_leaves, split)]
        return jax.tree.unflatten(treedef, leaves)

    return batches, rebuild


def _not_a_module(params: Any) -> None:
    """Raises a TypeError that says what to pass when ``params`` is a ``flax.nnx.Module``."""
    nnx = sys.modules.get("flax.nnx")  # only set when flax.nnx is imported, as it then is
    if nnx is not None and isinstance(params, nnx.Module):
        raise TypeError(
            f"train_step: params is a flax.nnx.Module ({type(params).__name__}), not a tree of"
            " arrays. Split it, graphdef, params = nnx.split(model), and let loss_fn rebuild it"
            " with nnx.merge(graphdef, params); or keep the module and step with"
            " gradtools.Optimizer(model, tx, wrt=nnx.Param)"
        )
