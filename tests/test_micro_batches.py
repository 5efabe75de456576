"""``train_step(..., micro_batches=k)`` against the whole-batch step and NumPy."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradtools


def _mlp_loss(params, x, y):
    """A two-layer tanh regression, mean squared error over the examples."""
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def _setup(n=16):
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.normal(size=(3, 5)), jnp.float32),
        "b1": jnp.zeros(5, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(5,)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(n,)), jnp.float32)
    return params, x, y


_TXS = {
    "sgd": lambda: optax.sgd(0.1),
    "adam": lambda: optax.adam(0.05),
    "clip+adam": lambda: optax.chain(gradtools.clip_by_global_norm(0.5), optax.adam(0.05)),
    "dynamic(sgd)": lambda: gradtools.dynamic_loss_scale(optax.sgd(0.1)),
    "dynamic(clip+adam)": lambda: gradtools.dynamic_loss_scale(
        optax.chain(gradtools.clip_by_global_norm(0.5), optax.adam(0.05))
    ),
    "fixed(adam)": lambda: gradtools.fixed_loss_scale(optax.adam(0.05), 2.0**8),
}


@pytest.mark.parametrize("name", list(_TXS))
@pytest.mark.parametrize("k", [2, 8])
def test_equals_the_whole_batch_step(name, k):
    params, x, y = _setup()
    tx = _TXS[name]()
    whole = jax.jit(gradtools.train_step(_mlp_loss, tx))
    split = jax.jit(gradtools.train_step(_mlp_loss, tx, micro_batches=k))
    p1, s1 = params, tx.init(params)
    p2, s2 = params, tx.init(params)
    for _ in range(3):
        p1, s1, m1 = whole(p1, s1, x, y)
        p2, s2, m2 = split(p2, s2, x, y)
        np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-6)
    chex.assert_trees_all_close(p2, p1, rtol=2e-5, atol=1e-6)
    chex.assert_trees_all_close(s2, s1, rtol=2e-5, atol=1e-6)


def test_gradient_is_the_numpy_mean_of_micro_batch_gradients():
    """Least squares, gradients by hand: one sgd step of lr 1 moves w by minus the mean gradient."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(12, 4)).astype(np.float32)
    y = rng.normal(size=(12,)).astype(np.float32)
    w = rng.normal(size=(4,)).astype(np.float32)

    def loss_fn(w, x, y):
        return 0.5 * jnp.mean((x @ w - y) ** 2)

    step = jax.jit(gradtools.train_step(loss_fn, optax.sgd(1.0), micro_batches=3))
    new_w, _, m = step(jnp.asarray(w), optax.sgd(1.0).init(w), x, y)
    xs, ys = np.split(x.astype(np.float64), 3), np.split(y.astype(np.float64), 3)
    grads = [xi.T @ (xi @ w - yi) / len(yi) for xi, yi in zip(xs, ys)]
    losses = [0.5 * np.mean((xi @ w - yi) ** 2) for xi, yi in zip(xs, ys)]
    np.testing.assert_allclose(new_w, w - np.mean(grads, axis=0), rtol=1e-5)
    np.testing.assert_allclose(m["loss"], np.mean(losses), rtol=1e-6)


def _fp16_loss(params, x):
    """float16 compute: the scaled gradient of a micro-batch holding 1e4 overflows."""
    return jnp.sum(params["w"].astype(jnp.float16) * x.astype(jnp.float16)).astype(jnp.float32)


def test_an_overflow_in_one_micro_batch_skips_the_whole_step():
    params = {"w": jnp.ones(3, jnp.float32)}
    tx = gradtools.dynamic_loss_scale(optax.adam(0.1), init_scale=2.0**15)
    step = jax.jit(gradtools.train_step(_fp16_loss, tx, micro_batches=4))
    state = tx.init(params)
    x = np.full((8, 3), 0.5, np.float32)
    x[5, 1] = 1e4  # micro-batch 2 only: 1e4 * 2**15 is past float16's 65504
    new_params, new_state, m = step(params, state, x)
    np.testing.assert_array_equal(new_params["w"], params["w"])
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
    assert float(m["loss_scale"]) == 2.0**14
    assert int(m["skipped_steps"]) == 1 and not bool(m["finite"])
    # Without the large value the same step is taken.
    x[5, 1] = 0.5
    new_params, _, m = step(params, state, x)
    assert int(m["skipped_steps"]) == 0
    assert not np.array_equal(new_params["w"], params["w"])


def test_float16_micro_batch_gradients_are_averaged_in_float32_not_summed_in_float16():
    """Two float16 micro-batch gradients of 2**15 each: their sum, 2**16, is past 65504."""
    params = {"w": jnp.zeros(2, jnp.float16)}
    x = np.full((4, 2), 2.0**14, np.float32)  # each micro-batch of 2: a gradient of 2**15

    def loss_fn(p, x):
        return jnp.sum(p["w"] * x.astype(jnp.float16))

    tx = optax.sgd(2.0**-15)
    new, _, _ = jax.jit(gradtools.train_step(loss_fn, tx, micro_batches=2))(
        params, tx.init(params), x
    )
    # NumPy: the mean of the two micro-batch gradients is 2**15; one SGD step of 2**-15.
    assert new["w"].dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(new["w"], np.float32), [-1.0, -1.0])


def _skips_in_float16(loss_fn, steps=20):
    """Updates a dynamic loss scale from 2**15 skips in ``steps`` float16 steps of ``loss_fn``."""
    params = {"w": jnp.ones(4, jnp.float16)}
    tx = gradtools.dynamic_loss_scale(optax.sgd(1e-4), init_scale=2.0**15)
    step = jax.jit(gradtools.train_step(loss_fn, tx, micro_batches=2))
    state = tx.init(params)
    x = np.random.default_rng(0).uniform(0.5, 1.0, size=(2, 4096, 4)).astype(np.float16)
    for _ in range(steps):
        params, state, m = step(params, state, x)
    return int(m["skipped_steps"])


def test_loss_sum_over_thousands_of_tokens_skips_no_more_float16_steps_than_a_mean():
    """The scaled quantity is each micro-batch's mean: 4096 tokens, gradient ~1 per token."""

    def token_losses(p, x):
        return jnp.sum(x * p["w"], axis=-1)  # float16, one loss per token

    mean_skips = _skips_in_float16(lambda p, x: jnp.mean(token_losses(p, x)))
    sum_skips = _skips_in_float16(
        lambda p, x: gradtools.LossSum(jnp.sum(token_losses(p, x)), x.shape[0] * x.shape[1])
    )
    # 2**15 times a mean gradient below 1 fits float16; times the sum over 4096 tokens would
    # not, until the scale had halved 12 times (12 skipped steps).
    assert mean_skips == 0
    assert sum_skips == mean_skips


def test_loss_is_the_mean_of_unscaled_losses_and_aux_is_stacked():
    params, x, y = _setup(12)

    def loss_fn(p, x, y):
        loss = _mlp_loss(p, x, y)
        return loss, {"loss": loss, "first": x[0]}

    tx = gradtools.dynamic_loss_scale(optax.sgd(0.1))
    step = jax.jit(gradtools.train_step(loss_fn, tx, has_aux=True, micro_batches=3))
    _, _, m = step(params, tx.init(params), x, y)
    expected = [_mlp_loss(params, xi, yi) for xi, yi in zip(np.split(x, 3), np.split(y, 3))]
    assert m["aux"]["loss"].shape == (3,)
    np.testing.assert_allclose(m["aux"]["loss"], expected, rtol=1e-6)
    np.testing.assert_array_equal(m["aux"]["first"], np.asarray(x)[[0, 4, 8]])
    np.testing.assert_allclose(m["loss"], np.mean(expected), rtol=1e-6)


def test_keyword_and_scalar_arguments_go_whole_to_every_micro_batch():
    seen = []

    def loss_fn(p, x, scale, *, offset):
        seen.append((jnp.shape(x), jnp.shape(scale), jnp.shape(offset)))
        return jnp.mean((x * p + offset) ** 2) * scale

    step = jax.jit(gradtools.train_step(loss_fn, optax.sgd(0.1), micro_batches=2))
    offset = jnp.arange(3.0)  # a keyword array with a leading axis: not split
    step(jnp.ones(3), optax.sgd(0.1).init(jnp.ones(3)), jnp.ones((4, 3)), 2.0, offset=offset)
    assert seen == [((2, 3), (), (3,))]


def test_padded_micro_batches_give_the_token_weighted_mean_with_loss_sum():
    """Micro-batches hold 5, 1, 0 and 3 valid tokens: the mean of means would be wrong."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 2)).astype(np.float32)
    mask = np.array([1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0], np.float32).reshape(8, 2)
    w = np.array([0.5, -1.0], np.float32)

    def loss_fn(w, x, mask):
        per_token = (x * w - 1.0) ** 2
        return gradtools.LossSum(jnp.sum(per_token * mask), jnp.sum(mask))

    tx = optax.sgd(1.0)
    step = jax.jit(gradtools.train_step(loss_fn, tx, micro_batches=4))
    new_w, _, m = step(jnp.asarray(w), tx.init(w), x, mask)
    # NumPy: the mean over the 9 valid tokens of the whole batch, and its gradient.
    r = (x * w - 1.0).astype(np.float64)
    n = mask.sum()
    np.testing.assert_allclose(m["loss"], np.sum(r**2 * mask) / n, rtol=1e-6)
    np.testing.assert_allclose(new_w, w - np.sum(2 * r * x * mask, axis=0) / n, rtol=1e-6)
    # The same LossSum without micro-batches gives the same step.
    whole_w, _, whole_m = jax.jit(gradtools.train_step(loss_fn, tx))(
        jnp.asarray(w), tx.init(w), x, mask
    )
    np.testing.assert_allclose(whole_w, new_w, rtol=1e-6)
    np.testing.assert_allclose(whole_m["loss"], m["loss"], rtol=1e-6)


def test_loss_sum_with_no_valid_token_is_a_zero_step_not_nan():
    def loss_fn(w, x, mask):
        return gradtools.LossSum(jnp.sum(x * w * mask), jnp.sum(mask))

    step = jax.jit(gradtools.train_step(loss_fn, optax.sgd(1.0), micro_batches=2))
    w, _, m = step(jnp.ones(2), optax.sgd(1.0).init(None), jnp.ones((4, 2)), jnp.zeros((4, 2)))
    np.testing.assert_array_equal(w, [1.0, 1.0])
    assert float(m["loss"]) == 0.0


def test_accumulate_flush_and_weight_work_on_top():
    params, x, y = _setup(8)
    # The reference: the accumulate window's weighted mean of the two batches' mean gradients.
    g1 = jax.grad(_mlp_loss)(params, x[:4], y[:4])
    g2 = jax.grad(_mlp_loss)(params, x[4:], y[4:])
    expected = jax.tree.map(lambda p, a, b: p - 0.1 * (a + 3 * b) / 4, params, g1, g2)
    tx = gradtools.accumulate(optax.sgd(0.1), every_k=4)
    step = jax.jit(gradtools.train_step(_mlp_loss, tx, micro_batches=2), donate_argnums=(0, 1))
    p, s = params, tx.init(params)
    p, s, _ = step(p, s, x[:4], y[:4], update_kwargs={"weight": 1.0})
    p, s, m = step(p, s, x[4:], y[4:], update_kwargs={"weight": 3.0, "flush": True})
    chex.assert_trees_all_close(p, expected, rtol=1e-5, atol=1e-7)
    assert int(m["micro_step"]) == 0  # the flushed window closed


def test_no_retrace_for_new_batch_values():
    params, x, y = _setup()
    tx = gradtools.dynamic_loss_scale(optax.adam(0.01))
    step = jax.jit(
        chex.assert_max_traces(gradtools.train_step(_mlp_loss, tx, micro_batches=4), n=1),
        donate_argnums=(0, 1),
    )
    p, s = params, tx.init(params)
    for i in range(3):
        p, s, _ = step(p, s, x + i, y - i)


def _primitives(jaxpr) -> set[str]:
    """Every primitive in ``jaxpr``, nested jaxprs (scan bodies, cond branches) included."""
    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr holds its Jaxpr
                if hasattr(sub, "eqns"):
                    out |= _primitives(sub)
    return out


def test_the_loop_body_holds_no_conditional():
    params, x, y = _setup()
    tx = gradtools.dynamic_loss_scale(
        optax.chain(gradtools.clip_by_global_norm(1.0), optax.adam(1))
    )
    step = gradtools.train_step(_mlp_loss, tx, micro_batches=4)
    jaxpr = jax.make_jaxpr(step)(params, tx.init(params), x, y).jaxpr
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == 4
    body = _primitives(scans[0].params["jaxpr"].jaxpr)
    assert "cond" not in body and "dot_general" in body
    assert "cond" in _primitives(jaxpr)  # the loss scaler's skip, after the loop


def test_peak_temporary_memory_falls_with_micro_batches():
    """A wide MLP on a large batch: activations dominate, one micro-batch's are alive at once."""
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.normal(size=(64, 1024)) * 0.1, jnp.float32)}
    params["w2"] = jnp.asarray(rng.normal(size=(1024, 1)) * 0.1, jnp.float32)

    def loss_fn(p, x):
        return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])

    x = jnp.zeros((2048, 64), jnp.float32)
    tx = optax.sgd(0.1)
    temp = {}
    for k in (1, 2, 4, 8):
        step = jax.jit(gradtools.train_step(loss_fn, tx, micro_batches=k), donate_argnums=(0, 1))
        compiled = step.lower(params, tx.init(params), x).compile()
        temp[k] = compiled.memory_analysis().temp_size_in_bytes
    activations = 2048 * 1024 * 4  # one float32 (batch, 1024) hidden layer
    assert temp[1] >= activations, temp
    assert temp[8] < temp[4] < temp[2] < temp[1], temp
    assert temp[8] <= temp[1] / 4, temp


@pytest.mark.parametrize("bad", [True, 1.5, 0, -1, "2", None])
def test_micro_batches_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="micro_batches"):
        gradtools.train_step(_mlp_loss, optax.sgd(0.1), micro_batches=bad)


def test_a_batch_that_micro_batches_does_not_divide_is_refused_when_traced():
    params, x, y = _setup(10)
    step = jax.jit(gradtools.train_step(_mlp_loss, optax.sgd(0.1), micro_batches=4))
    with pytest.raises(
        ValueError, match=r"args\[0\] has a leading axis of size 10.*micro_batches=4"
    ):
        step(params, optax.sgd(0.1).init(params), x, y)


def test_an_nnx_module_as_params_is_told_what_to_pass():
    from flax import nnx

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    step = gradtools.train_step(lambda m, x: jnp.sum(m(x)), optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"nnx.Module \(Linear\).*nnx.split.*gradtools.Optimizer"):
        step(model, None, jnp.ones((1, 2)))


def test_loss_sum_with_has_aux_and_without():
    sgd = optax.sgd(1.0)

    def loss_fn(w):
        return gradtools.LossSum(jnp.sum(w**2), 4.0), jnp.ones(1)

    w, _, m = gradtools.train_step(loss_fn, sgd, has_aux=True)(jnp.array([2.0]), sgd.init(None))
    np.testing.assert_allclose(w, [1.0])  # 2 - 2 * 2 / 4
    np.testing.assert_allclose(m["loss"], 1.0)
    bare = gradtools.train_step(lambda w: gradtools.LossSum(jnp.sum(w), 1.0), sgd, has_aux=True)
    with pytest.raises(TypeError, match=r"has_aux=True, loss_fn must return a pair"):
        bare(jnp.ones(1), sgd.init(None))


@pytest.mark.four_devices
def test_a_batch_sharded_over_devices_gives_the_single_device_step():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]), ("data",))
    params, x, y = _setup(32)
    tx = gradtools.dynamic_loss_scale(optax.adam(0.05))
    step = jax.jit(gradtools.train_step(_mlp_loss, tx, micro_batches=4))
    expected, _, m1 = step(params, tx.init(params), x, y)
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    p, s = jax.device_put((params, tx.init(params)), replicated)
    p, s, m2 = step(p, s, jax.device_put(x, split), jax.device_put(y, split))
    chex.assert_trees_all_close(p, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-6)
