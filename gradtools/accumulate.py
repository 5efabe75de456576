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

A micro-step does no optimizer work: the inner update runs under
``lax.cond`` only when a window closes. ``gradtools.apply_gradients(tx,
grads, opt_state, params, weight=..., flush=...)`` does the update and the
apply in one call, and its micro-step leaves the params untouched.

``every_k`` may also be a schedule of the number of windows closed so far (a
batch-size ramp), and ``noise_scale=True`` estimates the gradient noise scale
from the windows' micro-batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradtools import _apply
from gradtools import _checks
from gradtools import _noise_scale
from gradtools import _norms
from gradtools import _tree
from gradtools import _tuning
from gradtools._noise_scale import NoiseScaleState

__all__ = ["AccumulateState", "NoiseScaleState", "accumulate"]

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
        accumulation ``dtype``; ``()`` when ``every_k=1``. ``update`` clears
        it (to zeros) when a window closes. ``gradtools.apply_gradients``
        leaves the closed window's sum in it, which the next micro-step
        replaces: clearing it there would cost a pass over the buffer on
        every micro-step.
      inner_state: the state of the wrapped transformation.
      windows_closed: with a scheduled ``every_k``, the windows closed so far
        (by ``every_k`` or by ``flush``) that held at least one micro-step,
        at which the schedule is evaluated; 0 with an int ``every_k``.
      window_size: the length of the open window (of the next one between
        windows): ``every_k``, or ``every_k(windows_closed)`` raised to 1.
      noise_stats: a :class:`NoiseScaleState` with ``noise_scale=True``,
        else ``()``.
    """

    micro_step: jax.Array  # shape=(), dtype=int32
    window_weight: jax.Array  # shape=(), dtype=float32
    dropped_micro_steps: jax.Array  # shape=(), dtype=int32
    acc_grads: optax.Updates
    inner_state: optax.OptState
    windows_closed: jax.Array  # shape=(), dtype=int32
    window_size: jax.Array  # shape=(), dtype=int32

    def metrics(self) -> dict[str, jax.Array]:
        """What :func:`gradtools.metrics` reports of this state."""
        return {
            "micro_step": jnp.asarray(self.micro_step),
            "dropped_micro_steps": jnp.asarray(self.dropped_micro_steps),
            "window_size": jnp.asarray(self.window_size),
        }

    noise_stats: NoiseScaleState | tuple[()]


@dataclasses.dataclass(frozen=True, eq=False)
class _Accumulate:
    """The transformation :func:`accumulate` returns: ``init`` and ``step``, with its options."""

    inner: optax.GradientTransformationExtraArgs
    every_k: int | Callable[[jax.Array], Any]
    average: bool
    dtype: Any
    skip_nonfinite: bool
    noise_scale: bool
    noise_scale_decay: Any

    def window_size(self, windows_closed: jax.Array) -> jax.Array:
        """The length of the window opened after ``windows_closed`` windows, at least 1."""
        if not callable(self.every_k):
            return jnp.full([], self.every_k, jnp.int32)
        size = self.every_k(windows_closed)
        _checks.window_size(size)
        return jnp.maximum(jnp.asarray(size).astype(jnp.int32), 1)

    def init(self, params: Any) -> AccumulateState:
        """An empty window (no buffer with ``every_k=1``) and ``inner``'s state."""
        # laid out like the param, as optax lays out its moments
        zeros = optax.tree.zeros_like(params, dtype=self.dtype)
        return AccumulateState(
            micro_step=jnp.zeros([], jnp.int32),
            window_weight=jnp.zeros([], jnp.float32),
            dropped_micro_steps=jnp.zeros([], jnp.int32),
            acc_grads=() if self.every_k == 1 else zeros,
            inner_state=self.inner.init(params),
            windows_closed=jnp.zeros([], jnp.int32),
            window_size=self.window_size(jnp.zeros([], jnp.int32)),
            noise_stats=_noise_scale.init() if self.noise_scale else (),
        )

    def step(self, grads, state, params, extra_args, fused):
        """One micro-step: ``(updates, state)``, or fused ``(params, state)`` (see ``_apply``)."""
        _checks.state_of("accumulate", state, AccumulateState)
        extra_args = dict(extra_args)  # weight and flush are accumulate's, the rest inner's
        weight, flush = extra_args.pop("weight", 1.0), extra_args.pop("flush", False)
        _checks.micro_batch_args(weight, flush)
        _checks.real_leaves("accumulate", "updates", grads)
        _checks.check_like("accumulate", grads, params)
        if self.every_k != 1:
            _checks.check_like("accumulate", grads, state.acc_grads, "acc_grads (from init)")
        w = jnp.asarray(weight, jnp.float32)
        finite = _norms.all_finite(grads) if self.skip_nonfinite else jnp.array(True)
        take = finite & jnp.isfinite(w) & (w > 0)  # the micro-batch's gradients enter the window

        # Add this micro-step.
        window = self.add(state, grads, w, take)
        # at most window_size <= 2**31 - 1: the window closes there, so it cannot wrap
        micro_step = state.micro_step + finite.astype(jnp.int32)
        window_weight = state.window_weight + jnp.where(take, w, 0.0)
        size = state.window_size if callable(self.every_k) else self.every_k
        closes = (micro_step >= size) | jnp.asarray(flush)
        noise = state.noise_stats
        if self.noise_scale:
            noise = _noise_scale.add(noise, _noise_scale.sq_norm(grads), w, take)

        # If the window closes (and holds any weight), step the optimizer on its mean.
        like = grads if params is None or self.every_k == 1 else params  # every_k=1: as they came

        def close(window):
            div = (window_weight if self.average else jnp.ones([], jnp.float32)).astype(self.dtype)
            exact = window if self.every_k == 1 else jax.tree.map(lambda a: a / div, window)
            mean = jax.tree.map(lambda m, p: m.astype(jnp.result_type(p)), exact, like)
            out, new = _apply.step(self.inner, mean, state.inner_state, params, extra_args, fused)
            if not self.noise_scale:
                return out, (new, noise)
            big = _noise_scale.sq_norm(exact) / (1 if self.average else window_weight**2)
            return out, (new, _noise_scale.close(noise, big, window_weight, self.noise_scale_decay))

        carry, emits = (state.inner_state, noise), closes & (window_weight > 0)
        if fused or self.every_k == 1:
            out, (inner, noise) = _apply.step_or_skip(emits, close, window, fused, params, carry)
        else:  # the updates leave the cond through the buffer: no zeros written per micro-step
            out, window, (inner, noise) = _tuning.cond_through_buffer(emits, close, window, carry)
        new_state = self.after(state, closes, micro_step, window_weight, finite, window)
        return out, new_state._replace(inner_state=inner, noise_stats=noise)

    def add(self, state: AccumulateState, grads: Any, w: jax.Array, take: jax.Array) -> Any:
        """The window after this micro-step; the first micro-step of a window starts from 0."""
        if self.every_k == 1:  # no buffer: the window is this micro-batch
            return grads if self.average else _tree.scale_f32(grads, w)
        is_open, zero = state.micro_step > 0, jnp.zeros([], self.dtype)

        def add_leaf(acc, g):
            g = jnp.asarray(g).astype(self.dtype) * w.astype(self.dtype)
            return jnp.where(is_open, acc, zero) + jnp.where(take, g, zero)

        return jax.tree.map(add_leaf, state.acc_grads, grads)

    def after(self, state, closes, micro_step, window_weight, finite, window) -> AccumulateState:
        """The counters after this micro-step: a window that closes makes way for the next."""
        windows_closed, window_size = state.windows_closed, state.window_size
        dropped = state.dropped_micro_steps
        if callable(self.every_k):  # an int every_k needs no count (nor its kernel on a GPU)
            closed = closes & (micro_step > 0)  # it held a micro-step
            n = jnp.where(closed, optax.safe_increment(windows_closed), windows_closed)
            windows_closed = n.astype(jnp.int32)
            window_size = jnp.where(closes, self.window_size(windows_closed), window_size)
        return state._replace(
            micro_step=jnp.where(closes, 0, micro_step).astype(jnp.int32),
            window_weight=jnp.where(closes, 0.0, window_weight),
            dropped_micro_steps=jnp.where(finite, dropped, optax.safe_increment(dropped)),
            acc_grads=window if self.every_k != 1 else (),
            windows_closed=windows_closed,
            window_size=window_size,
        )


def accumulate(
    inner: optax.GradientTransformation,
    every_k: int | Callable[[jax.Array], Any],
    *,
    average: bool = True,
    dtype: Any = jnp.float32,
    on_nonfinite: str = "propagate",
    noise_scale: bool = False,
    noise_scale_decay: Any = 0.99,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` so that it steps once per window of ``every_k`` micro-batches.

    Each ``update(grads, state, params=None, *, weight=1, flush=False)`` does::

      w = weight if weight is finite and > 0 else 0
      counts = all(isfinite(grads)) if on_nonfinite == "skip_microstep" else True
      if counts:                                     # add this micro-step
        acc_grads += w * grads; window_weight += w; micro_step += 1
      else:
        dropped_micro_steps += 1
      if micro_step == window_size or flush:         # the window closes
        if window_weight > 0:
          g = acc_grads / window_weight if average else acc_grads
          updates, inner_state = inner.update(g, inner_state, params, **extra)
        acc_grads = 0; window_weight = 0; micro_step = 0
        if callable(every_k):                        # window_size is every_k otherwise
          windows_closed += 1                        # if the window held a micro-step
          window_size = max(every_k(windows_closed), 1)
      otherwise updates = 0 and inner_state is unchanged

    ``acc_grads`` is kept in ``dtype`` and cleared by selection (never by
    multiplying with 0, which keeps a NaN). ``g`` reaches ``inner`` in the
    params' dtypes (the gradients' without params). ``flush``, ``weight`` and
    a scheduled window's length may be traced: none retraces. A zero weight
    still counts towards ``every_k``; a window of total weight 0 is dropped.
    ``every_k=1`` is exactly ``inner``: no buffer, the gradients go to it
    untouched (times ``weight`` with ``average=False``). With ``"propagate"``
    a non-finite micro-step poisons its window: wrap
    ``accumulate(dynamic_loss_scale(inner), k)`` to skip the window whole, or
    ``dynamic_loss_scale(accumulate(inner, k))`` to drop only the overflowing
    micro-batch.

    A callable ``every_k`` gives each window's length from the number of
    windows closed before it (``flush`` closes one too), as a batch-size ramp:
    ``every_k=lambda n: jnp.where(n < 2, 2, 4)`` closes windows after 2, 2, 4,
    4, ... micro-steps. ``metrics()`` reports the length as ``window_size``.

    ``noise_scale=True`` estimates the gradient noise scale. A closed window of
    ``n >= 2`` micro-batches, of weight ``b`` each and ``B = n * b`` in all,
    gives, in float32, ``small = mean_i |g_i|^2``, ``big = |mean_i g_i|^2``, the
    estimates ``G2 = (B * big - b * small) / (B - b)`` of ``|G|^2`` and ``S =
    (small - big) / (1 / b - 1 / B)`` of ``tr(Sigma)``. ``metrics()`` reports
    their moving averages (decay ``noise_scale_decay``, bias-corrected as in
    Adam) as ``grad_sq_norm`` and ``grad_variance``, and ``noise_scale = S / G2``:
    the batch size, in units of ``weight``, past which larger batches help
    little. With unequal weights the means over ``i`` are weighted by them and
    ``b = B / n``: the estimates stay unbiased if a micro-batch's gradient
    noise is ``Sigma / weight`` (``weight`` its example count). A window whose
    estimates are not finite is left out; put a loss scaler outside
    ``accumulate``, so that they see unscaled gradients.

    Args:
      inner: the optimizer (any ``optax.GradientTransformation``); extra
        keyword arguments of ``update`` are passed on to it.
      every_k: micro-batches per window: an int >= 1, or a jit-able function of
        the windows closed so far (an int32 array) that returns an int (values
        below 1 count as 1).
      average: hand ``inner`` the weighted mean of the window (``True``) or
        the weighted sum (``False``).
      dtype: the floating dtype of ``acc_grads``; float32 keeps half-precision
        gradients from losing precision (or overflowing) as they are summed.
      on_nonfinite: ``"propagate"`` or ``"skip_microstep"``.
      noise_scale: keep the gradient noise statistics (off: no work, no state).
      noise_scale_decay: the decay of their moving averages, per window.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is an
      :class:`AccumulateState`.

    Raises:
      TypeError: if ``inner`` is not a GradientTransformation; at trace time,
        for complex gradients.
      ValueError: if ``every_k`` is neither an int >= 1 nor callable, or is
        traced (under ``optax.inject_hyperparams`` pass
        ``static_args=('every_k', 'dtype')``), ``average`` or ``noise_scale``
        is not a bool, ``dtype`` is not a floating dtype, ``on_nonfinite`` is
        unknown, ``noise_scale_decay`` is not in (0, 1), or ``noise_scale`` is
        asked with ``every_k=1``; at trace time, if ``every_k(n)`` is not a
        scalar int, ``weight`` is not a real scalar, ``flush`` is not a scalar
        bool, or the gradients' tree or leaf shapes differ from the params' or
        the buffer's.

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
      >>> ramp = gradtools.accumulate(optax.sgd(1.0), lambda n: jnp.where(n < 2, 2, 4))
      >>> state = ramp.init(params)
      >>> for _ in range(4):
      ...     u, state = ramp.update({'w': jnp.ones(2)}, state, params)
      >>> int(state.windows_closed), int(gradtools.metrics(state)['window_size'])
      (2, 4)

    References:
      Goyal et al., `Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour
      <https://arxiv.org/abs/1706.02677>`_, 2017. McCandlish et al., `An
      Empirical Model of Large-Batch Training <https://arxiv.org/abs/1812.06162>`_,
      2018. ``optax.MultiSteps`` (``every_k_schedule``); MindSpore's gradient
      accumulation with ``accu_overflow``.
    """
    _checks.is_transform("inner", inner)
    _checks.is_bool("noise_scale", noise_scale)
    _checks.every_k(every_k, noise_scale)
    _checks.is_bool("average", average)
    _checks.float_dtype("dtype", dtype)
    _checks.one_of("on_nonfinite", on_nonfinite, _ON_NONFINITE)
    _checks.in_open_interval("noise_scale_decay", noise_scale_decay, 0.0, 1.0)
    tx = _Accumulate(
        inner=optax.with_extra_args_support(inner),
        every_k=every_k if callable(every_k) else int(every_k),  # pyright: ignore[reportArgumentType]
        average=average,
        dtype=jnp.dtype(dtype),
        skip_nonfinite=on_nonfinite == "skip_microstep",
        noise_scale=noise_scale,
        noise_scale_decay=noise_scale_decay,
    )
    return optax.GradientTransformationExtraArgs(tx.init, _apply.Update(tx.step))
