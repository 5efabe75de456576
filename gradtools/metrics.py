"""Diagnostics read out of any optimizer state.

Every gradtools transform keeps what a training loop wants to log (the loss
scale, skipped steps, the gradient norm, the position in an accumulation
window) in a uniquely named NamedTuple state. :func:`metrics` finds those
states at any depth of an ``opt_state`` (inside ``optax.chain``,
``optax.inject_hyperparams``, parameter groups, other wrappers) and returns the
values as a flat dict, ready to log or to return from a jitted step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradtools import _noise_scale
from gradtools import _tree
from gradtools.accumulate import AccumulateState
from gradtools.clipping import ClipByGlobalNormState
from gradtools.group_norms import GroupNormsState
from gradtools.loss_scale import LossScaleState
from gradtools.naming import path_names
from gradtools.spike_guard import SpikeGuardState

__all__ = ["metrics", "nonfinite_leaves"]

# (metric key, state class, field): the first state of that class found in the
# tree supplies the metric. A transform whose state reports a metric adds a row.
_SOURCES = (
    ("loss_scale", LossScaleState, "loss_scale"),
    ("skipped_steps", LossScaleState, "skipped_steps"),
    ("finite", LossScaleState, "finite"),
    ("nonfinite_updates", LossScaleState, "nonfinite_updates"),
    ("micro_step", AccumulateState, "micro_step"),
    ("dropped_micro_steps", AccumulateState, "dropped_micro_steps"),
    ("window_size", AccumulateState, "window_size"),
)
# optax.inject_hyperparams's state, found by its name: its class has moved and been
# renamed across optax versions (InjectHyperparamsState is no longer produced).
_HYPERPARAM_STATE = "InjectStatefulHyperparamsState"
# Both measure the gradient norm before they act: grad_norm is that of the one
# that sees the gradients first (see metrics()).
_GRAD_NORM_STATES = {ClipByGlobalNormState: "grad_norm", SpikeGuardState: "guard_norm"}


def metrics(opt_state: optax.OptState) -> dict[str, jax.Array]:
    """Collects the diagnostics of every gradtools transform in ``opt_state``.

    Keys are present only when the matching transform is:

    ==================== ==================================================== =======
    key                  from                                                 dtype
    ==================== ==================================================== =======
    loss_scale           ``dynamic_loss_scale`` / ``fixed_loss_scale``        float32
    skipped_steps        the same: steps not applied so far                   int32
    finite               the same: whether the last step's gradients were     bool
                         finite
    nonfinite_updates    the same: steps not applied because they would have  int32
                         written inf or NaN into half-precision params or
                         state
    nonfinite_leaf_count the same: leaves whose gradients overflowed in the   int32
                         last skipped step
                         (:func:`gradtools.nonfinite_leaves` names them)
    grad_norm            ``clip_by_global_norm`` or ``spike_guard``: the norm float32
                         before it acted (see below)
    micro_step           ``accumulate``: micro-batches in the open window     int32
    dropped_micro_steps  ``accumulate``: non-finite micro-batches dropped     int32
                         (``on_nonfinite='skip_microstep'``)
    window_size          ``accumulate``: the open window's length             int32
                         (``every_k``, or what its schedule gave)
    noise_scale          ``accumulate(noise_scale=True)``: the gradient noise float32
                         scale ``grad_variance / grad_sq_norm``, in units of
                         ``weight`` (0 before the first estimate)
    grad_sq_norm         the same: the bias-corrected average of the          float32
                         estimates of ``|G|^2``
    grad_variance        the same: of the estimates of ``tr(Sigma)``          float32
    learning_rate        ``optax.inject_hyperparams(...)(learning_rate=...)`` float32
    spikes               ``spike_guard``: steps clipped or skipped as spikes  int32
    norm_mean            ``spike_guard``: running mean of the gradient norm   float32
    norm_std             ``spike_guard``: running standard deviation of it    float32
    grad_norm/<label>    ``group_norms``: the norm of the group ``<label>``   float32
    ==================== ==================================================== =======

    When a transform occurs more than once, the first state found in tree
    order is reported. ``grad_norm`` comes from whichever of
    ``clip_by_global_norm`` and ``spike_guard`` is first in tree order: a
    wrapper comes before what it wraps and an earlier element of a chain
    before a later one, so it is the norm of the gradients as the first of
    them received them. In ``spike_guard(chain(clip_by_global_norm(...),
    adam))`` it is the guard's, this step's norm before the guard.

    Args:
      opt_state: any optax optimizer state.

    Returns:
      A dict of scalar arrays (empty when ``opt_state`` holds none of the
      states above: ``freeze`` and ``param_groups`` report only what their
      inner transforms do). It can be returned from a jitted function.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = gradtools.dynamic_loss_scale(optax.sgd(0.1))
      >>> m = gradtools.metrics(tx.init({'w': jnp.zeros(2)}))
      >>> float(m['loss_scale']), int(m['skipped_steps'])
      (32768.0, 0)
    """
    # jnp.asarray: a flax.nnx.Optimizer keeps each state leaf in a Variable.
    out: dict[str, jax.Array] = {}
    for key, cls, field in _SOURCES:
        state = _first(opt_state, cls)
        if state is not None:
            out[key] = jnp.asarray(getattr(state, field))
    scaler = _first(opt_state, LossScaleState)
    if scaler is not None:
        flags = jnp.asarray(scaler.nonfinite_leaves)
        out["nonfinite_leaf_count"] = jnp.sum(flags, dtype=jnp.int32)
    first = _first(opt_state, tuple(_GRAD_NORM_STATES))
    if first is not None:
        out["grad_norm"] = jnp.asarray(getattr(first, _GRAD_NORM_STATES[type(first)]))
    guard = _first(opt_state, SpikeGuardState)
    if guard is not None:
        out["spikes"] = jnp.asarray(guard.spikes)
        out["norm_mean"] = jnp.asarray(guard.norm_mean)
        out["norm_std"] = jnp.sqrt(jnp.asarray(guard.norm_var))
    groups = _first(opt_state, GroupNormsState)
    if groups is not None:
        for label, norm in groups.group_grad_norms.items():
            out[f"grad_norm/{label}"] = jnp.asarray(norm)
    noise = _first(opt_state, _noise_scale.NoiseScaleState)
    if noise is not None:
        out.update(_noise_scale.report(noise))
    found = optax.tree.get_all_with_path(opt_state, _HYPERPARAM_STATE)
    rates = [s.hyperparams["learning_rate"] for _, s in found if "learning_rate" in s.hyperparams]
    if rates:
        # optax keeps it in the params' dtype (or as given: an int): report float32
        out["learning_rate"] = jnp.asarray(rates[0]).astype(jnp.float32)
    return out


def nonfinite_leaves(opt_state: optax.OptState, params: Any) -> list[str]:
    """The parameters whose gradients overflowed in the last step the loss scaler skipped.

    The outermost loss scaler in ``opt_state`` keeps one flag per leaf of the
    params (agreed across devices with ``axis_name``: a leaf is listed if it
    overflowed on any), set when a step is skipped for non-finite gradients.

    Args:
      opt_state: the state of a transformation that contains a loss scaler.
      params: the params the scaler was given (the tree ``init`` saw).

    Returns:
      The path names (as :func:`gradtools.path_names` spells them) of those
      leaves, in tree order; ``[]`` if no step was skipped.

    Raises:
      ValueError: if ``opt_state`` holds no loss-scale state, or ``params``
        has another number of leaves than the scaler's params.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = gradtools.dynamic_loss_scale(optax.sgd(0.1))
      >>> params = {'a': jnp.zeros(2), 'b': jnp.zeros(2)}
      >>> _, state = tx.update({'a': jnp.ones(2), 'b': jnp.array([1.0, jnp.inf])},
      ...                      tx.init(params), params)
      >>> gradtools.nonfinite_leaves(state, params)
      ['b']
    """
    found = _tree.find(opt_state, LossScaleState)
    if not found:
        raise ValueError(
            "nonfinite_leaves: opt_state holds no LossScaleState. Wrap the optimizer, e.g. "
            "gradtools.dynamic_loss_scale(optax.adam(1e-3))"
        )
    _, outermost = min(found, key=lambda pair: len(pair[0]))
    flags = np.asarray(outermost.nonfinite_leaves)
    names = jax.tree.leaves(path_names(params))
    if len(names) != flags.size:
        raise ValueError(
            f"nonfinite_leaves: params has {len(names)} leaves, the loss scaler's params had "
            f"{flags.size}: pass the params the scaler was given"
        )
    return [n for n, bad in zip(names, flags) if bad]


def _first(tree: Any, classes: type | tuple[type, ...]) -> Any:
    """The first node of ``tree``, in tree order, that is an instance of ``classes``; or None."""
    found = _tree.find(tree, classes)
    return found[0][1] if found else None
