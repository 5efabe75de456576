"""Parameters by path name: the flattening, the rules and the leaf facts the naming API shares.

:mod:`gradtools.naming`, :mod:`gradtools.groups` and :mod:`gradtools.group_norms`
all see a tree of parameters as ``(names, leaves, treedef)`` and choose a rule
for each name the same way; this module is that one way.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from gradtools import _name_checks

__all__ = ["Rules", "assign", "flatten", "leaf_array", "parse_rules", "shape_dtype"]

Rules = list[tuple[re.Pattern[str], Any]]


def _is_variable(x: Any) -> bool:
    """Whether ``x`` is a Flax ``nnx.Variable`` (one leaf, whatever its insides)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Variable)


_BOXED = jax.tree_util.GetAttrKey("value")


def _unboxed(paths: list[tuple[Any, ...]], tree: Any) -> list[tuple[Any, ...]]:
    """``paths`` without the ``value`` field of each Flax metadata box on them.

    ``nn.with_partitioning`` wraps a param in a box (``nn.Partitioned``,
    ``nn.LogicallyPartitioned``) whose array is its field ``value``: the kernel
    is named ``params/Dense_0/kernel``, not ``params/Dense_0/kernel/value``, as
    it is without partitioning.
    """
    meta = sys.modules.get("flax.core.meta")
    if meta is None:  # no box without flax.core.meta
        return paths
    box = meta.AxisMetadata
    found = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, box))
    boxes = {path for path, x in found if isinstance(x, box)}
    return [
        tuple(k for n, k in enumerate(path) if not (k == _BOXED and path[:n] in boxes))
        for path in paths
    ]


def flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
    """Path names, leaves (``nnx.Variable``s whole) and treedef of ``tree``."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)
    paths = _unboxed([path for path, _ in pairs], tree)
    names = [jax.tree_util.keystr(path, simple=True, separator="/") for path in paths]
    return names, [leaf for _, leaf in pairs], treedef


def leaf_array(leaf: Any) -> Any:
    """The array (or ShapeDtypeStruct) a leaf holds."""
    return jax.tree.leaves(leaf)[0] if _is_variable(leaf) else leaf


def parse_rules(rules: Any, arg: str = "rules") -> Rules:
    if isinstance(rules, (str, dict)) or not isinstance(rules, Sequence):
        raise TypeError(f"{arg}={rules!r} must be a sequence of (regex, value) pairs")
    parsed = []
    for i, rule in enumerate(rules):
        if not isinstance(rule, (tuple, list)) or len(rule) != 2:
            raise TypeError(f"{arg}[{i}]={rule!r} must be a (regex, value) pair")
        parsed.append((_name_checks.regex(f"{arg}[{i}][0]", rule[0]), rule[1]))
    return parsed


def assign(names: list[str], rules: Rules, has_default: bool, caller: str) -> list[int]:
    """For each name, the index of its first matching rule (``len(rules)``: default).

    Raises:
      ValueError: if a rule takes no parameter, or a parameter matches no rule
        while there is no default (:func:`gradtools._name_checks.rules_match`).
    """
    index = [
        next((i for i, (rx, _) in enumerate(rules) if rx.search(n)), len(rules)) for n in names
    ]
    _name_checks.rules_match(caller, names, rules, index, has_default)
    return index


def shape_dtype(leaf: Any) -> tuple[tuple[int, ...], str]:
    a = leaf_array(leaf)
    if not (hasattr(a, "shape") and hasattr(a, "dtype")):
        a = np.asarray(a)
    # The dtype JAX computes in: a Python float or a NumPy float64 array is
    # float32 inside a jitted step unless x64 is on.
    return tuple(a.shape), np.dtype(jax.dtypes.canonicalize_dtype(a.dtype)).name
