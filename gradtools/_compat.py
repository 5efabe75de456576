"""What gradtools recognises in optax and flax by something other than a type.

Some objects gradtools must recognise have no type of their own to test
against, or a type whose module has moved across versions. Each such test
lives here, with a test pinned to the optax and flax versions CI runs
(``tests/test_compat.py``): a release that changes one breaks that test, not
a user's step.
"""

from __future__ import annotations

from typing import Any

import optax

__all__ = [
    "FP8_META",
    "hyperparam_states",
    "chain_members",
    "is_fp8_meta",
    "is_output_grad_meta",
    "is_set_to_zero",
    "refused_keyword",
]

#: flax's name for the fp8 meta collection (``flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT``),
#: and the name of the ``nnx.Variable`` type ``nnx.bridge`` makes for it.
FP8_META = "_overwrite_with_gradient"

# flax's names for the meta of the gradient flowing out of a matmul, which records
# the scaled backward pass: output_grad_amax_history and output_grad_scale.
_OUTPUT_GRAD = "output_grad_"

# optax.inject_hyperparams's state: its class has moved and been renamed across
# optax versions (InjectHyperparamsState is no longer produced).
_HYPERPARAM_STATE = "InjectStatefulHyperparamsState"

# Every optax.set_to_zero() (optax's own way to freeze) has an update of this code
# (a fresh object, matching nothing, should a later optax make it no function).
# optax gives it no type of its own, and its init, optax.init_empty_state, is
# shared with optax.identity() and others.
_SET_TO_ZERO_CODE = getattr(optax.set_to_zero().update, "__code__", object())

# The update function of every optax.chain(...): chain returns a plain
# GradientTransformationExtraArgs.
_CHAIN_UPDATE = getattr(optax.chain(optax.identity()).update, "__code__", object())


def is_set_to_zero(tx: Any) -> bool:
    """Whether ``tx`` is an ``optax.set_to_zero()``."""
    return getattr(getattr(tx, "update", None), "__code__", None) is _SET_TO_ZERO_CODE


def chain_members(update: Any) -> tuple[Any, ...] | None:
    """The update functions of the members of the ``optax.chain`` whose ``update`` is
    ``update``, in order; ``None`` where ``update`` is no chain's.

    A chain hands its first member its own updates, and each later member what the one
    before returned. optax keeps the members' update functions in the closure of the
    chain's own, as ``update_fns``.
    """
    code = getattr(update, "__code__", None)
    if code is None or code is not _CHAIN_UPDATE or "update_fns" not in code.co_freevars:
        return None
    cell = update.__closure__[code.co_freevars.index("update_fns")]
    return tuple(cell.cell_contents)


def is_fp8_meta(path: Any, value: Any) -> bool:
    """An ``nnx`` filter: whether ``value`` is a variable of the type ``nnx.bridge`` names
    ``_overwrite_with_gradient`` (``nnx.variable_type_from_name`` makes a new class of
    that name, so only the name identifies it)."""
    del path
    return type(value).__name__ == FP8_META


def is_output_grad_meta(name: str) -> bool:
    """Whether the fp8 meta variable ``name`` records the scaled backward pass (flax's
    ``output_grad_amax_history`` and ``output_grad_scale``), not a forward input."""
    return name.startswith(_OUTPUT_GRAD)


def hyperparam_states(tree: Any) -> list[Any]:
    """Every ``optax.inject_hyperparams`` state in ``tree``, in tree order."""
    return [state for _, state in optax.tree.get_all_with_path(tree, _HYPERPARAM_STATE)]


def refused_keyword(err: TypeError, name: str) -> bool:
    """Whether ``err`` is Python's refusal of the keyword argument ``name``
    (``f() got an unexpected keyword argument 'name'``)."""
    return "unexpected keyword argument" in str(err) and f"'{name}'" in str(err)
