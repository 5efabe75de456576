"""gradtools: training-loop gradient plumbing for JAX, as Optax transforms."""

from gradtools._version import __version__
from gradtools.accumulate import AccumulateState
from gradtools.accumulate import accumulate
from gradtools.clipping import ClipByGlobalNormState
from gradtools.clipping import clip_by_global_norm
from gradtools.clipping import global_norm
from gradtools.loss_scale import LossScaleState
from gradtools.loss_scale import all_finite
from gradtools.loss_scale import dynamic_loss_scale
from gradtools.loss_scale import fixed_loss_scale
from gradtools.loss_scale import loss_scale
from gradtools.loss_scale import scale_loss
from gradtools.metrics import metrics
from gradtools.training import train_step

__all__ = [
    "AccumulateState",
    "ClipByGlobalNormState",
    "LossScaleState",
    "__version__",
    "accumulate",
    "all_finite",
    "clip_by_global_norm",
    "dynamic_loss_scale",
    "fixed_loss_scale",
    "global_norm",
    "loss_scale",
    "metrics",
    "scale_loss",
    "train_step",
]
