"""gradtools.TrainState against flax's TrainState with tx.update and optax.apply_updates."""

import subprocess
import sys
import textwrap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import gradtools


def _loss(params, x):
    return 0.5 * jnp.sum((params["w"] * x + params["b"]) ** 2)


PARAMS = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.array(0.25)}
XS = [jnp.array(x, jnp.float32) for x in ([1.0, 2.0, 0.5], [0.3, -1.0, 2.0], [1.5, 0.5, -0.5])]


@jax.jit
def _reference_step(state, grads, update_kwargs):
    """flax's TrainState, stepped by hand with every extra argument given to tx.update."""
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params, **update_kwargs)
    params = optax.apply_updates(state.params, updates)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state)


@jax.jit
def _step(state, grads, update_kwargs):
    return state.apply_gradients(grads=grads, update_kwargs=update_kwargs)


def _scaled_grads(params, opt_state, x):
    scaled = optax.tree.get_all_with_path(opt_state, "LossScaleState")
    return jax.grad(
        lambda p: gradtools.scale_loss(_loss(p, x), opt_state) if scaled else _loss(p, x)
    )(params)


def _close(actual, desired):
    """Equal up to a few float32 ulps: the fused update-and-apply may round last bits apart."""
    np.testing.assert_allclose(actual, desired, rtol=1e-6, atol=0)


def _assert_same(state, ref):
    assert int(state.step) == int(ref.step)
    jax.tree.map(_close, state.params, ref.params)
    jax.tree.map(
        np.testing.assert_array_equal,
        gradtools.metrics(state.opt_state),
        gradtools.metrics(ref.opt_state),
    )


def _run(tx, batches):
    """``batches``: (x, update_kwargs) pairs; both states take the same gradients."""
    state = gradtools.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    ref = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    for x, kwargs in batches:
        grads = _scaled_grads(ref.params, ref.opt_state, x)
        state = _step(state, grads, kwargs)
        ref = _reference_step(ref, grads, kwargs)
        _assert_same(state, ref)
    return state, ref


def test_is_a_flax_train_state():
    state = gradtools.TrainState.create(apply_fn=None, params=PARAMS, tx=optax.sgd(0.1))
    assert isinstance(state, train_state.TrainState)
    assert int(state.step) == 0
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(optax.sgd(0.1).init(PARAMS))


def test_accumulation_with_a_flushed_partial_window():
    tx = gradtools.accumulate(optax.adam(0.1), every_k=3)
    f, t = jnp.array(False), jnp.array(True)  # traced: one compilation for both
    batches = [(XS[0], {"flush": f}), (XS[1], {"flush": f}), (XS[2], {"flush": f})]
    batches += [(XS[0], {"flush": f}), (XS[1], {"flush": t})]  # 2 micro-batches, flushed
    state, _ = _run(tx, batches)
    assert int(state.step) == 5
    assert int(state.opt_state.inner_state[0].count) == 2  # adam stepped twice
    # the flushed window: the mean of its two gradients, as one optax.adam step
    adam = optax.adam(0.1)
    params, adam_state = PARAMS, adam.init(PARAMS)
    for window in (XS, XS[:2]):
        grads = [jax.grad(_loss)(params, x) for x in window]
        mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
        updates, adam_state = adam.update(mean, adam_state, params)
        params = optax.apply_updates(params, updates)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), state.params, params)


def test_a_loss_scaler_skips_a_nonfinite_step():
    tx = gradtools.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9), init_scale=2.0**10)
    bad = jnp.array([jnp.inf, 1.0, 1.0])
    state, ref = _run(tx, [(XS[0], {}), (bad, {}), (XS[1], {}), (XS[2], {})])
    m = gradtools.metrics(state.opt_state)
    assert int(m["skipped_steps"]) == 1 and float(m["loss_scale"]) == 2.0**9
    assert int(state.step) == 4  # calls, the skipped one included


def test_no_update_kwargs_matches_flax_apply_gradients():
    tx = gradtools.dynamic_loss_scale(optax.adam(0.1), init_scale=4.0)
    state = gradtools.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    ref = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    for x in XS:
        grads = _scaled_grads(ref.params, ref.opt_state, x)
        state = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
        ref = jax.jit(lambda s, g: s.apply_gradients(grads=g))(ref, grads)
        _assert_same(state, ref)


class _WithStats(gradtools.TrainState):
    batch_stats: Any = None


class _FlaxWithStats(train_state.TrainState):
    batch_stats: Any = None


def test_other_fields_are_replaced_as_flax_does():
    tx = gradtools.accumulate(optax.sgd(0.5), every_k=2)
    stats = {"mean": jnp.zeros(3)}
    state = _WithStats.create(apply_fn=None, params=PARAMS, tx=tx, batch_stats=stats)
    ref = _FlaxWithStats.create(apply_fn=None, params=PARAMS, tx=tx, batch_stats=stats)
    grads = jax.grad(_loss)(PARAMS, XS[0])
    new_stats = {"mean": jnp.array([1.0, 2.0, 3.0])}
    state = state.apply_gradients(grads=grads, update_kwargs={"flush": True}, batch_stats=new_stats)
    updates, opt_state = tx.update(grads, ref.opt_state, ref.params, flush=True)
    ref = ref.replace(
        step=1,
        params=optax.apply_updates(ref.params, updates),
        opt_state=opt_state,
        batch_stats=new_stats,
    )
    assert isinstance(state, _WithStats)
    _assert_same(state, ref)
    np.testing.assert_array_equal(state.batch_stats["mean"], [1.0, 2.0, 3.0])
    assert not np.array_equal(state.params["w"], PARAMS["w"])  # the flush stepped


def test_the_overwrite_with_gradient_collection_as_flax():
    owg = train_state.OVERWRITE_WITH_GRADIENT
    params = {"params": PARAMS, owg: {"scale": jnp.ones(2)}}
    tx = gradtools.dynamic_loss_scale(optax.sgd(0.1), init_scale=1.0)
    state = gradtools.TrainState.create(apply_fn=None, params=params, tx=tx)
    ref = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    grads = {"params": jax.grad(_loss)(PARAMS, XS[0]), owg: {"scale": jnp.array([3.0, 4.0])}}
    state, ref = state.apply_gradients(grads=grads), ref.apply_gradients(grads=grads)
    _assert_same(state, ref)
    np.testing.assert_array_equal(state.params[owg]["scale"], [3.0, 4.0])


def test_flax_refuses_flush_where_gradtools_takes_it():
    """The reason for the class: flax hands every keyword to ``replace``."""
    tx = gradtools.accumulate(optax.sgd(0.1), every_k=2)
    grads = jax.grad(_loss)(PARAMS, XS[0])
    ref = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    with pytest.raises(TypeError):
        ref.apply_gradients(grads=grads, flush=True)
    state = gradtools.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    with pytest.raises(TypeError, match="flush"):  # a keyword is a field to replace, as in flax
        state.apply_gradients(grads=grads, flush=True)
    with pytest.raises(TypeError, match=r"update_kwargs=\[\('flush', True\)\] must be a dict"):
        state.apply_gradients(grads=grads, update_kwargs=[("flush", True)])


def test_import_gradtools_does_not_import_flax():
    code = textwrap.dedent(
        """
        import sys
        import gradtools
        assert "flax" not in sys.modules, sorted(m for m in sys.modules if "flax" in m)
        assert "TrainState" in gradtools.__all__
        cls = gradtools.TrainState
        assert "flax" in sys.modules
        from flax.training import train_state
        assert issubclass(cls, train_state.TrainState)
        try:
            gradtools.NoSuchName
        except AttributeError as err:
            assert str(err) == "module 'gradtools' has no attribute 'NoSuchName'", err
        else:
            raise AssertionError("no AttributeError")
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
