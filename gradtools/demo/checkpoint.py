"""A demo run's checkpoints (orbax-checkpoint), and what ``--checkpoint-dir``/``--resume`` do.

A checkpoint is saved under its step, the demo's count of what it has
trained (micro-batches for LeNet-5, optimizer updates for the GPT), and
holds two items:

* ``state``: the arrays (LeNet-5's ``{'params', 'opt_state'}``, the GPT's
  ``{'model', 'optimizer'}``), restored with the structure, dtypes and
  shardings of a template, so the optimizer's
  NamedTuple states (the loss scale, a half-filled accumulation window, the
  optimizer's moments and step count) come back exactly;
* ``meta``: JSON with the run's config and its history (for the plot).

:class:`Checkpoints` reads and writes them; :func:`settings` decides which
settings a run starts or continues with, and :func:`save` writes a run's
checkpoint once per step.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import orbax.checkpoint as ocp

from gradtools.demo.cli import log
from gradtools.demo.errors import ConfigError

__all__ = ["Checkpoints", "resumed", "save", "settings"]


class Checkpoints:
    """The checkpoints in one directory.

    Args:
      directory: where to keep them; created on the first save.
      max_to_keep: how many of the latest checkpoints to keep.
    """

    def __init__(self, directory: str | os.PathLike[str], max_to_keep: int = 2):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=False, enable_async_checkpointing=False
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The step of the newest checkpoint, or ``None`` when there is none."""
        return self._manager.latest_step()

    def path(self, step: int) -> str:
        """The directory of the checkpoint saved at ``step``."""
        return os.path.join(self.directory, str(step))

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> str:
        """Saves ``state`` (a pytree of arrays) and ``meta`` (JSON) at ``step``."""
        os.makedirs(self.directory, exist_ok=True)
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self._manager.save(step, args=args, force=True)
        self._manager.wait_until_finished()
        return self.path(step)

    def restore_meta(self, step: int) -> dict[str, Any]:
        """The JSON saved at ``step``."""
        args = ocp.args.Composite(meta=ocp.args.JsonRestore())
        return self._manager.restore(step, args=args)["meta"]

    def restore(self, step: int, template: Any) -> Any:
        """The arrays saved at ``step``, shaped, typed and sharded like ``template``.

        ``template`` is a pytree of ``jax.ShapeDtypeStruct`` with shardings (or
        of arrays) with the structure the state was saved with.
        """
        args = ocp.args.Composite(state=ocp.args.StandardRestore(template))
        return self._manager.restore(step, args=args)["state"]

    def close(self) -> None:
        """Waits for pending writes and releases the manager."""
        self._manager.close()


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
