"""Every public transform against the rules every transform keeps (docs/internals.md).

The table, ``TRANSFORMS`` in ``tests/transforms.py``, lists each public
transform, ``factory(**kwargs)``, in one or more rows; every check below runs on
every row. Each check compares real values with a reference run of the same row
(jitted, unsharded, unserialized, on the standard tree), so a transform that
breaks a rule fails its row. The per-transform behaviour itself is tested
against NumPy in ``test_<module>.py``.

The standard tree mixes float32, bfloat16 and float16 leaves with ``None`` and
empty subtrees, and every leaf can be laid out on a 2x2 mesh of CPU devices.
"""

import functools

import chex
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from transforms import ROWS

import gradtools

IDS = list(ROWS)

# name: (shape, dtype, layout on the 2x2 mesh)
LEAVES = {
    ("dense", "kernel"): ((4, 2), jnp.float32, P("a", "b")),
    ("dense", "bias"): ((4,), jnp.float32, P(("a", "b"))),
    ("emb",): ((8, 2), jnp.bfloat16, P("b", None)),
    ("head",): ((4,), jnp.float16, P()),
}
STEPS = 3


def standard_tree(leaf, *, extras=True):
    """The standard tree with ``leaf(shape, dtype, spec)`` at each leaf, plus ``None``
    and empty subtrees with ``extras``."""
    tree = {"dense": {"none": None}, "empty": {}, "seq": []} if extras else {"dense": {}}
    for path, (shape, dtype, spec) in LEAVES.items():
        node = tree
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = leaf(shape, dtype, spec)
    return tree


def make_tree(seed, *, dtype=None, extras=True, scale=1.0):
    """Random values for the standard tree; ``dtype`` overrides every leaf's."""
    rng = np.random.default_rng(seed)
    return standard_tree(
        lambda shape, leaf_dtype, _: jnp.asarray(
            scale * rng.standard_normal(shape), dtype or leaf_dtype
        ),
        extras=extras,
    )


def params_and_grads(**kw):
    return make_tree(0, **kw), [make_tree(seed, scale=2.0, **kw) for seed in range(1, STEPS + 1)]


@functools.cache
def build(row_id):
    """One transform per row, so that the jitted functions below are shared."""
    row = ROWS[row_id]
    return row.factory(**row.kwargs)


def step_fn(tx, traces=None):
    def step(params, state, grads):
        if traces is not None:
            traces.append(1)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    return step


def run(step, tx, params, grads, state=None):
    """``STEPS`` updates; returns final params, init state, final state, all updates."""
    init = tx.init(params) if state is None else state
    state, all_updates = init, []
    for g in grads:
        params, state, updates = step(params, state, g)
        all_updates.append(updates)
    return params, init, state, all_updates


@functools.cache
def jitted(row_id):
    traces = []
    return jax.jit(step_fn(build(row_id), traces)), traces


@functools.cache
def reference(row_id):
    """The jitted run on the standard tree, and how often the step was traced."""
    step, traces = jitted(row_id)
    params, grads = params_and_grads()
    out = run(step, build(row_id), params, grads)
    return out, len(traces)


def dtypes(tree):
    return jax.tree.map(lambda x: jnp.asarray(x).dtype, tree)


def _without_stale_buffers(tree):
    def drop(s):
        if isinstance(s, gradtools.AccumulateState) and not np.any(np.asarray(s.micro_step)):
            return s._replace(acc_grads=None)
        return s

    return jax.tree.map(drop, tree, is_leaf=lambda x: isinstance(x, gradtools.AccumulateState))


def assert_same(actual, expected, *, exact=True):
    """Same structure, same dtypes, same values (bit for bit unless ``exact=False``)."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    assert dtypes(actual) == dtypes(expected)
    if exact:
        chex.assert_trees_all_equal(actual, expected, strict=True)
        return
    # Fused and unfused code may round differently: allow a few ulps of each dtype.
    # A closed window's buffer is stale and never read (AccumulateState's docs),
    # so only exact comparisons look at it.
    actual, expected = _without_stale_buffers(actual), _without_stale_buffers(expected)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
        a, b = np.asarray(a), np.asarray(b)
        if not jnp.issubdtype(a.dtype, jnp.inexact):  # NumPy's would call bfloat16 exact
            np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
            continue
        tol = 8 * float(jnp.finfo(a.dtype).eps)
        np.testing.assert_allclose(
            a.astype(np.float32),
            b.astype(np.float32),
            rtol=tol,
            atol=tol,
            err_msg=jax.tree_util.keystr(path),
        )


@pytest.mark.parametrize("row_id", IDS)
def test_jit_matches_op_by_op(row_id):
    """The jitted steps give what running the same code op by op gives."""
    params, grads = params_and_grads()
    tx = build(row_id)
    with jax.disable_jit():
        want = run(step_fn(tx), tx, params, grads)
    got, _ = reference(row_id)
    assert_same(got, want, exact=False)


@pytest.mark.parametrize("row_id", IDS)
def test_second_step_does_not_retrace(row_id):
    _, traces = reference(row_id)
    assert traces == 1


@pytest.mark.parametrize("row_id", IDS)
def test_mixed_dtypes_are_kept_and_match_float32(row_id):
    (params, init, state, updates), _ = reference(row_id)
    params0, grads = params_and_grads()
    assert dtypes(params) == dtypes(params0)
    want = dtypes(params0)
    if ROWS[row_id].float32_updates:  # stochastic_rounding (tests/transforms.py)
        want = jax.tree.map(lambda d: jnp.promote_types(d, jnp.float32), want)
        assert want != dtypes(params0)  # the standard tree has half-precision leaves
    assert all(dtypes(u) == want for u in updates)
    assert dtypes(state) == dtypes(init)
    # The same run in float32 everywhere: low-precision leaves really train.
    p32, g32 = params_and_grads(dtype=jnp.float32)
    tx = build(row_id)
    want, _, _, _ = run(jax.jit(step_fn(tx)), tx, p32, g32)
    # (A global norm couples the leaves: float32 leaves see the rounding of the others.)
    for (path, got), expected in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(want)
    ):
        np.testing.assert_allclose(
            np.asarray(got, np.float32), expected, rtol=3e-2, atol=3e-2, err_msg=str(path)
        )


@pytest.mark.parametrize("row_id", IDS)
def test_none_and_empty_subtrees_change_nothing(row_id):
    (params, _, state, updates), _ = reference(row_id)
    assert (params["dense"]["none"], params["empty"], params["seq"]) == (None, {}, [])
    for u in updates:
        assert (u["dense"]["none"], u["empty"], u["seq"]) == (None, {}, [])
    # The same run without the extra subtrees gives the same leaves.
    plain, grads = params_and_grads(extras=False)
    tx = build(row_id)
    want, _, want_state, _ = run(jax.jit(step_fn(tx)), tx, plain, grads)
    chex.assert_trees_all_equal(jax.tree.leaves(params), jax.tree.leaves(want))
    chex.assert_trees_all_equal(jax.tree.leaves(state), jax.tree.leaves(want_state))


@pytest.mark.parametrize("row_id", IDS)
def test_init_on_shape_dtype_structs(row_id):
    tx = build(row_id)
    params, grads = params_and_grads()
    state = tx.init(jax.eval_shape(lambda: params))
    (want_params, want_init, want_state, _), _ = reference(row_id)
    assert_same(state, want_init)
    step, _ = jitted(row_id)
    got_params, _, got_state, _ = run(step, tx, params, grads, state)
    assert_same((got_params, got_state), (want_params, want_state))


@pytest.mark.parametrize("row_id", IDS)
def test_composes_inside_chain(row_id):
    """``chain(scale(0.5), tx, identity())`` on doubled gradients is ``tx`` itself."""
    tx = optax.chain(optax.scale(0.5), build(row_id), optax.identity())
    params, grads = params_and_grads()
    doubled = [jax.tree.map(lambda g: g * 2, g) for g in grads]
    got, _, state, updates = run(jax.jit(step_fn(tx)), tx, params, doubled)
    (want, _, want_state, want_updates), _ = reference(row_id)
    assert_same((got, state[1], updates), (want, want_state, want_updates), exact=False)


@pytest.mark.parametrize("row_id", IDS)
def test_composes_inside_inject_hyperparams(row_id):
    row = ROWS[row_id]
    tx = optax.inject_hyperparams(row.factory, static_args=row.static_args)(**row.kwargs)
    params, grads = params_and_grads()
    got, _, state, updates = run(jax.jit(step_fn(tx)), tx, params, grads)
    (want, _, want_state, want_updates), _ = reference(row_id)
    assert_same((got, state.inner_state, updates), (want, want_state, want_updates), exact=False)


@pytest.mark.parametrize("row_id", IDS)
def test_state_keeps_its_structure_under_scan(row_id):
    """Three updates in one ``lax.scan``: the carry's types never change."""
    tx = build(row_id)
    params, grads = params_and_grads()
    stacked = jax.tree.map(lambda *g: jnp.stack(g), *grads)
    step = step_fn(tx)

    def body(carry, g):
        params, state, _ = step(*carry, g)
        return (params, state), None

    @jax.jit
    def loop(params):
        init = tx.init(params)
        return init, jax.lax.scan(body, (params, init), stacked)[0]

    init, (got, state) = loop(params)
    shapes = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)  # noqa: E731
    assert jax.tree.structure(state) == jax.tree.structure(init)
    assert shapes(state) == shapes(init)
    (want, _, want_state, _), _ = reference(row_id)
    assert_same((got, state), (want, want_state), exact=False)


@pytest.mark.parametrize("row_id", IDS)
def test_state_round_trips_through_flax_serialization(row_id):
    tx = build(row_id)
    (params, _, state, _), _ = reference(row_id)
    template = tx.init(params_and_grads()[0])
    restored = flax.serialization.from_bytes(template, flax.serialization.to_bytes(state))
    assert_same(restored, state)
    # and training goes on from it exactly as from the original
    step, _ = jitted(row_id)
    g = make_tree(99)
    assert_same(step(params, restored, g), step(params, state, g))


@pytest.mark.parametrize("row_id", IDS)
def test_state_round_trips_through_orbax(row_id, tmp_path):
    tx = build(row_id)
    (params, _, state, _), _ = reference(row_id)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
    checkpointer.wait_until_finished()
    target = jax.eval_shape(lambda: {"params": params, "opt_state": tx.init(params)})
    restored = checkpointer.restore(tmp_path / "ckpt", target)
    checkpointer.close()
    assert_same(restored["params"], params)
    assert_same(restored["opt_state"], state)


@pytest.mark.slow
@pytest.mark.four_devices
@pytest.mark.parametrize("row_id", IDS)
def test_sharded_params_keep_their_layout_and_values(row_id):
    mesh = jax.make_mesh((2, 2), ("a", "b"))
    shardings = standard_tree(lambda shape, dtype, spec: NamedSharding(mesh, spec))
    params, grads = params_and_grads()
    params = jax.device_put(params, shardings)
    grads = [jax.device_put(g, shardings) for g in grads]
    tx = build(row_id)
    got, _, state, updates = run(jax.jit(step_fn(tx)), tx, params, grads)
    (want, _, want_state, want_updates), _ = reference(row_id)
    assert_same((got, state, updates), (want, want_state, want_updates), exact=False)
    if row_id in ("freeze", "frozen") and jax.__version_info__ < (0, 10):
        # jax 0.6 and 0.7 give zeros_like no sharding: the frozen params' zero
        # updates come back replicated (their values were checked above).
        return
    for tree in (got, *updates):
        for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
            assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.sharding, sharding)


@pytest.mark.slow
@pytest.mark.four_devices
@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize("row_id", IDS)
def test_explicit_mesh_axes_keep_layout_and_values(row_id, fused):
    """Params laid out over explicit mesh axes, whose types carry their sharding.

    Both branches of every ``lax.cond`` must then agree on it, and
    ``TrainState.apply_gradients`` and ``nnx.Optimizer`` take the ``update``
    path; each leaf must keep its layout and the reference values.
    """
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=explicit)
    use_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh  # jax < 0.8: use_mesh
    shardings = standard_tree(lambda shape, dtype, spec: NamedSharding(mesh, spec))
    tx = build(row_id)

    def step(params, state, grads):
        if fused:
            new_params, state = gradtools.apply_gradients(tx, grads, state, params)
            return new_params, state, None
        return step_fn(tx)(params, state, grads)

    with use_mesh(mesh):
        params, grads = params_and_grads()
        params = jax.device_put(params, shardings)
        grads = [jax.device_put(g, shardings) for g in grads]
        got, _, state, _ = run(jax.jit(step), tx, params, grads)
    (want, _, want_state, _), _ = reference(row_id)
    assert_same((got, state), (want, want_state), exact=False)
    for leaf, sharding in zip(jax.tree.leaves(got), jax.tree.leaves(shardings)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.sharding, sharding)


@pytest.mark.slow
@pytest.mark.four_devices
@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize("row_id", IDS)
def test_runs_inside_shard_map_on_per_device_values(row_id, fused):
    """Four devices each train a copy inside ``jax.shard_map`` (``check_vma`` on).

    The params and gradients are per-device values (they vary over the mesh
    axis) and the initial state is shared: the outputs of every ``lax.cond``
    must vary alike in both branches, and each device must get the
    reference run.
    """
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    tx = build(row_id)
    params, grads = params_and_grads()
    init = tx.init(params)

    def step(params, state, grads):
        if fused:
            new_params, state = gradtools.apply_gradients(tx, grads, state, params)
            return new_params, state, jax.tree.map(jnp.subtract, new_params, params)
        return step_fn(tx)(params, state, grads)

    def per_device(params, grads):
        params, grads = jax.tree.map(lambda x: x[0], (params, grads))
        got, _, state, _ = run(step, tx, params, grads, init)
        return jax.tree.map(lambda x: x[None], (got, state))

    copies = lambda tree: jax.tree.map(lambda x: jnp.stack([x] * 4), tree)  # noqa: E731
    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    stacked = f(copies(params), copies(grads))
    (want, _, want_state, _), _ = reference(row_id)
    for device in range(4):
        got = jax.tree.map(functools.partial(lambda i, x: x[i], device), stacked)
        assert_same(got, (want, want_state), exact=False)
