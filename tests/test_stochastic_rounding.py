"""Tests for gradtools.stochastic_rounding, against neighbours and probabilities from NumPy.

The reference for one element: ``x = float32(p) + float32(u)``; ``lo`` and
``hi``, its neighbours in the param's dtype, from ml_dtypes' round-to-nearest
and ``np.nextafter``; the result must be ``lo`` or ``hi``, and ``hi`` with
probability ``(x - lo) / (hi - lo)``. Frequencies are checked within 5
binomial standard deviations.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradtools
from gradtools import StochasticRoundingState

HALF = [jnp.bfloat16, jnp.float16]
IDS = ["bfloat16", "float16"]


def neighbours(x, dtype):
    """``(lo, hi)``: the values of ``dtype`` just below and above float32 ``x``, as float32."""
    x = np.asarray(x, np.float32)
    npdt = np.dtype(dtype)
    with np.errstate(over="ignore"):
        near = x.astype(npdt)
        above = near.astype(np.float32) > x
        other = np.nextafter(near, np.where(above, -np.inf, np.inf).astype(npdt))
    lo, hi = np.where(above, other, near), np.where(above, near, other)
    return lo.astype(np.float32), hi.astype(np.float32)


def rounded(p, u, seed=0, step=0):
    """``optax.apply_updates(p, d)`` with ``d`` the updates of ``stochastic_rounding(seed)``."""
    tx = gradtools.stochastic_rounding(seed)
    state = StochasticRoundingState(jnp.asarray(step, jnp.int32))
    return jax.jit(lambda p, u: optax.apply_updates(p, tx.update(u, state, p)[0]))(p, u)


def f32(x):
    return np.asarray(x).astype(np.float32)


def assert_binomial(count, n, prob, what):
    sd = np.sqrt(n * prob * (1 - prob))
    assert abs(count - n * prob) <= 5 * sd + 1, f"{what}: {count} of {n}, expected {n * prob:.1f}"


# (param, update) pairs: several binades, both signs, crossing binade boundaries.
PAIRS = {
    jnp.bfloat16: [
        (1.0, 0.3 * 2**-7),
        (-3.0, -0.75 * 2**-6),
        (1.5 * 2**40, 0.5 * 2**33),
        (2.0**-100, 0.1 * 2**-107),
        (2 - 2**-7, 0.4 * 2**-7),  # up across 2.0
        (2.0, -0.6 * 2**-7),  # down across 2.0, where the spacing halves
        (-1.0, 0.9 * 2**-8),
        (1.0, 1.37),  # a large update: x = 2.37
        (2.0**-126, 1.3 * 2**-126),  # the smallest normal (float32's too)
    ],
    jnp.float16: [
        (1.0, 0.3 * 2**-10),
        (-3.0, -0.75 * 2**-9),
        (1000.0, 0.5 * 2**-1),
        (2.0**-20, 0.4 * 2**-24),  # a subnormal
        (-(2.0**-24), -0.7 * 2**-24),  # the smallest subnormal
        (2 - 2**-10, 0.4 * 2**-10),
        (2.0, -0.6 * 2**-10),
        (5.0, -7.3),  # a large update across zero: x = -2.3
        (6e4, 0.2 * 32),
    ],
}


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
def test_each_result_is_a_neighbour_and_hi_as_often_as_it_should_be(dtype):
    n = 2048
    p0, u0 = (np.array(v, np.float32) for v in zip(*PAIRS[dtype]))
    p = jnp.asarray(np.repeat(p0[:, None], n, 1), dtype)
    u = jnp.asarray(np.repeat(u0[:, None], n, 1), jnp.float32)
    got = f32(rounded(p, u))
    x = f32(p) + f32(u)
    lo, hi = neighbours(x, dtype)
    assert np.all((got == lo) | (got == hi))
    prob = (x[:, 0] - lo[:, 0]) / (hi[:, 0] - lo[:, 0])
    assert np.all((prob > 0.05) & (prob < 0.95))  # the cases test something
    for i, (count, pr) in enumerate(zip((got == hi).sum(1), prob)):
        assert_binomial(count, n, pr, f"pair {i}: {p0[i]} + {u0[i]}")


def broad(dtype, n, seed):
    """Params and float32 updates over the dtype's whole range, large updates and
    near-cancellations (u close to -p) included, with zeros and both signs."""
    rng = np.random.default_rng(seed)
    info = jnp.finfo(dtype)
    top, bottom = np.log2(float(info.max)), np.log2(float(info.smallest_subnormal))
    sign = lambda: rng.choice([-1.0, 1.0], n)  # noqa: E731
    p = f32(jnp.asarray(sign() * 2.0 ** rng.uniform(bottom, top, n), dtype))
    u = sign() * 2.0 ** rng.uniform(bottom - 4, top, n)
    third = n // 3
    u[:third] = -p[:third] * (1 + sign()[:third] * 2.0 ** rng.uniform(-30, 0, third))
    u[third : 2 * third] = p[third : 2 * third] * sign()[:third] * 2.0 ** rng.uniform(-24, 0, third)
    p[:8], u[8:16] = 0.0, 0.0
    p[16:20] = [-0.0, float(info.max), -float(info.max), float(info.tiny)]
    return jnp.asarray(p, dtype), jnp.asarray(u.astype(np.float32))


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
def test_any_update_lands_on_a_neighbour_through_apply_updates_and_apply_gradients(dtype):
    p, u = broad(dtype, 1 << 14, seed=1)
    got = rounded(p, u, seed=7)
    assert got.dtype == dtype
    # x as XLA computes it (the backend may flush float32 subnormals to zero)
    x = f32(jax.jit(lambda p, u: p.astype(jnp.float32) + u)(p, u))
    lo, hi = neighbours(x, dtype)
    inside = np.abs(x) <= float(jnp.finfo(dtype).max)
    assert inside.mean() > 0.9
    g = f32(got)
    assert np.all(((g == lo) | (g == hi))[inside])
    assert np.all(np.isinf(g[~inside]) | (np.abs(g[~inside]) == float(jnp.finfo(dtype).max)))
    # gradtools.apply_gradients applies the same updates the same way
    tx = optax.chain(optax.identity(), gradtools.stochastic_rounding(7))
    fused, _ = jax.jit(lambda p, u: gradtools.apply_gradients(tx, u, tx.init(p), p))(p, u)
    np.testing.assert_array_equal(f32(fused), g)


def test_a_loss_scaled_adam_step_lands_on_a_neighbour_through_every_path():
    """``dynamic_loss_scale(chain(adam, stochastic_rounding))``: update + apply_updates,
    apply_gradients (the scaler's fused branch) and train_step give the same params,
    each a neighbour of ``params + adam's update``."""
    rng = np.random.default_rng(2)
    shapes = {"w": ((64, 32), jnp.bfloat16), "h": ((300,), jnp.float16)}
    params = {k: jnp.asarray(rng.normal(size=s), d) for k, (s, d) in shapes.items()}
    c = {k: jnp.asarray(rng.normal(size=s), d) for k, (s, d) in shapes.items()}  # the gradient
    tx = gradtools.dynamic_loss_scale(
        optax.chain(optax.adam(1e-3), gradtools.stochastic_rounding(3)), init_scale=2.0**4
    )
    state = tx.init(params)
    scaled = jax.tree.map(lambda g: g * 16, c)
    updates, _ = jax.jit(tx.update)(scaled, state, params)
    want = optax.apply_updates(params, updates)
    apply = jax.jit(lambda g, s, p: gradtools.apply_gradients(tx, g, s, p))
    fused, fused_state = apply(scaled, state, params)
    loss = lambda p, c: sum(jnp.sum(p[k] * c[k]).astype(jnp.float32) for k in p)  # noqa: E731
    stepped, step_state, _ = jax.jit(gradtools.train_step(loss, tx))(params, state, c)
    adam_update, _ = optax.adam(1e-3).update(c, optax.adam(1e-3).init(params), params)
    for k, (_, dtype) in shapes.items():
        for got, got_state in ((fused, fused_state), (stepped, step_state)):
            np.testing.assert_array_equal(f32(got[k]), f32(want[k]))
            assert int(got_state.inner_state[1].rounding_step) == 1
        lo, hi = neighbours(f32(params[k]) + f32(adam_update[k]), dtype)
        w = f32(want[k])
        assert np.all((w == lo) | (w == hi)) and np.any(w != f32(params[k]))


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
def test_past_the_largest_value_it_overflows_as_if_the_exponent_went_on(dtype):
    big = float(jnp.finfo(dtype).max)
    gap = big - float(np.nextafter(np.asarray(big, dtype), np.asarray(0, dtype)))  # ulp at max
    n = 4096
    p = jnp.full((3, n), big, dtype) * jnp.asarray([[1], [-1], [1]], dtype)
    below = jnp.asarray(np.nextafter(np.asarray(big, dtype), np.asarray(0, dtype)), dtype)
    p = p.at[2].set(below)
    u = jnp.asarray([[gap / 2], [-gap / 4], [0.9 * gap]], jnp.float32) * jnp.ones((1, n))
    got = f32(rounded(p, u))
    # x = max + gap / 2: inf with probability 1/2, as if inf were max + gap
    assert set(np.unique(got[0])) == {big, np.inf}
    assert_binomial(np.isinf(got[0]).sum(), n, 0.5, "max + gap / 2")
    assert set(np.unique(got[1])) == {-big, -np.inf}
    assert_binomial(np.isinf(got[1]).sum(), n, 0.25, "-max - gap / 4")
    assert set(np.unique(got[2])) == {f32(below).item(), big}  # below max: never inf
    far = rounded(jnp.asarray([big, -big], dtype), jnp.asarray([2 * gap, -2 * gap], jnp.float32))
    assert np.all(np.isinf(f32(far)))
    # the update is t - param, inf itself where t is
    tx = gradtools.stochastic_rounding()
    d, _ = jax.jit(tx.update)(u, tx.init(p), p)
    np.testing.assert_array_equal(np.isinf(f32(d)), np.isinf(got))


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
def test_nan_and_inf_stay_as_they_are(dtype):
    inf, nan = np.inf, np.nan
    p = jnp.asarray([1.0, 1.0, -1.0, nan, inf, -inf, inf, 0.0], dtype)
    u = jnp.asarray([nan, inf, -inf, 1.0, 1.0, -1.0, 0.0, nan], jnp.float32)
    got = f32(rounded(p, u))
    np.testing.assert_array_equal(got, [nan, inf, -inf, nan, inf, -inf, inf, nan])
    # a NaN whose payload fills the low bits (0xFFFFFFFF) must not carry into the sign
    ones = jax.lax.bitcast_convert_type(jnp.full(64, 0xFFFFFFFF, jnp.uint32), jnp.float32)
    assert np.all(np.isnan(f32(rounded(jnp.ones(64, dtype), ones))))


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
def test_unbiased_where_round_to_nearest_does_not_move(dtype):
    """256 steps of +-1e-4, below half a spacing at 1.0: the mean lands on the exact sum."""
    n, steps = 4096, 256
    params = jnp.ones((2, n), dtype)
    u = jnp.asarray([[1e-4], [-1e-4]], jnp.float32) * jnp.ones((1, n))
    tx = gradtools.stochastic_rounding(5)

    def body(carry, _):
        p, state = carry
        d, state = tx.update(u, state, p)
        return (optax.apply_updates(p, d), state), None

    (got, state), _ = jax.jit(lambda p: jax.lax.scan(body, (p, tx.init(p)), length=steps))(params)
    assert int(state.rounding_step) == steps
    drift = f32(got).mean(1) - 1.0
    exact = steps * f32(u[:, 0])
    # each step's error is a zero-mean martingale step of at most one spacing
    spacing = float(jnp.finfo(dtype).eps)
    sd = spacing * np.sqrt(steps) / 2 / np.sqrt(n)
    np.testing.assert_allclose(drift, exact, atol=5 * sd)
    assert 5 * sd < 0.25 * abs(exact[0])  # the tolerance is tight enough to tell
    nearest = params
    for _ in range(4):
        nearest = optax.apply_updates(nearest, u.astype(dtype))
    np.testing.assert_array_equal(f32(nearest), 1.0)  # round-to-nearest stalls


def test_float32_and_integer_params_get_their_updates_unchanged():
    params = {
        "f32": jnp.asarray([1.0, -0.0, 3.0, 1e-30, 5.0], jnp.float32),
        "i32": jnp.arange(5, dtype=jnp.int32),
        "bf16": jnp.ones(5, jnp.bfloat16),
    }
    u = jnp.asarray([1e-9, -0.0, jnp.nan, jnp.inf, 1e-45], jnp.float32)
    updates = {"f32": u, "i32": jnp.asarray([1, -2, 0, 7, 3], jnp.int32), "bf16": u}
    tx = gradtools.stochastic_rounding()
    got, _ = jax.jit(tx.update)(updates, tx.init(params), params)
    for name in ("f32", "i32"):
        assert got[name].dtype == updates[name].dtype
        np.testing.assert_array_equal(
            jax.lax.bitcast_convert_type(got[name], jnp.int32),
            jax.lax.bitcast_convert_type(updates[name], jnp.int32),
        )
    assert got["bf16"].dtype == jnp.float32  # for bfloat16 and float16 params: float32


def test_draws_repeat_for_a_seed_and_are_fresh_for_each_step_leaf_and_seed():
    n = 4096
    p = {"a": jnp.ones(n, jnp.bfloat16), "b": jnp.ones(n, jnp.bfloat16)}
    half = jnp.full(n, 2.0**-8, jnp.float32)  # half a spacing: up with probability 1/2
    u = {"a": half, "b": half}

    def ups(seed, step=0):
        out = rounded(p, u, seed, step)
        return {k: f32(v) > 1.0 for k, v in out.items()}

    first = ups(0)
    assert all(np.array_equal(a, b) for a, b in zip(first.values(), ups(0).values()))
    tx = gradtools.stochastic_rounding(0)
    eager, _ = tx.update(u, tx.init(p), p)  # op by op: the same draws
    np.testing.assert_array_equal(f32(optax.apply_updates(p, eager)["a"]) > 1.0, first["a"])
    others = {"next step": ups(0, 1)["a"], "other leaf": first["b"], "other seed": ups(1)["a"]}
    assert_binomial(first["a"].sum(), n, 0.5, "up")
    for what, other in others.items():
        assert_binomial(other.sum(), n, 0.5, what)
        # independent draws agree half of the time
        assert_binomial((other == first["a"]).sum(), n, 0.5, what)


BAD_SEEDS = [1.5, True, np.float32(1.0), jnp.asarray([1, 2]), "0", None, -1, 2**31, np.array(1.0)]


@pytest.mark.parametrize("seed", BAD_SEEDS, ids=repr)
def test_seed_must_be_an_int(seed):
    with pytest.raises(ValueError, match=r"seed=.* must be an int from 0 to 2\*\*31 - 1"):
        gradtools.stochastic_rounding(seed)


@pytest.mark.parametrize("seed", [0, 2**31 - 1, np.int64(5), jnp.asarray(3, jnp.int32)], ids=repr)
def test_int_seeds_are_accepted_and_a_traced_one_draws_as_a_static_one(seed):
    p, u = jnp.ones(64, jnp.bfloat16), jnp.full(64, 2.0**-8, jnp.float32)
    tx = optax.inject_hyperparams(gradtools.stochastic_rounding)(seed=seed)
    got, _ = jax.jit(tx.update)(u, tx.init(p), p)  # seed is traced here
    static = gradtools.stochastic_rounding(int(seed))
    want, _ = static.update(u, static.init(p), p)
    np.testing.assert_array_equal(got, want)


def test_params_are_needed_and_other_narrow_floats_are_refused(strict_dtypes):
    tx = gradtools.stochastic_rounding()
    u = {"w": jnp.ones(2, jnp.float32)}
    with pytest.raises(ValueError, match="stochastic_rounding: params=None"):
        tx.update(u, tx.init(u))
    p8 = {"w": jnp.ones(2, jnp.float8_e4m3fn)}
    with pytest.raises(ValueError, match=r"params\['w'\] is float8_e4m3fn"):
        jax.jit(tx.update)(u, tx.init(p8), p8)
    half = {"w": jnp.ones(2, jnp.float16), "v": jnp.ones(2, jnp.bfloat16)}  # no promotion inside
    got, _ = jax.jit(tx.update)({"w": u["w"], "v": u["w"]}, tx.init(half), half)
    assert got["w"].dtype == got["v"].dtype == jnp.float32


def test_a_step_the_loss_scaler_skips_draws_nothing():
    p = {"w": jnp.ones(256, jnp.bfloat16)}
    g = {"w": jnp.full(256, 0.5, jnp.bfloat16)}
    bad = {"w": g["w"].at[3].set(jnp.inf)}
    tx = gradtools.dynamic_loss_scale(
        optax.chain(optax.sgd(2.0**-9), gradtools.stochastic_rounding(1)), init_scale=1.0
    )
    update = jax.jit(tx.update)

    def run(grads):
        params, state = p, tx.init(p)
        for x in grads:
            d, state = update(x, state, params)
            params = optax.apply_updates(params, d)
        return params, state

    with_skip, state = run([g, bad, g])
    without, _ = run([g, g])
    assert int(state.skipped_steps) == 1 and int(state.inner_state[1].rounding_step) == 2
    np.testing.assert_array_equal(f32(with_skip["w"]), f32(without["w"]))
    assert len(np.unique(f32(with_skip["w"]))) >= 2  # it did round, both ways


def test_inside_accumulate_it_rounds_once_per_window_on_the_mean():
    p = {"w": jnp.ones(256, jnp.bfloat16)}
    g1, g2 = {"w": jnp.full(256, 0.25, jnp.bfloat16)}, {"w": jnp.full(256, 0.75, jnp.bfloat16)}
    inner = optax.chain(optax.sgd(2.0**-9), gradtools.stochastic_rounding(4))
    tx = gradtools.accumulate(inner, every_k=2)
    update = jax.jit(tx.update)
    d1, state = update(g1, tx.init(p), p)
    assert not np.any(f32(d1["w"])) and int(state.inner_state[1].rounding_step) == 0
    d2, state = update(g2, state, p)
    assert int(state.inner_state[1].rounding_step) == 1
    mean = {"w": jnp.full(256, 0.5, jnp.bfloat16)}
    want, _ = jax.jit(inner.update)(mean, inner.init(p), p)
    np.testing.assert_array_equal(f32(d2["w"]), f32(want["w"]))
    assert len(np.unique(f32(optax.apply_updates(p, d2)["w"]))) == 2
