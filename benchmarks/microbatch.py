"""Micro-batching: a step's time and XLA's temporary bytes at k = 1, 2, 4, 8 micro-batches.

The model is an MLP whose activations outweigh its parameters many times
over (a large batch through a few GELU layers), so the temporaries XLA keeps
for the backward pass are what micro-batching should shrink. Three ways to
take one optimizer step per batch of ``B`` examples, each as one jitted
call (or ``k`` of them) with params and state donated:

- ``gradtools.train_step(loss_fn, tx, micro_batches=k)``: one call; the batch
  split into ``k`` contiguous micro-batches, their gradients summed in a
  ``lax.scan``, ``tx`` stepped once;
- ``optax.microbatching.microbatch`` around ``jax.value_and_grad`` (MEAN
  accumulation, a ``fori_loop``), then ``tx.update`` and
  ``optax.apply_updates``: one call;
- ``gradtools.train_step(loss_fn, gradtools.accumulate(tx, k))``: ``k`` calls,
  one micro-batch each, as a loop over a data loader's micro-batches runs it.

gradtools' ``tx`` is ``dynamic_loss_scale(chain(gradtools.clip_by_global_norm(1.0),
adam(1e-3)))``; optax's is ``chain(optax.clip_by_global_norm(1.0), adam(1e-3))``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradtools
from benchmarks import _steps
from benchmarks import _timing

__all__ = ["ACCUMULATE", "GRADTOOLS", "OPTAX", "mlp_loss", "mlp_params", "run_microbatch"]

#: The two variants whose ratios are the targets (the third is ACCUMULATE).
GRADTOOLS = "gradtools.train_step(micro_batches=k)"
OPTAX = "optax.microbatching + tx.update"
ACCUMULATE = "gradtools.accumulate(tx, k): k calls"
IN_DIM, CLASSES = 256, 10


def mlp_params(width: int, depth: int, seed: int = 0) -> dict[str, dict[str, jax.Array]]:
    """``depth`` GELU layers of ``width`` units on ``IN_DIM`` inputs, and a linear head."""
    rng = np.random.default_rng(seed)
    dims = [IN_DIM] + [width] * depth + [CLASSES]
    return {
        f"layer{i}": {
            "w": jnp.asarray(rng.normal(size=(m, n)) / np.sqrt(m), jnp.float32),
            "b": jnp.zeros((n,), jnp.float32),
        }
        for i, (m, n) in enumerate(zip(dims[:-1], dims[1:]))
    }


def mlp_loss(params: dict[str, dict[str, jax.Array]], x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of the MLP's logits against integer labels."""
    *hidden, head = params.values()
    for layer in hidden:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    logits = x @ head["w"] + head["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _runners(k: int, params: Any, batch: tuple[Any, ...], match: str | None):
    """name -> a compiled runner, for the variants at ``k`` micro-batches."""
    gt_tx = gradtools.dynamic_loss_scale(
        optax.chain(gradtools.clip_by_global_norm(1.0), optax.adam(1e-3))
    )
    optax_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    acc_tx = gradtools.accumulate(gt_tx, k)
    builders: dict[str, Callable[[], _steps.Runner]] = {
        GRADTOOLS: lambda: _steps.compile_runner(
            gradtools.train_step(mlp_loss, gt_tx, micro_batches=k), params, gt_tx, [batch]
        ),
        OPTAX: lambda: _steps.compile_runner(
            _steps.optax_microbatch_step(mlp_loss, optax_tx, k, batch[0].shape[0]),
            params,
            optax_tx,
            [batch],
        ),
        ACCUMULATE: lambda: _steps.compile_runner(
            gradtools.train_step(mlp_loss, acc_tx), params, acc_tx, _steps.split_batch(batch, k)
        ),
    }
    return {n: build() for n, build in builders.items() if not match or re.search(match, n)}


def run_microbatch(
    batch: int,
    width: int,
    depth: int,
    ks: tuple[int, ...],
    reps: int,
    *,
    match: str | None = None,
    sample_s: float = 0.2,
    log: Callable[[str], None] = print,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Per ``k`` in ``ks``: each variant's seconds per step of ``batch`` examples, temp bytes."""
    bad = [k for k in ks if k < 1 or batch % k]
    if bad:
        raise ValueError(f"micro-batch counts {bad} must be >= 1 and divide the batch {batch}")
    notes = []
    params = mlp_params(width, depth)
    rng = np.random.default_rng(1)
    data = (
        jnp.asarray(rng.normal(size=(batch, IN_DIM)), jnp.float32),
        jnp.asarray(rng.integers(0, CLASSES, size=batch), jnp.int32),
    )
    n_params = sum(x.size for x in jax.tree.leaves(params))
    notes.append(
        f"microbatch: an MLP of {depth} GELU layers {width} wide on {IN_DIM} inputs "
        f"({n_params:,} params), batch {batch}"
    )
    out = []
    for k in ks:
        log(f"microbatch k={k}: compiling")
        runners = _runners(k, params, data, match)
        calls = {n: _timing.calibrate(r.run, sample_s) for n, r in runners.items()}
        stats = _timing.interleave({n: r.run for n, r in runners.items()}, reps, calls)
        rows = _steps.rows(stats, runners, reps, k=k, batch=batch, params=n_params)
        for r in rows:
            ref = stats.get(OPTAX)
            r["x_optax"] = _timing.ratio(stats[r["variant"]], ref) if ref else None
            base = runners.get(OPTAX)
            base_bytes = base.temp_bytes() if base else 0
            r["temp_x_optax"] = r["temp_bytes"] / base_bytes if base_bytes else None
            log(
                f"  {r['variant']:44s} {r['median_s'] * 1e3:8.2f} ms "
                f"temp {r['temp_bytes'] / 2**20:8.2f} MiB"
            )
        out += rows
    return out, notes
