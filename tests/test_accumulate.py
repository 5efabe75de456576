"""Tests for gradtools.accumulate against NumPy big-batch references."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradtools

RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 3)).astype(np.float32)
Y = RNG.normal(size=(32,)).astype(np.float32)
W0 = np.array([0.5, -1.0, 2.0], np.float32)


def loss(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


def np_grad(w, x, y):
    """Closed-form gradient of the mean squared error, in float64."""
    x, y, w = (np.asarray(a, np.float64) for a in (x, y, w))
    return 2.0 / len(y) * x.T @ (x @ w - y)


def updates_and_state(tx, params, grads_list, **kw_seq):
    update = jax.jit(tx.update)
    state = tx.init(params)
    outs = []
    for i, g in enumerate(grads_list):
        kw = {k: v[i] for k, v in kw_seq.items()}
        u, state = update(g, state, params, **kw)
        outs.append(u)
    return outs, state


@pytest.mark.parametrize("k", [1, 2, 4])
def test_sgd_matches_one_big_batch_step(k):
    lr, windows = 0.1, 3
    tx = gradtools.accumulate(optax.sgd(lr), k)
    update = jax.jit(tx.update)
    grad = jax.jit(jax.grad(loss))
    params, state = jnp.asarray(W0), tx.init(jnp.asarray(W0))
    ref = W0.astype(np.float64)
    for _ in range(windows):
        for xs, ys in zip(np.split(X, k), np.split(Y, k)):
            u, state = update(grad(params, xs, ys), state, params)
            params = optax.apply_updates(params, u)
        ref = ref - lr * np_grad(ref, X, Y)  # one step on the whole batch
    np.testing.assert_allclose(params, ref, rtol=1e-6)


@pytest.mark.parametrize("k", [2, 4])
def test_adam_matches_one_big_batch_step(k):
    big, acc = optax.adam(0.05), gradtools.accumulate(optax.adam(0.05), k)
    grad = jax.jit(jax.grad(loss))
    big_update, acc_update = jax.jit(big.update), jax.jit(acc.update)
    p_big = p_acc = jnp.asarray(W0)
    s_big, s_acc = big.init(p_big), acc.init(p_acc)
    for _ in range(3):
        u, s_big = big_update(grad(p_big, X, Y), s_big, p_big)
        p_big = optax.apply_updates(p_big, u)
        for xs, ys in zip(np.split(X, k), np.split(Y, k)):
            u, s_acc = acc_update(grad(p_acc, xs, ys), s_acc, p_acc)
            p_acc = optax.apply_updates(p_acc, u)
    np.testing.assert_allclose(p_acc, p_big, rtol=1e-6)
    assert int(s_acc.inner_state[0].count) == 3


@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"]
)
def test_every_k_1_is_bit_identical_to_inner(dtype):
    inner = optax.chain(optax.clip(0.3), optax.adam(1e-2))
    tx = gradtools.accumulate(inner, 1)
    params = {"w": jnp.asarray(W0, dtype), "b": jnp.zeros((2, 2), dtype)}
    grads = [
        jax.tree.map(lambda p, i=i: jnp.asarray(RNG.normal(size=p.shape), dtype) * (i - 1), params)
        for i in range(4)
    ]  # the second is -0.0 everywhere: 0 + -0.0 would lose the sign
    ref_u, ref_state = updates_and_state(inner, params, grads)
    got_u, got_state = updates_and_state(tx, params, grads)
    for r, g in zip(ref_u, got_u):
        chex.assert_trees_all_equal(r, g, strict=True)
    chex.assert_trees_all_equal(ref_state, got_state.inner_state, strict=True)
    assert isinstance(got_state, gradtools.AccumulateState)
    assert got_state.acc_grads == ()  # no buffer kept
    assert int(gradtools.metrics(got_state)["micro_step"]) == 0


def test_weighted_micro_batches_equal_big_batch_mean():
    sizes = [32, 32, 32, 7]
    x = RNG.normal(size=(sum(sizes), 3)).astype(np.float32)
    y = RNG.normal(size=(sum(sizes),)).astype(np.float32)
    tx = gradtools.accumulate(optax.sgd(1.0), 4)
    cuts = np.cumsum(sizes)[:-1]
    grads = [
        jax.grad(loss)(jnp.asarray(W0), a, b) for a, b in zip(np.split(x, cuts), np.split(y, cuts))
    ]
    outs, state = updates_and_state(tx, jnp.asarray(W0), grads, weight=[float(s) for s in sizes])
    np.testing.assert_allclose(-outs[-1], np_grad(W0, x, y), rtol=1e-6)
    # The plain mean of the four micro-batch means is a different number.
    assert not np.allclose(-outs[-1], np.mean([np.asarray(g) for g in grads], 0), rtol=1e-3)
    assert all(not np.any(o) for o in outs[:-1])
    assert int(state.micro_step) == 0 and float(state.window_weight) == 0.0


def test_sum_instead_of_mean():
    tx = gradtools.accumulate(optax.sgd(1.0), 3, average=False)
    grads = [jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0]), jnp.array([5.0, 7.0])]
    outs, _ = updates_and_state(tx, jnp.zeros(2), grads, weight=[1.0, 2.0, 1.0])
    np.testing.assert_array_equal(outs[-1], -np.array([1 + 6 + 5, 2 + 8 + 7.0]))


def test_flush_after_two_of_four_then_clean_window():
    tx = gradtools.accumulate(optax.sgd(1.0), 4)
    g = [jnp.array([float(i), 10.0 * i]) for i in range(1, 7)]
    flush = [jnp.asarray(i == 1) for i in range(6)]
    outs, state = updates_and_state(tx, jnp.zeros(2), g, flush=flush)
    np.testing.assert_array_equal(outs[1], -np.mean(g[0:2], 0))  # the mean of those 2
    assert not np.any(np.stack(outs[2:5]))
    # The next window holds exactly the four micro-batches after the flush.
    np.testing.assert_allclose(outs[5], -np.mean(g[2:6], 0), rtol=1e-6)
    assert int(state.micro_step) == 0 and float(state.window_weight) == 0.0


def test_epoch_of_ten_batches_gives_three_updates_and_loses_none():
    tx = gradtools.accumulate(optax.sgd(1.0), 4)
    g = [jnp.asarray(RNG.normal(size=3), jnp.float32) for _ in range(10)]
    flush = [jnp.asarray(i == 9) for i in range(10)]
    outs, state = updates_and_state(tx, jnp.zeros(3), g, flush=flush)
    applied = [i for i, o in enumerate(outs) if np.any(o)]
    assert applied == [3, 7, 9]
    for i, window in zip(applied, [g[0:4], g[4:8], g[8:10]]):
        np.testing.assert_allclose(outs[i], -np.mean(window, 0), rtol=1e-6)
    assert int(state.micro_step) == 0


def test_inner_count_and_schedule_advance_once_per_window():
    schedule = lambda step: 1.0 / (step + 1.0)  # noqa: E731
    tx = gradtools.accumulate(optax.chain(optax.scale_by_adam(), optax.sgd(schedule)), 3)
    g = [jnp.full(2, 2.0)] * 9
    update = jax.jit(tx.update)
    state, lrs = tx.init(jnp.zeros(2)), []
    for i, gi in enumerate(g):
        u, state = update(gi, state, jnp.zeros(2))
        if i % 3 == 2:
            # adam on a constant gradient gives a unit step; sgd scales it by -lr.
            lrs.append(-float(u[0]))
    np.testing.assert_allclose(lrs, [1.0, 0.5, 1 / 3], rtol=1e-4)
    adam_state, sched_state = state.inner_state[0], state.inner_state[1]
    assert int(adam_state.count) == 3
    assert int(optax.tree.get(sched_state, "count")) == 3


def scaled(g, state):
    return jax.tree.map(lambda x: x * gradtools.loss_scale(state), g)


def test_nan_micro_step_skips_whole_window_under_inner_loss_scale():
    tx = gradtools.accumulate(
        gradtools.dynamic_loss_scale(optax.sgd(1.0), init_scale=64.0, growth_interval=100), 2
    )
    update = jax.jit(tx.update)
    params, state = jnp.zeros(2), tx.init(jnp.zeros(2))
    true = [
        jnp.array([1.0, 2.0]),
        jnp.array([jnp.nan, 1.0]),
        jnp.array([3.0, 5.0]),
        jnp.array([1.0, 1.0]),
    ]
    outs = []
    for g in true:
        u, state = update(scaled(g, state), state, params)
        outs.append(u)
    np.testing.assert_array_equal(outs[1], np.zeros(2))  # the whole window is skipped
    m = gradtools.metrics(state)
    assert float(m["loss_scale"]) == 32.0 and int(m["skipped_steps"]) == 1  # backed off once
    np.testing.assert_array_equal(outs[3], -np.array([2.0, 3.0]))  # the next window is clean
    assert bool(m["finite"])


def test_nan_micro_batch_dropped_under_outer_loss_scale():
    tx = gradtools.dynamic_loss_scale(
        gradtools.accumulate(optax.sgd(1.0), 2), init_scale=64.0, growth_interval=100
    )
    update = jax.jit(tx.update)
    params, state = jnp.zeros(2), tx.init(jnp.zeros(2))
    true = [jnp.array([1.0, 2.0]), jnp.array([jnp.inf, 1.0]), jnp.array([3.0, 6.0])]
    outs = []
    for g in true:
        u, state = update(scaled(g, state), state, params)
        outs.append(u)
        if len(outs) == 2:
            assert int(gradtools.metrics(state)["micro_step"]) == 1  # the window survives
    np.testing.assert_array_equal(outs[2], -np.array([2.0, 4.0]))  # mean of the good two
    m = gradtools.metrics(state)
    assert float(m["loss_scale"]) == 32.0 and int(m["skipped_steps"]) == 1


def test_skip_microstep_drops_nonfinite_without_loss_scaler():
    tx = gradtools.accumulate(optax.sgd(1.0), 2, on_nonfinite="skip_microstep")
    g = [jnp.array([1.0, 2.0]), jnp.array([jnp.nan, 1.0]), jnp.array([3.0, 6.0])]
    outs, state = updates_and_state(tx, jnp.zeros(2), g)
    assert not np.any(outs[1])
    np.testing.assert_array_equal(outs[2], -np.array([2.0, 4.0]))
    assert int(state.dropped_micro_steps) == 1 and int(state.micro_step) == 0
    m = gradtools.metrics(state)  # the only record of the drop, with no loss scaler
    assert int(m["dropped_micro_steps"]) == 1 and m["dropped_micro_steps"].dtype == jnp.int32


@pytest.mark.parametrize(
    "g",
    [jnp.full(4, 60000.0, jnp.float16), jnp.array([3e38, 3e38], jnp.float32)],
    ids=["f16", "f32"],
)
def test_skip_microstep_keeps_large_finite_micro_batches(g):
    # A plain sum of g overflows, but every value is finite: nothing is dropped.
    tx = gradtools.accumulate(optax.sgd(1.0), 2, on_nonfinite="skip_microstep")
    params = jnp.zeros(g.shape, g.dtype)
    outs, state = updates_and_state(tx, params, [g, jnp.zeros_like(g)])
    assert int(state.dropped_micro_steps) == 0
    np.testing.assert_array_equal(outs[1], -np.asarray(g) / 2)  # the mean of g and 0


def test_inf_weight_counts_as_zero():
    tx = gradtools.accumulate(optax.sgd(1.0), 2)
    g = [jnp.array([1.0, 2.0]), jnp.array([3.0, 5.0])]
    outs, _ = updates_and_state(tx, jnp.zeros(2), g, weight=[jnp.float32(jnp.inf), 2.0])
    np.testing.assert_array_equal(outs[1], [-3.0, -5.0])  # (0 * g0 + 2 * g1) / 2


def test_propagate_hands_nan_window_on_and_next_window_is_clean():
    tx = gradtools.accumulate(optax.sgd(1.0), 2)
    g = [
        jnp.array([1.0, jnp.nan]),
        jnp.array([1.0, 1.0]),
        jnp.array([1.0, 2.0]),
        jnp.array([3.0, 4.0]),
    ]
    outs, state = updates_and_state(tx, jnp.zeros(2), g)
    assert np.isnan(outs[1][1])  # propagate: inner receives the NaN, as asked
    np.testing.assert_array_equal(outs[3], -np.array([2.0, 3.0]))  # no NaN survives the reset
    assert int(state.dropped_micro_steps) == 0


@pytest.mark.parametrize(
    "pdtype, dtype",
    [
        (jnp.float32, jnp.float32),
        (jnp.bfloat16, jnp.float32),
        (jnp.float16, jnp.float32),
        (jnp.float32, jnp.bfloat16),  # updates the buffer cannot hold: they leave on their own
    ],
    ids=["f32", "bf16-params", "f16-params", "bf16-buffer"],
)
def test_update_clears_the_buffer_when_a_window_closes(pdtype, dtype):
    """``acc_grads`` holds the open window's weighted sum, and zeros once it closes.

    The NaN window is handed on (``"propagate"``) and cleared by selection: no
    NaN survives into the next window's sum.
    """
    vals = [[1.0, jnp.nan], [2.0, 3.0], [0.5, 1.5], [4.0, 2.0], [1.0, 1.0]]
    weights, flushes = [1.0, 2.0, 1.0, 3.0, 2.0], [False, False, False, False, True]
    tx = gradtools.accumulate(optax.sgd(1.0), 2, dtype=dtype)
    params = jnp.zeros(2, pdtype)
    update, state = jax.jit(tx.update), tx.init(params)
    acc, total = np.zeros(2), 0.0  # the NumPy reference of the open window
    for v, w, flush in zip(vals, weights, flushes):
        g = jnp.asarray(v, pdtype)
        u, state = update(g, state, params, weight=jnp.float32(w), flush=jnp.asarray(flush))
        acc, total = acc + w * np.asarray(g, np.float64), total + w
        assert u.dtype == jnp.dtype(pdtype) and state.acc_grads.dtype == jnp.dtype(dtype)
        if int(state.micro_step) == 0:  # the window closed
            eps = float(jnp.finfo(jnp.dtype(pdtype)).eps)  # XLA divides through the reciprocal
            np.testing.assert_allclose(np.asarray(u, np.float64), -acc / total, rtol=eps)
            np.testing.assert_array_equal(np.asarray(state.acc_grads, np.float64), [0.0, 0.0])
            acc, total = np.zeros(2), 0.0
        else:
            np.testing.assert_array_equal(np.asarray(u, np.float64), [0.0, 0.0])
            want_acc = acc.astype(jnp.dtype(dtype)).astype(np.float64)
            np.testing.assert_array_equal(np.asarray(state.acc_grads, np.float64), want_acc)


def test_zero_negative_and_nan_weights_never_give_nan():
    tx = gradtools.accumulate(optax.adam(0.1), 2)
    params = jnp.zeros(2)
    g = [
        jnp.array([1.0, 2.0]),
        jnp.array([jnp.nan, 5.0]),
        jnp.array([4.0, 4.0]),
        jnp.array([9.0, 9.0]),
    ]
    g += [jnp.array([3.0, 3.0]), jnp.array([1.0, 1.0])]
    weights = [0.0, 0.0, 2.0, -1.0, 1.0, jnp.nan]
    outs, state = updates_and_state(tx, params, g, weight=[jnp.float32(w) for w in weights])
    assert all(np.all(np.isfinite(o)) for o in outs)
    assert not np.any(outs[1])  # total weight 0: the window is dropped ...
    assert int(state.inner_state[0].count) == 2  # ... and adam's count did not move for it
    ref, ref_state = updates_and_state(optax.adam(0.1), params, [g[2], g[4]])
    np.testing.assert_allclose(outs[3], ref[0], rtol=1e-6)  # weight -1 counts as 0
    np.testing.assert_allclose(outs[5], ref[1], rtol=1e-6)  # weight NaN counts as 0


@pytest.mark.parametrize("gdtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("pdtype", [jnp.float32, "same"], ids=["f32-params", "half-params"])
def test_half_gradients_accumulate_in_float32(gdtype, pdtype):
    pdtype = gdtype if pdtype == "same" else pdtype
    # 256 + 1 is not representable in bf16 (nor 2048 + 1 in fp16): a half-precision
    # running sum drops the small terms, the float32 buffer keeps them.
    big = 256.0 if gdtype == jnp.bfloat16 else 2048.0
    vals = np.array([[big, 1.0], [1.0, 1.0], [1.0, 3.0], [1.0, 1.0]])
    g = [jnp.asarray(v, gdtype) for v in vals]
    params = jnp.zeros(2, pdtype)
    outs, state = updates_and_state(gradtools.accumulate(optax.sgd(1.0), 4), params, g)
    want = (-vals.mean(0)).astype(jnp.dtype(pdtype))  # one rounding, from the exact mean
    np.testing.assert_array_equal(np.asarray(outs[-1]), want)
    assert all(o.dtype == jnp.dtype(pdtype) for o in outs)  # micro-steps too
    assert state.acc_grads.dtype == jnp.float32
    half, _ = updates_and_state(gradtools.accumulate(optax.sgd(1.0), 4, dtype=gdtype), params, g)
    assert not np.array_equal(np.asarray(half[-1]).astype(np.float64), want.astype(np.float64))


def test_state_structure_mixed_dtypes_none_and_shape_dtype_struct():
    params = {
        "a": jnp.zeros((2, 3), jnp.bfloat16),
        "b": jnp.zeros(4, jnp.float16),
        "c": None,
        "d": {},
        "e": jnp.zeros(3),
    }
    tx = gradtools.accumulate(optax.adam(1e-3), 2)
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    state0 = tx.init(shapes)
    grads = jax.tree.map(jnp.ones_like, params)
    update = jax.jit(tx.update)
    _, s1 = update(grads, state0, params)
    u2, s2 = update(grads, s1, params)
    for s in (s1, s2):
        chex.assert_trees_all_equal_structs(state0, s)
        chex.assert_trees_all_equal_dtypes(state0, s)
    assert state0.micro_step.dtype == jnp.int32 and state0.window_weight.dtype == jnp.float32
    assert u2["c"] is None and u2["d"] == {}
    assert u2["a"].dtype == jnp.bfloat16 and u2["b"].dtype == jnp.float16


def test_one_trace_across_micro_update_and_flush_steps():
    tx = gradtools.accumulate(optax.adam(1e-3), 3)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(params, state, g, weight, flush):
        u, state = tx.update(g, state, params, weight=weight, flush=flush)
        return optax.apply_updates(params, u), state

    params = jnp.zeros(2)
    state = tx.init(params)
    applied = []
    for i in range(7):
        before = params
        flush = jnp.asarray(i == 4)
        params, state = step(params, state, jnp.ones(2), jnp.float32(i + 1), flush)
        applied.append(bool(np.any(params != before)))
    assert applied == [False, False, True, False, True, False, False]


def test_metrics_report_micro_step_and_grad_norm():
    tx = gradtools.accumulate(optax.chain(gradtools.clip_by_global_norm(1.0), optax.sgd(1.0)), 3)
    update = jax.jit(tx.update)
    state = tx.init(jnp.zeros(2))
    _, state = update(jnp.array([3.0, 4.0]), state, jnp.zeros(2))
    m = gradtools.metrics(state)
    assert int(m["micro_step"]) == 1 and m["micro_step"].dtype == jnp.int32
    assert float(m["grad_norm"]) == 0.0  # the inner clip has not run yet
    for g in ([3.0, 4.0], [3.0, 4.0]):
        _, state = update(jnp.array(g), state, jnp.zeros(2))
    m = gradtools.metrics(state)
    assert int(m["micro_step"]) == 0 and float(m["grad_norm"]) == 5.0


def test_extra_args_reach_inner_on_emitting_steps(scale_by_factor):
    tx = gradtools.accumulate(scale_by_factor, 2)
    step = jax.jit(lambda g, s, m: tx.update(g, s, factor=m))
    state = tx.init(jnp.zeros(2))
    u, state = step(jnp.array([1.0, 2.0]), state, 5.0)
    assert not np.any(u)
    u, state = step(jnp.array([3.0, 4.0]), state, 10.0)
    np.testing.assert_array_equal(u, [20.0, 30.0])


@pytest.mark.parametrize("k", [1, 2])
def test_weight_and_flush_never_reach_inner(k, scale_by_factor):
    tx = gradtools.accumulate(scale_by_factor, k)  # inner raises on an unknown extra argument
    state = tx.init(jnp.zeros(2))
    u, _ = jax.jit(tx.update)(jnp.array([1.0, 2.0]), state, weight=2.0, flush=True, factor=3.0)
    np.testing.assert_array_equal(u, [3.0, 6.0])  # the weighted mean of one micro-batch, times 3


def test_every_k_1_skip_rules():
    tx = gradtools.accumulate(optax.sgd(1.0), 1, on_nonfinite="skip_microstep")
    g = [jnp.array([1.0, jnp.nan]), jnp.array([1.0, 2.0]), jnp.array([3.0, 3.0])]
    outs, state = updates_and_state(tx, jnp.zeros(2), g, weight=[1.0, 0.0, 2.0])
    np.testing.assert_array_equal(np.stack(outs), [[0, 0], [0, 0], [-3.0, -3.0]])
    assert int(state.dropped_micro_steps) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_k": 0}, "every_k"),
        ({"every_k": 2.0}, "every_k"),
        ({"every_k": True}, "every_k"),
        ({"every_k": 2, "on_nonfinite": "skip"}, "on_nonfinite"),
        ({"every_k": 2, "average": "yes"}, "average"),
        ({"every_k": 2, "dtype": jnp.int32}, "dtype"),
        ({"every_k": 2, "dtype": None}, "dtype"),
        ({"every_k": "2"}, "every_k"),
        ({"every_k": 2, "noise_scale": 1}, "noise_scale"),
        ({"every_k": 2, "noise_scale": True, "noise_scale_decay": 1.0}, "noise_scale_decay"),
        ({"every_k": 2, "noise_scale_decay": 0.0}, "noise_scale_decay"),
        ({"every_k": 1, "noise_scale": True}, "every_k=1"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gradtools.accumulate(optax.sgd(0.1), **kwargs)


def test_bad_inner_and_runtime_arguments():
    with pytest.raises(TypeError, match="inner"):
        gradtools.accumulate(lambda g: g, 2)  # type: ignore[arg-type]
    tx = gradtools.accumulate(optax.sgd(0.1), 2)
    state = tx.init(jnp.zeros(2))
    with pytest.raises(ValueError, match="weight"):
        jax.jit(tx.update)(jnp.ones(2), state, weight=jnp.ones(2))
    with pytest.raises(ValueError, match="flush"):
        jax.jit(tx.update)(jnp.ones(2), state, flush=jnp.ones(2, bool))


def test_no_recompile_between_python_and_array_flush_values():
    tx = gradtools.accumulate(optax.sgd(0.1), 2)
    traces = []

    @jax.jit
    def step(g, state, flush):
        traces.append(None)
        return tx.update(g, state, flush=flush)

    state = tx.init(jnp.zeros(2))
    for f in (False, jnp.asarray(True), jnp.asarray(False), True):
        _, state = step(jnp.ones(2), state, f)
    assert len(traces) == 1


def test_gradtools_only_path_under_strict_dtypes(strict_dtypes):
    params = {"a": jnp.zeros(3, jnp.bfloat16), "b": jnp.zeros(2, jnp.float16), "c": jnp.zeros(2)}
    g = jax.tree.map(lambda p: jnp.full_like(p, 3.0), params)
    for k, mode in [(2, "propagate"), (2, "skip_microstep"), (1, "skip_microstep")]:
        tx = gradtools.accumulate(optax.identity(), k, on_nonfinite=mode)
        update = jax.jit(tx.update)
        state = tx.init(params)
        for _ in range(k):
            u, state = update(g, state, params, weight=jnp.float32(2.0), flush=jnp.array(False))
        chex.assert_trees_all_equal(u, g, strict=True)


def test_sharded_params_keep_their_sharding():
    mesh = jax.sharding.Mesh(jax.devices(), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    params = {"w": jax.device_put(jnp.zeros(8), sharding)}
    tx = gradtools.accumulate(optax.adam(0.1), 2)
    if jax.__version_info__ >= (0, 10):  # older jax gives zeros_like no sharding
        eager = tx.init(params)  # not on one device: the buffer is laid out like adam's mu
        for x in (eager.acc_grads["w"], eager.inner_state[0].mu["w"]):
            assert x.sharding.is_equivalent_to(sharding, 1), x.sharding
    state = jax.jit(tx.init)(params)
    update = jax.jit(tx.update)
    for _ in range(2):
        u, state = update(jax.tree.map(jnp.ones_like, params), state, params)
        for x in (u["w"], state.acc_grads["w"], state.inner_state[0].mu["w"]):
            assert x.sharding.is_equivalent_to(sharding, 1)


# --- every_k as a schedule of the windows closed so far ---------------------------------


def ramp(n):
    """2, 2, then 4 micro-batches per window (issue 28's example), traced."""
    return jnp.where(n < 2, 2, 4)


def np_ramp(n):
    return 2 if n < 2 else 4


def np_scheduled_run(p0, grads, weights, flushes, schedule, lr):
    """Plain SGD on the weighted mean of each window, windows as long as ``schedule`` says."""
    p, closed, params = np.asarray(p0, np.float64), 0, []
    acc, total, m = 0.0, 0.0, 0
    for g, w, f in zip(grads, weights, flushes):
        acc, total, m = acc + w * np.asarray(g, np.float64), total + w, m + 1
        if m == max(schedule(closed), 1) or f:
            p = p - lr * acc / total if total > 0 else p
            closed, acc, total, m = closed + 1, 0.0, 0.0, 0
        params.append(p)
    return params, closed


def scheduled_run(step, tx, p0, grads, weights, flushes, restore_at=None):
    """Params after every micro-step; the state goes through flax bytes at ``restore_at``."""
    import flax.serialization

    p, s, out = jnp.asarray(p0), tx.init(jnp.asarray(p0)), []
    for i, (g, w, f) in enumerate(zip(grads, weights, flushes)):
        if i == restore_at:
            s = flax.serialization.from_bytes(tx.init(p), flax.serialization.to_bytes(s))
        p, s = step(p, s, g, jnp.float32(w), jnp.asarray(f))
        out.append(p)
    return out, s


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
def test_scheduled_windows_match_numpy_with_weights_flush_and_a_restored_checkpoint(
    fused, weighted_step
):
    n = 21
    grads = [jnp.asarray(RNG.normal(size=3), jnp.float32) for _ in range(n)]
    weights = [float(w) for w in RNG.integers(1, 9, size=n)]
    flushes = [i == 6 for i in range(n)]  # closes the 4-window after 3 micro-batches
    tx = gradtools.accumulate(optax.sgd(0.5), ramp)
    want, closed = np_scheduled_run(W0, grads, weights, flushes, np_ramp, 0.5)
    step = weighted_step(tx, fused)
    got, state = scheduled_run(step, tx, W0, grads, weights, flushes)
    np.testing.assert_allclose(np.stack(got), np.stack(want), rtol=1e-6, atol=1e-7)
    # windows of 2, 2, then 3 cut by the flush, then 4, 4, 4 and 2 still open
    assert closed == int(state.windows_closed) == 6
    assert int(state.micro_step) == 2 and int(state.window_size) == 4
    # A checkpoint restored in the middle of the 4-window after the flush goes on bit for bit.
    resumed, resumed_state = scheduled_run(step, tx, W0, grads, weights, flushes, restore_at=9)
    chex.assert_trees_all_equal(resumed, got)
    chex.assert_trees_all_equal(resumed_state, state)


def test_schedule_below_one_counts_as_one_and_window_size_is_reported():
    schedule = lambda n: jnp.where(n < 2, n - 1, 3)  # -1, 0, then 3  # noqa: E731
    tx = gradtools.accumulate(optax.sgd(1.0), schedule)
    g = [jnp.array([float(i)]) for i in range(1, 8)]
    outs, state = updates_and_state(tx, jnp.zeros(1), g)
    applied = [i for i, o in enumerate(outs) if np.any(o)]
    assert applied == [0, 1, 4]  # windows of 1, 1, 3; two micro-batches still open
    np.testing.assert_allclose(outs[4], [-4.0])  # the mean of 3, 4 and 5
    m = gradtools.metrics(state)
    assert int(m["window_size"]) == 3 and m["window_size"].dtype == jnp.int32
    assert int(m["micro_step"]) == 2


def test_a_constant_schedule_is_bit_identical_to_the_int():
    params = {"w": jnp.asarray(W0), "b": jnp.zeros((2, 2), jnp.bfloat16)}
    grads = [
        jax.tree.map(lambda p: jnp.asarray(RNG.normal(size=p.shape), p.dtype), params)
        for _ in range(7)
    ]
    flush = [jnp.asarray(i == 4) for i in range(7)]
    fixed = gradtools.accumulate(optax.adam(1e-2), 3)
    scheduled = gradtools.accumulate(optax.adam(1e-2), lambda n: jnp.int32(3))
    ref_u, ref_state = updates_and_state(fixed, params, grads, flush=flush)
    got_u, got_state = updates_and_state(scheduled, params, grads, flush=flush)
    chex.assert_trees_all_equal(got_u, ref_u, strict=True)
    # Only the schedule needs the count of windows closed; an int keeps it at 0.
    assert (int(got_state.windows_closed), int(ref_state.windows_closed)) == (2, 0)
    chex.assert_trees_all_equal(
        got_state._replace(windows_closed=ref_state.windows_closed), ref_state, strict=True
    )
    assert int(ref_state.window_size) == 3


def test_no_retrace_when_the_scheduled_length_changes():
    tx = gradtools.accumulate(optax.adam(1e-3), lambda n: jnp.minimum(n + 1, 4))

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(params, state, g):
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    params, sizes, applied = jnp.zeros(2), [], []
    state = tx.init(params)
    for _ in range(14):
        before = params
        params, state = step(params, state, jnp.ones(2))
        sizes.append(int(gradtools.metrics(state)["window_size"]))
        applied.append(bool(np.any(params != before)))
    assert [i for i, a in enumerate(applied) if a] == [0, 2, 5, 9, 13]  # 1, 2, 3, 4, 4
    assert sizes == [2, 2, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4, 4]


def test_scheduled_windows_under_scan_equal_the_python_loop():
    tx = gradtools.accumulate(optax.sgd(0.1, momentum=0.9), ramp)
    grads = jnp.asarray(RNG.normal(size=(15, 3)), jnp.float32)
    params = jnp.asarray(W0)
    loop, state = updates_and_state(tx, params, list(grads))

    def body(state, g):
        u, state = tx.update(g, state, params)
        return state, u

    scan_state, scanned = jax.jit(lambda s: jax.lax.scan(body, s, grads))(tx.init(params))
    np.testing.assert_allclose(scanned, np.stack(loop), rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_equal_structs(scan_state, tx.init(params))
    assert int(scan_state.windows_closed) == int(state.windows_closed) == 4


@pytest.mark.parametrize("momentum", [None, 0.9])
def test_schedule_matches_optax_multisteps(momentum):
    inner = lambda: optax.sgd(0.1, momentum=momentum)  # noqa: E731
    schedule = lambda n: jnp.where(n < 3, 2, jnp.where(n < 5, 3, 5))  # noqa: E731
    ours = gradtools.accumulate(inner(), schedule)
    theirs = optax.MultiSteps(inner(), every_k_schedule=schedule).gradient_transformation()
    grads = [jnp.asarray(RNG.normal(size=3), jnp.float32) for _ in range(30)]
    params = {}
    for name, tx in (("ours", ours), ("theirs", theirs)):
        update, p = jax.jit(tx.update), jnp.asarray(W0)
        state, params[name] = tx.init(p), []
        for g in grads:
            u, state = update(g, state, p)
            p = optax.apply_updates(p, u)
            params[name].append(p)
    # optax keeps a running mean, gradtools a sum divided once: float32 rounding apart
    np.testing.assert_allclose(np.stack(params["ours"]), np.stack(params["theirs"]), rtol=1e-6)
    steps = np.stack([W0, *params["ours"]])
    changed = [i for i in range(30) if np.any(steps[i + 1] != steps[i])]
    assert changed == [1, 3, 5, 8, 11, 16, 21, 26]  # windows of 2, 2, 2, 3, 3, 5, 5, 5


@pytest.mark.parametrize(
    "schedule",
    [lambda n: 2.0, lambda n: n * 1.0 + 1, lambda n: jnp.full(2, 3), lambda n: True, lambda n: "4"],
    ids=["float", "float-array", "vector", "bool", "str"],
)
def test_a_schedule_that_gives_no_scalar_int_is_a_value_error(schedule):
    tx = gradtools.accumulate(optax.sgd(0.1), schedule)
    with pytest.raises(ValueError, match=r"every_k\(windows_closed\)"):
        tx.init(jnp.zeros(2))
