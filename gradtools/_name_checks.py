"""Checks of regex rules and patterns against parameter names, at ``init`` and at trace time.

Like :mod:`gradtools._checks`, it holds argument checks and nothing else. The
messages name a few parameters, those most like a pattern that matches none
first, so that a typo never trains everything silently.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "param_tree",
    "patterns_match",
    "regex",
    "regexes",
    "rules_match",
]


def regex(name: str, value: Any) -> re.Pattern[str]:
    """Compiles ``value`` as a regular expression (or takes it compiled), or says why it cannot."""
    if isinstance(value, re.Pattern) and isinstance(value.pattern, str):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name}={value!r} must be a regular expression string, e.g. r'conv'")
    try:
        return re.compile(value)
    except re.error as err:
        raise ValueError(f"{name}={value!r} is not a valid regular expression: {err}") from None


def regexes(name: str, value: Any) -> list[re.Pattern[str]]:
    """Compiles each of ``value``, a non-empty sequence of regexes, as :func:`regex` does.

    For an argument that takes one regex or a sequence of them: the caller
    puts a single one in a list first.
    """
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise TypeError(f"{name}={value!r} must be a regex or a non-empty sequence of regexes")
    return [regex(f"{name}[{i}]", v) for i, v in enumerate(value)]


_MAX_NAMES = 5  # how many parameter names an error message lists


def _listing(names: list[str]) -> str:
    """A few ``names``, and how many there are in all."""
    shown = "\n".join(f"  {n}" for n in names[:_MAX_NAMES])
    more = f"\n  ... and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else ""
    return f"{shown}{more}"


def _closest(pattern: str, names: list[str]) -> str:
    """The few names most like ``pattern`` (:func:`difflib.get_close_matches`), closest first."""
    close = difflib.get_close_matches(pattern, names, n=_MAX_NAMES, cutoff=0.0)
    return (
        f"The closest of the {len(names)} parameter names (gradtools.describe(params) lists "
        "them all):\n" + "\n".join(f"  {n}" for n in close)
    )


def param_tree(caller: str, params: Any) -> None:
    """Raises unless ``params`` may be a parameter tree: not a lone scalar integer (a step count).

    ``optax.inject_hyperparams`` takes every callable argument for a schedule
    and calls it with the step count: a ``mask=`` function would get that
    count, and a mask built from it would silently mask everything.
    """
    if isinstance(params, (jax.Array, np.ndarray, np.generic, int)) and np.ndim(params) == 0:
        if jnp.issubdtype(jnp.result_type(params), jnp.integer):
            raise ValueError(
                f"{caller}: params={params!r} is a scalar integer, not a parameter tree: "
                "optax.inject_hyperparams calls a callable hyperparameter with the step "
                "count. Name it in static_args, e.g. optax.inject_hyperparams(optax.adamw, "
                "static_args=('mask',))(learning_rate, mask=gradtools.decay_mask)"
            )


def rules_match(
    caller: str,
    names: list[str],
    rules: list[tuple[re.Pattern[str], Any]],
    index: list[int],
    has_default: bool,
) -> None:
    """Raises unless every rule takes a parameter and, without a default, every parameter has one.

    ``index`` holds each name's first matching rule (``len(rules)``: none).
    """
    unmatched = [n for n, i in zip(names, index) if i == len(rules)]
    if unmatched and not has_default:
        raise ValueError(
            f"{caller}: {len(unmatched)} parameter(s) match no rule and there is no default:\n"
            f"{_listing(unmatched)}\nAdd a rule for them or pass default=."
        )
    for i, (rx, _) in enumerate(rules):
        if i not in index:
            taken = [n for n in names if rx.search(n)]
            if taken:
                why = f"every parameter it matches is taken by an earlier rule:\n{_listing(taken)}"
            else:
                why = f"it matches no parameter. {_closest(rx.pattern, names)}"
            raise ValueError(f"{caller}: rules[{i}] regex {rx.pattern!r} is unused: {why}")


def patterns_match(
    caller: str, patterns: Sequence[Any], compiled: list[re.Pattern[str]], names: list[str]
) -> None:
    """Raises unless each of ``patterns`` (compiled: ``compiled``) matches one of ``names``."""
    for pattern, rx in zip(patterns, compiled):
        if not any(rx.search(n) for n in names):
            raise ValueError(
                f"{caller}: pattern {pattern!r} matches no parameter. {_closest(rx.pattern, names)}"
            )
