"""Each test of ``gradtools/_compat.py`` against the real optax and flax objects.

CI runs these on the oldest and the newest optax and flax it supports
(``.ci/run``): a release that renames a class or rewrites a function these
tests recognise breaks a test here first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

from gradtools import _compat


def test_set_to_zero_is_recognised_and_look_alikes_are_not():
    assert _compat.is_set_to_zero(optax.set_to_zero())
    # the same init, optax.init_empty_state, and the same empty state
    assert not _compat.is_set_to_zero(optax.identity())
    assert not _compat.is_set_to_zero(optax.sgd(0.1))
    assert not _compat.is_set_to_zero("frozen")


def test_a_chains_members_are_found_in_order_and_other_combinators_have_none():
    clip, sgd = optax.clip(1.0), optax.sgd(0.1)
    chain = optax.chain(clip, sgd)
    members = _compat.chain_members(chain.update)
    assert members is not None and len(members) == 2
    # they are the members' own updates, in order (a GradientTransformation is wrapped to
    # take extra arguments: its update is then a function that calls the member's)
    assert members[1] is sgd.update  # optax builds sgd as a chain: extra arguments already
    updates, _ = members[0]({"w": jnp.full(2, 3.0)}, clip.init({}), None)
    assert float(updates["w"][0]) == 1.0  # the clip, not the sgd
    assert _compat.chain_members(members[1]) is not None  # sgd is a chain itself
    assert len(_compat.chain_members(optax.chain(optax.identity()).update)) == 1
    for other in (
        optax.named_chain(("a", optax.sgd(0.1))),
        optax.scale(0.1),
        optax.multi_transform({"a": optax.sgd(0.1)}, "a"),
    ):
        assert _compat.chain_members(other.update) is None
    assert _compat.chain_members(None) is None
    # what a chain's state is: a tuple of the members' states, in their order
    state = chain.init({"w": jnp.ones(2)})
    assert type(state) is tuple and len(state) == 2
    assert state[0] == clip.init({"w": jnp.ones(2)})


def test_the_state_of_inject_hyperparams_is_found():
    tx = optax.chain(optax.identity(), optax.inject_hyperparams(optax.sgd)(learning_rate=0.25))
    found = _compat.hyperparam_states(tx.init({"w": jnp.ones(2)}))
    assert len(found) == 1
    assert float(found[0].hyperparams["learning_rate"]) == 0.25
    assert _compat.hyperparam_states(optax.sgd(0.1).init({"w": jnp.ones(2)})) == []


def test_a_refused_keyword_is_recognised_in_pythons_message():
    def update(updates, state, params=None):
        return updates, state

    with pytest.raises(TypeError) as caught:
        update(1, 2, value=3)  # pyright: ignore[reportCallIssue]
    assert _compat.refused_keyword(caught.value, "value")
    assert not _compat.refused_keyword(caught.value, "val")
    assert not _compat.refused_keyword(TypeError("'value' must be an array"), "value")


def test_flax_fp8_meta_is_recognised_by_its_type_name():
    fp8_ops = pytest.importorskip("flax.linen.fp8_ops")
    nnx = pytest.importorskip("flax.nnx")
    assert fp8_ops.OVERWRITE_WITH_GRADIENT == _compat.FP8_META
    meta_type = nnx.variable_type_from_name(_compat.FP8_META, allow_register=True)
    assert _compat.is_fp8_meta((), meta_type(jnp.zeros(2)))
    assert not _compat.is_fp8_meta((), nnx.Param(jnp.zeros(2)))


def test_flax_fp8_output_gradient_meta_is_named_as_recognised():
    """flax's fp8 dense layer keeps the backward pass's meta under ``output_grad_*`` names."""
    linen = pytest.importorskip("flax.linen")
    fp8_ops = pytest.importorskip("flax.linen.fp8_ops")
    layer = linen.Dense(4, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp)
    variables = layer.init(jax.random.key(0), jnp.ones((2, 3)))
    (op,) = variables[_compat.FP8_META].values()
    names = set(op)
    assert {n for n in names if _compat.is_output_grad_meta(n)} == {
        "output_grad_amax_history",
        "output_grad_scale",
    }
    assert len(names) == 6  # input, kernel and output_grad: an amax history and a scale each
