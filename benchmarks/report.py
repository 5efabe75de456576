"""Targets and the Markdown report (``benchmarks/RESULTS.md``)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["human", "render", "targets"]

ANALYSIS = Path(__file__).with_name("ANALYSIS.md")


def human(n: float) -> str:
    """1048576 -> '1M', 65536 -> '64K'."""
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n:,}"


def _find(rows: Iterable[dict[str, Any]], **where: Any) -> dict[str, Any] | None:
    for r in rows:
        if all(
            (r.get(k) or "").startswith(v[:-1]) if isinstance(v, str) and v.endswith("*") else r.get(k) == v
            for k, v in where.items()
        ):
            return r
    return None


def _target(name: str, value: float | None, limit: float, where: str, at_most: bool = True):
    if value is None or not math.isfinite(value):
        return None
    ok = value <= limit if at_most else value >= limit
    return {"target": name, "where": where, "value": value, "limit": limit,
            "at_most": at_most, "pass": ok}  # fmt: skip


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's performance targets, each checked where this run measured it.

    Update-cost targets are checked at every size >= 16M (at the largest size
    when the run had none that large, e.g. ``--quick``), for every leaf count.
    """
    out: list[dict[str, Any] | None] = []
    upd = results.get("update", [])
    sizes = sorted({r["params"] for r in upd})
    big = [s for s in sizes if s >= 16 << 20] or sizes[-1:]
    for n in big:
        for leaves in sorted({r["leaves"] for r in upd if r["params"] == n}):
            cfg = dict(params=n, leaves=leaves)
            where = f"{human(n)} params, {leaves} leaves"
            acc = _find(upd, case="gradtools.accumulate*", **cfg)
            if acc:
                out.append(_target("accumulate micro-step / its bandwidth bound", acc["x_bound"], 1.5, where))
                out.append(_target("accumulate micro-step / optax.MultiSteps micro-step", acc["x_baseline"], 0.1, where))
            dls = _find(upd, case="gradtools.dynamic_loss_scale*", **cfg)
            chain = _find(upd, case="optax.clip+adam", group="loss_scale", **cfg)
            aif = _find(upd, case="optax.apply_if_finite*", **cfg)
            if dls and chain:
                out.append(_target("dynamic_loss_scale(gradtools chain) / optax chain", dls["median_s"] / chain["median_s"], 1.1, where))
            if dls and aif:
                out.append(_target("dynamic_loss_scale(gradtools chain) / optax.apply_if_finite(optax chain)", dls["median_s"] / aif["median_s"], 0.9, where))
            clip = _find(upd, case="gradtools.clip+adam", **cfg)
            adam = _find(upd, case="optax.adam", **cfg)
            if clip and adam:
                out.append(_target("gradtools.clip+adam / adam alone", clip["median_s"] / adam["median_s"], 1.25, where))
    comp = results.get("compile", [])
    counts = sorted({r["leaves"] for r in comp})
    if counts:
        at = 200 if 200 in counts else counts[-1]
        where = f"{at} leaves"
        dls = _find(comp, case="gradtools.dynamic_loss_scale*", leaves=at)
        aif = _find(comp, case="optax.apply_if_finite*", leaves=at)
        if dls and aif:
            out.append(_target("compile: dynamic_loss_scale / apply_if_finite", dls["median_s"] / aif["median_s"], 1.2, where))
        for sel in (r for r in comp if r["select_tree"] and r["leaves"] == at):
            if dls:
                out.append(_target(f"compile: {sel['case'].split('(')[0]} / dynamic_loss_scale", sel["median_s"] / dls["median_s"], 10.0, where, at_most=False))
        lo, hi = counts[len(counts) // 2 - 1] if len(counts) > 2 else counts[0], counts[-1]
        dls_lo = _find(comp, case="gradtools.dynamic_loss_scale*", leaves=lo)
        dls_hi = _find(comp, case="gradtools.dynamic_loss_scale*", leaves=hi)
        if dls_lo and dls_hi and hi > lo:
            growth = (dls_hi["median_s"] / dls_lo["median_s"]) / (hi / lo)
            out.append(_target(f"compile: dynamic_loss_scale growth {lo}->{hi} leaves / linear", growth, 1.5, f"{lo} to {hi} leaves"))
    lenet = results.get("lenet", [])
    gt = _find(lenet, variant="gradtools fp32 (adam)")
    if gt and gt.get("x_baseline"):
        out.append(_target("LeNet fp32 images/s: gradtools / PyTorch eager", gt["x_baseline"], 1.0, f"batch {gt['batch']}", at_most=False))
    return [t for t in out if t]


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}" if s < 10 else f"{s * 1e3:.0f}"


def _table(header: list[str], rows: Iterable[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _update_section(rows: list[dict[str, Any]]) -> str:
    parts = [
        "## Update cost\n",
        "One jitted `update` + `apply_updates` step, params and state donated; milliseconds "
        "per step, median [min-max]. *words*: float32 words per parameter the step must read "
        "plus write (adam: read g, p, m, v, write p, m, v = 7); *bound*: words / 3 x the "
        "triad's time in the same group (the bandwidth bound); *XLA words*: XLA's cost-analysis "
        "estimate of bytes accessed, in the same unit; *copies*: `copy` instructions on "
        "parameter-sized arrays in the optimized HLO (all branches; MiB copied).\n",
    ]
    configs = sorted({(r["params"], r["leaves"]) for r in rows})
    for n, leaves in configs:
        sub = [r for r in rows if r["params"] == n and r["leaves"] == leaves]
        bw = [r["bandwidth_gbs"] for r in sub if r["case"] == "triad"]
        parts.append(
            f"### {human(n)} params in {leaves} leaves\n\nTriad bandwidth: "
            + ", ".join(f"{b:.1f}" for b in bw)
            + " GB/s (per group).\n"
        )
        table = []
        for r in sub:
            vs = f"{r['x_baseline']:.2f}x {r['baseline']}" if r.get("x_baseline") else ""
            table.append([
                r["group"], f"`{r['case']}`", _ms(r["median_s"]),
                f"{_ms(r['min_s'])}-{_ms(r['max_s'])}", r["words"], _ms(r["bound_s"]),
                f"{r['x_bound']:.2f}", vs, f"{r['xla_words']:.1f}",
                f"{r['copies']} ({r['copy_words'] * 4 * n / 2**20:.0f})",
            ])  # fmt: skip
        parts.append(_table(
            ["group", "case", "ms", "min-max", "words", "bound ms", "x bound", "vs counterpart",
             "XLA words", "copies (MiB)"], table))  # fmt: skip
        parts.append("")
    traffic = {r["case"]: (r["words"], r["traffic"]) for r in rows}
    parts.append("Traffic each case must move (float32 words per parameter):\n")
    parts.append(_table(["case", "words", "made of"], [[f"`{k}`", w, t] for k, (w, t) in traffic.items()]))
    return "\n".join(parts) + "\n"


def _compile_section(rows: list[dict[str, Any]]) -> str:
    counts = sorted({r["leaves"] for r in rows})
    cases = list(dict.fromkeys(r["case"] for r in rows))
    table = []
    for c in cases:
        cells = []
        for n in counts:
            r = _find(rows, case=c, leaves=n)
            cells.append(f"{r['median_s']:.2f}" if r else "-")
        per_leaf = [r for r in rows if r["case"] == c]
        last = max(per_leaf, key=lambda r: r["leaves"])
        table.append([f"`{c}`", *cells, f"{last['median_s'] / last['leaves'] * 1e3:.1f}"])
    return (
        "## Compile time\n\nSeconds to trace, lower and compile the donated step (1M params "
        "split into the given number of leaves), median over interleaved rounds; last "
        "column: milliseconds per leaf at the largest count measured.\n\n"
        + _table(["case", *[f"{n} leaves" for n in counts], "ms/leaf"], table)
        + "\n"
    )


def _memory_section(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    n, leaves = rows[0]["params"], rows[0]["leaves"]
    table = [
        [f"`{r['case']}`", f"{r['state_bytes'] / 2**20:.1f}", f"{r['state_per_param_bytes']:.2f}",
         f"{r['peak_bytes'] / 2**20:.1f}", f"{r['temp_bytes'] / 2**20:.1f}"]
        for r in rows
    ]  # fmt: skip
    return (
        f"## Memory\n\n{human(n)} float32 params in {leaves} leaves ({rows[0]['param_bytes'] / 2**20:.0f} "
        "MiB). *state*: the optimizer state (`jax.eval_shape` of `init`; for the jmp/flax patterns "
        "also their scale); *peak*: arguments + outputs - donated aliases + temporaries from "
        "`compiled.memory_analysis()` of the donated step (grads included as an argument).\n\n"
        + _table(["case", "state MiB", "state / params", "peak MiB", "temp MiB"], table)
        + "\n"
    )


def _lenet_section(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    table = [
        [r["variant"], f"{r['images_per_s']:.0f}", f"{_ms(r['median_s'])} [{_ms(r['min_s'])}-{_ms(r['max_s'])}]",
         f"{r['x_baseline']:.2f}" if r.get("x_baseline") else ""]
        for r in rows
    ]  # fmt: skip
    return (
        f"## LeNet-5 training\n\nOne training step (forward, backward, Adam) on a batch of "
        f"{rows[0]['batch']} 32x32 images, images per second; ms per step median [min-max]; "
        "last column: throughput over PyTorch eager fp32's. The accumulate row counts every "
        "micro-batch of the window (each call takes one batch).\n\n"
        + _table(["variant", "images/s", "ms/step", "x PyTorch fp32"], table)
        + "\n"
    )


def render(results: dict[str, Any]) -> str:
    """The whole report as Markdown."""
    meta = results["meta"]
    lines = [
        "# Benchmark results\n",
        f"Generated by `{meta['command']}` on {meta['date']} in {meta['wall_s'] / 60:.1f} min. "
        "Every section runs its cases side by side in one process, in interleaved rounds; "
        "times are medians with [min-max]; every ratio compares medians of one run. The "
        "machine is shared and noisy: only ratios within this run mean anything.\n",
        "## Machine and versions\n",
        _table(["", ""], [[k, v] for k, v in meta["machine"].items()]),
        "",
        _table(["package", "version"], [[k, v] for k, v in meta["versions"].items()]),
        "",
    ]
    t = targets(results)
    if t:
        lines += ["## Targets\n"]
        lines.append(_table(
            ["target", "where", "measured", "limit", ""],
            [[x["target"], x["where"], f"{x['value']:.3g}", ("<= " if x["at_most"] else ">= ") + f"{x['limit']:g}",
              "met" if x["pass"] else "**missed**"] for x in t]))  # fmt: skip
        lines.append("")
    for key, fn in (("update", _update_section), ("compile", _compile_section),
                    ("memory", _memory_section), ("lenet", _lenet_section)):  # fmt: skip
        if results.get(key):
            lines.append(fn(results[key]))
    if results.get("notes"):
        lines += ["## Notes\n", *[f"- {n}" for n in results["notes"]], ""]
    if results.get("analysis", True) and ANALYSIS.exists() and not meta.get("quick"):
        lines.append(ANALYSIS.read_text())
    return "\n".join(lines).rstrip() + "\n"


def machine() -> dict[str, str]:
    """CPU, cores, memory, load and accelerator, as far as the OS tells."""
    import platform

    import jax

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1])
        mem = f"{kib / 2**20:.0f} GiB"
    except (OSError, StopIteration):
        pass
    devices = jax.devices()
    return {
        "CPU": cpu,
        "cores": str(os.cpu_count()),
        "memory": mem,
        "OS": platform.platform(),
        "JAX devices": f"{len(devices)} x {devices[0].platform} ({devices[0].device_kind})",
        "GPU": "none in this run: the GPU table is future work"
        if devices[0].platform == "cpu"
        else devices[0].device_kind,
    }
