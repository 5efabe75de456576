"""Bad input gets a clear error that names the argument, never a crash deep inside JAX."""

import re

import jax
import jax.numpy as jnp
import numpy as np
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


@pytest.mark.parametrize("name", sorted(WITH_PARAMS))
def test_a_leaf_of_another_shape_is_refused_not_broadcast(name):
    # (1,) would broadcast silently against the params' (2,): every element would
    # get the gradient of the first, or a (2, 2) buffer would not fit the state.
    tx = WITH_PARAMS[name]()
    state = tx.init(PARAMS)
    for a in (jnp.ones(1), jnp.ones((2, 1))):
        grads = {"a": a, "b": {"c": jnp.ones(3)}}
        with pytest.raises(ValueError, match=f"{name}: the updates and the params differ in shape"):
            jax.jit(tx.update)(grads, state, PARAMS)
        with pytest.raises(ValueError, match=re.escape(f"['a']: {a.shape} against (2,)")):
            jax.jit(tx.update)(grads, state, PARAMS)


def test_accumulate_without_params_checks_grads_against_its_buffer():
    tx = gradtools.accumulate(optax.sgd(0.1), 2)
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match=re.escape("acc_grads (from init)")):
        jax.jit(tx.update)({"a": jnp.ones(2)}, state)
    with pytest.raises(ValueError, match=re.escape("acc_grads (from init) differ in shape")):
        jax.jit(tx.update)({"a": jnp.ones(1), "b": {"c": jnp.ones(3)}}, state)


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


COMPLEX = {"w": jnp.array([2 + 4j, -2 + 2j], jnp.complex64)}


@pytest.mark.parametrize(
    "tx",
    [
        gradtools.dynamic_loss_scale(optax.sgd(1.0)),
        gradtools.fixed_loss_scale(optax.sgd(1.0), 2.0),
        gradtools.accumulate(optax.sgd(1.0), 2),
        gradtools.clip_by_global_norm(1.0),
    ],
    ids=["dynamic_loss_scale", "fixed_loss_scale", "accumulate", "clip_by_global_norm"],
)
def test_complex_gradients_are_refused_not_made_real(tx):
    """Unscaling, norms and buffers are real float32: an imaginary part would be dropped."""
    with pytest.raises(TypeError, match=r"updates\['w'\] is complex \(complex64\)"):
        jax.jit(tx.update)(COMPLEX, tx.init(COMPLEX), COMPLEX)


# -- every public function, wrong types and out-of-range values ---------------------------------

G, S = gradtools, gradtools.schedules
V, T = ValueError, TypeError
SGD = optax.sgd(0.1)
MULTI = optax.MultiSteps(SGD, 2)  # has init and update, but is no GradientTransformation
NAN, INF = float("nan"), float("inf")
SGD_STATE = SGD.init(PARAMS)
SGD_ARGS = (jnp.ones(2), SGD.init(jnp.ones(2)))
SCALED_STATE = G.dynamic_loss_scale(SGD).init(PARAMS)


def accumulate_update(**kwargs):
    tx = G.accumulate(SGD, 2)
    return jax.jit(lambda g, s: tx.update(g, s, **kwargs))(PARAMS, tx.init(PARAMS))


# function: [(error, regex the message must match, call)]
BAD = {
    "dynamic_loss_scale": [
        (T, "inner=<function adam .* call it", lambda: G.dynamic_loss_scale(optax.adam)),
        (T, "inner=<.*MultiSteps.* gradtools.accumulate", lambda: G.dynamic_loss_scale(MULTI)),
        (T, r"inner=\[\] .* e.g. optax.adam\(1e-3\)", lambda: G.dynamic_loss_scale([])),
        (V, "init_scale=None", lambda: G.dynamic_loss_scale(SGD, init_scale=None)),
        (V, "growth_interval='3'", lambda: G.dynamic_loss_scale(SGD, growth_interval="3")),
        (V, r"backoff_factor=\[0.5\]", lambda: G.dynamic_loss_scale(SGD, backoff_factor=[0.5])),
        (V, "max_scale=nan", lambda: G.dynamic_loss_scale(SGD, max_scale=NAN)),
        (T, "axis_name=", lambda: G.dynamic_loss_scale(SGD, axis_name=["batch"])),
        # bools, and values float32 (the state's dtype) cannot hold or rounds past a limit
        (
            V,
            "init_scale=True must be a real number, not a bool",
            lambda: G.dynamic_loss_scale(SGD, init_scale=True),
        ),
        (
            V,
            r"max_scale=1e\+39 must be a finite number > 0 \(float32 rounds it to inf\)",
            lambda: G.dynamic_loss_scale(SGD, max_scale=1e39),
        ),
        (
            V,
            r"min_scale=1e-50 must be a finite number > 0 \(float32 rounds it to 0.0\)",
            lambda: G.dynamic_loss_scale(SGD, min_scale=1e-50),
        ),
        (
            V,
            r"growth_factor=1.0 must be a finite number > 1",
            lambda: G.dynamic_loss_scale(SGD, growth_factor=1.0),
        ),
        (
            V,
            r"growth_factor=1.000000000001 .*float32 rounds it to 1.0",
            lambda: G.dynamic_loss_scale(SGD, growth_factor=1 + 1e-12),
        ),
        (
            V,
            r"backoff_factor=0.999999999 .*float32 rounds it to 1.0",
            lambda: G.dynamic_loss_scale(SGD, backoff_factor=1 - 1e-9),
        ),
        (
            V,
            r"growth_interval=2147483648 must be at most 2\*\*31 - 1",
            lambda: G.dynamic_loss_scale(SGD, growth_interval=2**31),
        ),
    ],
    "fixed_loss_scale": [
        (T, "inner='sgd'", lambda: G.fixed_loss_scale("sgd")),
        (V, "scale=-1.0", lambda: G.fixed_loss_scale(SGD, -1.0)),
        (V, "scale=Array", lambda: G.fixed_loss_scale(SGD, jnp.ones(2))),
        (V, "skip_nonfinite=None", lambda: G.fixed_loss_scale(SGD, skip_nonfinite=None)),
        (T, "axis_name=", lambda: G.fixed_loss_scale(SGD, axis_name={"batch"})),
        (V, "scale=True must be a real number, not a bool", lambda: G.fixed_loss_scale(SGD, True)),
        (V, r"scale=1e\+39 .*float32 rounds it to inf", lambda: G.fixed_loss_scale(SGD, 1e39)),
    ],
    "scale_loss": [
        (T, "loss='0.5'", lambda: G.scale_loss("0.5", SCALED_STATE)),
        (T, "loss=None", lambda: G.scale_loss(None, SCALED_STATE)),
        (T, "loss=Array", lambda: G.scale_loss(jnp.int32(3), SCALED_STATE)),
        (V, "opt_state holds no LossScaleState", lambda: G.scale_loss(0.5, SGD_STATE)),
    ],
    "loss_scale": [(V, "opt_state holds no LossScaleState", lambda: G.loss_scale(None))],
    "nonfinite_leaves": [
        (V, "opt_state holds no LossScaleState", lambda: G.nonfinite_leaves(None, PARAMS)),
        (
            V,
            "params has 1 leaves, the loss scaler's params had",
            lambda: G.nonfinite_leaves(G.dynamic_loss_scale(optax.sgd(0.1)).init(PARAMS), [0.0]),
        ),
    ],
    "all_finite": [
        (T, r"tree\['a'\]='x'", lambda: G.all_finite({"a": "x"})),
        (T, r"tree\[1\]=<object", lambda: G.all_finite([1.0, object()])),
    ],
    "apply_gradients": [
        (T, "tx=", lambda: G.apply_gradients(optax.adam, PARAMS, (), PARAMS)),
        (V, "params=None", lambda: G.apply_gradients(SGD, PARAMS, SGD.init(PARAMS), None)),
    ],
    "train_step": [
        (T, "loss_fn='loss'", lambda: G.train_step("loss", SGD)),
        (T, "tx=", lambda: G.train_step(jnp.sum, optax.adam)),
        (V, "has_aux=1", lambda: G.train_step(jnp.sum, SGD, has_aux=1)),
        (
            T,
            "update_kwargs='flush'",
            lambda: G.train_step(jnp.sum, SGD)(*SGD_ARGS, update_kwargs="flush"),
        ),
    ],
    "label_params": [
        (T, "rules='a'", lambda: G.label_params(PARAMS, "a")),
        (V, r"rules\[0\]\[0\]='\('", lambda: G.label_params(PARAMS, [("(", 1)])),
        (V, r"rules\[0\] regex 'zzz' is unused", lambda: G.label_params(PARAMS, [("zzz", 1)], 0)),
    ],
    "param_groups": [
        (T, "rules=None", lambda: G.param_groups(None)),
        (T, r"rules\[0\]\[1\]='sgd'", lambda: G.param_groups([("a", "sgd")])),
        (T, "default=", lambda: G.param_groups([("a", SGD)], default=optax.sgd)),
        (V, r"rules\[0\] regex 'zzz'", lambda: G.param_groups([("zzz", SGD)], SGD).init(PARAMS)),
    ],
    "freeze": [
        (T, r"patterns=\[\]", lambda: G.freeze(SGD, [])),
        (T, r"patterns\[0\]=5", lambda: G.freeze(SGD, [5])),
        (V, r"patterns\[0\]='\('", lambda: G.freeze(SGD, "(")),
        (V, "pattern 'zzz' matches no parameter", lambda: G.freeze(SGD, "zzz").init(PARAMS)),
    ],
    "describe": [
        (T, "rules='a'", lambda: G.describe(PARAMS, rules="a")),
        (V, r"rules\[0\] regex 'zzz'", lambda: G.describe(PARAMS, [("zzz", "g")])),
    ],
    "accumulate": [
        (V, "every_k=0", lambda: G.accumulate(SGD, 0)),
        (V, "every_k=2.0", lambda: G.accumulate(SGD, 2.0)),
        (V, "every_k='2'", lambda: G.accumulate(SGD, "2")),
        (V, "average=None", lambda: G.accumulate(SGD, 2, average=None)),
        (V, "dtype=", lambda: G.accumulate(SGD, 2, dtype=jnp.int8)),
        (V, "dtype='no dtype'", lambda: G.accumulate(SGD, 2, dtype="no dtype")),
        (V, r"every_k=2147483648 must be at most 2\*\*31 - 1", lambda: G.accumulate(SGD, 2**31)),
        (V, "on_nonfinite='skip'", lambda: G.accumulate(SGD, 2, on_nonfinite="skip")),
        (V, "weight='x'", lambda: accumulate_update(weight="x")),
        (V, "weight must be a scalar", lambda: accumulate_update(weight=jnp.ones(2))),
        (V, r"weight=1j must be a real number", lambda: accumulate_update(weight=1j)),
        (V, "flush must be a scalar bool.*got None", lambda: accumulate_update(flush=None)),
        (V, "flush must be a scalar bool.*got 1", lambda: accumulate_update(flush=1)),
        (
            V,
            "flush must be a scalar bool.*got Array",
            lambda: accumulate_update(flush=jnp.ones(2, bool)),
        ),
    ],
    "clip_by_global_norm": [
        (V, "max_norm=0.0", lambda: G.clip_by_global_norm(0.0)),
        (V, "max_norm=inf", lambda: G.clip_by_global_norm(INF)),
        (V, "max_norm=None", lambda: G.clip_by_global_norm(None)),
        (V, "norm_type=0.5", lambda: G.clip_by_global_norm(1.0, norm_type=0.5)),
        (V, "norm_type='fro'", lambda: G.clip_by_global_norm(1.0, norm_type="fro")),
        (V, "norm_type=True", lambda: G.clip_by_global_norm(1.0, norm_type=True)),
        (V, "norm_type='2'", lambda: G.clip_by_global_norm(1.0, norm_type="2")),
        (V, "max_norm=True must be a real number, not a bool", lambda: G.clip_by_global_norm(True)),
        (V, r"max_norm=1e-50 .*float32 rounds it to 0.0", lambda: G.clip_by_global_norm(1e-50)),
    ],
    "spike_guard": [
        (T, "inner=<function sgd .* call it", lambda: G.spike_guard(optax.sgd)),
        (V, "z_threshold=0", lambda: G.spike_guard(SGD, z_threshold=0)),
        (
            V,
            "z_threshold='2.5' must be a real number",
            lambda: G.spike_guard(SGD, z_threshold="2.5"),
        ),
        (V, "decay=1.0 must be strictly between", lambda: G.spike_guard(SGD, decay=1.0)),
        (V, "warmup_steps=-1 must be an int >= 0", lambda: G.spike_guard(SGD, warmup_steps=-1)),
        (V, "warmup_steps=2.0 must be an int >= 0", lambda: G.spike_guard(SGD, warmup_steps=2.0)),
        (
            V,
            r"action='clamp' must be one of \('clip', 'skip'\)",
            lambda: G.spike_guard(SGD, action="clamp"),
        ),
        (V, "norm_type=0.5", lambda: G.spike_guard(SGD, norm_type=0.5)),
    ],
    "group_norms": [
        (T, r"rules\[0\]\[1\]=None must be a non-empty str", lambda: G.group_norms([("a", None)])),
        (T, "default=3 must be a non-empty str", lambda: G.group_norms([("a", "a")], default=3)),
        (V, "rules.*'\\(' is not a valid regular expression", lambda: G.group_norms([("(", "a")])),
        (V, "norm_type=0", lambda: G.group_norms([("a", "a")], norm_type=0)),
    ],
    "stochastic_rounding": [
        (V, "seed=1.5 must be an int", lambda: G.stochastic_rounding(1.5)),
        (V, "seed=True must be an int", lambda: G.stochastic_rounding(True)),
        (
            V,
            r"seed=Array\(\[1, 2\], .* must be an int",
            lambda: G.stochastic_rounding(jnp.asarray([1, 2])),
        ),
        (
            V,
            r"seed=2147483648 must be an int from 0 to 2\*\*31 - 1",
            lambda: G.stochastic_rounding(2**31),
        ),
        (
            V,
            "stochastic_rounding: params=None",
            lambda: G.stochastic_rounding().update(PARAMS, G.stochastic_rounding().init(PARAMS)),
        ),
    ],
    "global_norm": [
        (T, r"tree\['a'\]='x'", lambda: G.global_norm({"a": "x"})),
        (
            T,
            r"tree\['a'\] is complex \(complex64\)",
            lambda: G.global_norm({"a": jnp.ones(2, jnp.complex64)}),
        ),
        (V, "norm_type=nan", lambda: G.global_norm(PARAMS, norm_type=NAN)),
        (V, "not complex", lambda: G.global_norm(PARAMS, norm_type=np.complex128(2.0))),
    ],
    "schedules.piecewise_constant": [
        (T, "milestones=5", lambda: S.piecewise_constant(5, [0.1])),
        (T, "values=None", lambda: S.piecewise_constant([5], None)),
        (V, r"milestones\[0\]=2.5", lambda: S.piecewise_constant([2.5], [0.1])),
    ],
    "schedules.exponential_decay": [
        (V, "learning_rate=None", lambda: S.exponential_decay(None, 0.9, 2)),
        (V, "decay_rate=0.0", lambda: S.exponential_decay(0.1, 0.0, 2)),
        (V, "staircase='yes'", lambda: S.exponential_decay(0.1, 0.9, 2, staircase="yes")),
        (
            V,
            r"learning_rate=1e\+39 .*float32 rounds it to inf",
            lambda: S.exponential_decay(1e39, 0.9, 2),
        ),
    ],
    "schedules.natural_exp_decay": [
        (V, "decay_rate='0.5'", lambda: S.natural_exp_decay(0.1, "0.5", 2)),
        (V, "decay_steps=0", lambda: S.natural_exp_decay(0.1, 0.5, 0)),
    ],
    "schedules.inverse_time_decay": [
        (V, "decay_rate=inf", lambda: S.inverse_time_decay(0.1, INF, 2)),
        (V, "decay_steps=1.5", lambda: S.inverse_time_decay(0.1, 0.5, 1.5)),
    ],
    "schedules.cosine_decay": [
        (V, "min_lr=None", lambda: S.cosine_decay(None, 0.1, 10)),
        (V, "decay_steps='10'", lambda: S.cosine_decay(0.0, 0.1, "10")),
    ],
    "schedules.polynomial_decay": [
        (V, "power=-1.0", lambda: S.polynomial_decay(0.1, 0.0, 4, -1.0)),
        (V, "end_learning_rate='0'", lambda: S.polynomial_decay(0.1, "0", 4)),
        (V, "update_decay_steps=0", lambda: S.polynomial_decay(0.1, 0.0, 4, update_decay_steps=0)),
    ],
    "schedules.warmup": [
        (V, r"learning_rate=\[0.1\]", lambda: S.warmup([0.1], 2)),
        (V, "warmup_steps=-1", lambda: S.warmup(0.1, -1)),
        (V, "learning_rate=True must be a real number, not a bool", lambda: S.warmup(True, 2)),
    ],
    "schedules.with_warmup": [
        (T, "schedule=0.1", lambda: S.with_warmup(0.1, 2)),
        (V, "warmup_steps=None", lambda: S.with_warmup(S.warmup(0.1, 2), None)),
        (V, "init_value=nan", lambda: S.with_warmup(S.warmup(0.1, 2), 2, NAN)),
    ],
    "schedules.per_epoch": [
        (T, "schedule=None", lambda: S.per_epoch(None, 2)),
        (V, "steps_per_epoch=1.5", lambda: S.per_epoch(S.warmup(0.1, 2), 1.5)),
    ],
    "schedules.to_list": [
        (T, "schedule='cosine'", lambda: S.to_list("cosine", 2)),
        (V, "total_steps=-3", lambda: S.to_list(S.warmup(0.1, 2), -3)),
    ],
    "schedules.from_list": [
        (V, "values='abc'", lambda: S.from_list("abc")),
        (V, "values=None", lambda: S.from_list(None)),
        (V, r"values=\[\[0.1\]\]", lambda: S.from_list([[0.1]])),
        (V, r"values=\[-1.0\]", lambda: S.from_list([-1.0])),
        (
            V,
            r"values=\[1e\+39\] must all be finite numbers >= 0 in float32",
            lambda: S.from_list([1e39]),
        ),
    ],
}
CASES = [
    pytest.param(error, match, call, id=f"{name}: {match}")
    for name, cases in BAD.items()
    for error, match, call in cases
]
# Public functions for which no input is bad, and what they make of anything.
ANY_INPUT = {
    "metrics": lambda: G.metrics("not a state") == {},
    "path_names": lambda: G.path_names({"a": "x", "b": None}) == {"a": "a", "b": None},
    "decay_mask": lambda: G.decay_mask({"w": "x"}) == {"w": False},
    "frozen": lambda: G.frozen().init("anything") == optax.EmptyState(),
}


def public_functions():
    for name in G.__all__:
        obj = getattr(G, name)
        if name == "schedules":
            yield from (f"schedules.{sub}" for sub in obj.__all__)
        elif callable(obj) and not isinstance(obj, type):
            yield name


def test_every_public_function_is_called_with_bad_input():
    assert set(public_functions()) - set(BAD) - set(ANY_INPUT) == set()
    assert all(check() for check in ANY_INPUT.values())


@pytest.mark.parametrize("error, match, call", CASES)
def test_bad_input_raises_an_error_naming_the_argument(error, match, call):
    with pytest.raises(error, match=match) as info:
        call()
    # raised by gradtools itself, not by JAX, NumPy or optax further down
    assert info.traceback[-1].path.parent.name == "gradtools", info.traceback[-1]


def test_the_largest_int32_count_is_accepted():
    gradtools.accumulate(optax.sgd(0.1), 2**31 - 1)
    gradtools.dynamic_loss_scale(optax.sgd(0.1), growth_interval=2**31 - 1)
    with pytest.raises(ValueError, match=r"every_k.*2\*\*31 - 1"):
        gradtools.accumulate(optax.sgd(0.1), 2**31)


def test_numpy_bools_are_accepted_where_bools_are():
    tx = optax.sgd(0.5)
    step = gradtools.train_step(lambda p: (jnp.sum(p**2), 2 * p), tx, has_aux=np.True_)
    params = jnp.array([1.0, 2.0])
    new, _, m = step(params, tx.init(params))
    np.testing.assert_array_equal(new, [0.0, 0.0])  # p - 0.5 * 2p
    np.testing.assert_array_equal(m["aux"], [2.0, 4.0])
    tx = gradtools.accumulate(optax.sgd(1.0), 2, average=np.False_)
    _, state = tx.update(jnp.ones(2), tx.init(params), params)
    u, _ = tx.update(jnp.ones(2), state, params)
    np.testing.assert_array_equal(u, [-2.0, -2.0])  # the sum of the window, not its mean


def test_compiled_patterns_must_be_str_patterns():
    params = {"w": jnp.ones(2), "b": jnp.ones(2)}
    tx = gradtools.freeze(optax.sgd(1.0), re.compile(r"^b"))
    u, _ = tx.update(params, tx.init(params), params)
    assert np.asarray(u["w"]).tolist() == [-1.0, -1.0] and not np.any(u["b"])
    with pytest.raises(TypeError, match="patterns"):
        gradtools.freeze(optax.sgd(1.0), re.compile(rb"^b"))
    with pytest.raises(TypeError, match=r"rules\[0\]"):
        gradtools.param_groups([(re.compile(rb"^b"), gradtools.frozen())])


def test_scale_loss_refuses_a_complex_loss():
    state = gradtools.dynamic_loss_scale(optax.sgd(0.1)).init(jnp.ones(2))
    assert float(gradtools.scale_loss(jnp.float32(2.0), state)) == 2.0 * 2.0**15
    with pytest.raises(TypeError, match="loss"):
        gradtools.scale_loss(jnp.complex64(1.0 + 2.0j), state)
