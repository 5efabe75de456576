"""Bad input gets a clear error that names the argument, never a crash deep inside JAX."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import gradtools

PARAMS = {"a": jnp.ones(2), "b": {"c": jnp.ones(3)}}

# Transforms that read the params (to cast, split or mirror them), by the name in their errors.
WITH_PARAMS = {
    "dynamic_loss_scale": lambda: gradtools.dynamic_loss_scale(optax.adam(0.1)),
    "fixed_loss_scale": lambda: gradtools.fixed_loss_scale(optax.adam(0.1)),
    "accumulate": lambda: gradtools.accumulate(optax.adam(0.1), 2),
    "param_groups": lambda: gradtools.param_groups([("a", optax.sgd(0.1))], optax.adam(0.1)),
    "freeze": lambda: gradtools.freeze(optax.adam(0.1), "a"),
}
MISMATCHED = {  # (grads, params, a leaf path the message must name)
    "grads_lack_a_leaf": ({"a": jnp.ones(2), "b": {}}, PARAMS, "['b']['c']"),
    "grads_have_an_extra_leaf": ({**PARAMS, "d": jnp.ones(1)}, PARAMS, "['d']"),
    "grads_are_a_list": ([jnp.ones(2), jnp.ones(3)], PARAMS, "['a']"),
    "params_of_another_model": (PARAMS, {"a": jnp.ones(2), "x": {"c": jnp.ones(3)}}, "['x']['c']"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHED))
@pytest.mark.parametrize("name", sorted(WITH_PARAMS))
def test_mismatched_trees_name_both_structures_at_trace_time(name, case):
    grads, params, path = MISMATCHED[case]
    tx = WITH_PARAMS[name]()
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match=f"{name}: the updates and the params differ") as err:
        jax.jit(tx.update)(grads, state, params)
    message = str(err.value)
    assert path in message
    assert "updates: PyTreeDef(" in message and "params: PyTreeDef(" in message


def test_accumulate_without_params_checks_grads_against_its_buffer():
    tx = gradtools.accumulate(optax.sgd(0.1), 2)
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match=re.escape("acc_grads (from init)")):
        jax.jit(tx.update)({"a": jnp.ones(2)}, state)


def test_matching_trees_with_none_and_masked_nodes_pass():
    params = {"a": jnp.ones(2), "n": None, "e": {}, "m": optax.MaskedNode()}
    for make in WITH_PARAMS.values():
        tx = make()
        updates, _ = jax.jit(tx.update)(params, tx.init(params), params)
        assert jax.tree.structure(updates) == jax.tree.structure(params)


def test_accumulate_under_inject_hyperparams_says_what_to_make_static():
    params = {"w": jnp.ones(2)}
    inject = optax.inject_hyperparams
    # dtype=jnp.float32 is callable: inject_hyperparams would evaluate it as a schedule.
    with pytest.raises(ValueError, match=r"dtype=Array\(0\..*name 'dtype' in static_args"):
        inject(gradtools.accumulate, static_args="every_k")(optax.sgd(0.1), 2).init(params)
    tx = inject(gradtools.accumulate, static_args="dtype")(optax.sgd(0.1), every_k=2)
    with pytest.raises(ValueError, match=r"every_k=.* cannot be traced.*'every_k' in static_args"):
        jax.jit(tx.update)(params, tx.init(params), params)
    tx = inject(gradtools.accumulate, static_args=("every_k", "dtype"))(optax.sgd(1.0), every_k=2)
    update, state = jax.jit(tx.update), tx.init(params)
    u, state = update(params, state, params)
    u, state = update(params, state, params)
    assert u["w"].tolist() == [-1.0, -1.0]


NUMBER_AS_STRING = [
    ("scale", lambda: gradtools.fixed_loss_scale(optax.sgd(0.1), "1024")),
    ("init_scale", lambda: gradtools.dynamic_loss_scale(optax.sgd(0.1), init_scale="256")),
    ("max_norm", lambda: gradtools.clip_by_global_norm("1.0")),
    ("learning_rate", lambda: gradtools.schedules.exponential_decay("0.1", 0.9, 2)),
    ("power", lambda: gradtools.schedules.polynomial_decay(0.1, 0.0, 4, "2")),
    ("init_value", lambda: gradtools.schedules.with_warmup(optax.constant_schedule(0.1), 2, "0")),
]


@pytest.mark.parametrize("name, build", NUMBER_AS_STRING, ids=[n for n, _ in NUMBER_AS_STRING])
def test_numbers_given_as_strings_are_rejected(name, build):
    """float('1e-3') parses, but a string hyperparameter would fail later, inside JAX."""
    with pytest.raises(ValueError, match=f"{name}='.*' must be a real number, not a string"):
        build()
