"""Update and apply in one step, through the fast path a transform registers.

A wrapper whose optimizer work runs inside a ``lax.cond`` (a loss scaler's
skip, an accumulation window) can apply the updates inside that branch too.
The updates then never leave it, so XLA needs no parameter-sized buffer for
them, and a step that does no optimizer work leaves the params untouched
instead of adding zeros to them. :func:`gradtools.apply_gradients` is the
public entry point.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import jax
import optax

from gradtools import _tree

__all__ = ["inner_step", "no_step", "register", "update_and_apply"]

#: ``tx.update`` -> ``apply(grads, state, params, **extra_args) -> (params, state)``.
_FUSED: weakref.WeakKeyDictionary[Callable[..., Any], Callable[..., Any]]
_FUSED = weakref.WeakKeyDictionary()


def register(update_fn: Callable[..., Any], apply_fn: Callable[..., Any]) -> None:
    """Records ``apply_fn`` as the update-and-apply form of ``update_fn``.

    ``apply_fn(grads, state, params, **extra_args)`` must return what
    ``optax.apply_updates(params, updates)`` and the new state would be after
    ``update_fn(grads, state, params, **extra_args)``.
    """
    _FUSED[update_fn] = apply_fn


def update_and_apply(
    tx: optax.GradientTransformation, grads: Any, state: Any, params: Any, **extra_args: Any
) -> tuple[Any, Any]:
    """``(params, state)`` after one step of ``tx``: its fast path, else update then apply."""
    try:
        fused = _FUSED.get(tx.update)
    except TypeError:  # an update function that takes no weak references
        fused = None
    if fused is not None:
        return fused(grads, state, params, **extra_args)
    updates, state = tx.update(grads, state, params, **extra_args)
    return optax.apply_updates(params, updates), state


def inner_step(
    tx: optax.GradientTransformation,
    grads: Any,
    state: Any,
    params: Any,
    extra_args: dict[str, Any],
    fused: bool,
) -> tuple[Any, Any]:
    """A wrapper calling its inner ``tx``: ``(updates, state)``; fused, ``(params, state)``."""
    if fused:
        return update_and_apply(tx, grads, state, params, **extra_args)
    return tx.update(grads, state, params, **extra_args)


def no_step(fused: bool, params: Any, step: Callable[..., Any], *args: Any) -> Any:
    """What a branch that runs no optimizer returns in place of ``step(*args)[0]``.

    Fused, the params as they are; else zero updates of the shapes ``step`` gives.
    """
    if fused:
        return params
    return _tree.zeros_like_shapes(jax.eval_shape(step, *args)[0])
