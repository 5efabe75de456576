"""gradtools: training-loop gradient plumbing for JAX, as Optax transforms."""

from gradtools import schedules
from gradtools._version import __version__
from gradtools.loss_scale import (
    LossScaleState,
    all_finite,
    dynamic_loss_scale,
    fixed_loss_scale,
    loss_scale,
    scale_loss,
)
from gradtools.metrics import metrics
from gradtools.training import train_step

__all__ = [
    "LossScaleState",
    "__version__",
    "all_finite",
    "dynamic_loss_scale",
    "fixed_loss_scale",
    "loss_scale",
    "metrics",
    "scale_loss",
    "schedules",
    "train_step",
]
