"""A wrapper hands the transformation inside it only what the user passed.

The inner optimizer below is an ``optax.GradientTransformationExtraArgs``
whose ``update`` takes no ``**extra_args``: any keyword a wrapper added on
its own would make it fail. Every wrapper, and the nestings a training loop
builds (a loss scaler around a guard around a clip, accumulation around a
loss scaler, norms and clips first in a chain), must give the updates and
params that the same composition gives around plain ``optax.sgd``, eagerly
and under ``jax.jit``, through ``tx.update`` and through
:func:`gradtools.apply_gradients`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradtools

LR = 0.1


def strict_sgd() -> optax.GradientTransformationExtraArgs:
    """``optax.sgd(LR)`` whose ``update`` refuses every keyword argument."""
    sgd = optax.sgd(LR, momentum=0.9)

    def update(updates, state, params=None):
        return sgd.update(updates, state, params)

    return optax.GradientTransformationExtraArgs(sgd.init, update)


def plain_sgd() -> optax.GradientTransformation:
    return optax.sgd(LR, momentum=0.9)


def clip():
    return gradtools.clip_by_global_norm(1.0)


def norms():
    return gradtools.group_norms([(r"^a", "a")])


# name: a function of the inner optimizer, giving the transformation under test
WRAPPERS = {
    "dynamic_loss_scale": lambda o: gradtools.dynamic_loss_scale(o, init_scale=4.0),
    "fixed_loss_scale": lambda o: gradtools.fixed_loss_scale(o, 4.0),
    "fixed_loss_scale_always": lambda o: gradtools.fixed_loss_scale(o, 4.0, skip_nonfinite=False),
    "dynamic(chain(clip, inner))": lambda o: gradtools.dynamic_loss_scale(
        optax.chain(clip(), o), init_scale=4.0
    ),
    "dynamic(inner first in a chain)": lambda o: gradtools.dynamic_loss_scale(
        optax.chain(o, clip()), init_scale=4.0
    ),
    "dynamic(chain(norms, clip, inner))": lambda o: gradtools.dynamic_loss_scale(
        optax.chain(norms(), clip(), o), init_scale=4.0
    ),
    "spike_guard": lambda o: gradtools.spike_guard(o, warmup_steps=1, z_threshold=0.1),
    "spike_guard_skip": lambda o: gradtools.spike_guard(
        o, warmup_steps=1, z_threshold=0.1, action="skip"
    ),
    "dynamic(spike_guard(chain(clip, inner)))": lambda o: gradtools.dynamic_loss_scale(
        gradtools.spike_guard(optax.chain(clip(), o), warmup_steps=1, z_threshold=0.1),
        init_scale=4.0,
    ),
    "accumulate": lambda o: gradtools.accumulate(o, every_k=2),
    "accumulate(dynamic(chain(clip, inner)))": lambda o: gradtools.accumulate(
        gradtools.dynamic_loss_scale(optax.chain(clip(), o), init_scale=4.0), every_k=2
    ),
    "dynamic(accumulate(inner))": lambda o: gradtools.dynamic_loss_scale(
        gradtools.accumulate(o, every_k=2), init_scale=4.0
    ),
    "freeze": lambda o: gradtools.freeze(o, patterns=r"^b"),
    "param_groups": lambda o: gradtools.param_groups([(r"^a", o)], default=gradtools.frozen()),
    "dynamic(param_groups)": lambda o: gradtools.dynamic_loss_scale(
        gradtools.param_groups([(r"^a", optax.chain(clip(), o))], default=gradtools.frozen()),
        init_scale=4.0,
    ),
}


def params():
    return {"a": jnp.arange(4.0), "b": jnp.ones((2, 2))}


def grads(step: int):
    """Steady gradients, then a jump (a spike for the guards), then an inf (a skip)."""
    g = {"a": jnp.array([1.0, -2.0, 0.5, 3.0]), "b": jnp.full((2, 2), 0.25)}
    if step == 2:
        g = jax.tree.map(lambda x: 40.0 * x, g)
    if step == 3:
        g["b"] = g["b"].at[0, 1].set(jnp.inf)
    return g


def run(tx, fused: bool, jit: bool):
    """Five steps from ``params()``: the params after each."""
    if fused:

        def step(p, s, g):
            return gradtools.apply_gradients(tx, g, s, p)
    else:

        def step(p, s, g):
            updates, s = tx.update(g, s, p)
            return optax.apply_updates(p, updates), s

    step = jax.jit(step) if jit else step
    p, s, history = params(), tx.init(params()), []
    for i in range(5):
        p, s = step(p, s, grads(i))
        history.append(p)
    return history


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", WRAPPERS)
def test_a_strict_inner_optimizer_steps_as_plain_sgd_does(name, jit, fused):
    make = WRAPPERS[name]
    got = run(make(strict_sgd()), fused, jit)
    want = run(make(plain_sgd()), fused, jit)
    for g, w in zip(got, want):
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), g, w)
    # the steps moved the params: a wrapper that never ran its inner could not pass
    assert not np.array_equal(got[-1]["a"], params()["a"])


def test_a_keyword_the_user_passes_still_reaches_the_inner_optimizer():
    """What the user passes is handed on: the strict update refuses it, naming it."""
    tx = gradtools.dynamic_loss_scale(optax.chain(clip(), strict_sgd()))
    p = params()
    with pytest.raises(TypeError, match="mine"):
        tx.update(grads(0), tx.init(p), p, mine=1)
