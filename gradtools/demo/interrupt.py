"""Stopping a run on Ctrl-C between two steps, so that its state can still be saved.

* :class:`CtrlC` defers Ctrl-C to the loop's next step boundary;
* :func:`alive` tells whether a state survived a step that was interrupted
  (a step is handed its state donated, and loses it if it never returns).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import jax

__all__ = ["CtrlC", "alive"]


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


def alive(tree: Any) -> bool:
    """Whether the arrays of ``tree`` are intact (not donated to a step that never returned)."""
    return not any(x.is_deleted() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))
