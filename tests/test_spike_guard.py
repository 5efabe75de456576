"""Tests for gradtools.spike_guard against a NumPy reference of its rule."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradtools

SHAPES = {"a": (3, 4), "b": (5,), "c": (2, 2, 2)}
STEPS = 60
SPIKES_AT = (20, 21, 33, 50)  # gradients 25x their usual size
NONFINITE_AT = 40  # an inf in one leaf
LR = 0.1


def gradient_series(seed=0):
    """Gradients of a steady norm (about 5% spread), with spikes and one inf injected."""
    rng = np.random.default_rng(seed)
    base = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    series = []
    for t in range(STEPS):
        scale = np.float32(1.0 + 0.05 * rng.standard_normal())
        g = {k: (v * scale + 0.02 * rng.standard_normal(v.shape)).astype(np.float32)
             for k, v in base.items()}  # fmt: skip
        if t in SPIKES_AT:
            g = {k: v * np.float32(25.0) for k, v in g.items()}
        if t == NONFINITE_AT:
            g["b"] = g["b"].copy()
            g["b"][1] = np.inf
        series.append(g)
    return series


def reference(series, *, z, decay, warmup, action, p):
    """The rule of issue 28, in float64: per step the sgd updates, spikes, mean, std, norm."""
    mean = var = 0.0
    count = spikes = 0
    out = []
    for g in series:
        flat = np.concatenate([np.ravel(v).astype(np.float64) for v in g.values()])
        n = float(np.linalg.norm(flat, ord=p))
        limit = mean + z * math.sqrt(var)
        finite = math.isfinite(n)
        spike = finite and count >= max(warmup, 1) and n > limit
        used, factor, enters = n, 1.0, finite
        if spike:
            spikes += 1
            if action == "clip":
                used, factor = limit, limit / n
            else:
                factor, enters = 0.0, False  # zero updates, nothing learnt
        updates = {k: -LR * factor * v.astype(np.float64) for k, v in g.items()}
        if enters:
            count += 1
            w = (1 - decay) / (1 - decay**count)
            delta = used - mean
            var = (1 - w) * (var + w * delta * delta)
            mean += w * delta
        out.append((updates, spikes, mean, math.sqrt(var), n, spike))
    return out


def run(tx, series, params=None):
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()} if params is None else params
    update = jax.jit(tx.update)
    state, out = tx.init(params), []
    for g in series:
        updates, state = update(g, state, params)
        out.append((updates, state))
    return out


CASES = [("clip", 2.0), ("skip", 2.0), ("clip", math.inf), ("skip", 1.0), ("clip", 3.0)]


@pytest.mark.parametrize("action, p", CASES, ids=[f"{a}-p{p}" for a, p in CASES])
def test_steps_match_the_numpy_reference(action, p):
    series = gradient_series()
    kw = dict(z_threshold=2.5, decay=0.9, warmup_steps=10, action=action)
    tx = gradtools.spike_guard(optax.sgd(LR), norm_type=p, **kw)
    want = reference(series, z=2.5, decay=0.9, warmup=10, action=action, p=p)
    got = run(tx, series)
    # The injected spikes are spikes, and nothing else is.
    assert [t for t, w in enumerate(want) if w[5]] == list(SPIKES_AT)
    sgd = optax.sgd(LR)
    plain = jax.jit(lambda g: sgd.update(g, sgd.init(g))[0])
    for t, ((updates, state), (w_updates, spikes, mean, std, n, spike)) in enumerate(
        zip(got, want)
    ):
        m = gradtools.metrics(state)
        assert int(m["spikes"]) == spikes, t
        np.testing.assert_allclose(m["norm_mean"], mean, rtol=2e-6, err_msg=str(t))
        np.testing.assert_allclose(m["norm_std"], std, rtol=2e-4, atol=1e-6, err_msg=str(t))
        np.testing.assert_allclose(m["grad_norm"], n, rtol=2e-6, err_msg=str(t))
        if t == NONFINITE_AT:  # no spike: the inf reaches sgd, and the statistics stay
            assert np.isinf(updates["b"][1]) and not np.isfinite(m["grad_norm"])
            chex.assert_trees_all_equal(state.norm_mean, got[t - 1][1].norm_mean)
            continue
        if spike and action == "skip":
            chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
        elif not spike:  # bit for bit what sgd alone gives
            chex.assert_trees_all_equal(updates, plain(series[t]))
        for k in SHAPES:
            np.testing.assert_allclose(updates[k], w_updates[k], rtol=2e-5, atol=1e-7)
    assert int(gradtools.metrics(got[-1][1])["spikes"]) == len(SPIKES_AT)


def clip_adam():
    return optax.chain(gradtools.clip_by_global_norm(3.0), optax.adam(0.01))


def test_skip_is_the_inner_optimizer_on_the_other_steps_bit_for_bit():
    """A skipped spike leaves the inner state as it was: the clip's norm included."""
    series = gradient_series(1)
    guarded = run(gradtools.spike_guard(clip_adam(), warmup_steps=10, action="skip"), series)
    inner = clip_adam()
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    state, update = inner.init(params), jax.jit(inner.update)
    skipped = 0
    for t, (g, (updates, guard_state)) in enumerate(zip(series, guarded)):
        if t in SPIKES_AT:
            skipped += 1
            chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
        else:
            want, state = update(g, state, params)
            chex.assert_trees_all_equal(updates, want)
        chex.assert_trees_all_equal(guard_state.inner_state, state)
    assert skipped == len(SPIKES_AT)


def test_clip_hands_the_inner_clip_exact_sums_of_squares():
    """``spike_guard(chain(clip, adam))`` is ``chain(clip, adam)`` on what the guard passes.

    ``spike_guard(identity())`` gives the gradients the guard passes on; the
    inner clip, which takes its sums of squares from the guard, must measure
    them exactly as it would itself, bit for bit. (Adam's arithmetic, compiled
    into another program, may round its last bit differently.)
    """
    series = gradient_series(2)
    passed = [u for u, _ in run(gradtools.spike_guard(optax.identity(), warmup_steps=10), series)]
    guarded = run(gradtools.spike_guard(clip_adam(), warmup_steps=10), series)
    inner = clip_adam()
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    state, update = inner.init(params), jax.jit(inner.update)
    for t, (g, (updates, guard_state)) in enumerate(zip(passed, guarded)):
        want, state = update(g, state, params)
        chex.assert_trees_all_equal(guard_state.inner_state[0], state[0])
        chex.assert_trees_all_close((updates, guard_state.inner_state), (want, state), rtol=1e-6)
        if t in SPIKES_AT:  # the clip saw the norm the guard scaled to
            limit = gradtools.metrics(guarded[t - 1][1])
            limit = limit["norm_mean"] + 2.5 * limit["norm_std"]
            np.testing.assert_allclose(state[0].grad_norm, limit, rtol=1e-5)


def test_apply_gradients_leaves_params_of_a_skipped_spike_as_they_were():
    series = gradient_series(3)
    tx = gradtools.spike_guard(optax.adam(0.01), warmup_steps=10, action="skip")
    params = {k: jnp.ones(s) for k, s in SHAPES.items()}
    state = tx.init(params)
    fused = jax.jit(lambda g, s, p: gradtools.apply_gradients(tx, g, s, p))
    plain = jax.jit(lambda g, s, p: tx.update(g, s, p))
    for t, g in enumerate(series[: SPIKES_AT[0] + 1]):
        updates, want_state = plain(g, state, params)
        new_params, state = fused(g, state, params)
        chex.assert_trees_all_close(new_params, optax.apply_updates(params, updates), rtol=1e-6)
        chex.assert_trees_all_equal(state, want_state)
        if t == SPIKES_AT[0]:
            chex.assert_trees_all_equal(new_params, params)
            assert int(state.spikes) == 1
        params = new_params


def test_inside_a_loss_scaler_it_sees_unscaled_gradients_and_no_overflow():
    series = gradient_series(4)[:30]
    scale = 2.0**10
    guard = lambda: gradtools.spike_guard(clip_adam(), warmup_steps=10)  # noqa: E731
    tx = gradtools.dynamic_loss_scale(guard(), init_scale=scale)
    scaled = [{k: v * np.float32(scale) for k, v in g.items()} for g in series]
    overflow_at = 15
    scaled[overflow_at]["a"][0, 0] = np.inf
    # the scale halves at the overflow: scale the later gradients by the new scale
    for g in scaled[overflow_at + 1 :]:
        for k in g:
            g[k] = g[k] / np.float32(2.0)
    got = run(tx, scaled)
    alone = run(guard(), [g for t, g in enumerate(series) if t != 15])
    got = [s for t, (_, s) in enumerate(got) if t != overflow_at]
    assert int(got[-1].skipped_steps) == 1
    for state, (_, want) in zip(got, alone):
        guard = state.inner_state
        for field in ("spikes", "norm_count", "guard_norm", "norm_mean", "norm_var"):
            np.testing.assert_allclose(getattr(guard, field), getattr(want, field), rtol=1e-6)
    assert int(got[-1].inner_state.spikes) == 2  # steps 20 and 21


def test_first_norm_is_never_a_spike_and_warmup_zero_guards_the_second():
    tx = gradtools.spike_guard(optax.sgd(1.0), warmup_steps=0)
    out = run(tx, [{"a": np.full(SHAPES["a"], x, np.float32)} for x in (1.0, 0.5, 2.0)],
              params={"a": jnp.zeros(SHAPES["a"])})  # fmt: skip
    assert [int(s.spikes) for _, s in out] == [0, 0, 1]
    # the third is clipped to the mean of the first two norms (weights 1/(1+d), d/(1+d))
    norms = np.array([1.0, 0.5]) * np.sqrt(12)
    d = 0.97
    mean = norms[0] + (norms[1] - norms[0]) / (1 + d)
    var = (1 - 1 / (1 + d)) * (norms[1] - norms[0]) ** 2 / (1 + d)
    got = float(gradtools.global_norm(out[2][0]))
    np.testing.assert_allclose(got, mean + 2.5 * np.sqrt(var), rtol=1e-5)


def test_metrics_grad_norm_is_that_of_the_first_to_see_the_gradients():
    g = {"w": jnp.array([30.0, 40.0])}
    params = {"w": jnp.zeros(2)}

    def after(tx, grads):
        state = tx.init(params)
        for x in grads:
            _, state = tx.update(x, state, params)
        return gradtools.metrics(state), state

    small = [{"w": jnp.array([3.0, 4.0])}] * 2
    # The guard outside the clip: the norm before the guard, not the clip's after it.
    m, state = after(gradtools.spike_guard(clip_adam(), warmup_steps=2), [*small, g])
    # (5.0 to float32 rounding: XLA:GPU rescales [30, 40] to a norm of 4.9999995)
    assert float(m["grad_norm"]) == 50.0
    assert float(state.inner_state[0].grad_norm) == pytest.approx(5.0, rel=1e-6)
    assert sorted(m) == ["grad_norm", "norm_mean", "norm_std", "spikes"]
    # The clip outside the guard: the clip's, before clipping.
    tx = optax.chain(gradtools.clip_by_global_norm(4.0), gradtools.spike_guard(optax.sgd(1.0)))
    m, state = after(tx, [*small, g])
    assert float(m["grad_norm"]) == 50.0 and float(state[1].guard_norm) == pytest.approx(4.0)


BAD = [
    ("z_threshold", dict(z_threshold=0.0), ValueError),
    ("z_threshold", dict(z_threshold=float("nan")), ValueError),
    ("decay", dict(decay=1.0), ValueError),
    ("decay", dict(decay=0.0), ValueError),
    ("warmup_steps", dict(warmup_steps=-1), ValueError),
    ("warmup_steps", dict(warmup_steps=2.5), ValueError),
    ("warmup_steps", dict(warmup_steps=True), ValueError),
    ("action", dict(action="clamp"), ValueError),
    ("norm_type", dict(norm_type=0.5), ValueError),
]


@pytest.mark.parametrize("name, kwargs, error", BAD, ids=[str(b[1]) for b in BAD])
def test_bad_arguments_are_refused_when_built(name, kwargs, error):
    with pytest.raises(error, match=name):
        gradtools.spike_guard(optax.sgd(0.1), **kwargs)


def test_inner_must_be_a_transformation():
    with pytest.raises(TypeError, match="inner=.* call it"):
        gradtools.spike_guard(optax.sgd)  # pyright: ignore[reportArgumentType]
