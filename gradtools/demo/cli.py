"""The command line both demos share: host options, parsing, checks, output and exit codes.

A demo's ``main`` is :func:`parse_config` then :func:`run_main`; its own
``parser()`` adds its options, then :func:`add_host_options`.

* :func:`add_host_options` adds ``--coordinator``, ``--num-processes`` and
  ``--process-id``;
* :func:`parse_config` parses the options, starts ``jax.distributed`` when
  they ask for it, and builds the demo's config from them;
* :func:`run_main` runs the demo and turns its errors into exit statuses;
* :func:`check_run` checks the options every demo has;
* :func:`log` prints a line on process 0, above any progress bar.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

import jax

from gradtools.demo.distributed import initialize_distributed
from gradtools.demo.errors import ConfigError
from gradtools.demo.errors import DataError

__all__ = ["add_host_options", "check_run", "log", "parse_config", "run_main"]


def add_host_options(p: argparse.ArgumentParser) -> None:
    """Adds ``--coordinator``, ``--num-processes`` and ``--process-id`` to ``p``."""
    hosts = p.add_argument_group(
        "several hosts (jax.distributed)",
        "Every process runs this command on the same data and trains on its own share\n"
        "of each batch; process 0 also runs the coordinator, and alone prints, plots\n"
        "and writes the checkpoint (put --checkpoint-dir on a shared file system).",
    )
    h = hosts.add_argument
    h("--coordinator", metavar="HOST:PORT", help="process 0's address, the same for all")
    h("--num-processes", type=int, metavar="N", help="how many processes take part")
    h("--process-id", type=int, metavar="I", help="this process's number, 0 to N-1")


def parse_config(
    p: argparse.ArgumentParser, argv: list[str] | None, kind: Any
) -> tuple[argparse.Namespace, Any]:
    """Parses ``argv`` with ``p``, starts ``jax.distributed`` if asked, and builds the config.

    Args:
      p: the demo's parser, with :func:`add_host_options`' options and
        ``--no-progress``.
      argv: the options (``None``: ``sys.argv[1:]``).
      kind: the demo's config, a frozen dataclass: each field named as an
        option's destination (``--batch-size``: ``batch_size``) takes its
        value (a list as a tuple); ``progress`` is ``not --no-progress``.

    Returns:
      The parsed options and the config built from them.

    Raises:
      SystemExit: with status 2 and the usage, for a bad option (through
        ``p.error``), before JAX is asked for its devices.
    """
    args = p.parse_args(argv)
    try:
        initialize_distributed(args)  # before anything else asks JAX for its devices
    except ConfigError as e:
        p.error(str(e))
    given = vars(args)
    values = {f.name: given[f.name] for f in dataclasses.fields(kind) if f.name in given}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return args, kind(**values, progress=not args.no_progress)


def run_main(
    p: argparse.ArgumentParser, train_and_evaluate: Callable[[Any], Any], config: Any
) -> int:
    """Runs ``train_and_evaluate(config)`` for a demo's ``main`` and returns its exit status.

    Returns:
      0 on success; bad data exits with status 1, with one line on stderr
      saying what is wrong; bad options with 2 (through ``p.error``), with
      the usage and a line saying what is wrong; Ctrl-C exits with 130.
    """
    try:
        train_and_evaluate(config)
    except ConfigError as e:
        p.error(str(e))
    except DataError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def check_run(config: Any, n_devices: int) -> None:
    """Checks the settings every demo has: ``seed``, ``devices``, ``batch_size``, ``plot``.

    Raises:
      ConfigError: naming the option and its value when one is bad.
    """

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    need(  # numpy's and jax's random keys take 0 to 2**32 - 1
        0 <= config.seed < 2**32, f"--seed {config.seed}: must be an integer from 0 to 2**32 - 1"
    )
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


def log(message: str) -> None:
    """Prints a line (on process 0), above any progress bar."""
    if jax.process_index() == 0:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stdout)
