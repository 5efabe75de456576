"""gradtools: training-loop gradient plumbing for JAX, as Optax transforms."""

from typing import TYPE_CHECKING
from typing import Any

from gradtools import schedules
from gradtools._version import __version__
from gradtools.accumulate import AccumulateState
from gradtools.accumulate import NoiseScaleState
from gradtools.accumulate import accumulate
from gradtools.clipping import ClipByGlobalNormState
from gradtools.clipping import clip_by_global_norm
from gradtools.clipping import global_norm
from gradtools.group_norms import GroupNormsState
from gradtools.group_norms import group_norms
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
from gradtools.metrics import nonfinite_leaves
from gradtools.naming import decay_mask
from gradtools.naming import label_params
from gradtools.naming import path_names
from gradtools.spike_guard import SpikeGuardState
from gradtools.spike_guard import spike_guard
from gradtools.stochastic_rounding import StochasticRoundingState
from gradtools.stochastic_rounding import stochastic_rounding
from gradtools.training import LossSum
from gradtools.training import apply_gradients
from gradtools.training import train_step

if TYPE_CHECKING:  # imported on first use (below): they need flax
    from gradtools.nnx_optimizer import Optimizer
    from gradtools.train_state import TrainState

__all__ = [
    "AccumulateState",
    "ClipByGlobalNormState",
    "FreezeState",
    "GroupNormsState",
    "LossScaleState",
    "LossSum",
    "NoiseScaleState",
    "Optimizer",
    "ParamGroupsState",
    "SpikeGuardState",
    "StochasticRoundingState",
    "TrainState",
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
    "group_norms",
    "label_params",
    "loss_scale",
    "metrics",
    "nonfinite_leaves",
    "param_groups",
    "path_names",
    "scale_loss",
    "schedules",
    "spike_guard",
    "stochastic_rounding",
    "train_step",
]


def __getattr__(name: str) -> Any:
    """``gradtools.TrainState`` and ``gradtools.Optimizer``, imported on first use: the rest
    needs no flax."""
    if name == "TrainState":
        from gradtools.train_state import TrainState

        return TrainState
    if name == "Optimizer":
        from gradtools.nnx_optimizer import Optimizer

        return Optimizer
    raise AttributeError(f"module 'gradtools' has no attribute {name!r}")
