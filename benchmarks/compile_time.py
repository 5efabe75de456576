"""Compile time against the number of leaves.

Each case's step is traced, lowered and compiled for parameter *shapes* (no
arrays are allocated) at every leaf count; rounds are interleaved across the
cases. Linear growth shows as a per-leaf cost that stays flat as leaves grow.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import jax

from benchmarks import _xla
from benchmarks.cases import param_shapes, update_cases

__all__ = ["run_compile"]


def run_compile(
    leaves: Sequence[int],
    reps: int,
    *,
    n_params: int = 1 << 20,
    select_max_leaves: int = 200,
    log: Callable[[str], None] = print,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Times lowering and compiling each case; one row per (leaves, case)."""
    cases = [c for c in update_cases() if "*" not in c.groups]
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for n_leaves in leaves:
        shapes = param_shapes(max(n_params, n_leaves), n_leaves)
        members = []
        for c in cases:
            if c.select_tree and n_leaves > select_max_leaves:
                notes.append(
                    f"{c.name}: not compiled at {n_leaves} leaves (over --select-max-leaves="
                    f"{select_max_leaves}); extrapolate from the smaller counts"
                )
            else:
                members.append(c)
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
