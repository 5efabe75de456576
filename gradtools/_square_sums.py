"""The sums of squares a wrapper hands the norm right inside it: one read of the gradients for both.

A loss scaler's finiteness check reads every gradient leaf and yields each
leaf's float32 sum of squares (:func:`gradtools._tuning.checked_square_sum`).
The L2 norms of :func:`gradtools.clip_by_global_norm`,
:func:`gradtools.spike_guard` and :func:`gradtools.group_norms` are sums of
those same sums. Computed again inside the scaler's ``lax.cond`` branch they
cost a second read of every gradient, and on the fused path a
parameter-sized temporary (``benchmarks/ANALYSIS.md``, "Loss scaling").

The sums travel in the receiving transformation's state, never as an
argument, so a transformation of the user's sees nothing it was not given.
A sender calls ``offer(inner, inner_state, sums)`` and passes what it returns
to ``inner.update``. In it, the state of each receiver that gets exactly the
sender's updates (``inner`` itself, or the first member of an
``optax.chain``, and the members after a receiver that returns its updates
unchanged, into nested chains too) is an :class:`Offered`. The receiver calls
:func:`take`, which gives back its own state and the sums, or ``None`` for
the sums where nothing was offered. A receiver's state class says
``takes_square_sums = True`` (and ``updates_unchanged = True`` where its
``update`` returns the updates it was given, as ``group_norms``' does); its
``update`` returns its own state, never an :class:`Offered`.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax

from gradtools import _compat

__all__ = ["Offered", "offer", "take"]


class Offered(NamedTuple):
    """A receiver's state, with the sums of squares of the updates it is about to receive.

    Attributes:
      state: the receiver's own state.
      sums: one float32 scalar per leaf of those updates, in tree order.
    """

    state: Any
    sums: list[jax.Array]


def _receives(state: Any) -> bool:
    return getattr(type(state), "takes_square_sums", False) is True


def offer(inner: Any, inner_state: Any, sums: list[jax.Array] | None) -> Any:
    """``inner_state``, with ``sums`` offered to every receiver that gets ``inner``'s updates
    as they are: ``inner`` itself; in an ``optax.chain``, its first member, and each next one
    while those before it return their updates unchanged; inside a member that is a chain
    itself, the same. Every other state is returned as it was."""
    if sums is None:
        return inner_state
    return _offer(getattr(inner, "update", None), inner_state, sums)[0]


def _offer(update: Any, state: Any, sums: list[jax.Array]) -> tuple[Any, bool]:
    """``(state with the sums offered, whether the transformation whose update is ``update``
    returns its updates unchanged)``."""
    if _receives(state):
        return Offered(state, sums), getattr(type(state), "updates_unchanged", False) is True
    members = _compat.chain_members(update)
    if members is None or type(state) is not tuple or len(members) != len(state):
        return state, False
    states = list(state)
    for i, member in enumerate(members):
        states[i], unchanged = _offer(member, states[i], sums)
        if not unchanged:
            return tuple(states), False
    return tuple(states), True


def take(state: Any, updates: Any) -> tuple[Any, list[jax.Array] | None]:
    """``(state, sums)``: the receiver's own state, and the sums offered with it for
    ``updates`` (``None`` where none were offered)."""
    if not isinstance(state, Offered):
        return state, None
    if len(state.sums) != len(jax.tree.leaves(updates)):  # not these updates' sums
        return state.state, None
    return state.state, state.sums
