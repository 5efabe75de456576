"""Global-norm gradient clipping that is safe for float16 and bfloat16 gradients.

``optax.clip_by_global_norm`` sums squares in the gradients' own dtype: a float16
gradient whose entries reach 256 squares to more than float16's maximum
(65504), the norm becomes inf and every update becomes zero (or NaN). Here the
norm is always accumulated in float32, and clipping multiplies each leaf by one
precomputed float32 factor, so it costs one read of the gradients for the norm
and nothing per element that XLA cannot fuse into the optimizer that follows.

Put the clip inside the loss scaler, so that it sees unscaled gradients (and
takes the sums of squares the scaler computes anyway)::

    tx = gradtools.dynamic_loss_scale(
        optax.chain(gradtools.clip_by_global_norm(1.0), optax.adam(1e-3)))
"""

from __future__ import annotations

import functools
import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradtools import _checks
from gradtools import _tree
from gradtools import _tuning

__all__ = ["ClipByGlobalNormState", "clip_by_global_norm", "global_norm"]


class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm`.

    Attributes:
      grad_norm: the global norm of the last update before clipping (0 after
        ``init``; inf or NaN if that update was not finite).
    """

    grad_norm: jax.Array  # shape=(), dtype=float32


def _norm_type(norm_type: Any) -> Any:
    """Validates ``norm_type``: a Python float, or a tracer (not checked)."""
    if _checks.traced(norm_type):
        return norm_type
    message = f"{norm_type=} must be a number >= 1 or float('inf')"
    try:
        p = _checks.real_number("norm_type", norm_type)  # refuses bools, strings, complex
    except ValueError as err:
        raise ValueError(f"{message}: {err}") from None
    if math.isnan(p) or p < 1:
        raise ValueError(message)
    return p


def _magnitudes(leaves: list[jax.Array]) -> list[jax.Array]:
    # |x| is exact in any dtype; everything after it is float32.
    return [jnp.abs(x).astype(jnp.float32) for x in leaves]


def _fixed_norm(leaves: list[jax.Array], p: float) -> jax.Array:
    """The p-norm of all leaves for a Python float ``p``."""
    # optax.tree.norm(ord=p), in float32 and with the per-leaf reductions stacked 32 at a
    # time (_tuning.stack_scalars): one fusion over every leaf compiles superlinearly.
    mags = _magnitudes(leaves)
    if p == 2:
        return jnp.sqrt(jnp.sum(_tuning.stack_scalars([jnp.sum(m * m) for m in mags])))
    if p == math.inf:
        return jnp.max(_tuning.stack_scalars([jnp.max(m, initial=0.0) for m in mags]))
    if p == 1:
        return jnp.sum(_tuning.stack_scalars([jnp.sum(m) for m in mags]))
    return _scaled_norm(leaves, p)


def _scaled_norm(leaves: list[jax.Array], p: Any) -> jax.Array:
    """Any finite p (also traced): sum (|x| / max|x|) ** p cannot overflow float32."""
    mags = _magnitudes(leaves)
    big = _fixed_norm(leaves, math.inf)
    unit = jnp.where(jnp.isfinite(big) & (big > 0), big, jnp.ones([], jnp.float32))
    s, divisor = _tree.split_divisor(unit)
    total = jnp.sum(_tuning.stack_scalars([jnp.sum((m * s / divisor) ** p) for m in mags]))
    return unit * total ** (1.0 / p)


def _global_norm(tree: Any, p: Any) -> jax.Array:
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
    if not leaves:
        return jnp.zeros([], jnp.float32)
    if isinstance(p, float):
        return _fixed_norm(leaves, p)
    # A traced p (optax.inject_hyperparams injects norm_type too): run only the
    # branch it selects, so p = 2 still costs one pass.
    p = jnp.asarray(p, jnp.float32)
    index = jnp.select([p == 1, p == 2, p == jnp.inf], [0, 1, 2], 3)
    branches = [functools.partial(_fixed_norm, p=q) for q in (1.0, 2.0, math.inf)]
    branches.append(functools.partial(_scaled_norm, p=p))
    return lax.switch(index, branches, leaves)


def global_norm(tree: Any, norm_type: float = 2.0) -> jax.Array:
    """The p-norm of all elements of all leaves of ``tree``, taken together.

    ``norm = (sum over leaves and elements of |x| ** p) ** (1 / p)``, or
    ``max |x|`` for ``p = inf``, accumulated in float32 whatever the leaves'
    dtypes. L1, L2 and L-inf read the tree once; other ``p`` read it twice,
    scaling by ``max |x|`` first so that ``|x| ** p`` cannot overflow. The L2
    norm sums plain float32 squares, as optax and PyTorch do: beyond about
    1.8e19 (gradients that have blown up) it comes out as inf.

    Args:
      tree: a pytree of arrays (fp32, bf16, fp16 mixed; ``None`` leaves and
        empty trees allowed).
      norm_type: ``p``, any number >= 1, or ``float('inf')``; as
        ``torch.nn.utils.clip_grad_norm_``'s ``norm_type``. A traced value
        (``optax.inject_hyperparams`` injects it) is not checked.

    Returns:
      A float32 scalar; 0 for an empty tree; inf or NaN if an element is;
      inf for an L2 norm beyond about 1.8e19.

    Raises:
      TypeError: if a leaf of ``tree`` is not a real numeric array or number.
      ValueError: if ``norm_type`` is below 1, NaN or not a number.

    Example:
      >>> import jax.numpy as jnp
      >>> g = {'a': jnp.full(4, 300.0, jnp.float16)}    # 300**2 overflows fp16
      >>> gradtools.global_norm(g)
      Array(600., dtype=float32)
      >>> gradtools.global_norm({'a': jnp.array([3.0, -4.0])}, norm_type=1)
      Array(7., dtype=float32)
    """
    _checks.real_leaves("global_norm", "tree", tree)
    return _global_norm(tree, _norm_type(norm_type))


def _known(updates: Any, leaves: list[jax.Array], sums: list[jax.Array]) -> list[jax.Array]:
    """Each leaf's float32 sum of squares: from ``sums`` for the very arrays in ``leaves``.

    Identity is the contract of ``square_sums``: the sums belong to those very
    arrays (tracers, under ``jit``). A transformation between the loss scaler
    and this one makes new arrays, whose sums are then computed here; no other
    property of an array can tell that it was not changed on the way.
    """
    given = {id(x): (x, s) for x, s in zip(leaves, sums, strict=True)}
    out = []
    for x in jax.tree.leaves(updates):
        x_, s = given.get(id(x), (None, None))
        out.append(s if x_ is x else jnp.sum(jnp.square(jnp.asarray(x).astype(jnp.float32))))
    return out or [jnp.zeros([], jnp.float32)]


def clip_by_global_norm(
    max_norm: float, *, norm_type: float = 2.0
) -> optax.GradientTransformationExtraArgs:
    """Scales the updates down so that their global norm is at most ``max_norm``.

    Each ``update(updates, state, params=None)`` does::

      norm = global_norm(updates, norm_type)             # float32
      factor = max_norm / norm if norm > max_norm else 1 # 0 for an inf norm
      updates = (updates * factor).astype(updates.dtype) # one float32 scalar
      grad_norm = norm                                   # kept for metrics()

    Updates whose norm is at most ``max_norm`` pass unchanged, bit for bit
    (XLA:CPU flushes subnormals to zero). An inf norm (an inf gradient, or an
    L2 norm beyond float32's range) scales the updates by 0; a NaN norm lets
    them pass, so that a loss scaler or ``optax.apply_if_finite`` around the
    optimizer sees the NaN and skips the step. Inside a loss scaler a skipped
    step leaves ``grad_norm`` as it was. Right inside
    :func:`gradtools.dynamic_loss_scale` or :func:`gradtools.fixed_loss_scale`
    the L2 norm costs no pass of its own: the scaler passes the sums of
    squares of the gradients it hands on as the extra argument
    ``square_sums=(leaves, sums)``, used for those very arrays only.

    Args:
      max_norm: the largest global norm let through; finite and > 0. May be
        scheduled with ``optax.inject_hyperparams``.
      norm_type: ``p`` of the norm: any number >= 1, or ``float('inf')``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`ClipByGlobalNormState`.

    Raises:
      ValueError: if ``max_norm`` is not finite and > 0, or ``norm_type`` is
        below 1, NaN or not a number.

    Example:
      >>> import jax.numpy as jnp
      >>> tx = gradtools.clip_by_global_norm(1.0)
      >>> updates, state = tx.update({'w': jnp.array([3.0, 4.0])}, tx.init(None))
      >>> updates['w'], gradtools.metrics(state)['grad_norm']
      (Array([0.6, 0.8], dtype=float32), Array(5., dtype=float32))

    References:
      Pascanu et al., `On the difficulty of training recurrent neural networks
      <https://arxiv.org/abs/1211.5063>`_, 2013. ``optax.clip_by_global_norm``,
      ``torch.nn.utils.clip_grad_norm_`` and MindSpore's
      ``ops.clip_by_global_norm``; ``docs/guides`` list the differences.
    """
    _checks.finite_positive("max_norm", max_norm)
    p = _norm_type(norm_type)

    def init_fn(params):
        del params
        return ClipByGlobalNormState(grad_norm=jnp.zeros([], jnp.float32))

    def update_fn(updates, state, params=None, *, square_sums=None, **extra_args):
        del params, extra_args
        _checks.state_of("clip_by_global_norm", state, ClipByGlobalNormState)
        _checks.real_leaves("clip_by_global_norm", "updates", updates, floating=True)
        if isinstance(p, float) and p == 2 and square_sums is not None:  # summed by a loss scaler
            norm = jnp.sqrt(jnp.sum(_tuning.stack_scalars(_known(updates, *square_sums))))
        else:
            norm = _global_norm(updates, p)
        limit = jnp.asarray(max_norm, jnp.float32)
        s, divisor = _tree.split_divisor(norm)  # max_norm / norm may be subnormal
        one = jnp.ones([], jnp.float32)
        factors = jnp.where(norm > limit, s, one), jnp.where(norm > limit, limit / divisor, one)
        return _tree.scale_f32(updates, *factors), ClipByGlobalNormState(grad_norm=norm)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
