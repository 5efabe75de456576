"""``gradtools.Optimizer`` against ``flax.nnx.Optimizer`` with the same ``tx``."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import gradtools


class _Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(16, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.out = nnx.Linear(8, 16, rngs=rngs)
        self.calls = nnx.Variable(jnp.zeros([], jnp.int32))  # not a Param: not optimised

    def __call__(self, tokens):
        self.calls[...] += 1
        return self.out(self.norm(self.embed(tokens)))


def _loss(model, tokens):
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _batches(n=4):
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.integers(0, 16, size=(4, 6)), jnp.int32) for _ in range(n)]


def _run(optimizer_class, tx, batches, update_kwargs_of=lambda i: {}):
    model = _Net(nnx.Rngs(0))
    optimizer = optimizer_class(model, tx, wrt=nnx.Param)
    scaled = bool(optax.tree.get_all_with_path(optimizer.opt_state, "LossScaleState"))

    @nnx.jit
    def step(model, optimizer, tokens, kwargs):
        def loss_fn(model):
            loss = _loss(model, tokens)
            return gradtools.scale_loss(loss, optimizer.opt_state) if scaled else loss

        grads = nnx.grad(loss_fn)(model)
        optimizer.update(model, grads, **kwargs)

    for i, tokens in enumerate(batches):
        step(model, optimizer, tokens, update_kwargs_of(i))
    return model, optimizer


_TXS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "clip+adam": lambda: optax.chain(gradtools.clip_by_global_norm(0.1), optax.adam(1e-2)),
    "dynamic(clip+adam)": lambda: gradtools.dynamic_loss_scale(
        optax.chain(gradtools.clip_by_global_norm(0.1), optax.adam(1e-2))
    ),
    "accumulate(sgd, 2)": lambda: gradtools.accumulate(optax.sgd(0.5), 2),
    "freeze(adam)": lambda: gradtools.freeze(optax.adam(1e-2), [r"^norm/"]),
}


def _arrays(tree):
    """``tree`` with each ``nnx.Variable`` replaced by its value: optax's NamedTuples again."""
    return jax.tree.map(lambda v: v[...], tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _closed(state):
    """``state`` with a closed accumulation window's buffer zeroed: ``tx.update`` clears it, the
    fused path leaves the window's sum for the next micro-step to replace (documented)."""
    if not isinstance(state, gradtools.AccumulateState) or int(state.micro_step) != 0:
        return state
    return state._replace(acc_grads=jax.tree.map(jnp.zeros_like, state.acc_grads))


@pytest.mark.parametrize("name", list(_TXS))
def test_equals_nnx_optimizer_with_the_same_tx(name):
    batches = _batches()
    theirs, their_opt = _run(nnx.Optimizer, _TXS[name](), batches)
    ours, our_opt = _run(gradtools.Optimizer, _TXS[name](), batches)
    chex.assert_trees_all_close(
        nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param), rtol=1e-6, atol=1e-7
    )
    chex.assert_trees_all_close(
        _closed(_arrays(our_opt.opt_state)),
        _closed(_arrays(their_opt.opt_state)),
        rtol=1e-6,
        atol=1e-7,
    )
    assert int(our_opt.step[...]) == int(their_opt.step[...]) == len(batches)
    assert int(ours.calls[...]) == len(batches)  # other variables are the model's own


def test_update_kwargs_and_keywords_reach_tx_as_in_nnx():
    """A flushed partial window: nnx.Optimizer takes flush= as a keyword, TrainState-style
    update_kwargs gives the same."""
    batches = _batches(3)
    flush_last = lambda i: {"flush": jnp.asarray(i == 2)}  # noqa: E731
    theirs, _ = _run(nnx.Optimizer, gradtools.accumulate(optax.sgd(0.5), 4), batches, flush_last)
    ours, opt = _run(
        gradtools.Optimizer, gradtools.accumulate(optax.sgd(0.5), 4), batches, flush_last
    )
    chex.assert_trees_all_close(nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param), rtol=1e-6)
    assert int(gradtools.metrics(opt.opt_state)["micro_step"]) == 0

    model = _Net(nnx.Rngs(0))
    optimizer = gradtools.Optimizer(model, gradtools.accumulate(optax.sgd(0.5), 4), wrt=nnx.Param)
    grads = nnx.grad(_loss)(model, batches[0])
    before = _arrays(nnx.state(model, nnx.Param))
    optimizer.update(model, grads, update_kwargs={"flush": True})
    expected = jax.tree.map(lambda p, g: p - 0.5 * g, before, _arrays(grads))
    chex.assert_trees_all_close(_arrays(nnx.state(model, nnx.Param)), expected, rtol=1e-6)


def test_a_skipped_step_leaves_model_and_inner_state_unchanged():
    model = _Net(nnx.Rngs(0))
    tx = gradtools.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**15)
    optimizer = gradtools.Optimizer(model, tx, wrt=nnx.Param)
    params = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    inner = jax.tree.map(np.asarray, _arrays(optimizer.opt_state).inner_state)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, jnp.nan), nnx.state(model, nnx.Param))
    nnx.jit(lambda m, o, g: o.update(m, g))(model, optimizer, grads)
    chex.assert_trees_all_equal(nnx.state(model, nnx.Param), params)
    m = gradtools.metrics(optimizer.opt_state)
    assert int(m["skipped_steps"]) == 1 and float(m["loss_scale"]) == 2.0**14
    chex.assert_trees_all_equal(_arrays(optimizer.opt_state).inner_state, inner)


def test_scale_loss_reads_the_scale_from_the_optimizer_state():
    model = _Net(nnx.Rngs(0))
    optimizer = gradtools.Optimizer(
        model, gradtools.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**10), wrt=nnx.Param
    )
    assert float(gradtools.scale_loss(jnp.float32(3.0), optimizer.opt_state)) == 3.0 * 2**10
    assert float(gradtools.loss_scale(optimizer.opt_state)) == 2.0**10


def test_bad_update_kwargs():
    model = _Net(nnx.Rngs(0))
    optimizer = gradtools.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    grads = nnx.grad(_loss)(model, _batches(1)[0])
    with pytest.raises(TypeError, match="update_kwargs"):
        optimizer.update(model, grads, update_kwargs=[("flush", True)])
