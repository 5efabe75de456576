"""The gradient noise scale from the micro-batches of accumulation windows.

McCandlish et al., `An Empirical Model of Large-Batch Training
<https://arxiv.org/abs/1812.06162>`_, 2018, appendix A.1: the squared norms
of the micro-batch gradients and of their mean are two estimates of ``|G|^2``
at two batch sizes, from which ``|G|^2`` and ``tr(Sigma)`` follow.
:func:`gradtools.accumulate` keeps them with ``noise_scale=True``.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradtools import _tree

__all__ = ["NoiseScaleState", "add", "close", "init", "sq_norm"]


class NoiseScaleState(NamedTuple):
    """The gradient-noise statistics of :func:`gradtools.accumulate` (``noise_scale=True``).

    Attributes:
      window_sq_norms: the sum over the open window's micro-batches of
        ``weight * |g_i|^2``, in float32.
      window_micro_batches: the micro-batches that entered the open window
        (those of weight > 0, and finite ones with ``"skip_microstep"``).
      g2_ema: the exponential moving average of the estimates of ``|G|^2``,
        not yet corrected for its start at 0.
      s_ema: the same for the estimates of ``tr(Sigma)``.
      ema_weight: the weight the averages have gathered, ``1 - decay**t``
        after ``t`` estimates; dividing by it is Adam's bias correction.
    """

    window_sq_norms: jax.Array  # shape=(), dtype=float32
    window_micro_batches: jax.Array  # shape=(), dtype=int32
    g2_ema: jax.Array  # shape=(), dtype=float32
    s_ema: jax.Array  # shape=(), dtype=float32
    ema_weight: jax.Array  # shape=(), dtype=float32

    def metrics(self) -> dict[str, jax.Array]:
        """``noise_scale``, ``grad_sq_norm`` and ``grad_variance``, bias-corrected; 0 before any
        (what :func:`gradtools.metrics` reports of this state)."""
        g2, s, weight = (jnp.asarray(x) for x in (self.g2_ema, self.s_ema, self.ema_weight))
        some = weight > 0
        one = jnp.ones([], jnp.float32)
        return {
            "noise_scale": jnp.where(g2 != 0, s / jnp.where(g2 != 0, g2, one), 0 * one),
            "grad_sq_norm": jnp.where(some, g2 / jnp.where(some, weight, one), 0 * one),
            "grad_variance": jnp.where(some, s / jnp.where(some, weight, one), 0 * one),
        }


def init() -> NoiseScaleState:
    """No window open, no estimate yet (each field its own array: each can be donated)."""
    f32 = [jnp.zeros([], jnp.float32) for _ in range(4)]
    return NoiseScaleState(f32[0], jnp.zeros([], jnp.int32), *f32[1:])


def sq_norm(tree: Any) -> jax.Array:
    """``sum(|x|^2)`` over every leaf of ``tree``, in float32."""
    return jnp.asarray(optax.tree.norm(optax.tree.cast(tree, jnp.float32), squared=True))


def add(state: NoiseScaleState, g_sq_norm: jax.Array, w: jax.Array, take: jax.Array):
    """``state`` after a micro-batch of weight ``w`` and ``|g|^2 = g_sq_norm``, if ``take``."""
    zero = jnp.zeros([], jnp.float32)
    return state._replace(
        window_sq_norms=state.window_sq_norms + jnp.where(take, w * g_sq_norm, zero),
        window_micro_batches=jnp.where(
            take, optax.safe_increment(state.window_micro_batches), state.window_micro_batches
        ),
    )


def close(
    state: NoiseScaleState, big: jax.Array, window_weight: jax.Array, decay: Any
) -> NoiseScaleState:
    """``state`` after a window closes: its estimates enter the averages, and its sums clear.

    ``big`` is ``|mean_i g_i|^2``; take it from the window's mean, not from the
    buffer that holds its sum: a second read of the buffer in the branch that
    closes the window makes XLA:CPU copy the buffer on every micro-step. With
    ``n`` micro-batches and ``b = B / n``, ``(B * big - b * small) / (B - b) =
    (n * big - small) / (n - 1)`` and ``(small - big) / (1 / b - 1 / B) =
    (small - big) * B / (n - 1)``. A window of fewer than 2 micro-batches, or
    with estimates that are not finite, gives none.
    """
    n = state.window_micro_batches.astype(jnp.float32)
    small = state.window_sq_norms / window_weight  # mean_i |g_i|^2
    g2 = (n * big - small) / (n - 1)
    s = (small - big) * window_weight / (n - 1)
    ok = (n >= 2) & jnp.isfinite(g2) & jnp.isfinite(s)
    decay = jnp.asarray(decay, jnp.float32)

    def ema(avg: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.where(ok, optax.tree.update_moment(x, avg, decay, 1), avg)

    # zeros that vary over shard_map axes as the window's sums do
    sq_norms, micro_batches = _tree.zeros_of_types(
        (state.window_sq_norms, state.window_micro_batches)
    )
    return NoiseScaleState(
        window_sq_norms=sq_norms,
        window_micro_batches=micro_batches,
        g2_ema=ema(state.g2_ema, g2),
        s_ema=ema(state.s_ema, s),
        ema_weight=ema(state.ema_weight, jnp.ones([], jnp.float32)),
    )
