"""Loss scaling against a plain-Python reference of the rule."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import gradtools

INF = float("inf")


def reference_dynamic(pattern, init, growth_factor, backoff, interval, lo, hi):
    """The scale after each step, written straight from the rule in docs/internals.md."""
    scale, good, out = init, 0, []
    for finite in pattern:
        if finite:
            good += 1
            if good == interval:
                scale, good = min(scale * growth_factor, hi), 0
        else:
            scale, good = max(scale * backoff, lo), 0
        out.append(scale)
    return out


def run_pattern(tx, pattern, params):
    """Feeds grads of ones (or an inf on overflow steps); returns per-step state."""
    update = jax.jit(tx.update)
    state = tx.init(params)
    trajectory = []
    for finite in pattern:
        g = jax.tree.map(jnp.ones_like, params)
        if not finite:
            g["w"] = g["w"].at[0].set(INF)
        _, state = update(g, state, params)
        trajectory.append(state)
    return trajectory


PARAMS = {"w": jnp.ones(3), "b": jnp.zeros(2)}
# Growth timing, a cap hit twice, backoff to the floor and a stay there.
PATTERN = [1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize(
    "kw",
    [
        dict(
            init_scale=4.0,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=3,
            min_scale=1.0,
            max_scale=16.0,
        ),
        dict(
            init_scale=8.0,
            growth_factor=3.0,
            backoff_factor=0.25,
            growth_interval=2,
            min_scale=0.5,
            max_scale=20.0,
        ),
        dict(
            init_scale=1.0,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=1,
            min_scale=1.0,
            max_scale=4.0,
        ),
    ],
)
def test_dynamic_trajectory_matches_reference(kw):
    pattern = [bool(x) for x in PATTERN]
    tx = gradtools.dynamic_loss_scale(optax.sgd(0.1), **kw)
    got = [float(s.loss_scale) for s in run_pattern(tx, pattern, PARAMS)]
    want = reference_dynamic(
        pattern,
        kw["init_scale"],
        kw["growth_factor"],
        kw["backoff_factor"],
        kw["growth_interval"],
        kw["min_scale"],
        kw["max_scale"],
    )
    assert got == want
    # The pattern must exercise both the cap and the floor.
    assert max(want) == kw["max_scale"] and min(want) == kw["min_scale"]


def test_dynamic_counters_match_reference():
    pattern = [bool(x) for x in PATTERN]
    tx = gradtools.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0, growth_interval=3)
    states = run_pattern(tx, pattern, PARAMS)
    good, skipped = 0, 0
    for finite, s in zip(pattern, states):
        good = 0 if not finite or good + 1 == 3 else good + 1
        skipped += not finite
        assert int(s.good_steps) == good
        assert int(s.skipped_steps) == skipped
        assert bool(s.finite) == finite


def test_growth_happens_on_the_interval_th_finite_step():
    # torch.amp.GradScaler: with growth_interval=N the scale grows on the N-th clean step.
    tx = gradtools.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0, growth_interval=4)
    scales = [float(s.loss_scale) for s in run_pattern(tx, [True] * 9, PARAMS)]
    assert scales == [2.0, 2.0, 2.0, 4.0, 4.0, 4.0, 4.0, 8.0, 8.0]


@pytest.mark.parametrize("skip", [True, False])
def test_fixed_scale_never_changes(skip):
    pattern = [bool(x) for x in PATTERN]
    tx = gradtools.fixed_loss_scale(optax.sgd(0.1), 64.0, skip_nonfinite=skip)
    states = run_pattern(tx, pattern, PARAMS)
    assert [float(s.loss_scale) for s in states] == [64.0] * len(pattern)
    assert int(states[-1].skipped_steps) == pattern.count(False)


def test_fixed_skip_nonfinite_false_always_applies():
    params = {"w": jnp.ones(3)}
    g = {"w": jnp.array([64.0, INF, 128.0])}
    applied = gradtools.fixed_loss_scale(optax.sgd(1.0), 64.0, skip_nonfinite=False)
    updates, state = jax.jit(applied.update)(g, applied.init(params), params)
    np.testing.assert_array_equal(updates["w"], [-1.0, -INF, -2.0])
    assert not bool(state.finite)

    skipping = gradtools.fixed_loss_scale(optax.sgd(1.0), 64.0)
    updates, state = jax.jit(skipping.update)(g, skipping.init(params), params)
    np.testing.assert_array_equal(updates["w"], [0.0, 0.0, 0.0])
    assert int(state.skipped_steps) == 1


def test_fixed_good_steps_count_consecutive_finite_steps():
    tx = gradtools.fixed_loss_scale(optax.sgd(0.1), 8.0)
    states = run_pattern(tx, [True, True, False, True], PARAMS)
    assert [int(s.good_steps) for s in states] == [1, 2, 0, 1]


@pytest.mark.parametrize(
    "gdtype, grads, scale",
    [(jnp.float16, [2.0**-10, 3.0], 2.0**15), (jnp.bfloat16, [1.0, -5.0], 3.0)],
    ids=["f16", "bf16"],
)
def test_unscaling_happens_in_float32(gdtype, grads, scale):
    # In float16, 2**-10 / 2**15 = 2**-25 rounds to 0 or 2**-24; in bfloat16, 1/3 is 0.333984.
    tx = gradtools.fixed_loss_scale(optax.sgd(1.0), scale)
    params = {"w": jnp.zeros(2, jnp.float32)}
    g = {"w": jnp.array(grads, gdtype)}
    updates, _ = jax.jit(tx.update)(g, tx.init(params), params)
    want = -(np.asarray(g["w"], np.float64) / scale)
    assert updates["w"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(updates["w"], np.float64), want, rtol=1e-6, atol=0)


def test_unscaled_grads_reach_the_inner_optimizer():
    # sgd(1.0) returns -grads, so the update shows exactly what inner received.
    tx = gradtools.dynamic_loss_scale(optax.sgd(1.0), init_scale=1024.0)
    params = {"w": jnp.zeros(3)}
    g = {"w": jnp.array([1024.0, -2048.0, 512.0])}
    updates, _ = jax.jit(tx.update)(g, tx.init(params), params)
    np.testing.assert_array_equal(updates["w"], [-1.0, 2.0, -0.5])


def test_skipped_step_leaves_adam_and_schedule_untouched():
    schedule = optax.linear_schedule(1e-2, 1e-3, 100)
    tx = gradtools.dynamic_loss_scale(optax.adam(schedule), init_scale=2.0**10)
    params = {"w": jnp.linspace(-1.0, 1.0, 5), "b": jnp.ones(2)}
    update = jax.jit(tx.update)
    state = tx.init(params)
    for _ in range(3):  # some history, so mu/nu/count are not trivial
        g = jax.tree.map(lambda p: 1024.0 * (p + 0.5), params)
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)

    bad = {"w": jnp.full(5, jnp.nan), "b": jnp.ones(2)}
    updates, new_state = update(bad, state, params)
    new_params = optax.apply_updates(params, updates)

    for leaf in jax.tree.leaves(updates):
        np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
        assert not np.signbit(leaf).any()  # exact +0.0, not -0.0
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
    adam_state, schedule_state = new_state.inner_state[0], new_state.inner_state[-1]
    assert int(adam_state.count) == 3
    assert int(schedule_state.count) == 3
    assert float(new_state.loss_scale) == 2.0**9


def test_fp16_underflow_is_rescued_by_scaling():
    """True gradients ~1e-8 vanish in fp16 but survive with a loss scale."""
    x = jnp.linspace(1.0, 2.0, 8) * 1e-4
    c = 1e-4

    def loss_fn(params):  # fp32 master weights, fp16 compute
        w16 = params["w"].astype(jnp.float16)
        return jnp.sum(w16 * x.astype(jnp.float16)) * jnp.float16(c)

    params = {"w": jnp.ones(8)}
    true_grad = np.asarray(x, np.float64) * c  # d loss / d w, about 1e-8
    assert true_grad.max() < 2.0**-24  # below fp16's smallest subnormal

    plain = jax.grad(loss_fn)(params)["w"]
    np.testing.assert_array_equal(plain, np.zeros(8))

    tx = gradtools.dynamic_loss_scale(optax.sgd(1.0))
    state = tx.init(params)
    scaled = jax.grad(lambda p: gradtools.scale_loss(loss_fn(p), state))(params)
    updates, state = jax.jit(tx.update)(scaled, state, params)
    assert bool(state.finite)
    np.testing.assert_allclose(-updates["w"], true_grad, rtol=1e-2)


def test_updates_keep_param_dtypes_with_none_leaves():
    params = {
        "f32": jnp.ones(3, jnp.float32),
        "bf16": jnp.ones(3, jnp.bfloat16),
        "f16": jnp.ones(3, jnp.float16),
        "none": None,
        "empty": {},
    }
    grads = jax.tree.map(lambda p: jnp.full_like(p, 8.0), params)
    tx = gradtools.dynamic_loss_scale(optax.sgd(0.5), init_scale=8.0)
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert updates["none"] is None and updates["empty"] == {}
    for k in ("f32", "bf16", "f16"):
        assert updates[k].dtype == params[k].dtype
        np.testing.assert_array_equal(np.asarray(updates[k], np.float32), [-0.5] * 3)

    # Without params the unscaled grads stay float32.
    updates, _ = jax.jit(lambda g, s: tx.update(g, s))(grads, state)
    assert all(u.dtype == jnp.float32 for u in jax.tree.leaves(updates))


def test_state_structure_and_dtypes_survive_scan():
    # eps=1e-3: Adam's default 1e-8 is 0 in float16, where its steps would write inf
    tx = gradtools.dynamic_loss_scale(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3, eps=1e-3)), growth_interval=2
    )
    params = {"w": jnp.ones(4, jnp.float16), "v": jnp.ones(2)}
    state = tx.init(params)
    pattern = jnp.array([True, False, True, True, True, False])

    def body(carry, finite):
        params, state = carry
        g = jax.tree.map(lambda p: jnp.full_like(p, jnp.where(finite, 1.0, jnp.inf)), params)
        updates, state = tx.update(g, state, params)
        return (optax.apply_updates(params, updates), state), state.loss_scale

    (_, final), scales = jax.jit(lambda c: jax.lax.scan(body, c, pattern))((params, state))
    assert jax.tree.structure(final) == jax.tree.structure(state)
    assert jax.tree.map(lambda a: a.dtype, final) == jax.tree.map(lambda a: a.dtype, state)
    want = reference_dynamic([bool(f) for f in pattern], 2.0**15, 2.0, 0.5, 2, 1.0, 2.0**24)
    np.testing.assert_array_equal(scales, want)
    assert int(final.inner_state[1][0].count) == int(pattern.sum())


def test_no_recompilation_on_second_step():
    tx = gradtools.dynamic_loss_scale(optax.adam(1e-3))
    params = {"w": jnp.ones(3)}

    @jax.jit
    @chex.assert_max_traces(n=1)
    def update(g, state):
        return tx.update(g, state, params)

    state = tx.init(params)
    for value in (1.0, INF, 2.0):
        _, state = update({"w": jnp.full(3, value)}, state)
    assert int(state.skipped_steps) == 1


def counting_sgd(calls):
    """SGD(0.5) that records every trace of its update in ``calls``."""

    def update(g, state, params=None):
        calls.append(1)
        return jax.tree.map(lambda x: -0.5 * x, g), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


@pytest.mark.parametrize(
    "wrap",
    [
        gradtools.dynamic_loss_scale,
        gradtools.fixed_loss_scale,
        lambda inner: gradtools.accumulate(inner, 1, on_nonfinite="skip_microstep"),
        lambda inner: gradtools.accumulate(inner, 2, on_nonfinite="skip_microstep"),
    ],
    ids=["dynamic", "fixed", "accumulate_k1", "accumulate_k2"],
)
@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
def test_inner_optimizer_is_traced_once_per_step(wrap, fused):
    """The branch that runs no optimizer takes its zeros' shapes from the one trace of it."""
    calls = []
    tx = wrap(counting_sgd(calls))
    params = {"w": jnp.ones(3), "h": jnp.ones(2, jnp.bfloat16)}
    state = tx.init(params)
    if fused:
        step = jax.jit(lambda g, s: gradtools.apply_gradients(tx, g, s, params))
    else:
        step = jax.jit(lambda g, s: tx.update(g, s, params))
    out, _ = step(jax.tree.map(lambda p: jnp.full(p.shape, jnp.inf, p.dtype), params), state)
    assert len(calls) == 1
    want = params if fused else jax.tree.map(jnp.zeros_like, params)
    chex.assert_trees_all_equal(out, want, strict=True)


def test_skipped_step_op_by_op_gives_what_jit_gives():
    """Under ``jax.disable_jit`` only the skip branch runs; its zeros still match."""
    tx = gradtools.dynamic_loss_scale(optax.adam(0.1), init_scale=4.0)
    params = {"w": jnp.ones(3), "h": jnp.ones(2, jnp.bfloat16), "n": None}
    state = tx.init(params)
    grads = {"w": jnp.array([1.0, INF, 2.0]), "h": jnp.ones(2, jnp.bfloat16), "n": None}
    want = jax.jit(tx.update)(grads, state, params)
    with jax.disable_jit():
        got = tx.update(grads, state, params)
    chex.assert_trees_all_equal(got, want, strict=True)
    chex.assert_trees_all_equal(
        got[0], {"w": jnp.zeros(3), "h": jnp.zeros(2, jnp.bfloat16), "n": None}
    )


def test_inside_chain_and_inject_hyperparams():
    inner = optax.inject_hyperparams(gradtools.dynamic_loss_scale)(
        optax.sgd(1.0), init_scale=8.0, growth_interval=2, backoff_factor=0.5
    )
    tx = optax.chain(optax.identity(), inner)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    scales = []
    for finite in (True, True, False, True):
        g = {"w": jnp.array([8.0, 8.0 if finite else INF])}
        _, state = update(g, state, params)
        scales.append(float(gradtools.loss_scale(state)))
    assert scales == reference_dynamic([1, 1, 0, 1], 8.0, 2.0, 0.5, 2, 1.0, 2.0**24)

    # A hyperparameter changed in the state takes effect without rebuilding.
    state[1].hyperparams["backoff_factor"] = jnp.float32(0.25)
    _, state = update({"w": jnp.array([INF, 0.0])}, state, params)
    assert float(gradtools.loss_scale(state)) == 8.0 * 0.25


def test_scale_loss_finds_state_at_any_depth():
    ls = gradtools.fixed_loss_scale(optax.adam(1e-3), 256.0)
    tx = optax.chain(optax.identity(), optax.chain(optax.scale(1.0), ls))
    state = {"outer": (tx.init({"w": jnp.zeros(2)}),)}
    assert float(gradtools.scale_loss(jnp.float32(0.5), state)) == 128.0
    assert float(gradtools.loss_scale(state)) == 256.0
    m = gradtools.metrics(state)
    assert float(m["loss_scale"]) == 256.0
    assert int(m["skipped_steps"]) == 0 and bool(m["finite"])
    # Under jit, scaling keeps the loss dtype.
    out = jax.jit(gradtools.scale_loss)(jnp.float16(0.5), state)
    assert out.dtype == jnp.float16 and float(out) == 128.0


def test_nnx_optimizer_state_reads_as_arrays():
    """flax.nnx.Optimizer keeps each state leaf in a Variable; metrics give plain arrays."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(3, jnp.bfloat16))

    model = Model()
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    opt = nnx.Optimizer(model, gradtools.dynamic_loss_scale(inner, init_scale=4.0), wrt=nnx.Param)
    grads = nnx.State({"w": nnx.Param(jnp.full(3, 4.0, jnp.bfloat16))})  # 1.0 unscaled
    opt.update(model, grads)
    assert isinstance(gradtools.loss_scale(opt.opt_state), jax.Array)
    m = gradtools.metrics(opt.opt_state)
    assert all(isinstance(v, jax.Array) for v in m.values()), m
    assert (float(m["loss_scale"]), int(m["skipped_steps"]), bool(m["finite"])) == (4.0, 0, True)
    # optax keeps the rate in the params' dtype (bfloat16); metrics report float32
    assert m["learning_rate"].dtype == jnp.float32
    assert float(m["learning_rate"]) == float(jnp.bfloat16(0.1))
    np.testing.assert_array_equal(np.asarray(model.w[...], np.float32), [0.8984375] * 3)


def test_injected_fixed_scale_takes_effect_from_the_next_step():
    tx = optax.inject_hyperparams(gradtools.fixed_loss_scale)(optax.sgd(1.0), scale=4.0)
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    u, state = update({"w": jnp.full(2, 4.0)}, state, params)  # scaled by 4: 1.0 each
    np.testing.assert_array_equal(u["w"], [-1.0, -1.0])
    state.hyperparams["scale"] = jnp.float32(16.0)
    u, state = update({"w": jnp.full(2, 8.0)}, state, params)  # still scaled by the old 4
    np.testing.assert_array_equal(u["w"], [-2.0, -2.0])
    assert float(gradtools.loss_scale(state)) == 16.0  # what scale_loss uses next
    u, state = update({"w": jnp.full(2, 16.0)}, state, params)
    np.testing.assert_array_equal(u["w"], [-1.0, -1.0])


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.inject_hyperparams(gradtools.dynamic_loss_scale)(
            optax.sgd(0.1), init_scale=8.0
        ),
        lambda: optax.inject_hyperparams(gradtools.fixed_loss_scale)(optax.sgd(0.1), scale=8.0),
        lambda: gradtools.dynamic_loss_scale(optax.sgd(0.1), init_scale=jnp.float32(8.0)),
    ],
    ids=["inject(dynamic)", "inject(fixed)", "array init_scale"],
)
def test_state_can_be_donated_when_the_scale_is_an_array(make):
    """The documented ``jit(step, donate_argnums=(0, 1))`` with an array scale.

    XLA refuses to donate one buffer twice, and a donated hyperparameter would
    be deleted under the transform that still holds it.
    """
    tx = make()
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    leaves = jax.tree.leaves(state)
    assert len({id(x) for x in leaves}) == len(leaves)  # no buffer appears twice
    step = jax.jit(gradtools.train_step(lambda p: jnp.sum(p["w"] ** 2), tx), donate_argnums=(0, 1))
    p, s = jax.tree.map(jnp.copy, params), state
    for _ in range(3):
        p, s, _ = step(p, s)
    np.testing.assert_allclose(p["w"], 0.8**3, rtol=1e-6)  # sgd: w <- w - 0.1 * 2w
    assert float(gradtools.loss_scale(tx.init(params))) == 8.0  # the transform still works


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # optax's cast
def test_inject_hyperparams_with_float16_params_says_to_keep_them_float32():
    params = {"w": jnp.ones(2, jnp.float16)}
    injected = optax.inject_hyperparams(gradtools.dynamic_loss_scale)
    # optax casts every float hyperparameter to the params' dtype: 2**24 is inf in float16
    assert float(jnp.finfo(jnp.float16).max) < 2.0**24
    with pytest.raises(ValueError, match=r"max_scale=.*hyperparam_dtype=jnp.float32"):
        injected(optax.sgd(1.0)).init(params)
    tx = optax.inject_hyperparams(gradtools.dynamic_loss_scale, hyperparam_dtype=jnp.float32)(
        optax.sgd(1.0), init_scale=4.0
    )
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.full(2, 4.0, jnp.float16)}, state, params)
    np.testing.assert_array_equal(updates["w"], [-1.0, -1.0])  # unscaled by 4
    assert state.hyperparams["max_scale"].dtype == jnp.float32


def test_missing_state_says_what_to_do():
    state = optax.adam(1e-3).init({"w": jnp.zeros(2)})
    for fn in (lambda: gradtools.scale_loss(1.0, state), lambda: gradtools.loss_scale(state)):
        with pytest.raises(ValueError, match=r"dynamic_loss_scale\(optax.adam"):
            fn()
    assert gradtools.metrics(state) == {}


def test_two_scalers_are_ambiguous():
    a = gradtools.fixed_loss_scale(optax.sgd(1.0))
    state = (a.init({"w": jnp.zeros(1)}), a.init({"w": jnp.zeros(1)}))
    with pytest.raises(ValueError, match="several LossScaleStates"):
        gradtools.loss_scale(state)


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(init_scale=0.0), "init_scale"),
        (dict(init_scale=-4.0), "init_scale"),
        (dict(init_scale=INF), "init_scale"),
        (dict(init_scale=float("nan")), "init_scale"),
        (dict(init_scale="big"), "init_scale"),
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(growth_factor=0.5), "growth_factor"),
        (dict(growth_factor=INF), "growth_factor"),
        (dict(backoff_factor=0.0), "backoff_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(backoff_factor=1.5), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(growth_interval=2.5), "growth_interval"),
        (dict(growth_interval=100.0), "growth_interval"),
        (dict(growth_interval=True), "growth_interval"),
        (dict(min_scale=0.0), "min_scale"),
        (dict(min_scale=2.0**16), "min_scale"),
        (dict(max_scale=2.0**14), "max_scale"),
        (dict(max_scale=INF), "max_scale"),
    ],
)
def test_dynamic_rejects_bad_hyperparameters(kw, name):
    with pytest.raises(ValueError, match=name):
        gradtools.dynamic_loss_scale(optax.sgd(0.1), **kw)


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(scale=0.0), "scale"),
        (dict(scale=-1.0), "scale"),
        (dict(scale=INF), "scale"),
        (dict(skip_nonfinite="yes"), "skip_nonfinite"),
    ],
)
def test_fixed_rejects_bad_hyperparameters(kw, name):
    with pytest.raises(ValueError, match=name):
        gradtools.fixed_loss_scale(optax.sgd(0.1), **kw)


def test_inner_must_be_a_transformation():
    with pytest.raises(TypeError, match="inner"):
        gradtools.dynamic_loss_scale(optax.sgd)
    with pytest.raises(TypeError, match="inner"):
        gradtools.fixed_loss_scale(lambda g: g)


def _np_clip(u, max_norm):
    """optax's rule on float32 sums of squares: an overflowing norm is inf and scales by 0."""
    squares = sum(float(np.sum(np.square(x, dtype=np.float64))) for x in u.values())
    norm = math.inf if squares > float(np.finfo(np.float32).max) else math.sqrt(squares)
    factor = max_norm / norm if norm > max_norm else 1.0
    clipped = {k: (x.astype(np.float32) * np.float32(factor)).astype(x.dtype) for k, x in u.items()}
    return clipped, norm


@pytest.mark.parametrize("clip", [False, True], ids=["sgd", "clip+sgd"])
@pytest.mark.parametrize("value", [INF, -INF, float("nan"), 1e30, -3.0])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_skip_is_decided_on_the_unscaled_grads_as_numpy_does(dtype, value, clip):
    """One element of one leaf set to ``value``: inf and NaN skip, big finite values do not.

    1e30 is finite in float32 and bfloat16 but its square is not: the step is
    applied, and a clip inside sees an inf norm and scales the updates by 0.
    In float16 1e30 is inf already.
    """
    scale, max_norm = 4.0, 1.0
    params = {"a": jnp.zeros(6, dtype), "b": jnp.zeros((2, 3), jnp.float32)}
    grads = {"a": np.full(6, 2.0, np.float32), "b": np.arange(6.0, dtype=np.float32).reshape(2, 3)}
    grads["a"][4] = value
    grads = {k: jnp.asarray(g).astype(params[k].dtype) for k, g in grads.items()}  # 1e30: fp16 inf
    inner = optax.sgd(1.0)
    if clip:
        inner = optax.chain(gradtools.clip_by_global_norm(max_norm), inner)
    tx = gradtools.dynamic_loss_scale(inner, init_scale=scale)
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)

    u = {k: (np.asarray(g, np.float32) / scale).astype(params[k].dtype) for k, g in grads.items()}
    finite = all(np.isfinite(x.astype(np.float32)).all() for x in u.values())
    assert bool(state.finite) is finite
    assert int(state.skipped_steps) == (not finite)
    if not finite:
        for leaf in jax.tree.leaves(updates):
            np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
        return
    if clip:
        u, norm = _np_clip(u, max_norm)
        got = float(gradtools.metrics(state)["grad_norm"])
        assert got == pytest.approx(norm, rel=1e-6) if math.isfinite(norm) else got == norm
    for k, x in u.items():
        np.testing.assert_allclose(np.asarray(updates[k], np.float32), -x.astype(np.float32), 1e-6)
        assert updates[k].dtype == params[k].dtype


def test_loss_scaled_clip_reads_each_gradient_once(array_reductions):
    """The scaler's finiteness pass also sums the squares that a clip right inside it needs.

    Behind another transform the clip receives other arrays and reads them itself; behind
    ``group_norms``, which returns its updates unchanged, it takes the sums too.
    (float32 params: with half-precision ones the scaler also checks what it writes.)
    """
    params = {
        "w": jax.ShapeDtypeStruct((4096,), jnp.float32),
        "v": jax.ShapeDtypeStruct((64, 64), jnp.float32),
    }

    def reductions(*inner):
        tx = gradtools.dynamic_loss_scale(optax.chain(*inner, optax.adam(1e-3)))
        state = jax.eval_shape(tx.init, params)

        def step(p, s, g):
            return gradtools.apply_gradients(tx, g, s, p)

        return array_reductions(step, params, state, params, min_size=1024)

    assert reductions() == 2
    assert reductions(gradtools.clip_by_global_norm(1.0)) == 2
    assert reductions(optax.scale(0.5), gradtools.clip_by_global_norm(1.0)) == 4
    # group_norms returns the updates it was given, so the clip after it gets them too
    norms = gradtools.group_norms([(r"w", "w")])
    assert reductions(norms, gradtools.clip_by_global_norm(1.0)) == 2
    # the GPT demo's shape: the guard after the norms takes the sums, as it does alone (its
    # clip recomputes them in the branch of a spike only)
    guarded = gradtools.spike_guard(optax.chain(gradtools.clip_by_global_norm(1.0), optax.sgd(1.0)))
    assert reductions(norms, guarded) == reductions(guarded) == 4
    # into a nested chain too; behind a transformation that changes the updates, not
    assert reductions(norms, optax.chain(gradtools.clip_by_global_norm(1.0))) == 2
    nested = optax.chain(optax.scale(0.5), gradtools.clip_by_global_norm(1.0))
    assert reductions(norms, nested) == 4


def test_all_finite():
    assert bool(gradtools.all_finite({"a": jnp.ones(3), "b": None, "c": {}}))
    assert bool(gradtools.all_finite({}))
    assert not bool(gradtools.all_finite([jnp.ones(2), jnp.array([1.0, jnp.nan])]))
    assert not bool(gradtools.all_finite(jnp.array([jnp.inf], jnp.float16)))


@pytest.mark.parametrize(
    "x",
    [np.full(4, 60000.0, np.float16), np.array([3e38, 3e38], np.float32)],
    ids=["f16-sum-past-65504", "f32-sum-past-max"],
)
def test_all_finite_is_true_for_large_finite_values_whose_sum_overflows(x):
    with np.errstate(over="ignore"):
        assert np.isinf(x.sum(dtype=x.dtype))  # a plain sum would call them non-finite
    assert bool(gradtools.all_finite({"g": jnp.asarray(x)}))
    assert bool(jax.jit(gradtools.all_finite)({"g": jnp.asarray(x)}))


@pytest.mark.parametrize("bad", [None, 0, 31, 32, 555, 1099])
def test_all_finite_of_1100_leaves_finds_any_nonfinite_leaf(bad, widest_stack):
    tree = [jnp.full(3, float(i), jnp.float32) for i in range(1100)]
    if bad is not None:
        tree[bad] = tree[bad].at[1].set(jnp.nan if bad % 2 else jnp.inf)
    expected = all(np.isfinite(np.asarray(x)).all() for x in tree)
    assert bool(jax.jit(gradtools.all_finite)(tree)) is expected
    assert 2 <= widest_stack(gradtools.all_finite, tree) <= 32


@pytest.mark.four_devices
@pytest.mark.parametrize("axis_name", ["d", None])
def test_axis_name_makes_every_device_skip(axis_name):
    """Device 2 alone overflows; with axis_name all four skip and back off."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    tx = gradtools.dynamic_loss_scale(optax.sgd(1.0), init_scale=4.0, axis_name=axis_name)
    params = jnp.zeros(3)
    state = tx.init(params)
    grads = jnp.ones((4, 3)).at[2, 0].set(INF)

    def per_device(g, state):
        updates, state = tx.update(g[0], state, params)
        return updates[None], state.loss_scale[None], state.skipped_steps[None]

    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d")))
    updates, scales, skipped = f(grads, state)
    if axis_name is None:  # the failure mode axis_name exists for: replicas diverge
        assert list(skipped) == [0, 0, 1, 0]
        return
    np.testing.assert_array_equal(updates, np.zeros((4, 3)))
    assert list(scales) == [2.0] * 4
    assert list(skipped) == [1] * 4


def test_the_dynamic_scale_rule_alone_follows_the_reference():
    """The rule as a unit (as jmp tests ``adjust``), without the optimizer around it."""
    from gradtools.loss_scale import _dynamic_scale_rule

    kw = dict(
        growth_factor=2.0, backoff_factor=0.5, growth_interval=3, min_scale=1.0, max_scale=16.0
    )
    rule = jax.jit(lambda s, g, f: _dynamic_scale_rule(s, g, f, **kw))
    scale, good, got = jnp.float32(4.0), jnp.int32(0), []
    for finite in PATTERN:
        scale, good = rule(scale, good, jnp.bool_(finite))
        got.append(float(scale))
    assert got == reference_dynamic(PATTERN, 4.0, 2.0, 0.5, 3, 1.0, 16.0)


def test_the_fixed_scale_rule_keeps_the_scale_and_counts_finite_steps_in_a_row():
    from gradtools.loss_scale import _fixed_scale_rule

    good, counts = jnp.int32(0), []
    for finite in PATTERN:
        scale, good = _fixed_scale_rule(8.0, good, jnp.bool_(finite))
        assert float(scale) == 8.0
        counts.append(int(good))
    want, run = [], 0
    for finite in PATTERN:
        run = run + 1 if finite else 0
        want.append(run)
    assert counts == want
