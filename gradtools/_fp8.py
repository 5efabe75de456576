"""fp8 delayed-scaling meta: the variables a training step overwrites instead of optimizing.

flax's fp8 ops (``flax.linen.fp8_ops``) keep, per matmul, scales and amax
histories in the collection ``_overwrite_with_gradient``, beside ``params``.
Their backward pass returns each one's *new* value as its gradient. Where the
variables hold that collection, every step path (:func:`gradtools.apply_gradients`,
``train_step``, ``TrainState``, ``Optimizer``) does what flax's
``TrainState.apply_gradients`` does, and keeps non-finite values out::

  params, opt_state = tx step on (grads['params'], opt_state, variables['params'])
  meta = where(isfinite(new), new, old)                 # element by element
  meta[output_grad_*] *= new_loss_scale / old_loss_scale   # with a loss scaler

The meta is written whatever ``tx`` did (a skipped step, an accumulation
micro-step, a frozen layer): its forward and backward pass ran. Under
``nnx.bridge`` the same variables are ``nnx.Variable``s of a type named after
the collection, recognised by that name.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from gradtools import _checks
from gradtools import _compat
from gradtools import _tree
from gradtools.loss_scale import LossScaleState

__all__ = [
    "OVERWRITE",
    "apply",
    "held",
    "lowest",
    "maximum",
    "merge",
    "overwrite",
    "refuse_whole_state",
    "rescale",
    "split",
]

OVERWRITE = _compat.FP8_META


def held(*trees: Any) -> bool:
    """Whether any of ``trees`` is a mapping holding the collection ``_overwrite_with_gradient``."""
    return any(isinstance(t, Mapping) and OVERWRITE in t for t in trees)


def split(tree: Any, name: str) -> tuple[Any, Any]:
    """``(tree['params'], tree[OVERWRITE])`` where ``tree`` holds fp8 meta, else ``(tree, None)``.

    Raises a ``ValueError`` naming ``name`` where the collection sits beside
    anything but ``params``.
    """
    if not (isinstance(tree, Mapping) and OVERWRITE in tree):
        return tree, None
    other = sorted(str(k) for k in tree if k != OVERWRITE)
    if other != ["params"]:
        raise ValueError(
            f"{name} holds {OVERWRITE!r} (flax's fp8 meta) beside {other}, where it takes "
            f"'params' alone: pass the variables {{'params': ..., {OVERWRITE!r}: ...}}, whose "
            "params tx steps on and whose meta takes its gradients' values"
        )
    return tree["params"], tree[OVERWRITE]


def merge(like: Any, params: Any, meta: Any) -> Any:
    """What :func:`split` took apart: ``params`` where ``meta`` is ``None``, else the variables
    (in ``like``'s mapping type)."""
    if meta is None:
        return params
    out = {"params": params, OVERWRITE: meta}
    return out if type(like) is dict else type(like)(out)


def overwrite(old: Any, new: Any) -> Any:
    """The meta a step writes: each element of ``new`` where finite, else of ``old``.

    flax's new history is the old one shifted by one place (the oldest entry,
    at index 1, drops out; the newest moves from index 0 to the end) with the
    new amax at index 0: where that is inf or NaN, index 0 keeps the old newest.
    """
    _checks.check_like("apply_gradients", new, old, name=f"{OVERWRITE} variables")
    return jax.tree.map(lambda o, n: jnp.where(jnp.isfinite(n), n.astype(o.dtype), o), old, new)


def lowest(meta: Any) -> Any:
    """``-inf`` leaves shaped like ``meta`` (``None`` for none): where a running maximum starts."""
    if meta is None:
        return None
    return jax.tree.map(lambda m: jnp.full(jnp.shape(m), -jnp.inf, jnp.result_type(m)), meta)


def maximum(running: Any, meta: Any) -> Any:
    """The element-wise maximum of two metas (``None`` for none); a NaN stays, and
    :func:`overwrite` then drops it."""
    return None if meta is None else jax.tree.map(jnp.maximum, running, meta)


def rescale(meta: Any, old_state: Any, new_state: Any) -> Any:
    """``meta`` with its output-gradient histories and scales moved to the new loss scale.

    They record the scaled backward pass, so a loss scale that doubles would
    clip the next step's largest gradients to the recorded maximum. Where the
    states hold no single ``LossScaleState``, ``meta`` is returned as it is.
    """
    old, new = _tree.find(old_state, LossScaleState), _tree.find(new_state, LossScaleState)
    if len(old) != 1 or len(new) != 1:
        return meta
    ratio = jnp.asarray(new[0][1].loss_scale) / jnp.asarray(old[0][1].loss_scale)

    def one(path: Any, m: jax.Array) -> jax.Array:
        key = path[-1] if path else None
        name = str(getattr(key, "key", getattr(key, "name", "")))
        return (m * ratio).astype(m.dtype) if _compat.is_output_grad_meta(name) else m

    return jax.tree_util.tree_map_with_path(one, meta)


def refuse_whole_state(caller: str, opt_state: Any) -> None:
    """Raises a ``ValueError`` where ``opt_state`` was built from the whole variables (it holds
    the meta's collection), naming ``params`` and the fix."""
    for path, _ in jax.tree_util.tree_leaves_with_path(opt_state):
        if any(getattr(k, "key", None) == OVERWRITE for k in path):
            raise ValueError(
                f"{caller}: opt_state{jax.tree_util.keystr(path)} belongs to {OVERWRITE!r} "
                "(flax's fp8 meta): the state was built from the whole variables. tx steps "
                "on variables['params'] only, and the meta takes its gradients' values: "
                "build the state with tx.init(variables['params']), as flax's "
                "TrainState.create does"
            )


def apply(step: Callable, tx: Any, grads: Any, opt_state: Any, params: Any, extra_args: dict):
    """``(variables, opt_state)``: ``step`` on the params only, and the meta written.

    ``params`` and ``grads`` are variables holding the meta; ``step`` is
    :func:`gradtools.apply_gradients`, given ``params['params']`` and
    ``grads['params']``.
    """
    p, old = split(params, "params")
    g, new = split(grads, "grads")
    if (old is None) != (new is None):
        has, lacks = ("params", "grads") if new is None else ("grads", "params")
        raise ValueError(
            f"apply_gradients: {has} hold {OVERWRITE!r} (flax's fp8 meta) and {lacks} do "
            "not: differentiate the loss with respect to the whole variables, "
            f"{{'params': ..., {OVERWRITE!r}: ...}}, and pass those variables as params"
        )
    refuse_whole_state("apply_gradients", opt_state)
    p, new_state = step(tx, g, opt_state, p, **extra_args)
    return merge(params, p, rescale(overwrite(old, new), opt_state, new_state)), new_state
