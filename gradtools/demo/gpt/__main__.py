"""``python -m gradtools.demo.gpt``: train a byte-level GPT on Python's help text with gradtools."""

from __future__ import annotations

import argparse
import sys

from gradtools.demo.cli import add_host_options
from gradtools.demo.cli import parse_config
from gradtools.demo.cli import run_main
from gradtools.demo.gpt.config import Config
from gradtools.demo.gpt.model import DTYPES
from gradtools.demo.gpt.model import SIZES
from gradtools.demo.gpt.train import train_and_evaluate

__all__ = ["main", "parser"]

_EPILOG = """\
precisions (the optimizer state and the loss stay float32):
  fp32          float32 compute
  bf16          bfloat16 compute, no loss scaling (bfloat16 has float32's range)
  fp16          float16 compute with gradtools.dynamic_loss_scale
  fp16-noscale  float16 compute without loss scaling: small gradients flush to 0
  fp8           the blocks' matmuls in fp8 with delayed scaling (flax's fp8 ops;
                emulated on a CPU), bfloat16 elsewhere

--param-dtype bf16 keeps the parameters themselves in bfloat16, with no float32
master copy; --rounding stochastic (the default) rounds each update into them
stochastically (gradtools.stochastic_rounding), nearest rounds to nearest.

Ctrl-C lets the update in flight finish, saves it to --checkpoint-dir DIR as
DIR/N (N updates trained) and stops; --resume goes on from there to the run's
own --steps (its learning-rate schedule is built for them).

--study trains the same model eight times (fp32, bf16, fp16 without a loss
scale, with a fixed one and with a dynamic one, after Micikevicius et al.,
Mixed Precision Training, 2018; then fp8, and bf16 params rounded to nearest and
stochastically) and prints a Markdown table.
"""


def parser() -> argparse.ArgumentParser:
    """The command-line parser; its defaults are :class:`Config`'s."""
    d = Config()
    p = argparse.ArgumentParser(
        prog="python -m gradtools.demo.gpt",
        description="Train a byte-level GPT (Flax NNX) on Python's help topics with gradtools: "
        "AdamW with warmup and cosine decay, clipping, spike guard, per-group gradient norms, "
        "accumulation and loss scaling in one jitted step.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument
    a("--size", default=d.size, help=f"model size: {', '.join(SIZES)} (%(default)s)")
    a("--precision", default=d.precision, help=f"{', '.join(DTYPES)} (%(default)s); see below")
    a("--param-dtype", default=d.param_dtype, help="parameters' dtype: fp32, bf16 (%(default)s)")
    a("--rounding", default=d.rounding,
      help="updates into bf16 params: nearest, stochastic (%(default)s)")  # fmt: skip
    a("--steps", type=int, metavar="N", default=d.steps, help="optimizer updates (%(default)s)")
    a("--seed", type=int, metavar="N", default=d.seed, help="init and batch seed (%(default)s)")
    a("--batch-size", type=int, metavar="N", default=d.batch_size,
      help="windows per micro-batch, split over the devices (%(default)s)")  # fmt: skip
    a("--accum-steps", type=int, metavar="K", default=d.accum_steps,
      help="micro-batches accumulated per update (%(default)s)")  # fmt: skip
    a(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (3e-3 tiny, 1e-3 small, 6e-4 gpt2)",
    )
    a("--data-dir", metavar="DIR", help="train on the *.txt files in DIR instead")
    a("--checkpoint-dir", metavar="DIR",
      help="save checkpoints here, DIR/N after N updates (each evaluation, Ctrl-C)")  # fmt: skip
    a("--resume", action="store_true",
      help="continue the run in --checkpoint-dir exactly, to its own --steps")  # fmt: skip
    a("--plot", metavar="PATH", help="write the run's curves to a PNG")
    a("--no-progress", action="store_true", help="no progress bar, only a line per evaluation")
    study = p.add_argument_group("the precision study")
    s = study.add_argument
    s("--study", action="store_true", help="run the eight precisions and print a table")
    s("--loss-multiplier", type=float, metavar="X", default=d.loss_multiplier,
      help="multiply the loss differentiated by X, e.g. 2**-12 (%(default)s)")  # fmt: skip
    add_host_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the demo (or the study) with the options in ``argv`` (default ``sys.argv[1:]``).

    Returns:
      0 on success; a data directory without text exits with status 1, with
      one line on stderr; bad options with 2, with the usage and a line
      naming the option and value; Ctrl-C exits with 130.
    """
    p = parser()
    args, config = parse_config(p, argv, Config)  # jax.distributed first, if asked for
    if args.study:
        from gradtools.demo.gpt.study import run_study

        return run_main(p, run_study, config)
    return run_main(p, train_and_evaluate, config)


if __name__ == "__main__":
    sys.exit(main())
