"""gradtools: training-loop gradient plumbing for JAX, as Optax transforms."""

from gradtools import schedules
from gradtools._version import __version__
from gradtools.accumulate import AccumulateState
from gradtools.accumulate import accumulate
from gradtools.clipping import ClipByGlobalNormState
from gradtools.clipping import clip_by_global_norm
from gradtools.clipping import global_norm
from gradtools.groups import FreezeState
from gradtools.groups import ParamGroupsState
from gradtools.groups import describe
from gradtools.groups import freeze
from gradtools.groups import frozen
from gradtools.groups import param_groups
from gradtools.loss_scale import LossScaleState
from gradtools.loss_scale import all_finite
from gradtools.loss_scale import dynamic_loss_scale
from gradtools.loss_scale import fixed_loss_scale
from gradtools.loss_scale import loss_scale
from gradtools.loss_scale import scale_loss
from gradtools.metrics import metrics
from gradtools.naming import decay_mask
from gradtools.naming import label_params
from gradtools.naming import path_names
from gradtools.training import apply_gradients
from gradtools.training import train_step

__all__ = [
    "AccumulateState",
    "ClipByGlobalNormState",
    "FreezeState",
    "LossScaleState",
    "ParamGroupsState",
    "__version__",
    "accumulate",
    "all_finite",
    "apply_gradients",
    "clip_by_global_norm",
    "decay_mask",
    "describe",
    "dynamic_loss_scale",
    "fixed_loss_scale",
    "freeze",
    "frozen",
    "global_norm",
    "label_params",
    "loss_scale",
    "metrics",
    "param_groups",
    "path_names",
    "scale_loss",
    "schedules",
    "train_step",
]
