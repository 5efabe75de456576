"""Whole training steps written with plain optax, and a timer-ready runner for any step.

Shared by the ``microbatch`` and ``gpt`` sections. Every step has the shape
``step(params, opt_state, *batch) -> (params, opt_state, out)`` and is compiled
ahead of time with params and state donated, so that XLA's memory analysis of
the very executable that is timed can be read.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax

from benchmarks import _xla

__all__ = [
    "Runner",
    "compile_runner",
    "optax_microbatch_step",
    "optax_step",
    "rows",
    "split_batch",
]

Step = Callable[..., tuple[Any, Any, Any]]


def optax_step(loss_fn: Callable[..., Any], tx: optax.GradientTransformation, scale: float = 1.0):
    """``value_and_grad``, ``tx.update``, ``optax.apply_updates``: the step optax's docs write.

    With ``scale != 1`` the loss is multiplied by it before differentiating and
    the gradients divided by it after: a fixed loss scale written by hand.
    """

    def step(params, opt_state, *batch):
        if scale == 1.0:
            loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        else:
            scaled, grads = jax.value_and_grad(lambda p: loss_fn(p, *batch) * scale)(params)
            loss, grads = scaled / scale, jax.tree.map(lambda g: g / scale, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def optax_microbatch_step(
    loss_fn: Callable[..., Any], tx: optax.GradientTransformation, k: int, batch_size: int
):
    """The step with its gradient averaged over ``k`` micro-batches by ``optax.microbatching``.

    ``optax.microbatching.microbatch`` wraps ``jax.value_and_grad(loss_fn)``
    with MEAN accumulation (a ``fori_loop`` over the micro-batches); then
    ``tx.update`` and ``optax.apply_updates`` run once.
    """
    mean = optax.microbatching.AccumulationType.MEAN

    def step(params, opt_state, *batch):
        argnums = tuple(range(1, 1 + len(batch)))
        value_and_grad = optax.microbatching.microbatch(
            jax.value_and_grad(loss_fn), argnums, batch_size // k, mean
        )
        loss, grads = value_and_grad(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def split_batch(batch: Sequence[Any], k: int) -> list[tuple[Any, ...]]:
    """``k`` contiguous micro-batches of every array in ``batch`` (axis 0)."""
    n = jax.tree.leaves(batch)[0].shape[0] // k
    return [jax.tree.map(lambda a, i=i: a[i * n : (i + 1) * n], tuple(batch)) for i in range(k)]


@dataclass
class Runner:
    """A compiled step and the loop that times it: ``run()`` makes one call per batch."""

    run: Callable[[], None]
    executable: Any

    def temp_bytes(self) -> int:
        """XLA's temporary buffers of one call (``memory_analysis().temp_size_in_bytes``)."""
        return int(self.executable.memory_analysis().temp_size_in_bytes)

    def peak_bytes(self) -> int:
        """Arguments + outputs - donated aliases + temporaries of one call."""
        return _xla.peak_bytes(self.executable)


def compile_runner(
    step: Step, params: Any, tx: optax.GradientTransformation, batches: Sequence[tuple[Any, ...]]
) -> Runner:
    """``step`` compiled with params and state donated; ``run`` calls it once per batch.

    The params are copied first (donation consumes them). ``run`` blocks on the
    last call's output, so it returns once the whole sequence has finished.
    """
    carry = [jax.tree.map(jnp.copy, params), None]
    carry[1] = tx.init(carry[0])
    with warnings.catch_warnings():
        # Scalar counters may find no output to alias; that is expected.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        jitted = jax.jit(step, donate_argnums=(0, 1))
        executable = jitted.lower(carry[0], carry[1], *batches[0]).compile()

    def run() -> None:
        out = None
        for batch in batches:
            carry[0], carry[1], out = executable(carry[0], carry[1], *batch)
        jax.block_until_ready(out)

    run()
    return Runner(run, executable)


def rows(stats: dict[str, Any], runners: dict[str, Runner], reps: int, **extra: Any) -> list:
    """One row per case: seconds per step (median, min, max, every sample) and XLA's bytes."""
    return [
        {
            **extra,
            "variant": name,
            **s.as_dict(),
            "samples_s": list(s.samples),
            "reps": reps,
            "temp_bytes": runners[name].temp_bytes(),
            "peak_bytes": runners[name].peak_bytes(),
        }
        for name, s in stats.items()
    ]
