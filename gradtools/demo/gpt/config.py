"""The GPT demo's settings: one :class:`Config` field per CLI option, and their checks."""

from __future__ import annotations

import dataclasses
import math

from gradtools.demo.cli import check_run
from gradtools.demo.errors import ConfigError
from gradtools.demo.gpt.model import DTYPES
from gradtools.demo.gpt.model import PARAM_DTYPES
from gradtools.demo.gpt.model import SIZES

__all__ = ["LOSS_SCALES", "ROUNDINGS", "RUN_OPTIONS", "Config", "validate"]

#: ``loss_scale`` values: ``auto`` is dynamic for ``fp16`` and none for the others.
LOSS_SCALES = ("auto", "none", "fixed", "dynamic")
#: ``rounding`` values: how updates are rounded into bfloat16 parameters.
ROUNDINGS = ("nearest", "stochastic")
_DEFAULT_LR = {"tiny": 3e-3, "small": 1e-3, "gpt2": 6e-4}
# Options a resumed run takes from the command line; the rest from the checkpoint.
RUN_OPTIONS = ("checkpoint_dir", "resume", "plot", "progress", "devices", "max_steps")


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of a GPT demo run; the CLI options, one field each.

    ``steps`` counts optimizer updates, each of ``accum_steps`` micro-batches
    of ``batch_size`` windows. ``loss_scale``, ``loss_multiplier``,
    ``eval_every``, ``eval_windows``, ``devices`` and ``max_steps`` have no
    CLI option of the training run (the study sets the first two): tests use
    ``max_steps`` to stop a run early, as if interrupted, after that many
    updates. Like ``steps``, ``eval_every`` and the checkpoints count updates.
    """

    size: str = "tiny"
    precision: str = "fp32"
    param_dtype: str = "fp32"
    rounding: str = "stochastic"
    steps: int = 300
    batch_size: int = 16
    accum_steps: int = 2
    lr: float | None = None  # None: 3e-3 for tiny, 1e-3 for small, 6e-4 for gpt2
    warmup_steps: int | None = None  # None: a tenth of the steps
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    loss_scale: str = "auto"
    loss_multiplier: float = 1.0
    seed: int = 0
    data_dir: str | None = None
    checkpoint_dir: str | None = None
    resume: bool = False
    plot: str | None = None
    progress: bool = True
    eval_every: int | None = None  # None: ten evaluations a run
    eval_windows: int = 64
    devices: int | None = None
    max_steps: int | None = None

    @property
    def learning_rate(self) -> float:
        """``lr``, or the size's default when it is ``None``."""
        return _DEFAULT_LR.get(self.size, 1e-3) if self.lr is None else self.lr

    @property
    def warmup(self) -> int:
        """``warmup_steps``, or a tenth of ``steps`` when it is ``None``."""
        return self.steps // 10 if self.warmup_steps is None else self.warmup_steps

    @property
    def scaler(self) -> str:
        """The loss scaler: ``'none'``, ``'fixed'`` or ``'dynamic'``."""
        if self.loss_scale != "auto":
            return self.loss_scale
        return "dynamic" if self.precision == "fp16" else "none"

    @property
    def evaluate_every(self) -> int:
        """``eval_every``, or a tenth of ``steps`` (at least 1) when it is ``None``."""
        return max(self.steps // 10, 1) if self.eval_every is None else self.eval_every


def validate(config: Config, n_devices: int) -> None:
    """Raises :class:`ConfigError` naming the option when a setting is bad."""

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    need(config.size in SIZES, f"--size {config.size}: not in {tuple(SIZES)}")
    need(config.precision in DTYPES, f"--precision {config.precision}: not in {tuple(DTYPES)}")
    need(
        config.param_dtype in PARAM_DTYPES,
        f"--param-dtype {config.param_dtype}: not in {tuple(PARAM_DTYPES)}",
    )
    need(config.rounding in ROUNDINGS, f"--rounding {config.rounding}: not in {ROUNDINGS}")
    for name in ("steps", "batch_size", "accum_steps", "eval_windows"):
        value = getattr(config, name)
        need(value >= 1, f"--{name.replace('_', '-')} {value}: must be an integer >= 1")
    lr = config.learning_rate
    need(math.isfinite(lr) and lr > 0, f"--lr {lr}: must be a finite number > 0")
    need(config.warmup >= 0, f"--warmup-steps {config.warmup_steps}: must be >= 0")
    need(config.evaluate_every >= 1, f"eval_every={config.eval_every}: must be >= 1")
    need(
        config.loss_scale in LOSS_SCALES, f"loss_scale={config.loss_scale!r}: not in {LOSS_SCALES}"
    )
    m = config.loss_multiplier
    need(math.isfinite(m) and m > 0, f"--loss-multiplier {m}: must be a finite number > 0")
    check_run(config, n_devices)
