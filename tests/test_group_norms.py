"""Tests for gradtools.group_norms against numpy.linalg.norm of each group's leaves."""

import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradtools

# Flax-style names; fp32, bf16 and fp16 leaves in every group.
SHAPES = {
    "params": {
        "conv1": {"kernel": ((3, 3, 1, 4), jnp.float32), "bias": ((4,), jnp.float16)},
        "conv2": {"kernel": ((3, 3, 4, 8), jnp.bfloat16), "bias": ((8,), jnp.float32)},
        "fc1": {"kernel": ((32, 10), jnp.bfloat16), "bias": ((10,), jnp.float16)},
        "head": {"kernel": ((10, 3), jnp.float32)},
    }
}
RULES = [(r"bias$", "bias"), (r"conv", "conv"), (r"fc1/", "dense"), (r"head", "dense")]
# The groups the rules make, by name: the first matching rule wins.
GROUPS = {
    "bias": ["conv1/bias", "conv2/bias", "fc1/bias"],
    "conv": ["conv1/kernel", "conv2/kernel"],
    "dense": ["fc1/kernel", "head/kernel"],
}


def grads(seed=0, scale=30.0):
    """Random gradients large enough that float16 squares would overflow (300**2 > 65504)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda sd: jnp.asarray(scale * rng.standard_normal(sd[0]), sd[1]),
        SHAPES,
        is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[1], type),
    )


def numpy_norms(tree, groups, p):
    """numpy.linalg.norm, in float64, of each group's leaves laid end to end."""
    flat = tree["params"]
    out = {}
    for label, names in groups.items():
        values = [np.asarray(flat[n.split("/")[0]][n.split("/")[1]], np.float64) for n in names]
        out[label] = np.linalg.norm(np.concatenate([v.ravel() for v in values]), ord=p)
    return out


@pytest.mark.parametrize("p", [1.0, 2.0, math.inf, 3.0])
def test_norms_match_numpy_per_group(p):
    tx = gradtools.group_norms(RULES, norm_type=p)
    g = grads()
    update = jax.jit(tx.update)
    updates, state = update(g, tx.init(g))
    want = numpy_norms(g, GROUPS, p)
    got = state.group_grad_norms
    assert sorted(got) == sorted(want)  # no 'other': every parameter matched a rule
    for label, norm in got.items():
        assert norm.dtype == jnp.float32
        np.testing.assert_allclose(norm, want[label], rtol=2e-6, err_msg=label)
    # the updates are the gradients, the very arrays under jit
    chex.assert_trees_all_equal(updates, g, strict=True)
    # a second step replaces the norms
    g2 = grads(1, scale=0.01)
    _, state = update(g2, state)
    for label, norm in state.group_grad_norms.items():
        np.testing.assert_allclose(norm, numpy_norms(g2, GROUPS, p)[label], rtol=2e-6)


def test_unmatched_parameters_go_to_the_default_and_metrics_reports_every_group():
    tx = gradtools.group_norms([(r"conv", "conv")], default="rest")
    g = grads()
    _, state = tx.update(g, tx.init(g))
    want = numpy_norms(
        g, {"conv": GROUPS["conv"] + ["conv1/bias", "conv2/bias"],
            "rest": GROUPS["dense"] + ["fc1/bias"]}, 2,
    )  # fmt: skip
    m = gradtools.metrics(state)
    assert sorted(m) == ["grad_norm/conv", "grad_norm/rest"]
    for label in want:
        np.testing.assert_allclose(m[f"grad_norm/{label}"], want[label], rtol=2e-6)


def test_first_in_a_chain_it_sees_raw_gradients_after_a_clip_clipped_ones():
    g = grads()
    norms = gradtools.group_norms(RULES)
    tx = optax.chain(norms, gradtools.clip_by_global_norm(1.0), norms, optax.sgd(0.1))
    _, state = jax.jit(tx.update)(g, tx.init(g))
    raw, clipped = state[0].group_grad_norms, state[2].group_grad_norms
    clip = gradtools.clip_by_global_norm(1.0)
    want = numpy_norms(jax.jit(clip.update)(g, clip.init(g))[0], GROUPS, 2)
    for label in GROUPS:
        assert float(raw[label]) > 10 * float(clipped[label])
        np.testing.assert_allclose(clipped[label], want[label], rtol=2e-6)
    assert float(gradtools.metrics(state)["grad_norm/conv"]) == float(raw["conv"])  # the first


def test_inside_a_loss_scaler_it_takes_the_scalers_sums_and_sees_unscaled_gradients():
    g = grads(2, scale=1.0)
    scale = 2.0**12
    tx = gradtools.dynamic_loss_scale(
        optax.chain(gradtools.group_norms(RULES), optax.sgd(0.1)), init_scale=scale
    )
    params = jax.tree.map(jnp.zeros_like, g)
    scaled = jax.tree.map(lambda x: (x.astype(jnp.float32) * scale).astype(x.dtype), g)
    _, state = jax.jit(tx.update)(scaled, tx.init(params), params)
    want = numpy_norms(g, GROUPS, 2)
    for label, norm in state.inner_state[0].group_grad_norms.items():
        np.testing.assert_allclose(norm, want[label], rtol=2e-6, err_msg=label)


def test_state_keeps_the_labels_through_a_checkpoint():
    import flax.serialization

    tx = gradtools.group_norms([(r"conv", "conv/all"), (r"fc1", "fc 1")], default="other")
    g = grads()
    _, state = tx.update(g, tx.init(g))
    restored = flax.serialization.from_bytes(tx.init(g), flax.serialization.to_bytes(state))
    chex.assert_trees_all_equal(restored, state, strict=True)
    assert sorted(gradtools.metrics(restored)) == [
        "grad_norm/conv/all",
        "grad_norm/fc 1",
        "grad_norm/other",
    ]


def test_a_rule_that_matches_nothing_is_an_error_at_init():
    tx = gradtools.group_norms([(r"conv", "conv"), (r"attention", "attn")])
    with pytest.raises(ValueError, match=r"group_norms: rules\[1\] regex 'attention' is unused"):
        tx.init(grads())
    tx = gradtools.group_norms([(r"conv", "conv"), (r"conv1", "first")])
    with pytest.raises(ValueError, match="taken by an earlier rule"):
        tx.init(grads())
    tx = gradtools.group_norms([(r"conv", "conv")], default=None)
    with pytest.raises(ValueError, match="match no rule and there is no default"):
        tx.init(grads())


def test_updates_of_another_tree_are_refused():
    tx = gradtools.group_norms([(r"conv", "conv")])
    state = tx.init(grads())
    with pytest.raises(ValueError, match=r"the updates have the groups \['conv'\]"):
        tx.update({"conv": jnp.ones(2)}, state)


def _edit(tree, layer, leaf, value):
    """``tree`` with ``params/<layer>/<leaf>`` set to ``value`` (removed for ``None``)."""
    out = jax.tree.map(lambda x: x, tree)  # a copy of the dicts
    if value is None:
        del out["params"][layer][leaf]
    else:
        out["params"].setdefault(layer, {})[leaf] = value
    return out


def _tree(only_in_updates, only_in_params):
    """What a message on trees of another structure must say, in order."""
    return [
        "differ in tree structure",
        f"leaves only in updates: {only_in_updates}",
        f"leaves only in params: {only_in_params}",
        "updates: PyTreeDef(",
        "params: PyTreeDef(",
    ]


# Gradients unlike the params, each within the params' groups so that the labels
# alone cannot tell: (gradients, what the message must say, in order).
HEAD, BIAS = "['params']['head']['kernel']", "['params']['conv1']['bias']"
UNLIKE = {
    "extra_leaf": (
        lambda g: _edit(g, "conv3", "kernel", jnp.ones((2, 4))),  # into 'conv'
        _tree(["['params']['conv3']['kernel']"], []),
    ),
    "nested_leaf": (
        lambda g: _edit(g, "head", "kernel", {"w": g["params"]["head"]["kernel"]}),
        _tree([HEAD + "['w']"], [HEAD]),
    ),
    "missing_leaf": (
        lambda g: _edit(g, "conv1", "bias", None),  # 'bias' keeps two leaves
        _tree([], [BIAS]),
    ),
    "transposed": (
        lambda g: _edit(g, "head", "kernel", g["params"]["head"]["kernel"].T),
        ["differ in shape", f"{HEAD}: (3, 10) against (10, 3)"],
    ),
    "broadcastable": (
        lambda g: _edit(g, "conv1", "bias", g["params"]["conv1"]["bias"][None]),
        ["differ in shape", f"{BIAS}: (1, 4) against (4,)"],
    ),
}


@pytest.mark.parametrize("case", sorted(UNLIKE))
def test_updates_unlike_the_params_are_refused_at_trace_time_naming_the_leaf(case):
    change, parts = UNLIKE[case]
    params = grads()
    tx = optax.chain(gradtools.group_norms(RULES), optax.sgd(0.1))
    pattern = "(?s)group_norms: the updates and the params " + ".*".join(map(re.escape, parts))
    with pytest.raises(ValueError, match=pattern):
        jax.jit(tx.update)(change(grads(1)), tx.init(params), params)


def test_before_a_lookahead_it_checks_the_updates_against_the_fast_params():
    params = {"conv": jnp.ones(2), "fc": jnp.ones(3)}
    tx = optax.chain(
        gradtools.group_norms([(r"conv", "conv")]), optax.lookahead(optax.sgd(1.0), 2, 0.5)
    )
    synced = optax.LookaheadParams.init_synced(params)
    state = tx.init(synced)
    g = {"conv": jnp.array([3.0, 4.0]), "fc": jnp.ones(3)}
    _, state = jax.jit(tx.update)(g, state, synced)
    assert float(state[0].group_grad_norms["conv"]) == 5.0
    with pytest.raises(ValueError, match=re.escape("['fc']: (1, 3) against (3,)")):
        jax.jit(tx.update)({**g, "fc": jnp.ones((1, 3))}, state, synced)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(rules=[(r"conv", 3)]), TypeError, r"rules\[0\]\[1\]=3 must be a non-empty str"),
        (dict(rules=[(r"conv", "")]), TypeError, r"rules\[0\]\[1\]='' must be a non-empty str"),
        (dict(rules=[(r"(", "x")]), ValueError, "not a valid regular expression"),
        (dict(rules="conv"), TypeError, "must be a sequence of"),
        (dict(rules=[], default=1), TypeError, "default=1 must be a non-empty str"),
        (dict(rules=[], norm_type=0), ValueError, "norm_type=0"),
    ],
)
def test_bad_arguments_are_refused_when_built(kwargs, error, match):
    with pytest.raises(error, match=match):
        gradtools.group_norms(**kwargs)
