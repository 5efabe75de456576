"""What the benchmarks compare: gradtools transforms and the code they replace.

A case is a train-step fragment ``step(carry, grads) -> carry`` with
``carry = init(params)``; for an optax transform the step is the usual
``tx.update`` followed by ``optax.apply_updates``. Each case names the number
of float32 words per parameter its step must read and write at the least (its
traffic), from which the report derives a bandwidth bound.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import jax
import jax.numpy as jnp
import optax

import gradtools

__all__ = [
    "Case",
    "MICRO_K",
    "Pattern",
    "available",
    "installed",
    "from_tx",
    "param_shapes",
    "random_tree",
    "update_cases",
]

#: ``every_k`` of the micro-step cases: no window closes while they are timed.
MICRO_K = 1 << 30


@dataclass(frozen=True)
class Pattern:
    """``init(params) -> carry`` and ``step(carry, grads) -> carry``; ``carry[0]`` is params."""

    init: Callable[[Any], Any]
    step: Callable[[Any, Any], Any]


@dataclass(frozen=True)
class Case:
    """One benchmarked train-step fragment.

    Attributes:
      name: the row label.
      groups: the groups the case is timed in; a group's cases are timed
        interleaved with each other (and with the triad, which is in all).
      words: float32 words per parameter the step must read plus write.
      traffic: how ``words`` is made up, for the report.
      make: builds the :class:`Pattern`.
      baseline: the name of the case this one replaces (the ratio column).
      select_tree: the select-between-whole-trees pattern (compiles slowly).
      calls: optimizer calls per timed sample (a window of ``accumulate``).
      f32_words: how many of ``words`` are float32 whatever the params' dtype
        (``accumulate``'s buffer); the others have the params' dtype.
    """

    name: str
    groups: tuple[str, ...]
    words: float
    traffic: str
    make: Callable[[], Pattern]
    baseline: str | None = None
    select_tree: bool = False
    calls: int = 1
    f32_words: float = 0.0
    notes: str = field(default="", compare=False)

    def bytes_per_param(self, dtype: Any) -> float:
        """The bytes per parameter the step must move when params and grads are ``dtype``."""
        size = jnp.dtype(dtype).itemsize
        return (self.words - self.f32_words) * size + self.f32_words * 4


def param_shapes(n_params: int, n_leaves: int, dtype: Any = jnp.float32) -> dict[str, Any]:
    """``n_params`` parameters of ``dtype`` split into ``n_leaves`` 1-D leaves (a flat dict)."""
    if n_leaves < 1 or n_params < n_leaves:
        raise ValueError(f"need 1 <= {n_leaves=} <= {n_params=}")
    base = n_params // n_leaves
    sizes = [base] * n_leaves
    sizes[0] += n_params - base * n_leaves
    return {f"w{i:04d}": jax.ShapeDtypeStruct((s,), jnp.dtype(dtype)) for i, s in enumerate(sizes)}


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(key: jax.Array, shape: tuple[int, ...], dtype: Any, std: float) -> jax.Array:
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


def random_tree(shapes: dict[str, Any], seed: int, std: float = 1e-3) -> dict[str, jax.Array]:
    """Normal(0, std) arrays of the given shapes, made on the device."""
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {k: _normal(key, s.shape, s.dtype, std) for key, (k, s) in zip(keys, shapes.items())}


def from_tx(tx: optax.GradientTransformation) -> Callable[[], Pattern]:
    """The standard step: ``update`` then ``apply_updates``."""

    def make() -> Pattern:
        def init(params):
            return params, tx.init(params)

        def step(carry, grads):
            params, state = carry
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        return Pattern(init, step)

    return make


def _apply_gradients(tx: optax.GradientTransformation) -> Callable[[], Pattern]:
    """The step through ``gradtools.apply_gradients`` (what ``train_step`` runs)."""

    def make() -> Pattern:
        def init(params):
            return params, tx.init(params)

        def step(carry, grads):
            params, state = carry
            return gradtools.apply_gradients(tx, grads, state, params)  # pyright: ignore

        return Pattern(init, step)

    return make


def _like(grads: Any, params: Any) -> Any:
    """Grads cast to their params' dtypes, as jmp's ``cast_to_param`` does after unscaling
    (which computes in float32); a no-op for float32 params."""
    return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


def _jmp_select(inner: optax.GradientTransformation) -> Callable[[], Pattern]:
    """jmp's documented loop: unscale, check, adjust, then select whole trees.

    The carry holds the scale's arrays, not the ``jmp.DynamicLossScale``
    itself: its ``__post_init__`` fails on the placeholders ``jax.jit(...).lower``
    unflattens it with.
    """
    import jmp

    def make() -> Pattern:
        def init(params):
            return params, inner.init(params), (jnp.float32(2.0**15), jnp.int32(0))

        def step(carry, grads):
            params, state, (loss_scale, counter) = carry
            scale = jmp.DynamicLossScale(loss_scale, counter)
            grads = _like(scale.unscale(grads), params)
            finite = jmp.all_finite(grads)
            scale = scale.adjust(finite)
            updates, new_state = inner.update(grads, state, params)
            new_params = optax.apply_updates(params, updates)
            params, state = jmp.select_tree(finite, (new_params, new_state), (params, state))
            return params, state, (scale.loss_scale, scale.counter)

        return Pattern(init, step)

    return make


@jax.custom_vjp
def _given_grads(params: Any, grads: Any) -> jax.Array:
    """A zero "loss" whose gradient with respect to ``params`` is ``grads``."""
    del params, grads
    return jnp.zeros([], jnp.float32)


def _given_fwd(params, grads):
    del params
    return jnp.zeros([], jnp.float32), grads


def _given_bwd(grads, cotangent):
    del cotangent
    return grads, jax.tree.map(jnp.zeros_like, grads)


_given_grads.defvjp(_given_fwd, _given_bwd)


def _flax_select(inner: optax.GradientTransformation) -> Callable[[], Pattern]:
    """flax's ``DynamicScale.value_and_grad``, then ``jnp.where`` over whole trees.

    The loss handed to ``value_and_grad`` returns the benchmark's (scaled)
    gradients unchanged, so the step does exactly flax's unscale, finiteness
    check, scale update and selection, and no model work.
    """
    from flax.training.dynamic_scale import DynamicScale

    def make() -> Pattern:
        def init(params):
            return params, inner.init(params), DynamicScale()

        def step(carry, grads):
            params, state, dyn = carry
            dyn, finite, _, grads = dyn.value_and_grad(lambda p: _given_grads(p, grads))(params)
            grads = _like(grads, params)
            updates, new_state = inner.update(grads, state, params)
            new_params = optax.apply_updates(params, updates)
            select = functools.partial(jnp.where, finite)
            params = jax.tree.map(select, new_params, params)
            state = jax.tree.map(select, new_state, state)
            return params, state, dyn

        return Pattern(init, step)

    return make


def _triad() -> Pattern:
    def step(carry, grads):
        return (jax.tree.map(lambda a, b: a + 0.5 * b, carry[0], grads),)  # weak 0.5: a's dtype

    return Pattern(lambda params: (params,), step)


def installed(module: str) -> bool:
    """Whether an optional counterpart (jmp, flax) can be imported."""
    return importlib.util.find_spec(module) is not None


def available(name: str) -> bool:
    """Whether this gradtools build has the public name (features land one by one)."""
    return hasattr(gradtools, name)


def _adam() -> optax.GradientTransformation:
    return optax.adam(1e-3)


def _optax_chain() -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0), _adam())


def _gradtools_chain() -> optax.GradientTransformation:
    return optax.chain(gradtools.clip_by_global_norm(1.0), _adam())  # pyright: ignore


def update_cases() -> list[Case]:
    """Every case the update-cost, compile-time and memory sections know.

    Cases whose gradtools feature is not in this build are left out.
    """
    T = "triad"
    cases = [
        Case(T, ("*",), 3, "read a, b; write a", lambda: _triad()),
        Case(
            "optax.adam",
            ("clip", "groups", "rounding"),
            7,
            "read g, p, m, v; write p, m, v",
            from_tx(_adam()),
        ),
        Case(
            "optax.clip+adam",
            ("clip", "loss_scale"),
            8,
            "norm: read g; adam: 7",
            from_tx(_optax_chain()),
            baseline="optax.adam",
        ),
    ]
    clip = available("clip_by_global_norm")
    if clip:
        cases.append(
            Case(
                "gradtools.clip+adam",
                ("clip", "diagnostics"),
                8,
                "norm: read g; adam: 7",
                from_tx(_gradtools_chain()),
                baseline="optax.clip+adam",
            )
        )
    inner = _gradtools_chain if clip else _optax_chain
    inner_name = "gradtools.clip+adam" if clip else "optax.clip+adam"
    ls = "finite: read g; norm: read g; adam: 7"
    cases += [
        Case(
            "optax.apply_if_finite(optax.clip+adam)",
            ("loss_scale",),
            9,
            ls,
            from_tx(optax.apply_if_finite(_optax_chain(), 3)),
        ),
        Case(
            f"gradtools.dynamic_loss_scale({inner_name})",
            ("loss_scale",),
            9,
            ls,
            from_tx(gradtools.dynamic_loss_scale(inner())),
            baseline="optax.apply_if_finite(optax.clip+adam)",
        ),
    ]
    if available("apply_gradients"):
        cases.append(
            Case(
                f"gradtools.apply_gradients(dynamic_loss_scale({inner_name}))",
                ("loss_scale",),
                9,
                ls,
                _apply_gradients(gradtools.dynamic_loss_scale(inner())),
                baseline="optax.apply_if_finite(optax.clip+adam)",
            )
        )
    if installed("jmp"):
        cases.append(
            Case(
                f"jmp.DynamicLossScale+select_tree({inner_name})",
                ("loss_scale",),
                9,
                ls,
                _jmp_select(inner()),
                select_tree=True,
            )
        )
    if installed("flax"):
        cases.append(
            Case(
                f"flax DynamicScale+where({inner_name})",
                ("loss_scale",),
                9,
                ls,
                _flax_select(inner()),
                select_tree=True,
            )
        )
    cases += [
        Case(
            "optax.MultiSteps(adam) micro-step",
            ("accumulate",),
            6,
            ACC_TRAFFIC,
            from_tx(optax.MultiSteps(_adam(), MICRO_K).gradient_transformation()),
        ),
    ]
    if available("accumulate"):
        acc = gradtools.accumulate  # pyright: ignore
        cases.append(
            Case(
                "gradtools.accumulate(adam) micro-step",
                ("accumulate",),
                6,
                ACC_TRAFFIC,
                from_tx(acc(_adam(), MICRO_K)),
                baseline="optax.MultiSteps(adam) micro-step",
                f32_words=2,
            )
        )
        if available("apply_gradients"):
            cases.append(
                Case(
                    "gradtools.apply_gradients(accumulate(adam)) micro-step",
                    ("accumulate",),
                    3,
                    "buffer: read g, acc; write acc (params untouched)",
                    _apply_gradients(acc(_adam(), MICRO_K)),
                    baseline="optax.MultiSteps(adam) micro-step",
                    f32_words=2,
                )
            )
        if available("NoiseScaleState"):
            cases += _noise_scale_cases(acc)
    if available("freeze"):
        cases += _group_cases()
    if clip:
        cases += _diagnostic_cases()
    if available("stochastic_rounding"):
        rounding = gradtools.stochastic_rounding()  # pyright: ignore
        cases.append(
            Case(
                "optax.adam+stochastic_rounding",
                ("rounding",),
                7,
                "adam: 7; the rounding reads the p and u that apply_updates reads",
                from_tx(optax.chain(_adam(), rounding)),
                baseline="optax.adam",
            )
        )
    return cases


ACC_TRAFFIC = "buffer: read g, acc; write acc (3); apply_updates of zeros: read p, u; write p (3)"


def _noise_scale_cases(acc: Callable[..., Any]) -> list[Case]:
    """The micro-step with the noise-scale statistics, against the micro-step without them.

    The statistics add |g|^2 to a scalar: the gradients the buffer reads
    anyway, so the least traffic is the plain micro-step's.
    """
    on = functools.partial(acc, _adam(), MICRO_K, noise_scale=True)
    cases = [
        Case(
            "gradtools.accumulate(adam, noise_scale) micro-step",
            ("accumulate",),
            6,
            ACC_TRAFFIC + "; |g|^2: the g the buffer reads",
            from_tx(on()),
            baseline="gradtools.accumulate(adam) micro-step",
            f32_words=2,
        )
    ]
    if available("apply_gradients"):
        cases.append(
            Case(
                "gradtools.apply_gradients(accumulate(adam, noise_scale)) micro-step",
                ("accumulate",),
                3,
                "buffer: read g, acc; write acc (params untouched); |g|^2: the same g",
                _apply_gradients(on()),
                baseline="gradtools.apply_gradients(accumulate(adam)) micro-step",
                f32_words=2,
            )
        )
    return cases


#: Half of the leaves (the even-numbered ones), by name.
_HALF = r"w\d*[02468]$"


def _group_cases() -> list[Case]:
    """freeze and param_groups against optax.multi_transform, half the leaves each way."""

    def labels(params):
        return {k: ("b" if re.search(_HALF, k) else "a") for k in params}

    sgd = optax.sgd(1e-2, momentum=0.9)
    frozen_traffic = "trained half: adam 7; frozen half: apply_updates of zeros 0 to 3"
    split_traffic = "adam half: 7; sgd-momentum half: read g, p, m; write p, m (5)"
    return [
        Case(
            "optax.multi_transform(adam, set_to_zero)",
            ("groups",),
            3.5,
            frozen_traffic,
            from_tx(optax.multi_transform({"a": _adam(), "b": optax.set_to_zero()}, labels)),
        ),
        Case(
            "gradtools.freeze(adam, half)",
            ("groups",),
            3.5,
            frozen_traffic,
            from_tx(gradtools.freeze(_adam(), _HALF)),  # pyright: ignore
            baseline="optax.multi_transform(adam, set_to_zero)",
        ),
        Case(
            "optax.multi_transform(adam, sgd)",
            ("groups",),
            6,
            split_traffic,
            from_tx(optax.multi_transform({"a": _adam(), "b": sgd}, labels)),
        ),
        Case(
            "gradtools.param_groups(adam, sgd)",
            ("groups",),
            6,
            split_traffic,
            from_tx(gradtools.param_groups([(_HALF, sgd)], default=_adam())),  # pyright: ignore
            baseline="optax.multi_transform(adam, sgd)",
        ),
    ]


def _diagnostic_cases() -> list[Case]:
    """spike_guard around, and group_norms before, gradtools' clip + adam: each against the chain.

    Both read the gradients for their norms where the clip does: the guard
    hands the clip its sums of squares, and XLA computes group_norms' and the
    clip's per-leaf sums once.
    """
    traffic = "norm: read g (one read for both); adam: 7"
    out = []
    if available("spike_guard"):
        guard = gradtools.spike_guard(_gradtools_chain())  # pyright: ignore
        out.append(
            Case(
                "gradtools.spike_guard(gradtools.clip+adam)",
                ("diagnostics",),
                8,
                traffic,
                from_tx(guard),
                baseline="gradtools.clip+adam",
            )
        )
    if available("group_norms"):
        norms = gradtools.group_norms([(_HALF, "even")])  # pyright: ignore
        out.append(
            Case(
                "gradtools.group_norms+clip+adam",
                ("diagnostics",),
                8,
                traffic,
                from_tx(optax.chain(norms, _gradtools_chain())),
                baseline="gradtools.clip+adam",
            )
        )
    return out
