"""Memory: optimizer-state bytes per case, and the compiled step's peak bytes.

Nothing is allocated: the state's size comes from ``jax.eval_shape`` of
``init`` and the peak from XLA's memory analysis of the donated step
(arguments + outputs - aliased donations + temporaries).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax

from benchmarks import _xla
from benchmarks.cases import param_shapes
from benchmarks.cases import update_cases

__all__ = ["run_memory"]


def run_memory(
    n_params: int,
    n_leaves: int,
    *,
    match: str | None = None,
    dtype: str = "float32",
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """One row per case: state bytes, state / params, peak and temporary bytes."""
    shapes = param_shapes(n_params, n_leaves, dtype)
    param_bytes = _xla.nbytes(shapes)
    rows = []
    for c in update_cases():
        if "*" in c.groups or (match and not re.search(match, c.name)):
            continue
        pattern = c.make()
        carry = jax.eval_shape(pattern.init, shapes)
        state_bytes = _xla.nbytes(carry[1:])
        compiled = _xla.compile_step(pattern.step, carry, shapes)
        rows.append(
            {
                "params": n_params,
                "leaves": n_leaves,
                "dtype": dtype,
                "case": c.name,
                "param_bytes": param_bytes,
                "state_bytes": state_bytes,
                "state_per_param_bytes": state_bytes / param_bytes,
                "peak_bytes": compiled.peak_bytes(),
                "temp_bytes": compiled.temp_bytes(),
            }
        )
        log(f"memory {c.name:58s} state {state_bytes / 2**20:9.1f} MiB")
    return rows
