"""Compiling a case once, ahead of time, and reading XLA's own account of it."""

from __future__ import annotations

import re
import time
import warnings
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

__all__ = ["Compiled", "compile_step", "hlo_copies", "nbytes", "peak_bytes"]

_COPY = re.compile(r"= (\w+)\[([\d,]*)\]\S* copy\(")


@dataclass
class Compiled:
    """A step compiled with its carry donated, and what it took."""

    executable: Any
    lower_s: float  # trace and lower to StableHLO
    compile_s: float  # XLA compile

    @property
    def total_s(self) -> float:
        return self.lower_s + self.compile_s

    def peak_bytes(self) -> int:
        """Arguments + outputs - donated aliases + temporaries (XLA's memory analysis)."""
        return peak_bytes(self.executable)

    def temp_bytes(self) -> int:
        return int(self.executable.memory_analysis().temp_size_in_bytes)

    def bytes_accessed(self) -> float:
        """XLA's cost-analysis estimate of the bytes one call reads and writes."""
        cost = self.executable.cost_analysis()
        if isinstance(cost, list | tuple):  # older jax: one dict per computation
            cost = cost[0] if cost else {}
        return float((cost or {}).get("bytes accessed", float("nan")))


def peak_bytes(executable: Any) -> int:
    """Arguments + outputs - donated aliases + temporaries of one call of ``executable``."""
    m = executable.memory_analysis()
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


def compile_step(step: Any, carry: Any, grads: Any) -> Compiled:
    """``jax.jit(step, donate_argnums=0)`` lowered and compiled for these (shapes of) args."""
    fn = jax.jit(step, donate_argnums=0)
    with warnings.catch_warnings():
        # Scalar counters may find no output to alias; that is expected.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        t0 = time.perf_counter()
        lowered = fn.lower(carry, grads)
        t1 = time.perf_counter()
        executable = lowered.compile()
        t2 = time.perf_counter()
    return Compiled(executable, t1 - t0, t2 - t1)


def hlo_copies(executable: Any, min_elements: int = 1) -> tuple[int, int]:
    """The ``copy`` instructions in the optimized HLO (all branches): count and bytes.

    Only arrays of at least ``min_elements`` elements count, so copies of
    scalar counters do not hide the ones that matter.
    """
    count = total = 0
    for dtype, dims in _COPY.findall(executable.as_text()):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        if n < min_elements:
            continue
        count += 1
        total += n * _itemsize(dtype)
    return count, total


def _itemsize(hlo_dtype: str) -> int:
    if hlo_dtype == "pred":
        return 1
    bits = re.findall(r"\d+", hlo_dtype)
    return int(bits[0]) // 8 if bits else 4


def nbytes(tree: Any) -> int:
    """Bytes of every array (or ShapeDtypeStruct) leaf of ``tree``."""
    return int(
        sum(
            np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(tree)
        )
    )
