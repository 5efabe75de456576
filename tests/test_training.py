"""Tests of gradtools.train_step against hand-computed steps."""

import flax.training.train_state as train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradtools


def _quadratic(params, x, y):
    """Least squares: 0.5 * mean((x @ w + b - y)**2)."""
    residual = x @ params["w"] + params["b"] - y
    return 0.5 * jnp.mean(residual**2)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 3)).astype(np.float32)
    y = rng.normal(size=(8,)).astype(np.float32)
    return x, y


def _numpy_sgd(params, x, y, lr, steps):
    """The same least-squares steps, gradients by hand."""
    w, b = np.array(params["w"], np.float64), float(params["b"])
    losses = []
    for _ in range(steps):
        residual = x @ w + b - y
        losses.append(0.5 * np.mean(residual**2))
        w = w - lr * x.T @ residual / len(y)
        b = b - lr * np.mean(residual)
    return {"w": w, "b": b}, losses


def _assert_close(actual, desired):
    """Equal up to 2 ulps of the dtype (XLA may fuse a multiply-add differently), NaN == NaN."""
    actual, desired = np.asarray(actual), np.asarray(desired)
    assert actual.dtype == desired.dtype
    if not jnp.issubdtype(actual.dtype, jnp.floating):
        np.testing.assert_array_equal(actual, desired)
        return
    eps = float(jnp.finfo(actual.dtype).eps)
    np.testing.assert_allclose(
        actual.astype(np.float64), desired.astype(np.float64), rtol=2 * eps, atol=0, equal_nan=True
    )


@pytest.mark.parametrize("scaler", [None, "fixed", "dynamic"])
def test_steps_match_numpy_sgd(scaler):
    x, y = _data()
    tx = optax.sgd(0.1)
    if scaler == "fixed":
        tx = gradtools.fixed_loss_scale(tx, 2.0**10)
    elif scaler == "dynamic":
        tx = gradtools.dynamic_loss_scale(tx)
    params = {"w": jnp.array([0.5, -0.25, 1.0]), "b": jnp.array(0.1)}
    expected, losses = _numpy_sgd(params, x, y, 0.1, 3)
    step = jax.jit(gradtools.train_step(_quadratic, tx), donate_argnums=(0, 1))
    state = tx.init(params)
    for loss in losses:
        params, state, m = step(params, state, x, y)
        np.testing.assert_allclose(m["loss"], loss, rtol=1e-5)  # unscaled
    np.testing.assert_allclose(params["w"], expected["w"], rtol=1e-5)
    np.testing.assert_allclose(params["b"], expected["b"], rtol=1e-5)
    if scaler is None:
        assert set(m) == {"loss"}
    else:
        assert set(m) == {
            "loss",
            "loss_scale",
            "skipped_steps",
            "finite",
            "nonfinite_updates",
            "nonfinite_leaf_count",
        }
        assert float(m["loss_scale"]) == (2.0**10 if scaler == "fixed" else 2.0**15)


def test_scaling_rescues_fp16_gradients_that_underflow():
    # d loss / dp = 2**-13 * 2**-13 = 2**-26, below fp16's smallest subnormal
    # (2**-24): it is zero unless the loss is scaled first.
    def loss_fn(p):
        h = (p.astype(jnp.float16) * jnp.float16(2.0**-13)) * jnp.float16(2.0**-13)
        return jnp.sum(h)

    params = jnp.ones(2, jnp.float32)
    plain = optax.sgd(1.0)
    scaled = gradtools.fixed_loss_scale(optax.sgd(1.0), 2.0**15)
    p_plain, _, _ = jax.jit(gradtools.train_step(loss_fn, plain))(params, plain.init(params))
    p_scaled, _, _ = jax.jit(gradtools.train_step(loss_fn, scaled))(params, scaled.init(params))
    np.testing.assert_array_equal(p_plain, params)
    np.testing.assert_array_equal(p_scaled, params - 2.0**-26)


def test_nonfinite_step_is_skipped_and_loss_reported():
    tx = gradtools.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0)
    step = jax.jit(gradtools.train_step(lambda p, c: jnp.sum(p * c), tx))
    params = jnp.ones(2)
    state = tx.init(params)
    params, state, m = step(params, state, jnp.array([1.0, jnp.inf]))
    np.testing.assert_array_equal(params, [1.0, 1.0])
    assert float(m["loss"]) == np.inf
    assert (int(m["skipped_steps"]), bool(m["finite"]), float(m["loss_scale"])) == (1, False, 2.0)
    params, state, m = step(params, state, jnp.array([1.0, 2.0]))
    np.testing.assert_allclose(params, [0.9, 0.8])
    assert float(m["loss"]) == 3.0


def test_args_kwargs_and_aux_reach_loss_fn():
    def loss_fn(p, x, *, offset):
        loss = jnp.sum((p - x - offset) ** 2)
        return loss, {"residual": p - x - offset}

    tx = optax.sgd(0.25)
    step = jax.jit(gradtools.train_step(loss_fn, tx, has_aux=True))
    params = jnp.array([3.0, 4.0])
    params, _, m = step(params, tx.init(params), jnp.array([1.0, 1.0]), offset=1.0)
    # residual r = p - 2 = (1, 2); grad = 2r; p - 0.25 * 2r = p - r / 2
    np.testing.assert_allclose(m["aux"]["residual"], [1.0, 2.0])
    np.testing.assert_allclose(m["loss"], 5.0)
    np.testing.assert_allclose(params, [2.5, 3.0])


def _scale_by_factor():
    """Multiplies the updates by its extra argument ``factor``, ignoring others (optax's rule)."""

    def update(updates, state, params=None, *, factor, **extra_args):
        del params, extra_args
        return jax.tree.map(lambda u: u * factor, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def test_update_kwargs_reach_tx_without_retracing():
    traces = []

    def loss_fn(p):
        traces.append(None)
        return jnp.sum(p)

    tx = optax.chain(_scale_by_factor(), optax.sgd(1.0))
    step = jax.jit(gradtools.train_step(loss_fn, tx), donate_argnums=(0, 1))
    params = jnp.zeros(2)
    state = tx.init(params)
    for factor in (1.0, 3.0, 0.5):  # an array argument: traced, one compilation
        params, state, _ = step(params, state, update_kwargs={"factor": np.float32(factor)})
    np.testing.assert_array_equal(params, [-4.5, -4.5])
    assert len(traces) == 1


def test_update_kwargs_for_plain_transform_is_an_error():
    def loss_fn(p):
        return jnp.sum(p)

    tx = optax.scale(-1.0)  # a plain GradientTransformation: no extra arguments
    step = gradtools.train_step(loss_fn, tx)
    with pytest.raises(TypeError, match="flush"), pytest.warns(UserWarning, match="flush"):
        step(jnp.zeros(2), tx.init(jnp.zeros(2)), update_kwargs={"flush": True})


def _counting(name):
    """A transformation of the user's own that counts how often it got keyword ``name``."""

    def update_fn(updates, state, params=None, **extra):
        del params
        return updates, state + (name in extra)

    return optax.GradientTransformationExtraArgs(lambda p: jnp.zeros([], jnp.int32), update_fn)


@pytest.mark.parametrize(
    "tx, update_kwargs, warning",
    [
        (gradtools.accumulate(optax.sgd(1.0), 2), {"flsh": True}, "did you mean flush="),
        (gradtools.accumulate(optax.sgd(1.0), 2), {"wieght": 2.0}, "did you mean weight="),
        (optax.sgd(1.0), {"flush": True}, "flush= goes nowhere.*gradtools.accumulate"),
        (gradtools.dynamic_loss_scale(optax.sgd(1.0)), {"weight": 2.0}, "weight= goes nowhere"),
    ],
    ids=["typo-flush", "typo-weight", "flush-no-accumulate", "weight-no-accumulate"],
)
def test_update_keywords_that_go_nowhere_are_warned_of(tx, update_kwargs, warning):
    tx = optax.chain(tx, _counting("nothing"))
    step = gradtools.train_step(jnp.sum, tx)
    params = jnp.ones(2)
    with pytest.warns(UserWarning, match=warning):
        step(params, tx.init(params), update_kwargs=update_kwargs)
    with pytest.warns(UserWarning, match=warning):
        gradtools.apply_gradients(tx, params, tx.init(params), params, **update_kwargs)


def test_a_keyword_for_the_users_own_transformation_passes_without_a_warning():
    tx = optax.chain(gradtools.accumulate(optax.sgd(1.0), 1), _counting("temperature"))
    step = jax.jit(gradtools.train_step(jnp.sum, tx))
    params = jnp.ones(2)
    _, state, _ = step(params, tx.init(params), update_kwargs={"temperature": 0.5})  # no warning
    assert int(state[1]) == 1


def test_flax_nnx_optimizer_given_update_kwargs_says_to_pass_keywords():
    """flax's own nnx.Optimizer hands update_kwargs to tx.update as one keyword."""
    from flax import nnx

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    tx = optax.chain(optax.clip(1.0), gradtools.accumulate(optax.sgd(1.0), 4))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    with pytest.raises(TypeError, match=r"optimizer.update\(model, grads, flush=True\)"):
        optimizer.update(model, grads, update_kwargs={"flush": True})
    kernel = np.asarray(model.kernel[...])
    optimizer.update(model, grads, flush=True)  # flax's way: the window of one closes
    np.testing.assert_allclose(model.kernel[...], kernel - 1.0)


@pytest.mark.parametrize("wrap", [lambda t: t, gradtools.dynamic_loss_scale], ids=["adam", "dls"])
def test_a_state_built_for_other_params_names_the_leaf_and_both_shapes(wrap):
    tx = wrap(optax.adam(1e-3))
    state = tx.init({"w": jnp.zeros(128), "b": jnp.zeros(3)})
    params = {"w": jnp.zeros(256), "b": jnp.zeros(3)}
    step = jax.jit(gradtools.train_step(lambda p: jnp.sum(p["w"] ** 2) + jnp.sum(p["b"]), tx))
    message = r"mu\['w'\]: shape \(128,\), where tx.init\(params\) gives \(256,\) \(params\['w'\]\)"
    with pytest.raises(ValueError, match=message):
        step(params, state)
    ts = gradtools.TrainState.create(apply_fn=None, params=params, tx=tx)
    with pytest.raises(ValueError, match=message):
        ts.replace(opt_state=state).apply_gradients(grads=params)


def test_a_plain_transform_gets_no_value_and_still_steps():
    tx = optax.scale(-0.5)  # update(updates, state, params): no extra arguments
    params, _, m = gradtools.train_step(lambda p: jnp.sum(p**2), tx)(
        jnp.array([1.0, -2.0]), tx.init(jnp.zeros(2))
    )
    np.testing.assert_array_equal(params, [0.0, 0.0])  # p - 0.5 * 2p
    assert float(m["loss"]) == 5.0


def test_an_update_that_refuses_value_is_told_to_take_extra_args(scale_by_factor):
    tx = optax.chain(scale_by_factor, optax.sgd(1.0))  # update(..., *, factor): no **extra_args
    step = gradtools.train_step(lambda p: jnp.sum(p), tx)
    with pytest.raises(TypeError, match=r"'value'.*loss as value=.*add \*\*extra_args to it"):
        step(jnp.zeros(2), tx.init(jnp.zeros(2)), update_kwargs={"factor": 2.0})
    # with a value of its own, the error is the update's own
    with pytest.raises(TypeError, match=r"'value'$"):
        step(jnp.zeros(2), tx.init(jnp.zeros(2)), update_kwargs={"factor": 2.0, "value": 1.0})


def test_a_tuple_loss_without_has_aux_says_to_pass_has_aux():
    def loss_fn(p):
        return jnp.sum(p**2), {"norm": jnp.linalg.norm(p)}

    for tx in (optax.sgd(0.1), gradtools.dynamic_loss_scale(optax.sgd(0.1))):
        step = jax.jit(gradtools.train_step(loss_fn, tx))
        with pytest.raises(TypeError) as err:
            step(jnp.ones(2), tx.init(jnp.ones(2)))
        assert str(err.value) == (
            "train_step: loss_fn returned a tuple of 2, not a scalar loss; if it returns"
            " (loss, aux), build the step with train_step(loss_fn, tx, has_aux=True)"
        )


def test_has_aux_with_a_bare_loss_says_what_it_needs():
    step = gradtools.train_step(lambda p: jnp.sum(p), optax.sgd(0.1), has_aux=True)
    with pytest.raises(TypeError, match=r"has_aux=True, loss_fn must return a pair \(loss, aux\)"):
        step(jnp.ones(2), optax.sgd(0.1).init(jnp.ones(2)))


def _plateau(lr=2.0):
    # sgd(2.0) on 0.5 * sum((w * x)**2) with x = 1 maps w to -w: the loss stays
    # flat until reduce_on_plateau halves the step to 1.0, which lands on 0.
    return optax.chain(
        optax.sgd(lr), optax.contrib.reduce_on_plateau(factor=0.5, patience=2, cooldown=0)
    )


def _plateau_loss(w, x):
    return 0.5 * jnp.sum((w * x) ** 2)


def test_reduce_on_plateau_inside_a_loss_scaler_gets_the_loss_as_value():
    xs = [1.0, 1.0, np.inf, 1.0, 1.0]  # the third step overflows and is skipped
    tx = gradtools.dynamic_loss_scale(_plateau(), init_scale=8.0)
    step = jax.jit(gradtools.train_step(_plateau_loss, tx))
    w = jnp.array([1.0, -2.0])
    state = tx.init(w)
    ref_tx = _plateau()  # the same optimizer driven by hand, skipping the overflow
    ref_w, ref_state = w, ref_tx.init(w)
    ref_update = jax.jit(ref_tx.update)
    for x in xs:
        x = jnp.float32(x)
        w, state, m = step(w, state, x)
        loss, grads = jax.value_and_grad(_plateau_loss)(ref_w, x)
        if np.isfinite(x):
            updates, ref_state = ref_update(grads, ref_state, ref_w, value=loss)
            ref_w = optax.apply_updates(ref_w, updates)
        np.testing.assert_array_equal(w, ref_w)
        jax.tree.map(np.testing.assert_array_equal, state.inner_state, ref_state)
    assert int(m["skipped_steps"]) == 1
    # losses 2.5 (the best), 2.5, skipped, 2.5 (the second flat one: the rate
    # halves and w lands on 0), 0.0
    assert float(ref_state[1].scale) == 0.5 and float(ref_state[1].best_value) == 0.0
    np.testing.assert_array_equal(w, [0.0, 0.0])


def test_update_kwargs_value_wins_over_the_loss():
    tx = _plateau()
    step = jax.jit(gradtools.train_step(_plateau_loss, tx))
    w, state = jnp.array([1.0, -2.0]), tx.init(jnp.zeros(2))
    values = [3.0, 2.0, 1.0, 0.5]  # improving: the rate is never cut
    for v in values:
        w, state, _ = step(w, state, jnp.float32(1.0), update_kwargs={"value": jnp.float32(v)})
    assert float(state[1].scale) == 1.0
    np.testing.assert_array_equal(w, [1.0, -2.0])  # w -> -w four times


@pytest.mark.parametrize(
    "make",
    [
        lambda: gradtools.dynamic_loss_scale(optax.adam(0.1), init_scale=4.0),
        lambda: gradtools.accumulate(optax.adam(0.1), 2),
        lambda: gradtools.fixed_loss_scale(gradtools.clip_by_global_norm(1.0)),
    ],
    ids=["dynamic_loss_scale(adam)", "accumulate(adam)", "fixed_loss_scale(clip)"],
)
def test_the_value_is_dropped_by_optimizers_that_take_none(make):
    """The wrappers hand value= to an inner update that does not take it: nothing changes."""
    tx = make()
    step = jax.jit(gradtools.train_step(_plateau_loss, tx))
    w, state = jnp.array([1.0, -2.0]), tx.init(jnp.zeros(2))
    ref_w, ref_state = w, tx.init(jnp.zeros(2))
    for x in (1.0, 2.0, 0.5, 1.5):
        x = jnp.float32(x)
        w, state, _ = step(w, state, x)
        grads = jax.grad(_plateau_loss)(ref_w, x)
        if optax.tree.get_all_with_path(ref_state, "LossScaleState"):  # scaled by hand
            grads = grads * gradtools.loss_scale(ref_state)
        updates, ref_state = tx.update(grads, ref_state, ref_w)
        ref_w = optax.apply_updates(ref_w, updates)
    _assert_close(w, ref_w)
    # (a closed window's buffer is left stale by the fused path: compare the rest)
    jax.tree.map(_assert_close, state.inner_state, ref_state.inner_state)
    jax.tree.map(_assert_close, gradtools.metrics(state), gradtools.metrics(ref_state))
    assert not np.array_equal(w, [1.0, -2.0])


def test_donated_buffers_are_reused():
    tx = gradtools.dynamic_loss_scale(optax.adam(1e-3))
    step = jax.jit(gradtools.train_step(lambda p: jnp.sum(p["w"] ** 2), tx), donate_argnums=(0, 1))
    params = {"w": jnp.ones((4, 4))}
    state = tx.init(params)
    old_w, old_mu = params["w"], state.inner_state[0].mu["w"]
    params, state, _ = step(params, state)  # pytest turns a "not usable" warning into an error
    assert old_w.is_deleted() and old_mu.is_deleted()


def test_flax_train_state_recipe_matches_train_step():
    """The TrainState recipe in the docstring gives the same params and metrics."""
    x, y = _data()
    tx = gradtools.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9))
    params = {"w": jnp.array([0.5, -0.25, 1.0]), "b": jnp.array(0.1)}

    @jax.jit
    def ts_step(state, x, y):
        def scaled(p):
            return gradtools.scale_loss(_quadratic(p, x, y), state.opt_state)

        grads = jax.grad(scaled)(state.params)
        state = state.apply_gradients(grads=grads)
        return state, gradtools.metrics(state.opt_state)

    ts = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    step = jax.jit(gradtools.train_step(_quadratic, tx))
    state = tx.init(params)
    bad_x = x.copy()
    bad_x[0, 0] = np.inf  # the second step is not finite and is skipped
    for batch in (x, bad_x, x, x):
        ts, ts_metrics = ts_step(ts, batch, y)
        params, state, metrics = step(params, state, batch, y)
        for key in ts_metrics:
            _assert_close(ts_metrics[key], metrics[key])
    jax.tree.map(_assert_close, ts.params, params)
    assert int(metrics["skipped_steps"]) == 1
    assert int(ts.step) == 4  # TrainState counts calls, skipped ones included


def test_bad_arguments():
    with pytest.raises(TypeError, match="loss_fn"):
        gradtools.train_step("loss", optax.sgd(0.1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tx"):
        gradtools.train_step(_quadratic, lambda g: g)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has_aux"):
        gradtools.train_step(_quadratic, optax.sgd(0.1), has_aux=1)  # type: ignore[arg-type]


# apply_gradients: update and apply in one call ------------------------------


def _mixed_params(mixed=True):
    return {
        "w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(3, 2),
        "b": jnp.array([0.5, -0.5], jnp.bfloat16 if mixed else jnp.float32),
        "h": jnp.array([1.0, 2.0, -3.0, 0.25], jnp.float16 if mixed else jnp.float32),
    }


def _grad_sequence(params, scale):
    """Six scaled gradient trees; the third overflows in 'w', the fifth is NaN in 'h'."""
    rng = np.random.default_rng(1)
    out = []
    for i in range(6):
        g = {k: np.asarray(rng.normal(size=v.shape) * scale, np.float32) for k, v in params.items()}
        if i == 2:
            g["w"][1, 0] = np.inf
        if i == 4:
            g["h"][2] = np.nan
        out.append({k: jnp.asarray(g[k], v.dtype) for k, v in params.items()})
    return out


_TRANSFORMS = {
    "dynamic(clip+adam)": lambda: gradtools.dynamic_loss_scale(
        optax.chain(gradtools.clip_by_global_norm(1.0), optax.adam(1e-2)), init_scale=64.0
    ),
    "fixed(sgd momentum)": lambda: gradtools.fixed_loss_scale(optax.sgd(0.1, 0.9), 64.0),
    "fixed(sgd), no skip": lambda: gradtools.fixed_loss_scale(
        optax.sgd(0.1), 64.0, skip_nonfinite=False
    ),
    "dynamic(accumulate(adam, 2))": lambda: gradtools.dynamic_loss_scale(
        gradtools.accumulate(optax.adam(1e-2), 2), init_scale=64.0
    ),
    "dynamic(accumulate(adam, 2, noise_scale))": lambda: gradtools.dynamic_loss_scale(
        gradtools.accumulate(optax.adam(1e-2), 2, noise_scale=True), init_scale=64.0
    ),
    "dynamic(inject_hyperparams(adam))": lambda: gradtools.dynamic_loss_scale(
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-2), init_scale=64.0
    ),
    "freeze(dynamic(clip+adam))": lambda: gradtools.freeze(
        gradtools.dynamic_loss_scale(
            optax.chain(gradtools.clip_by_global_norm(1.0), optax.adam(1e-2)), init_scale=64.0
        ),
        r"^b",
    ),
    "param_groups(frozen, default=dynamic(accumulate(adam, 2)))": lambda: gradtools.param_groups(
        [(r"^b", gradtools.frozen())],
        default=gradtools.dynamic_loss_scale(
            gradtools.accumulate(optax.adam(1e-2), 2), init_scale=64.0
        ),
    ),
    "adam, no scaler": lambda: optax.adam(1e-2),
    "accumulate(adam, 3)": lambda: gradtools.accumulate(optax.adam(1e-2), 3),
    "accumulate(adam, 3), skip micro-steps": lambda: gradtools.accumulate(
        optax.adam(1e-2), 3, on_nonfinite="skip_microstep"
    ),
    "accumulate(adam, 1), skip micro-steps": lambda: gradtools.accumulate(
        optax.adam(1e-2), 1, on_nonfinite="skip_microstep"
    ),
}
#: The transforms that keep the third and fifth (non-finite) gradients from the params.
_SKIPPING = {
    "dynamic(clip+adam)",
    "fixed(sgd momentum)",
    "dynamic(accumulate(adam, 2))",
    "dynamic(accumulate(adam, 2, noise_scale))",
    "dynamic(inject_hyperparams(adam))",
    "freeze(dynamic(clip+adam))",
    "param_groups(frozen, default=dynamic(accumulate(adam, 2)))",
    "accumulate(adam, 3), skip micro-steps",
    "accumulate(adam, 1), skip micro-steps",
}

#: Steps of the sequence on which an accumulate window stays open (the skipping
#: variant does not count the two non-finite micro-batches).
_MICRO_STEPS = {
    "accumulate(adam, 3)": (0, 1, 3, 4),
    "accumulate(adam, 3), skip micro-steps": (0, 1, 5),
}


def _live(state):
    """``state`` with each closed window's buffer zeroed, as ``update`` leaves it.

    Between windows ``apply_gradients`` leaves the last window's sum there,
    which the next micro-step replaces.
    """

    def clear(s):
        if not isinstance(s, gradtools.AccumulateState):
            return s
        closed = s.micro_step == 0
        buffer = jax.tree.map(lambda b: jnp.where(closed, jnp.zeros_like(b), b), s.acc_grads)
        return s._replace(acc_grads=buffer)

    return jax.tree.map(clear, state, is_leaf=lambda x: isinstance(x, gradtools.AccumulateState))


@pytest.mark.parametrize("name", list(_TRANSFORMS))
def test_apply_gradients_equals_update_then_apply_updates(name):
    """Every step: params (NaN included where nothing skips it) and state.

    Skipped steps return the params bit for bit; applied steps agree to 2 ulps.
    """
    tx = _TRANSFORMS[name]()
    scaled = "fixed" in name or "dynamic" in name
    skips = name in _SKIPPING

    @jax.jit
    def by_hand(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    fused = jax.jit(lambda p, s, g: gradtools.apply_gradients(tx, g, s, p))
    params = _mixed_params(mixed="inject" not in name)  # optax cannot mix bf16 and fp16 there
    state = tx.init(params)
    ref_params, ref_state = params, state
    for i, grads in enumerate(_grad_sequence(params, 64.0 if scaled else 1.0)):
        before = params
        params, state = fused(params, state, grads)
        ref_params, ref_state = by_hand(ref_params, ref_state, grads)
        jax.tree.map(_assert_close, params, ref_params)
        jax.tree.map(_assert_close, _live(state), _live(ref_state))
        if skips and i in (2, 4):  # the skipped step returns the params untouched
            jax.tree.map(np.testing.assert_array_equal, params, before)
        if i in _MICRO_STEPS.get(name, ()):  # no optimizer step: params untouched
            jax.tree.map(np.testing.assert_array_equal, params, before)
    if scaled:
        assert int(gradtools.metrics(state)["skipped_steps"]) == 2
    finite = all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(params))
    assert finite == skips  # without a skip, the NaN reaches the params, as asked


@pytest.mark.parametrize(
    "wrap",
    [
        lambda tx: gradtools.dynamic_loss_scale(tx, init_scale=1.0),
        lambda tx: gradtools.accumulate(tx, 1, on_nonfinite="skip_microstep"),
    ],
    ids=["dynamic_loss_scale", "accumulate skip_microstep"],
)
def test_skips_around_an_optimizer_that_promotes_its_state(wrap):
    """``inject_hyperparams(adam)`` turns a bfloat16 param's moments into float32 on its
    first update (its learning rate is a float32 array). A skipped step returns the
    old state, cast alike; the run matches optax on the finite steps."""
    params = {"w": jnp.ones(3, jnp.bfloat16), "norm": jnp.ones(3, jnp.float32)}
    adam = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    grads = [jax.tree.map(lambda p, v=v: jnp.full_like(p, v), params) for v in (1.0, -2.0, 0.5)]
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.inf), grads[0])
    tx = wrap(adam)
    state, p = tx.init(params), params
    for g in (grads[0], bad, grads[1], grads[2]):
        p, state = jax.jit(lambda p, s, g: gradtools.apply_gradients(tx, g, s, p))(p, state, g)
    ref_state, ref = adam.init(params), params
    for g in grads:
        updates, ref_state = adam.update(g, ref_state, ref)
        ref = optax.apply_updates(ref, updates)
    jax.tree.map(_assert_close, p, ref)
    inner = state.inner_state  # inject_hyperparams' state, under either wrapper
    assert (
        int(inner.inner_state[0].count) == 3 and inner.inner_state[0].mu["w"].dtype == jnp.float32
    )


def _adds_outside_cond(fn, *args):
    """``add``s to an input array (params, a buffer) in ``fn``'s jaxpr, outside any cond."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    inputs = {id(v) for v in jaxpr.invars}
    return [
        e
        for e in jaxpr.eqns
        if e.primitive.name == "add"
        and e.outvars[0].aval.size > 1
        and any(id(v) in inputs for v in e.invars)
    ]


def test_apply_gradients_applies_inside_the_loss_scalers_branch():
    """The updates never leave the cond: the params are added to inside it."""
    tx = gradtools.dynamic_loss_scale(optax.adam(1e-3))
    params = {"w": jnp.ones(1000), "v": jnp.ones((10, 10))}
    state, grads = tx.init(params), jax.tree.map(jnp.ones_like, params)

    def by_hand(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    assert len(_adds_outside_cond(by_hand, params, state, grads)) == 2  # the check can fail
    assert (
        _adds_outside_cond(
            lambda p, s, g, tx=tx: gradtools.apply_gradients(tx, g, s, p), params, state, grads
        )
        == []
    )
    step = gradtools.train_step(lambda p: sum(jnp.sum(x**2) for x in jax.tree.leaves(p)), tx)
    assert [
        e for e in _adds_outside_cond(step, params, state) if e.outvars[0].aval.size == 1000
    ] == []
    for tx in (  # accumulate too, alone and inside a loss scaler
        gradtools.accumulate(optax.adam(1e-3), 4),
        gradtools.dynamic_loss_scale(gradtools.accumulate(optax.adam(1e-3), 4)),
    ):
        state = tx.init(params)
        fused = _adds_outside_cond(
            lambda p, s, g, tx=tx: gradtools.apply_gradients(tx, g, s, p), params, state, grads
        )
        # only the buffer's read-add-write is left outside the cond: no params + updates
        assert len(fused) == len(_adds_outside_cond(by_hand, params, state, grads)) - 2


def test_apply_gradients_through_freeze_takes_the_inner_fast_path():
    """``freeze`` outermost: the loss scaler applies inside its branch, the frozen
    params are not read, and their gradients are neither checked nor computed."""
    tx = gradtools.freeze(gradtools.dynamic_loss_scale(optax.adam(1e-3)), r"^v")
    params = {"w": jnp.ones(1000), "v": jnp.full((10, 10), -0.0)}
    state, grads = tx.init(params), jax.tree.map(jnp.ones_like, params)

    def fused(p, s, g):
        return gradtools.apply_gradients(tx, g, s, p)

    def by_hand(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    assert len(_adds_outside_cond(by_hand, params, state, grads)) == 2  # the check can fail
    assert _adds_outside_cond(fused, params, state, grads) == []
    # An overflow in a frozen gradient skips nothing: the scaler never sees it.
    grads["v"] = grads["v"].at[0, 0].set(jnp.inf)
    new, state = jax.jit(fused)(params, state, grads)
    assert bool(gradtools.metrics(state)["finite"])
    np.testing.assert_allclose(new["w"], 1.0 - 1e-3, rtol=1e-6)  # Adam's first step: lr * sign
    assert np.signbit(new["v"]).all()  # bit for bit: not even -0.0 + 0.0

    def loss(p):
        return jnp.sum(p["w"] ** 2) + jnp.sum(jnp.sin(p["v"]) ** 2)

    step = jax.jit(gradtools.train_step(loss, tx))
    hlo = step.lower(params, tx.init(params)).compile().as_text()
    assert " sine(" in hlo and " cosine(" not in hlo  # the loss needs sin; only its backward cos


@pytest.mark.skipif(
    jax.default_backend() != "cpu" or jax.__version_info__ < (0, 10),
    reason="XLA:CPU's buffer assignment, as of jaxlib 0.10 (0.6 and 0.7 store a temporary)",
)
@pytest.mark.parametrize("clip", [False, True], ids=["adam", "clip+adam"])
def test_loss_scaled_adam_through_apply_gradients_needs_no_temporary_buffer(clip):
    """Unscaling, the finiteness check, the clip and Adam all fuse: nothing parameter-sized
    is stored.

    On XLA:CPU every temporary is mapped afresh and faulted in on each call, so
    one costs about as much as the arithmetic. (A finiteness check written as
    ``isfinite(x).all()`` stores a bool per element: a quarter of the bytes. A
    clip that summed its squares inside the branch stored the unscaled gradients.)
    """
    params = {
        "w": jax.ShapeDtypeStruct((1 << 18,), jnp.float32),
        "v": jax.ShapeDtypeStruct((512, 512), jnp.float32),
    }
    inner = optax.adam(1e-3)
    if clip:
        inner = optax.chain(gradtools.clip_by_global_norm(1.0), inner)
    tx = gradtools.dynamic_loss_scale(inner)

    def fused(p, s, g):
        return gradtools.apply_gradients(tx, g, s, p)

    def by_hand(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    state = jax.eval_shape(tx.init, params)

    def temp_bytes(step):
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes(by_hand) >= 4 << 18  # the updates leave the cond: the check can fail
    assert temp_bytes(fused) < 1024


def test_apply_gradients_passes_weight_and_flush_to_accumulate():
    """Weighted micro-batches and a flushed partial window, as update + apply_updates."""
    tx = gradtools.dynamic_loss_scale(gradtools.accumulate(optax.sgd(0.5), 3), init_scale=8.0)
    params = {"w": jnp.array([1.0, -2.0])}
    fused = jax.jit(lambda p, s, g, **kw: gradtools.apply_gradients(tx, g, s, p, **kw))

    @jax.jit
    def by_hand(p, s, g, **kw):
        updates, s = tx.update(g, s, p, **kw)
        return optax.apply_updates(p, updates), s

    state = ref_state = tx.init(params)
    ref = params
    unscaled = [
        np.array([1.0, 2.0]),
        np.array([3.0, -1.0]),
        np.array([0.5, 0.5]),
        np.array([2.0, 2.0]),
    ]
    weights, flushes = [1.0, 3.0, 2.0, 4.0], [False, False, False, True]
    for g, w, f in zip(unscaled, weights, flushes):
        kw = {"weight": jnp.float32(w), "flush": jnp.bool_(f)}
        grads = {"w": jnp.asarray(g * 8.0, jnp.float32)}
        params, state = fused(params, state, grads, **kw)
        ref, ref_state = by_hand(ref, ref_state, grads, **kw)
        jax.tree.map(_assert_close, (params, _live(state)), (ref, _live(ref_state)))
    # Independent arithmetic: two windows, each the weighted mean of its micro-batches.
    first = (1 * unscaled[0] + 3 * unscaled[1] + 2 * unscaled[2]) / 6
    expected = np.array([1.0, -2.0]) - 0.5 * first - 0.5 * unscaled[3]
    np.testing.assert_allclose(params["w"], expected, rtol=1e-6)


def test_apply_gradients_agrees_across_replicas():
    """With axis_name, one replica's overflow skips the step on every replica."""
    tx = gradtools.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0, axis_name="d")
    params = {"w": jnp.zeros((2, 3))}  # one row per replica
    state = jax.vmap(tx.init)(params)
    grads = {"w": jnp.array([[2.0, 2.0, 2.0], [2.0, jnp.inf, 2.0]])}
    new, state = jax.vmap(lambda p, s, g: gradtools.apply_gradients(tx, g, s, p), axis_name="d")(
        params, state, grads
    )
    np.testing.assert_array_equal(new["w"], np.zeros((2, 3)))
    np.testing.assert_array_equal(state.skipped_steps, [1, 1])
    np.testing.assert_array_equal(state.loss_scale, [1.0, 1.0])


def test_apply_gradients_bad_arguments():
    with pytest.raises(TypeError, match="tx"):
        gradtools.apply_gradients(lambda g: g, {}, (), {})  # type: ignore[arg-type]
    tx = gradtools.dynamic_loss_scale(optax.sgd(0.1))
    with pytest.raises(ValueError, match="params=None"):
        gradtools.apply_gradients(tx, {"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}), None)


def test_apply_gradients_hands_params_to_an_optimizer_that_needs_them():
    params = {"w": jnp.array([1.0, -2.0]), "b": jnp.array([0.5])}
    grads = {"w": jnp.array([0.5, 0.25]), "b": jnp.array([-1.0])}
    lr, wd = 0.1, 0.5
    # adamw's first step: p - lr * (g / (|g| + eps) + wd * p), with eps = 1e-8
    want = {k: params[k] - lr * (g / (np.abs(g) + 1e-8) + wd * params[k]) for k, g in grads.items()}
    adamw = lambda: optax.adamw(lr, weight_decay=wd)  # noqa: E731
    for tx in (
        adamw(),
        gradtools.param_groups([("w", adamw())], default=adamw()),
        gradtools.accumulate(adamw(), 1),
        gradtools.dynamic_loss_scale(adamw(), init_scale=1.0),
    ):
        step = jax.jit(lambda g, s, p, tx=tx: gradtools.apply_gradients(tx, g, s, p))
        new, _ = step(grads, tx.init(params), params)
        for k in params:
            np.testing.assert_allclose(new[k], want[k], rtol=1e-5)
