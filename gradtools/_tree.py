"""Small pytree helpers shared by the transforms."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "check_like",
    "distinct_scalars",
    "match_types",
    "reduce_scalars",
    "scale_f32",
    "square_sum",
    "square_sums_known",
    "zeros_like_shapes",
]

_MAX_SHOWN = 10  # how many differing paths an error message lists
_FAN_IN = 32  # scalars combined by one fusion in reduce_scalars


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

    def zeros(s: Any) -> jax.Array:
        # Under explicit mesh axes a type carries its sharding, which lax.cond's
        # two branches must agree on; elsewhere the spec has no axes to keep.
        sharding = getattr(s, "sharding", None)
        if any(getattr(sharding, "spec", ())):
            return jnp.zeros(s.shape, s.dtype, out_sharding=sharding)
        return jnp.zeros(s.shape, s.dtype)

    return jax.tree.map(zeros, shapes)


def match_types(tree: Any, types: Any) -> Any:
    """``tree``, each leaf given the dtype and the varying mesh axes of its match in ``types``.

    The branches of a ``lax.cond`` must agree on both. The branch that skips
    an optimizer step returns zeros, or the state it was given, where the
    other returns the optimizer's outputs, which may differ:

    - in dtype: optax promotes some state on its first update (Adam's moments
      of a bfloat16 param become float32 under
      ``inject_hyperparams(..., hyperparam_dtype=jnp.float32)``, whose ``b1``
      and ``b2`` are then float32 arrays); the old state is cast to match;
    - in mesh axes: inside ``jax.shard_map`` (with its default
      ``check_vma=True``) a step on gradients that differ between devices
      returns updates and state that vary over the mesh axis. Marking the
      skip branch's outputs as varying alike is free: no data moves.

    Outside ``shard_map``, and without a promotion, ``tree`` comes back as it is.

    Args:
      tree: the outputs of the branch that runs no optimizer.
      types: the types of the other branch's outputs (``jax.typeof`` of each
        leaf, as :func:`gradtools._apply.recorded` keeps them), same structure.

    Returns:
      ``tree`` with matching dtypes and the missing axes marked.
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


def reduce_scalars(scalars: list[jax.Array], reduce: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """``reduce(jnp.stack(scalars))``, combined in groups of at most 32.

    One value per leaf (a finiteness flag, a sum of squares) must be combined
    into one. XLA fuses a flat combination of ``n`` scalars into one kernel
    with ``n`` inputs, and LLVM's time to compile that kernel grows faster than
    linearly: at 1000 leaves it alone took 9 of a loss scaler's 27 s of
    compile time. Here each level combines groups of 32 and a
    ``lax.optimization_barrier`` keeps XLA from fusing the levels back into
    one, so every kernel has at most 32 inputs. For sums the grouping is
    a different summation order than a flat ``jnp.sum`` (float32 rounding).

    Args:
      scalars: a non-empty list of scalar arrays of one dtype.
      reduce: reduces a 1-D array to a scalar (``jnp.all``, ``jnp.sum``, ``jnp.max``).

    Returns:
      The combined scalar.
    """
    while len(scalars) > _FAN_IN:
        groups = [scalars[i : i + _FAN_IN] for i in range(0, len(scalars), _FAN_IN)]
        scalars = list(jax.lax.optimization_barrier([reduce(jnp.stack(g)) for g in groups]))
    return reduce(jnp.stack(scalars))


#: id(array) -> (array, its float32 sum of squares), for the arrays being traced.
_KNOWN: contextvars.ContextVar[dict[int, tuple[jax.Array, jax.Array]]]
_KNOWN = contextvars.ContextVar("gradtools_square_sums", default={})  # noqa: B039 (never mutated)


def square_sum(x: jax.Array) -> jax.Array:
    """``sum(x ** 2)`` in float32, or the value :func:`square_sums_known` gave for ``x``."""
    known = _KNOWN.get().get(id(x))
    if known is not None and known[0] is x:
        return known[1]
    x = jnp.asarray(x).astype(jnp.float32)
    return jnp.sum(x * x)


@contextlib.contextmanager
def square_sums_known(leaves: list[jax.Array], sums: list[jax.Array]) -> Iterator[None]:
    """While tracing inside, :func:`square_sum` of these very arrays returns ``sums``.

    A loss scaler must read the gradients before its branch, to decide whether
    they are finite; a clip inside the branch reads them again for its norm,
    and XLA stores them in between. When the scaler's one read also yields the
    sums of squares, the clip takes them from here instead: one pass over the
    gradients where there were two, and no stored copy. The match is by object
    identity at trace time, so only the arrays the scaler passed on get the
    sums; anything that transforms them first makes new arrays, whose sums are
    computed afresh.
    """
    known = dict(_KNOWN.get())
    known.update({id(x): (x, s) for x, s in zip(leaves, sums, strict=True)})
    token = _KNOWN.set(known)
    try:
        yield
    finally:
        _KNOWN.reset(token)


def _shorten(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[: limit - 4] + " ..."


def check_like(caller: str, updates: Any, params: Any, name: str = "params") -> None:
    """Raises a ``ValueError`` if ``params`` is given and not shaped like ``updates``.

    Run at trace time, so that a tree mismatch names both trees instead of
    failing inside ``jax.tree.map`` or the inner optimizer, and so that a leaf
    of another shape is not silently broadcast (gradients of shape ``(1,)``
    added to a buffer or to params of shape ``(3,)``).

    Args:
      caller: the transform's name, to start the message.
      updates: the gradients or updates passed to ``update``.
      params: the params passed to ``update`` (or a tree built from them by
        ``init``); ``None`` means there is nothing to check.
      name: what ``params`` is called in the message.

    Raises:
      ValueError: if the tree structures or the shapes of their leaves differ.
    """
    if params is None:
        return
    u_def, p_def = jax.tree.structure(updates), jax.tree.structure(params)
    if u_def != p_def:
        u_paths = [
            jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(updates)
        ]
        p_paths = [
            jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)
        ]
        u_set, p_set = set(u_paths), set(p_paths)
        only_u = [k for k in u_paths if k not in p_set][:_MAX_SHOWN]
        only_p = [k for k in p_paths if k not in u_set][:_MAX_SHOWN]
        raise ValueError(
            f"{caller}: the updates and the {name} differ in tree structure; pass the "
            "gradients of the params given to init, and those params.\n"
            f"  leaves only in updates: {only_u}\n  leaves only in {name}: {only_p}\n"
            f"  updates: {_shorten(str(u_def))}\n  {name}: {_shorten(str(p_def))}"
        )
    odd = [
        f"{jax.tree_util.keystr(path)}: {jnp.shape(u)} against {jnp.shape(p)}"
        for (path, u), p in zip(
            jax.tree_util.tree_leaves_with_path(updates), jax.tree.leaves(params)
        )
        if jnp.shape(u) != jnp.shape(p)
    ]
    if odd:
        raise ValueError(
            f"{caller}: the updates and the {name} differ in shape; pass the gradients of "
            f"the params given to init, and those params.\n  "
            + "\n  ".join(odd[:_MAX_SHOWN])
            + (f"\n  ... and {len(odd) - _MAX_SHOWN} more" if len(odd) > _MAX_SHOWN else "")
        )
