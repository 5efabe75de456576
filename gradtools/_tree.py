"""Small pytree helpers shared by the transforms."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["scale_f32", "zeros_like_shapes"]


def scale_f32(tree: Any, factor: jax.Array, like: Any = None) -> Any:
    """Multiplies every leaf by a scalar in float32, then casts.

    Args:
      tree: a pytree of arrays (``None`` leaves are kept as ``None``).
      factor: a scalar, multiplied in float32.
      like: optional pytree with the structure of ``tree``; each result is cast
        to the dtype of its matching leaf. Without it results stay float32.

    Returns:
      The scaled pytree.
    """
    factor = jnp.asarray(factor, jnp.float32)
    if like is None:
        return jax.tree.map(lambda g: g.astype(jnp.float32) * factor, tree)
    return jax.tree.map(lambda g, p: (g.astype(jnp.float32) * factor).astype(p.dtype), tree, like)


def zeros_like_shapes(shapes: Any) -> Any:
    """Zeros for a pytree of arrays or ``jax.ShapeDtypeStruct``s, one computation a leaf.

    XLA merges identical ``broadcast(0)``s of leaves that share a shape and
    dtype; when they leave a ``lax.cond`` branch as separate outputs, XLA:CPU
    then copies the one buffer into every output (two memory passes per leaf
    instead of one write). Broadcasting a distinct element of a small vector
    hidden behind ``lax.optimization_barrier`` keeps them apart.
    """
    leaves, treedef = jax.tree.flatten(shapes)
    if not leaves:
        return jax.tree.unflatten(treedef, [])
    seeds = jax.lax.optimization_barrier(jnp.zeros(len(leaves), jnp.float32))
    return jax.tree.unflatten(
        treedef,
        [jnp.broadcast_to(seeds[i].astype(s.dtype), s.shape) for i, s in enumerate(leaves)],
    )
