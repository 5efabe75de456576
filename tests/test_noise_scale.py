"""The gradient noise scale of ``accumulate(..., noise_scale=True)`` against NumPy.

The reference applies issue 29's formulas as written, in float64: per closed
window of ``n >= 2`` micro-batches, ``small`` and ``big``, then ``G2`` and
``S`` with ``b = B / n``, and Adam's bias correction of their moving averages.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradtools

KEYS = ("grad_sq_norm", "grad_variance", "noise_scale")


def np_noise_scale(grads, weights, flushes, every_k, decay=0.99):
    """The metrics after every micro-step: (grad_sq_norm, grad_variance, noise_scale)."""
    window, m, closed, t, g2_avg, s_avg, out = [], 0, 0, 0, 0.0, 0.0, []
    for g, w, f in zip(grads, weights, flushes):
        g = np.concatenate([np.ravel(x).astype(np.float64) for x in jax.tree.leaves(g)])
        m += 1
        if w > 0:
            window.append((w, g))
        if m == max(every_k(closed), 1) or f:
            n = len(window)
            if n >= 2:
                B = sum(w for w, _ in window)  # noqa: N806
                b = B / n
                small = sum(w * g @ g for w, g in window) / B
                mean = sum(w * g for w, g in window) / B
                big = mean @ mean
                G2 = (B * big - b * small) / (B - b)  # noqa: N806
                S = (small - big) / (1 / b - 1 / B)  # noqa: N806
                if np.isfinite(G2) and np.isfinite(S):
                    t += 1
                    g2_avg = decay * g2_avg + (1 - decay) * G2
                    s_avg = decay * s_avg + (1 - decay) * S
            window, m, closed = [], 0, closed + 1
        corr = 1 - decay**t
        out.append((g2_avg / corr, s_avg / corr, s_avg / g2_avg) if t else (0.0, 0.0, 0.0))
    return np.array(out)


def run(step, tx, params, grads, weights, flushes):
    """The metrics ``KEYS`` after each micro-step of ``step`` (a ``weighted_step``); the state."""
    state, out = tx.init(params), []
    for g, w, f in zip(grads, weights, flushes):
        params, state = step(params, state, g, jnp.float32(w), jnp.asarray(f))
        m = gradtools.metrics(state)
        out.append([float(m[k]) for k in KEYS])
    return np.array(out), state


def ramp(n):
    return jnp.where(n < 2, 3, 4)


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize("every_k", [4, ramp], ids=["every_k=4", "schedule"])
def test_statistics_match_the_formulas_step_by_step(every_k, fused, weighted_step):
    rng = np.random.default_rng(1)
    params = {"a": jnp.zeros((3, 2)), "b": jnp.zeros(5)}
    grads = [
        jax.tree.map(lambda p: jnp.asarray(0.3 + rng.normal(size=p.shape), jnp.float32), params)
        for _ in range(40)
    ]
    grads[13]["b"] = grads[13]["b"].at[2].set(jnp.nan)  # its window is left out
    weights = [1.0] * 20 + [float(w) for w in rng.integers(1, 6, size=20)]
    weights[5] = weights[26] = 0.0  # these micro-batches do not count
    flushes = [i in (8, 17, 29) for i in range(40)]
    tx = gradtools.accumulate(optax.sgd(0.1), every_k, noise_scale=True)
    got, state = run(weighted_step(tx, fused), tx, params, grads, weights, flushes)
    schedule = (lambda n: every_k) if isinstance(every_k, int) else (lambda n: 3 if n < 2 else 4)
    want = np_noise_scale(grads, weights, flushes, schedule)
    assert np.count_nonzero(np.diff(want[:, 0])) >= 6  # several windows gave estimates
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    assert state.noise_stats.g2_ema.dtype == jnp.float32


def test_loss_scaler_outside_gives_the_statistics_of_the_unscaled_gradients(weighted_step):
    rng = np.random.default_rng(2)
    true = [jnp.asarray(rng.normal(size=4) + 1, jnp.float32) for _ in range(12)]
    plain = gradtools.accumulate(optax.sgd(0.1), 3, noise_scale=True)
    scaled = gradtools.dynamic_loss_scale(plain, init_scale=2.0**10, growth_interval=100)
    state, update = scaled.init(jnp.zeros(4)), jax.jit(scaled.update)
    for g in true:
        _, state = update(g * gradtools.loss_scale(state), state, jnp.zeros(4))
    want, _ = run(weighted_step(plain, False), plain, jnp.zeros(4), true, [1.0] * 12, [False] * 12)
    got = gradtools.metrics(state)
    np.testing.assert_array_equal([float(got[k]) for k in KEYS], want[-1])
    assert want[-1][0] != 0.0


def _synthetic_run(weights, windows, k, seed):
    """``g_i = G + noise / sqrt(b_i)`` with ``noise ~ N(0, Sigma)``: the metrics at the end."""
    rng = np.random.default_rng(seed)
    d = 64
    sigma = rng.uniform(0.5, 2.0, size=d)  # a diagonal covariance
    g_true = rng.normal(size=d)
    g_true *= np.sqrt(sigma.sum() / 24.0 / (g_true @ g_true))  # tr(Sigma) / |G|^2 = 24
    b = np.resize(weights, windows * k).astype(np.float32)
    noise = rng.normal(size=(windows * k, d)) * np.sqrt(sigma) / np.sqrt(b)[:, None]
    grads = jnp.asarray(g_true + noise, jnp.float32)
    tx = gradtools.accumulate(optax.sgd(0.0), k, noise_scale=True)
    params = jnp.zeros(d)

    def body(state, gw):
        g, w = gw
        return tx.update(g, state, params, weight=w)[1], None

    state = jax.jit(lambda s: jax.lax.scan(body, s, (grads, jnp.asarray(b)))[0])(tx.init(params))
    return gradtools.metrics(state), sigma.sum() / (g_true @ g_true), sigma.sum(), g_true @ g_true


@pytest.mark.parametrize(
    "weights", [[4.0], [1.0, 2.0, 4.0, 8.0, 3.0]], ids=["equal", "unequal-example-counts"]
)
def test_noise_scale_estimates_the_true_one_on_synthetic_gradients(weights):
    m, b_simple, trace, g_sq = _synthetic_run(weights, windows=400, k=8, seed=3)
    assert float(m["noise_scale"]) == pytest.approx(b_simple, rel=0.15)
    assert float(m["grad_variance"]) == pytest.approx(trace, rel=0.15)
    assert float(m["grad_sq_norm"]) == pytest.approx(g_sq, rel=0.15)


def test_a_window_of_one_micro_batch_gives_no_estimate(weighted_step):
    tx = gradtools.accumulate(optax.sgd(0.1), 3, noise_scale=True)
    grads = [jnp.array([1.0, 2.0]), jnp.array([3.0, 1.0])]
    got, state = run(weighted_step(tx, False), tx, jnp.zeros(2), grads, [1.0, 1.0], [True, True])
    np.testing.assert_array_equal(got, np.zeros((2, 3)))
    assert float(state.noise_stats.ema_weight) == 0.0
    assert int(state.noise_stats.window_micro_batches) == 0  # cleared by each flush


def test_off_by_default_and_off_keeps_no_state():
    tx = gradtools.accumulate(optax.sgd(0.1), 2)
    state = tx.init(jnp.zeros(2))
    assert state.noise_stats == ()
    on = gradtools.accumulate(optax.sgd(0.1), 2, noise_scale=True).init(jnp.zeros(2))
    # what noise_scale=True adds is its NoiseScaleState, and nothing else
    assert len(jax.tree.leaves(on)) == len(jax.tree.leaves(state)) + 5
    assert not set(KEYS) & set(gradtools.metrics(state))
    assert set(KEYS) <= set(gradtools.metrics(on))
    chex.assert_trees_all_equal(on._replace(noise_stats=()), state)
