"""The table of transforms that ``test_contract.py`` and ``test_conformance.py`` check.

A new transform joins by adding one row here (and its export in
``gradtools/__init__.py``); ``test_every_public_transform_has_a_row`` fails
until a public transform has a row with ``contract=True``.

Each row of ``TRANSFORMS`` is one configuration of one transform,
``factory(**kwargs)``, with what the checks need to know about it:

- ``id``: the test id, unique in the table.
- ``factory``, ``kwargs``: the transform under test; both files use these
  kwargs, except where a counter names its own (``Counter.kwargs``).
- ``takes_params``: whether its ``update`` needs ``params`` (the contract then
  refuses gradients whose tree or leaf shapes differ from them).
- ``counters``: the int32 counters its state keeps, each with the input that
  advances it (``Counter``); the contract checks that each saturates.
- ``floats``: its float hyperparameters; the contract checks that each refuses
  complex values, and that every parameter annotated ``float`` is listed.
- ``float32_updates``: its updates of bfloat16 and float16 params are float32
  (stochastic_rounding's: ``optax.apply_updates`` then lands exactly on the
  rounded value); every other transform's updates keep the params' dtypes.
- ``static_args``: the arguments ``optax.inject_hyperparams`` must leave
  static: those that fix the state's structure (``every_k``), and callables it
  would otherwise take for schedules (``dtype=jnp.float32``).
- ``contract``: whether the contract checks (``test_contract.py``) run on the
  row: ``False`` only for a plain optax optimizer, here to drive gradtools'
  schedules through the conformance checks, which run on every row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

import gradtools
from gradtools import _apply
from gradtools import _checks
from gradtools import schedules

__all__ = [
    "ROWS",
    "TRANSFORMS",
    "Counter",
    "Row",
    "SkipSmallState",
    "skip_small",
]


@dataclasses.dataclass(frozen=True)
class Counter:
    """An int32 counter of a state: ``field`` (dotted for a nested state), advanced by
    ``update`` with the contract's gradients of kind ``grads`` ('finite', 'nonfinite',
    'overflow'), from a state with the fields ``preset`` set first, and ``extra`` passed
    to it; ``kwargs`` replace the row's where the counter needs them to advance."""

    field: str
    grads: str = "finite"
    preset: tuple[tuple[str, Any], ...] = ()
    extra: tuple[tuple[str, Any], ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class Row:
    """A row: ``factory(**kwargs)`` is the transform under test (the module's docstring)."""

    id: str
    factory: Callable[..., optax.GradientTransformation]
    kwargs: dict[str, Any]
    takes_params: bool = True
    counters: tuple[Counter, ...] = ()
    floats: tuple[str, ...] = ()
    float32_updates: bool = False
    static_args: tuple[str, ...] = ()
    contract: bool = True


class SkipSmallState(NamedTuple):
    skipped: jax.Array  # shape=(), dtype=int32
    inner_state: optax.OptState

    def metrics(self):  # what gradtools.metrics reports of this state
        return {"skipped_small": jnp.asarray(self.skipped)}


def skip_small(inner, *, threshold: float = 0.0):
    """The template of docs/internals.md ("Adding a wrapper"), as written there."""
    _checks.is_transform("inner", inner)
    _checks.finite_non_negative("threshold", threshold)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return SkipSmallState(jnp.zeros([], jnp.int32), inner.init(params))

    def step(grads, state, params, extra_args, fused):
        _checks.state_of("skip_small", state, SkipSmallState)
        _checks.real_leaves("skip_small", "updates", grads)
        _checks.check_like("skip_small", grads, params)
        runs = gradtools.global_norm(grads) > threshold

        def do_update(grads):
            return _apply.step(inner, grads, state.inner_state, params, extra_args, fused)

        out, inner_state = _apply.step_or_skip(
            runs, do_update, grads, fused, params, state.inner_state
        )
        skipped = jnp.where(runs, state.skipped, optax.safe_increment(state.skipped))
        return out, SkipSmallState(skipped, inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, _apply.Update(step))


def sgd_warmup_exponential_decay(learning_rate, decay_rate, decay_steps, warmup_steps):
    """``optax.sgd`` with momentum, driven by a warmed-up exponential decay."""
    schedule = schedules.exponential_decay(learning_rate, decay_rate, decay_steps, staircase=True)
    return optax.sgd(schedules.with_warmup(schedule, warmup_steps), momentum=0.9)


def one_then_two(windows_closed):
    """A scheduled ``every_k``: a window of 1 micro-batch, then windows of 2."""
    return jnp.where(windows_closed < 1, 1, 2)


GROUP_RULES = [(r"^dense/", optax.sgd(0.1, momentum=0.9)), (r"^head", gradtools.frozen())]
GUARDED_CLIP = optax.chain(gradtools.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))
NORM_GROUPS = [(r"^dense/", "dense"), (r"^emb", "emb")]  # head: "other"
# A step of optax.sgd(1.0) on the contract's 'overflow' gradients overflows their
# float16 leaf; with a loss scale of 1, the loss scalers' step does too.
SGD = optax.sgd(1.0)
SPIKE_GUARD_FLOATS = ("z_threshold", "decay", "norm_type")
ACCUMULATE_STATIC = ("every_k", "dtype")

TRANSFORMS = [
    Row(
        "dynamic_loss_scale",
        gradtools.dynamic_loss_scale,
        dict(inner=optax.adam(0.1), init_scale=4.0, growth_interval=2),
        counters=(
            Counter("skipped_steps", "nonfinite"),
            Counter("nonfinite_updates", "overflow", kwargs=(("inner", SGD), ("init_scale", 1.0))),
        ),
        floats=("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"),
    ),
    Row(
        "fixed_loss_scale",
        gradtools.fixed_loss_scale,
        dict(inner=optax.sgd(0.1, momentum=0.9), scale=8.0),
        counters=(
            Counter("good_steps"),
            Counter("skipped_steps", "nonfinite"),
            Counter("nonfinite_updates", "overflow", kwargs=(("inner", SGD), ("scale", 1.0))),
        ),
        floats=("scale",),
    ),
    Row(
        "fixed_loss_scale_always_apply",
        gradtools.fixed_loss_scale,
        dict(inner=optax.sgd(0.1), scale=2.0, skip_nonfinite=False),
        floats=("scale",),
    ),
    Row(
        "accumulate",
        gradtools.accumulate,
        dict(inner=optax.adam(0.1), every_k=2),
        floats=("noise_scale_decay",),
        static_args=ACCUMULATE_STATIC,
    ),
    Row(
        "accumulate_skip_microstep",
        gradtools.accumulate,
        dict(inner=optax.sgd(0.1), every_k=3, average=False, on_nonfinite="skip_microstep"),
        counters=(Counter("dropped_micro_steps", "nonfinite"),),
        floats=("noise_scale_decay",),
        static_args=ACCUMULATE_STATIC,
    ),
    Row(
        "accumulate_scheduled",
        gradtools.accumulate,
        dict(inner=optax.sgd(0.1, momentum=0.9), every_k=one_then_two),
        counters=(Counter("windows_closed", extra=(("flush", True),)),),
        floats=("noise_scale_decay",),
        static_args=ACCUMULATE_STATIC,
    ),
    Row(
        "accumulate_noise_scale",
        gradtools.accumulate,
        dict(inner=optax.adam(0.1), every_k=2, noise_scale=True),
        counters=(Counter("noise_stats.window_micro_batches"),),
        floats=("noise_scale_decay",),
        static_args=ACCUMULATE_STATIC,
    ),
    Row(
        "clip_by_global_norm",
        gradtools.clip_by_global_norm,
        dict(max_norm=1.0),
        takes_params=False,
        floats=("max_norm", "norm_type"),
    ),
    Row("param_groups", gradtools.param_groups, dict(rules=GROUP_RULES, default=optax.adam(0.1))),
    Row(
        "freeze",
        gradtools.freeze,
        dict(inner=optax.sgd(0.1, momentum=0.9), patterns=r"^dense/bias"),
    ),
    Row("frozen", gradtools.frozen, dict(), takes_params=False),
    Row(
        "spike_guard",  # warmed up after one step: the 2nd and 3rd are clipped spikes
        gradtools.spike_guard,
        dict(inner=optax.adam(0.1), z_threshold=0.5, warmup_steps=1),
        counters=(
            # a spike: the running mean and variance are 0, the count past warm-up
            Counter("spikes", preset=(("norm_count", 5),)),
            Counter("norm_count"),
        ),
        floats=SPIKE_GUARD_FLOATS,
    ),
    Row(
        "spike_guard_skip",  # the 3rd step is a skipped spike
        gradtools.spike_guard,
        dict(inner=GUARDED_CLIP, action="skip", warmup_steps=2),
        counters=(Counter("spikes", preset=(("norm_count", 5),)),),
        floats=SPIKE_GUARD_FLOATS,
    ),
    Row(
        "group_norms",
        gradtools.group_norms,
        dict(rules=NORM_GROUPS),
        floats=("norm_type",),
    ),
    Row(
        "stochastic_rounding",
        gradtools.stochastic_rounding,
        dict(seed=3),
        counters=(Counter("rounding_step"),),
        float32_updates=True,
    ),
    Row(
        "skip_small",  # the template of docs/internals.md
        skip_small,
        # The conformance run's gradient norms are 10.3, 11.2 and 12.6: it skips the
        # 1st step; the contract's (3.7) are always skipped.
        dict(inner=optax.adam(0.1), threshold=10.7),
        counters=(Counter("skipped"),),
        floats=("threshold",),
    ),
    Row(
        "sgd_warmup_exponential_decay",
        sgd_warmup_exponential_decay,
        dict(learning_rate=0.1, decay_rate=0.5, decay_steps=1, warmup_steps=1),
        contract=False,
    ),
]
ROWS = {row.id: row for row in TRANSFORMS}
