"""Parameter groups: names, rules, freezing, per-group optimizers, describe.

References are hand-applied optax on the split sub-trees, or NumPy; never the
code under test.
"""

import functools
import re
from typing import NamedTuple

import chex
import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import gradtools

CONV = ("conv1", "conv2")
FC = ("fc1", "fc2", "fc3")
LENET_NAMES = [f"params/{layer}/{p}" for layer in CONV + FC for p in ("bias", "kernel")]


class LeNet(nn.Module):
    """LeNet-5 on 32x32x1 inputs: 61,706 parameters."""

    @nn.compact
    def __call__(self, x):
        for name, features in zip(CONV, (6, 16)):
            x = nn.Conv(features, (5, 5), padding="VALID", name=name)(x)
            x = nn.avg_pool(nn.relu(x), (2, 2), (2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(120, name="fc1")(x))
        x = nn.relu(nn.Dense(84, name="fc2")(x))
        return nn.Dense(10, name="fc3")(x)


@functools.cache
def lenet():
    """(variables, batch) for the Linen LeNet, built once.

    The tree is Linen's (``eval_shape`` of ``init``); the values are drawn with
    NumPy, scaled like LeCun-normal, which spares compiling the initialisers.
    """
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 32, 32, 1)), jnp.float32)
    y = jnp.arange(4) % 10
    shapes = jax.eval_shape(LeNet().init, jax.random.key(0), x[:1])
    fan_in = lambda s: int(np.prod(s.shape[:-1])) if len(s.shape) > 1 else 1  # noqa: E731
    variables = jax.tree.map(
        lambda s: jnp.asarray(rng.standard_normal(s.shape) / np.sqrt(fan_in(s)), s.dtype), shapes
    )
    return variables, (x, y)


def loss_fn(variables, x, y):
    logits = LeNet().apply(variables, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def split(variables):
    """The conv and fc halves of a LeNet tree, as plain dicts."""
    p = variables["params"]
    return {k: p[k] for k in CONV}, {k: p[k] for k in FC}


def join(conv, fc):
    return {"params": {**conv, **fc}}


def state_arrays(state):
    leaves = jax.tree.leaves(state)
    return len(leaves), sum(x.size * x.dtype.itemsize for x in leaves)


# -- names and rules -----------------------------------------------------------------------------


class Pair(NamedTuple):
    left: object
    right: object


def test_path_names_linen_plain_and_nnx():
    variables, _ = lenet()
    assert jax.tree.leaves(gradtools.path_names(variables)) == LENET_NAMES

    tree = {"a": [1, Pair(2, {"x": 3})], "b": None, "c": {}, "d": (4,)}
    named = gradtools.path_names(tree)
    assert named == {"a": ["a/0", Pair("a/1/left", {"x": "a/1/right/x"})], "b": None, "c": {},
                     "d": ("d/0",)}  # fmt: skip

    model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.LayerNorm(3, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)  # nnx.Variable leaves, as nnx.Optimizer's init sees
    expected = ["layers/0/bias", "layers/0/kernel", "layers/1/bias", "layers/1/scale"]
    assert jax.tree.leaves(gradtools.path_names(state)) == expected
    if hasattr(nnx, "as_pure"):  # newer flax hands update plain arrays
        assert jax.tree.leaves(gradtools.path_names(nnx.as_pure(state))) == expected
    # decay_mask and label_params see each nnx.Variable as one leaf.
    assert nnx.to_pure_dict(gradtools.decay_mask(state)) == {
        "layers": {0: {"bias": False, "kernel": True}, 1: {"bias": False, "scale": False}}
    }
    labels = gradtools.label_params(state, [(r"^layers/1/", "norm")], default="linear")
    assert jax.tree.leaves(labels) == ["linear", "linear", "norm", "norm"]


def test_partitioned_params_are_named_as_unboxed():
    """nn.with_partitioning boxes a param; its array is the box's field ``value``."""

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
            x = nn.Dense(3, kernel_init=init)(x)
            return nn.Dense(1)(x)

    variables = Net().init(jax.random.key(0), jnp.ones((1, 2)))
    assert isinstance(variables["params"]["Dense_0"]["kernel"], nn.Partitioned)
    names = ["params/Dense_0/bias", "params/Dense_0/kernel", "params/Dense_1/bias"]
    assert jax.tree.leaves(gradtools.path_names(variables)) == [*names, "params/Dense_1/kernel"]
    tx = gradtools.freeze(optax.sgd(1.0), r"Dense_0/kernel$")
    grads = jax.tree.map(jnp.ones_like, variables)
    updates, _ = jax.jit(tx.update)(grads, tx.init(variables), variables)
    boxed = updates["params"]["Dense_0"]["kernel"]
    assert isinstance(boxed, nn.Partitioned) and boxed.names == (None, "model")
    np.testing.assert_array_equal(boxed.value, np.zeros((2, 3)))
    np.testing.assert_array_equal(updates["params"]["Dense_1"]["kernel"], -np.ones((3, 1)))


def test_label_params_first_match_wins():
    variables, _ = lenet()
    rules = [(r"fc3", "head"), (r"bias$", "bias"), (r"^params/fc", "fc")]
    labels = gradtools.label_params(variables, rules, default="conv")["params"]
    assert labels["fc3"] == {"bias": "head", "kernel": "head"}  # rule 0 before rule 1
    assert labels["fc1"] == {"bias": "bias", "kernel": "fc"}
    assert labels["conv2"] == {"bias": "bias", "kernel": "conv"}
    swapped = [rules[1], rules[0], rules[2]]
    labels = gradtools.label_params(variables, swapped, default="conv")["params"]
    assert labels["fc3"] == {"bias": "bias", "kernel": "head"}


def test_compiled_regexes_work_as_strings_do():
    variables, _ = lenet()
    rules = [(re.compile(r"FC3", re.IGNORECASE), "head"), (r"^params/fc", "fc")]
    labels = gradtools.label_params(variables, rules, default="conv")["params"]
    assert labels["fc3"] == {"bias": "head", "kernel": "head"}
    assert labels["fc1"] == {"bias": "fc", "kernel": "fc"}
    assert labels["conv1"] == {"bias": "conv", "kernel": "conv"}
    frozen = gradtools.freeze(optax.sgd(1.0), re.compile(r"CONV", re.IGNORECASE))
    grads = jax.tree.map(jnp.ones_like, variables)
    updates, _ = frozen.update(grads, frozen.init(variables), variables)
    assert not np.any(np.asarray(updates["params"]["conv1"]["kernel"]))
    np.testing.assert_array_equal(
        updates["params"]["fc1"]["kernel"], -grads["params"]["fc1"]["kernel"]
    )


def test_describe_and_param_groups_take_compiled_regexes():
    params = {"a": jnp.ones(2), "b": jnp.ones(3)}
    rules = [(re.compile(r"^a"), optax.sgd(1.0))]
    rows = [line.split() for line in gradtools.describe(params, rules).splitlines()[2:4]]
    assert rows == [
        ["a", "(2,)", "float32", "^a", "yes", "2"],
        ["b", "(3,)", "float32", "default", "yes", "3"],
    ]
    tx = gradtools.param_groups(rules, default=gradtools.frozen())
    updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
    np.testing.assert_array_equal(updates["a"], -1.0)
    np.testing.assert_array_equal(updates["b"], 0.0)
    # An unused compiled rule is named by its pattern, as a string rule is.
    with pytest.raises(ValueError, match=r"rules\[0\] regex '\^z' is unused"):
        gradtools.param_groups([(re.compile(r"^z"), optax.sgd(1.0))], optax.sgd(1.0)).init(params)


def test_freeze_patterns_may_overlap_and_any_match_freezes():
    variables, _ = lenet()
    grads = jax.tree.map(jnp.ones_like, variables)
    tx = gradtools.freeze(optax.sgd(1.0), [r"conv", r"conv1", r"fc3/bias$"])
    updates, _ = tx.update(grads, tx.init(variables), variables)
    moved = [name for name, u in zip(LENET_NAMES, jax.tree.leaves(updates)) if np.any(u)]
    assert moved == ["params/fc1/bias", "params/fc1/kernel", "params/fc2/bias",
                     "params/fc2/kernel", "params/fc3/kernel"]  # fmt: skip


def _listed(message):
    return [line.strip() for line in message.splitlines() if line.startswith("  ")]


def _raises_listing_names(match, fn, *args):
    """The error lists at most 5 of LeNet's 10 names; for an unused regex, those most like it."""
    with pytest.raises(ValueError, match=match) as err:
        fn(*args)
    listed = [n for n in _listed(str(err.value)) if not n.startswith("...")]
    assert 1 <= len(listed) <= 5 and set(listed) <= set(LENET_NAMES), listed
    if "conv3" in match:  # difflib's ratio: 2 * matching characters / total characters
        assert set(listed[:2]) == {"params/conv1/bias", "params/conv2/bias"}, listed


def test_rule_matching_nothing_lists_names():
    variables, _ = lenet()
    typo = [(r"conv3", optax.sgd(0.1))]
    _raises_listing_names(
        r"rules\[0\] regex 'conv3' is unused: it matches no",
        gradtools.param_groups(typo, default=optax.sgd(0.1)).init,
        variables,
    )
    _raises_listing_names("'conv3' is unused", gradtools.label_params, variables, [("conv3", 1)], 0)
    _raises_listing_names("'conv3' is unused", gradtools.describe, variables, [("conv3", 1)])
    _raises_listing_names(
        "pattern 'conv3' matches no parameter",
        gradtools.freeze(optax.sgd(0.1), [r"conv1", r"conv3"]).init,
        variables,
    )
    shadowed = [(r"conv", "a"), (r"conv1", "b")]
    _raises_listing_names(
        "taken by an earlier rule", gradtools.label_params, variables, shadowed, 0
    )


def test_parameter_matching_no_rule_lists_names():
    variables, _ = lenet()
    tx = gradtools.param_groups([(r"conv", optax.sgd(0.1))])
    _raises_listing_names(
        r"(?s)6 parameter\(s\) match no rule.*params/fc1/bias", tx.init, variables
    )
    _raises_listing_names("match no rule", gradtools.label_params, variables, [(r"conv", 1)])


def test_bad_rules_are_rejected_when_built():
    with pytest.raises(ValueError, match=r"rules\[1\]\[0\]='conv\[' is not a valid regular"):
        gradtools.param_groups([(r"fc", optax.sgd(0.1)), (r"conv[", optax.sgd(0.1))])
    with pytest.raises(ValueError, match=r"patterns\[0\]='\(conv' is not a valid"):
        gradtools.freeze(optax.sgd(0.1), "(conv")
    with pytest.raises(TypeError, match=r"rules\[0\]\[1\]='sgd' must be an optax"):
        gradtools.param_groups([(r"fc", "sgd")])
    with pytest.raises(TypeError, match="default=.*must be an optax"):
        gradtools.param_groups([], default=0.1)
    with pytest.raises(TypeError, match=r"rules\[0\]=.*must be a \(regex, value\) pair"):
        gradtools.param_groups([r"fc"])
    with pytest.raises(TypeError, match="must be a sequence of"):
        gradtools.param_groups({r"fc": optax.sgd(0.1)})
    with pytest.raises(TypeError, match="inner=.*must be an optax"):
        gradtools.freeze(None, [r"conv"])
    with pytest.raises(TypeError, match="patterns"):
        gradtools.freeze(optax.sgd(0.1), [])


# -- freezing ------------------------------------------------------------------------------------


def test_freeze_lenet_conv_matches_adam_on_fc_alone():
    variables, (x, y) = lenet()
    tx = gradtools.freeze(optax.adam(1e-3), [r"conv"])
    grad = jax.jit(jax.grad(loss_fn))

    @jax.jit
    def step(params, state):
        updates, state = tx.update(grad(params, x, y), state, params)
        return optax.apply_updates(params, updates), state

    ref_tx = optax.adam(1e-3)  # by hand on the fc half only

    @jax.jit
    def ref_step(conv, fc, state):
        _, g_fc = split(grad(join(conv, fc), x, y))
        u, state = ref_tx.update(g_fc, state, fc)
        return optax.apply_updates(fc, u), state

    params, state = variables, tx.init(variables)
    ref_conv, ref_fc = split(variables)
    ref_state = ref_tx.init(ref_fc)
    for _ in range(4):
        params, state = step(params, state)
        ref_fc, ref_state = ref_step(ref_conv, ref_fc, ref_state)

    conv, fc = split(params)
    init_conv, init_fc = split(variables)
    chex.assert_trees_all_equal(conv, init_conv)  # bit-identical
    for new, old in zip(jax.tree.leaves(fc), jax.tree.leaves(init_fc)):
        assert not np.array_equal(new, old)
    chex.assert_trees_all_close(fc, ref_fc, rtol=1e-6, atol=1e-7)


def test_frozen_params_hold_no_optimizer_state():
    variables, _ = lenet()
    n_all = 61_706
    n_conv = (5 * 5 * 1 + 1) * 6 + (5 * 5 * 6 + 1) * 16
    assert sum(x.size for x in jax.tree.leaves(variables)) == n_all
    # Adam: a count (int32) plus mu and nu (float32) per leaf of what it trains.
    assert state_arrays(optax.adam(1e-3).init(variables)) == (1 + 2 * 10, 4 + 8 * n_all)
    expected = (1 + 2 * 6, 4 + 8 * (n_all - n_conv))
    state = gradtools.freeze(optax.adam(1e-3), r"conv").init(variables)
    assert state_arrays(state) == expected
    assert state.inner_state[0].mu["params"]["conv1"] == {
        "bias": optax.MaskedNode(),
        "kernel": optax.MaskedNode(),
    }
    tx = gradtools.param_groups([(r"conv", gradtools.frozen())], default=optax.adam(1e-3))
    assert state_arrays(tx.init(variables)) == expected
    assert state_arrays(gradtools.frozen().init(variables)) == (0, 0)


def test_nnx_optimizer_trains_only_unfrozen_layers():
    class Small(nnx.Module):  # LeNet's layout, scaled down: conv1, conv2, fc1, fc2, fc3
        def __init__(self, rngs):
            self.conv1 = nnx.Conv(1, 2, (3, 3), padding="VALID", rngs=rngs)
            self.conv2 = nnx.Conv(2, 2, (3, 3), padding="VALID", rngs=rngs)
            self.fc1 = nnx.Linear(8, 4, rngs=rngs)
            self.fc2 = nnx.Linear(4, 4, rngs=rngs)
            self.fc3 = nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            x = nnx.avg_pool(nnx.relu(self.conv2(nnx.relu(self.conv1(x)))), (2, 2), (2, 2))
            x = nnx.relu(self.fc1(x.reshape(x.shape[0], -1)))
            return self.fc3(nnx.relu(self.fc2(x)))

    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 8, 1)), jnp.float32)
    y = jnp.array([0, 2])
    model = Small(nnx.Rngs(0))
    before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    optimizer = nnx.Optimizer(model, gradtools.freeze(optax.adam(1e-2), [r"conv"]), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer):
        def loss(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

        optimizer.update(model, nnx.grad(loss)(model))

    for _ in range(3):
        train_step(model, optimizer)
    after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for layer in CONV:
        chex.assert_trees_all_equal(after[layer], before[layer])
    for layer in FC:
        for p in ("kernel", "bias"):
            assert not np.array_equal(after[layer][p], before[layer][p])
    assert int(optimizer.step[...]) == 3
    # Adam's count plus mu and nu for the 6 fc leaves only.
    assert len(jax.tree.leaves(nnx.state(optimizer.opt_state))) == 1 + 2 * 6


# -- per-group optimizers ------------------------------------------------------------------------


def _fake_grads(variables, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda p: jnp.asarray(scale * rng.standard_normal(p.shape), jnp.float32), variables
    )


def test_per_group_learning_rates_match_sgd_by_hand():
    variables, _ = lenet()
    tx = gradtools.param_groups(
        [(r"conv", optax.sgd(0.0, momentum=0.9)), (r"fc", optax.sgd(0.1, momentum=0.9))]
    )
    ref_conv_tx, ref_fc_tx = optax.sgd(0.0, momentum=0.9), optax.sgd(0.1, momentum=0.9)
    update = jax.jit(tx.update)
    state = tx.init(variables)
    conv, fc = split(variables)
    s_conv, s_fc = ref_conv_tx.init(conv), ref_fc_tx.init(fc)
    for seed in range(3):
        grads = _fake_grads(variables, seed)
        updates, state = update(grads, state, variables)
        g_conv, g_fc = split(grads)
        u_conv, s_conv = jax.jit(ref_conv_tx.update)(g_conv, s_conv)
        u_fc, s_fc = jax.jit(ref_fc_tx.update)(g_fc, s_fc)
        chex.assert_trees_all_close(updates, join(u_conv, u_fc), rtol=1e-5, atol=1e-8)
        assert all(not np.any(u) for u in jax.tree.leaves(split(updates)[0]))
    # The first step in NumPy: -lr * g.
    grads = _fake_grads(variables, 7)
    updates, _ = update(grads, tx.init(variables), variables)
    for layer in FC:
        u, g = updates["params"][layer]["kernel"], grads["params"][layer]["kernel"]
        np.testing.assert_allclose(u, -0.1 * np.asarray(g), rtol=1e-6)


def test_a_loss_scaler_inside_a_group_must_leave_the_others_frozen():
    """``scale_loss`` scales the whole loss; a scaler in one group unscales only its own."""
    params = {"body": jnp.ones(2), "head": jnp.ones(2)}
    scaler = gradtools.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
    tx = gradtools.param_groups([(r"^head", scaler)], default=optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"'\^head' holds a loss scaler, but 'default'"):
        tx.init(params)
    # With the rest frozen the scaled gradients reach the scaler alone: sgd on g / 8.
    tx = gradtools.param_groups([(r"^head", scaler)], default=gradtools.frozen())
    step = jax.jit(gradtools.train_step(lambda p: jnp.sum(p["head"] ** 2 + p["body"] ** 2), tx))
    new, _, m = step(params, tx.init(params))
    np.testing.assert_allclose(new["head"], 1.0 - 0.1 * 2.0, rtol=1e-6)  # d/dw w**2 = 2w
    np.testing.assert_array_equal(new["body"], params["body"])
    assert float(m["loss_scale"]) == 8.0 and bool(m["finite"])


def test_optax_set_to_zero_is_a_frozen_group():
    """optax's own idiom for freezing gets what ``frozen()`` gets."""
    params = {"body": jnp.array([2.0, 1.0]), "head": jnp.ones(2)}
    rules = [(r"^head", optax.sgd(0.1)), (r"^body", optax.set_to_zero())]
    lines = gradtools.describe(params, rules).splitlines()
    assert lines[2].split()[-2:] == ["no", "2"] and lines[-2].split()[-1] == "2"  # frozen params
    # A loss scaler in the other group is allowed, as with frozen().
    scaler = gradtools.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
    tx = gradtools.param_groups([(r"^head", scaler)], default=optax.set_to_zero())
    state = tx.init(params)
    assert state.group_states[1] == optax.EmptyState()
    grads = {"body": jnp.full(2, 8.0), "head": jnp.full(2, 8.0)}
    new, _ = jax.jit(lambda g, s, p: gradtools.apply_gradients(tx, g, s, p))(grads, state, params)
    np.testing.assert_allclose(new["head"], 1.0 - 0.1, rtol=1e-6)
    np.testing.assert_array_equal(new["body"], params["body"])


def test_per_group_weight_decay():
    variables, _ = lenet()
    grads = _fake_grads(variables)
    conv, fc = split(variables)
    g_conv, g_fc = split(grads)

    # adamw per group against adamw applied to each half by hand, two steps.
    conv_tx, fc_tx = optax.adamw(1e-2, weight_decay=0.0), optax.adamw(1e-2, weight_decay=0.5)
    tx = gradtools.param_groups([(r"conv", conv_tx)], default=fc_tx)
    state, s_conv, s_fc = tx.init(variables), conv_tx.init(conv), fc_tx.init(fc)
    for _ in range(2):
        updates, state = jax.jit(tx.update)(grads, state, variables)
        u_conv, s_conv = jax.jit(conv_tx.update)(g_conv, s_conv, conv)
        u_fc, s_fc = jax.jit(fc_tx.update)(g_fc, s_fc, fc)
        chex.assert_trees_all_close(updates, join(u_conv, u_fc), rtol=1e-6, atol=1e-8)

    # sgd with decay 0 / 0.5 in NumPy: -lr * (g + wd * p).
    def sgd_wd(wd):
        return optax.chain(optax.add_decayed_weights(wd), optax.sgd(0.1))

    tx = gradtools.param_groups([(r"conv", sgd_wd(0.0)), (r"fc", sgd_wd(0.5))])
    updates, _ = jax.jit(tx.update)(grads, tx.init(variables), variables)
    for layer in CONV + FC:
        wd = 0.5 if layer in FC else 0.0
        for p in ("kernel", "bias"):
            g, w = (np.asarray(t["params"][layer][p]) for t in (grads, variables))
            np.testing.assert_allclose(updates["params"][layer][p], -0.1 * (g + wd * w), rtol=1e-6)


def test_decay_mask_matches_the_last_path_component_whole():
    params = {"attn_bias": jnp.ones((2, 2)), "logit_scale": jnp.ones((2, 2))}
    params["x"] = {"bias": jnp.ones((2, 2)), "scale": jnp.ones((2, 2))}  # 2-D, excluded by name
    mask = gradtools.decay_mask(params)
    assert mask == {"attn_bias": True, "logit_scale": True, "x": {"bias": False, "scale": False}}


def test_freeze_hands_extra_args_to_inner(scale_by_factor):
    tx = gradtools.freeze(scale_by_factor, r"^a$")
    params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    grads = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0, 4.0])}
    updates, _ = jax.jit(lambda g, s: tx.update(g, s, params, factor=3.0))(grads, tx.init(params))
    np.testing.assert_array_equal(updates["a"], [0.0, 0.0])
    np.testing.assert_array_equal(updates["b"], [9.0, 12.0])


class _Unkeyed:
    """A pytree node registered without keys: its children have flat indices."""

    def __init__(self, x, y):
        self.x, self.y = x, y


jax.tree_util.register_pytree_node(
    _Unkeyed, lambda n: ((n.x, n.y), None), lambda _, children: _Unkeyed(*children)
)


def test_children_of_an_unkeyed_node_are_named_by_index():
    tree = {"m": _Unkeyed(jnp.ones(2), jnp.ones(3))}
    assert jax.tree.leaves(gradtools.path_names(tree)) == ["m/0", "m/1"]
    labels = gradtools.label_params(tree, [(r"^m/1$", "second")], default="first")
    assert jax.tree.leaves(labels) == ["first", "second"]


@pytest.mark.parametrize(
    "call",
    [
        lambda: gradtools.label_params({"a": 1}, [("a", "x", "y")]),
        lambda: gradtools.param_groups([("a", optax.sgd(0.1), 0.5)]),
        lambda: gradtools.describe({"a": jnp.ones(1)}, [("a", "x", "y")]),
    ],
    ids=["label_params", "param_groups", "describe"],
)
def test_a_rule_of_three_items_is_rejected(call):
    with pytest.raises(TypeError, match=r"rules\[0\]=.*must be a \(regex, value\) pair"):
        call()


def test_unused_rule_error_names_the_closest_few_of_many_names():
    names = [f"layer{i:03d}/kernel" for i in range(150)] + ["layer042/bias"]
    with pytest.raises(ValueError, match="'layer042/bais' is unused") as err:
        gradtools.label_params({n: jnp.zeros(1) for n in names}, [("layer042/bais", 1)], 0)
    assert "151 parameter names" in str(err.value)
    assert _listed(str(err.value))[0] == "layer042/bias"  # the typo's target comes first
    assert len(_listed(str(err.value))) == 5


def test_parameters_without_a_rule_are_counted_and_a_few_named():
    names = [f"p{i:03d}" for i in range(150)]
    with pytest.raises(ValueError, match="150 parameter.s. match no rule") as err:
        gradtools.label_params({n: jnp.zeros(1) for n in names}, [("zzz", 1)])
    assert _listed(str(err.value)) == names[:5] + ["... and 145 more"]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "mask",
    [gradtools.decay_mask, lambda p: gradtools.label_params(p, [(r"bias$", False)], True)],
    ids=["decay_mask", "label_params"],
)
def test_a_mask_given_the_step_count_says_to_make_it_static(mask, jit):
    """``inject_hyperparams`` calls a callable ``mask`` with the step count unless static."""
    params = {"fc": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}}
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=0.1, mask=mask)
    init = jax.jit(tx.init) if jit else tx.init
    with pytest.raises(ValueError, match=r"not a parameter tree.*static_args=\('mask',\)"):
        init(params)
    # As the message says: with mask static, the bias is not decayed and the kernel is.
    tx = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=1.0, weight_decay=0.5, mask=mask
    )
    zeros = jax.tree.map(jnp.zeros_like, params)  # Adam's part of the update is then 0
    updates, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_array_equal(updates["fc"]["bias"], 0.0)
    np.testing.assert_allclose(updates["fc"]["kernel"], -0.5)  # -learning_rate * 0.5 * 1


def test_metrics_report_the_first_state_in_tree_order():
    params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([6.0, 8.0])}  # norms 5 and 10
    clip = lambda: optax.chain(gradtools.clip_by_global_norm(100.0), optax.sgd(0.1))  # noqa: E731
    tx = gradtools.param_groups([("a", clip()), ("b", clip())])
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert float(gradtools.metrics(state)["grad_norm"]) == 5.0

    sgd = optax.inject_hyperparams(optax.sgd)
    tx = gradtools.param_groups([("a", sgd(learning_rate=0.1)), ("b", sgd(learning_rate=0.2))])
    assert float(gradtools.metrics(tx.init(params))["learning_rate"]) == np.float32(0.1)


def test_decay_mask_excludes_biases_norm_scales_and_vectors():
    params = {
        "params": {
            "fc": {"kernel": jnp.ones((3, 2)), "bias": jnp.ones(2)},
            "attn": {"kernel": jnp.ones((2, 2, 2)), "bias": jnp.ones((2, 2))},  # DenseGeneral
            "LayerNorm_0": {"scale": jnp.ones(2), "bias": jnp.ones(2)},
            "embed": {"embedding": jnp.ones((5, 2))},
            "temperature": jnp.ones(()),
            "w": jnp.ones(3),  # a 1-D parameter of any name
        }
    }
    mask = gradtools.decay_mask(params)["params"]
    assert mask == {
        "fc": {"kernel": True, "bias": False},
        "attn": {"kernel": True, "bias": False},
        "LayerNorm_0": {"scale": False, "bias": False},
        "embed": {"embedding": True},
        "temperature": False,
        "w": False,
    }
    assert gradtools.decay_mask(jax.eval_shape(lambda: params)) == gradtools.decay_mask(params)
    # First adamw step in NumPy: m_hat = g, v_hat = g**2.
    lr, wd, eps = 0.1, 0.5, 1e-8
    tx = optax.adamw(lr, eps=eps, weight_decay=wd, mask=gradtools.decay_mask)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.25), params)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    for (u, m), g in zip(
        zip(jax.tree.leaves(updates), jax.tree.leaves(gradtools.decay_mask(params))),
        jax.tree.leaves(grads),
    ):
        expected = -lr * (0.25 / (0.25 + eps) + (wd * 1.0 if m else 0.0))
        np.testing.assert_allclose(u, np.full(g.shape, expected), rtol=1e-5)


# -- describe ------------------------------------------------------------------------------------


def test_describe_lenet_line_by_line():
    variables, _ = lenet()
    rules = [(r"conv", gradtools.frozen()), (r"fc3", optax.sgd(0.1))]
    expected = """\
name                 shape          dtype    group    trainable  params
-------------------  -------------  -------  -------  ---------  ------
params/conv1/bias    (6,)           float32  conv     no              6
params/conv1/kernel  (5, 5, 1, 6)   float32  conv     no            150
params/conv2/bias    (16,)          float32  conv     no             16
params/conv2/kernel  (5, 5, 6, 16)  float32  conv     no          2,400
params/fc1/bias      (120,)         float32  default  yes           120
params/fc1/kernel    (400, 120)     float32  default  yes        48,000
params/fc2/bias      (84,)          float32  default  yes            84
params/fc2/kernel    (120, 84)      float32  default  yes        10,080
params/fc3/bias      (10,)          float32  fc3      yes            10
params/fc3/kernel    (84, 10)       float32  fc3      yes           840
trainable params: 59,134
frozen params:     2,572
all params:       61,706"""
    lines = gradtools.describe(variables, rules).splitlines()
    expected_lines = expected.splitlines()
    assert len(lines) == len(expected_lines)
    for line, want in zip(lines, expected_lines):
        assert line == want

    # Labels instead of transforms: 'frozen' freezes; no rules: all trainable, default.
    by_label = gradtools.describe(variables, [(r"conv", "frozen"), (r"fc3", "fc3")])
    relabelled = [line.replace("float32  conv   ", "float32  frozen ") for line in expected_lines]
    assert by_label.splitlines() == relabelled
    plain = gradtools.describe(variables).splitlines()
    assert [line.split()[0] for line in plain[2:12]] == [line.split()[0] for line in lines[2:12]]
    assert all(line.split()[-3:-1] == ["default", "yes"] for line in plain[2:12])
    assert plain[12:] == [
        "trainable params: 61,706",
        "frozen params:         0",
        "all params:       61,706",
    ]


def test_describe_labels_dtypes_and_shape_structs():
    params = {"a": jnp.ones((2, 3), jnp.bfloat16), "b": {"c": jnp.ones((), jnp.float16)}}
    text = gradtools.describe(jax.eval_shape(lambda: params), [(r"^a", "frozen"), (r"c", 7)])
    assert [line.split() for line in text.splitlines()[2:4]] == [
        ["a", "(2,", "3)", "bfloat16", "frozen", "no", "6"],
        ["b/c", "()", "float16", "7", "yes", "1"],
    ]


def test_describe_shows_the_dtype_jax_computes_in():
    # jnp.asarray is the reference: a Python float and a NumPy float64 array
    # become float32 in a step unless x64 is on.
    params = {"lr": 0.5, "n": 3, "w": np.ones(2), "h": np.ones(2, np.float16)}
    rows = [line.split() for line in gradtools.describe(params).splitlines()[2:6]]
    expected = {k: jnp.asarray(v).dtype.name for k, v in params.items()}
    assert {row[0]: row[2] for row in rows} == expected
    assert expected["lr"] == "float32" and expected["w"] == "float32"


# -- conformance ---------------------------------------------------------------------------------


def _mixed():
    params = {
        "conv": {"w": jnp.ones((3, 2), jnp.bfloat16), "b": jnp.ones(2, jnp.float16)},
        "fc": {"w": jnp.ones((2, 2), jnp.float32), "b": jnp.ones(2, jnp.bfloat16)},
        "empty": {},
        "none": None,
        "seq": [],
    }
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    return params, grads


@pytest.mark.parametrize("kind", ["freeze", "param_groups"])
def test_jit_once_mixed_dtypes_empty_subtrees(kind):
    params, grads = _mixed()
    if kind == "freeze":
        tx = gradtools.freeze(optax.adam(0.1), [r"^conv/"])
    else:
        tx = gradtools.param_groups([(r"^conv/", gradtools.frozen())], default=optax.adam(0.1))
    state = tx.init(params)
    shapes = tx.init(jax.eval_shape(lambda: params))
    assert jax.tree.structure(shapes) == jax.tree.structure(state)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), shapes) == jax.tree.map(
        lambda a: (a.shape, a.dtype), state
    )

    traces = []

    @jax.jit
    def step(params, state):
        traces.append(1)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), updates, state

    ref = optax.adam(0.1)  # by hand on the fc half

    @jax.jit
    def ref_step(fc, state):
        u, state = ref.update(grads["fc"], state, fc)
        return optax.apply_updates(fc, u), state

    ref_fc, ref_state = params["fc"], ref.init(params["fc"])
    p, s = params, state
    for _ in range(3):
        p, updates, s = step(p, s)
        ref_fc, ref_state = ref_step(ref_fc, ref_state)
        assert jax.tree.structure(s) == jax.tree.structure(state)
        assert jax.tree.map(lambda a: a.dtype, s) == jax.tree.map(lambda a: a.dtype, state)
        assert jax.tree.map(lambda a: a.dtype, updates) == jax.tree.map(lambda a: a.dtype, grads)
    assert len(traces) == 1  # no recompilation
    assert (p["empty"], p["none"], p["seq"]) == ({}, None, [])
    chex.assert_trees_all_equal(p["conv"], params["conv"])
    chex.assert_trees_all_close(p["fc"], ref_fc)
    assert jax.tree.map(lambda a: a.dtype, p) == jax.tree.map(lambda a: a.dtype, params)


def test_state_round_trips_through_flax_serialization():
    params, grads = _mixed()
    tx = gradtools.param_groups(
        [(r"^conv/w", optax.sgd(0.1, momentum=0.9)), (r"^conv/b", gradtools.frozen())],
        default=gradtools.freeze(optax.adam(0.1), r"fc/b"),  # nested: a freeze in a group
    )
    state = jax.jit(tx.update)(grads, tx.init(params), params)[1]
    restored = flax.serialization.from_bytes(tx.init(params), flax.serialization.to_bytes(state))
    chex.assert_trees_all_equal(restored, state)
    assert jax.tree.structure(restored) == jax.tree.structure(state)


def test_composes_with_dynamic_loss_scale_and_clipping():
    variables, _ = lenet()
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    tx = gradtools.dynamic_loss_scale(
        gradtools.param_groups([(r"conv", gradtools.frozen())], default=inner), init_scale=8.0
    )
    update = jax.jit(tx.update)
    state = tx.init(variables)
    ref_state = inner.init(split(variables)[1])  # clip and adam on the fc half alone
    for seed, finite in [(0, True), (1, False), (2, True)]:
        grads = _fake_grads(variables, seed, scale=3.0 * 8.0)  # scaled by the loss scale
        if not finite:
            bias = np.array(grads["params"]["fc2"]["bias"])
            bias[0] = np.inf
            grads["params"]["fc2"]["bias"] = jnp.asarray(bias)
        updates, state = update(grads, state, variables)
        if finite:
            g_fc = split(_fake_grads(variables, seed, scale=3.0))[1]
            u_fc, ref_state = jax.jit(inner.update)(g_fc, ref_state, split(variables)[1])
            chex.assert_trees_all_close(split(updates)[1], u_fc, rtol=1e-5, atol=1e-8)
        else:
            assert all(not np.any(u) for u in jax.tree.leaves(updates))
        assert all(not np.any(u) for u in jax.tree.leaves(split(updates)[0]))
    m = gradtools.metrics(state)
    assert (float(m["loss_scale"]), int(m["skipped_steps"])) == (4.0, 1)


def test_learning_rate_metric_and_extra_args_reach_the_groups(scale_by_factor):
    params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    adam = optax.inject_hyperparams(optax.adam)(learning_rate=0.25)
    state = gradtools.freeze(adam, r"^a").init(params)
    assert float(gradtools.metrics(state)["learning_rate"]) == 0.25

    tx = gradtools.param_groups([(r"^a", scale_by_factor)], default=optax.chain(optax.sgd(1.0)))
    tx = optax.chain(tx)  # optax.chain forwards extra args
    grads = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0, 4.0])}
    updates, _ = jax.jit(lambda g, s: tx.update(g, s, params, factor=3.0))(grads, tx.init(params))
    np.testing.assert_array_equal(updates["a"], [3.0, 6.0])
    np.testing.assert_array_equal(updates["b"], [-3.0, -4.0])


@pytest.mark.four_devices
def test_sharded_params_keep_their_sharding():
    mesh = jax.make_mesh((4,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    params = {"conv": jnp.ones(8), "fc": jnp.arange(8.0)}
    params = jax.device_put(params, sharding)
    tx = gradtools.freeze(optax.adam(0.1), r"conv")
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(params, state, params)
    new = optax.apply_updates(params, updates)
    for leaf in jax.tree.leaves(new):
        assert leaf.sharding.is_equivalent_to(sharding, 1)
    assert state.inner_state[0].mu["fc"].sharding.is_equivalent_to(sharding, 1)
    np.testing.assert_array_equal(new["conv"], np.ones(8))
