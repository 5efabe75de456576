"""The precision study: one GPT trained in eight precisions, after *Mixed Precision Training*.

``python -m gradtools.demo.gpt --study`` trains the same model from the same
seed on the same batches eight times (:data:`RUNS`): float32, bfloat16, and
float16 without a loss scale, with :func:`gradtools.fixed_loss_scale` and
with :func:`gradtools.dynamic_loss_scale` (the paper's five); then fp8
matmuls, and bfloat16 parameters rounded to nearest and with
:func:`gradtools.stochastic_rounding`. Beside each run's validation
bits/byte, skipped steps and final loss scale it measures the paper's point:
backpropagated through a float16 copy of the trained model, on a fixed
validation batch, how many gradient elements come out exactly zero at loss
scale 1 and under the run's loss scale (:func:`fp16_gradient_zeros`): small
gradients flush to zero in float16 unless the loss is scaled up first.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gradtools.demo.cli import log
from gradtools.demo.gpt import data
from gradtools.demo.gpt.config import Config
from gradtools.demo.gpt.config import validate
from gradtools.demo.gpt.model import GPT
from gradtools.demo.gpt.model import SIZES
from gradtools.demo.gpt.train import loss_fn
from gradtools.demo.gpt.train import train_and_evaluate

__all__ = ["RUNS", "Row", "fp16_gradient_zeros", "run_study", "zero_fraction"]

#: ``(name, settings)`` of the study's runs: the paper's five, then fp8 matmuls and
#: bfloat16 parameters (no float32 master copy) rounded to nearest and stochastically.
RUNS = (
    ("fp32", dict(precision="fp32", loss_scale="none")),
    ("bf16", dict(precision="bf16", loss_scale="none")),
    ("fp16, no loss scale", dict(precision="fp16-noscale", loss_scale="none")),
    ("fp16, fixed loss scale", dict(precision="fp16", loss_scale="fixed")),
    ("fp16, dynamic loss scale", dict(precision="fp16", loss_scale="dynamic")),
    ("fp8", dict(precision="fp8", loss_scale="none")),
    ("bf16 params, nearest", dict(precision="bf16", param_dtype="bf16", rounding="nearest")),
    ("bf16 params, stochastic", dict(precision="bf16", param_dtype="bf16", rounding="stochastic")),
)


class Row(NamedTuple):
    """One run of the study.

    Attributes:
      name: what was trained, e.g. ``'fp16, dynamic loss scale'``.
      val_bits_per_byte: the final validation loss.
      skipped_steps: updates the loss scaler skipped (0 without one).
      loss_scale: the final loss scale (1.0 without a scaler).
      zeros_unscaled: the fraction of float16 gradient elements that are 0 at scale 1.
      zeros_scaled: the same under ``loss_scale``.
      zeros_fp32: the fraction that are 0 in float32 (truly zero gradients).
      seconds_per_step: wall time per micro-batch, compilation left out.
      history: the run's history (for the figure).
    """

    name: str
    val_bits_per_byte: float
    skipped_steps: int
    loss_scale: float
    zeros_unscaled: float
    zeros_scaled: float
    zeros_fp32: float
    seconds_per_step: float
    history: dict[str, Any]


def zero_fraction(tree: Any) -> float:
    """The fraction of all elements of the arrays in ``tree`` that are exactly 0."""
    leaves = jax.tree.leaves(tree)
    zeros = sum(int(jnp.sum(x == 0)) for x in leaves)
    return zeros / sum(int(x.size) for x in leaves)


def fp16_gradient_zeros(
    model: GPT, batch: jax.Array, scale: float, dtype: Any = jnp.float16
) -> float:
    """The fraction of exactly-zero gradient elements when ``model`` backpropagates in ``dtype``.

    Copies ``model``'s parameters into a GPT whose parameters and compute
    are both ``dtype`` (the paper's float16 copy of the master weights), and
    differentiates ``loss * scale`` on ``batch``: the gradients are ``dtype``
    arrays, and what underflows in them is exactly 0.

    Args:
      model: a trained GPT (any precision; its float32 params are cast).
      batch: ``int32 (n, block_size + 1)`` windows.
      scale: the loss scale (with any loss multiplier folded in).
      dtype: the dtype of the copy; ``jnp.float32`` gives the reference.

    Returns:
      The fraction of zero gradient elements, over all parameters.
    """
    params = nnx.state(model, nnx.Param)
    half = nnx.eval_shape(
        lambda: GPT(model.config, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    )
    nnx.update(half, jax.tree.map(lambda p: p.astype(dtype), params))
    return zero_fraction(nnx.state(_scaled_grads(half, batch, jnp.float32(scale)), nnx.Param))


@nnx.jit
def _scaled_grads(model: GPT, batch: jax.Array, scale: jax.Array) -> Any:
    """The gradients of ``loss * scale``, in the dtype of ``model``'s parameters."""
    return nnx.grad(lambda m: loss_fn(m, batch) * scale)(model)


def run_study(config: Config, text: data.Text | None = None) -> list[Row]:
    """Trains the :data:`RUNS` of ``config`` and prints a Markdown table of them.

    Each run is ``config`` with its precision and loss scale (no checkpoints,
    no progress bar); ``config.plot`` receives the study's figure.

    Args:
      config: the settings shared by the runs.
      text: bytes to use instead of loading them as ``config.data_dir`` says.

    Returns:
      One :class:`Row` per run, in the order of :data:`RUNS`.
    """
    validate(config, len(jax.devices()[: config.devices]))
    text = text if text is not None else data.load(config.data_dir)
    block = SIZES[config.size].block_size
    batch = jnp.asarray(data.eval_windows(text.valid, block, config.batch_size))
    rows = []
    for name, settings in RUNS:
        log(f"-- {name}")
        run = dataclasses.replace(
            config,
            **{"loss_scale": "none", "param_dtype": "fp32", **settings},
            progress=False,
            plot=None,
            checkpoint_dir=None,
        )
        result = train_and_evaluate(run, text)
        last = {k: v[-1] for k, v in result.history.items() if k not in ("step", "eval")}
        scale = float(last.get("loss_scale", 1.0))
        m = config.loss_multiplier
        rows.append(
            Row(
                name,
                result.val_bits_per_byte,
                int(last.get("skipped_steps", 0)),
                scale,
                fp16_gradient_zeros(result.model, batch, m),
                fp16_gradient_zeros(result.model, batch, m * scale),
                fp16_gradient_zeros(result.model, batch, m, jnp.float32),
                result.seconds_per_step,
                result.history,
            )
        )
    log(table(rows, config))
    if config.plot:
        log(f"plot: {plot_study(rows, config)}")
    return rows


def table(rows: list[Row], config: Config) -> str:
    """The study as a Markdown table, headed by what was trained."""
    head = (
        f"GPT {config.size}, {config.steps} updates of {config.batch_size} x "
        f"{config.accum_steps} windows, seed {config.seed}, loss multiplier "
        f"{config.loss_multiplier:g}\n\n"
        "| run | val bits/byte | skipped steps | final loss scale | fp16 grad zeros, scale 1 "
        "| fp16 grad zeros, run's scale | fp32 grad zeros | s/step |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    lines = [
        f"| {r.name} | {r.val_bits_per_byte:.3f} | {r.skipped_steps} | {r.loss_scale:g} "
        f"| {r.zeros_unscaled:.2%} | {r.zeros_scaled:.2%} | {r.zeros_fp32:.2%} "
        f"| {r.seconds_per_step:.3f} |"
        for r in rows
    ]
    return head + "\n".join(lines)


def plot_study(rows: list[Row], config: Config) -> str:
    """Draws validation bits/byte against the step per run, and the zero fractions."""
    import os

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 7), layout="constrained")
    FigureCanvasAgg(fig)
    curves, bars = fig.subplots(2, 1)
    for r in rows:  # the history counts micro-batches
        updates = [s / config.accum_steps for s in r.history["eval"]["step"]]
        curves.plot(updates, r.history["eval"]["val_bits_per_byte"], "o-", ms=3, label=r.name)
    curves.axhline(rows[0].history["eval"]["unigram"][-1], color="gray", ls="--", label="unigram")
    curves.set(xlabel="update", ylabel="validation bits/byte")
    curves.legend(fontsize="small")
    curves.grid(alpha=0.3)
    x = np.arange(len(rows))
    for i, (key, label) in enumerate(
        (("zeros_unscaled", "fp16, scale 1"), ("zeros_scaled", "fp16, run's loss scale"),
         ("zeros_fp32", "fp32"))
    ):  # fmt: skip
        bars.bar(x + (i - 1) * 0.27, [100 * getattr(r, key) for r in rows], 0.27, label=label)
    bars.set_xticks(x, [r.name.replace(", ", ",\n") for r in rows], fontsize="small")
    bars.set_ylabel("gradient elements\nexactly 0 (%)")
    bars.legend(fontsize="small")
    bars.grid(alpha=0.3, axis="y")
    fig.suptitle(
        f"Precision study: GPT {config.size}, {config.steps} updates, "
        f"loss multiplier {config.loss_multiplier:g}"
    )
    path = os.path.abspath(str(config.plot))
    fig.savefig(path, dpi=100)
    return path
