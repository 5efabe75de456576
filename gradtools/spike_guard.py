"""A gradient-spike guard: clip or skip steps whose gradient norm jumps far above its recent level.

Loss spikes in long runs follow gradient-norm spikes, and one fixed clipping
threshold is either too tight for normal steps or too loose for spikes.
:func:`spike_guard` keeps running estimates of the mean and variance of the
gradient norm and treats a step whose norm has a z-score above a threshold as
a spike: it clips that step to the threshold, or skips it. Put it inside the
loss scaler, so that it sees unscaled gradients and never sees an overflow::

    tx = gradtools.dynamic_loss_scale(
        gradtools.spike_guard(optax.chain(gradtools.clip_by_global_norm(1.0), optax.adam(1e-3))))
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradtools import _apply
from gradtools import _checks
from gradtools import _norms
from gradtools import _square_sums
from gradtools import _tree

__all__ = ["SpikeGuardState", "spike_guard"]

_ACTIONS = ("clip", "skip")


class SpikeGuardState(NamedTuple):
    """State of :func:`spike_guard`.

    Attributes:
      spikes: how many steps were spikes (clipped or skipped).
      guard_norm: the global norm of the last step's gradients, before the
        guard acted (0 after ``init``; inf or NaN if they were not finite).
      norm_mean: the running mean of the gradient norm.
      norm_var: the running variance of the gradient norm.
      norm_count: how many norms entered the statistics.
      inner_state: the state of the wrapped transformation.
    """

    spikes: jax.Array  # shape=(), dtype=int32
    guard_norm: jax.Array  # shape=(), dtype=float32
    norm_mean: jax.Array  # shape=(), dtype=float32
    norm_var: jax.Array  # shape=(), dtype=float32
    norm_count: jax.Array  # shape=(), dtype=int32
    inner_state: optax.OptState

    takes_square_sums = True  # from a loss scaler right outside (_square_sums)

    def metrics(self) -> dict[str, jax.Array]:
        """What :func:`gradtools.metrics` reports of this state."""
        return {
            "grad_norm": jnp.asarray(self.guard_norm),
            "spikes": jnp.asarray(self.spikes),
            "norm_mean": jnp.asarray(self.norm_mean),
            "norm_std": jnp.sqrt(jnp.asarray(self.norm_var)),
        }


def _observe(state: SpikeGuardState, norm: jax.Array, decay: Any) -> tuple[jax.Array, jax.Array]:
    """The mean and variance with ``norm`` entered: an exponential average, bias-corrected."""
    d = jnp.asarray(decay, jnp.float32)
    k = jnp.asarray(optax.safe_increment(state.norm_count)).astype(jnp.float32)
    # 1 for the first norm, exactly (a division can be an ulp off on a GPU)
    w = jnp.where(k > 1, jnp.minimum((1 - d) / (1 - d**k), 1.0), 1.0)
    delta = norm - state.norm_mean
    return state.norm_mean + w * delta, (1 - w) * (state.norm_var + w * delta * delta)


def _norm(grads: Any, p: Any, shared: bool, given: Any) -> tuple[jax.Array, Any]:
    """``(norm, sums)``: the global norm, and for a shared L2 norm each leaf's sum of squares
    (``given``, where a loss scaler right outside offered them)."""
    if not (shared and jax.tree.leaves(grads)):
        return _norms.tree_norm(grads, p), None
    sums = _norms.square_sums(jax.tree.leaves(grads)) if given is None else given
    return _norms.l2_norm(sums), sums


def _clip(
    inner, grads, inner_state, params, extra_args, fused, norm, sums, limit, spike
) -> tuple[Any, Any, jax.Array, jax.Array]:
    """Scales a spike down to ``limit``: ``(out, inner_state, used_norm, enters)``."""
    factor = jnp.where(spike, limit / norm, jnp.ones([], jnp.float32))
    clipped = optax.tree.where(spike, _tree.scale_f32(grads, factor), grads)
    rescaled = sums
    if sums is not None:  # the sums of the clipped grads, read again only on a spike
        rescaled = lax.cond(
            spike,
            lambda g, f: _norms.square_sums(jax.tree.leaves(_tree.scale_f32(g, f))),
            lambda g, f: sums,
            grads,
            factor,
        )
    offered = _square_sums.offer(inner, inner_state, rescaled)
    out, new_inner_state = _apply.step(inner, clipped, offered, params, extra_args, fused)
    return out, new_inner_state, jnp.where(spike, limit, norm), jnp.isfinite(norm)


def _skip(
    inner, grads, inner_state, params, extra_args, fused, norm, sums, spike
) -> tuple[Any, Any, jax.Array, jax.Array]:
    """Drops a spike, ``inner`` untouched: ``(out, inner_state, used_norm, enters)``."""

    def run(grads):
        offered = _square_sums.offer(inner, inner_state, sums)
        return _apply.step(inner, grads, offered, params, extra_args, fused)

    out, new_inner_state = _apply.step_or_skip(~spike, run, grads, fused, params, inner_state)
    return out, new_inner_state, norm, jnp.isfinite(norm) & ~spike


def _update(state, inner_state, norm, spike, used, enters, decay) -> SpikeGuardState:
    """The next state: ``used`` enters the statistics where ``enters``; a spike is counted."""
    mean, var = _observe(state, used, decay)
    return SpikeGuardState(
        spikes=jnp.where(spike, optax.safe_increment(state.spikes), state.spikes),
        guard_norm=norm,
        norm_mean=jnp.where(enters, mean, state.norm_mean),
        norm_var=jnp.where(enters, var, state.norm_var),
        norm_count=jnp.where(enters, optax.safe_increment(state.norm_count), state.norm_count),
        inner_state=inner_state,
    )


def spike_guard(
    inner: optax.GradientTransformation,
    *,
    z_threshold: float = 2.5,
    decay: float = 0.97,
    warmup_steps: int = 25,
    action: str = "clip",
    norm_type: float = 2.0,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` so that a step whose gradient norm spikes is clipped or skipped.

    Each ``update(grads, state, params)`` does, in float32::

      n = global_norm(grads, norm_type)
      limit = norm_mean + z_threshold * sqrt(norm_var)
      spike = isfinite(n) and norm_count >= max(warmup_steps, 1) and n > limit
      if spike and action == 'clip': grads = grads * (limit / n); n = limit
      if spike and action == 'skip': updates = zeros    # inner state untouched
      else: updates, inner_state = inner.update(grads, inner_state, params)
      if isfinite(n) and not (spike and action == 'skip'):
        w = (1 - decay) / (1 - decay ** (norm_count + 1))  # bias-corrected, as Adam's
        norm_var = (1 - w) * (norm_var + w * (n - norm_mean) ** 2)
        norm_mean += w * (n - norm_mean); norm_count += 1

    A spike enters the statistics at the norm it was clipped to, and not at all
    when skipped, so one spike does not widen the threshold for the next.
    Non-finite gradients are no spike: they reach ``inner`` unchanged and stay
    out of the statistics. Other steps reach ``inner`` bit for bit. Through
    :func:`gradtools.apply_gradients` a skipped spike leaves the params as they
    were. An L2 norm is one read of the gradients, shared with a
    :func:`gradtools.clip_by_global_norm` right inside (the wrapped
    transformation, or first in an ``optax.chain`` that is), and taken from a
    loss scaler right outside.

    Args:
      inner: the optimizer (any ``optax.GradientTransformation``) to guard.
      z_threshold: how many standard deviations above the mean make a spike; > 0.
      decay: the weight of the past in the running mean and variance; in (0, 1).
      warmup_steps: finite steps that only gather statistics first; an int >= 0
        (the first norm is never a spike: there is nothing to compare it to).
      action: ``'clip'`` scales a spike down to the limit; ``'skip'`` drops it.
      norm_type: ``p`` of the norm, as in :func:`gradtools.clip_by_global_norm`.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`SpikeGuardState`; extra keyword arguments go to ``inner``.

    Raises:
      TypeError: if ``inner`` is not a GradientTransformation.
      ValueError: if ``z_threshold`` is not finite and > 0, ``decay`` is
        outside (0, 1), ``warmup_steps`` is not an int >= 0, ``action`` is
        not ``'clip'`` or ``'skip'``, or ``norm_type`` is below 1 or no number.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = gradtools.spike_guard(optax.sgd(1.0), warmup_steps=2)
      >>> state = tx.init({'w': jnp.zeros(2)})
      >>> for g in ([3.0, 4.0], [4.0, 3.0], [30.0, 40.0]):
      ...     updates, state = tx.update({'w': jnp.array(g)}, state)
      >>> updates['w'].round(4), gradtools.metrics(state)['spikes']  # clipped to norm 5
      (Array([-3., -4.], dtype=float32), Array(1, dtype=int32))

    References:
      Kumar et al., `ZClip: Adaptive Spike Mitigation for LLM Pre-Training
      <https://arxiv.org/abs/2504.02507>`_, 2025; Chowdhery et al., `PaLM
      <https://arxiv.org/abs/2204.02311>`_, 2022 (skipping batches around spikes).
    """
    _checks.is_transform("inner", inner)
    _checks.finite_positive("z_threshold", z_threshold)
    _checks.in_open_interval("decay", decay, 0.0, 1.0)
    _checks.non_negative_int("warmup_steps", warmup_steps)
    _checks.one_of("action", action, _ACTIONS)
    p = _norms.norm_type(norm_type)
    shared = isinstance(p, float) and p == 2  # the sums of squares go with the grads
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return SpikeGuardState(
            spikes=jnp.zeros([], jnp.int32),
            guard_norm=jnp.zeros([], jnp.float32),
            norm_mean=jnp.zeros([], jnp.float32),
            norm_var=jnp.zeros([], jnp.float32),
            norm_count=jnp.zeros([], jnp.int32),
            inner_state=inner.init(params),
        )

    def step(grads, state, params, extra_args, fused):
        state, given = _square_sums.take(state, grads)
        _checks.state_of("spike_guard", state, SpikeGuardState)
        _checks.real_leaves("spike_guard", "updates", grads)
        _checks.check_like("spike_guard", grads, params)
        norm, sums = _norm(grads, p, shared, given)
        limit = state.norm_mean + jnp.asarray(z_threshold, jnp.float32) * jnp.sqrt(state.norm_var)
        warm = state.norm_count >= jnp.maximum(warmup_steps, 1)
        spike = jnp.isfinite(norm) & warm & (norm > limit)
        args = (inner, grads, state.inner_state, params, extra_args, fused, norm, sums)
        if action == "clip":
            out, inner_state, used, enters = _clip(*args, limit, spike)
        else:
            out, inner_state, used, enters = _skip(*args, spike)
        return out, _update(state, inner_state, norm, spike, used, enters, decay)

    return optax.GradientTransformationExtraArgs(init_fn, _apply.Update(step))
