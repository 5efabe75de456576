"""Path names of parameters, and regex rules that label them.

Every parameter has a path name: the keys of the dicts, the fields of the
dataclasses and NamedTuples and the indices of the sequences on the way to it,
joined by ``/``. A Flax Linen ``Conv`` called ``conv1`` owns
``'params/conv1/kernel'`` and ``'params/conv1/bias'``; the same layer of a Flax
NNX model, seen through ``nnx.state(model, nnx.Param)``, owns ``'conv1/kernel'``
(an ``nnx.Variable`` counts as one leaf). Rules are ordered ``(regex, value)``
pairs; a parameter takes the value of the first rule whose regex
``re.search``-es its name. :mod:`gradtools.groups` builds its transforms on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gradtools import _name_checks
from gradtools import _paths

__all__ = ["decay_mask", "label_params", "path_names"]


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
    names, _, treedef = _paths.flatten(params)
    return treedef.unflatten(names)


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
        while ``default is None`` (the message names the closest few); or if
        ``params`` is a scalar integer, as ``optax.inject_hyperparams`` passes
        a ``mask`` not named in ``static_args``.

    Example:
      >>> params = {'conv': {'kernel': jnp.ones((3, 3)), 'bias': jnp.ones(3)}, 'fc': jnp.ones(2)}
      >>> gradtools.label_params(params, [(r'bias$', 'no_decay'), (r'conv', 'conv')], 'rest')
      {'conv': {'bias': 'no_decay', 'kernel': 'conv'}, 'fc': 'rest'}
    """
    _name_checks.param_tree("label_params", params)
    parsed = _paths.parse_rules(rules)
    names, _, treedef = _paths.flatten(params)
    index = _paths.assign(names, parsed, default is not None, "label_params")
    values = [value for _, value in parsed] + [default]
    return treedef.unflatten([values[i] for i in index])


_NO_DECAY_NAMES = ("bias", "scale")


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
      itself as ``mask=`` of ``optax.adamw`` or ``optax.add_decayed_weights``
      (under ``optax.inject_hyperparams``, with ``static_args=('mask',)``).

    Raises:
      ValueError: if ``params`` is a scalar integer (a step count:
        ``optax.inject_hyperparams`` passes one to a ``mask`` not named in
        ``static_args``).

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
    _name_checks.param_tree("decay_mask", params)
    names, leaves, treedef = _paths.flatten(params)
    return treedef.unflatten(
        [
            n.rsplit("/", 1)[-1] not in _NO_DECAY_NAMES and len(_paths.shape_dtype(x)[0]) >= 2
            for n, x in zip(names, leaves)
        ]
    )
