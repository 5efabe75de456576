"""Property-based tests of the invariants (hypothesis)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import gradtools

pytestmark = pytest.mark.slow  # CI runs these after the README's command

STEPS = 48
INT32_MAX = np.iinfo(np.int32).max


def _scale_trajectory_fn():
    """One compiled scan over a finite/overflow pattern; hyperparameters are traced."""
    tx = optax.inject_hyperparams(gradtools.dynamic_loss_scale)(
        optax.sgd(0.1),
        init_scale=1.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=1,
        min_scale=1.0,
        max_scale=1.0,
    )
    params = jnp.ones(2)

    @jax.jit
    def run(hyper, pattern):
        state = tx.init(params)
        state.hyperparams.update(hyper)
        state = state._replace(
            inner_state=state.inner_state._replace(loss_scale=hyper["init_scale"])
        )

        def body(state, finite):
            g = jnp.where(finite, 1.0, jnp.inf) * jnp.ones(2)
            _, state = tx.update(g, state, params)
            return state, state.inner_state.loss_scale

        return jax.lax.scan(body, state, pattern)[1]

    return run


RUN = _scale_trajectory_fn()


@settings(max_examples=60, deadline=None)
@given(
    pattern=st.lists(st.booleans(), min_size=STEPS, max_size=STEPS),
    lo_exp=st.integers(-10, 5),
    span=st.integers(0, 30),
    start=st.floats(0.0, 1.0),
    growth=st.floats(1.01, 10.0),
    backoff=st.floats(0.01, 0.99),
    interval=st.integers(1, 5),
)
def test_scale_stays_finite_and_within_bounds(
    pattern, lo_exp, span, start, growth, backoff, interval
):
    lo, hi = 2.0**lo_exp, 2.0 ** (lo_exp + span)
    init = float(np.float32(lo * (hi / lo) ** start))
    init = min(max(init, lo), hi)
    hyper = dict(
        init_scale=jnp.float32(init),
        growth_factor=jnp.float32(growth),
        backoff_factor=jnp.float32(backoff),
        growth_interval=jnp.int32(interval),
        min_scale=jnp.float32(lo),
        max_scale=jnp.float32(hi),
    )
    scales = np.asarray(RUN(hyper, jnp.array(pattern)))
    assert np.isfinite(scales).all()
    assert (scales >= np.float32(lo)).all() and (scales <= np.float32(hi)).all()


OPTIMIZERS = {
    "adam": optax.adam(1e-2),
    "sgd_momentum": optax.sgd(0.1, momentum=0.9),
    "adamw_schedule": optax.adamw(optax.cosine_decay_schedule(1e-2, 50), weight_decay=0.1),
    "clip_rmsprop": optax.chain(optax.clip_by_global_norm(1.0), optax.rmsprop(1e-3)),
}


# One wrapped optimizer and one compiled update per name, shared by all examples.
SCALED = {
    name: gradtools.dynamic_loss_scale(opt, init_scale=4.0) for name, opt in OPTIMIZERS.items()
}
SCALED_UPDATE = {name: jax.jit(tx.update) for name, tx in SCALED.items()}


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    history=st.integers(0, 4),
    bad_leaf=st.sampled_from(["w", "b"]),
    bad_value=st.sampled_from([np.inf, -np.inf, np.nan]),
    seed=st.integers(0, 2**16),
)
def test_skipped_step_changes_nothing(name, history, bad_leaf, bad_value, seed):
    tx, update = SCALED[name], SCALED_UPDATE[name]
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32), "b": jnp.ones(2)}
    state = tx.init(params)
    for _ in range(history):
        g = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)

    bad = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
    bad[bad_leaf] = bad[bad_leaf].at[0].set(bad_value)
    updates, new_state = update(bad, state, params)
    chex.assert_trees_all_equal(optax.apply_updates(params, updates), params)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
    assert int(new_state.skipped_steps) == int(state.skipped_steps) + 1


def test_soak_100k_steps_with_one_percent_overflow():
    """100,000 steps under lax.scan: bounds hold, applied steps == finite steps."""
    n = 100_000
    pattern = jax.random.bernoulli(jax.random.key(0), 0.99, (n,))
    tx = gradtools.dynamic_loss_scale(optax.adam(1e-4), growth_interval=50)
    params = jnp.ones(4)

    def body(carry, finite):
        params, state = carry
        g = jnp.where(finite, 0.01, jnp.inf) * jnp.ones(4)
        updates, state = tx.update(g, state, params)
        return (optax.apply_updates(params, updates), state), state.loss_scale

    (params, state), scales = jax.jit(lambda c: jax.lax.scan(body, c, pattern))(
        (params, tx.init(params))
    )
    scales = np.asarray(scales)
    finite_steps = int(pattern.sum())
    assert 0 < n - finite_steps < 2 * n // 100
    assert np.isfinite(scales).all() and (scales >= 1.0).all() and (scales <= 2.0**24).all()
    assert len(np.unique(scales)) > 2  # it really grew and backed off
    assert int(state.inner_state[0].count) == finite_steps
    assert int(state.skipped_steps) == n - finite_steps
    assert np.isfinite(np.asarray(params)).all()


def test_counters_saturate_instead_of_wrapping():
    tx = gradtools.fixed_loss_scale(optax.sgd(0.1), 2.0)
    params = jnp.ones(2)
    state = tx.init(params)
    state = state._replace(
        skipped_steps=jnp.int32(INT32_MAX - 1), good_steps=jnp.int32(INT32_MAX - 1)
    )
    update = jax.jit(tx.update)
    _, s = update(jnp.ones(2), state, params)
    _, s = update(jnp.ones(2), s, params)
    assert int(s.good_steps) == INT32_MAX
    s = s._replace(skipped_steps=jnp.int32(INT32_MAX - 1))
    for _ in range(2):
        _, s = update(jnp.full(2, jnp.inf), s, params)
    assert int(s.skipped_steps) == INT32_MAX


# -- accumulation equals the big-batch mean -------------------------------------------------------

# Parameter trees (leaf shapes); each micro-batch holds examples with one target per leaf.
TREES = [{"w": (3,)}, {"w": (2, 2), "b": (1,)}, {"s": (), "m": {"k": (2, 3)}}]
ACCUMULATORS = {}


def shape_map(f, shapes):
    return jax.tree.map(f, shapes, is_leaf=lambda s: isinstance(s, tuple))


def _accumulator(k, average):
    """One accumulate(sgd(1)) and its compiled update per (k, average), shared by all examples."""
    if (k, average) not in ACCUMULATORS:
        tx = gradtools.accumulate(optax.sgd(1.0), k, average=average)
        ACCUMULATORS[k, average] = tx, jax.jit(tx.update)
    return ACCUMULATORS[k, average]


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(1, 4),
    tree=st.sampled_from(range(len(TREES))),
    average=st.booleans(),
    weighted=st.booleans(),
    data=st.data(),
)
def test_accumulation_equals_the_big_batch_mean(k, tree, average, weighted, data):
    """Micro-batch means, weighted by their sizes, give the mean over all examples.

    The loss of an example with targets ``t`` is ``0.5 * sum((p - t) ** 2)``, so a
    micro-batch's gradient is ``p - mean(t)`` and the big batch's is ``p - mean of
    all t``. A window of ``m <= k`` micro-batches (flushed when ``m < k``) must
    hand sgd(1) that mean (or, with ``average=False``, the weighted sum).
    """
    m = data.draw(st.integers(1, k), label="micro-batches in the window")
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=m, max_size=m), label="sizes")
    if not weighted:
        sizes = [2] * m  # equal micro-batches: the plain mean of their gradients
    weights = [float(n) if weighted else 1.0 for n in sizes]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    params = shape_map(lambda s: rng.normal(size=s), TREES[tree])
    targets = [shape_map(lambda s, n=n: rng.normal(size=(n, *s)), TREES[tree]) for n in sizes]
    grads = [jax.tree.map(lambda p, t: p - t.mean(0), params, t) for t in targets]

    tx, update = _accumulator(k, average)
    p32 = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    state = tx.init(p32)
    for i, (g, w) in enumerate(zip(grads, weights)):
        g32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g)
        u, state = update(g32, state, p32, weight=jnp.float32(w), flush=jnp.asarray(i == m - 1))
        if i < m - 1:  # a micro-step: exact zeros, no optimizer work
            assert all(not np.any(x) for x in jax.tree.leaves(u))

    everything = jax.tree.map(lambda *t: np.concatenate(t), *targets)
    big_batch = jax.tree.map(lambda p, t: p - t.mean(0), params, everything)  # float64
    want = big_batch if average else jax.tree.map(lambda g: g * sum(weights), big_batch)
    chex.assert_trees_all_close(jax.tree.map(np.negative, u), want, rtol=1e-5, atol=1e-5)
    assert int(state.micro_step) == 0  # the window closed


# -- global_norm equals NumPy's -------------------------------------------------------------------

DTYPES = {
    "float32": (jnp.float32, 1e15),
    "bfloat16": (jnp.bfloat16, 1e15),
    "float16": (jnp.float16, 6e4),
}
TRACED_NORM = jax.jit(gradtools.global_norm)  # norm_type traced: the lax.switch path


@settings(max_examples=40, deadline=None)
@given(
    dtypes=st.lists(st.sampled_from(sorted(DTYPES)), min_size=3, max_size=3),
    p=st.sampled_from([1.0, 2.0, 3.0, float("inf")]),
    log_scale=st.floats(-3, 0),
    seed=st.integers(0, 2**16),
)
def test_global_norm_equals_numpy(dtypes, p, log_scale, seed):
    """Any mix of fp32/bf16/fp16 leaves, up to each dtype's range: float32 accuracy."""
    rng = np.random.default_rng(seed)

    def leaf(shape, name):
        dtype, biggest = DTYPES[name]
        # magnitudes spread over six decades, up to 10**log_scale of the dtype's limit
        mags = biggest * 10.0 ** (log_scale - rng.uniform(0, 6, shape))
        return jnp.asarray(np.sign(rng.normal(size=shape)) * mags, dtype)

    tree = {
        "a": leaf((5,), dtypes[0]),
        "b": [leaf((2, 3), dtypes[1]), None],
        "c": {"d": leaf((4,), dtypes[2]), "e": {}},
    }
    exact = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])
    want = np.abs(exact).max() if p == float("inf") else (np.abs(exact) ** p).sum() ** (1 / p)
    # |x| and max are exact; sums of 15 positive float32 terms, a power and a root
    # lose a few ulps
    rtol = 0 if p == float("inf") else 1e-5
    got = gradtools.global_norm(tree, norm_type=p)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.float64(got), want, rtol=rtol)
    np.testing.assert_allclose(np.float64(TRACED_NORM(tree, jnp.float32(p))), want, rtol=rtol)
