"""Reductions of a whole tree of gradients, in float32: its global norm, and whether it is finite.

Whatever the leaves' dtypes, every sum is accumulated in float32, and the
per-leaf scalars are stacked 32 at a time (:func:`gradtools._tuning.stack_scalars`)
so that compile time stays linear in the number of leaves. The clip, the spike
guard and the group norms take their norms here; the loss scalers and
``accumulate`` their finiteness.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gradtools import _checks
from gradtools import _tree
from gradtools import _tuning

__all__ = ["all_finite", "l2_norm", "norm_type", "square_sums", "tree_norm"]


def norm_type(norm_type: Any) -> Any:
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


def tree_norm(tree: Any, p: Any) -> jax.Array:
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


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every leaf of ``tree`` is finite.

    Args:
      tree: a pytree of arrays; ``None`` leaves and empty trees are allowed.

    Returns:
      A scalar bool array, ``True`` for an empty tree.

    Raises:
      TypeError: if a leaf is not a numeric array or number.

    Example:
      >>> import jax.numpy as jnp
      >>> bool(gradtools.all_finite({'a': jnp.ones(3), 'b': jnp.array([1.0, jnp.inf])}))
      False
    """
    leaves = _checks.numeric_leaves("all_finite", "tree", tree)
    flags = [jnp.all(jnp.isfinite(x)) for x in leaves]
    # stacked 32 at a time: one fusion of a flag per leaf compiles superlinearly in their number
    return jnp.all(_tuning.stack_scalars(flags)) if flags else jnp.array(True)


def square_sums(leaves: list[jax.Array]) -> list[jax.Array]:
    """Each leaf's float32 sum of squares."""
    return [jnp.sum(jnp.square(jnp.asarray(x).astype(jnp.float32))) for x in leaves]


def l2_norm(sums: list[jax.Array]) -> jax.Array:
    """The L2 norm of leaves whose float32 sums of squares are ``sums`` (0 for none)."""
    if not sums:
        return jnp.zeros([], jnp.float32)
    return jnp.sqrt(jnp.sum(_tuning.stack_scalars(sums)))
