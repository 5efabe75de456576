"""Diagnostics read out of any optimizer state.

Every gradtools transform keeps what a training loop wants to log (the loss
scale, skipped steps, the gradient norm, the position in an accumulation
window) in its NamedTuple state, and the state says what it reports: a state
class with a method ``metrics(self) -> dict[str, jax.Array]`` reports those
values. :func:`metrics` finds such states at any depth of an ``opt_state``
(inside ``optax.chain``, ``optax.inject_hyperparams``, parameter groups, other
wrappers) and returns their values as one flat dict, ready to log or to return
from a jitted step. A wrapper written outside gradtools reports its own
metrics the same way, with no change here.
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradtools import _compat
from gradtools import _tree
from gradtools.loss_scale import LossScaleState
from gradtools.naming import path_names

__all__ = ["metrics", "nonfinite_leaves"]


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

    Each state reports through its class's method ``metrics(self) -> dict[str,
    jax.Array]``: a state of your own that defines it is reported here too,
    its keys beside these. Each key comes from the first state in tree order
    that reports it, so where a transform occurs more than once the first
    is reported. ``grad_norm`` comes from whichever of
    ``clip_by_global_norm`` and ``spike_guard`` is first in tree order: a
    wrapper comes before what it wraps and an earlier element of a chain
    before a later one, so it is the norm of the gradients as the first of
    them received them. In ``spike_guard(chain(clip_by_global_norm(...),
    adam))`` it is the guard's, this step's norm before the guard.

    Args:
      opt_state: any optax optimizer state.

    Returns:
      A dict of arrays, scalars but for what a state of your own reports
      (empty when ``opt_state`` holds no state that reports: ``freeze`` and
      ``param_groups`` report only what their inner transforms do). It can
      be returned from a jitted function.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = gradtools.dynamic_loss_scale(optax.sgd(0.1))
      >>> m = gradtools.metrics(tx.init({'w': jnp.zeros(2)}))
      >>> float(m['loss_scale']), int(m['skipped_steps'])
      (32768.0, 0)
    """
    out: dict[str, jax.Array] = {}
    for state in _reporting(opt_state):
        for key, value in state.metrics().items():
            out.setdefault(key, jnp.asarray(value))
    hyper = [s.hyperparams for s in _compat.hyperparam_states(opt_state)]
    rates = [h["learning_rate"] for h in hyper if "learning_rate" in h]
    if rates and "learning_rate" not in out:
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


def _reports(node: Any) -> bool:
    """Whether ``node``'s class defines the ``metrics`` method of the protocol."""
    return inspect.isfunction(getattr(type(node), "metrics", None))


def _reporting(tree: Any) -> list[Any]:
    """Every node of ``tree`` that reports metrics, in tree order: a wrapper's state before
    the states inside it, an earlier element of a chain before a later one."""
    found = [tree] if _reports(tree) else []
    inside = jax.tree.leaves(tree, is_leaf=lambda x: x is not tree and _reports(x))
    for node in inside:
        if _reports(node):
            found += _reporting(node)
    return found
