"""Interleaved timing: every case runs once per round, so machine noise hits all alike."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Stats", "calibrate", "interleave", "ratio"]


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


def calibrate(fn: Callable[[], None], target_s: float, max_calls: int = 64) -> int:
    """How many calls of ``fn`` (already warm) make one sample of about ``target_s``."""
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
    sample is divided by it. Every callable must block until its work is done.

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
