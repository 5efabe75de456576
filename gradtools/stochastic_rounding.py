"""Stochastic rounding of updates to bfloat16 and float16 params.

bfloat16 keeps 8 significant bits: at 1.0 its values are 2**-7 apart, so an
update below 2**-8 is rounded away and a bfloat16 parameter stops moving late
in a learning-rate schedule. Rounding ``param + update`` up or down at random,
in proportion to where it lies between its two neighbours, makes the expected
parameter the exact sum.

Put it last in the chain (outside any per-group split), so that it sees the
final updates and the whole tree::

    tx = gradtools.dynamic_loss_scale(
        optax.chain(optax.adam(1e-3), gradtools.stochastic_rounding(seed=0)))
"""

from __future__ import annotations

import numbers
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from gradtools import _checks

__all__ = ["StochasticRoundingState", "stochastic_rounding"]

#: The Weyl increment (2**32 / golden ratio) and murmur3's 32-bit finalizer constants.
_GOLDEN = np.uint32(0x9E3779B9)
_MIX1, _MIX2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)


class StochasticRoundingState(NamedTuple):
    """State of :func:`stochastic_rounding`.

    Attributes:
      rounding_step: how many updates have been rounded. With the seed, the
        leaf's place in the tree and each element's index, it picks the
        element's random bits, so that every step draws afresh. It stops at
        ``2**31 - 1``, from where every step draws the same bits.
    """

    rounding_step: jax.Array  # shape=(), dtype=int32


def _check_seed(seed: Any) -> None:
    """Checks that ``seed`` is an int from 0 to 2**31 - 1 (traced: an integer scalar)."""
    if _checks.traced(seed):
        if jnp.shape(seed) == () and jnp.issubdtype(seed.dtype, jnp.integer):
            return
    elif not isinstance(seed, (bool, np.bool_)) and (
        isinstance(seed, numbers.Integral)
        or (np.ndim(seed) == 0 and np.issubdtype(np.asarray(seed).dtype, np.integer))
    ):
        if 0 <= int(seed) <= _checks.MAX_INT32:
            return
    raise ValueError(f"seed={seed!r} must be an int from 0 to 2**31 - 1, e.g. seed=0")


def _mix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: every bit of the uint32 result depends on every input bit."""
    h = (h ^ (h >> 16)) * _MIX1
    h = (h ^ (h >> 13)) * _MIX2
    return h ^ (h >> 16)


def _random_bits(shape: tuple[int, ...], key: jax.Array) -> jax.Array:
    """32 random bits per element: ``_mix(flat_index * golden + key)``, a counter-based hash."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride)
        stride *= shape[axis]
    return _mix(index * _GOLDEN + key)


def _round_bfloat16(x: jax.Array, bits: jax.Array) -> jax.Array:
    """``x`` (float32) rounded stochastically to bfloat16, as the float32 of that value.

    bfloat16 is the top 16 bits of the float32 pattern. A random 16-bit number
    added to the low 16 bits carries into the top ones (one bfloat16 step away
    from zero) with probability ``(|x| - |lo|) / (|hi| - |lo|)``; then the low
    bits are cleared. A NaN gets no carry, which could run into its sign bit.
    """
    noise = jnp.where(jnp.isnan(x), np.uint32(0), bits >> 16)
    pattern = (lax.bitcast_convert_type(x, jnp.uint32) + noise) & np.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(pattern, jnp.float32)


def _round_float16(x: jax.Array, bits: jax.Array) -> jax.Array:
    """``x`` (float32) rounded stochastically to float16, as the float32 of that value.

    float16 keeps 10 of float32's 23 fraction bits: as for bfloat16, with 13
    random bits. Below 2**-14 float16's values are 2**-24 apart, as float32's
    are from 2**-14 to 2**-13: there it rounds ``|x| + 2**-14`` and takes
    ``2**-14`` off again (that sum is rounded to float32's 2**-37, so the
    probability is right to 2**-14 there). Past float16's largest value, inf.
    """
    magnitude = jnp.abs(x)
    small = magnitude < np.float32(2.0**-14)
    shifted = jnp.where(small, magnitude + np.float32(2.0**-14), magnitude)
    pattern = (lax.bitcast_convert_type(shifted, jnp.uint32) + (bits >> 19)) & np.uint32(0xFFFFE000)
    rounded = lax.bitcast_convert_type(pattern, jnp.float32)
    rounded = jnp.where(small, rounded - np.float32(2.0**-14), rounded)
    rounded = jnp.where(rounded > float(jnp.finfo(jnp.float16).max), np.float32(np.inf), rounded)
    return jnp.where(jnp.isnan(x), x, jnp.copysign(rounded, x))


def _round_leaf(path: str, update: Any, param: Any, key: jax.Array) -> Any:
    """The float32 update that takes ``param`` to ``param + update`` rounded stochastically."""
    dtype = jnp.result_type(param)
    if not jnp.issubdtype(dtype, jnp.floating) or jnp.finfo(dtype).bits >= 32:
        return update
    if dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"stochastic_rounding: params{path} is {dtype}; it rounds to bfloat16 and float16"
            " (float32 and wider params, and integer ones, are left as they are)"
        )
    p = jnp.asarray(param).astype(jnp.float32)
    x = p + jnp.asarray(update).astype(jnp.float32)
    bits = _random_bits(jnp.shape(param), key)
    t = _round_bfloat16(x, bits) if dtype == jnp.bfloat16 else _round_float16(x, bits)
    return jnp.where(t == p, np.float32(0), t - p)  # inf - inf would be NaN


def stochastic_rounding(seed: int = 0) -> optax.GradientTransformation:
    """Rounds ``param + update`` stochastically to each bfloat16 or float16 param's dtype.

    It goes last in a chain. Each ``update(updates, state, params)`` does, for
    each bfloat16 or float16 param::

      x = float32(param) + float32(update)
      lo, hi = the neighbours of x in param's dtype     # lo <= x <= hi
      t = hi with probability (x - lo) / (hi - lo), else lo
      update = float32(t) - float32(param)              # 0 where t == param

    ``optax.apply_updates`` adds in float32 and casts back, so it lands on
    ``t`` exactly, as do :func:`gradtools.apply_gradients`, ``train_step`` and
    the loss scalers, which apply that way. These updates are float32: in the
    param's dtype, ``t - param`` could round. Float32, float64 and integer
    params get their updates unchanged; float8 params are refused.

    The random bits hash the seed, ``rounding_step``, the leaf's place in the
    tree and the element's index: fresh every step, the same for the same
    seed. 16 of them decide for bfloat16, 13 for float16, which makes each
    probability exact (to 2**-14 for float16 values below 2**-14). A step that
    a loss scaler skips, or a micro-step of :func:`gradtools.accumulate`,
    never reaches it. Beyond the dtype's largest value it rounds as if the
    exponent had no bound, then overflows (as IEEE 754 does for
    round-to-nearest): between that value and the next power of two, up means
    inf. Below it, never inf; NaN and inf stay.

    Args:
      seed: an int from 0 to 2**31 - 1.

    Returns:
      An ``optax.GradientTransformation`` whose state is a
      :class:`StochasticRoundingState`.

    Raises:
      ValueError: if ``seed`` is not an int from 0 to 2**31 - 1; when traced,
        if ``params`` is None or not shaped like the updates, or holds a float
        dtype narrower than float32 other than bfloat16 and float16.

    Example:
      >>> import optax
      >>> tx = optax.chain(optax.sgd(1e-3), gradtools.stochastic_rounding(seed=0))
      >>> params = {'w': jnp.ones(4096, jnp.bfloat16)}
      >>> grads = {'w': jnp.ones(4096, jnp.bfloat16)}
      >>> updates, _ = tx.update(grads, tx.init(params), params)
      >>> new = optax.apply_updates(params, updates)['w']
      >>> sorted(set(new.tolist()))  # 1 - 1e-3 lies between these two bfloat16 values
      [0.99609375, 1.0]
      >>> round(float(new.astype(jnp.float32).mean()), 3)  # round-to-nearest gives 1.0
      0.999

    References:
      Zamirai et al., `Revisiting BFloat16 Training
      <https://arxiv.org/abs/2010.06192>`_, 2020; Gupta et al., `Deep Learning
      with Limited Numerical Precision <https://arxiv.org/abs/1502.02551>`_, 2015.
    """
    _check_seed(seed)

    def init_fn(params):
        del params
        return StochasticRoundingState(rounding_step=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        _checks.state_of("stochastic_rounding", state, StochasticRoundingState)
        if params is None:
            raise ValueError(
                "stochastic_rounding: params=None; pass the params to update, e.g."
                " tx.update(grads, state, params): the updates are rounded against them"
            )
        _checks.real_leaves("stochastic_rounding", "updates", updates)
        _checks.check_like("stochastic_rounding", updates, params)
        step = state.rounding_step
        # The mixer maps 0 to 0: without ^ _GOLDEN, seed 0 would draw 0 for the first
        # element of the first leaf at step 0, every time.
        seed_bits = jnp.asarray(seed).astype(jnp.uint32) ^ _GOLDEN
        base = _mix(_mix(seed_bits) ^ step.astype(jnp.uint32))
        pairs, treedef = jax.tree_util.tree_flatten_with_path(params)
        rounded = [
            _round_leaf(jax.tree_util.keystr(path), u, p, _mix(base ^ np.uint32(i)))
            for i, ((path, p), u) in enumerate(zip(pairs, treedef.flatten_up_to(updates)))
        ]
        new_state = StochasticRoundingState(rounding_step=jnp.asarray(optax.safe_increment(step)))
        return treedef.unflatten(rounded), new_state

    return optax.GradientTransformation(init_fn, update_fn)
