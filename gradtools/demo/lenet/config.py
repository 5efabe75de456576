"""The LeNet-5 demo's settings: one :class:`Config` field per CLI option, and their checks."""

from __future__ import annotations

import dataclasses
import math
import re

from gradtools.demo.cli import check_run
from gradtools.demo.errors import ConfigError
from gradtools.demo.lenet.model import DTYPES

__all__ = [
    "LOSS_SCALES",
    "OPTIMIZERS",
    "RUN_OPTIONS",
    "SCHEDULES",
    "Config",
    "ConfigError",
    "validate",
]

OPTIMIZERS = ("momentum", "adam", "adamw")
SCHEDULES = (
    "constant",
    "piecewise_constant",
    "exponential_decay",
    "natural_exp_decay",
    "inverse_time_decay",
    "cosine_decay",
    "polynomial_decay",
    "warmup",
)
LOSS_SCALES = ("none", "fixed", "dynamic")
_DEFAULT_LR = {"momentum": 0.01, "adam": 1e-3, "adamw": 1e-3}
# Options a resumed run takes from the command line; the rest from the checkpoint.
RUN_OPTIONS = (
    "checkpoint_dir",
    "resume",
    "eval_only",
    "plot",
    "progress",
    "verbose",
    "devices",
    "max_steps",
)


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of a demo run; the CLI options, one field each.

    ``devices`` and ``max_steps`` have no CLI option: tests and notebooks use
    them to pick the number of devices and to stop a run early (as if
    interrupted) after ``max_steps`` micro-batches.
    """

    epochs: int = 20
    batch_size: int = 32
    accum_steps: int = 4
    optimizer: str = "momentum"
    lr: float | None = None  # None: 0.01 for momentum, 0.001 for adam and adamw
    schedule: str = "constant"
    warmup_steps: int = 0
    clip_norm: float | None = 5.0
    loss_scale: str = "dynamic"
    precision: str = "fp32"
    freeze: tuple[str, ...] = ()
    seed: int = 0
    data_dir: str | None = None
    checkpoint_dir: str | None = None
    resume: bool = False
    eval_only: bool = False
    plot: str | None = None
    progress: bool = True
    verbose: bool = False
    devices: int | None = None
    max_steps: int | None = None

    @property
    def learning_rate(self) -> float:
        """``lr``, or the optimizer's default when it is ``None``."""
        return _DEFAULT_LR[self.optimizer] if self.lr is None else self.lr


def validate(config: Config, n_devices: int) -> None:
    """Raises :class:`ConfigError` naming the option when a setting is bad."""

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    for name in ("epochs", "batch_size", "accum_steps"):
        value = getattr(config, name)
        need(value >= 1, f"--{name.replace('_', '-')} {value}: must be an integer >= 1")
    need(config.optimizer in OPTIMIZERS, f"--optimizer {config.optimizer}: not in {OPTIMIZERS}")
    need(config.schedule in SCHEDULES, f"--schedule {config.schedule}: not in {SCHEDULES}")
    need(
        config.loss_scale in LOSS_SCALES, f"--loss-scale {config.loss_scale}: not in {LOSS_SCALES}"
    )
    need(config.precision in DTYPES, f"--precision {config.precision}: not in {tuple(DTYPES)}")
    lr = config.learning_rate
    need(math.isfinite(lr) and lr > 0, f"--lr {lr}: must be a finite number > 0")
    need(config.warmup_steps >= 0, f"--warmup-steps {config.warmup_steps}: must be >= 0")
    need(
        config.schedule != "warmup" or config.warmup_steps > 0,
        "--schedule warmup needs --warmup-steps N with N >= 1",
    )
    clip = config.clip_norm
    need(clip is None or (math.isfinite(clip) and clip > 0), f"--clip-norm {clip}: must be > 0")
    for pattern in config.freeze:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"--freeze {pattern!r}: not a regular expression: {e}") from None
    check_run(config, n_devices)
