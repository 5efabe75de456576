"""Shared test setup: four CPU devices for sharding tests, dtype helpers."""

import jax

# Must run before JAX creates its backends (the equinox way).
jax.config.update("jax_num_cpu_devices", 4)

import os  # noqa: E402

import optax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI sets HYPOTHESIS_PROFILE=ci: the property tests then draw the same examples
# on every run (so a red run reproduces and a green one stays green) and keep no
# example database.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_collection_modifyitems(config, items):
    """Skips the ``four_devices`` tests where JAX's default backend has fewer devices.

    Here that backend is the CPU with four devices; on a machine with one GPU, JAX
    defaults to the GPU, and these tests would only check the test machine.
    """
    devices = jax.devices()
    if len(devices) >= 4:
        return
    why = f"needs 4 devices; the default backend has {len(devices)} ({devices[0].platform})"
    for item in items:
        if "four_devices" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture
def strict_dtypes():
    """Runs a test under strict dtype promotion (no silent up-casts)."""
    with jax.numpy_dtype_promotion("strict"):
        yield


def _all_eqns(jaxpr):
    """Every equation of ``jaxpr`` and of its sub-jaxprs (cond branches, loops, jits)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr holds its Jaxpr
                if hasattr(sub, "eqns"):
                    yield from _all_eqns(sub)


def _stack_widths(jaxpr):
    """Operand counts of every ``stack``/``concatenate`` in ``jaxpr`` and its sub-jaxprs."""
    for eqn in _all_eqns(jaxpr):
        if eqn.primitive.name in ("stack", "concatenate"):
            yield len(eqn.invars)


@pytest.fixture
def widest_stack():
    """``widest(fn, *args)``: the most operands of any stack ``fn`` traces to.

    One ``jnp.stack`` of a scalar per leaf becomes one XLA kernel with that many
    inputs, whose compile time grows faster than linearly.
    """

    def widest(fn, *args):
        return max(_stack_widths(jax.make_jaxpr(fn)(*args).jaxpr), default=0)

    return widest


_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or"}


@pytest.fixture
def array_reductions():
    """``count(fn, *args, min_size=...)``: the reductions in ``fn`` that read an array.

    Each is a pass over an array of at least ``min_size`` elements (a gradient
    leaf, a moment); the few per-leaf scalars combined afterwards stay below it.
    """

    def count(fn, *args, min_size):
        jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
        return sum(
            1
            for eqn in _all_eqns(jaxpr)
            if eqn.primitive.name in _REDUCTIONS and eqn.invars[0].aval.size >= min_size
        )

    return count


@pytest.fixture
def scale_by_factor():
    """A transformation that multiplies the updates by its extra argument ``factor``.

    Its ``update`` takes no ``**kwargs``: any other extra argument that reaches it raises.
    """

    def update(updates, state, params=None, *, factor):
        del params
        return jax.tree.map(lambda u: u * factor, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


@pytest.fixture
def weighted_step():
    """``make(tx, fused)``: a jitted ``step(params, state, grads, weight, flush)``.

    It runs ``tx.update`` then ``optax.apply_updates``, or with ``fused``
    ``gradtools.apply_gradients``, and returns ``(params, state)``.
    """
    import gradtools

    def make(tx, fused):
        def step(p, s, g, w, f):
            if fused:
                return gradtools.apply_gradients(tx, g, s, p, weight=w, flush=f)
            u, s = tx.update(g, s, p, weight=w, flush=f)
            return optax.apply_updates(p, u), s

        return jax.jit(step)

    return make
