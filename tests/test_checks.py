"""The shared argument checks (gradtools/_checks.py), called directly and through factories."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradtools
from gradtools import _checks

TINY = float(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal float32


def _normal_with_normal_reciprocal(value):
    """The reference: the float32 value and its float32 reciprocal are both normal numbers."""
    with np.errstate(over="ignore", under="ignore", divide="ignore"):
        v = np.float32(value)
        r = np.float32(1) / v
    return bool(np.isfinite(v) and np.isfinite(r) and TINY <= v and TINY <= r)


def test_scale_bound_accepts_exactly_the_normal_range():
    accepted = []
    for value in [m * 2.0**k for k in range(-130, 131) for m in (1.0, 1.5)]:
        if _normal_with_normal_reciprocal(value):
            _checks.scale_bound("max_scale", value)
            accepted.append(value)
        else:
            with pytest.raises(ValueError, match=re.escape(f"max_scale={value!r} must be")):
                _checks.scale_bound("max_scale", value)
    assert min(accepted) == 2.0**-126 and max(accepted) == 2.0**126


SCALE_BOUND_MESSAGES = [
    (
        2.0**127,
        "init_scale=1.7014118346046923e+38 must be at most 2**126 (~8.51e+37): its float32"
        " reciprocal, which unscales the gradients, would be subnormal, and XLA flushes it to"
        " zero, zeroing every gradient",
    ),
    (
        1e38,
        "init_scale=1e+38 must be at most 2**126 (~8.51e+37): its float32 reciprocal, which"
        " unscales the gradients, would be subnormal, and XLA flushes it to zero, zeroing every"
        " gradient (float32 rounds it to 9.999999680285692e+37)",
    ),
    (
        2.0**-127,
        "init_scale=5.877471754111438e-39 must be at least 2**-126 (~1.18e-38), the smallest"
        " normal float32: XLA flushes a subnormal to zero, which would make the scale 0",
    ),
    (1e-46, "init_scale=1e-46 must be a finite number > 0 (float32 rounds it to 0.0)"),
    (0.0, "init_scale=0.0 must be a finite number > 0"),
    (float("inf"), "init_scale=inf must be a finite number > 0"),
    ("1024", "init_scale='1024' must be a real number, not a string"),
]


@pytest.mark.parametrize("value, message", SCALE_BOUND_MESSAGES)
def test_scale_bound_names_the_argument_the_value_and_the_reason(value, message):
    with pytest.raises(ValueError) as err:
        _checks.scale_bound("init_scale", value)
    assert str(err.value) == message


def test_scale_bound_takes_numpy_and_jax_scalars_and_skips_tracers():
    for value in (np.float32(2.0**126), jnp.float32(TINY), np.int64(2**24), 1):
        _checks.scale_bound("min_scale", value)
    with pytest.raises(ValueError, match="min_scale=np.float64|min_scale=1.7"):
        _checks.scale_bound("min_scale", np.float64(2.0**127))

    @jax.jit
    def traced(scale):  # a value under optax.inject_hyperparams: unknown when checked
        _checks.scale_bound("min_scale", scale)
        return scale

    assert float(traced(jnp.float32(0.0))) == 0.0


COMPLEX = [np.complex128(1024 + 1j), np.complex64(2.0), 1024 + 1j, jnp.complex64(1 + 1j)]


@pytest.mark.parametrize("value", COMPLEX, ids=repr)
def test_complex_numbers_are_refused_not_made_real(value):
    message = re.escape(f"scale={value!r} must be a real number, not complex")
    for check in (_checks.finite_positive, _checks.finite_non_negative, _checks.greater_than_one):
        with pytest.raises(ValueError, match=message):
            check("scale", value)


@pytest.mark.parametrize("value", COMPLEX, ids=repr)
def test_factories_refuse_complex_hyperparameters(value):
    sgd = optax.sgd(0.1)
    builds = {
        "scale": lambda: gradtools.fixed_loss_scale(sgd, value),
        "init_scale": lambda: gradtools.dynamic_loss_scale(sgd, init_scale=value),
        "growth_factor": lambda: gradtools.dynamic_loss_scale(sgd, growth_factor=value),
        "max_norm": lambda: gradtools.clip_by_global_norm(value),
        "learning_rate": lambda: gradtools.schedules.exponential_decay(value, 0.5, 2),
    }
    for name, build in builds.items():
        with pytest.raises(ValueError, match=re.escape(f"{name}={value!r} must be a real number")):
            build()


def test_a_string_leaf_is_named_with_what_was_expected():
    tree = {"a": jnp.ones(2), "b": {"c": "0.5"}}
    with pytest.raises(TypeError) as err:
        _checks.numeric_leaves("accumulate", "updates", tree)
    assert str(err.value) == "accumulate: updates['b']['c']='0.5' must be a numeric array"
