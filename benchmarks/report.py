"""Targets and the Markdown report (``benchmarks/RESULTS.md``)."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["human", "merge", "on_cpu", "render", "targets"]

ANALYSIS = Path(__file__).with_name("ANALYSIS.md")
#: The rows of the latest GPU run (``--from-json`` of its files, ``--json`` here).
GPU_RESULTS = Path(__file__).with_name("results_gpu.json")


def human(n: float) -> str:
    """1048576 -> '1M', 65536 -> '64K'."""
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n:,}"


def _find(rows: Iterable[dict[str, Any]], **where: Any) -> dict[str, Any] | None:
    """The first row matching every ``key=value`` (a value ending in ``*`` is a prefix)."""
    for r in rows:
        ok = True
        for k, v in where.items():
            if isinstance(v, str) and v.endswith("*"):
                ok = ok and str(r.get(k) or "").startswith(v[:-1])
            else:
                ok = ok and r.get(k) == v
        if ok:
            return r
    return None


def _paired(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Median per-round ratio of two rows timed in the same group (else of medians)."""
    sa, sb = a.get("samples_s"), b.get("samples_s")
    if sa and sb and len(sa) == len(sb) and a.get("group") == b.get("group"):
        return statistics.median(x / y for x, y in zip(sa, sb))
    return a["median_s"] / b["median_s"]


#: The accumulate micro-step rows, through update and through apply_gradients.
ACC = "gradtools.accumulate(adam) micro-step"
ACC_FUSED = "gradtools.apply_gradients(accumulate(adam)) micro-step"

#: (target, case, baseline case or None for the bandwidth bound, limit, at most?)
UPDATE_TARGETS = (
    (
        "accumulate micro-step / its bandwidth bound (6 words, apply_updates included)",
        ACC,
        None,
        1.5,
    ),
    (
        "accumulate micro-step / read-add-write of the buffer alone (3 words)",
        ACC,
        "triad",
        1.5,
    ),
    (
        "accumulate micro-step / optax.MultiSteps micro-step",
        ACC,
        "optax.MultiSteps*",
        0.1,
    ),
    (
        "apply_gradients(accumulate) micro-step / its bandwidth bound (3 words)",
        ACC_FUSED,
        None,
        1.5,
    ),
    (
        "apply_gradients(accumulate) micro-step / optax.MultiSteps micro-step",
        ACC_FUSED,
        "optax.MultiSteps*",
        0.1,
    ),
    (
        "accumulate(noise_scale) micro-step / accumulate micro-step",
        "gradtools.accumulate(adam, noise_scale) micro-step",
        ACC,
        1.15,
    ),
    (
        "apply_gradients(accumulate(noise_scale)) / apply_gradients(accumulate) micro-step",
        "gradtools.apply_gradients(accumulate(adam, noise_scale)) micro-step",
        ACC_FUSED,
        1.15,
    ),
    (
        "dynamic_loss_scale(gradtools.clip+adam) / optax.clip+adam",
        "gradtools.dynamic_loss_scale*",
        "optax.clip+adam",
        1.1,
    ),
    (
        "dynamic_loss_scale(gradtools.clip+adam) / apply_if_finite(optax.clip+adam)",
        "gradtools.dynamic_loss_scale*",
        "optax.apply_if_finite*",
        0.9,
    ),
    (
        "apply_gradients(dynamic_loss_scale(gradtools.clip+adam)) / optax.clip+adam",
        "gradtools.apply_gradients(dynamic_loss_scale*",
        "optax.clip+adam",
        1.1,
    ),
    (
        "apply_gradients(dynamic_loss_scale(gradtools.clip+adam)) / "
        "apply_if_finite(optax.clip+adam)",
        "gradtools.apply_gradients(dynamic_loss_scale*",
        "optax.apply_if_finite*",
        0.9,
    ),
    ("gradtools.clip+adam / optax.adam", "gradtools.clip+adam", "optax.adam", 1.25),
    (
        "spike_guard(gradtools.clip+adam) / gradtools.clip+adam",
        "gradtools.spike_guard*",
        "gradtools.clip+adam",
        1.1,
    ),
    (
        "group_norms+gradtools.clip+adam / gradtools.clip+adam",
        "gradtools.group_norms*",
        "gradtools.clip+adam",
        1.1,
    ),
)


def _target(name: str, value: float | None, limit: float, where: str, at_most: bool = True):
    if value is None or not math.isfinite(value):
        return None
    ok = value <= limit if at_most else value >= limit
    return {
        "target": name,
        "where": where,
        "value": value,
        "limit": limit,
        "at_most": at_most,
        "pass": ok,
    }


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's performance targets, each checked where this run measured it.

    Update-cost targets are checked at every size >= 16M (at the largest size
    when the run had none that large, e.g. ``--quick``), for every leaf count;
    a ratio is the median of per-round ratios of the two cases in one group.
    """
    out: list[dict[str, Any] | None] = []
    for dtype in dict.fromkeys(_dtype(r) for r in results.get("update", [])):
        upd = [r for r in results["update"] if _dtype(r) == dtype]
        out += _update_targets(upd, "" if dtype == "float32" else f", {dtype}")
    comp = results.get("compile", [])
    counts = sorted({r["leaves"] for r in comp})
    dls = "gradtools.dynamic_loss_scale*"
    if counts:
        at = 200 if 200 in counts else counts[-1]
        where = f"{at} leaves"
        mine = _find(comp, case=dls, leaves=at)
        aif = _find(comp, case="optax.apply_if_finite*", leaves=at)
        if mine and aif:
            ratio = mine["median_s"] / aif["median_s"]
            out.append(_target("compile: dynamic_loss_scale / apply_if_finite", ratio, 1.2, where))
        for sel in (r for r in comp if r["select_tree"] and r["leaves"] == at and mine):
            name = f"compile: {sel['case'].split('(')[0]} / dynamic_loss_scale"
            ratio = sel["median_s"] / mine["median_s"]  # pyright: ignore
            out.append(_target(name, ratio, 10.0, where, at_most=False))
        lo, hi = (100 if 100 in counts else counts[0]), counts[-1]
        a, b = _find(comp, case=dls, leaves=lo), _find(comp, case=dls, leaves=hi)
        if a and b and hi > lo:
            growth = (b["median_s"] / a["median_s"]) / (hi / lo)
            name = f"compile: dynamic_loss_scale time({hi}) / time({lo}) / ({hi}/{lo})"
            out.append(_target(name, growth, 1.2, f"{lo} to {hi} leaves"))
    out += _lenet_targets(results)
    out += _microbatch_targets(results.get("microbatch", []))
    out += _gpt_targets(results.get("gpt", []))
    return [t for t in out if t]


#: The LeNet rows whose throughputs the LeNet target compares (benchmarks/lenet.py).
LENET_STACK = "gradtools stack fp32*"
LENET_PLAIN_OPTAX = "plain optax fp32*"


def _lenet_targets(results: dict[str, Any]) -> list[dict[str, Any] | None]:
    """What the gradtools stack costs against plain optax; on a GPU, also PyTorch's pace.

    The images/s ratio of two rows timed in the same rounds is the median of
    per-round ratios of their times, the other way round.
    """
    rows, out = results.get("lenet", []), []
    stack, plain = _find(rows, variant=LENET_STACK), _find(rows, variant=LENET_PLAIN_OPTAX)
    if stack and plain:
        name = "LeNet images/s: gradtools stack / plain optax"
        value = _paired(plain, stack)
        out.append(_target(name, value, 0.97, f"batch {stack['batch']}", at_most=False))
    gt = _find(rows, variant="gradtools fp32 (adam)")
    meta = results.get("meta")
    on_gpu = meta is not None and not on_cpu(meta)
    if on_gpu and gt and gt.get("x_baseline"):  # on a CPU it measures XLA:CPU's convolutions
        name = "LeNet fp32 images/s: gradtools / PyTorch eager"
        out.append(_target(name, gt["x_baseline"], 1.0, f"batch {gt['batch']}", at_most=False))
    return out


#: The micro-batching rows the targets compare (benchmarks/microbatch.py).
MB_GRADTOOLS = "gradtools.train_step(micro_batches=k)"
MB_OPTAX = "optax.microbatching + tx.update"


def _microbatch_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """At each k: gradtools' micro-batched step against optax.microbatching's (time, temp)."""
    out = []
    for k in sorted({r["k"] for r in rows}):
        mine = _find(rows, k=k, variant=MB_GRADTOOLS)
        theirs = _find(rows, k=k, variant=MB_OPTAX)
        if not (mine and theirs):
            continue
        where = f"k={k}, batch {mine['batch']}"
        name = "microbatch: train_step(micro_batches=k) time / optax.microbatching step"
        out.append(_target(name, _paired(mine, theirs), 1.05, where))
        if theirs["temp_bytes"]:
            name = "microbatch: train_step(micro_batches=k) temp bytes / optax.microbatching's"
            out.append(_target(name, mine["temp_bytes"] / theirs["temp_bytes"], 1.0, where))
    return out


def gpt_baseline(rows: list[dict[str, Any]], mine: dict[str, Any]) -> dict[str, Any] | None:
    """The optax row ``mine`` (a gradtools GPT row) is compared with: the faster of its pair's."""
    from benchmarks.gpt import PAIRS

    for _, variant, bases, _ in PAIRS:
        if variant == mine["variant"]:
            found = [_find(rows, dtype=mine["dtype"], variant=b) for b in bases]
            found = [r for r in found if r]
            return min(found, key=lambda r: r["median_s"]) if found else None
    return None


def _gpt_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """Each gradtools GPT step against the optax step of its pair (the faster, for (c))."""
    from benchmarks.gpt import PAIRS

    out = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        for name, variant, _, limit in PAIRS:
            mine = _find(rows, dtype=dtype, variant=variant)
            base = mine and gpt_baseline(rows, mine)
            if mine and base:
                where = f"{mine['size']}, {dtype}, batch {mine['batch']}x{mine['seq']}"
                if variant != base["variant"] and "(c)" in name:
                    where += f", vs {base['variant'].split(': ', 1)[1]}"
                out.append(_target(f"GPT step {name}", _paired(mine, base), limit, where))
    return out


ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_ORDER = tuple(ITEMSIZE)


def _dtype(row: dict[str, Any]) -> str:
    return row.get("dtype", "float32")  # runs from before --dtype were all float32


def _bytes(row: dict[str, Any]) -> float:
    return row.get("bytes_per_param", 4 * row["words"])


def _update_targets(upd: list[dict[str, Any]], suffix: str) -> list[dict[str, Any] | None]:
    """The update-cost targets over rows of one dtype; ``suffix`` ends each ``where``."""
    out = []
    sizes = sorted({r["params"] for r in upd})
    big = [n for n in sizes if n >= 16 << 20] or sizes[-1:]
    for n in big:
        for leaves in sorted({r["leaves"] for r in upd if r["params"] == n}):
            where = f"{human(n)} params, {leaves} leaves{suffix}"
            for name, case, base, limit in UPDATE_TARGETS:
                for row in [r for r in upd if r["params"] == n and r["leaves"] == leaves]:
                    if not _find([row], case=case):
                        continue
                    if base is None:
                        out.append(_target(name, row["x_bound"], limit, where))
                        continue
                    if base == "triad":  # the buffer's read g, read acc, write acc alone
                        f32 = row.get("f32_words", 0)
                        buffer = (3 - f32) * ITEMSIZE[_dtype(row)] + 4 * f32
                        value = row["x_bound"] * _bytes(row) / buffer
                        out.append(_target(name, value, limit, where))
                        continue
                    other = _find(upd, params=n, leaves=leaves, group=row["group"], case=base)
                    if other:
                        out.append(_target(name, _paired(row, other), limit, where))
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}" if s < 10 else f"{s * 1e3:.0f}"


def _table(header: list[str], rows: Iterable[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}" if n >= 2**20 or n == 0 else f"{n / 2**20:.2f}"


def _update_section(rows: list[dict[str, Any]]) -> str:
    parts = [
        "## Update cost\n",
        "One jitted step (`update` + `apply_updates`, or the call the case names: "
        "`apply_gradients`, jmp's or flax's select pattern), params and state donated, grads an "
        "argument; ms per step, median [min-max]. *words*: float32 words per parameter the "
        "step must read plus write (adam: read g, p, m, v, write p, m, v = 7); *bound*: "
        "words / 3 x the triad's time in the same group; *x bound*, *x counterpart*: medians "
        "of per-round ratios. XLA's own account of the compiled step: *XLA words* (its "
        "cost-analysis bytes accessed, same unit), *temp MiB* (temporary buffers, which "
        "XLA:CPU maps afresh on every call) and *faults* (minor page faults of one call); "
        "*copies*: `copy` instructions on parameter-sized arrays in the optimized HLO (all "
        "branches, MiB copied).\n",
    ]
    header = ["group", "case", "ms", "min-max", "words", "bound ms", "x bound"]
    header += ["x counterpart", "XLA words", "temp MiB", "faults", "copies (MiB)"]
    configs = dict.fromkeys((_dtype(r), r["params"], r["leaves"]) for r in rows)
    for dtype, n, leaves in sorted(configs, key=lambda c: (DTYPE_ORDER.index(c[0]), *c[1:])):
        sub = [r for r in rows if (_dtype(r), r["params"], r["leaves"]) == (dtype, n, leaves)]
        bw = ", ".join(f"{r['bandwidth_gbs']:.1f}" for r in sub if r["case"] == "triad")
        what = "params" if dtype == "float32" else f"{dtype} params"
        half = (
            ""
            if dtype == "float32"
            else f"Params, grads and Adam's moments are {dtype}, so a word is "
            f"{ITEMSIZE[dtype]} bytes, except the 2 float32 words of `accumulate`'s buffer; "
            "*bound* counts bytes. "
        )
        parts.append(
            f"### {human(n)} {what} in {leaves} leaves\n\n{half}"
            f"Triad bandwidth: {bw} GB/s (per group).\n"
        )
        table = []
        for r in sub:
            vs = f"{r['x_baseline']:.2f}x `{r['baseline']}`" if r.get("x_baseline") else ""
            copied = r["copy_words"] * 4 * n
            table.append(
                [
                    r["group"],
                    f"`{r['case']}`",
                    _ms(r["median_s"]),
                    f"{_ms(r['min_s'])}-{_ms(r['max_s'])}",
                    r["words"],
                    _ms(r["bound_s"]),
                    f"{r['x_bound']:.2f}",
                    vs,
                    f"{r['xla_words']:.1f}",
                    _mib(r["temp_bytes"]),
                    f"{r['page_faults']:.0f}",
                    f"{r['copies']} ({_mib(copied)})",
                ]
            )
        parts += [_table(header, table), ""]
    traffic = {r["case"]: (r["words"], r["traffic"]) for r in rows}
    parts.append("Traffic each case must move (float32 words per parameter):\n")
    parts.append(
        _table(["case", "words", "made of"], [[f"`{k}`", w, t] for k, (w, t) in traffic.items()])
    )
    return "\n".join(parts) + "\n"


def _compile_section(rows: list[dict[str, Any]]) -> str:
    counts = sorted({r["leaves"] for r in rows})
    table = []
    for c in dict.fromkeys(r["case"] for r in rows):
        cells = []
        for n in counts:
            r = _find(rows, case=c, leaves=n)
            cells.append(f"{r['median_s']:.2f}" if r else "-")
        last = max((r for r in rows if r["case"] == c), key=lambda r: r["leaves"])
        table.append([f"`{c}`", *cells, f"{last['median_s'] / last['leaves'] * 1e3:.1f}"])
    return (
        "## Compile time\n\nSeconds to trace, lower and compile the donated step (params "
        "split into the given number of leaves), median over interleaved rounds; last "
        "column: milliseconds per leaf at the largest count measured.\n\n"
        + _table(["case", *[f"{n} leaves" for n in counts], "ms/leaf"], table)
        + "\n"
    )


def _memory_section(rows: list[dict[str, Any]]) -> str:
    n, leaves, pbytes = rows[0]["params"], rows[0]["leaves"], rows[0]["param_bytes"]
    dtype = _dtype(rows[0])
    table = [
        [
            f"`{r['case']}`",
            f"{r['state_bytes'] / 2**20:.1f}",
            f"{r['state_per_param_bytes']:.2f}",
            f"{r['peak_bytes'] / 2**20:.1f}",
            f"{r['temp_bytes'] / 2**20:.1f}",
        ]
        for r in rows
    ]
    return (
        f"## Memory\n\n{human(n)} {dtype} params in {leaves} leaves ({_mib(pbytes)} MiB). "
        "*state*: the optimizer state (`jax.eval_shape` of `init`; for the jmp/flax patterns "
        "also their scale); *peak*: arguments + outputs - donated aliases + temporaries from "
        "`compiled.memory_analysis()` of the donated step (grads included as an argument).\n\n"
        + _table(["case", "state MiB", "state / params", "peak MiB", "temp MiB"], table)
        + "\n"
    )


def _lenet_section(rows: list[dict[str, Any]]) -> str:
    torch = any(r.get("x_baseline") for r in rows)

    def row(r: dict[str, Any]) -> list[str]:
        cells = [
            r["variant"],
            f"{r['images_per_s']:.0f}",
            f"{_ms(r['median_s'])} [{_ms(r['min_s'])}-{_ms(r['max_s'])}]",
            f"{r['x_plain_optax']:.2f}" if r.get("x_plain_optax") else "",
        ]
        return cells + ([f"{r['x_baseline']:.2f}" if r.get("x_baseline") else ""] if torch else [])

    header = ["variant", "images/s", "ms/step", "x plain optax"]
    header += ["x PyTorch fp32"] if torch else []
    return (
        f"## LeNet-5 training\n\nOne training step (forward, backward, optimizer) on a batch of "
        f"{rows[0]['batch']} 32x32 images: images per second; ms per step, median [min-max]; "
        "*x plain optax*: throughput over that of the same model and optimizer (clip + SGD "
        "with momentum) written with plain optax"
        + (", *x PyTorch fp32*: over PyTorch eager fp32's" if torch else "")
        + " (medians of per-round ratios). The accumulate row takes one batch per call, so a "
        "window is 4 calls.\n\n" + _table(header, [row(r) for r in rows]) + "\n"
    )


def _microbatch_section(rows: list[dict[str, Any]]) -> str:
    table = [
        [
            r["k"],
            r["variant"],
            f"{_ms(r['median_s'])} [{_ms(r['min_s'])}-{_ms(r['max_s'])}]",
            f"{r['x_optax']:.2f}" if r.get("x_optax") else "",
            f"{r['temp_bytes'] / 2**20:.2f}",
            f"{r['temp_x_optax']:.2f}" if r.get("temp_x_optax") else "",
            f"{r['peak_bytes'] / 2**20:.2f}",
        ]
        for r in rows
    ]
    header = ["k", "variant", "ms/step", "x optax", "temp MiB", "temp x optax", "peak MiB"]
    first = rows[0]
    return (
        f"## Micro-batching\n\nOne optimizer step on a batch of {first['batch']} examples "
        f"through an MLP of {first['params']:,} params whose activations dominate, the batch "
        "split into k micro-batches: `gradtools.train_step(loss_fn, tx, micro_batches=k)` "
        "(one call; tx = `dynamic_loss_scale(chain(gradtools.clip_by_global_norm(1.0), "
        "adam(1e-3)))`), `optax.microbatching.microbatch` of `jax.value_and_grad` (MEAN) then "
        "`tx.update` and `apply_updates` (one call; tx = `chain(optax.clip_by_global_norm(1.0), "
        "adam(1e-3))`), and `gradtools.accumulate(tx, k)` through `train_step` (k calls of one "
        "micro-batch; its temp and peak are one call's). ms per step, median [min-max]; "
        "*x optax*: median of per-round ratios to the optax.microbatching step at the same k; "
        "*temp*: `memory_analysis().temp_size_in_bytes` of the compiled, donated step; "
        "*peak*: arguments + outputs - donated aliases + temp.\n\n" + _table(header, table) + "\n"
    )


def _gpt_section(rows: list[dict[str, Any]]) -> str:
    table = []
    for r in rows:
        base = gpt_baseline(rows, r)
        table.append(
            [
                r["dtype"],
                r["variant"],
                f"{_ms(r['median_s'])} [{_ms(r['min_s'])}-{_ms(r['max_s'])}]",
                f"{_paired(r, base):.3f}" if base else "",
                f"{r['temp_bytes'] / 2**20:.0f}",
            ]
        )
    first = rows[0]
    return (
        f"## GPT training step\n\nThe demo's GPT (`{first['size']}`, {first['params']:,} "
        f"params), one whole training step (forward, backward, AdamW after clipping to norm 1, "
        f"apply) on {first['batch']} sequences of {first['seq']} bytes, params and state "
        "donated; (c) splits the batch into "
        f"k={first['k']} micro-batches (the *k calls* rows time all k calls). ms per step, "
        "median [min-max]; *x optax*: median of per-round ratios to the optax step of the same "
        "letter (for (c) the faster of the two optax forms); *temp MiB*: XLA's temporary "
        "buffers of one call.\n\n"
        + _table(["compute", "variant", "ms/step", "x optax", "temp MiB"], table)
        + "\n"
    )


def _targets_section(found: list[dict[str, Any]]) -> str:
    table = [
        [
            t["target"],
            t["where"],
            f"{t['value']:.3g}",
            ("<= " if t["at_most"] else ">= ") + f"{t['limit']:g}",
            "met" if t["pass"] else "**missed**",
        ]
        for t in found
    ]
    return "## Targets\n\n" + _table(["target", "where", "measured", "limit", ""], table) + "\n"


SECTIONS = (
    ("update", _update_section),
    ("compile", _compile_section),
    ("memory", _memory_section),
    ("lenet", _lenet_section),
    ("microbatch", _microbatch_section),
    ("gpt", _gpt_section),
)


def on_cpu(meta: dict[str, Any]) -> bool:
    """Whether a run (its ``meta``) ran on XLA:CPU."""
    return "x cpu" in meta["machine"].get("JAX devices", "x cpu")


def _body(results: dict[str, Any]) -> list[str]:
    """A run's report without its title: its sections under '##' headings."""
    meta = results["meta"]
    settled = (
        "each timed sample of update and LeNet times starts once the process's other threads "
        "are idle and after one untimed call of its case"
        if on_cpu(meta)
        else "each timed sample of update and LeNet times follows one untimed call of its case"
    )
    noise = (
        "The machine is shared and noisy: only ratios within one run mean anything."
        if on_cpu(meta)
        else "Only ratios within one run mean anything."
    )
    lines = [
        f"Generated by `{meta['command']}` on {meta['date']} in {meta['wall_s'] / 60:.1f} min. "
        f"Every section runs its cases side by side in one process, in interleaved rounds; "
        f"{settled}; times are medians with [min-max]; the ratios of update and LeNet times "
        f"are medians of per-round ratios within this run, those of compile times ratios of "
        f"medians. {noise}\n",
        "## Machine and versions\n",
        _table(["", ""], [[k, v] for k, v in meta["machine"].items()]),
        "",
        _table(["package", "version"], [[k, v] for k, v in meta["versions"].items()]),
        "",
    ]
    found = targets(results)
    if found:
        lines.append(_targets_section(found))
    for key, section in SECTIONS:
        if results.get(key):
            lines.append(section(results[key]))
    if results.get("notes"):
        lines += ["## Notes\n", *[f"- {n}" for n in results["notes"]], ""]
    return lines


def render(results: dict[str, Any], gpu: dict[str, Any] | None = None) -> str:
    """The whole report as Markdown; ``gpu``, a GPU run's results, makes a section of its own."""
    lines = ["# Benchmark results\n", *_body(results)]
    if gpu:
        device = gpu["meta"]["machine"].get("GPU", "GPU")
        body = "\n".join(_body(gpu)).split("\n")  # its headings one level down
        lines += [f"## GPU run: {device}\n", *("#" + ln if ln[:1] == "#" else ln for ln in body)]
    if ANALYSIS.exists() and not results["meta"].get("quick"):
        lines.append(ANALYSIS.read_text())
    return "\n".join(lines).rstrip() + "\n"


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One results dict from the runs of several commands on one machine (rows and notes
    concatenated; the commands joined, their times added)."""
    out: dict[str, Any] = {"notes": []}
    for run in runs:
        for key, _ in SECTIONS:
            out[key] = out.get(key, []) + run.get(key, [])
        out["notes"] += [n for n in run.get("notes", []) if n not in out["notes"]]
    first = runs[0]["meta"]
    out["meta"] = {
        **first,
        "command": "; ".join(r["meta"]["command"] for r in runs),
        "wall_s": sum(r["meta"]["wall_s"] for r in runs),
        "configs": [r["meta"]["config"] for r in runs],
    }
    return {k: v for k, v in out.items() if v or k in ("notes", "meta")}


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
        "GPU": "none in this run" if devices[0].platform == "cpu" else devices[0].device_kind,
    }
