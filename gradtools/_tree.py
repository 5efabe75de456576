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
    """Zeros for a pytree of arrays or ``jax.ShapeDtypeStruct``s."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
