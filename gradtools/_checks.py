"""Eager argument checks shared by every transform.

Each check raises a ``ValueError`` (for a bad value, and for a number, bool
or dtype of the wrong kind) or a ``TypeError`` (for an object that is not what
the argument takes, such as a transformation or a pytree of arrays) that
names the argument, shows its value and says what was expected. The numeric
checks pass traced values, as ``optax.inject_hyperparams`` gives them, without
looking: their value is unknown when the transform is built; an argument that
must be static refuses them.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

import jax
import jax.core as jax_core
import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
    "check_like",
    "every_k",
    "finite_non_negative",
    "finite_positive",
    "float_dtype",
    "floating",
    "greater_than_one",
    "hashable",
    "in_open_interval",
    "is_bool",
    "is_transform",
    "micro_batch_args",
    "non_negative_int",
    "numeric",
    "numeric_leaves",
    "one_of",
    "positive_int",
    "real_leaves",
    "real_number",
    "scale_bound",
    "scale_bounds",
    "state_of",
    "static",
    "traced",
    "window_size",
]


def traced(value: Any) -> bool:
    """Whether ``value`` is a tracer (its value is unknown until run time)."""
    return isinstance(value, jax_core.Tracer)


def static(name: str, value: Any, why: str) -> None:
    """Checks that ``value`` is not traced; ``why`` says what it decides."""
    if traced(value):
        raise ValueError(
            f"{name}={value!r} cannot be traced: {why}. Under optax.inject_hyperparams, "
            f"name {name!r} in static_args."
        )


#: The largest step count: steps and counters are int32.
MAX_INT32 = int(np.iinfo(np.int32).max)


def real_number(name: str, value: Any) -> float:
    """``value`` as a float, refusing strings, bools and complex numbers (NumPy's too)."""
    if isinstance(value, (str, bytes)):  # float('1e-3') would accept them
        raise ValueError(f"{name}={value!r} must be a real number, not a string")
    if isinstance(value, (bool, np.bool_)):  # float(True) would accept them
        raise ValueError(f"{name}={value!r} must be a real number, not a bool")
    if np.iscomplexobj(value):  # float(np.complex128(1+1j)) would drop the 1j
        raise ValueError(f"{name}={value!r} must be a real number, not complex")
    if not isinstance(value, numbers.Real):
        try:
            value = float(value)  # numpy and jax scalars
        except (TypeError, ValueError):
            raise ValueError(f"{name}={value!r} must be a real number") from None
    return float(value)


def _in_float32(name: str, value: Any, ok: Callable[[float], bool], what: str) -> None:
    """Raises unless ``ok`` holds for ``value`` as the float32 it is computed in."""
    if traced(value):
        return
    v = real_number(name, value)
    with np.errstate(over="ignore", under="ignore"):
        v32 = float(np.float32(v)) if math.isfinite(v) else v
    if not ok(v32):
        rounded = "" if v32 == v else f" (float32 rounds it to {v32})"
        hint = ""
        dtype = getattr(value, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
            hint = (
                "; optax.inject_hyperparams casts hyperparameters to the params' dtype:"
                " pass it hyperparam_dtype=jnp.float32"
            )
        raise ValueError(f"{name}={value!r} must be {what}{rounded}{hint}")


def finite_positive(name: str, value: Any) -> None:
    """Checks ``0 < value < inf``, in float32."""
    _in_float32(name, value, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")


def finite_non_negative(name: str, value: Any) -> None:
    """Checks ``0 <= value < inf``, in float32."""
    _in_float32(name, value, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")


def in_open_interval(name: str, value: Any, low: float, high: float) -> None:
    """Checks ``low < value < high``, in float32."""
    _in_float32(name, value, lambda v: low < v < high, f"strictly between {low} and {high}")


def greater_than_one(name: str, value: Any) -> None:
    """Checks ``1 < value < inf``, in float32."""
    _in_float32(name, value, lambda v: math.isfinite(v) and v > 1, "a finite number > 1")


#: The range of a loss scale or its bounds: the value and its float32
#: reciprocal both normal (XLA flushes subnormal float32 to zero).
SCALE_RANGE = (2.0**-126, 2.0**126)


def scale_bound(name: str, value: Any) -> None:
    """Checks ``2**-126 <= value <= 2**126`` in float32: it and ``1 / value`` are normal."""
    finite_positive(name, value)
    low, high = SCALE_RANGE
    _in_float32(
        name,
        value,
        lambda v: v >= low,
        f"at least 2**-126 (~{low:.3g}), the smallest normal float32: XLA flushes a"
        " subnormal to zero, which would make the scale 0",
    )
    _in_float32(
        name,
        value,
        lambda v: v <= high,
        f"at most 2**126 (~{high:.3g}): its float32 reciprocal, which unscales the"
        " gradients, would be subnormal, and XLA flushes it to zero, zeroing every gradient",
    )


def scale_bounds(*, init_scale: Any, min_scale: Any, max_scale: Any) -> None:
    """Checks each with :func:`scale_bound`, and ``min_scale <= init_scale <= max_scale``."""
    for name, value in (
        ("init_scale", init_scale),
        ("min_scale", min_scale),
        ("max_scale", max_scale),
    ):
        scale_bound(name, value)
    if any(traced(v) for v in (init_scale, min_scale, max_scale)):
        return
    if float(min_scale) > float(init_scale):
        raise ValueError(f"{min_scale=} must be <= {init_scale=}")
    if float(max_scale) < float(init_scale):
        raise ValueError(f"{max_scale=} must be >= {init_scale=}")


def positive_int(name: str, value: Any) -> None:
    """Checks that ``value`` is an integer from 1 to 2**31 - 1 (not a bool, not a float)."""
    if traced(value):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if not (np.ndim(value) == 0 and np.issubdtype(np.asarray(value).dtype, np.integer)):
            raise ValueError(f"{name}={value!r} must be a positive int")
    if int(value) < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    if int(value) > MAX_INT32:
        raise ValueError(f"{name}={value!r} must be at most 2**31 - 1: steps are counted in int32")


def non_negative_int(name: str, value: Any) -> None:
    """Checks that ``value`` is an integer from 0 to 2**31 - 1 (not a bool, not a float)."""
    if traced(value):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if not (np.ndim(value) == 0 and np.issubdtype(np.asarray(value).dtype, np.integer)):
            raise ValueError(f"{name}={value!r} must be an int >= 0")
    if int(value) < 0:
        raise ValueError(f"{name}={value!r} must be an int >= 0")
    if int(value) > MAX_INT32:
        raise ValueError(f"{name}={value!r} must be at most 2**31 - 1: steps are counted in int32")


def update_kwargs(value: Any) -> None:
    """Checks that ``update_kwargs`` is ``None`` or a dict (of ``tx.update``'s extra arguments)."""
    if value is not None and not isinstance(value, Mapping):
        raise TypeError(
            f"update_kwargs={value!r} must be a dict of tx.update's extra arguments,"
            " e.g. {'flush': True}"
        )


def is_bool(name: str, value: Any) -> None:
    """Checks that ``value`` is a Python or NumPy bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}={value!r} must be True or False")


def one_of(name: str, value: Any, choices: Iterable[Any]) -> None:
    """Checks that ``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {choices}")


def is_transform(name: str, value: Any) -> None:
    """Checks that ``value`` is an ``optax.GradientTransformation``."""
    if isinstance(value, optax.GradientTransformation):
        return
    if hasattr(value, "gradient_transformation"):  # optax.MultiSteps
        hint = "use gradtools.accumulate(inner, every_k), or pass .gradient_transformation()"
    elif callable(value):  # optax.adam rather than optax.adam(1e-3)
        hint = "call it to build one, e.g. optax.adam(1e-3)"
    else:
        hint = "e.g. optax.adam(1e-3)"
    raise TypeError(f"{name}={value!r} must be an optax.GradientTransformation: {hint}")


def float_dtype(name: str, value: Any) -> None:
    """Checks that ``value`` names a floating-point dtype (an array does not)."""
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        # optax.inject_hyperparams turns the callable jnp.float32 into a schedule.
        raise ValueError(
            f"{name}={value!r} must be a floating dtype, e.g. jnp.float32, not an array. "
            f"Under optax.inject_hyperparams, name {name!r} in static_args."
        )
    try:
        dtype = None if value is None else np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name}={value!r} must be a floating dtype, e.g. jnp.float32")


def hashable(name: str, value: Any) -> None:
    """Checks that ``value`` is ``None`` or hashable, as axis names must be."""
    if value is not None and not isinstance(value, Hashable):
        raise TypeError(f"{name}={value!r} must be a hashable axis name, e.g. 'batch', or None")


def every_k(value: Any, noise_scale: bool) -> None:
    """Checks ``every_k``: a static int >= 1 (>= 2 with ``noise_scale``) or a callable."""
    if callable(value):
        return
    static("every_k", value, "it decides the structure of the state")
    positive_int("every_k", value)
    if noise_scale and int(value) == 1:
        raise ValueError("noise_scale=True needs windows of 2 or more micro-batches: every_k=1")


def numeric(x: Any) -> bool:
    """Whether ``x`` is a number, or a numeric or bool array (or tracer)."""
    if isinstance(x, (bool, int, float, complex)):
        return True
    if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return False
    return bool(jnp.issubdtype(x.dtype, jnp.number) or jnp.issubdtype(x.dtype, jnp.bool_))


def floating(caller: str, name: str, value: Any) -> None:
    """Checks that ``value`` is a floating-point number or array (or tracer)."""
    if not (numeric(value) and jnp.issubdtype(jnp.result_type(value), jnp.floating)):
        raise TypeError(f"{caller}: {name}={value!r} must be a floating-point number or array")


def real_leaves(caller: str, name: str, tree: Any, *, floating: bool = False) -> None:
    """Raises a ``TypeError`` naming the first leaf of ``tree`` that is not a real number.

    gradtools computes in real float32 (unscaling, norms, accumulation
    buffers): a complex gradient would silently lose its imaginary part, and
    with ``floating`` an integer one would be truncated.
    """
    numeric_leaves(caller, name, tree)
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        where = f"{caller}: {name}{jax.tree_util.keystr(path)}"
        if jnp.iscomplexobj(x):
            raise TypeError(
                f"{where} is complex ({jnp.result_type(x)}); gradtools takes real gradients: "
                "keep a complex parameter as its real and imaginary parts"
            )
        if floating and not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise TypeError(
                f"{where} is {jnp.result_type(x)}; it must be floating-point (integer "
                "gradients would be truncated when scaled)"
            )


def state_of(caller: str, state: Any, cls: type) -> None:
    """Raises a ``TypeError`` unless ``state`` is a ``cls``, saying where a state comes from."""
    if not isinstance(state, cls):
        raise TypeError(
            f"{caller}: the state is a {type(state).__name__}, not a {cls.__name__}: pass the "
            f"state this transformation's init returned (restore a checkpoint with that state "
            f"as the target, e.g. orbax's args.StandardRestore(tx.init(params)))"
        )


def numeric_leaves(caller: str, name: str, tree: Any) -> list[Any]:
    """The leaves of ``tree``, each checked to be a numeric array (or tracer) or number."""
    pairs = jax.tree_util.tree_leaves_with_path(tree)
    for path, x in pairs:
        if not numeric(x):
            raise TypeError(
                f"{caller}: {name}{jax.tree_util.keystr(path)}={x!r} must be a numeric array"
            )
    return [x for _, x in pairs]


_MAX_SHOWN = 10  # how many differing paths an error message lists


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
    if isinstance(params, optax.LookaheadParams):
        raise ValueError(
            f"{caller}: params is an optax LookaheadParams: put optax.lookahead outside, "
            f"e.g. optax.lookahead(gradtools.{caller}(fast_optimizer), sync_period, alpha)"
        )
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


def micro_batch_args(weight: Any, flush: Any) -> None:
    """Checks ``accumulate``'s ``weight`` (a real scalar) and ``flush`` (a scalar bool)."""
    if not numeric(weight):
        raise ValueError(f"weight={weight!r} must be a scalar number (the micro-batch's weight)")
    if jnp.iscomplexobj(weight):
        raise ValueError(f"weight={weight!r} must be a real number, not complex")
    if jnp.shape(weight) != ():
        raise ValueError(f"weight must be a scalar, got an array of shape {jnp.shape(weight)}")
    if not numeric(flush) or jnp.shape(flush) != () or jnp.result_type(flush) != jnp.bool_:
        raise ValueError(f"flush must be a scalar bool (Python or traced), got {flush!r}")


def window_size(size: Any) -> None:
    """Checks that a scheduled ``every_k(windows_closed)`` returned a scalar int."""
    if not numeric(size) or jnp.shape(size) != () or isinstance(size, (bool, float)):
        raise ValueError(f"every_k(windows_closed) must return a scalar int, got {size!r}")
    if not jnp.issubdtype(jnp.result_type(size), jnp.integer):
        raise ValueError(
            f"every_k(windows_closed) returned {jnp.result_type(size)}: return an int, "
            "e.g. jnp.int32(...) or x.astype(jnp.int32)"
        )
