"""The contract every public transform keeps, as one table (docs/internals.md, "Adding a wrapper").

Each row of ``CONTRACTS`` is one transform, with what the checks below need
to know about it: whether it takes ``params``, which int32 counters its state
keeps (and what input advances each), and which of its hyperparameters are
floats. Every transform must:

- refuse a state that is not its own with a ``ValueError`` or ``TypeError``
  naming the transform and ``init``, eagerly and under ``jax.jit``;
- where it takes ``params``, refuse gradients whose tree or leaf shapes differ
  from them, naming the transform and the leaf path;
- keep every int32 counter saturating at ``2**31 - 1``;
- refuse NumPy complex values for every float hyperparameter, naming it.

A new transform joins by adding a row.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradtools
from gradtools import _apply
from gradtools import _checks

MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Counter:
    """An int32 counter of a state: ``field`` (dotted for a nested state), advanced by
    ``update`` with gradients of kind ``grads`` ('finite', 'nonfinite', 'overflow'),
    from a state with the fields ``preset`` set first, and ``extra`` passed to it."""

    field: str
    grads: str = "finite"
    preset: tuple[tuple[str, Any], ...] = ()
    extra: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class Contract:
    """A row: ``factory(**kwargs)`` is the transform under test."""

    id: str
    factory: Callable[..., optax.GradientTransformation]
    kwargs: dict[str, Any]
    takes_params: bool = True
    counters: tuple[Counter, ...] = ()
    floats: tuple[str, ...] = ()


def every_2_then_4(windows_closed):
    return jnp.where(windows_closed < 1, 2, 4)


class SkipSmallState(NamedTuple):
    skipped: jax.Array  # shape=(), dtype=int32
    inner_state: optax.OptState


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


SGD = optax.sgd(1.0)
CONTRACTS = [
    Contract(
        "dynamic_loss_scale",
        gradtools.dynamic_loss_scale,
        dict(inner=SGD, init_scale=1.0),
        counters=(Counter("skipped_steps", "nonfinite"), Counter("nonfinite_updates", "overflow")),
        floats=("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"),
    ),
    Contract(
        "fixed_loss_scale",
        gradtools.fixed_loss_scale,
        dict(inner=SGD, scale=1.0),
        counters=(
            Counter("good_steps"),
            Counter("skipped_steps", "nonfinite"),
            Counter("nonfinite_updates", "overflow"),
        ),
        floats=("scale",),
    ),
    Contract(
        "accumulate",
        gradtools.accumulate,
        dict(inner=SGD, every_k=2, on_nonfinite="skip_microstep", noise_scale=True),
        counters=(
            Counter("dropped_micro_steps", "nonfinite"),
            Counter("noise_stats.window_micro_batches"),
        ),
        floats=("noise_scale_decay",),
    ),
    Contract(
        "accumulate_scheduled",
        gradtools.accumulate,
        dict(inner=SGD, every_k=every_2_then_4),
        counters=(Counter("windows_closed", extra=(("flush", True),)),),
        floats=("noise_scale_decay",),
    ),
    Contract(
        "clip_by_global_norm",
        gradtools.clip_by_global_norm,
        dict(max_norm=1.0),
        takes_params=False,
        floats=("max_norm", "norm_type"),
    ),
    Contract(
        "spike_guard",
        gradtools.spike_guard,
        dict(inner=SGD, warmup_steps=1),
        counters=(
            # a spike: the running mean and variance are 0, the count past warm-up
            Counter("spikes", preset=(("norm_count", 5),)),
            Counter("norm_count"),
        ),
        floats=("z_threshold", "decay", "norm_type"),
    ),
    Contract(
        "spike_guard_skip",
        gradtools.spike_guard,
        dict(inner=SGD, warmup_steps=1, action="skip"),
        counters=(Counter("spikes", preset=(("norm_count", 5),)),),
        floats=("z_threshold", "decay", "norm_type"),
    ),
    Contract("freeze", gradtools.freeze, dict(inner=optax.adam(0.1), patterns=r"^dense/bias")),
    Contract(
        "param_groups",
        gradtools.param_groups,
        dict(rules=[(r"^dense/", optax.adam(0.1)), (r"^head", gradtools.frozen())]),
    ),
    Contract(
        "group_norms",
        gradtools.group_norms,
        dict(rules=[(r"^dense/", "dense")]),
        floats=("norm_type",),
    ),
    Contract("frozen", gradtools.frozen, dict(), takes_params=False),
    Contract(
        "stochastic_rounding",
        gradtools.stochastic_rounding,
        dict(seed=0),
        counters=(Counter("rounding_step"),),
    ),
    Contract(
        "skip_small",  # the template of docs/internals.md
        skip_small,
        dict(inner=optax.adam(0.1), threshold=100.0),
        counters=(Counter("skipped"),),
        floats=("threshold",),
    ),
]
ROWS = {row.id: row for row in CONTRACTS}
COUNTERS = [(row.id, c.field) for row in CONTRACTS for c in row.counters]
FLOATS = [(row.id, name) for row in CONTRACTS for name in row.floats]


def params():
    """float32 and float16 leaves; the float16 one near its largest value (65504)."""
    return {
        "dense": {"kernel": jnp.ones((4, 2)), "bias": jnp.arange(4.0)},
        "head": jnp.full((4,), 6e4, jnp.float16),
    }


def grads(kind="finite"):
    """Gradients of ``params()``: finite; with an inf; or finite ones whose step by
    ``optax.sgd(1.0)`` overflows the float16 leaf."""
    g = {
        "dense": {"kernel": jnp.full((4, 2), 0.5), "bias": jnp.ones(4)},
        "head": jnp.ones(4, jnp.float16),
    }
    if kind == "nonfinite":
        g["dense"]["bias"] = jnp.array([1.0, jnp.inf, 1.0, 1.0])
    elif kind == "overflow":
        g["head"] = jnp.full((4,), -6e4, jnp.float16)
    return g


def build(row_id):
    row = ROWS[row_id]
    return row.factory(**row.kwargs)


def update(tx, g, state, p, jit, **extra):
    fn = (lambda g, s, p: tx.update(g, s, p, **extra)) if extra else tx.update
    return (jax.jit(fn) if jit else fn)(g, state, p)


def test_every_public_transform_has_a_row():
    public = {
        f
        for f in (getattr(gradtools, name) for name in gradtools.__all__)
        if inspect.isfunction(f)
        and "GradientTransformation" in str(inspect.signature(f).return_annotation)
    }
    assert gradtools.spike_guard in public and gradtools.frozen in public
    assert public <= {row.factory for row in CONTRACTS}


@pytest.mark.parametrize("row_id", ROWS)
def test_every_float_hyperparameter_is_listed(row_id):
    """A parameter annotated ``float`` has its place in the row's ``floats``."""
    row = ROWS[row_id]
    annotated = {
        name
        for name, param in inspect.signature(row.factory).parameters.items()
        if param.annotation in ("float", float) or re.fullmatch(r".*decay", name)
    }
    assert annotated <= set(row.floats)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("foreign", ["tuple", "adam"])
@pytest.mark.parametrize("row_id", ROWS)
def test_a_state_not_its_own_is_refused(row_id, foreign, jit):
    tx, p = build(row_id), params()
    state = () if foreign == "tuple" else optax.adam(0.1).init(p)
    name = row_id.removesuffix("_scheduled").removesuffix("_skip")
    with pytest.raises((ValueError, TypeError), match=rf"(?s){name}.*\binit\b"):
        update(tx, grads(), state, p, jit)


def _paths_differ(tree):
    return {**tree, "dense": {"kernel": tree["dense"]["kernel"]}}  # no bias


def _shapes_differ(tree):
    return {**tree, "dense": {**tree["dense"], "bias": tree["dense"]["bias"][:1]}}  # broadcasts


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("change", [_paths_differ, _shapes_differ], ids=["tree", "shape"])
@pytest.mark.parametrize("row_id", [row.id for row in CONTRACTS if row.takes_params])
def test_gradients_unlike_params_are_refused(row_id, change, jit):
    tx, p = build(row_id), params()
    name = row_id.removesuffix("_scheduled").removesuffix("_skip")
    with pytest.raises((ValueError, TypeError), match=rf"(?s){name}.*\['dense'\]\['bias'\]"):
        update(tx, change(grads()), tx.init(p), p, jit)


def _with(state, field, value):
    """``state`` with the (dotted) ``field`` set to the int32 ``value``."""
    head, _, rest = field.partition(".")
    inner = getattr(state, head)
    new = _with(inner, rest, value) if rest else jnp.asarray(value, inner.dtype)
    return state._replace(**{head: new})


def _get(state, field):
    for name in field.split("."):
        state = getattr(state, name)
    return state


@pytest.mark.parametrize(("row_id", "field"), COUNTERS)
def test_counters_saturate_at_the_largest_int32(row_id, field):
    row = ROWS[row_id]
    counter = next(c for c in row.counters if c.field == field)
    tx, p = build(row_id), params()
    state = tx.init(p)
    for name, value in counter.preset:
        state = _with(state, name, value)
    assert _get(state, field).dtype == jnp.int32
    g = grads(counter.grads)
    step = jax.jit(lambda s: tx.update(g, s, p, **dict(counter.extra))[1])
    # The input advances the counter (so the check below can fail) ...
    assert int(_get(step(_with(state, field, MAX - 1)), field)) == MAX
    # ... and at the largest int32 it stays there rather than wrapping to -2**31.
    assert int(_get(step(_with(state, field, MAX)), field)) == MAX


@pytest.mark.parametrize("value", [np.complex128(2.0), np.complex64(0.5 + 0.5j)], ids=str)
@pytest.mark.parametrize(("row_id", "name"), FLOATS)
def test_complex_float_hyperparameters_are_refused(row_id, name, value):
    row = ROWS[row_id]
    with pytest.raises((ValueError, TypeError), match=rf"\b{name}\b"):
        row.factory(**{**row.kwargs, name: value})


def test_the_template_wrapper_skips_small_steps_as_optax_would_not_run_them():
    """``skip_small`` against its reference: adam stepped only on the large gradients."""
    tx, p = skip_small(optax.adam(0.1), threshold=2.0), params()
    ref, ref_state = optax.adam(0.1), optax.adam(0.1).init(p)
    state = tx.init(p)
    for g in (grads(), jax.tree.map(lambda x: x * 0, grads()), grads()):  # norms 3.6, 0, 3.6
        updates, state = jax.jit(tx.update)(g, state, p)
        big = float(gradtools.global_norm(g)) > 2.0
        want = ref.update(g, ref_state, p)[0] if big else jax.tree.map(jnp.zeros_like, g)
        if big:
            ref_state = ref.update(g, ref_state, p)[1]
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), updates, want)
    assert int(state.skipped) == 1
    assert int(state.inner_state[0].count) == 2  # adam stepped twice
