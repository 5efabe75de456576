"""Small pytree helpers shared by the transforms."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gradtools import _checks

__all__ = ["f32", "find", "match_types", "scale_f32", "split_divisor", "zeros_of_types"]


def f32(x: Any) -> jax.Array:
    """``x`` as a float32 array."""
    return jnp.asarray(x).astype(jnp.float32)


def scale_f32(tree: Any, *factors: jax.Array) -> Any:
    """Multiplies every leaf by scalar factors in float32 (float64 in float64), then casts back.

    Args:
      tree: a pytree of arrays or numbers (``None`` leaves are kept as ``None``).
      *factors: float32 scalars, applied one after the other before the cast.

    Returns:
      The scaled pytree, each leaf in its own dtype. Factors of 1 return
      every leaf bit for bit (subnormals aside: XLA:CPU flushes them to zero).
    """
    factors = tuple(jnp.asarray(f, jnp.float32) for f in factors)

    def one(g: Any) -> jax.Array:
        g = jnp.asarray(g)  # a Python float leaf
        wide = jnp.float64 if g.dtype == jnp.float64 else jnp.float32
        x = g.astype(wide)
        for f in factors:
            x = x * f.astype(wide)
        return x.astype(g.dtype)

    return jax.tree.map(one, tree)


def split_divisor(d: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(s, d * s)``: ``x / d == (x * s) / (d * s)``, where ``1 / (d * s)`` is a normal float32.

    XLA:CPU divides by multiplying with the reciprocal, which for ``d`` above
    2**126 is subnormal and flushed to zero; ``s`` is 2**-64 there, else 1.
    """
    s = jnp.where(d > 2.0**100, jnp.float32(2.0**-64), jnp.float32(1.0))
    return s, d * s


def zeros_of_types(tree: Any) -> Any:
    """Zeros typed like the leaves of ``tree`` (arrays, or types from ``jax.typeof``).

    Unlike ``optax.tree.zeros_like``, it takes types as well as arrays, and:

    traced, the zeros are laid out like their leaf on explicit mesh axes (newer
    jax gives traced zeros no layout otherwise), and inside ``jax.shard_map``
    they vary over the mesh axes their leaf varies over, as the two branches
    of a ``lax.cond`` must agree on both.
    """

    def zeros(x: Any) -> jax.Array:
        t = jax.typeof(x) if isinstance(x, jax.Array) else x
        out = jnp.zeros_like(x) if isinstance(x, jax.Array) else jnp.zeros(t.shape, t.dtype)
        if _checks.traced(out) and any(getattr(getattr(t, "sharding", None), "spec", ())):
            out = jax.sharding.reshard(out, t.sharding)
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

    def varying(aval: Any) -> frozenset[Any]:
        manual = getattr(aval, "manual_axis_type", None)  # newer jax; older jax keeps vma
        return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()) or ())

    def one(x: Any, like: Any) -> Any:
        x = jnp.asarray(x)  # an optax state may hold a Python number
        x = x if x.dtype == like.dtype else x.astype(like.dtype)  # keeps a weak type
        missing = tuple(varying(like) - varying(jax.typeof(x)))
        if not missing:
            return x
        if hasattr(jax.lax, "pcast"):  # it replaced pvary in jax 0.8.2
            return jax.lax.pcast(x, missing, to="varying")
        return jax.lax.pvary(x, missing)  # pyright: ignore[reportAttributeAccessIssue]

    return jax.tree.map(one, tree, types)


def find(tree: Any, classes: type | tuple[type, ...]) -> list[tuple[Any, Any]]:
    """``(path, node)`` of every node of ``tree`` that is an instance of ``classes``, in tree
    order (a state inside an ``nnx.Optimizer`` or a restored checkpoint keeps its class)."""
    found, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, classes))
    return [(path, x) for path, x in found if isinstance(x, classes)]
