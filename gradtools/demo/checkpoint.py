"""Checkpoints of a demo run with orbax-checkpoint.

A checkpoint is saved under its step, the demo's count of what it has
trained (micro-batches for LeNet-5, optimizer updates for the GPT), and
holds two items:

* ``state``: ``{'params': ..., 'opt_state': ...}``, the arrays, restored with
  the structure, dtypes and shardings of a template, so the optimizer's
  NamedTuple states (the loss scale, a half-filled accumulation window, the
  optimizer's moments and step count) come back exactly;
* ``meta``: JSON with the run's config and its history (for the plot).
"""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp

__all__ = ["Checkpoints"]


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
