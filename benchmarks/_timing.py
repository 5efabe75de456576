"""Interleaved timing: every case runs once per round, so machine noise hits all alike."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass

import jax

__all__ = ["Stats", "calibrate", "interleave", "ratio", "settle"]


@dataclass(frozen=True)
class Stats:
    """Seconds per call over the repetitions of one case."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def as_dict(self) -> dict[str, float]:
        return {"median_s": self.median, "min_s": self.min, "max_s": self.max}


def settle(quiet_s: float = 0.01, max_s: float = 2.0) -> float:
    """Waits until this process's other threads have used no CPU for ``quiet_s``.

    XLA:CPU hands back a call's result before it has freed the call's
    temporaries: one of its worker threads unmaps them afterwards (about 45 ms
    for 768 MiB on the 2-core machine), while the next call already runs. Left
    alone, that work is charged to whatever runs next. The CPU time of other
    threads advances in scheduler ticks (4 ms at HZ=250), so ``quiet_s``
    should span a few. Gives up after ``max_s``. Returns at once when JAX runs
    on an accelerator, whose allocator keeps device memory between calls: no
    such work follows a call there.

    Returns:
      The seconds waited.
    """
    if jax.default_backend() != "cpu":
        return 0.0
    t0 = last_busy = time.perf_counter()
    used = time.process_time() - time.thread_time()  # every thread's CPU but this one's
    while True:
        now = time.perf_counter()
        now_used = time.process_time() - time.thread_time()
        if now_used > used:
            used, last_busy = now_used, now
        elif now - last_busy >= quiet_s or now - t0 >= max_s:
            return now - t0


def calibrate(fn: Callable[[], None], target_s: float, max_calls: int = 64) -> int:
    """How many calls of ``fn`` (already warm) make one sample of about ``target_s``."""
    settle()
    fn()
    t0 = time.perf_counter()
    fn()
    dt = max(time.perf_counter() - t0, 1e-6)
    return max(1, min(max_calls, math.ceil(target_s / dt)))


def interleave(
    cases: Mapping[str, Callable[[], None]],
    reps: int,
    calls: Mapping[str, int] | None = None,
) -> dict[str, Stats]:
    """Times each case ``reps`` times, one case after the other in every round.

    Each round starts at a different case (a rotation), so no case always runs
    right after the same neighbour. ``calls[name]`` calls make one sample; the
    sample is divided by it. Every callable must block until its result is ready.

    Before each sample the process settles (:func:`settle`) and the case runs once
    untimed, so that the timed calls find the machine as the case's own
    previous call leaves it, as in a training loop: each call's leftover work
    (temporaries freed after it returns) overlaps the next call of the same
    case, never a call of another case.

    Returns:
      Seconds per call, per case.
    """
    names = list(cases)
    calls = calls or {}
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            n = calls.get(name, 1)
            fn = cases[name]
            settle()
            fn()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n)
    return {n: Stats(tuple(s)) for n, s in samples.items()}


def ratio(a: Stats, b: Stats) -> float:
    """The median over rounds of ``a / b`` within each round: the ratio the report quotes.

    Both cases ran in the same round, seconds apart, so a load change on the
    machine between rounds scales both; the per-round ratio cancels it where a
    ratio of the two medians would not.
    """
    return statistics.median(x / y for x, y in zip(a.samples, b.samples))
