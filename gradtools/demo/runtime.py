"""What every demo's training loop needs besides its model: the plumbing they share.

* :func:`log` prints a line on process 0, above any progress bar;
* :class:`CtrlC` defers Ctrl-C to the loop's next step boundary, so the
  donated state survives to be checkpointed;
* :func:`add_host_options` and :func:`initialize_distributed` are the
  ``--coordinator``/``--num-processes``/``--process-id`` options and the
  ``jax.distributed.initialize`` call they make;
* :func:`global_batch` builds a batch split over the devices from the rows
  each process reads itself;
* :class:`ConfigError` is a bad option, named in its message, and
  :class:`DataError` bad data; :func:`run_main` turns them into exit codes;
* :func:`check_run` checks the options every demo has;
* :func:`settings`, :func:`resumed` and :func:`save` are ``--checkpoint-dir``/``--resume``:
  which settings a run continues with, and a checkpoint of its state;
* :func:`record` and :func:`alive` keep a run's metrics history and tell
  whether its state survived an interrupted step.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import cast

import jax
import numpy as np
from jax.sharding import NamedSharding

from gradtools.demo.checkpoint import Checkpoints

__all__ = [
    "ConfigError",
    "CtrlC",
    "DataError",
    "add_host_options",
    "alive",
    "check_run",
    "global_batch",
    "initialize_distributed",
    "log",
    "parse_args",
    "record",
    "run_main",
    "resumed",
    "save",
    "settings",
]


class ConfigError(ValueError):
    """An option has a bad value, or options do not fit together."""


class DataError(ValueError):
    """A data file is missing, damaged or does not hold what its name says."""


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


class CtrlC:
    """Defers Ctrl-C (SIGINT) inside its block to the next :meth:`check`.

    A training step is handed the params and optimizer state (donated): a
    ``KeyboardInterrupt`` raised while it is in flight loses both, and the
    checkpoint that Ctrl-C promises with them. So the first Ctrl-C only asks
    to stop, and the loop stops between steps; a second one stops at once.
    Outside the main thread (where Python delivers signals) nothing changes.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        # No printing here: a handler that writes to a stream the loop is writing
        # to raises RuntimeError (a reentrant call) in the middle of the step.
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def check(self) -> None:
        """Raises ``KeyboardInterrupt`` if a stop was asked for."""
        if self.requested:
            raise KeyboardInterrupt


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


def parse_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``p.parse_args(argv)``, then :func:`initialize_distributed` (a bad option exits with 2)."""
    args = p.parse_args(argv)
    try:
        initialize_distributed(args)  # before anything else asks JAX for its devices
    except ConfigError as e:
        p.error(str(e))
    return args


def initialize_distributed(args: argparse.Namespace) -> None:
    """Calls ``jax.distributed.initialize`` when a multi-host option is given.

    On clusters that JAX recognises (Cloud TPU, SLURM, ...) the options left
    out are found there; elsewhere all three are needed.

    Raises:
      ConfigError: naming the option, for a malformed address or a process
        count or number out of range.
    """
    given = {
        "coordinator_address": args.coordinator,
        "num_processes": args.num_processes,
        "process_id": args.process_id,
    }
    if all(v is None for v in given.values()):
        return
    n, i = args.num_processes, args.process_id
    if args.coordinator is not None and not re.fullmatch(r"\[?[\w.:-]+\]?:\d+", args.coordinator):
        raise ConfigError(f"--coordinator {args.coordinator}: expected HOST:PORT")
    if n is not None and n < 1:
        raise ConfigError(f"--num-processes {n}: must be an integer >= 1")
    if i is not None and (i < 0 or n is not None and i >= n):
        upper = "" if n is None else f" to {n - 1}"
        raise ConfigError(f"--process-id {i}: must be an integer from 0{upper}")
    jax.distributed.initialize(**given)


def global_batch(
    sharding: NamedSharding, indices: np.ndarray, read: Callable[[np.ndarray], np.ndarray]
) -> jax.Array:
    """The rows ``read(indices)``, split over ``sharding``'s devices as one global array.

    Each process reads only the rows its own devices hold.
    """
    n = len(indices)
    held = sharding.addressable_devices_indices_map((n,)).values()  # {device: (slice,)}
    starts, stops = zip(*(cast(tuple, index)[0].indices(n)[:2] for index in held))
    local = read(indices[min(starts) : max(stops)])
    return jax.make_array_from_process_local_data(sharding, local, (n, *local.shape[1:]))


def settings(
    config: Any,
    ckpt: Checkpoints | None,
    run_options: Sequence[str],
    *,
    fixed: Sequence[str] = (),
    unit: str = "step",
) -> tuple[Any, dict[str, Any] | None]:
    """The settings to run with, and the newest checkpoint's metadata when resuming.

    Args:
      config: a demo's settings (a frozen dataclass with ``checkpoint_dir``,
        ``resume`` and, optionally, ``eval_only``).
      ckpt: the checkpoints in ``config.checkpoint_dir``, if given.
      run_options: the fields a resumed run takes from ``config``.
      fixed: the fields that ``--resume`` refuses to see changed (instead of
        noting that the checkpoint's value is kept), such as the length of the
        run that the learning-rate schedule is built for.
      unit: what the demo's checkpoint steps count, for the messages.

    Returns:
      ``(config, None)`` for a fresh run; ``(the checkpoint's settings merged
      with run_options, its metadata with 'step')`` to resume.

    Raises:
      ConfigError: if a fresh run's directory holds a checkpoint, a resumed
        one has no directory or no checkpoint in it, or ``--resume`` asks for
        another value of a ``fixed`` field.
    """
    latest = ckpt.latest_step() if ckpt else None
    eval_only = getattr(config, "eval_only", False)
    if not (config.resume or eval_only):
        if latest is not None:
            raise ConfigError(
                f"--checkpoint-dir {config.checkpoint_dir} already holds a checkpoint ({unit} "
                f"{latest}): pass --resume to continue it, or choose another directory"
            )
        return config, None
    if config.resume and eval_only:
        raise ConfigError("--resume and --eval-only exclude each other")
    if ckpt is None:
        raise ConfigError(
            f"{'--resume' if config.resume else '--eval-only'} needs --checkpoint-dir"
        )
    if latest is None:
        raise ConfigError(f"--checkpoint-dir {config.checkpoint_dir}: holds no checkpoint")
    meta = {**ckpt.restore_meta(latest), "step": latest}
    if config.resume:
        _check_fixed(config, meta["config"], fixed)
    config, ignored = resumed(config, meta["config"], run_options)
    if ignored and config.resume:
        log(f"note: continuing with the checkpoint's settings, not {', '.join(ignored)}")
    return config, meta


def _check_fixed(config: Any, saved: dict[str, Any], fixed: Sequence[str]) -> None:
    """Raises :class:`ConfigError` if ``config`` asks for another value of a ``fixed`` field."""
    defaults = type(config)()
    for name in fixed:
        asked, was = getattr(config, name), saved[name]
        if asked != was and asked != getattr(defaults, name):  # a default is not asked for
            flag = "--" + name.replace("_", "-")
            raise ConfigError(
                f"{flag} {asked}: --resume finishes the run in {config.checkpoint_dir} as it was "
                f"set up, with {flag} {was} (its learning-rate schedule ends there): leave out "
                f"{flag}, or start a new run with {flag} {asked} in another --checkpoint-dir"
            )


def resumed(
    config: Any, saved: dict[str, Any], run_options: Sequence[str]
) -> tuple[Any, list[str]]:
    """Merges a checkpoint's settings with the run options of ``config``.

    Args:
      config: the settings asked for now (a dataclass whose fields all have
        defaults).
      saved: ``dataclasses.asdict`` of the checkpoint's settings, read back
        from JSON (so its tuples are lists).
      run_options: the fields taken from ``config``, not the checkpoint.

    Returns:
      The settings to continue with: the checkpoint's, except for
      ``run_options``; and ``'name=value'`` for each setting of ``config``
      that is ignored because it differs. A setting left at its default is
      taken as not asked for, and not listed.
    """
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()}
    kind = type(config)
    merged = kind(**{**saved, **{k: getattr(config, k) for k in run_options}})
    defaults = kind()
    ignored = [
        f"{k}={getattr(config, k)!r}"
        for k in saved
        if k not in run_options
        and getattr(config, k) != saved[k]
        and getattr(config, k) != getattr(defaults, k)
    ]
    return merged, ignored


def save(
    ckpt: Checkpoints | None, step: int, state: dict[str, Any], config: Any, **meta: Any
) -> str | None:
    """Checkpoints ``state`` at ``step`` (once), if the run has a checkpoint directory.

    The metadata saved is ``{'config': asdict(config), **meta}`` (JSON).
    """
    if ckpt is None:
        return None
    if ckpt.latest_step() == step:
        return ckpt.path(step)  # saved already (Ctrl-C during a save)
    return ckpt.save(step, state, {"config": dataclasses.asdict(config), **meta})


def alive(tree: Any) -> bool:
    """Whether the arrays of ``tree`` are intact (not donated to a step that never returned)."""
    return not any(x.is_deleted() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def record(
    history: dict[str, Any],
    recorded: list[tuple[int, dict[str, jax.Array]]],
    keys: Callable[[str], bool],
) -> None:
    """Appends the metrics of the steps trained, those whose key ``keys`` accepts, to ``history``.

    Waits for the steps' results; ``history['step']`` gets their steps.
    """
    steps, records = zip(*jax.device_get(recorded)) if recorded else ((), ())
    history["step"].extend(steps)
    for key in records[0] if records else ():
        if keys(key):
            history.setdefault(key, []).extend(float(r[key]) for r in records)
