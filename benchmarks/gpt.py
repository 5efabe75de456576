"""The demo GPT's whole training step: what gradtools costs against the same step in optax.

The model is ``gradtools.demo.gpt.model.GPT`` (flax.nnx), split with
``nnx.split`` into its parameters and a pure ``apply(params, tokens)``, so that
every variant is a plain ``jax.jit`` step (forward, backward, optimizer,
apply), params and state donated, of next-byte cross-entropy. Three pairs,
timed side by side in the same rounds, all with AdamW (``optax.adamw(3e-4,
weight_decay=0.1)``) after clipping the global norm to 1:

- (a) unprotected: ``chain(optax.clip_by_global_norm, adamw)`` in optax's own
  step against ``chain(gradtools.clip_by_global_norm, adamw)`` through
  ``gradtools.train_step``;
- (b) protected: ``optax.apply_if_finite`` of optax's chain, the loss scaled by
  hand by a fixed ``2**15``, against ``gradtools.dynamic_loss_scale`` of
  gradtools' chain through ``train_step``;
- (c) a batch in ``k`` micro-batches: ``optax.MultiSteps`` (``k`` calls) and
  ``optax.microbatching`` (one call) against ``train_step(micro_batches=k)``
  (one call) and ``gradtools.accumulate`` (``k`` calls).
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

__all__ = ["PAIRS", "run_gpt"]

#: The fixed loss scale of optax's protected step.
SCALE = 2.0**15

A_OPTAX = "(a) optax: chain(clip, adamw)"
A_GRADTOOLS = "(a) gradtools: train_step(chain(clip, adamw))"
B_OPTAX = "(b) optax: apply_if_finite(chain), loss x 2^15 by hand"
B_GRADTOOLS = "(b) gradtools: train_step(dynamic_loss_scale(chain))"
C_MULTISTEPS = "(c) optax: MultiSteps(chain, k): k calls"
C_MICROBATCH = "(c) optax: microbatching(k) + tx.update"
C_TRAIN_STEP = "(c) gradtools: train_step(chain, micro_batches=k)"
C_ACCUMULATE = "(c) gradtools: accumulate(chain, k): k calls"

#: (target, gradtools variant, optax variants (the faster one is the baseline), limit)
PAIRS = (
    ("(a) train_step(gradtools chain) / optax step", A_GRADTOOLS, (A_OPTAX,), 1.02),
    ("(b) dynamic_loss_scale / apply_if_finite + fixed scale", B_GRADTOOLS, (B_OPTAX,), 1.0),
    (
        "(c) train_step(micro_batches) / faster optax accumulation",
        C_TRAIN_STEP,
        (C_MULTISTEPS, C_MICROBATCH),
        1.0,
    ),
    (
        "(c) accumulate / faster optax accumulation",
        C_ACCUMULATE,
        (C_MULTISTEPS, C_MICROBATCH),
        1.0,
    ),
)


def _adamw() -> optax.GradientTransformation:
    return optax.adamw(3e-4, weight_decay=0.1)


def _model(size: str, dtype: Any) -> tuple[Callable[..., Any], Any, int]:
    """``(loss_fn, params, block_size)`` of the demo GPT at ``size``, computing in ``dtype``."""
    from flax import nnx

    from gradtools.demo.gpt.model import GPT
    from gradtools.demo.gpt.model import SIZES

    config = SIZES[size]
    model = GPT(config, dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params: Any, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, params, rest)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return loss_fn, params, config.block_size


def _builders(loss_fn: Callable[..., Any], k: int, batch_size: int):
    """name -> (step, tx, calls): ``calls`` micro-batches per timed step (1 or ``k``)."""
    optax_chain = optax.chain(optax.clip_by_global_norm(1.0), _adamw())
    gt_chain = optax.chain(gradtools.clip_by_global_norm(1.0), _adamw())
    protected = optax.apply_if_finite(optax_chain, max_consecutive_errors=1_000_000)
    scaled = gradtools.dynamic_loss_scale(gt_chain)
    multi = optax.MultiSteps(optax_chain, k).gradient_transformation()
    acc = gradtools.accumulate(gt_chain, k)
    microbatched = _steps.optax_microbatch_step(loss_fn, optax_chain, k, batch_size)
    return {
        A_OPTAX: (_steps.optax_step(loss_fn, optax_chain), optax_chain, 1),
        A_GRADTOOLS: (gradtools.train_step(loss_fn, gt_chain), gt_chain, 1),
        B_OPTAX: (_steps.optax_step(loss_fn, protected, scale=SCALE), protected, 1),
        B_GRADTOOLS: (gradtools.train_step(loss_fn, scaled), scaled, 1),
        C_MULTISTEPS: (_steps.optax_step(loss_fn, multi), multi, k),
        C_MICROBATCH: (microbatched, optax_chain, 1),
        C_TRAIN_STEP: (gradtools.train_step(loss_fn, gt_chain, micro_batches=k), gt_chain, 1),
        C_ACCUMULATE: (gradtools.train_step(loss_fn, acc), acc, k),
    }


def run_gpt(
    size: str,
    batch: int,
    seq: int,
    reps: int,
    *,
    k: int = 4,
    dtypes: tuple[str, ...] = ("float32",),
    match: str | None = None,
    sample_s: float = 0.0,
    log: Callable[[str], None] = print,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Seconds per training step of ``batch`` sequences of ``seq`` bytes, per variant and dtype."""
    if batch % k:
        raise ValueError(f"the GPT batch {batch} must be a multiple of k={k}")
    try:
        import gradtools.demo.gpt.model  # noqa: F401
    except ImportError:
        return [], ["gradtools.demo.gpt is not in this build: the GPT rows are skipped"]
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 256, size=(batch, seq + 1)), jnp.int32)
    data = (tokens[:, :-1], tokens[:, 1:])
    out, notes = [], []
    for dtype in dtypes:
        loss_fn, params, block = _model(size, jnp.dtype(dtype))
        if seq > block:
            raise ValueError(f"the GPT sequence {seq} is longer than {size}'s block {block}")
        n_params = sum(x.size for x in jax.tree.leaves(params))
        builders = _builders(loss_fn, k, batch)
        if match:
            builders = {n: b for n, b in builders.items() if re.search(match, n)}
        log(f"gpt {size} {dtype}: compiling {len(builders)} variants")
        runners = {
            name: _steps.compile_runner(
                step, params, tx, [data] if calls == 1 else _steps.split_batch(data, calls)
            )
            for name, (step, tx, calls) in builders.items()
        }
        calls = {n: _timing.calibrate(r.run, sample_s) for n, r in runners.items()}
        stats = _timing.interleave({n: r.run for n, r in runners.items()}, reps, calls)
        extra = {"size": size, "dtype": dtype, "batch": batch, "seq": seq, "k": k}
        rows = _steps.rows(stats, runners, reps, params=n_params, **extra)
        for r in rows:
            log(f"  {r['variant']:56s} {r['median_s'] * 1e3:8.1f} ms")
        out += rows
    return out, notes
