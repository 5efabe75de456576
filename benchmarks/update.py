"""Update cost: the jitted ``update`` + ``apply_updates`` step of each case, donated.

For every (size, leaves) configuration and every group, the group's cases and
a triad over the same arrays run interleaved. The triad (``a + 0.5 * b``,
``a`` donated: two reads and one write per parameter) measures the bandwidth
this run gets; a case that must move ``b`` bytes per parameter is bounded
below by ``b / (3 * itemsize)`` triads (in float32, ``w`` words: ``w / 3``).
Ratios are medians of per-round ratios (:func:`benchmarks._timing.ratio`).
Each row also carries XLA's own account of the step (bytes accessed,
temporary bytes, ``copy`` instructions) and the page faults of one call:
XLA:CPU maps large temporaries afresh on every call.
"""

from __future__ import annotations

import gc
import re
import resource
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax

from benchmarks import _timing
from benchmarks import _xla
from benchmarks.cases import Case
from benchmarks.cases import param_shapes
from benchmarks.cases import random_tree
from benchmarks.cases import update_cases

__all__ = ["run_update"]


class _Runner:
    """One case's carry, kept on the device between calls, and its executable."""

    def __init__(self, case: Case, shapes: Any, grads: Any, seed: int):
        pattern = case.make()
        self.carry = pattern.init(random_tree(shapes, seed))
        self.compiled = _xla.compile_step(pattern.step, self.carry, grads)
        self.grads = grads
        self()  # warm up: first call, allocations

    def __call__(self) -> None:
        self.carry = self.compiled.executable(self.carry, self.grads)
        jax.block_until_ready(self.carry)

    def page_faults(self) -> float:
        """Minor page faults of one call (first touches of freshly mapped memory)."""
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self()
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)


def _groups(cases: Sequence[Case]) -> list[str]:
    seen: list[str] = []
    for c in cases:
        for g in c.groups:
            if g != "*" and g not in seen:
                seen.append(g)
    return seen


#: One update configuration: params, leaves, and the groups to time (None: all).
Config = tuple[int, int, Sequence[str] | None]


def run_update(
    configs: Sequence[Config],
    reps: int,
    *,
    groups: Sequence[str] | None = None,
    match: str | None = None,
    select_max_leaves: int = 200,
    sample_s: float = 0.05,
    dtype: str = "float32",
    log: Callable[[str], None] = print,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Times every case; returns one row per (size, leaves, group, case) and notes.

    ``configs`` lists ``(params, leaves, groups)``; a config's own groups (when
    not None) narrow ``groups``. Params and grads are ``dtype``.
    """
    cases = update_cases()
    triad = cases[0]
    if match:
        cases = [triad] + [c for c in cases[1:] if re.search(match, c.name)]
    notes: list[str] = []
    rows: list[dict[str, Any]] = []
    for n_params, n_leaves, only in configs:
        shapes = param_shapes(n_params, n_leaves, dtype)
        grads = random_tree(shapes, seed=0)
        for group in groups or _groups(cases):
            if only is not None and group not in only:
                continue
            members = [triad]
            for c in cases:
                if group not in c.groups:
                    continue
                if c.select_tree and n_leaves > select_max_leaves:
                    note = (
                        f"{c.name}: not timed at {n_leaves} leaves (its compile time grows "
                        f"quadratically; see the compile-time table)"
                    )
                    if note not in notes:
                        notes.append(note)
                    continue
                members.append(c)
            if len(members) == 1:
                continue
            log(f"update {n_params:,} {dtype} params x {n_leaves} leaves, {group}: compiling")
            runners = {c.name: _Runner(c, shapes, grads, seed=i + 1) for i, c in enumerate(members)}
            calls = {k: _timing.calibrate(r, sample_s) for k, r in runners.items()}
            log(f"  timing {reps} interleaved rounds of {len(members)} cases")
            stats = _timing.interleave(runners, reps, calls)
            t_triad = stats[triad.name]
            triad_bytes = triad.bytes_per_param(dtype)
            for c in members:
                s, r = stats[c.name], runners[c.name]
                copies, copy_bytes = _xla.hlo_copies(r.compiled.executable, n_params // n_leaves)
                case_bytes = c.bytes_per_param(dtype)
                x_bound = _timing.ratio(s, t_triad) * triad_bytes / case_bytes
                base = stats.get(c.baseline) if c.baseline else None
                rows.append(
                    {
                        "params": n_params,
                        "leaves": n_leaves,
                        "dtype": dtype,
                        "group": group,
                        "case": c.name,
                        **s.as_dict(),
                        "samples_s": list(s.samples),
                        "reps": reps,
                        "calls_per_sample": calls[c.name],
                        "words": c.words,
                        "f32_words": c.f32_words,
                        "bytes_per_param": case_bytes,
                        "traffic": c.traffic,
                        "bound_s": case_bytes / triad_bytes * t_triad.median,
                        "x_bound": x_bound,
                        "baseline": c.baseline if base else None,
                        "x_baseline": _timing.ratio(s, base) if base else None,
                        "bandwidth_gbs": triad_bytes * n_params / t_triad.median / 1e9,
                        "xla_words": r.compiled.bytes_accessed() / (triad_bytes / 3 * n_params),
                        "temp_bytes": r.compiled.temp_bytes(),
                        "page_faults": r.page_faults(),
                        "copies": copies,
                        "copy_words": copy_bytes / (4 * n_params),
                        "compile_s": r.compiled.total_s,
                    }
                )
                log(
                    f"  {c.name:58s} {s.median * 1e3:9.2f} ms "
                    f"[{s.min * 1e3:.2f}-{s.max * 1e3:.2f}]  x bound {x_bound:5.2f}"
                )
            del runners
            gc.collect()
        del grads
        gc.collect()
    return rows, notes
