"""The reductions gradtools keeps in a faster form than the obvious one, each for a measured win.

``benchmarks/ANALYSIS.md`` gives the measurements ("What each kept form in
`gradtools/_tuning.py` buys"); each form computes exactly what its docstring's plain
expression computes, and each call site says in a sentence why it is used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradtools import _apply
from gradtools import _tree

__all__ = [
    "checked_square_sum",
    "cond_through_buffer",
    "distinct_scalars",
    "stack_scalars",
]

_FAN_IN = 32  # scalars stacked by one fusion in stack_scalars


def checked_square_sum(x: jax.Array) -> jax.Array:
    """``sum(x * x)`` in float32 where ``x`` is finite, else NaN: one read of ``x`` for both.

    ``y + (y - y)`` is ``y`` for a finite value and NaN for inf or NaN, and
    squares are never negative, so finite values too large to square give
    +inf, never NaN.
    """
    y = x.astype(jnp.float32)
    z = y + (y - y)
    return jnp.sum(z * z)


def stack_scalars(scalars: list[jax.Array]) -> jax.Array:
    """``jnp.stack(scalars)``, built 32 at a time to keep XLA's compile time linear in their number.

    A barrier between the levels stops XLA from fusing them, and any
    reduction that follows, into one kernel with one input per leaf, whose
    compile time grows faster than linearly. Reduce the result to combine
    per-leaf scalars: ``jnp.sum(stack_scalars(sums))``.
    """
    parts = [jnp.stack(scalars[i : i + _FAN_IN]) for i in range(0, len(scalars), _FAN_IN)]
    while len(parts) > 1:
        parts = list(jax.lax.optimization_barrier(parts))
        parts = [jnp.concatenate(parts[i : i + _FAN_IN]) for i in range(0, len(parts), _FAN_IN)]
    return parts[0]


def cond_through_buffer(
    pred: jax.Array, step: Callable[[Any], tuple[Any, Any]], buffer: Any, state: Any
) -> tuple[Any, Any, Any]:
    """``step(buffer)`` where ``pred`` holds, its updates leaving through ``buffer``'s output.

    Returns ``(updates, buffer, state)``: where ``pred`` holds, ``step``'s
    updates and state and a cleared (zero) buffer; elsewhere zero updates and
    ``buffer`` and ``state`` as they were. Updates that ``buffer``'s dtypes
    hold exactly take its place in the branch, so that a skipped step writes
    no zeros to an output of their own (on XLA:CPU a temporary faulted in on
    every call); one pass after the branch then gives both the updates and
    the cleared buffer.
    """
    types: list[Any] = []

    def run(buffer: Any) -> Any:
        updates, new_state = step(buffer)
        types.append(jax.tree.map(jax.typeof, updates))
        if not _holds(buffer, types[-1]):
            return buffer, new_state, updates
        return jax.tree.map(lambda u, b: u.astype(b.dtype), updates, buffer), new_state, ()

    def hold(like: Any, buffer: Any) -> Any:
        return buffer, state, _tree.zeros_of_types(like[2])

    slot, state, updates = _apply.cond(pred, run, hold, buffer)
    if _holds(buffer, types[-1]):
        updates = jax.tree.map(lambda s, t: jnp.where(pred, s, 0).astype(t.dtype), slot, types[-1])
    cleared = jax.tree.map(lambda s: jnp.where(pred, jnp.zeros([], s.dtype), s), slot)
    return updates, cleared, state


def _holds(buffer: Any, types: Any) -> bool:
    """Whether ``buffer``'s leaves can hold arrays of ``types`` exactly (same tree and shapes)."""
    leaves = jax.tree.leaves(buffer)
    return jax.tree.structure(buffer) == jax.tree.structure(types) and all(
        b.shape == t.shape and np.can_cast(t.dtype, b.dtype, casting="safe")
        for b, t in zip(leaves, jax.tree.leaves(types))
    )


def distinct_scalars(value: jax.Array, leaves: list[Any]) -> list[jax.Array]:
    """``value`` as float32, one copy per leaf that XLA cannot merge back into one.

    XLA merges the broadcasts of one scalar to leaves of one shape, and
    XLA:CPU then writes the merged broadcast out as a parameter-sized array;
    a barrier per leaf keeps each broadcast inside its own fusion.
    """
    value = jnp.asarray(value, jnp.float32)
    return [jax.lax.optimization_barrier((value, x))[0] for x in leaves]
