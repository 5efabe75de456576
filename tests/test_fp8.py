"""fp8 delayed-scaling meta (flax's ``_overwrite_with_gradient``) through every step path.

The model is two ``nn.Dense`` layers on flax's real fp8 op
(``Fp8DirectDotGeneralOp``); each reference is ``jax.grad`` of the same loss
and plain optax on ``grads['params']``: the meta takes the gradients' values
(flax's new scales and amax histories), the params the optimizer's step.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.linen import fp8_ops

import gradtools

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
LR = 1e-2


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        fp8 = fp8_ops.Fp8DirectDotGeneralOp
        h = nn.relu(nn.Dense(8, dot_general_cls=fp8)(x))
        return nn.Dense(8, dot_general_cls=fp8)(h)


_NET = _Net()
_RNG = np.random.default_rng(0)
# rows of two magnitudes, so that the two micro-batches of 2 record different amaxes
X = jnp.asarray(_RNG.normal(size=(4, 8)) * np.array([[1.0], [1.0], [3.0], [3.0]]), jnp.float32)
Y = jnp.asarray(_RNG.normal(size=(4, 8)), jnp.float32)


def _loss(variables, x, y):
    return jnp.mean((_NET.apply(variables, x) - y) ** 2)


@jax.jit
def _grads(variables, x, y, scale):
    """The reference: ``jax.grad`` of the loss times ``scale``, meta and params alike."""
    return jax.grad(lambda v: _loss(v, x, y) * scale)(variables)


@functools.cache
def _variables():
    """Variables after one step of meta: the histories hold an amax, the next scales are not 1."""
    v = _NET.init(jax.random.key(0), X)
    return {"params": v["params"], OWG: _grads(v, X, Y, 1.0)[OWG]}


def _adam(params, grads, state=None):
    """The reference optimizer: plain ``optax.adam`` on the params' gradients."""
    tx = optax.adam(LR)
    state = tx.init(params) if state is None else state
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def _close(actual, desired):
    jax.tree.map(
        lambda a, d: np.testing.assert_allclose(a, d, rtol=1e-6, atol=1e-7), actual, desired
    )


def _differ(a, b):
    """Guards a comparison: the two trees are not the same (so the test could fail)."""
    assert not all(jax.tree.leaves(jax.tree.map(lambda x, y: np.allclose(x, y), a, b)))


def _output_grad(tree, factor):
    """``tree`` with its ``output_grad_*`` leaves (the scaled backward pass's) times ``factor``."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x * factor if str(p[-1].key).startswith("output_grad") else x, tree
    )


def test_train_step_writes_the_meta_and_tx_sees_only_the_params():
    v = _variables()
    tx = optax.chain(gradtools.clip_by_global_norm(0.01), optax.adamw(LR, weight_decay=0.1))
    step = jax.jit(gradtools.train_step(_loss, tx))
    new, _, m = step(v, tx.init(v["params"]), X, Y)
    g = _grads(v, X, Y, 1.0)
    ref_tx = optax.chain(optax.clip_by_global_norm(0.01), optax.adamw(LR, weight_decay=0.1))
    updates, _ = ref_tx.update(g["params"], ref_tx.init(v["params"]), v["params"])
    _close(new["params"], optax.apply_updates(v["params"], updates))
    _close(new[OWG], g[OWG])  # taken as the backward pass gave it: no clip, no decay, no Adam
    _differ(g[OWG], v[OWG])
    np.testing.assert_allclose(m["grad_norm"], optax.tree.norm(g["params"]), rtol=1e-6)


def test_micro_batches_take_the_maximum_of_the_meta_never_its_mean():
    v = _variables()
    tx = gradtools.fixed_loss_scale(optax.adam(LR), 8.0)
    step = jax.jit(gradtools.train_step(_loss, tx, micro_batches=2))
    new, state, _ = step(v, tx.init(v["params"]), X, Y)
    g0, g1 = _grads(v, X[:2], Y[:2], 8.0), _grads(v, X[2:], Y[2:], 8.0)
    mean = jax.tree.map(lambda a, b: (a + b) / 16.0, g0["params"], g1["params"])
    params, adam = _adam(v["params"], mean)
    _close(new["params"], params)
    _close(state.inner_state[0].mu, adam[0].mu)
    _close(new[OWG], jax.tree.map(jnp.maximum, g0[OWG], g1[OWG]))  # of the scaled passes
    _differ(g0[OWG], g1[OWG])  # the micro-batches recorded different amaxes


def test_a_loss_scaler_leaves_the_meta_as_the_scaled_backward_pass_gave_it():
    v, scale = _variables(), 2.0**10
    tx = gradtools.dynamic_loss_scale(optax.adam(LR), init_scale=scale)
    new, state, m = jax.jit(gradtools.train_step(_loss, tx))(v, tx.init(v["params"]), X, Y)
    g, unscaled = _grads(v, X, Y, scale), _grads(v, X, Y, 1.0)
    _close(new[OWG], g[OWG])
    # the last layer's newest output-gradient amax is the scaled pass's, not divided by it
    history = new[OWG]["Dense_1"]["Fp8DirectDotGeneralOp_0"]["output_grad_amax_history"]
    ref = unscaled[OWG]["Dense_1"]["Fp8DirectDotGeneralOp_0"]["output_grad_amax_history"]
    np.testing.assert_allclose(history[0], ref[0] * scale, rtol=1e-6)
    params, _ = _adam(v["params"], jax.tree.map(lambda x: x / scale, g["params"]))
    _close(new["params"], params)
    assert float(m["loss_scale"]) == scale  # it did not change, so nothing was moved


def test_an_overflow_keeps_params_and_state_and_writes_no_inf_into_the_meta():
    v = _variables()
    big = {"params": v["params"], OWG: v[OWG]}
    tx = gradtools.dynamic_loss_scale(optax.adam(LR), init_scale=2.0**126, max_scale=2.0**126)
    state = tx.init(v["params"])
    y = Y * 1e4  # the last layer's output gradient overflows float32
    new, new_state, m = jax.jit(gradtools.train_step(_loss, tx))(big, state, X, y)
    g = _grads(v, X, y, 2.0**126)
    assert not all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(g[OWG]))
    assert int(m["skipped_steps"]) == 1
    jax.tree.map(np.testing.assert_array_equal, new["params"], v["params"])
    jax.tree.map(np.testing.assert_array_equal, new_state.inner_state, state.inner_state)
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(new[OWG]))
    # where the pass gave inf or NaN the old value stays; the scale backed off to half,
    # and the output-gradient meta (recorded at the old scale) moved with it
    kept = jax.tree.map(lambda n, o: np.where(np.isfinite(n), n, o), g[OWG], v[OWG])
    _close(new[OWG], _output_grad(kept, 0.5))
    last = new[OWG]["Dense_1"]["Fp8DirectDotGeneralOp_0"]
    old = v[OWG]["Dense_1"]["Fp8DirectDotGeneralOp_0"]["output_grad_amax_history"]
    # flax's history after a step: the newest amax at 0, the previous newest at the end
    np.testing.assert_array_equal(last["output_grad_amax_history"][0], old[0] * 0.5)
    np.testing.assert_array_equal(last["output_grad_amax_history"][-1], old[0] * 0.5)


def test_a_skipped_spike_still_writes_the_meta():
    v = _variables()
    tx = gradtools.spike_guard(optax.adam(LR), action="skip", warmup_steps=1)
    apply = jax.jit(gradtools.apply_gradients, static_argnums=0)
    g = _grads(v, X, Y, 1.0)
    v1, state = apply(tx, g, tx.init(v["params"]), v)
    g2 = _grads(v1, X, Y, 1.0)
    spike = {"params": jax.tree.map(lambda x: x * 1e3, g2["params"]), OWG: g2[OWG]}
    v2, state2 = apply(tx, spike, state, v1)
    assert int(gradtools.metrics(state2)["spikes"]) == 1
    jax.tree.map(np.testing.assert_array_equal, v2["params"], v1["params"])
    _close(v2[OWG], g2[OWG])
    _differ(g2[OWG], v1[OWG])


def test_accumulate_writes_the_meta_every_call_and_the_params_when_the_window_closes():
    v = _variables()
    tx = gradtools.accumulate(optax.adam(LR), every_k=2)
    step = jax.jit(gradtools.train_step(_loss, tx))
    v1, state, _ = step(v, tx.init(v["params"]), X[:2], Y[:2])
    g1 = _grads(v, X[:2], Y[:2], 1.0)
    jax.tree.map(np.testing.assert_array_equal, v1["params"], v["params"])
    _close(v1[OWG], g1[OWG])
    v2, _, _ = step(v1, state, X[2:], Y[2:])
    g2 = _grads(v1, X[2:], Y[2:], 1.0)  # the second pass ran with the meta of the first
    _close(v2[OWG], g2[OWG])
    mean = jax.tree.map(lambda a, b: (a + b) / 2, g1["params"], g2["params"])
    _close(v2["params"], _adam(v["params"], mean)[0])


@pytest.mark.parametrize(
    "tx",
    [
        gradtools.freeze(optax.adam(LR), "Dense_0"),
        gradtools.param_groups([("Dense_0", gradtools.frozen()), ("Dense_1", optax.adam(LR))]),
    ],
    ids=["freeze", "param_groups"],
)
def test_a_frozen_layer_keeps_its_params_and_its_meta_is_written(tx):
    v = _variables()
    new, _, _ = jax.jit(gradtools.train_step(_loss, tx))(v, tx.init(v["params"]), X, Y)
    g = _grads(v, X, Y, 1.0)
    jax.tree.map(np.testing.assert_array_equal, new["params"]["Dense_0"], v["params"]["Dense_0"])
    _close(new["params"]["Dense_1"], _adam(v["params"]["Dense_1"], g["params"]["Dense_1"])[0])
    _close(new[OWG], g[OWG])
    _differ(g[OWG]["Dense_0"], v[OWG]["Dense_0"])


def test_train_state_steps_as_flax_and_writes_the_meta():
    v = _variables()
    tx = gradtools.dynamic_loss_scale(optax.adam(LR), init_scale=4.0)
    state = gradtools.TrainState.create(apply_fn=_NET.apply, params=v, tx=tx)
    g = _grads(v, X, Y, 4.0)
    state = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, g)
    params, _ = _adam(v["params"], jax.tree.map(lambda x: x / 4.0, g["params"]))
    _close(state.params["params"], params)
    _close(state.params[OWG], g[OWG])
    assert int(state.step) == 1


def test_a_growing_loss_scale_moves_the_output_gradient_meta_with_it():
    v = _variables()
    tx = gradtools.dynamic_loss_scale(optax.adam(LR), init_scale=4.0, growth_interval=1)
    g = _grads(v, X, Y, 4.0)
    new, state = jax.jit(gradtools.apply_gradients, static_argnums=0)(
        tx, g, tx.init(v["params"]), v
    )
    assert float(gradtools.loss_scale(state)) == 8.0
    _close(new[OWG], _output_grad(g[OWG], 2.0))  # the next pass records at twice the scale
    _differ(new[OWG], g[OWG])


def test_a_state_built_from_the_whole_variables_is_refused():
    v = _variables()
    tx = optax.adam(LR)
    whole = tx.init(v)
    g = _grads(v, X, Y, 1.0)
    match = r"tx.init\(variables\['params'\]\)"
    with pytest.raises(ValueError, match=match):
        gradtools.apply_gradients(tx, g, whole, v)
    with pytest.raises(ValueError, match=match):
        jax.jit(gradtools.train_step(_loss, tx))(v, whole, X, Y)  # at trace time
    state = gradtools.TrainState.create(apply_fn=None, params=v, tx=tx).replace(opt_state=whole)
    with pytest.raises(ValueError, match=match):
        state.apply_gradients(grads=g)


def test_variables_that_do_not_pair_params_with_meta_are_refused():
    v = _variables()
    tx = optax.adam(LR)
    g = _grads(v, X, Y, 1.0)
    with pytest.raises(ValueError, match="grads do not"):
        gradtools.apply_gradients(tx, {"params": g["params"]}, tx.init(v["params"]), v)
    stats = {"batch_stats": {"mean": jnp.zeros(8)}}
    with pytest.raises(ValueError, match=r"beside \['batch_stats', 'params'\]"):
        gradtools.apply_gradients(tx, {**g, **stats}, tx.init(v["params"]), {**v, **stats})


def _bridged():
    """The same network as an nnx module; its fp8 meta are variables of a type named ``OWG``."""
    model = nnx.bridge.ToNNX(_Net(), rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(model, X)
    return model, nnx.variable_type_from_name(OWG)


def _pure(state):
    """The arrays of an nnx state (flax 0.11 has no ``nnx.as_pure``)."""
    return nnx.as_pure(state) if hasattr(nnx, "as_pure") else nnx.to_arrays(nnx.pure(state))


def test_nnx_optimizer_through_the_bridge():
    model, meta_type = _bridged()
    tx = gradtools.dynamic_loss_scale(optax.adam(LR), init_scale=4.0)
    optimizer = gradtools.Optimizer(model, tx, wrt=nnx.Param)
    adam = optax.adam(LR).init(_pure(nnx.state(model, nnx.Param)))
    wrt = nnx.DiffState(0, (nnx.Param, meta_type))  # the gradients of both kinds of variable

    def loss_fn(model):  # scaled by the optimizer's current loss scale
        return gradtools.scale_loss(jnp.mean((model(X) - Y) ** 2), optimizer.opt_state)

    for _ in range(2):  # the first step fills the histories, the second takes scales from them
        params, meta = (_pure(nnx.state(model, t)) for t in (nnx.Param, meta_type))
        grads = nnx.grad(loss_fn, argnums=wrt)(model)
        optimizer.update(model, grads)
        unscaled = jax.tree.map(lambda g: g / 4.0, _pure(nnx.state(grads, nnx.Param)))
        ref_params, adam = _adam(params, unscaled, adam)
        _close(_pure(nnx.state(model, nnx.Param)), ref_params)
        new_meta = _pure(nnx.state(model, meta_type))
        _close(new_meta, _pure(nnx.state(grads, meta_type)))  # the scaled pass's
        _differ(new_meta, meta)


def test_nnx_optimizer_refuses_a_wrt_that_selects_the_meta():
    model, meta_type = _bridged()
    optimizer = gradtools.Optimizer(model, optax.adam(LR), wrt=(nnx.Param, meta_type))
    wrt = nnx.DiffState(0, (nnx.Param, meta_type))
    grads = nnx.grad(lambda m: jnp.mean(m(X) ** 2), argnums=wrt)(model)
    with pytest.raises(ValueError, match=r"wrt=nnx.Param"):
        optimizer.update(model, grads)
