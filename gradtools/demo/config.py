"""The demo's settings: one :class:`Config` field per CLI option, and their checks."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

import jax

from gradtools.demo.model import DTYPES

__all__ = [
    "LOSS_SCALES",
    "OPTIMIZERS",
    "RUN_OPTIONS",
    "SCHEDULES",
    "Config",
    "ConfigError",
    "resumed",
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


class ConfigError(ValueError):
    """An option has a bad value, or options do not fit together."""


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
    need(  # numpy's and jax's random keys take 0 to 2**32 - 1
        0 <= config.seed < 2**32, f"--seed {config.seed}: must be an integer from 0 to 2**32 - 1"
    )
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
    need(
        config.devices is None or 1 <= config.devices <= len(jax.devices()),
        f"devices={config.devices}: this machine has {len(jax.devices())}",
    )
    need(
        config.devices in (None, len(jax.devices())) or jax.process_count() == 1,
        f"devices={config.devices}: with {jax.process_count()} processes, every device trains",
    )
    need(
        config.batch_size % n_devices == 0,
        f"--batch-size {config.batch_size} does not split over {n_devices} devices: "
        f"use a multiple of {n_devices}",
    )
    if config.plot is not None:
        folder = os.path.dirname(os.path.abspath(config.plot))
        need(config.plot.lower().endswith(".png"), f"--plot {config.plot}: must end in .png")
        need(os.path.isdir(folder), f"--plot {config.plot}: no directory {folder}")


def resumed(config: Config, saved: dict[str, Any]) -> tuple[Config, list[str]]:
    """Merges a checkpoint's settings with the run options of ``config``.

    Args:
      config: the settings asked for now.
      saved: ``dataclasses.asdict`` of the checkpoint's settings.

    Returns:
      The settings to continue with: the checkpoint's, except for
      :data:`RUN_OPTIONS`, which come from ``config``; and ``'name=value'``
      for each setting of ``config`` that is ignored because it differs. A
      setting left at its default is taken as not asked for, and not listed.
    """
    saved = {**saved, "freeze": tuple(saved["freeze"])}
    merged = Config(**{**saved, **{k: getattr(config, k) for k in RUN_OPTIONS}})
    defaults = Config()
    ignored = [
        f"{k}={getattr(config, k)!r}"
        for k in saved
        if k not in RUN_OPTIONS
        and getattr(config, k) != saved[k]
        and getattr(config, k) != getattr(defaults, k)
    ]
    return merged, ignored
