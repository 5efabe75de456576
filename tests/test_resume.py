"""Exact resume: stopping at any step, saving, restoring and going on changes nothing.

The run trains a tiny mixed-precision model for ``N`` steps with a loss scaler,
accumulation, clipping and Adam driven by a schedule. Two of its micro-batches
overflow, and the checkpoints taken before every step therefore include ones
inside an accumulation window and ones right after an overflow. Each
checkpoint is written (orbax to disk, or ``flax.serialization`` bytes), read
back into a freshly built optimizer's state, and training goes on to step
``N``: params and state must equal the uninterrupted run's bit for bit.
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

import gradtools
from gradtools import schedules

N = 12
EVERY_K = 3
OVERFLOW_AT = (4, 7)  # micro-batch indices whose gradients are inf/NaN


def make_tx(nesting):
    """The optimizer, built afresh each time (as a resumed job rebuilds it)."""
    lr = schedules.with_warmup(schedules.cosine_decay(1e-3, 5e-2, 6), 1)
    inner = optax.chain(gradtools.clip_by_global_norm(1.0), optax.adam(lr))
    scale = dict(init_scale=2.0**8, growth_interval=2)
    if nesting == "scale_outside":  # an overflowing micro-batch is dropped alone
        return gradtools.dynamic_loss_scale(gradtools.accumulate(inner, EVERY_K), **scale)
    return gradtools.accumulate(gradtools.dynamic_loss_scale(inner, **scale), EVERY_K)


def loss_fn(params, x, y, poison):
    pred = x @ params["w"] + params["b"].astype(jnp.float32)
    return jnp.mean((pred - y) ** 2) * poison


def batch(t):
    rng = np.random.default_rng(t)
    x = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)
    return x, y, jnp.float32(np.inf if t in OVERFLOW_AT else 1.0)


PARAMS = {"w": jnp.full((4, 2), 0.5, jnp.float32), "b": jnp.zeros(2, jnp.bfloat16)}


def train(step, params, opt_state, start):
    """Steps ``start .. N-1`` from the given params and state."""
    for t in range(start, N):
        params, opt_state, _ = step(params, opt_state, *batch(t))
    return params, opt_state


@functools.cache
def uninterrupted(nesting):
    """The state before each step, and the end of the run without a break."""
    step = jax.jit(gradtools.train_step(loss_fn, make_tx(nesting)))
    params, opt_state = PARAMS, make_tx(nesting).init(PARAMS)
    before, history = [], []
    for t in range(N):
        before.append({"params": params, "opt_state": opt_state})
        params, opt_state, m = step(params, opt_state, *batch(t))
        history.append(jax.device_get(m))
    return before, {"params": params, "opt_state": opt_state}, history


@pytest.mark.parametrize("nesting", ["scale_outside", "scale_inside"])
def test_the_run_covers_windows_and_overflows(nesting):
    """The checkpoints below fall inside windows and right after overflows."""
    before, end, history = uninterrupted(nesting)
    micro = [int(gradtools.metrics(c["opt_state"])["micro_step"]) for c in before]
    assert {1, 2} <= set(micro)  # checkpoints inside an accumulation window
    after_overflow = [t + 1 for t in OVERFLOW_AT]
    assert any(micro[t] > 0 for t in after_overflow)  # right after an overflow, mid-window
    assert int(history[-1]["skipped_steps"]) == len(OVERFLOW_AT)  # both were skipped
    assert len({float(m["loss_scale"]) for m in history}) > 2  # grew and backed off
    # Adam took some steps, fewer than the micro-batches, and trained finite params.
    adam_count = int(optax.tree.get_all_with_path(end["opt_state"], "ScaleByAdamState")[0][1].count)
    assert 0 < adam_count < N // EVERY_K + 1
    assert np.isfinite(np.asarray(end["params"]["w"])).all()
    assert jax.tree.map(lambda x: x.dtype, end["params"]) == jax.tree.map(lambda x: x.dtype, PARAMS)


def resume(nesting, restore):
    """From every checkpoint, a freshly built optimizer goes on to step N."""
    before, end, _ = uninterrupted(nesting)
    tx = make_tx(nesting)
    step = jax.jit(gradtools.train_step(loss_fn, tx))
    template = {"params": PARAMS, "opt_state": tx.init(PARAMS)}
    for t, saved in enumerate(before):
        restored = restore(t, saved, template)
        chex.assert_trees_all_equal(restored, saved, strict=True)
        params, opt_state = train(step, restored["params"], restored["opt_state"], t)
        got = {"params": params, "opt_state": opt_state}
        assert jax.tree.structure(got) == jax.tree.structure(end)
        chex.assert_trees_all_equal(got, end, strict=True, custom_message=f"resumed at step {t}")


@pytest.mark.parametrize("nesting", ["scale_outside", "scale_inside"])
def test_resume_from_orbax_on_disk_is_exact(nesting, tmp_path):
    checkpointer = ocp.StandardCheckpointer()

    def restore(t, saved, template):
        checkpointer.save(tmp_path / f"step_{t}", saved)
        checkpointer.wait_until_finished()
        return checkpointer.restore(tmp_path / f"step_{t}", jax.eval_shape(lambda: template))

    try:
        resume(nesting, restore)
    finally:
        checkpointer.close()


@pytest.mark.parametrize("nesting", ["scale_outside", "scale_inside"])
def test_resume_from_flax_serialization_is_exact(nesting):
    def restore(t, saved, template):
        return flax.serialization.from_bytes(template, flax.serialization.to_bytes(saved))

    resume(nesting, restore)
