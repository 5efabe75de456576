"""Diagnostics read out of any optimizer state.

Every gradtools transform keeps what a training loop wants to log (the loss
scale, skipped steps, the gradient norm, the position in an accumulation
window) in a uniquely named NamedTuple state. :func:`metrics` finds those
states at any depth of an ``opt_state`` (inside ``optax.chain``,
``optax.inject_hyperparams``, parameter groups, other wrappers) and returns the
values as a flat dict, ready to log or to return from a jitted step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from gradtools import _noise_scale

__all__ = ["metrics"]

# (metric key, state class name, field): the first state of that class found in
# the tree supplies the metric.
_SOURCES = (
    ("loss_scale", "LossScaleState", "loss_scale"),
    ("skipped_steps", "LossScaleState", "skipped_steps"),
    ("finite", "LossScaleState", "finite"),
    ("grad_norm", "ClipByGlobalNormState", "grad_norm"),
    ("micro_step", "AccumulateState", "micro_step"),
    ("dropped_micro_steps", "AccumulateState", "dropped_micro_steps"),
    ("window_size", "AccumulateState", "window_size"),
)
# The state of optax.inject_hyperparams (optax's InjectHyperparamsState is no
# longer produced by it).
_HYPERPARAM_STATE = "InjectStatefulHyperparamsState"


def metrics(opt_state: optax.OptState) -> dict[str, jax.Array]:
    """Collects the diagnostics of every gradtools transform in ``opt_state``.

    Keys are present only when the matching transform is:

    =================== =================================================== =======
    key                 from                                                dtype
    =================== =================================================== =======
    loss_scale          ``dynamic_loss_scale`` / ``fixed_loss_scale``        float32
    skipped_steps       the same: non-finite steps so far                   int32
    finite              the same: whether the last step was finite          bool
    grad_norm           ``clip_by_global_norm``: the norm before clipping   float32
    micro_step          ``accumulate``: micro-batches in the open window    int32
    dropped_micro_steps ``accumulate``: non-finite micro-batches dropped    int32
                        (``on_nonfinite='skip_microstep'``)
    window_size         ``accumulate``: the open window's length            int32
                        (``every_k``, or what its schedule gave)
    noise_scale         ``accumulate(noise_scale=True)``: the gradient      float32
                        noise scale ``grad_variance / grad_sq_norm``, in
                        units of ``weight`` (0 before the first estimate)
    grad_sq_norm        the same: the bias-corrected average of the         float32
                        estimates of ``|G|^2``
    grad_variance       the same: of the estimates of ``tr(Sigma)``         float32
    learning_rate       ``optax.inject_hyperparams(...)(learning_rate=...)`` float32
    =================== =================================================== =======

    When a transform occurs more than once, the first state found in tree
    order is reported.

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
      >>> sorted(m), float(m['loss_scale'])
      (['finite', 'loss_scale', 'skipped_steps'], 32768.0)
    """
    # jnp.asarray: a flax.nnx.Optimizer keeps each state leaf in a Variable.
    out: dict[str, jax.Array] = {}
    for key, cls, field in _SOURCES:
        found = optax.tree.get_all_with_path(opt_state, cls)
        if found:
            out[key] = jnp.asarray(getattr(found[0][1], field))
    found = optax.tree.get_all_with_path(opt_state, "NoiseScaleState")
    if found:
        out.update(_noise_scale.report(found[0][1]))
    found = optax.tree.get_all_with_path(opt_state, _HYPERPARAM_STATE)
    rates = [s.hyperparams["learning_rate"] for _, s in found if "learning_rate" in s.hyperparams]
    if rates:
        # optax keeps it in the params' dtype (or as given: an int): report float32
        out["learning_rate"] = jnp.asarray(rates[0]).astype(jnp.float32)
    return out
