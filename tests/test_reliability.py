"""Nothing lost, nothing silent: half-precision params, odd inputs, clear errors."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization
from jax.sharding import PartitionSpec as P

import gradtools

SCALERS = {
    "dynamic": lambda inner: gradtools.dynamic_loss_scale(inner, init_scale=32768.0),
    "fixed": lambda inner: gradtools.fixed_loss_scale(inner, 32768.0),
}


def _np_adam_step(p, g, lr, eps, dtype):
    """Adam's first step in ``dtype`` as optax computes it (bias-corrected moments)."""
    p, g = np.asarray(p, dtype), np.asarray(g, dtype)
    mu, nu = (0.1 * g).astype(dtype), (0.001 * g * g).astype(dtype)
    with np.errstate(all="ignore"):
        mu_hat, nu_hat = (mu / dtype(0.1)).astype(dtype), (nu / dtype(0.001)).astype(dtype)
        return (p - lr * mu_hat / (np.sqrt(nu_hat) + dtype(eps))).astype(dtype)


# -- 1. half-precision params ----------------------------------------------------------------


@pytest.mark.parametrize("scaler", SCALERS)
@pytest.mark.parametrize("path", ["update", "apply_gradients"])
def test_a_float16_step_that_would_write_nan_is_not_applied(scaler, path):
    tx = SCALERS[scaler](optax.adam(1e-2))
    p = {"w": jnp.array([1.0, 1.0, 1.0], jnp.float16)}
    g = {"w": jnp.array([1e-3, 1e-1, 0.0], jnp.float16) * 32768}
    # The independent reference: Adam in float16 writes inf/NaN here (eps=1e-8 is 0).
    assert not np.all(np.isfinite(_np_adam_step(p["w"], g["w"] / 32768, 1e-2, 1e-8, np.float16)))
    state = tx.init(p)
    if path == "update":
        updates, state = jax.jit(tx.update)(g, state, p)
        new = optax.apply_updates(p, updates)
        np.testing.assert_array_equal(np.asarray(updates["w"]), 0)
    else:
        new, state = jax.jit(functools.partial(gradtools.apply_gradients, tx))(g, state, p)
    np.testing.assert_array_equal(np.asarray(new["w"]), [1.0, 1.0, 1.0])
    chex.assert_trees_all_equal(state.inner_state, tx.init(p).inner_state)  # count 0, moments 0
    m = gradtools.metrics(state)
    assert int(m["nonfinite_updates"]) == 1 and int(m["skipped_steps"]) == 1
    assert bool(m["finite"])  # the gradients were fine, so the scale is not lowered
    assert float(m["loss_scale"]) == 32768.0


def test_the_float16_recipe_steps_as_numpy_does():
    """With eps suited to float16 the step is finite, applied, and matches Adam in float16."""
    tx = gradtools.dynamic_loss_scale(optax.adam(1e-2, eps=1e-3), init_scale=1024.0)
    p = {"w": jnp.array([1.0, 1.0, 1.0], jnp.float16)}
    g = {"w": jnp.array([1e-3, 1e-1, 0.0], jnp.float16) * 1024}
    new, state = gradtools.apply_gradients(tx, g, tx.init(p), p)
    want = _np_adam_step(p["w"], g["w"].astype(np.float32) / 1024, 1e-2, 1e-3, np.float16)
    np.testing.assert_allclose(np.asarray(new["w"], np.float32), want, rtol=2e-3)
    m = gradtools.metrics(state)
    assert int(m["nonfinite_updates"]) == 0 and int(m["skipped_steps"]) == 0


def test_float32_params_get_no_extra_check(array_reductions):
    """The write check reads the new params: float32 trees never pay for it."""

    def reductions(dtype):
        tx = gradtools.dynamic_loss_scale(optax.adam(1e-3))
        params = {"w": jax.ShapeDtypeStruct((4096,), dtype)}
        state = jax.eval_shape(tx.init, params)
        step = functools.partial(gradtools.apply_gradients, tx)
        return array_reductions(step, params, state, params, min_size=1024)

    assert reductions(jnp.float32) == 1  # the finiteness pass over the gradients alone
    assert reductions(jnp.bfloat16) > reductions(jnp.float32)


# -- 2. inputs optax accepts --------------------------------------------------------------------


def _python_number_state():
    """optax's own test transformation: a state holding a plain Python int."""
    return optax.GradientTransformation(lambda p: {"foo": 1}, lambda u, s, p=None: (u, s))


@pytest.mark.parametrize(
    "wrap",
    [
        lambda t: gradtools.dynamic_loss_scale(t, init_scale=4.0),
        lambda t: gradtools.fixed_loss_scale(t, 4.0),
        lambda t: gradtools.accumulate(t, 2),
        lambda t: gradtools.freeze(t, "^b$"),
        lambda t: gradtools.param_groups([("^a$", t)], default=gradtools.frozen()),
    ],
    ids=["dynamic", "fixed", "accumulate", "freeze", "param_groups"],
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_inner_state_holding_a_python_number_works(wrap, jit):
    """It steps as the same wrapper around optax.identity() does, and keeps the number."""
    p = {"a": jnp.ones(2), "b": jnp.ones(2)}
    runs = []
    for inner in (_python_number_state(), optax.identity()):
        tx = wrap(inner)
        update = jax.jit(tx.update) if jit else tx.update
        state, out = tx.init(p), []
        for fill in (4.0, jnp.inf, 8.0):
            updates, state = update({"a": jnp.full(2, fill), "b": jnp.full(2, 4.0)}, state, p)
            out.append(updates)
        runs.append((out, state))
    chex.assert_trees_all_equal(runs[0][0], runs[1][0])
    found = jax.tree.leaves(runs[0][1], is_leaf=lambda x: isinstance(x, dict) and "foo" in x)
    assert [int(x["foo"]) for x in found if isinstance(x, dict)] == [1]


@pytest.mark.parametrize(
    "make, want",
    [
        (lambda: gradtools.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0), -0.75),
        (lambda: gradtools.fixed_loss_scale(optax.sgd(1.0), 2.0), -0.75),
        (lambda: gradtools.accumulate(optax.sgd(1.0), 1), -1.5),
        (lambda: optax.chain(gradtools.clip_by_global_norm(1.0), optax.sgd(1.0)), -1.0),
    ],
    ids=["dynamic", "fixed", "accumulate", "clip"],
)
def test_python_float_gradient_leaves_work(make, want):
    tx = make()
    params = {"w": 1.0}
    updates, _ = tx.update({"w": 1.5}, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(updates["w"]), want, rtol=1e-6)


def test_integer_gradients_are_refused_by_the_clip():
    tx = gradtools.clip_by_global_norm(1.0)
    with pytest.raises(TypeError, match=re.escape("updates['w'] is int32")):
        tx.update({"w": jnp.array([3, 4])}, tx.init(None))


@pytest.mark.parametrize(
    "make",
    [
        lambda: gradtools.dynamic_loss_scale(optax.sgd(1.0)),
        lambda: gradtools.accumulate(optax.sgd(1.0), 2),
        lambda: gradtools.clip_by_global_norm(1.0),
    ],
    ids=["dynamic", "accumulate", "clip"],
)
def test_a_string_leaf_is_named(make):
    tx = make()
    params = {"a": {"b": jnp.ones(2)}, "c": jnp.ones(2)}
    grads = {"a": {"b": jnp.ones(2)}, "c": "0.5"}
    with pytest.raises(TypeError, match=re.escape("['c']='0.5' must be a numeric array")):
        tx.update(grads, tx.init(params), params)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"init_scale": 2.0**127}, "init_scale"),
        ({"init_scale": 2.0**-127, "min_scale": 2.0**-127}, "init_scale"),
        ({"init_scale": 1.0, "min_scale": 2.0**-127}, "min_scale"),
        ({"max_scale": 2.0**127}, "max_scale"),
    ],
)
def test_scale_bounds_whose_reciprocal_or_value_is_subnormal_are_refused(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}="):
        gradtools.dynamic_loss_scale(optax.sgd(1.0), **kwargs)
    # The edges themselves are normal, and so are their reciprocals.
    gradtools.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0**126, max_scale=2.0**126)
    gradtools.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0**-126, min_scale=2.0**-126)


def test_a_fixed_scale_whose_reciprocal_is_subnormal_is_refused():
    with pytest.raises(ValueError, match="^scale="):
        gradtools.fixed_loss_scale(optax.sgd(1.0), 2.0**127)


@pytest.mark.parametrize("p", [1.0, 3.0, float("inf")])
def test_clipping_a_norm_near_float32s_max_scales_to_max_norm(p):
    g = np.array([2e38, 1e38, 3.0], np.float32)
    tx = gradtools.clip_by_global_norm(1.0, norm_type=p)
    want_norm = np.linalg.norm(g.astype(np.float64), ord=p)
    want = g.astype(np.float64) / want_norm
    for update in (tx.update, jax.jit(tx.update)):
        updates, state = update({"w": jnp.asarray(g)}, tx.init(None))
        np.testing.assert_allclose(float(state.grad_norm), want_norm, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(updates["w"]), want, rtol=1e-5, atol=1e-37)
        assert abs(np.linalg.norm(np.asarray(updates["w"], np.float64), ord=p) - 1.0) < 1e-5


def test_a_3_norm_near_float32s_max_is_the_same_eager_and_jitted():
    tree = {"w": jnp.array([2e38, 1e38], jnp.float32)}
    want = np.linalg.norm(np.array([2e38, 1e38]), ord=3)
    eager = gradtools.global_norm(tree, norm_type=3.0)
    jitted = jax.jit(lambda t: gradtools.global_norm(t, norm_type=3.0))(tree)
    np.testing.assert_allclose([float(eager), float(jitted)], [want, want], rtol=1e-5)


# -- 3. errors that point at the cause -----------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: gradtools.dynamic_loss_scale(optax.adam(0.1)),
        lambda: gradtools.accumulate(optax.adam(0.1), 2),
        lambda: gradtools.freeze(optax.adam(0.1), "^b"),
        lambda: gradtools.param_groups([("^a", optax.adam(0.1))], default=optax.sgd(0.1)),
    ],
    ids=["dynamic", "accumulate", "freeze", "param_groups"],
)
def test_a_state_from_another_transformation_says_where_states_come_from(make):
    tx = make()
    p = {"a": jnp.ones(2), "b": jnp.ones(2)}
    for wrong in (optax.adam(0.1).init(p), {"loss_scale": 1.0, "inner_state": {}}):
        with pytest.raises(TypeError, match=r"pass the state this transformation's init returned"):
            tx.update(p, wrong, p)


def test_lookahead_inside_a_loss_scaler_says_to_put_it_outside():
    inner = optax.lookahead(optax.sgd(0.1), sync_period=2, slow_step_size=0.5)
    tx = gradtools.dynamic_loss_scale(inner)
    params = optax.LookaheadParams.init_synced({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"put optax.lookahead outside"):
        tx.update({"w": jnp.ones(2)}, tx.init(params), params)
    # ... and outside it works, the scaler seeing the fast params.
    outer = optax.lookahead(gradtools.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0), 2, 0.5)
    updates, _ = outer.update({"w": jnp.full(2, 2.0)}, outer.init(params), params)
    np.testing.assert_allclose(np.asarray(updates.fast["w"]), -0.1)


# -- which parameters overflowed (issue: diagnostics) -------------------------------------------

PARAMS = {"conv": {"kernel": jnp.ones(3), "bias": jnp.ones(2)}, "fc": [jnp.ones(2), jnp.ones(4)]}


def _grads(bad):
    """Gradients of PARAMS with an inf (or NaN) in the leaves named ``bad``."""
    names = gradtools.path_names(PARAMS)
    return jax.tree.map(
        lambda n, p: p.at[0].set(jnp.nan if n.endswith("0") else jnp.inf) if n in bad else p,
        names,
        PARAMS,
    )


@pytest.mark.parametrize(
    "bad", [["conv/bias"], ["conv/kernel", "fc/0"], ["conv/bias", "conv/kernel", "fc/0", "fc/1"]]
)
@pytest.mark.parametrize(
    "make",
    [
        lambda: gradtools.dynamic_loss_scale(optax.adam(0.1)),
        lambda: gradtools.dynamic_loss_scale(gradtools.accumulate(optax.adam(0.1), 2)),
        lambda: gradtools.accumulate(gradtools.dynamic_loss_scale(optax.adam(0.1)), 2),
    ],
    ids=["scaler", "scaler(accumulate)", "accumulate(scaler)"],
)
def test_nonfinite_leaves_names_exactly_the_overflowing_leaves(make, bad):
    tx = make()
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    assert gradtools.nonfinite_leaves(state, PARAMS) == []
    _, state = update(_grads([]), state, PARAMS)
    assert gradtools.nonfinite_leaves(state, PARAMS) == []
    _, state = update(_grads(bad), state, PARAMS)
    want = [n for n in jax.tree.leaves(gradtools.path_names(PARAMS)) if n in bad]
    assert gradtools.nonfinite_leaves(state, PARAMS) == want
    assert int(gradtools.metrics(state)["nonfinite_leaf_count"]) == len(bad)
    _, state = update(_grads([]), state, PARAMS)  # a finite step keeps the last skip's names
    restored = serialization.from_bytes(tx.init(PARAMS), serialization.to_bytes(state))
    assert gradtools.nonfinite_leaves(restored, PARAMS) == want


def test_nonfinite_leaves_refuses_other_params():
    tx = gradtools.dynamic_loss_scale(optax.sgd(0.1))
    with pytest.raises(ValueError, match="params has 1 leaves, the loss scaler's params had 4"):
        gradtools.nonfinite_leaves(tx.init(PARAMS), {"w": jnp.ones(2)})
    with pytest.raises(ValueError, match="holds no LossScaleState"):
        gradtools.nonfinite_leaves(optax.sgd(0.1).init(PARAMS), PARAMS)


@pytest.mark.four_devices
def test_nonfinite_leaves_are_agreed_across_devices():
    """Device i overflows in leaf i: every device lists all the leaves that overflowed anywhere."""
    mesh = jax.make_mesh((4,), ("d",))
    tx = gradtools.dynamic_loss_scale(optax.sgd(0.1), axis_name="d")
    params = {f"w{i}": jnp.ones(2) for i in range(5)}
    state = tx.init(params)

    def step(grads):
        i = jax.lax.axis_index("d")
        grads = {k: jnp.where((i == int(k[1])) & (i < 3), jnp.inf, g) for k, g in grads.items()}
        _, new = tx.update(grads, state, params)
        return new.nonfinite_leaves[None]

    flags = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P("d"), check_vma=False)
    )(params)
    np.testing.assert_array_equal(np.asarray(flags), [[True, True, True, False, False]] * 4)
    first = jnp.asarray(np.asarray(flags)[0])
    names = gradtools.nonfinite_leaves(state._replace(nonfinite_leaves=first), params)
    assert names == ["w0", "w1", "w2"]
