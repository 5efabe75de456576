"""Parameter groups: freeze layers and give each group its own optimizer, by name.

Every parameter has a path name: the keys of the dicts, the fields of the
dataclasses and NamedTuples and the indices of the sequences on the way to it,
joined by ``/``. A Flax Linen ``Conv`` called ``conv1`` owns
``'params/conv1/kernel'`` and ``'params/conv1/bias'``; the same layer of a Flax
NNX model, seen through ``nnx.state(model, nnx.Param)``, owns ``'conv1/kernel'``
(an ``nnx.Variable`` counts as one leaf). Rules are ordered ``(regex, value)``
pairs; a parameter takes the value of the first rule whose regex
``re.search``-es its name.

This is PyTorch's ``requires_grad = False`` plus per-group optimizers, and
MindSpore's ``group_params``, as optax transforms::

    tx = gradtools.param_groups(
        [(r'conv', optax.sgd(0.01, momentum=0.9)), (r'^params/fc1/', gradtools.frozen())],
        default=optax.adamw(1e-3, mask=gradtools.decay_mask),
    )

Each group's transform sees only its own parameters (the others are
``optax.MaskedNode``, an empty subtree), so frozen parameters hold no optimizer
state at all and a global transform such as gradient clipping inside a group
measures that group alone. Rules are checked against the parameter names when
the names are known, at ``init`` (and again when ``update`` is traced): a rule
that matches nothing, or a parameter that matches no rule while there is no
default, is a ``ValueError`` that lists the names, so a typo never trains
everything silently.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradtools import _apply
from gradtools import _checks
from gradtools import _tree

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

_Rules = list[tuple[re.Pattern[str], Any]]
_MAX_NAMES = 100  # how many names an error message lists


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


# -- names ---------------------------------------------------------------------------------------


def _is_variable(x: Any) -> bool:
    """Whether ``x`` is a Flax ``nnx.Variable`` (one leaf, whatever its insides)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Variable)


def _key_name(key: Any) -> str:
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def _is_box(x: Any) -> bool:
    """Whether ``x`` is a Flax metadata box (``nn.Partitioned``, ``nn.LogicallyPartitioned``)."""
    meta = sys.modules.get("flax.core.meta")
    return meta is not None and isinstance(x, meta.AxisMetadata)


_BOXED = jax.tree_util.GetAttrKey("value")


def _unboxed(paths: list[tuple[Any, ...]], tree: Any) -> list[tuple[Any, ...]]:
    """``paths`` without the ``value`` field of each Flax metadata box on them.

    ``nn.with_partitioning`` wraps a param in a box whose array is its field
    ``value``: the kernel is named ``params/Dense_0/kernel``, not
    ``params/Dense_0/kernel/value``, as it is without partitioning.
    """
    if "flax.core.meta" not in sys.modules:
        return paths
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: _is_box(x))[0]
    boxes = {tuple(path) for path, x in found if _is_box(x)}
    if not boxes:
        return paths
    out = []
    for path in paths:
        for n in range(len(path)):
            if path[n] == _BOXED and tuple(path[:n]) in boxes:
                path = (*path[:n], *path[n + 1 :])
                break
        out.append(tuple(path))
    return out


def _flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
    """Path names, leaves (``nnx.Variable``s whole) and treedef of ``tree``."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)
    paths = _unboxed([path for path, _ in pairs], tree)
    names = ["/".join(_key_name(k) for k in path) for path in paths]
    return names, [leaf for _, leaf in pairs], treedef


def _array(leaf: Any) -> Any:
    """The array (or ShapeDtypeStruct) a leaf holds."""
    return jax.tree.leaves(leaf)[0] if _is_variable(leaf) else leaf


def path_names(params: Any) -> Any:
    """The path name of every leaf: keys, fields and indices joined by ``/``.

    Args:
      params: a pytree: Flax Linen variables, an ``nnx.State``, nested
        dicts/lists/tuples/NamedTuples/dataclasses. ``None`` and empty subtrees
        stay as they are; an ``nnx.Variable`` is one leaf; a param boxed by
        ``nn.with_partitioning`` is named as it would be unboxed.

    Returns:
      A pytree of the structure of ``params`` with a ``str`` at every leaf.

    Example:
      >>> names = gradtools.path_names({'params': {'conv1': {'kernel': 0, 'bias': 0}},
      ...                               'heads': [0, (0, 0)]})
      >>> jax.tree.leaves(names)
      ['heads/0', 'heads/1/0', 'heads/1/1', 'params/conv1/bias', 'params/conv1/kernel']
    """
    names, _, treedef = _flatten(params)
    return treedef.unflatten(names)


# -- rules ---------------------------------------------------------------------------------------


def _parse_rules(rules: Any, arg: str = "rules") -> _Rules:
    if isinstance(rules, (str, dict)) or not isinstance(rules, Sequence):
        raise TypeError(f"{arg}={rules!r} must be a sequence of (regex, value) pairs")
    parsed = []
    for i, rule in enumerate(rules):
        if not isinstance(rule, (tuple, list)) or len(rule) != 2:
            raise TypeError(f"{arg}[{i}]={rule!r} must be a (regex, value) pair")
        parsed.append((_checks.regex(f"{arg}[{i}][0]", rule[0]), rule[1]))
    return parsed


def _listing(names: list[str]) -> str:
    shown = "\n".join(f"  {n}" for n in names[:_MAX_NAMES])
    more = f"\n  ... and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else ""
    return f"The parameter names are:\n{shown}{more}"


def _assign(names: list[str], rules: _Rules, has_default: bool, caller: str) -> list[int]:
    """For each name, the index of its first matching rule (``len(rules)``: default)."""
    index = [
        next((i for i, (rx, _) in enumerate(rules) if rx.search(n)), len(rules)) for n in names
    ]
    unmatched = [n for n, i in zip(names, index) if i == len(rules)]
    if unmatched and not has_default:
        raise ValueError(
            f"{caller}: {len(unmatched)} parameter(s) match no rule and there is no default: "
            f"{unmatched[:_MAX_NAMES]}. Add a rule for them or pass default=. {_listing(names)}"
        )
    for i, (rx, _) in enumerate(rules):
        if i not in index:
            why = (
                "every parameter it matches is taken by an earlier rule"
                if any(rx.search(n) for n in names)
                else "it matches no parameter"
            )
            raise ValueError(
                f"{caller}: rules[{i}] regex {rx.pattern!r} is unused: {why}. {_listing(names)}"
            )
    return index


def label_params(params: Any, rules: Sequence[tuple[str, Any]], default: Any = None) -> Any:
    """Labels every parameter with the value of the first rule that matches its name.

    Args:
      params: a pytree of parameters (see :func:`path_names`).
      rules: ordered ``(regex, label)`` pairs; a parameter takes the label of
        the first rule whose regex ``re.search``-es its path name (a string,
        or compiled with ``re.compile``, e.g. for ``re.IGNORECASE``). Labels
        should be leaves (str, int, bool), e.g. ``False`` for a weight-decay mask.
      default: the label of parameters that match no rule; ``None`` means
        every parameter must match a rule.

    Returns:
      A pytree of the structure of ``params`` holding the labels.

    Raises:
      TypeError: if ``rules`` is not a sequence of pairs or a regex is not a str.
      ValueError: if a regex is invalid, a rule matches no parameter (or only
        parameters that earlier rules took), or a parameter matches no rule
        while ``default is None``; the message lists the parameter names.

    Example:
      >>> params = {'conv': {'kernel': jnp.ones((3, 3)), 'bias': jnp.ones(3)}, 'fc': jnp.ones(2)}
      >>> gradtools.label_params(params, [(r'bias$', 'no_decay'), (r'conv', 'conv')], 'rest')
      {'conv': {'bias': 'no_decay', 'kernel': 'conv'}, 'fc': 'rest'}
    """
    parsed = _parse_rules(rules)
    names, _, treedef = _flatten(params)
    index = _assign(names, parsed, default is not None, "label_params")
    values = [value for _, value in parsed] + [default]
    return treedef.unflatten([values[i] for i in index])


# -- transforms ----------------------------------------------------------------------------------


def _frozen_init(params: Any) -> optax.EmptyState:
    del params
    return optax.EmptyState()


def _frozen_update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
    del params
    return jax.tree.map(jnp.zeros_like, updates), state


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
    return optax.GradientTransformation(_frozen_init, _frozen_update)


# Every optax.set_to_zero() (optax's own way to freeze) has an update of this code
# (a fresh object, matching nothing, should a later optax make it no function).
_SET_TO_ZERO_CODE = getattr(optax.set_to_zero().update, "__code__", object())


def _is_frozen(value: Any) -> bool:
    """Whether ``value`` is :func:`frozen()`, ``optax.set_to_zero()`` or the label ``'frozen'``."""
    if isinstance(value, str):
        return value == "frozen"
    return isinstance(value, optax.GradientTransformation) and (
        value.init is _frozen_init or getattr(value.update, "__code__", None) is _SET_TO_ZERO_CODE
    )


def _only(tree: Any, index: list[int], group: int) -> Any:
    """``tree`` with every leaf outside ``group`` replaced by ``optax.MaskedNode()``."""
    _, leaves, treedef = _flatten(tree)
    return treedef.unflatten(
        [x if i == group else optax.MaskedNode() for x, i in zip(leaves, index)]
    )


def _init_groups(txs: list[Any], params: Any, index: list[int]) -> tuple[Any, ...]:
    return tuple(tx.init(_only(params, index, g)) for g, tx in enumerate(txs))


def _update_groups(txs, states, updates, params, index, extra_args, fused=False):
    """Runs each group's transform on its own leaves and merges the results.

    Returns the updates, or with ``fused`` the new params: each group then takes
    its own fast path (:func:`gradtools._apply.update_and_apply`), and a frozen
    group leaves its params as they are instead of adding zeros to them.
    """
    _, leaves, treedef = _flatten(updates)
    out, new_states = list(leaves), []
    for g, (tx, state) in enumerate(zip(txs, states)):
        group_params = None if params is None else _only(params, index, g)
        group_updates = _only(updates, index, g)
        if fused and _is_frozen(tx):
            new = group_params
        elif fused:
            new, state = _apply.update_and_apply(
                tx, group_updates, state, group_params, **extra_args
            )
        else:
            new, state = tx.update(group_updates, state, group_params, **extra_args)
        for j, x in enumerate(treedef.flatten_up_to(new)):
            if index[j] == g:
                out[j] = x
        new_states.append(state)
    return treedef.unflatten(out), tuple(new_states)


def _check_loss_scale_covers_all(states: tuple[Any, ...], txs: list[Any], patterns: list[str]):
    """Raises unless a loss scaler inside a group leaves every other group frozen.

    ``scale_loss`` scales the whole loss, so every gradient arrives scaled; a
    scaler inside one group unscales only that group's.
    """
    names = [*patterns, "default"]
    scaled = [g for g, s in enumerate(states) if optax.tree.get_all_with_path(s, "LossScaleState")]
    unscaled = [g for g in range(len(txs)) if g not in scaled and not _is_frozen(txs[g])]
    if scaled and unscaled:
        raise ValueError(
            f"param_groups: the group {names[scaled[0]]!r} holds a loss scaler, but "
            f"{', '.join(repr(names[g]) for g in unscaled)} would get gradients of the scaled "
            "loss that nothing unscales. Put the loss scaler outside: "
            "dynamic_loss_scale(param_groups(...))"
        )


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
        lists the parameter names; also at ``init``, if a group holds a loss
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
    parsed = _parse_rules(rules)
    for i, (_, tx) in enumerate(parsed):
        _checks.is_transform(f"rules[{i}][1]", tx)
    if default is not None:
        _checks.is_transform("default", default)
    # frozen(): set_to_zero() gives the same updates, but the wrapper hides what it is.
    txs = [tx for _, tx in parsed] + ([default] if default is not None else [])
    txs = [optax.with_extra_args_support(frozen() if _is_frozen(tx) else tx) for tx in txs]

    def index_of(tree):
        return _assign(_flatten(tree)[0], parsed, default is not None, "param_groups")

    def init_fn(params):
        states = _init_groups(txs, params, index_of(params))
        _check_loss_scale_covers_all(states, txs, [rx.pattern for rx, _ in parsed])
        return ParamGroupsState(states)

    def step(updates, state, params, extra_args, fused):
        _tree.check_like("param_groups", updates, params)
        index = index_of(updates)
        out, states = _update_groups(
            txs, state.group_states, updates, params, index, extra_args, fused
        )
        return out, ParamGroupsState(states)

    return _apply.transformation(init_fn, step)


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
        matches no parameter: the message lists the parameter names.

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
    if not isinstance(patterns, Sequence) or not patterns:
        raise TypeError(f"{patterns=} must be a regex or a non-empty sequence of regexes")
    compiled = [_checks.regex(f"patterns[{i}]", p) for i, p in enumerate(patterns)]
    txs = [optax.with_extra_args_support(inner), optax.with_extra_args_support(frozen())]

    def index_of(tree):  # 1: frozen, 0: trained by inner
        names = _flatten(tree)[0]
        for pattern, rx in zip(patterns, compiled):
            if not any(rx.search(n) for n in names):
                raise ValueError(
                    f"freeze: pattern {pattern!r} matches no parameter. {_listing(names)}"
                )
        return [int(any(rx.search(n) for rx in compiled)) for n in names]

    def init_fn(params):
        return FreezeState(_init_groups(txs, params, index_of(params))[0])

    def step(updates, state, params, extra_args, fused):
        _tree.check_like("freeze", updates, params)
        states = (state.inner_state, optax.EmptyState())
        index = index_of(updates)
        out, states = _update_groups(txs, states, updates, params, index, extra_args, fused)
        return out, FreezeState(states[0])

    return _apply.transformation(init_fn, step)


# -- helpers for weight decay and inspection -----------------------------------------------------

_NO_DECAY_NAMES = ("bias", "scale")


def _shape_dtype(leaf: Any) -> tuple[tuple[int, ...], str]:
    a = _array(leaf)
    if not (hasattr(a, "shape") and hasattr(a, "dtype")):
        a = np.asarray(a)
    # The dtype JAX computes in: a Python float or a NumPy float64 array is
    # float32 inside a jitted step unless x64 is on.
    return tuple(a.shape), np.dtype(jax.dtypes.canonicalize_dtype(a.dtype)).name


def decay_mask(params: Any) -> Any:
    """``True`` for the parameters weight decay should shrink: no biases, no norm scales.

    A parameter is excluded (``False``) when the last component of its path
    name is ``bias`` or ``scale`` (``attn_bias`` is not), or when it has fewer
    than 2 dimensions. The names cover Flax
    Linen and NNX ``Dense``/``Linear``/``Conv``/``DenseGeneral`` biases
    (``DenseGeneral``'s may be 2-D) and the ``scale``/``bias`` of
    ``LayerNorm``, ``BatchNorm``, ``GroupNorm`` and ``RMSNorm``; the
    dimension rule covers other naming schemes (Haiku's ``b``/``offset``, a
    converted PyTorch norm's ``weight``) and scalar parameters. Kernels and
    embeddings are decayed. For other rules, build the mask with
    :func:`label_params`, e.g. ``lambda p: label_params(p, [(r'bias$', False)], True)``.

    Args:
      params: a pytree of parameters, updates or ``jax.ShapeDtypeStruct``s.

    Returns:
      A pytree of bools of the structure of ``params``; pass the function
      itself as ``mask=`` of ``optax.adamw`` or ``optax.add_decayed_weights``.

    Example:
      >>> import optax
      >>> params = {'fc': {'kernel': jnp.ones((2, 3)), 'bias': jnp.ones(3)},
      ...           'norm': {'scale': jnp.ones(3)}}
      >>> gradtools.decay_mask(params)
      {'fc': {'bias': False, 'kernel': True}, 'norm': {'scale': False}}
      >>> tx = optax.adamw(1e-3, weight_decay=1e-4, mask=gradtools.decay_mask)

    References:
      Loshchilov & Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019; the "no decay on bias and
      LayerNorm weights" rule of BERT's and timm's optimizers.
    """
    names, leaves, treedef = _flatten(params)
    return treedef.unflatten(
        [
            n.rsplit("/", 1)[-1] not in _NO_DECAY_NAMES and len(_shape_dtype(x)[0]) >= 2
            for n, x in zip(names, leaves)
        ]
    )


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
    parsed = _parse_rules(rules) if rules is not None else []
    names, leaves, _ = _flatten(params)
    index = _assign(names, parsed, True, "describe")
    rows, trainable, frozen_count = [], 0, 0
    for name, leaf, i in zip(names, leaves, index):
        shape, dtype = _shape_dtype(leaf)
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
