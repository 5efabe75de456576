"""Compile time against the number of leaves.

Each case's step is traced, lowered and compiled for parameter *shapes* (no
arrays are allocated) at every leaf count; rounds are interleaved across the
cases. Linear growth shows as a per-leaf cost that stays flat as leaves grow.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax

from benchmarks import _xla
from benchmarks.cases import param_shapes
from benchmarks.cases import update_cases

__all__ = ["run_compile"]


def run_compile(
    leaves: Sequence[int],
    reps: int,
    *,
    n_params: int = 1 << 20,
    match: str | None = None,
    select_max_leaves: int = 200,
    budget_s: float = 300.0,
    dtype: str = "float32",
    log: Callable[[str], None] = print,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Times lowering and compiling each case; one row per (leaves, case).

    A case is not compiled at a leaf count where the growth of its own
    earlier times predicts more than ``budget_s`` seconds (the select-whole-tree
    patterns grow quadratically); the notes give the prediction.
    """
    cases = [c for c in update_cases() if "*" not in c.groups]
    if match:
        cases = [c for c in cases if re.search(match, c.name)]
    seen: dict[str, list[tuple[int, float]]] = {c.name: [] for c in cases}
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for n_leaves in leaves:
        shapes = param_shapes(max(n_params, n_leaves), n_leaves, dtype)
        members = []
        for c in cases:
            guess = _predict(seen[c.name], n_leaves)
            if c.select_tree and n_leaves > select_max_leaves:
                notes.append(
                    f"{c.name}: not compiled at {n_leaves} leaves (over --select-max-leaves="
                    f"{select_max_leaves}); its growth predicts {guess:.0f} s"
                )
            elif guess > budget_s:
                notes.append(
                    f"{c.name}: not compiled at {n_leaves} leaves: its growth so far predicts "
                    f"{guess:.0f} s, over the {budget_s:.0f} s budget"
                )
            else:
                members.append(c)
        if not members:
            continue
        lower: dict[str, list[float]] = {c.name: [] for c in members}
        comp: dict[str, list[float]] = {c.name: [] for c in members}
        for r in range(reps):
            k = r % len(members)
            for c in members[k:] + members[:k]:
                pattern = c.make()  # fresh closures: nothing is reused from a cache
                carry = jax.eval_shape(pattern.init, shapes)
                compiled = _xla.compile_step(pattern.step, carry, shapes)
                lower[c.name].append(compiled.lower_s)
                comp[c.name].append(compiled.compile_s)
                log(f"compile {n_leaves:5d} leaves {c.name:58s} {compiled.total_s:8.2f} s")
        for c in members:
            totals = [a + b for a, b in zip(lower[c.name], comp[c.name])]
            seen[c.name].append((n_leaves, statistics.median(totals)))
            rows.append(
                {
                    "leaves": n_leaves,
                    "case": c.name,
                    "lower_s": statistics.median(lower[c.name]),
                    "compile_s": statistics.median(comp[c.name]),
                    "median_s": statistics.median(totals),
                    "min_s": min(totals),
                    "max_s": max(totals),
                    "reps": reps,
                    "select_tree": c.select_tree,
                }
            )
    return rows, notes


def _predict(history: list[tuple[int, float]], n_leaves: int) -> float:
    """Seconds at ``n_leaves`` from a power law through the last two points (or linear)."""
    if not history:
        return 0.0
    (n1, t1), (n0, t0) = history[-1], history[-2] if len(history) > 1 else (0, 0.0)
    power = 1.0
    if n0 > 0 and t0 > 0 and n1 > n0 and t1 > t0:
        power = max(1.0, math.log(t1 / t0) / math.log(n1 / n0))
    return t1 * (n_leaves / n1) ** power
