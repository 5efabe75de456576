"""Parameter groups: freeze layers and give each group its own optimizer, by name.

This is PyTorch's ``requires_grad = False`` plus per-group optimizers, and
MindSpore's ``group_params``, as optax transforms over the path names of
:mod:`gradtools.naming`::

    tx = gradtools.param_groups(
        [(r'conv', optax.sgd(0.01, momentum=0.9)), (r'^params/fc1/', gradtools.frozen())],
        default=optax.adamw(1e-3, mask=gradtools.decay_mask),
    )

Each group's transform sees only its own parameters (the others are
``optax.MaskedNode``, an empty subtree), so frozen parameters hold no optimizer
state at all and a global transform such as gradient clipping inside a group
measures that group alone. A rule that matches nothing, or a parameter that
matches no rule while there is no default, is a ``ValueError`` that names the
closest few parameters, so a typo never trains everything silently.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import optax

from gradtools import _apply
from gradtools import _checks
from gradtools import _compat
from gradtools import _name_checks
from gradtools import _paths
from gradtools import _tree
from gradtools.loss_scale import LossScaleState
from gradtools.naming import decay_mask
from gradtools.naming import label_params
from gradtools.naming import path_names

__all__ = [
    "FreezeState",
    "ParamGroupsState",
    "decay_mask",
    "describe",
    "freeze",
    "frozen",
    "label_params",
    "param_groups",
    "path_names",
]


class ParamGroupsState(NamedTuple):
    """State of :func:`param_groups`.

    Attributes:
      group_states: one state per rule, in rule order, then the default's state
        when there is a default. Each group's state covers only its own
        parameters; the others are ``optax.MaskedNode`` (no arrays).
    """

    group_states: tuple[optax.OptState, ...]


class FreezeState(NamedTuple):
    """State of :func:`freeze`.

    Attributes:
      inner_state: the state of the wrapped transformation, over the trainable
        parameters only (frozen ones are ``optax.MaskedNode``, no arrays).
    """

    inner_state: optax.OptState


# -- transforms ----------------------------------------------------------------------------------


def _frozen_init(params: Any) -> optax.EmptyState:
    """:func:`frozen`'s init, by which :func:`_is_frozen` knows a ``frozen()``."""
    del params
    return optax.EmptyState()


def frozen() -> optax.GradientTransformation:
    """Zero updates and no state: the transform of a frozen group.

    ``update`` returns ``zeros_like(grads)``; ``init`` returns
    ``optax.EmptyState()``. Use it as a group's transform in
    :func:`param_groups` (or as the ``default``, to train only the matched
    groups); :func:`describe` shows parameters given ``frozen()`` as not
    trainable. ``optax.set_to_zero()``, optax's way to freeze, is taken as
    ``frozen()`` in both.

    Returns:
      An ``optax.GradientTransformation``.

    Example:
      >>> tx = gradtools.frozen()
      >>> tx.update({'w': jnp.ones(2)}, tx.init({'w': jnp.ones(2)}))[0]
      {'w': Array([0., 0.], dtype=float32)}
    """

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        _checks.state_of("frozen", state, optax.EmptyState)
        return _tree.zeros_of_types(updates), state

    return optax.GradientTransformation(_frozen_init, update_fn)


def _loss_scaler_outside(
    caller: str, names: list[str], states: Sequence[Any], frozen: list[bool]
) -> None:
    """Raises unless a group whose state holds a loss scaler leaves every other group frozen.

    ``scale_loss`` scales the whole loss, so every gradient arrives scaled; a
    scaler inside one group unscales only that group's. ``names`` and
    ``frozen`` tell each group's name and whether it is frozen.
    """
    scaled = [g for g, s in enumerate(states) if _tree.find(s, LossScaleState)]
    unscaled = [g for g in range(len(states)) if g not in scaled and not frozen[g]]
    if scaled and unscaled:
        raise ValueError(
            f"{caller}: the group {names[scaled[0]]!r} holds a loss scaler, but "
            f"{', '.join(repr(names[g]) for g in unscaled)} would get gradients of the scaled "
            "loss that nothing unscales. Put the loss scaler outside: "
            f"dynamic_loss_scale({caller}(...))"
        )


def _is_frozen(value: Any) -> bool:
    """Whether ``value`` is :func:`frozen()`, ``optax.set_to_zero()`` or the label ``'frozen'``."""
    if isinstance(value, str):
        return value == "frozen"
    return isinstance(value, optax.GradientTransformation) and (
        value.init is _frozen_init or _compat.is_set_to_zero(value)
    )


def _only(tree: Any, index: list[int], group: int) -> Any:
    """``tree`` with every leaf outside ``group`` replaced by ``optax.MaskedNode()``."""
    _, leaves, treedef = _paths.flatten(tree)
    return treedef.unflatten(
        [x if i == group else optax.MaskedNode() for x, i in zip(leaves, index)]
    )


def _update_groups(txs, states, updates, params, index, extra_args, fused):
    """Runs each group's transform on its own leaves and merges the results.

    Returns the updates, or with ``fused`` the new params: each group then takes
    its own fast path (:func:`gradtools._apply.step`). A frozen group (its
    transform ``None``) runs none: its updates are zeros, and fused its params
    stay as they are instead of having zeros added to them.
    """
    _, leaves, treedef = _paths.flatten(updates)
    out, new_states = list(leaves), []
    for g, (tx, state) in enumerate(zip(txs, states)):
        group_params = None if params is None else _only(params, index, g)
        group_updates = _only(updates, index, g)
        if tx is None:
            new = group_params if fused else _tree.zeros_of_types(group_updates)
        else:
            new, state = _apply.step(tx, group_updates, state, group_params, extra_args, fused)
        for j, x in enumerate(treedef.flatten_up_to(new)):
            if index[j] == g:
                out[j] = x
        new_states.append(state)
    return treedef.unflatten(out), tuple(new_states)


def param_groups(
    rules: Sequence[tuple[str, optax.GradientTransformation]],
    default: optax.GradientTransformation | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Gives each group of parameters, chosen by name, its own transformation.

    ::

      group(p) = first i with re.search(rules[i][0], path_name(p)), else default
      updates[g], state[g] = rules[g][1].update(grads[g], state[g], params[g])

    where ``grads[g]`` holds group ``g``'s leaves and ``optax.MaskedNode()``
    elsewhere, so a group's optimizer state covers only its own parameters and
    a :func:`frozen` group has none. Extra keyword arguments of ``update`` go
    to every group.

    Args:
      rules: ordered ``(regex, transformation)`` pairs; first match wins.
      default: the transformation for parameters that match no rule; ``None``
        means every parameter must match a rule.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`ParamGroupsState`.

    Raises:
      TypeError: if ``rules`` is not a sequence of ``(str, transformation)``
        pairs or ``default`` is not a transformation.
      ValueError: if a regex is invalid (when built); at ``init``, if a rule
        matches no parameter (or only ones taken by earlier rules), or a
        parameter matches no rule while ``default is None``: the message
        names the closest few parameters; also at ``init``, if a group holds a loss
        scaler while another group trains (their gradients would stay
        scaled: put the scaler outside, around ``param_groups``).

    Example:
      >>> import optax
      >>> rules = [(r'^head', optax.sgd(0.1)), (r'^body', gradtools.frozen())]
      >>> tx = gradtools.param_groups(rules)
      >>> params = {'body': jnp.ones(2), 'head': jnp.ones(2)}
      >>> tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)[0]
      {'body': Array([0., 0.], dtype=float32), 'head': Array([-0.1, -0.1], dtype=float32)}

    References:
      MindSpore ``nn.Optimizer`` with ``group_params``; PyTorch optimizer
      parameter groups.
    """
    parsed = _paths.parse_rules(rules)
    for i, (_, tx) in enumerate(parsed):
        _checks.is_transform(f"rules[{i}][1]", tx)
    if default is not None:
        _checks.is_transform("default", default)
    txs = [tx for _, tx in parsed] + ([default] if default is not None else [])
    txs = [None if _is_frozen(tx) else optax.with_extra_args_support(tx) for tx in txs]
    names = [rx.pattern for rx, _ in parsed] + ["default"]

    def index_of(tree):
        return _paths.assign(_paths.flatten(tree)[0], parsed, default is not None, "param_groups")

    def init_fn(params):
        index = index_of(params)
        states = tuple(
            optax.EmptyState() if tx is None else tx.init(_only(params, index, g))
            for g, tx in enumerate(txs)
        )
        _loss_scaler_outside("param_groups", names, states, [tx is None for tx in txs])
        return ParamGroupsState(states)

    def step(updates, state, params, extra_args, fused):
        _checks.state_of("param_groups", state, ParamGroupsState)
        _checks.check_like("param_groups", updates, params)
        index = index_of(updates)
        out, states = _update_groups(
            txs, state.group_states, updates, params, index, extra_args, fused
        )
        return out, ParamGroupsState(states)

    return optax.GradientTransformationExtraArgs(init_fn, _apply.Update(step))


def freeze(
    inner: optax.GradientTransformation, patterns: str | Sequence[str]
) -> optax.GradientTransformationExtraArgs:
    """Freezes the parameters whose names match any of ``patterns``; ``inner`` trains the rest.

    ::

      frozen(p) = any(re.search(pattern, path_name(p)) for pattern in patterns)
      updates[frozen] = 0                       # exact zeros, no state
      updates[rest], inner_state = inner.update(grads[rest], inner_state, params[rest])

    ``inner`` sees the frozen leaves as ``optax.MaskedNode()``: with
    ``optax.adam`` a frozen half of a model costs no ``mu``/``nu``, and a
    global-norm clip inside ``inner`` measures the trainable gradients only,
    as PyTorch's ``clip_grad_norm_`` skips parameters without gradients.
    Put ``freeze`` outermost, around a loss scaler and :func:`gradtools.accumulate`:
    they then neither check nor buffer the frozen gradients, nothing reads
    them, and under ``jax.jit`` XLA drops their computation. Through
    :func:`gradtools.apply_gradients` the frozen params are not touched at all.

    Args:
      inner: the optimizer of the trainable parameters.
      patterns: a regex or a sequence of regexes; every one must match at
        least one parameter name.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`FreezeState`; extra keyword arguments go to ``inner``.

    Raises:
      TypeError: if ``inner`` is not a transformation or a pattern not a str.
      ValueError: if a pattern is invalid (when built) or, at ``init``,
        matches no parameter: the message names the closest few.

    Example:
      >>> import optax
      >>> tx = gradtools.freeze(optax.adam(0.1), [r'^conv'])
      >>> params = {'conv': jnp.ones(2), 'fc': jnp.ones(2)}
      >>> state = tx.init(params)
      >>> state.inner_state[0].mu  # no Adam moments for the frozen conv
      {'conv': MaskedNode(), 'fc': Array([0., 0.], dtype=float32)}
      >>> updates, state = tx.update({'conv': jnp.ones(2), 'fc': jnp.ones(2)}, state, params)
      >>> updates['conv'], state.inner_state[0].mu['conv']
      (Array([0., 0.], dtype=float32), MaskedNode())

    References:
      PyTorch ``param.requires_grad_(False)``; MindSpore
      ``param.requires_grad = False``.
    """
    _checks.is_transform("inner", inner)
    if isinstance(patterns, (str, re.Pattern)):
        patterns = [patterns]
    compiled = _name_checks.regexes("patterns", patterns)
    txs = [optax.with_extra_args_support(inner), None]  # None: the frozen group runs nothing

    def index_of(tree):  # 1: frozen, 0: trained by inner
        names = _paths.flatten(tree)[0]
        _name_checks.patterns_match("freeze", patterns, compiled, names)
        return [int(any(rx.search(n) for rx in compiled)) for n in names]

    def init_fn(params):
        return FreezeState(txs[0].init(_only(params, index_of(params), 0)))

    def step(updates, state, params, extra_args, fused):
        _checks.state_of("freeze", state, FreezeState)
        _checks.check_like("freeze", updates, params)
        states = (state.inner_state, optax.EmptyState())
        index = index_of(updates)
        out, states = _update_groups(txs, states, updates, params, index, extra_args, fused)
        return out, FreezeState(states[0])

    return optax.GradientTransformationExtraArgs(init_fn, _apply.Update(step))


def describe(params: Any, rules: Sequence[tuple[str, Any]] | None = None) -> str:
    """A table of the parameters: name, shape, dtype, group, trainable, count, totals.

    PyTorch's ``for name, p in model.named_parameters(): print(name, p.shape,
    p.requires_grad)``, for a pytree and the rules of :func:`param_groups` or
    :func:`label_params`. The group of a parameter is its rule's label, or
    its rule's regex when the rule's value is a transformation, or
    ``default`` when no rule matches (and when ``rules`` is ``None``). A
    parameter is frozen (``trainable`` is ``no``) when its rule's value is
    :func:`frozen()`, ``optax.set_to_zero()`` or the label ``'frozen'``.

    Args:
      params: a pytree of arrays or ``jax.ShapeDtypeStruct``s (see
        :func:`path_names`).
      rules: optional ordered ``(regex, value)`` pairs, first match wins.

    Returns:
      The table as a string: a header, one line per parameter in path-name
      order, and the trainable, frozen and total parameter counts.

    Raises:
      TypeError, ValueError: as :func:`label_params` for malformed rules, an
        invalid regex or a rule that matches no parameter.

    Example:
      >>> params = {'conv': {'kernel': jnp.ones((3, 3, 1, 4)), 'bias': jnp.ones(4)},
      ...           'fc': {'kernel': jnp.ones((4, 2), jnp.bfloat16)}}
      >>> print(gradtools.describe(params, [(r'^conv/', 'frozen')]))
      name         shape         dtype     group    trainable  params
      -----------  ------------  --------  -------  ---------  ------
      conv/bias    (4,)          float32   frozen   no              4
      conv/kernel  (3, 3, 1, 4)  float32   frozen   no             36
      fc/kernel    (4, 2)        bfloat16  default  yes             8
      trainable params:  8
      frozen params:    40
      all params:       48
    """
    parsed = _paths.parse_rules(rules) if rules is not None else []
    names, leaves, _ = _paths.flatten(params)
    index = _paths.assign(names, parsed, True, "describe")
    rows, trainable, frozen_count = [], 0, 0
    for name, leaf, i in zip(names, leaves, index):
        shape, dtype = _paths.shape_dtype(leaf)
        count = math.prod(shape)
        if i == len(parsed):
            group, value = "default", None
        else:
            rx, value = parsed[i]
            group = rx.pattern if isinstance(value, optax.GradientTransformation) else str(value)
        if _is_frozen(value):
            frozen_count += count
        else:
            trainable += count
        row = (name, str(shape), dtype, group, "no" if _is_frozen(value) else "yes", f"{count:,}")
        rows.append(row)
    header = ("name", "shape", "dtype", "group", "trainable", "params")
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    lines = [
        "  ".join(
            cell.rjust(w) if c == 5 else cell.ljust(w) for c, (cell, w) in enumerate(zip(r, widths))
        )
        for r in [header, tuple("-" * w for w in widths), *rows]
    ]
    totals = [
        ("trainable params:", trainable),
        ("frozen params:", frozen_count),
        ("all params:", trainable + frozen_count),
    ]
    width = len(f"{trainable + frozen_count:,}")
    lines += [f"{label:<17} {n:>{width},}" for label, n in totals]
    return "\n".join(lines)
