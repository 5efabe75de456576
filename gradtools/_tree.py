"""Small pytree helpers shared by the transforms."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["match_types", "scale_f32", "zeros_like"]


def scale_f32(tree: Any, factor: jax.Array) -> Any:
    """Multiplies every leaf by a scalar in float32 (float64 leaves in float64), then casts back.

    Args:
      tree: a pytree of arrays (``None`` leaves are kept as ``None``).
      factor: a scalar; a float32 value.

    Returns:
      The scaled pytree, each leaf in its own dtype. A factor of 1 returns
      every leaf bit for bit (subnormals aside: XLA:CPU flushes them to zero).
    """
    factor = jnp.asarray(factor, jnp.float32)

    def one(g: jax.Array) -> jax.Array:
        wide = jnp.float64 if g.dtype == jnp.float64 else jnp.float32
        return (g.astype(wide) * factor.astype(wide)).astype(g.dtype)

    return jax.tree.map(one, tree)


def zeros_like(tree: Any) -> Any:
    """Zeros typed like the leaves of ``tree`` (arrays, or types from ``jax.typeof``).

    Traced, they are laid out like their leaf on explicit mesh axes (newer
    jax gives traced zeros no layout otherwise), and inside ``jax.shard_map``
    they vary over the mesh axes their leaf varies over, as the two branches
    of a ``lax.cond`` must agree on both.
    """

    def zeros(x: Any) -> jax.Array:
        traced = isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array)
        t = jax.typeof(x) if isinstance(x, jax.Array) else x
        out = jnp.zeros(t.shape, t.dtype) if traced else jnp.zeros_like(x)
        sharding = getattr(t, "sharding", None)
        if traced and any(getattr(sharding, "spec", ())):
            out = jax.sharding.reshard(out, sharding)
        return match_types(out, t)

    return jax.tree.map(zeros, tree)


def match_types(tree: Any, types: Any) -> Any:
    """``tree``, each leaf given the dtype and the ``shard_map`` axes of its match in ``types``.

    The two branches of a ``lax.cond`` must agree on both, and the branch that
    skips an optimizer step returns zeros or the old state where the other
    returns the optimizer's outputs: optax may promote state dtypes on the
    first update, and inside ``jax.shard_map`` those outputs vary over the
    mesh axes the gradients vary over. Marking a value as varying moves no data.
    """

    def one(x: Any, like: Any) -> Any:
        if jnp.dtype(x.dtype) != jnp.dtype(like.dtype):
            x = x.astype(like.dtype)
        missing = tuple(_varying(like) - _varying(jax.typeof(x)))
        if not missing:
            return x
        if hasattr(jax.lax, "pcast"):  # it replaced pvary in jax 0.8.2
            return jax.lax.pcast(x, missing, to="varying")
        return jax.lax.pvary(x, missing)  # pyright: ignore[reportAttributeAccessIssue]

    return jax.tree.map(one, tree, types)


def _varying(aval: Any) -> frozenset[Any]:
    """The mesh axes an abstract value varies over inside ``jax.shard_map``."""
    manual = getattr(aval, "manual_axis_type", None)  # newer jax
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", None) or ())  # older jax
