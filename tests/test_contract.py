"""The contract every gradtools transform keeps (docs/internals.md, "Adding a wrapper").

The rows are those of ``TRANSFORMS`` in ``tests/transforms.py`` with
``contract=True``; each says whether the transform takes ``params``, which
int32 counters its state keeps (and what input advances each), and which of
its hyperparameters are floats. Every transform must:

- refuse a state that is not its own with a ``ValueError`` or ``TypeError``
  naming the transform and ``init``, eagerly and under ``jax.jit``;
- where it takes ``params``, refuse gradients whose tree or leaf shapes differ
  from them, naming the transform and the leaf path;
- keep every int32 counter saturating at ``2**31 - 1``;
- refuse NumPy complex values for every float hyperparameter, naming it.

A new transform joins by adding one row to that table.
"""

from __future__ import annotations

import inspect
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from transforms import ROWS
from transforms import TRANSFORMS
from transforms import skip_small

import gradtools

MAX = 2**31 - 1
CONTRACTS = [row for row in TRANSFORMS if row.contract]
IDS = [row.id for row in CONTRACTS]
COUNTERS = [(row.id, c.field) for row in CONTRACTS for c in row.counters]
FLOATS = [(row.id, name) for row in CONTRACTS for name in row.floats]


def params():
    """float32, bfloat16 and float16 leaves, the float16 one near its largest value
    (65504); their paths are those of ``test_conformance.py``'s standard tree, which
    every row's kwargs (its rules and patterns) are written for."""
    return {
        "dense": {"kernel": jnp.ones((4, 2)), "bias": jnp.arange(4.0)},
        "emb": jnp.ones((2, 2), jnp.bfloat16),
        "head": jnp.full((4,), 6e4, jnp.float16),
    }


def grads(kind="finite"):
    """Gradients of ``params()``: finite; with an inf; or finite ones whose step by
    ``optax.sgd(1.0)`` overflows the float16 leaf."""
    g = {
        "dense": {"kernel": jnp.full((4, 2), 0.5), "bias": jnp.ones(4)},
        "emb": jnp.ones((2, 2), jnp.bfloat16),
        "head": jnp.ones(4, jnp.float16),
    }
    if kind == "nonfinite":
        g["dense"]["bias"] = jnp.array([1.0, jnp.inf, 1.0, 1.0])
    elif kind == "overflow":
        g["head"] = jnp.full((4,), -6e4, jnp.float16)
    return g


def build(row_id, **kwargs):
    """The row's transform, with ``kwargs`` replacing the row's."""
    row = ROWS[row_id]
    return row.factory(**{**row.kwargs, **kwargs})


def update(tx, g, state, p, jit, **extra):
    fn = (lambda g, s, p: tx.update(g, s, p, **extra)) if extra else tx.update
    return (jax.jit(fn) if jit else fn)(g, state, p)


def test_every_public_transform_has_a_row():
    """Every public transform has a row that both files' checks run on."""
    # Every public function whose return annotation is a GradientTransformation.
    public = {
        f
        for f in (getattr(gradtools, name) for name in gradtools.__all__)
        if inspect.isfunction(f)
        and "GradientTransformation" in str(inspect.signature(f).return_annotation)
    }
    assert len(public) >= 7  # the scan finds them
    assert gradtools.spike_guard in public and gradtools.frozen in public
    assert public <= {row.factory for row in CONTRACTS}


def test_row_ids_are_unique():
    assert len(ROWS) == len(TRANSFORMS) == len({row.id for row in TRANSFORMS})


@pytest.mark.parametrize("row_id", IDS)
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
@pytest.mark.parametrize("row_id", IDS)
def test_a_state_not_its_own_is_refused(row_id, foreign, jit):
    tx, p = build(row_id), params()
    state = () if foreign == "tuple" else optax.adam(0.1).init(p)
    name = ROWS[row_id].factory.__name__
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
    name = ROWS[row_id].factory.__name__
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
    tx, p = build(row_id, **dict(counter.kwargs)), params()
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
    for g in (grads(), jax.tree.map(lambda x: x * 0, grads()), grads()):  # norms 3.7, 0, 3.7
        updates, state = jax.jit(tx.update)(g, state, p)
        big = float(gradtools.global_norm(g)) > 2.0
        want = ref.update(g, ref_state, p)[0] if big else jax.tree.map(jnp.zeros_like, g)
        if big:
            ref_state = ref.update(g, ref_state, p)[1]
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), updates, want)
    assert int(state.skipped) == 1
    assert int(state.inner_state[0].count) == 2  # adam stepped twice


def test_the_template_wrapper_reports_its_metrics_through_gradtools_metrics():
    """Its state's ``metrics()`` reaches ``gradtools.metrics``, inside a loss scaler too,
    with nothing registered in gradtools: the count of skips against a loop that counts."""
    p = params()
    tx = gradtools.dynamic_loss_scale(skip_small(optax.sgd(0.1), threshold=2.0), init_scale=1.0)
    state, skipped, scaler_skips = tx.init(p), 0, 0
    kinds = ("finite", "small", "nonfinite", "small", "finite")
    for kind in kinds:
        g = jax.tree.map(lambda x: x * 0.01, grads()) if kind == "small" else grads(kind)
        _, state = jax.jit(tx.update)(g, state, p)
        scaler_skips += kind == "nonfinite"  # the scaler skips it: skip_small never sees it
        skipped += kind == "small"
        m = gradtools.metrics(state)
        assert int(m["skipped_small"]) == skipped
        assert int(m["skipped_steps"]) == scaler_skips
    assert skipped == 2 and scaler_skips == 1


def _template(text):
    """From ``class SkipSmallState`` to the end of ``skip_small`` in ``text``."""
    start = text.index("class SkipSmallState")
    return text[start : text.index("_apply.Update(step))\n", start)]


def test_the_template_wrapper_is_the_one_in_the_docs():
    """docs/internals.md shows ``skip_small`` as written in tests/transforms.py."""
    tests = pathlib.Path(__file__).parent
    docs = _template((tests.parent / "docs" / "internals.md").read_text())
    code = _template((tests / "transforms.py").read_text())
    assert code.replace(f'    """{skip_small.__doc__}"""\n', "") == docs
