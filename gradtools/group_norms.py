"""Gradient norms per group of parameters, chosen by name, for the training log.

Per-layer gradient norms answer "which layer?" when a run diverges or its
loss scale keeps backing off, and are otherwise written by hand with hooks.
:func:`group_norms` keeps them in the optimizer state, where
:func:`gradtools.metrics` finds them as ``grad_norm/<label>``::

    tx = optax.chain(
        gradtools.group_norms([(r'conv', 'conv'), (r'Dense', 'dense')]),
        gradtools.clip_by_global_norm(1.0),
        optax.adam(1e-3),
    )

First in a chain it sees the raw gradients; after a clip, the clipped ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradtools import _checks
from gradtools import _norms
from gradtools import _paths
from gradtools import _square_sums

__all__ = ["GroupNormsState", "group_norms"]


class GroupNormsState(NamedTuple):
    """State of :func:`group_norms`.

    Attributes:
      group_grad_norms: a dict from each group's label to the float32 norm of
        that group's last updates (0 after ``init``); a label no parameter
        takes has no entry.
    """

    group_grad_norms: dict[str, jax.Array]  # each shape=(), dtype=float32

    takes_square_sums = True  # from a loss scaler right outside (_square_sums)
    updates_unchanged = True  # so the next member of a chain is offered them too

    def metrics(self) -> dict[str, jax.Array]:
        """What :func:`gradtools.metrics` reports of this state."""
        return {f"grad_norm/{k}": jnp.asarray(v) for k, v in self.group_grad_norms.items()}


def _by_group(groups: dict[str, list[int]], updates: Any, sums: Any, p: Any) -> dict[str, Any]:
    """Each group's norm, the group given by its leaves' positions: from ``sums``, where a loss
    scaler offered the sums of squares of these very leaves for an L2 norm, else read."""
    leaves = [_paths.leaf_array(x) for x in _paths.flatten(updates)[1]]
    if isinstance(p, float) and p == 2 and sums is not None and len(sums) == len(leaves):
        return {label: _norms.l2_norm([sums[i] for i in at]) for label, at in groups.items()}
    return {label: _norms.tree_norm([leaves[i] for i in at], p) for label, at in groups.items()}


def group_norms(
    rules: Sequence[tuple[str, str]], *, default: str | None = "other", norm_type: float = 2.0
) -> optax.GradientTransformationExtraArgs:
    """Passes the updates through unchanged and keeps the norm of each group's updates.

    ::

      label(p) = rules[i][1] for the first i with re.search(rules[i][0], path_name(p)),
                 else default
      group_grad_norms[l] = global_norm([u for u in updates if label(u) == l], norm_type)

    Groups are chosen as :func:`gradtools.label_params` chooses labels (rules
    with the same label make one group); norms are float32 whatever the
    dtypes. :func:`gradtools.metrics` reports them as ``grad_norm/<label>``.
    Each leaf is read once; beside a :func:`gradtools.clip_by_global_norm`
    in one jitted step, XLA computes each leaf's sum of squares once for both,
    and right inside a loss scaler (as the wrapped transformation, or first in
    an ``optax.chain`` that is) the L2 norms come from the sums of squares of
    the scaler's own pass.

    Args:
      rules: ordered ``(regex, label)`` pairs; a parameter takes the label of
        the first rule whose regex ``re.search``-es its path name. Labels are
        non-empty strings.
      default: the label of parameters that match no rule; ``None`` means
        every parameter must match a rule.
      norm_type: ``p`` of the norms: any number >= 1, or ``float('inf')``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`GroupNormsState`; its updates are its inputs.

    Raises:
      TypeError: if ``rules`` is not a sequence of pairs, a regex is not a
        str, or a label (or ``default``) is not a non-empty str.
      ValueError: if a regex is invalid or ``norm_type`` is below 1 or no
        number (when built); at ``init``, if a rule matches no parameter (or
        only ones taken by earlier rules), or a parameter matches no rule
        while ``default is None``: the message names a few parameters; when
        ``update`` is traced, if the updates fall into other groups than the
        params given to ``init``, or if ``params`` are given (as
        ``optax.chain`` passes them) and the updates differ from them in tree
        structure or in a leaf's shape: the message names those leaves.

    Example:
      >>> import jax.numpy as jnp
      >>> tx = gradtools.group_norms([(r'^conv', 'conv')])
      >>> grads = {'conv': jnp.array([3.0, 4.0]), 'fc': jnp.array([1.0])}
      >>> updates, state = tx.update(grads, tx.init(grads))
      >>> {k: float(v) for k, v in gradtools.metrics(state).items()}
      {'grad_norm/conv': 5.0, 'grad_norm/other': 1.0}

    References:
      PyTorch users log ``torch.linalg.vector_norm`` of each parameter's
      ``.grad`` by hand; Keras and MindSpore have no counterpart.
    """
    parsed = _paths.parse_rules(rules)
    for i, (_, label) in enumerate(parsed):
        if not isinstance(label, str) or not label:
            raise TypeError(f"rules[{i}][1]={label!r} must be a non-empty str: the group's label")
    if default is not None and (not isinstance(default, str) or not default):
        raise TypeError(f"{default=} must be a non-empty str, or None")
    p = _norms.norm_type(norm_type)
    labels = [label for _, label in parsed] + [default]

    def grouped(tree: Any) -> dict[str, list[int]]:
        """Each label's leaf positions in ``tree``, in tree order."""
        names, _, _ = _paths.flatten(tree)
        index = _paths.assign(names, parsed, default is not None, "group_norms")
        out: dict[str, list[int]] = {}
        for position, i in enumerate(index):
            out.setdefault(labels[i], []).append(position)  # pyright: ignore[reportArgumentType]
        return out

    def init_fn(params):
        return GroupNormsState({k: jnp.zeros([], jnp.float32) for k in grouped(params)})

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        state, sums = _square_sums.take(state, updates)
        _checks.state_of("group_norms", state, GroupNormsState)
        _checks.real_leaves("group_norms", "updates", updates)
        if isinstance(params, optax.LookaheadParams):  # chained before an optax.lookahead
            params = params.fast
        _checks.check_like("group_norms", updates, params)
        groups = grouped(updates)
        if set(groups) != set(state.group_grad_norms):
            raise ValueError(
                f"group_norms: the updates have the groups {sorted(groups)}, the state from "
                f"init {sorted(state.group_grad_norms)}; pass the gradients of the params "
                "given to init"
            )
        return updates, GroupNormsState(_by_group(groups, updates, sums, p))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
