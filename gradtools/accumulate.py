"""Gradient accumulation: one optimizer step per window of micro-batches.

A batch too large for memory is split into ``every_k`` micro-batches. Their
gradients are added into a buffer, and the wrapped optimizer runs once per
window on the (weighted) mean, so ``k`` micro-batches give the step one batch
``k`` times larger would give::

    tx = gradtools.accumulate(optax.adam(1e-3), every_k=4)
    for i, batch in enumerate(batches):
        grads = jax.grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params,
                                       weight=len(batch), flush=i == len(batches) - 1)
        params = optax.apply_updates(params, updates)   # zeros on micro-steps

Unlike ``optax.MultiSteps``, a micro-step does no optimizer work: it reads the
buffer and the gradients and writes the buffer; its zero updates are a
selection that XLA fuses into ``apply_updates``. The inner update runs under
``lax.cond`` only when a window closes. ``gradtools.apply_gradients(tx, grads,
opt_state, params, weight=..., flush=...)`` does the update and the apply in
one call, and its micro-step leaves the params untouched: it reads and writes
3 floats per parameter, against 6 for the two lines above by the report's
count (5 as compiled; ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradtools import _apply
from gradtools import _checks
from gradtools import _tree
from gradtools.loss_scale import all_finite

__all__ = ["AccumulateState", "accumulate"]

_ON_NONFINITE = ("propagate", "skip_microstep")


class AccumulateState(NamedTuple):
    """State of :func:`accumulate`.

    Attributes:
      micro_step: micro-batches held in the open window (0 right after a window
        closed; always 0 when ``every_k=1``).
      window_weight: the total weight of the micro-batches in the open window.
      dropped_micro_steps: micro-steps left out because their gradients were
        not finite (``on_nonfinite="skip_microstep"`` only).
      acc_grads: the weighted sum of the open window's gradients, in the
        accumulation ``dtype`` (empty when ``every_k=1``). While
        ``micro_step`` is 0 it is stale (it may still hold the last closed
        window, or the updates that window produced) and is never read: the
        next micro-step replaces it.
      inner_state: the state of the wrapped transformation.
    """

    micro_step: jax.Array  # shape=(), dtype=int32
    window_weight: jax.Array  # shape=(), dtype=float32
    dropped_micro_steps: jax.Array  # shape=(), dtype=int32
    acc_grads: optax.Updates
    inner_state: optax.OptState


def _micro_weight(weight: Any) -> tuple[jax.Array, jax.Array]:
    """The float32 weight of one micro-batch and whether it counts (finite, > 0)."""
    if not _checks.numeric(weight):
        raise ValueError(f"weight={weight!r} must be a scalar number (the micro-batch's weight)")
    w = jnp.asarray(weight)
    if jnp.issubdtype(w.dtype, jnp.complexfloating):
        raise ValueError(f"weight={weight!r} must be a real number, not complex")
    if w.shape != ():
        raise ValueError(f"weight must be a scalar, got an array of shape {w.shape}")
    w = w.astype(jnp.float32)
    valid = jnp.isfinite(w) & (w > 0)
    return jnp.where(valid, w, jnp.zeros([], jnp.float32)), valid


def _flush_flag(flush: Any) -> jax.Array:
    flag = jnp.asarray(flush) if _checks.numeric(flush) else None
    if flag is None or flag.shape != () or flag.dtype != jnp.bool_:
        raise ValueError(f"flush must be a scalar bool (Python or traced), got {flush!r}")
    return flag


def _emit_or_hold(
    emitting: jax.Array,
    emit: Callable[[Any], tuple[Any, Any]],
    acc: Any,
    inner_state: Any,
    dtype: Any,
) -> tuple[Any, Any, Any]:
    """``lax.cond(emitting, emit, hold)``; returns ``(updates, acc, inner_state)``.

    The updates ``emit`` computes leave the branch in the accumulation buffer
    itself, which is stale once the window closes, and are selected outside
    it: ``updates = where(emitting, buffer, 0)``. A micro-step then forwards
    the buffer and the inner state untouched and writes nothing, and XLA fuses
    the selection into the caller's ``apply_updates``. Returning the updates
    as a branch output instead makes them a parameter-sized temporary, which
    a micro-step must fill with zeros and which XLA:CPU maps (and faults in)
    afresh on every call. Updates of another shape or dtype than the buffer
    (bf16 params with a float32 buffer, say) still leave the branch as outputs
    of their own: a cast in and out of the buffer would be exact, but XLA may
    skip the rounding in between, which would make the stale buffer differ
    between jitted and op-by-op runs.
    """
    emit, types = _apply.recorded(emit)
    acc_leaves, acc_def = jax.tree.flatten(acc)

    def plan():
        """The updates' treedef and leaf shapes, and ``stash``: the leaves kept in the buffer."""
        u_leaves, u_def = jax.tree.flatten(types(acc)[0])
        stash = [False] * len(u_leaves)
        if u_def == acc_def:
            stash = [u.shape == a.shape and u.dtype == dtype for u, a in zip(u_leaves, acc_leaves)]
        return u_def, u_leaves, stash

    def emit_branch(acc):
        updates, new_inner = emit(acc)
        u_def, _, stash = plan()
        done, buffers = u_def.flatten_up_to(updates), jax.tree.leaves(acc)
        if any(stash):
            buffers = [u.astype(dtype) if ok else b for u, b, ok in zip(done, buffers, stash)]
        return buffers, [u for u, ok in zip(done, stash) if not ok], new_inner

    def hold_branch(like, acc):  # like: the types of emit_branch's outputs
        return jax.tree.leaves(acc), _tree.zeros_like_shapes(like[1]), inner_state

    # hold is branch 0: XLA then forwards the buffer and inner state without copies.
    buffers, extra, inner_state = _apply.cond(emitting, emit_branch, hold_branch, acc)
    u_def, u_leaves, stash = plan()
    out = list(extra)
    if any(stash):
        rest = iter(extra)
        zero = [jnp.zeros([], u.dtype) for u in u_leaves]
        out = [
            jnp.where(emitting, b.astype(u.dtype), z) if ok else next(rest)
            for b, u, z, ok in zip(buffers, u_leaves, zero, stash)
        ]
    return jax.tree.unflatten(u_def, out), jax.tree.unflatten(acc_def, buffers), inner_state


def accumulate(
    inner: optax.GradientTransformation,
    every_k: int,
    *,
    average: bool = True,
    dtype: Any = jnp.float32,
    on_nonfinite: str = "propagate",
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` so that it steps once per window of ``every_k`` micro-batches.

    Each ``update(grads, state, params=None, *, weight=None, flush=False)`` does::

      w = weight if weight is finite and > 0 else 0     # weight=None means 1
      keep = all(isfinite(grads)) if on_nonfinite == "skip_microstep" else True
      if keep:
        if w > 0: acc_grads += w * grads                 # in dtype
        window_weight += w; micro_step += 1
      if micro_step == every_k or flush:                 # the window closes
        if window_weight > 0:
          g = acc_grads / window_weight if average else acc_grads
          updates, inner_state = inner.update(g, inner_state, params, **extra)
        else:                                            # an empty window
          updates = zeros                                # inner_state unchanged
        acc_grads = zeros; window_weight = 0; micro_step = 0
      else:
        updates = zeros                                  # a micro-step

    The branch is a ``lax.cond``, so a micro-step does no optimizer work: it
    reads the buffer and the gradients once and writes the buffer, and its
    zero updates cost nothing until ``apply_updates`` reads them. The buffer
    is cleared by selection, never by multiplying it with 0 (which would keep
    a NaN forever); to save a pass, the clearing happens in
    the add of the next window's first micro-step. ``g`` is handed to
    ``inner`` in the dtype of the matching param (of the gradient when
    ``params`` is None); updates, zero or not, come back in the dtype ``inner``
    returns them. ``flush`` may be a traced bool: it does not retrace.
    With float16 params and ``average=False``, a window's sum of loss-scaled
    gradients can pass float16's maximum (65504) in that cast and arrive as
    inf: there, average, or put the loss scaler outside
    (``dynamic_loss_scale(accumulate(...))``), which unscales each micro-step.
    No check sees such an overflow, nor one in a float16 buffer's own sum:
    every micro-step was finite, so ``inner`` receives the inf. With
    half-precision params keep the float32 buffer and ``average=True``.

    **Weights.** With ``weight`` (e.g. the micro-batch's example count) the
    window's mean is weighted, so micro-batches of 32, 32, 32 and 7 examples
    give the mean over all 103. A weight that is zero, negative, inf or NaN
    counts as 0: that micro-batch still counts towards ``every_k``, but its
    gradients (even NaN ones, as the mean over an empty batch gives) are left
    out. A window whose total weight is 0 is dropped when it closes: the
    update is zero and ``inner``'s state, so its step count, stays as it was.
    Pass ``weight`` on every call or on none (a switch retraces).

    **Non-finite micro-steps.** With ``"propagate"`` a NaN or inf poisons its
    window, which ``inner`` then receives as it is: wrap
    ``accumulate(gradtools.dynamic_loss_scale(inner), k)`` to skip that window
    whole (the scale backs off once), or
    ``gradtools.dynamic_loss_scale(accumulate(inner, k))`` to unscale and check
    each micro-step on its own and drop only the overflowing micro-batch. With
    ``"skip_microstep"`` a non-finite micro-step is left out here: it does not
    count towards ``every_k`` and is counted in ``dropped_micro_steps``.

    **every_k=1** is exactly ``inner`` (bit for bit): no buffer is kept and the
    gradients go to ``inner`` untouched (with ``average=False`` and a
    ``weight``, multiplied by it: the weighted sum of one micro-batch); only a
    weight that is not > 0 or (with ``"skip_microstep"``) non-finite gradients
    skip the step, as above. The
    state is still an :class:`AccumulateState`, so ``metrics()`` reads it alike.

    Args:
      inner: the optimizer (any ``optax.GradientTransformation``); extra
        keyword arguments of ``update`` are passed on to it.
      every_k: micro-batches per window; an int >= 1.
      average: hand ``inner`` the weighted mean of the window (``True``) or the
        weighted sum (``False``).
      dtype: the floating dtype of the accumulation buffer; float32 keeps
        bf16/fp16 gradients from losing precision as they are summed (and a
        float16 sum from overflowing, which no check would catch).
      on_nonfinite: ``"propagate"`` or ``"skip_microstep"``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is an
      :class:`AccumulateState`.

    Raises:
      TypeError: if ``inner`` is not a GradientTransformation.
      ValueError: if ``every_k`` is not an int >= 1, ``average`` is not a bool,
        ``dtype`` is not a floating dtype or ``on_nonfinite`` is unknown; at
        trace time, if ``weight`` is not a real scalar, ``flush`` is not a
        scalar bool, the gradients' tree structure or leaf shapes differ
        from the buffer's, or ``every_k`` is traced (under ``optax.inject_hyperparams``,
        pass ``static_args=('every_k', 'dtype')``); at trace time too, a
        ``TypeError`` for complex gradients.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = gradtools.accumulate(optax.sgd(1.0), every_k=2)
      >>> params = {'w': jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> u, state = tx.update({'w': jnp.array([1.0, 2.0])}, state, params)
      >>> u['w'], gradtools.metrics(state)['micro_step']
      (Array([0., 0.], dtype=float32), Array(1, dtype=int32))
      >>> u, state = tx.update({'w': jnp.array([3.0, 4.0])}, state, params)
      >>> u['w'], gradtools.metrics(state)['micro_step']
      (Array([-2., -3.], dtype=float32), Array(0, dtype=int32))

    References:
      Goyal et al., `Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour
      <https://arxiv.org/abs/1706.02677>`_, 2017. Matches ``optax.MultiSteps``
      (without its per-micro-step optimizer work) and MindSpore's gradient
      accumulation with ``accu_overflow`` under a loss scaler.
    """
    _checks.is_transform("inner", inner)
    _checks.static("every_k", every_k, "it decides the structure of the state")
    _checks.positive_int("every_k", every_k)
    _checks.is_bool("average", average)
    _checks.float_dtype("dtype", dtype)
    _checks.one_of("on_nonfinite", on_nonfinite, _ON_NONFINITE)
    inner = optax.with_extra_args_support(inner)
    every_k = int(every_k)
    dtype = jnp.dtype(dtype)
    skip_nonfinite = on_nonfinite == "skip_microstep"

    def init_fn(params):
        # zeros_like: laid out like the param, as optax lays out its moments
        buffer = () if every_k == 1 else jax.tree.map(lambda p: jnp.zeros_like(p, dtype), params)
        return AccumulateState(
            micro_step=jnp.zeros([], jnp.int32),
            window_weight=jnp.zeros([], jnp.float32),
            dropped_micro_steps=jnp.zeros([], jnp.int32),
            acc_grads=buffer,
            inner_state=inner.init(params),
        )

    def step(updates, state, params, extra_args, fused):
        """``update`` (``fused=False``), or ``update`` and ``apply_updates`` in one.

        Returns the updates (or, when ``fused``, the new params) and the new state.
        ``weight`` and ``flush`` are accumulate's own; the other extra arguments
        go to ``inner``.
        """
        extra_args = dict(extra_args)
        weight, flush = extra_args.pop("weight", None), extra_args.pop("flush", False)
        _tree.check_like("accumulate", updates, params)
        _checks.real_leaves("accumulate", "updates", updates)
        if every_k > 1:
            _tree.check_like("accumulate", updates, state.acc_grads, "acc_grads (from init)")
        flush = _flush_flag(flush)
        # take: whether this micro-batch's gradients enter the window (None: always).
        finite = all_finite(updates) if skip_nonfinite else None
        if weight is None:
            w, take = None, finite
        else:
            w, positive = _micro_weight(weight)
            take = positive if finite is None else positive & finite
        dropped = state.dropped_micro_steps
        if finite is not None:
            dropped = jnp.where(finite, dropped, optax.safe_increment(dropped))

        def apply(grads):  # fused, the updates never leave the branch that computes them
            return _apply.inner_step(inner, grads, state.inner_state, params, extra_args, fused)

        if every_k == 1:
            if w is not None and not average:  # the weighted sum of one micro-batch
                updates = _tree.scale_f32(updates, w)
            if take is None:
                new_updates, inner_state = apply(updates)
            else:
                new_updates, inner_state = _apply.step_or_skip(
                    take, apply, fused, params, state.inner_state, updates
                )
            return new_updates, state._replace(dropped_micro_steps=dropped, inner_state=inner_state)

        # A window that is not open (micro_step == 0) may still hold the sum of the
        # last closed one: it is dropped here by selection, in the same pass as the add,
        # so that closing a window writes nothing.
        is_open = state.micro_step > 0
        zero = jnp.zeros([], dtype)

        def add(acc, g):
            x = g.astype(dtype)
            if w is not None:
                x = x * w.astype(dtype)
            if take is not None:
                x = jnp.where(take, x, zero)
            return jnp.where(is_open, acc, zero) + x

        acc_grads = jax.tree.map(add, state.acc_grads, updates)
        w_in = jnp.ones([], jnp.float32) if w is None else w
        if take is not None:
            w_in = jnp.where(take, w_in, jnp.zeros([], jnp.float32))
        counted = 1 if finite is None else finite.astype(jnp.int32)  # towards every_k
        micro_step = state.micro_step + counted
        window_weight = state.window_weight + w_in
        closes = (micro_step >= every_k) | flush
        like = updates if params is None else params

        def emit(acc):
            div = window_weight.astype(dtype) if average else jnp.ones([], dtype)
            return apply(jax.tree.map(lambda a, p: (a / div).astype(p.dtype), acc, like))

        emitting = closes & (window_weight > 0)
        if fused:  # a micro-step forwards params, buffer and inner state untouched

            def emit_and_apply(acc):
                new_params, new_inner = emit(acc)
                return new_params, acc, new_inner

            def hold(like, acc):
                del like
                return params, acc, state.inner_state

            new_updates, acc_grads, inner_state = _apply.cond(
                emitting, emit_and_apply, hold, acc_grads
            )
        else:
            new_updates, acc_grads, inner_state = _emit_or_hold(
                emitting, emit, acc_grads, state.inner_state, dtype
            )
        new_state = AccumulateState(
            micro_step=jnp.where(closes, 0, micro_step).astype(jnp.int32),
            window_weight=jnp.where(closes, jnp.zeros([], jnp.float32), window_weight),
            dropped_micro_steps=dropped,
            acc_grads=acc_grads,
            inner_state=inner_state,
        )
        return new_updates, new_state

    return _apply.transformation(init_fn, step)
