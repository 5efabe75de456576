"""The one mechanism of gradtools' wrappers: step the inner transformation, or skip it.

A wrapper (a loss scaler, ``accumulate``, ``freeze``, ``param_groups``) is
written as one function ``step(grads, state, params, extra_args, fused)``.
With ``fused=False`` it is optax's ``update`` and returns ``(updates,
state)``; with ``fused=True`` it also applies the updates and returns
``(params, state)``. A wrapper that runs its inner step inside a
``lax.cond`` branch then applies the updates inside that branch too: they
never leave it, and a step that runs no optimizer returns the params as they
were instead of adding zeros to them.

:class:`Update` holds both forms in the transformation's own ``update``
field (``optax.GradientTransformationExtraArgs(init_fn, Update(step))``), so
they travel with the transformation: through gradtools' wrappers,
``optax.with_extra_args_support`` and anything else that keeps ``tx.update``.
Where a wrapper hides it (``optax.chain``, ``optax.inject_hyperparams``),
:func:`step` falls back to ``update`` and then ``optax.apply_updates``,
which gives the same result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax import lax

from gradtools import _step_checks
from gradtools import _tree

__all__ = ["Update", "cond", "step", "step_or_skip"]

StepFn = Callable[[Any, Any, Any, dict[str, Any], bool], tuple[Any, Any]]


@dataclasses.dataclass(frozen=True)
class Update:
    """A wrapper's ``update``: called, optax's ``update``; :meth:`apply`, update and apply."""

    step: StepFn

    def __call__(self, updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        _step_checks.no_nested_kwargs(extra_args)
        return self.step(updates, state, params, extra_args, False)

    def apply(self, grads: Any, state: Any, params: Any, **extra_args: Any) -> Any:
        """``(params, state)``: what ``update`` then ``optax.apply_updates`` give."""
        _step_checks.no_nested_kwargs(extra_args)
        return self.step(grads, state, params, extra_args, True)


def step(tx: optax.GradientTransformation, grads, state, params, extra_args: dict, fused: bool):
    """One step of ``tx``: ``(updates, state)``, or fused ``(params, state)``.

    Fused, it takes ``tx``'s update-and-apply form where ``tx.update`` is an
    :class:`Update`, else ``tx.update`` then ``optax.apply_updates``.
    """
    if not fused:
        return tx.update(grads, state, params, **extra_args)
    if isinstance(tx.update, Update):
        return tx.update.apply(grads, state, params, **extra_args)
    updates, state = tx.update(grads, state, params, **extra_args)
    return optax.apply_updates(params, updates), state


def cond(pred: jax.Array, run: Callable[..., Any], skip: Callable[..., Any], *operands: Any) -> Any:
    """``lax.cond(pred, run, skip, *operands)``, where ``skip(like, *operands)`` runs no optimizer.

    ``like`` holds the types of ``run``'s outputs, recorded as ``lax.cond``
    traces ``run`` (its first branch), so that the optimizer is traced once;
    ``skip``'s outputs are given their dtypes and ``shard_map`` axes
    (:func:`gradtools._tree.match_types`).
    """
    types: list[Any] = []

    def first(*args: Any) -> Any:
        out = run(*args)
        types.append(jax.tree.map(jax.typeof, out))
        return out

    def second(*args: Any) -> Any:
        if not types:  # only this branch is traced (a concrete pred under disable_jit)
            types.append(jax.eval_shape(run, *args))
        return _tree.match_types(skip(types[-1], *args), types[-1])

    return lax.cond(pred, first, second, *operands)


def step_or_skip(pred: jax.Array, run: Callable, operand, fused: bool, params, state):
    """``run(operand)`` where ``pred`` holds, else no optimizer work.

    ``run`` returns ``(updates, new_state)``, or fused ``(new_params,
    new_state)``. A skipped step returns ``(params, state)`` when fused, else
    zero updates and ``state``.
    """

    def skip(like: Any, operand: Any) -> Any:
        del operand
        return (params, state) if fused else (_tree.zeros_of_types(like[0]), state)

    return cond(pred, run, skip, operand)
