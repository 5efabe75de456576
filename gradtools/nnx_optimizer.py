"""A ``flax.nnx.Optimizer`` whose ``update`` takes gradtools' fused path.

Like :mod:`gradtools.train_state`, this module imports flax; ``gradtools.Optimizer``
imports it on first use, so the rest of gradtools needs only jax, optax and numpy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx

from gradtools import _checks
from gradtools import _compat
from gradtools import _fp8
from gradtools.training import apply_gradients

__all__ = ["Optimizer"]


def _arrays(tree: Any) -> Any:
    """``tree`` with every ``nnx.Variable`` replaced by its array (flax 0.11 and 0.12 spell it
    differently)."""
    if hasattr(nnx, "as_pure"):
        return nnx.as_pure(tree)
    return nnx.to_arrays(nnx.pure(tree))  # type: ignore[attr-defined]


class Optimizer(nnx.Optimizer):
    """``flax.nnx.Optimizer`` stepping through :func:`gradtools.apply_gradients`.

    Build and use it as flax's: ``Optimizer(model, tx, wrt=nnx.Param)``, then
    ``optimizer.update(model, grads)`` inside an ``nnx.jit`` step. Its
    ``update`` computes::

      params, opt_state = gradtools.apply_gradients(
          tx, grads, opt_state, params, **update_kwargs, **kwargs)
      step = step + 1

    so a gradtools wrapper applies the update inside the branch that computes
    it: a step a loss scaler skips, or an accumulation micro-step, leaves the
    model's parameters as they were. With a loss scaler in ``tx``, scale the
    loss you differentiate by the current scale (forgetting it leaves the
    gradients ``loss_scale`` times too small)::

      def loss_fn(model):
          return gradtools.scale_loss(cross_entropy(model, batch), optimizer.opt_state)
      grads = nnx.grad(loss_fn)(model)
      optimizer.update(model, grads)

    fp8 meta (flax's fp8 ops through ``nnx.bridge``, variables of the type
    named ``_overwrite_with_gradient``) takes the gradients' values, as
    :func:`gradtools.apply_gradients` writes it: keep ``wrt=nnx.Param`` and
    differentiate with respect to both, ``nnx.grad(loss_fn,
    argnums=nnx.DiffState(0, (nnx.Param, meta_type)))``, where ``meta_type =
    nnx.variable_type_from_name('_overwrite_with_gradient')``.

    ``step`` counts calls, skipped steps and micro-steps included; the
    optimizer's own count, which its schedules read, counts applied updates.

    Attributes:
      step: the number of ``update`` calls (an ``nnx.OptState`` variable).
      tx: the optimizer, e.g. ``gradtools.dynamic_loss_scale(optax.adamw(1e-3))``.
      opt_state: ``tx``'s state, as ``nnx.Optimizer`` keeps it.
      wrt: the filter of the variables it updates.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> tx = gradtools.dynamic_loss_scale(optax.sgd(0.1))
      >>> optimizer = gradtools.Optimizer(model, tx, wrt=nnx.Param)
      >>> inf = jax.tree.map(lambda p: jnp.full(p.shape, jnp.inf), nnx.state(model, nnx.Param))
      >>> kernel = model.kernel[...]
      >>> optimizer.update(model, inf)   # overflow: skipped, the model is unchanged
      >>> bool(jnp.all(model.kernel[...] == kernel))
      True
      >>> gradtools.metrics(optimizer.opt_state)['skipped_steps']
      Array(1, dtype=int32)

    References:
      flax ``flax.nnx.Optimizer``.
    """

    def _with_meta(self, model: Any, params: Any, grads: Any, meta: Any, graph: dict) -> Any:
        """``(params, grads)``, as variables ``{'params': ..., '_overwrite_with_gradient': ...}``
        where ``grads`` hold fp8 meta (as :func:`gradtools.apply_gradients` takes them)."""
        if not meta:
            return params, grads
        selected = nnx.state(nnx.state(model, self.wrt, **graph), _compat.is_fp8_meta)
        if selected:
            raise ValueError(
                f"Optimizer: wrt={self.wrt!r} selects fp8 meta ({_compat.FP8_META!r} variables), "
                "so the optimizer state was built for them. tx steps on the params only and "
                "the meta takes its gradients' values: build Optimizer(model, tx, wrt=nnx.Param)"
            )
        old = _arrays(nnx.state(model, _compat.is_fp8_meta, **graph))
        return _fp8.merge({}, params, old), _fp8.merge({}, grads, _arrays(meta))

    def update(  # type: ignore[override]
        self,
        model: Any,
        grads: Any,
        /,
        update_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """One optimizer step: updates ``model``'s parameters and ``opt_state`` in place.

        Args:
          model: the ``nnx.Module`` whose ``wrt`` variables to update.
          grads: the gradients, as ``nnx.grad`` returns them (scaled by
            :func:`gradtools.scale_loss` when ``tx`` holds a loss scaler).
          update_kwargs: extra arguments for ``tx.update`` as a dict (e.g.
            ``{'flush': True}``), as :class:`gradtools.TrainState` takes them.
          **kwargs: extra arguments for ``tx.update``, as ``nnx.Optimizer``
            takes them; merged with ``update_kwargs``.

        Returns:
          None: the updates are applied where they are computed, never
          returned (``nnx.Optimizer.update`` returns them).

        Raises:
          TypeError: if ``update_kwargs`` is not a dict.
          ValueError: if ``grads`` hold fp8 meta and ``wrt`` selects it.
        """
        _checks.update_kwargs(update_kwargs)
        graph = {} if getattr(self, "graph", None) is None else {"graph": self.graph}
        params, grads = self._with_meta(
            model,
            _arrays(nnx.state(model, self.wrt, **graph)),
            _arrays(nnx.state(grads, self.wrt, **graph)),
            nnx.state(grads, _compat.is_fp8_meta, **graph),
            graph,
        )
        params, opt_state = apply_gradients(
            self.tx,
            grads,
            _arrays(self.opt_state),
            params,
            **_arrays({**(update_kwargs or {}), **kwargs}),
        )
        for part in _fp8.split(params, "params"):  # the params, then any fp8 meta
            if part is not None:
                nnx.update(model, part)
        nnx.update(self.opt_state, nnx.state(opt_state, **graph))
        self.step[...] += 1
