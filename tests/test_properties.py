"""Property-based tests of the invariants (hypothesis)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import gradtools

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


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    history=st.integers(0, 4),
    bad_leaf=st.sampled_from(["w", "b"]),
    bad_value=st.sampled_from([np.inf, -np.inf, np.nan]),
    seed=st.integers(0, 2**16),
)
def test_skipped_step_changes_nothing(name, history, bad_leaf, bad_value, seed):
    tx = gradtools.dynamic_loss_scale(OPTIMIZERS[name], init_scale=4.0)
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32), "b": jnp.ones(2)}
    state = tx.init(params)
    update = _jitted_update(tx)
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


_UPDATES = {}


def _jitted_update(tx):
    key = id(tx)
    if key not in _UPDATES:
        _UPDATES[key] = jax.jit(tx.update)
    return _UPDATES[key]


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
