"""The GPT demo's optimizer: AdamW as language models are trained, built from gradtools.

::

  accumulate(                          # --accum-steps: micro-batches per update
    dynamic_loss_scale(                # fp16 (fixed_loss_scale in the study)
      chain(group_norms(GROUPS),       # gradient norm of embed / attn / mlp / norm
            spike_guard(               # clip a step whose norm spikes
              chain(clip_by_global_norm(1.0),
                    inject_hyperparams(adamw)(warmup + cosine, weight decay 0.1),
                    stochastic_rounding())))),   # bfloat16 params, --rounding stochastic
    every_k)

The loss scaler sits inside ``accumulate``, so an overflow in any
micro-batch skips its whole window; inside the scaler every transform sees
unscaled gradients, and the norms that ``group_norms``, ``spike_guard`` and
``clip_by_global_norm`` take share the scaler's sums of squares. Weight decay
is off, by name, for biases, LayerNorm scales and the embeddings
(:data:`NO_DECAY`). ``inject_hyperparams`` puts the learning rate where
``gradtools.metrics`` finds it.
"""

from __future__ import annotations

from typing import Any

import optax

import gradtools
from gradtools.demo.gpt.config import Config

__all__ = ["GROUPS", "NO_DECAY", "decay", "make_optimizer"]

#: Parameters AdamW does not decay: ``(regex, False)`` rules on the path names of
#: :class:`~gradtools.demo.gpt.model.GPT` (``blocks/0/ln1/scale``, ``wte/embedding``).
NO_DECAY = [(r"(^|/)(bias|scale)$", False), (r"^(wte|wpe)/", False)]

#: The groups whose gradient norms are reported (``grad_norm/<group>``).
GROUPS = [
    (r"^(wte|wpe)/", "embed"),
    (r"/(qkv|attn_proj)/", "attn"),
    (r"/(fc|mlp_proj)/", "mlp"),
    (r"(^|/)(ln1|ln2|ln_f)/", "norm"),
]


def decay(params: Any) -> Any:
    """AdamW's mask: ``True`` for the kernels, ``False`` for what :data:`NO_DECAY` names."""
    return gradtools.label_params(params, NO_DECAY, default=True)


def make_optimizer(config: Config, total_updates: int) -> optax.GradientTransformation:
    """The optimizer for ``config`` (see the module docstring).

    Args:
      config: the run's settings.
      total_updates: optimizer updates in the whole run, for the schedule.

    Returns:
      The transformation.
    """
    s = gradtools.schedules
    warmup = min(config.warmup, total_updates - 1)
    lr = s.cosine_decay(0.1 * config.learning_rate, config.learning_rate, total_updates - warmup)
    if warmup > 0:
        lr = s.with_warmup(lr, warmup)
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))
    tx = optax.chain(
        gradtools.clip_by_global_norm(config.clip_norm),
        adamw(learning_rate=lr, b2=0.95, weight_decay=config.weight_decay, mask=decay),
    )
    if config.param_dtype != "fp32" and config.rounding == "stochastic":
        tx = optax.chain(tx, gradtools.stochastic_rounding())
    tx = optax.chain(gradtools.group_norms(GROUPS, default=None), gradtools.spike_guard(tx))
    if config.scaler == "dynamic":
        tx = gradtools.dynamic_loss_scale(tx)
    elif config.scaler == "fixed":
        tx = gradtools.fixed_loss_scale(tx)
    return gradtools.accumulate(tx, config.accum_steps)
