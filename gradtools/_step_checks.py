"""What a training step checks about its inputs: keywords for ``tx.update``, and a state's fit.

:func:`gradtools.apply_gradients` (and so ``train_step``, ``TrainState`` and
``Optimizer``) hands its extra keywords to ``tx.update``, where, by optax's
convention, each transformation takes the ones it knows and ignores the rest.
So a keyword that no transformation takes goes nowhere without a word. The
checks here make the cases a user meets loud, while keywords meant for the
user's own transformations still pass.
"""

from __future__ import annotations

import difflib
import warnings
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["explain_state", "no_nested_kwargs", "update_keywords"]

#: The keywords gradtools' own transformations read from ``tx.update``.
KEYWORDS = ("flush", "weight", "value")
_ACCUMULATE_KEYWORDS = ("flush", "weight")


def no_nested_kwargs(extra_args: dict[str, Any]) -> None:
    """Raises a ``TypeError`` where a keyword for ``tx.update`` is named ``update_kwargs``
    (flax's ``nnx.Optimizer`` hands its keywords to ``tx.update`` as they are)."""
    if "update_kwargs" in extra_args:
        raise TypeError(
            f"tx.update got update_kwargs={extra_args['update_kwargs']!r} as one keyword, so "
            "its entries reach no transformation. flax's nnx.Optimizer.update passes its "
            "keywords to tx.update as they are: call optimizer.update(model, grads, flush=True), "
            "or use gradtools.Optimizer, whose update takes update_kwargs"
        )


def update_keywords(extra_args: dict[str, Any], accumulates: bool) -> None:
    """Refuses a nested ``update_kwargs``; warns of keywords for ``tx.update`` that go nowhere.

    Args:
      extra_args: the keywords for ``tx.update``.
      accumulates: whether the optimizer state holds a :func:`gradtools.accumulate`.

    Raises:
      TypeError: as :func:`no_nested_kwargs`.
    """
    no_nested_kwargs(extra_args)
    for key in extra_args:
        if key in _ACCUMULATE_KEYWORDS and not accumulates:
            warnings.warn(
                f"{key}= goes nowhere: the optimizer holds no gradtools.accumulate, which is "
                f"what reads it; wrap the optimizer, tx = gradtools.accumulate(tx, every_k), "
                f"or leave {key} out",
                stacklevel=4,
            )
        elif key not in KEYWORDS and (close := difflib.get_close_matches(key, KEYWORDS, 1, 0.75)):
            warnings.warn(
                f"{key}= is not a keyword of gradtools' transformations; did you mean "
                f"{close[0]}=? (a keyword of a transformation of your own passes on as it is)",
                stacklevel=4,
            )


def explain_state(caller: str, tx: Any, opt_state: Any, params: Any) -> None:
    """Raises a ``ValueError`` naming the leaves where ``opt_state`` is not ``tx.init(params)``'s.

    Called when a step has failed, to say why where the state was built for
    other params: it compares the state with ``jax.eval_shape(tx.init, params)``
    and returns (letting the original error stand) if they agree or if
    ``tx.init`` cannot be traced.
    """
    try:
        expected = jax.eval_shape(tx.init, params)
    except Exception:  # an init that cannot run on abstract values: keep the step's error
        return
    have = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(opt_state)}
    want = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(expected)}
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    odd = [
        f"opt_state{k}: shape {jnp.shape(have[k])}, where tx.init(params) gives "
        f"{want[k].shape}{_param_of(k, names)}"
        for k in want
        if k in have and jnp.shape(have[k]) != want[k].shape
    ]
    odd += [f"opt_state{k}: not in tx.init(params)'s state" for k in have if k not in want]
    odd += [f"opt_state{k}: missing (tx.init(params) has it)" for k in want if k not in have]
    if odd:
        raise ValueError(
            f"{caller}: opt_state was not built for these params; build it with "
            "tx.init(params), from the params the step updates.\n  " + "\n  ".join(odd[:10])
        )


def _param_of(state_path: str, param_names: list[str]) -> str:
    """`` (params['w'])`` for the longest param path that ends ``state_path``, else ''."""
    ends = [n for n in param_names if n and state_path.endswith(n)]
    return f" (params{max(ends, key=len)})" if ends else ""
