"""Small pytree helpers shared by the transforms."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["distinct_scalars", "scale_f32", "zeros_like_shapes"]


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
    """Zeros for a pytree of arrays or ``jax.ShapeDtypeStruct``s.

    Used for the updates of a step that does no optimizer work (a skipped
    loss-scale step, an empty window). XLA merges the identical
    ``broadcast(0)`` of leaves that share a shape and dtype, and XLA:CPU then
    copies that one buffer into each ``lax.cond`` output: a second pass over
    the updates on such (rare) steps. Keeping the zeros apart behind
    ``lax.optimization_barrier``s costs more than it saves: at 500 leaves it
    made XLA's compile time of a loss-scaled optimizer 1.7x longer, and the
    growth faster than linear in the number of leaves.
    """
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def distinct_scalars(value: jax.Array, leaves: list[jax.Array]) -> list[jax.Array]:
    """One float32 copy of a scalar per leaf, which XLA cannot merge back into one.

    XLA merges the ``broadcast(scalar)`` of every leaf with the same shape into
    one instruction; XLA:CPU then writes it out as a parameter-sized array and
    reads it in every fusion that multiplies by the scalar, and will not fuse
    the product into a reduction. Passing the scalar through a
    ``lax.optimization_barrier`` together with its leaf gives every leaf its
    own scalar, so every broadcast stays inside its own fusion. (One vector
    sliced per leaf would do the same, but its many users make XLA's compile
    time grow faster than linearly in the number of leaves.) The values are
    exactly ``value``.
    """
    value = jnp.asarray(value, jnp.float32)
    return [jax.lax.optimization_barrier((value, x))[0] for x in leaves]
