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

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradtools import _checks
from gradtools import _norms
from gradtools import _square_sums
from gradtools import _tree

__all__ = ["ClipByGlobalNormState", "clip_by_global_norm", "global_norm"]


class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm`.

    Attributes:
      grad_norm: the global norm of the last update before clipping (0 after
        ``init``; inf or NaN if that update was not finite).
    """

    grad_norm: jax.Array  # shape=(), dtype=float32

    takes_square_sums = True  # from a loss scaler or spike_guard right outside (_square_sums)

    def metrics(self) -> dict[str, jax.Array]:
        """What :func:`gradtools.metrics` reports of this state."""
        return {"grad_norm": jnp.asarray(self.grad_norm)}


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
    return _norms.tree_norm(tree, _norms.norm_type(norm_type))


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
    :func:`gradtools.dynamic_loss_scale`, :func:`gradtools.fixed_loss_scale`
    or :func:`gradtools.spike_guard` (as the wrapped transformation, or first
    in an ``optax.chain`` that is), the L2 norm costs no pass of its own: the
    wrapper's own pass over the gradients gave the sums of squares, and it
    hands them to the clip with the clip's state.

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
    p = _norms.norm_type(norm_type)

    def init_fn(params):
        del params
        return ClipByGlobalNormState(grad_norm=jnp.zeros([], jnp.float32))

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        state, sums = _square_sums.take(state, updates)
        _checks.state_of("clip_by_global_norm", state, ClipByGlobalNormState)
        _checks.real_leaves("clip_by_global_norm", "updates", updates, floating=True)
        if isinstance(p, float) and p == 2 and sums is not None:  # summed by a loss scaler
            norm = _norms.l2_norm(sums)
        else:
            norm = _norms.tree_norm(updates, p)
        limit = jnp.asarray(max_norm, jnp.float32)
        s, divisor = _tree.split_divisor(norm)  # max_norm / norm may be subnormal
        one = jnp.ones([], jnp.float32)
        factors = jnp.where(norm > limit, s, one), jnp.where(norm > limit, limit / divisor, one)
        return _tree.scale_f32(updates, *factors), ClipByGlobalNormState(grad_norm=norm)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
