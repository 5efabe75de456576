"""Loss scaling for fp16 and bf16 training, as wrappers around an optimizer.

Small gradients underflow in float16 (anything at or below 2**-25 becomes zero).
Multiplying the loss by a scale ``S`` multiplies every gradient by ``S`` and
lifts them into range; the wrapper divides by ``S`` again before the optimizer
sees them. When the scaled gradients overflow (inf or NaN), the step is skipped:
the optimizer state, and so its step count and any schedule it drives, stay as
they were, and the update is exactly zero.

The training loop needs two calls::

    tx = gradtools.dynamic_loss_scale(optax.adam(1e-3))
    grads = jax.grad(lambda p: gradtools.scale_loss(loss_fn(p, batch), opt_state))(params)
    updates, opt_state = tx.update(grads, opt_state, params)

``gradtools.train_step`` does both for you. Where you write the loop
yourself, ``params, opt_state = gradtools.apply_gradients(tx, grads,
opt_state, params)`` gives what ``tx.update`` followed by
``optax.apply_updates`` gives, but applies the updates inside the branch
that computes them, so XLA stores no parameter-sized buffer for them.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradtools import _apply
from gradtools import _checks
from gradtools import _square_sums
from gradtools import _tree
from gradtools import _tuning
from gradtools._norms import all_finite  # documented here, beside the loss scalers

__all__ = [
    "LossScaleState",
    "all_finite",
    "dynamic_loss_scale",
    "fixed_loss_scale",
    "loss_scale",
    "scale_loss",
]


class LossScaleState(NamedTuple):
    """State of :func:`dynamic_loss_scale` and :func:`fixed_loss_scale`.

    Attributes:
      loss_scale: the scale the next loss is multiplied by.
      good_steps: consecutive finite steps since the last growth or overflow.
      skipped_steps: how many steps had non-finite gradients (all of them
        skipped, unless ``fixed_loss_scale(skip_nonfinite=False)``).
      finite: whether the gradients of the last update were all finite.
      nonfinite_updates: steps skipped because, with half-precision params or
        optimizer state, the step would have written an inf or NaN there.
      nonfinite_leaves: one flag per leaf of the params, in tree order: whether
        its gradients held an inf or NaN in the last step skipped for that.
      inner_state: the state of the wrapped transformation.
    """

    loss_scale: jax.Array  # shape=(), dtype=float32
    good_steps: jax.Array  # shape=(), dtype=int32
    skipped_steps: jax.Array  # shape=(), dtype=int32
    finite: jax.Array  # shape=(), dtype=bool
    nonfinite_updates: jax.Array  # shape=(), dtype=int32
    nonfinite_leaves: jax.Array  # shape=(leaves,), dtype=bool
    inner_state: optax.OptState

    def metrics(self) -> dict[str, jax.Array]:
        """What :func:`gradtools.metrics` reports of this state."""
        return {
            "loss_scale": jnp.asarray(self.loss_scale),
            "skipped_steps": jnp.asarray(self.skipped_steps),
            "finite": jnp.asarray(self.finite),
            "nonfinite_updates": jnp.asarray(self.nonfinite_updates),
            "nonfinite_leaf_count": jnp.sum(jnp.asarray(self.nonfinite_leaves), dtype=jnp.int32),
        }


def _unscale(grads: Any, inv_scale: jax.Array, params: Any) -> Any:
    """``grads * inv_scale`` in float32, cast to each param's dtype (float32 without params)."""
    leaves, treedef = jax.tree.flatten(grads)
    like = [jnp.float32] * len(leaves) if params is None else treedef.flatten_up_to(params)
    # one copy of the factor per leaf: XLA:CPU otherwise writes a merged broadcast out in full
    factors = _tuning.distinct_scalars(inv_scale, leaves)
    unscaled = [
        (jnp.asarray(g, jnp.float32) * f).astype(jnp.result_type(p))
        for g, f, p in zip(leaves, factors, like)
    ]
    return treedef.unflatten(unscaled)


def _half_leaves(tree: Any) -> list[Any]:
    """The float16 and bfloat16 leaves of ``tree``: known from dtypes, when traced."""
    return [x for x in jax.tree.leaves(tree) if jnp.result_type(x) in (jnp.float16, jnp.bfloat16)]


def _init(inner: optax.GradientTransformation, init_scale: Any, params: Any) -> LossScaleState:
    """The state before the first step: the scale is ``init_scale`` and nothing is counted."""
    return LossScaleState(
        # A copy: an array init_scale (inject_hyperparams keeps one) must not
        # share its buffer with the state, or donating the state fails.
        loss_scale=jnp.array(init_scale, jnp.float32, copy=True),
        good_steps=jnp.zeros([], jnp.int32),
        skipped_steps=jnp.zeros([], jnp.int32),
        finite=jnp.ones([], jnp.bool_),
        nonfinite_updates=jnp.zeros([], jnp.int32),
        nonfinite_leaves=jnp.zeros([len(jax.tree.leaves(params))], jnp.bool_),
        inner_state=inner.init(params),
    )


def _finite_check(grads: Any, inv: jax.Array, params: Any, axis_name: Hashable | None):
    """``(sums, bad)``: each unscaled leaf's float32 sum of squares, and which leaves overflowed.

    One read of the gradients gives both (:func:`gradtools._tuning.checked_square_sum`:
    a NaN sum marks a leaf that is not finite, where a separate check would
    read every leaf twice). With ``axis_name`` the flags are agreed over
    devices, so that every device takes the same branch.
    """
    leaves = jax.tree.leaves(_unscale(grads, inv, params))
    sums = [_tuning.checked_square_sum(g) for g in leaves]
    bad = jnp.isnan(_tuning.stack_scalars(sums)) if sums else jnp.zeros([0], jnp.bool_)
    if axis_name is not None:
        bad = lax.pmax(bad.astype(jnp.int32), axis_name).astype(jnp.bool_)
    return sums, bad


def _next_state(state: LossScaleState, rule, finite, ok, bad, inner_state) -> LossScaleState:
    """The state after a step: the scale ``rule`` applied, skipped steps and writes counted."""
    scale, good_steps = rule(state.loss_scale, state.good_steps, finite)
    skipped, written = state.skipped_steps, state.nonfinite_updates
    return LossScaleState(
        loss_scale=jnp.asarray(scale).astype(jnp.float32),
        good_steps=jnp.asarray(good_steps).astype(jnp.int32),
        skipped_steps=jnp.where(finite & ok, skipped, optax.safe_increment(skipped)),
        finite=finite,
        nonfinite_updates=jnp.where(ok, written, optax.safe_increment(written)),
        nonfinite_leaves=jnp.where(finite, state.nonfinite_leaves, bad),
        inner_state=inner_state,
    )


def _loss_scaler(caller: str, inner, init_scale, rule, skip_nonfinite: bool, axis_name):
    """The wrapper both loss scalers share: ``rule(scale, good_steps, finite)`` sets the scale."""
    inner = optax.with_extra_args_support(inner)

    def step(grads, state, params, extra_args, fused):
        _checks.state_of(caller, state, LossScaleState)
        _checks.real_leaves(caller, "updates", grads)
        _checks.check_like(caller, grads, params)
        inv = 1.0 / state.loss_scale
        sums, bad = _finite_check(grads, inv, params, axis_name)
        finite = ~jnp.any(bad)
        # With half-precision params or state, a finite step may still write inf or NaN.
        check_writes = skip_nonfinite and bool(_half_leaves((params, state.inner_state)))

        def do_update(grads):  # unscaled again here, so that XLA need not store the unscaled copy
            unscaled = _unscale(grads, inv, params)
            # finite here: a clip right inside takes the sums instead of reading the grads again
            offered = _square_sums.offer(inner, state.inner_state, sums if skip_nonfinite else None)
            out, new_inner = _apply.step(inner, unscaled, offered, params, extra_args, fused)
            if not check_writes:
                return out, (new_inner, jnp.array(True))
            new_params = out if fused else optax.apply_updates(params, out)
            ok = all_finite((new_params, _half_leaves(new_inner)))  # float32 may hold an inf norm
            old = (params if fused else _tree.zeros_of_types(out), state.inner_state)
            out, new_inner = optax.tree.where(ok, (out, new_inner), old)
            return out, (new_inner, ok)

        def reject_update(like, grads):  # no optimizer work: the params or zero updates
            del grads
            out = params if fused else _tree.zeros_of_types(like[0])
            return out, (state.inner_state, jnp.array(True))

        if skip_nonfinite:
            out, (inner_state, ok) = _apply.cond(finite, do_update, reject_update, grads)
        else:
            out, (inner_state, ok) = do_update(grads)
        return out, _next_state(state, rule, finite, ok, bad, inner_state)

    init_fn = functools.partial(_init, inner, init_scale)
    return optax.GradientTransformationExtraArgs(init_fn, _apply.Update(step))


def _dynamic_scale_rule(
    scale,
    good_steps,
    finite,
    *,
    growth_factor,
    backoff_factor,
    growth_interval,
    min_scale,
    max_scale,
) -> tuple[jax.Array, jax.Array]:
    """:func:`dynamic_loss_scale`'s rule, ``(scale, good_steps)`` after a step: the
    ``growth_interval``-th finite step in a row grows the scale, a non-finite one backs off."""
    good_steps = jnp.asarray(optax.safe_increment(good_steps))
    grow = good_steps >= growth_interval
    grown = jnp.where(grow, jnp.minimum(scale * growth_factor, max_scale), scale)
    scale = jnp.where(finite, grown, jnp.maximum(scale * backoff_factor, min_scale))
    return scale, jnp.where(finite & ~grow, good_steps, 0)


def _fixed_scale_rule(scale, good_steps, finite) -> tuple[jax.Array, jax.Array]:
    """:func:`fixed_loss_scale`'s rule: the scale ``scale``; finite steps in a row counted."""
    return jnp.asarray(scale, jnp.float32), jnp.where(finite, optax.safe_increment(good_steps), 0)


def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    *,
    init_scale: float = 2.0**15,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    axis_name: Hashable | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with a loss scale that grows while steps are clean.

    Each ``update(grads, state, params)`` does::

      g = grads * (1 / scale)                 # float32; cast to params' dtypes
      finite = all(isfinite(g))               # agreed over axis_name, if given
      if finite:
        updates, inner_state = inner.update(g, inner_state, params)
        good_steps += 1
        if good_steps == growth_interval:
          scale = min(scale * growth_factor, max_scale); good_steps = 0
      else:                                   # the step is skipped
        updates = zeros; inner_state unchanged
        scale = max(scale * backoff_factor, min_scale); good_steps = 0
        skipped_steps += 1

    The branch is a ``lax.cond``, so a skipped step does no optimizer work.
    ``grads`` are the gradients of ``scale_loss(loss, opt_state)``. Under
    ``optax.inject_hyperparams`` with half-precision params, pass
    ``hyperparam_dtype=jnp.float32``.

    Args:
      inner: the optimizer (any ``optax.GradientTransformation``) to protect.
      init_scale: the first scale; 2**15 is the largest power of two that
        float16 itself can hold.
      growth_factor: multiplies the scale after ``growth_interval`` finite steps
        in a row; > 1.
      backoff_factor: multiplies the scale after an overflow; in (0, 1).
      growth_interval: consecutive finite steps before the scale grows; an int
        >= 1 (MindSpore's ``scale_window``).
      min_scale: the floor of the scale; finite, > 0, <= ``init_scale``.
      max_scale: the cap of the scale; finite, >= ``init_scale``.
      axis_name: under ``shard_map`` or ``pmap``, the mapped axis over which
        devices agree whether the step is finite, so all take the same branch.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`LossScaleState`; extra keyword arguments go to ``inner``.

    Raises:
      TypeError: if ``inner`` is not a GradientTransformation or
        ``axis_name`` is not hashable.
      ValueError: if ``init_scale``, ``min_scale`` or ``max_scale`` is not
        between 2**-126 and 2**126 (where it and its float32 reciprocal are
        normal numbers), ``growth_factor <= 1``, ``backoff_factor`` is
        outside (0, 1), ``growth_interval`` is not an int >= 1,
        ``min_scale > init_scale`` or ``max_scale < init_scale``.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> tx = gradtools.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
      >>> params = {'w': jnp.ones(2)}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({'w': jnp.array([8.0, jnp.inf])}, state, params)
      >>> updates['w'], gradtools.loss_scale(state)
      (Array([0., 0.], dtype=float32), Array(4., dtype=float32))

    References:
      Micikevicius et al., `Mixed Precision Training
      <https://arxiv.org/abs/1710.03740>`_, 2018. Matches
      ``torch.amp.GradScaler`` and MindSpore's ``DynamicLossScaleManager``
      with ``TrainOneStepWithLossScaleCell``.
    """
    _checks.is_transform("inner", inner)
    _checks.scale_bounds(init_scale=init_scale, min_scale=min_scale, max_scale=max_scale)
    _checks.greater_than_one("growth_factor", growth_factor)
    _checks.in_open_interval("backoff_factor", backoff_factor, 0.0, 1.0)
    _checks.positive_int("growth_interval", growth_interval)
    _checks.hashable("axis_name", axis_name)

    rule = functools.partial(
        _dynamic_scale_rule,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        min_scale=min_scale,
        max_scale=max_scale,
    )
    return _loss_scaler("dynamic_loss_scale", inner, init_scale, rule, True, axis_name)


def fixed_loss_scale(
    inner: optax.GradientTransformation,
    scale: float = 2.0**10,
    *,
    skip_nonfinite: bool = True,
    axis_name: Hashable | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with a loss scale that never changes.

    Each ``update(grads, state, params)`` divides ``grads`` by ``scale`` in
    float32 (cast to the params' dtypes), then runs ``inner``. With
    ``skip_nonfinite=True`` a step with non-finite gradients is skipped exactly
    as in :func:`dynamic_loss_scale` (zero update, inner state unchanged); with
    ``False`` it is always applied, non-finite values included. Either way the
    non-finite step is counted in ``skipped_steps``.

    Args:
      inner: the optimizer (any ``optax.GradientTransformation``).
      scale: the loss scale; finite and > 0. Under
        ``optax.inject_hyperparams``, a new value takes effect from the next
        step (this step's gradients were scaled by the old one).
      skip_nonfinite: skip steps whose gradients are not all finite. ``False``
        is MindSpore's ``FixedLossScaleManager(drop_overflow_update=False)``,
        without the optimizer having to know the scale.
      axis_name: under ``shard_map`` or ``pmap``, the mapped axis over which
        devices agree whether the step is finite.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`LossScaleState`.

    Raises:
      TypeError: if ``inner`` is not a GradientTransformation or
        ``axis_name`` is not hashable.
      ValueError: if ``scale`` is not between 2**-126 and 2**126, or
        ``skip_nonfinite`` is not a bool.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = gradtools.fixed_loss_scale(optax.sgd(1.0), 128.0)
      >>> params = {'w': jnp.zeros(2)}
      >>> updates, state = tx.update({'w': jnp.array([128.0, 256.0])}, tx.init(params), params)
      >>> updates['w']
      Array([-1., -2.], dtype=float32)

    References:
      MindSpore ``FixedLossScaleManager``. PyTorch has no fixed scale:
      ``torch.amp.GradScaler`` backs off on every overflow.
    """
    _checks.is_transform("inner", inner)
    _checks.scale_bound("scale", scale)
    _checks.is_bool("skip_nonfinite", skip_nonfinite)
    _checks.hashable("axis_name", axis_name)

    def rule(current, good_steps, finite):
        del current  # the state's: the given scale replaces it (inject_hyperparams may change it)
        return _fixed_scale_rule(scale, good_steps, finite)

    return _loss_scaler("fixed_loss_scale", inner, scale, rule, skip_nonfinite, axis_name)


def _find_state(opt_state: optax.OptState, caller: str) -> LossScaleState:
    found = _tree.find(opt_state, LossScaleState)
    if not found:
        raise ValueError(
            f"{caller}: opt_state holds no LossScaleState. Wrap the optimizer, e.g. "
            "tx = gradtools.dynamic_loss_scale(optax.adam(1e-3)), and pass the "
            "state from tx.init(params)."
        )
    if len(found) > 1:
        paths = [jax.tree_util.keystr(path) for path, _ in found]
        raise ValueError(f"{caller}: opt_state holds several LossScaleStates, at {paths}")
    return found[0][1]


def loss_scale(opt_state: optax.OptState) -> jax.Array:
    """The current loss scale held anywhere in ``opt_state``.

    Args:
      opt_state: the state of a transformation that contains one
        :func:`dynamic_loss_scale` or :func:`fixed_loss_scale`, at any depth.

    Returns:
      A float32 scalar.

    Raises:
      ValueError: if ``opt_state`` holds no loss-scale state, or several.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = optax.chain(optax.identity(), gradtools.fixed_loss_scale(optax.sgd(0.1), 512.0))
      >>> gradtools.loss_scale(tx.init({'w': jnp.zeros(3)}))
      Array(512., dtype=float32)
    """
    return jnp.asarray(_find_state(opt_state, "loss_scale").loss_scale)  # nnx keeps a Variable


def scale_loss(loss: jax.Array, opt_state: optax.OptState) -> jax.Array:
    """Multiplies ``loss`` by the current loss scale found in ``opt_state``.

    Differentiate the result, not ``loss``: the gradients come out scaled, and
    the loss-scale wrapper unscales them. The product keeps ``loss``'s dtype,
    and so does the scale the gradients start from: keep scales powers of two
    (the defaults, and any ``growth_factor``/``backoff_factor`` of 2 and 0.5),
    which bfloat16 and float16 hold exactly. A scale of 1001 is 1000 in
    bfloat16, and gradients unscaled by 1/1001 come out 0.1% small.

    Args:
      loss: a scalar loss (any float dtype).
      opt_state: the state of a transformation that contains a loss scaler.

    Returns:
      ``loss * scale``.

    Raises:
      TypeError: if ``loss`` is not a floating-point number or array.
      ValueError: if ``opt_state`` holds no loss-scale state, or several.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> state = gradtools.dynamic_loss_scale(optax.sgd(0.1)).init({'w': jnp.zeros(3)})
      >>> gradtools.scale_loss(jnp.float32(0.5), state)
      Array(16384., dtype=float32)
    """
    _checks.floating("scale_loss", "loss", loss)
    loss = jnp.asarray(loss)
    return loss * _find_state(opt_state, "scale_loss").loss_scale.astype(loss.dtype)
