"""Tests for gradtools.clip_by_global_norm and gradtools.global_norm."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradtools

RNG = np.random.default_rng(1)


def mixed_tree(seed=1):
    """The same tree whichever tests ran before on the worker."""
    rng = np.random.default_rng(seed)
    return {
        "f32": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
        "bf16": jnp.asarray(rng.normal(size=5) * 3, jnp.bfloat16),
        "f16": jnp.asarray(rng.normal(size=(2, 2)) * 10, jnp.float16),
        "none": None,
        "empty": {},
        "zero_size": jnp.zeros((0, 3)),
    }


def np_norm(tree, p):
    """Reference: the p-norm of all elements, in float64."""
    x = np.concatenate([np.asarray(v, np.float64).ravel() for v in jax.tree.leaves(tree)])
    if p == math.inf:
        return np.max(np.abs(x))
    return np.sum(np.abs(x) ** p) ** (1 / p)


@pytest.mark.parametrize("p", [1, 2.0, 3, math.inf], ids=["L1", "L2", "L3", "Linf"])
def test_global_norm_matches_numpy(p):
    tree = mixed_tree()
    got = jax.jit(lambda t: gradtools.global_norm(t, norm_type=p))(tree)
    assert got.dtype == jnp.float32 and got.shape == ()
    np.testing.assert_allclose(got, np_norm(tree, p), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("p", [1, 2.0, 3, math.inf], ids=["L1", "L2", "L3", "Linf"])
def test_global_norm_of_1100_leaves_matches_numpy_and_combines_32_at_a_time(p, widest_stack):
    # 1100 leaves take three levels of groups of 32 (1100 -> 35 -> 2 -> 1).
    tree = [jnp.asarray(RNG.normal(size=int(n)), jnp.float32) for n in RNG.integers(1, 9, 1100)]
    got = jax.jit(lambda t: gradtools.global_norm(t, norm_type=p))(tree)
    np.testing.assert_allclose(got, np_norm(tree, p), rtol=1e-5)
    norm = functools.partial(gradtools.global_norm, norm_type=p)
    assert 2 <= widest_stack(norm, tree) <= 32
    tree[1099] = tree[1099].at[0].set(jnp.inf)
    assert np.isinf(gradtools.global_norm(tree, norm_type=p))


def test_global_norm_large_p_does_not_overflow():
    tree = {"a": jnp.array([10.0, -20.0, 5.0]), "b": jnp.array([15.0])}
    got = gradtools.global_norm(tree, norm_type=40)  # 20**40 overflows float32
    assert np.isfinite(got)
    np.testing.assert_allclose(got, np_norm(tree, 40), rtol=1e-6)


def test_global_norm_empty_and_nonfinite():
    assert float(gradtools.global_norm({})) == 0.0
    assert float(gradtools.global_norm({"a": None})) == 0.0
    assert np.isinf(gradtools.global_norm({"a": jnp.array([1.0, jnp.inf])}))
    assert np.isnan(gradtools.global_norm({"a": jnp.array([1.0, jnp.nan])}, norm_type=3))


def test_fp16_squares_overflow_in_optax_not_here():
    # 300**2 = 90000 > 65504, the float16 maximum.
    update = {"w": jnp.full((4,), 300.0, jnp.float16)}
    norm = gradtools.global_norm(update)
    np.testing.assert_allclose(norm, 600.0, rtol=1e-6)  # sqrt(4 * 300**2)
    ours, state = jax.jit(gradtools.clip_by_global_norm(60.0).update)(
        update, gradtools.clip_by_global_norm(60.0).init(update)
    )
    assert ours["w"].dtype == jnp.float16
    np.testing.assert_allclose(ours["w"].astype(np.float32), np.full(4, 30.0), rtol=1e-3)
    assert float(state.grad_norm) == pytest.approx(600.0)
    theirs, _ = jax.jit(optax.clip_by_global_norm(60.0).update)(update, optax.EmptyState())
    t = np.asarray(theirs["w"], np.float32)
    assert np.all((t == 0) | np.isnan(t))  # optax's update is lost


def test_clip_scales_to_max_norm_and_matches_optax_in_float32():
    tree = {"a": jnp.asarray(RNG.normal(size=(4, 3)), jnp.float32), "b": jnp.ones(2)}
    norm = np_norm(tree, 2)
    max_norm = 0.5 * norm
    tx = gradtools.clip_by_global_norm(max_norm)
    got, state = jax.jit(tx.update)(tree, tx.init(tree))
    for k in tree:
        np.testing.assert_allclose(got[k], np.asarray(tree[k]) * (max_norm / norm), rtol=1e-6)
    np.testing.assert_allclose(np_norm(got, 2), max_norm, rtol=1e-6)
    np.testing.assert_allclose(state.grad_norm, norm, rtol=1e-6)
    ref, _ = optax.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
    chex.assert_trees_all_close(got, ref, rtol=1e-6)


@pytest.mark.parametrize("p", [1, 2, math.inf])
def test_clip_with_other_norm_types(p):
    tree = {"a": jnp.array([3.0, -4.0]), "b": jnp.array([12.0])}
    tx = gradtools.clip_by_global_norm(1.0, norm_type=p)
    got, state = jax.jit(tx.update)(tree, tx.init(tree))
    np.testing.assert_allclose(state.grad_norm, np_norm(tree, p), rtol=1e-6)
    np.testing.assert_allclose(np_norm(got, p), 1.0, rtol=1e-6)


def test_boundary_norm_equal_or_below_passes_unchanged():
    tree = {"a": jnp.array([3.0, 4.0], jnp.float32), "b": jnp.array([0.5, -0.25], jnp.bfloat16)}
    norm = np.float32(np.sqrt(25.3125))  # 3**2 + 4**2 + 0.5**2 + 0.25**2, exact in float32
    assert float(gradtools.global_norm(tree)) == norm
    for max_norm in (norm, 2 * norm):
        tx = gradtools.clip_by_global_norm(float(max_norm))
        got, _ = jax.jit(tx.update)(tree, tx.init(tree))
        chex.assert_trees_all_equal(got, tree, strict=True)
    # One float32 step below the norm, the clip acts: each value times max_norm / norm.
    below = np.nextafter(norm, np.float32(0))
    tx = gradtools.clip_by_global_norm(float(below))
    got, _ = jax.jit(tx.update)(tree, tx.init(tree))
    # XLA:CPU divides exactly as NumPy does; XLA:GPU's float32 division may be one ulp off.
    ulps = 0 if jax.default_backend() == "cpu" else 1
    np.testing.assert_array_max_ulp(got["a"], np.float32([3.0, 4.0]) * (below / norm), ulps)
    assert not np.array_equal(got["a"], tree["a"])


def test_inf_norm_scales_by_zero_as_optax_does_and_is_recorded():
    tree = {"a": jnp.array([1.0, jnp.inf]), "b": jnp.array([2.0, 3.0])}
    tx = gradtools.clip_by_global_norm(1.0)
    got, state = jax.jit(tx.update)(tree, tx.init(tree))
    ref, _ = optax.clip_by_global_norm(1.0).update(tree, optax.EmptyState())
    chex.assert_trees_all_equal(got, {"a": jnp.array([0.0, jnp.nan]), "b": jnp.zeros(2)})
    chex.assert_trees_all_equal(got, ref)
    assert np.isinf(state.grad_norm) and not bool(gradtools.all_finite(got))


def test_float64_updates_under_x64_are_scaled_in_float64():
    """Unclipped float64 updates pass bit for bit; clipped ones are not rounded to float32."""
    jax.config.update("jax_enable_x64", True)
    try:
        g = {"a": jnp.array([0.1, 0.2, 1 / 3], jnp.float64)}
        tx = gradtools.clip_by_global_norm(10.0)
        got, _ = jax.jit(tx.update)(g, tx.init(g))
        chex.assert_trees_all_equal(got, g, strict=True)
        tx = gradtools.clip_by_global_norm(0.25)
        got, state = jax.jit(tx.update)(g, tx.init(g))
        assert got["a"].dtype == jnp.float64 and state.grad_norm.dtype == jnp.float32
        np.testing.assert_allclose(state.grad_norm, np_norm(g, 2), rtol=1e-7)
        factor = np.float64(np.float32(0.25) / np.float32(np_norm(g, 2)))  # the float32 factor
        np.testing.assert_array_equal(got["a"], np.asarray(g["a"]) * factor)
    finally:
        jax.config.update("jax_enable_x64", False)


def test_nan_norm_passes_updates_and_records_it():
    tree = {"a": jnp.array([1.0, jnp.nan]), "b": jnp.array([2.0, 3.0])}
    tx = gradtools.clip_by_global_norm(1.0)
    got, state = jax.jit(tx.update)(tree, tx.init(tree))
    chex.assert_trees_all_equal(got, tree)  # optax makes every entry NaN
    assert np.isnan(state.grad_norm)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_too_large_to_square_move_nothing(dtype):
    """Finite gradients whose squares overflow float32: an inf L2 norm, zero updates.

    PyTorch's clip_grad_norm_ (norm inf, coefficient max_norm / inf = 0) and
    optax's clip give the same zeros. Inside a loss scaler, whose check finds
    these gradients finite, Adam then takes zeros instead of squaring 1e20
    into an inf second moment that would freeze the param for good.
    """
    grads = {"w": jnp.array([1e20, -1e20, 1.0], dtype)}
    tx = gradtools.clip_by_global_norm(1.0)
    got, state = jax.jit(tx.update)(grads, tx.init(grads))
    chex.assert_trees_all_equal(got, {"w": jnp.zeros(3, dtype)})
    ref, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    chex.assert_trees_all_equal(got, ref)
    assert np.isinf(state.grad_norm)

    params = {"w": jnp.ones(3, jnp.float32)}
    scaled = gradtools.dynamic_loss_scale(
        optax.chain(gradtools.clip_by_global_norm(1.0), optax.adam(0.1)), init_scale=1.0
    )
    for apply in (False, True):
        state = scaled.init(params)
        if apply:
            new, state = jax.jit(gradtools.apply_gradients, static_argnums=0)(
                scaled, grads, state, params
            )
        else:
            updates, state = jax.jit(scaled.update)(grads, state, params)
            new = optax.apply_updates(params, updates)
        m = gradtools.metrics(state)
        assert bool(m["finite"]) and np.isinf(m["grad_norm"])  # applied, not skipped
        chex.assert_trees_all_equal(new, params)  # Adam's first step on zeros moves nothing
        ((_, adam),) = optax.tree.get_all_with_path(state, "ScaleByAdamState")
        chex.assert_trees_all_equal(adam.nu, {"w": jnp.zeros(3)})


def test_clipping_after_unscaling_is_scale_independent():
    params = {"w": jnp.array([0.5, -0.5, 1.0])}
    true = [{"w": jnp.array([30.0, -40.0, 0.0])}, {"w": jnp.array([0.3, 0.4, 1.2])}]

    def train(tx, scale_grads):
        update = jax.jit(tx.update)
        p, state = params, tx.init(params)
        for g in true:
            s = gradtools.loss_scale(state) if scale_grads else 1.0
            u, state = update(jax.tree.map(lambda x, s=s: x * s, g), state, p)
            p = optax.apply_updates(p, u)
        return p, state

    inner = lambda: optax.chain(gradtools.clip_by_global_norm(1.0), optax.adam(0.1))  # noqa: E731
    ref, _ = train(inner(), False)
    for scale in (2.0**4, 2.0**12):
        got, state = train(gradtools.dynamic_loss_scale(inner(), init_scale=scale), True)
        chex.assert_trees_all_close(got, ref, rtol=1e-6)
        assert float(gradtools.metrics(state)["grad_norm"]) == pytest.approx(1.3, rel=1e-6)


@pytest.mark.parametrize("before", [1.0, 3.0, None], ids=["clip_first", "scaled_first", "masked"])
def test_clip_inside_a_loss_scaler_takes_the_norm_of_what_it_receives(before):
    """Right inside the scaler the clip reuses the scaler's sums of squares; behind
    ``optax.scale`` it sees other values, and inside ``optax.masked`` only some leaves."""
    max_norm, loss_scale = 2.0, 2.0**10
    tree = mixed_tree()
    params = jax.tree.map(jnp.zeros_like, tree)
    scaled = jax.tree.map(lambda x: (x.astype(jnp.float32) * loss_scale).astype(x.dtype), tree)
    clip = gradtools.clip_by_global_norm(max_norm)
    if before is None:
        mask = jax.tree.map(lambda x: x.dtype != jnp.bfloat16, tree)
        inner = optax.chain(optax.masked(clip, mask), optax.sgd(1.0))
    else:
        inner = optax.chain(optax.scale(before), clip, optax.sgd(1.0))
    tx = gradtools.dynamic_loss_scale(inner, init_scale=loss_scale)
    updates, state = jax.jit(tx.update)(scaled, tx.init(params), params)

    arrays = ("f32", "bf16", "f16", "zero_size")
    seen = {k: tree[k] for k in arrays if before is not None or k != "bf16"}
    # optax.scale multiplies in each leaf's dtype (and rounds there)
    seen = {k: np.asarray(x * (before or 1.0), np.float64) for k, x in seen.items()}
    norm = np_norm(seen, 2)
    assert norm > max_norm  # the clip acts, so a wrong norm shows in the updates
    if before is None:  # counting the masked-out leaf would move the norm well past rtol
        assert np_norm({k: tree[k] for k in arrays}, 2) > 1.05 * norm
    # rtol: XLA may keep optax.scale's bf16 product in float32 (excess precision)
    np.testing.assert_allclose(gradtools.metrics(state)["grad_norm"], norm, rtol=1e-2)
    want = jax.tree.map(lambda x: -np.asarray(x, np.float64) * (before or 1.0), tree)
    for k, x in seen.items():
        want[k] = -x * max_norm / norm
    for k in arrays:
        np.testing.assert_allclose(np.asarray(updates[k], np.float64), want[k], rtol=1e-2)
        assert updates[k].dtype == tree[k].dtype


def test_state_dtypes_metrics_and_one_trace():
    tx = gradtools.clip_by_global_norm(1.0)
    params = {"a": jnp.zeros(3, jnp.float16), "b": None}
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    state = tx.init(shapes)
    assert state.grad_norm.dtype == jnp.float32

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(g, state):
        return tx.update(g, state)

    for v in (1.0, 0.1, 3.0):
        u, new_state = step({"a": jnp.full(3, v, jnp.float16), "b": None}, state)
        chex.assert_trees_all_equal_structs(state, new_state)
        chex.assert_trees_all_equal_dtypes(state, new_state)
        assert u["a"].dtype == jnp.float16 and u["b"] is None
        state = new_state
    assert float(gradtools.metrics(state)["grad_norm"]) == pytest.approx(3 * math.sqrt(3), rel=1e-3)


def test_max_norm_under_inject_hyperparams():
    tx = optax.inject_hyperparams(gradtools.clip_by_global_norm)(max_norm=2.0)
    g = {"w": jnp.array([3.0, 4.0])}
    state = tx.init(g)
    u, state = jax.jit(tx.update)(g, state)
    np.testing.assert_allclose(u["w"], [1.2, 1.6], rtol=1e-6)
    state.hyperparams["max_norm"] = jnp.asarray(10.0)
    u, _ = jax.jit(tx.update)(g, state)
    np.testing.assert_allclose(u["w"], [3.0, 4.0])


@pytest.mark.parametrize("max_norm", [0.0, -1.0, math.inf, math.nan, "big"])
def test_bad_max_norm(max_norm):
    with pytest.raises(ValueError, match="max_norm"):
        gradtools.clip_by_global_norm(max_norm)


@pytest.mark.parametrize("norm_type", [0.5, 0, -math.inf, math.nan, "l2", True, None])
def test_bad_norm_type(norm_type):
    with pytest.raises(ValueError, match="norm_type"):
        gradtools.clip_by_global_norm(1.0, norm_type=norm_type)
    with pytest.raises(ValueError, match="norm_type"):
        gradtools.global_norm({"a": jnp.ones(2)}, norm_type=norm_type)


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf], ids=["L1", "L2", "L3", "Linf"])
def test_injected_norm_type_is_traced_and_still_right(p):
    # inject_hyperparams injects every numeric argument, defaults included.
    tree = mixed_tree()
    inject = optax.inject_hyperparams(gradtools.clip_by_global_norm, hyperparam_dtype=jnp.float32)
    tx = inject(max_norm=1e-3, norm_type=p)
    got, state = jax.jit(tx.update)(tree, tx.init(tree))
    assert "norm_type" in state.hyperparams
    np.testing.assert_allclose(state.inner_state.grad_norm, np_norm(tree, p), rtol=1e-6)
    factor = 1e-3 / np_norm(tree, p)  # clipped to norm 1e-3
    for k in ("f32", "bf16", "f16"):
        want = np.asarray(tree[k], np.float64) * factor
        np.testing.assert_allclose(np.asarray(got[k], np.float64), want, rtol=1e-2, atol=0)
    norm = jax.jit(gradtools.global_norm)(tree, jnp.float32(p))
    np.testing.assert_allclose(norm, np_norm(tree, p), rtol=1e-6)


def test_mixed_half_tree_under_strict_dtypes(strict_dtypes):
    tree = {"a": jnp.full(3, 300.0, jnp.bfloat16), "b": jnp.full(2, 300.0, jnp.float16)}
    tx = gradtools.clip_by_global_norm(1.0, norm_type=3)
    got, state = jax.jit(tx.update)(tree, tx.init(tree))
    np.testing.assert_allclose(state.grad_norm, 300.0 * 5 ** (1 / 3), rtol=1e-6)
    assert got["a"].dtype == jnp.bfloat16 and got["b"].dtype == jnp.float16
    np.testing.assert_allclose(got["b"].astype(np.float32), 5 ** (-1 / 3), rtol=1e-3)


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, 2.5, math.inf])
def test_norm_of_all_zero_gradients_is_zero(p):
    tree = {"a": jnp.zeros(3), "b": jnp.zeros((2, 2), jnp.bfloat16)}
    assert float(gradtools.global_norm(tree, norm_type=p)) == 0.0
    assert float(jax.jit(gradtools.global_norm)(tree, jnp.float32(p))) == 0.0  # traced p
    tx = gradtools.clip_by_global_norm(1.0, norm_type=p)
    updates, state = jax.jit(tx.update)(tree, tx.init(tree))
    assert float(gradtools.metrics(state)["grad_norm"]) == 0.0
    assert not any(np.any(u) for u in jax.tree.leaves(updates))


def test_state_stays_float32_under_x64_through_a_scan():
    jax.config.update("jax_enable_x64", True)
    try:
        tx = gradtools.clip_by_global_norm(1.0)
        g = {"a": jnp.array([3.0, 4.0], jnp.float64)}
        state = tx.init(g)
        assert state.grad_norm.dtype == jnp.float32
        state, _ = jax.lax.scan(lambda s, _: (tx.update(g, s)[1], None), state, None, length=2)
        assert state.grad_norm.dtype == jnp.float32 and float(state.grad_norm) == 5.0
    finally:
        jax.config.update("jax_enable_x64", False)
