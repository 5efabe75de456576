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
from jax import lax

from gradtools import _tree

__all__ = [
    "cond",
    "inner_step",
    "recorded",
    "register",
    "step_or_skip",
    "transformation",
    "update_and_apply",
]

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


def transformation(
    init_fn: Callable[..., Any], step: Callable[..., tuple[Any, Any]]
) -> optax.GradientTransformationExtraArgs:
    """``init_fn`` and an ``update`` with a registered fast path, both from one ``step``.

    ``step(updates, state, params, extra_args, fused)`` returns ``(updates,
    state)``, or with ``fused`` the new params and state.
    """

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        return step(updates, state, params, extra_args, False)

    def apply_fn(grads: Any, state: Any, params: Any, **extra_args: Any) -> Any:
        return step(grads, state, params, extra_args, True)

    register(update_fn, apply_fn)
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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


def recorded(step: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``step``, and a function giving the types of ``step(*args)`` without tracing it again.

    A ``lax.cond`` branch that runs no optimizer must return arrays shaped like
    the optimizer's updates. ``lax.cond`` traces its true branch first; put
    the returned ``run`` there and it records the types of its outputs as it
    is traced, so ``types(*args)`` in the other branch costs nothing. Tracing
    the optimizer a second time under ``jax.eval_shape`` was a third of a
    loss-scaled Adam's tracing time at 200 leaves. Where ``run`` has not been
    traced (a concrete predicate under ``jax.disable_jit`` runs one branch
    only), ``types`` falls back to ``jax.eval_shape``, once. The types carry
    each output's dtype and the mesh axes it varies over inside
    ``jax.shard_map``, which the other branch must match
    (:func:`gradtools._tree.match_types`).
    """
    seen: list[Any] = []

    def run(*args: Any) -> Any:
        out = step(*args)
        seen.append(jax.tree.map(jax.typeof, out))
        return out

    def types(*args: Any) -> Any:
        if not seen:
            seen.append(jax.eval_shape(step, *args))
        return seen[-1]

    return run, types


def cond(pred: jax.Array, run: Callable[..., Any], skip: Callable[..., Any], *operands: Any) -> Any:
    """``lax.cond(pred, run, skip, *operands)`` around an optimizer step ``run``.

    ``skip`` runs no optimizer. It is called as ``skip(types, *operands)``,
    with the types of ``run``'s outputs (:func:`recorded`), so that it can
    return arrays shaped like them. Its outputs then take the dtypes of
    ``run``'s and are marked as varying over the mesh axes ``run``'s vary over
    inside ``jax.shard_map`` (:func:`gradtools._tree.match_types`), which
    ``lax.cond`` requires.
    """
    run, types = recorded(run)

    def other(*args: Any) -> Any:
        like = types(*args)
        return _tree.match_types(skip(like, *args), like)

    return lax.cond(pred, run, other, *operands)


def step_or_skip(
    pred: jax.Array, step: Callable[..., Any], fused: bool, params: Any, state: Any, *operands: Any
) -> tuple[Any, Any]:
    """``step(*operands)`` where ``pred`` holds, else no optimizer work (one :func:`cond`).

    ``step`` returns ``(updates, new_state)`` (fused, ``(new_params,
    new_state)``). Where ``pred`` does not hold the result is ``(params,
    state)`` when fused, else zero updates shaped like ``step``'s and ``state``.
    """

    def skip(like: Any, *args: Any) -> Any:
        del args
        return (params, state) if fused else (_tree.zeros_like_shapes(like[0]), state)

    return cond(pred, step, skip, *operands)
