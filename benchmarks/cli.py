"""``python -m benchmarks``: run the sections, print the tables, write RESULTS.md."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import report

__all__ = ["Config", "is_partial", "main", "parse_configs", "parse_count", "run"]

SECTIONS = ("update", "compile", "memory", "lenet", "microbatch", "gpt")
DTYPES = ("float32", "bfloat16", "float16")
RESULTS = Path(__file__).with_name("RESULTS.md")


#: The cases the compile section measures by default: the ones its targets name.
COMPILE_CASES = (
    r"^(optax\.adam|optax\.apply_if_finite|gradtools\.dynamic_loss_scale|"
    r"gradtools\.apply_gradients|jmp\.|flax |"
    r"optax\.MultiSteps|gradtools\.accumulate)"
)


@dataclass(frozen=True)
class Config:
    """What to run. The defaults are the full run that RESULTS.md records."""

    sections: tuple[str, ...] = SECTIONS
    sizes: tuple[int, ...] = (1 << 20, 16 << 20, 64 << 20)
    leaves: tuple[int, ...] = (8, 1000)
    #: configs timed besides sizes x leaves (the whole run adds FULL_EXTRA_CONFIGS).
    extra_configs: tuple[tuple[int, int, tuple[str, ...] | None], ...] = ()
    #: (params, leaves, groups or None) for the update section; None: sizes x leaves.
    configs: tuple[tuple[int, int, tuple[str, ...] | None], ...] | None = None
    groups: tuple[str, ...] | None = None
    match: str | None = None
    reps: int = 7
    sample_s: float = 0.05
    compile_leaves: tuple[int, ...] = (8, 100, 200, 1000)
    compile_reps: int = 3
    compile_match: str | None = COMPILE_CASES
    compile_params: int = 1 << 20
    select_max_leaves: int = 200
    compile_budget_s: float = 300.0
    memory_params: int = 16 << 20
    memory_leaves: int = 8
    lenet_batch: int = 256
    lenet_reps: int = 7
    #: the micro-batching section's MLP: batch, width, depth, micro-batch counts, rounds.
    microbatch_batch: int = 2048
    microbatch_width: int = 256
    microbatch_depth: int = 4
    microbatch_ks: tuple[int, ...] = (1, 2, 4, 8)
    microbatch_reps: int = 7
    #: the GPT section: model size (a key of the demo's SIZES), batch, sequence, k, dtypes.
    gpt_size: str = "small"
    gpt_batch: int = 8
    gpt_seq: int = 32
    gpt_k: int = 4
    gpt_dtypes: tuple[str, ...] = ("float32",)
    gpt_reps: int = 7
    #: dtype of the params and grads in the update, compile and memory sections.
    dtype: str = "float32"
    quick: bool = False


QUICK = Config(
    sizes=(1 << 16,),
    leaves=(4, 16),
    reps=2,
    sample_s=0.0,
    compile_leaves=(2, 8),
    compile_params=1 << 12,
    select_max_leaves=8,
    memory_params=1 << 16,
    memory_leaves=4,
    lenet_batch=8,
    lenet_reps=2,
    microbatch_batch=32,
    microbatch_width=16,
    microbatch_depth=2,
    microbatch_ks=(2,),
    microbatch_reps=2,
    gpt_size="tiny",
    gpt_batch=4,
    gpt_seq=8,
    gpt_reps=2,
    quick=True,
)

#: What the whole run times besides sizes x leaves: a real model's tree (a transformer's has
#: about 150 leaves).
FULL_EXTRA_CONFIGS = ((16 << 20, 150, None),)


def is_partial(config: dict[str, Any]) -> bool:
    """Whether a run (its ``Config`` as a dict, as saved in ``meta``) leaves out sections or cases.

    Such a run's report must not replace RESULTS.md, which records one whole run.
    """
    return (
        set(config["sections"]) != set(SECTIONS)
        or config["groups"] is not None
        or config["match"] is not None
        or config["compile_match"] != COMPILE_CASES
        or config.get("dtype", "float32") != "float32"
    )


def _write_report(text: str, out: str | None, config: dict[str, Any]) -> None:
    """To ``--out`` if given, else to RESULTS.md for a whole run, not at all for a partial one."""
    path = out or (None if config["quick"] or is_partial(config) else str(RESULTS))
    if path:
        Path(path).write_text(text)
        print(f"wrote {path}")
    elif not config["quick"]:
        print(f"a partial run: {RESULTS.name} not written (--out writes the report)")


def _render(results: dict[str, Any]) -> str:
    """The report; a whole CPU run's also shows the GPU run saved in ``report.GPU_RESULTS``."""
    meta = results["meta"]
    gpu = None
    if report.GPU_RESULTS.is_file() and report.on_cpu(meta):
        if not meta["quick"] and not is_partial(meta["config"]):
            gpu = json.loads(report.GPU_RESULTS.read_text())
    return report.render(results, gpu=gpu)


def parse_count(text: str) -> int:
    """'64M' -> 67108864, '16K' -> 16384, '1000' -> 1000."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("gradtools", "jax", "jaxlib", "optax", "flax", "jmp", "numpy", "torch"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            if pkg == "gradtools":
                import gradtools

                out[pkg] = gradtools.__version__
            else:
                out[pkg] = "not installed"
    return out


def run(config: Config, log: Callable[[str], None] = print, command: str = "") -> dict[str, Any]:
    """Runs the configured sections; returns every row, the notes and the metadata."""
    unknown = set(config.sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    results: dict[str, Any] = {"notes": []}
    if "update" in config.sections:
        from benchmarks.update import run_update

        configs = (
            config.configs
            or tuple((n, leaves, None) for n in config.sizes for leaves in config.leaves)
            + config.extra_configs
        )
        results["update"], notes = run_update(
            configs,
            config.reps,
            groups=config.groups,
            match=config.match,
            select_max_leaves=config.select_max_leaves,
            sample_s=config.sample_s,
            dtype=config.dtype,
            log=log,
        )
        results["notes"] += notes
    if "compile" in config.sections:
        from benchmarks.compile_time import run_compile

        results["compile"], notes = run_compile(
            config.compile_leaves,
            config.compile_reps,
            n_params=config.compile_params,
            match=_both(config.match, config.compile_match),
            select_max_leaves=config.select_max_leaves,
            budget_s=config.compile_budget_s,
            dtype=config.dtype,
            log=log,
        )
        results["notes"] += notes
    if "memory" in config.sections:
        from benchmarks.memory import run_memory

        results["memory"] = run_memory(
            config.memory_params,
            config.memory_leaves,
            match=config.match,
            dtype=config.dtype,
            log=log,
        )
    if "lenet" in config.sections:
        from benchmarks.lenet import run_lenet

        results["lenet"], notes = run_lenet(
            config.lenet_batch,
            config.lenet_reps,
            match=config.match,
            sample_s=0.0 if config.quick else 0.2,
            log=log,
        )
        results["notes"] += notes
    if "microbatch" in config.sections:
        from benchmarks.microbatch import run_microbatch

        results["microbatch"], notes = run_microbatch(
            config.microbatch_batch,
            config.microbatch_width,
            config.microbatch_depth,
            config.microbatch_ks,
            config.microbatch_reps,
            match=config.match,
            sample_s=0.0 if config.quick else 0.2,
            log=log,
        )
        results["notes"] += notes
    if "gpt" in config.sections:
        from benchmarks.gpt import run_gpt

        results["gpt"], notes = run_gpt(
            config.gpt_size,
            config.gpt_batch,
            config.gpt_seq,
            config.gpt_reps,
            k=config.gpt_k,
            dtypes=config.gpt_dtypes,
            match=config.match,
            log=log,
        )
        results["notes"] += notes
    load1 = os.getloadavg()
    machine = report.machine()
    machine["load average (1 min) at start / end"] = f"{load0[0]:.1f} / {load1[0]:.1f}"
    results["meta"] = {
        "command": command or "python -m benchmarks",
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "wall_s": time.perf_counter() - t0,
        "machine": machine,
        "versions": _versions(),
        "config": dataclasses.asdict(config),
        "quick": config.quick,
    }
    return results


def _both(a: str | None, b: str | None) -> str | None:
    """A regex matching what both match (either may be None: no condition)."""
    if a and b:
        return f"(?=.*(?:{a}))(?=.*(?:{b}))"
    return a or b


def parse_configs(text: str) -> tuple[tuple[int, int, tuple[str, ...] | None], ...]:
    """'64M:8,64M:1000:loss_scale+accumulate' -> ((67108864, 8, None), (..., 1000, (...)))."""
    out = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"--configs item {item!r}: expected SIZE:LEAVES[:GROUP+GROUP]")
        groups = tuple(parts[2].split("+")) if len(parts) == 3 else None
        out.append((parse_count(parts[0]), parse_count(parts[1]), groups))
    return tuple(out)


def _counts(text: str) -> tuple[int, ...]:
    return tuple(parse_count(t) for t in text.split(",") if t.strip())


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits through ``p.error`` (status 2, one line) for a bad option value."""
    from benchmarks.cases import update_cases
    from benchmarks.update import _groups

    def names(flag: str, text: str | None, known: Sequence[str]) -> None:
        unknown = [t.strip() for t in (text or "").split(",") if t.strip() not in known]
        if text is not None and unknown:
            p.error(f"{flag} {text!r}: unknown {unknown}; choose from {','.join(known)}")

    def check(flag: str, text: str | None, parse: Callable[[str], Any]) -> None:
        if text is not None:
            try:
                parse(text)
            except (ValueError, IndexError, re.error) as e:
                p.error(f"{flag} {text!r}: {e}")

    def positive_counts(text: str) -> None:
        if not all(c >= 1 for c in _counts(text)) or not _counts(text):
            raise ValueError("every count must be >= 1, e.g. 1M,16M or 8,1000")

    names("--sections", args.sections, SECTIONS)
    names("--groups", args.groups, _groups(update_cases()))
    for flag in ("--sizes", "--leaves", "--compile-leaves", "--memory-size"):
        check(flag, getattr(args, flag[2:].replace("-", "_")), positive_counts)
    check("--configs", args.configs, parse_configs)
    for flag in ("--match", "--compile-match"):
        check(flag, getattr(args, flag[2:].replace("-", "_")), re.compile)
    check("--microbatch-ks", args.microbatch_ks, positive_counts)
    names("--gpt-dtypes", args.gpt_dtypes, ("float32", "bfloat16"))
    for flag in ("--reps", "--compile-reps", "--lenet-batch", "--microbatch-batch",
                 "--gpt-batch", "--gpt-seq"):  # fmt: skip
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value < 1:
            p.error(f"{flag} {value}: must be >= 1")
    for path in args.from_json or ():
        if not Path(path).is_file():
            p.error(f"--from-json {path}: no such file")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The command line; returns the results (for tests)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of about a minute")
    p.add_argument("--sections", help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--sizes", help="param counts for the update section, e.g. 1M,16M,64M")
    p.add_argument("--leaves", help="leaf counts for the update section, e.g. 8,1000")
    p.add_argument(
        "--configs",
        help="update configs instead of sizes x leaves, e.g. 16M:8,64M:1000:loss_scale+accumulate",
    )
    p.add_argument(
        "--compile-match",
        help="regex of the cases the compile section measures ('.' for all; default: those "
        "its targets name)",
    )
    p.add_argument("--groups", help="update groups: clip,loss_scale,accumulate (default all)")
    p.add_argument("--match", help="only the cases whose name matches this regex (and the triad)")
    p.add_argument("--reps", type=int, help="interleaved rounds per group")
    p.add_argument("--compile-leaves", help="leaf counts for the compile section")
    p.add_argument("--compile-reps", type=int, help="rounds per leaf count (compile)")
    p.add_argument(
        "--select-max-leaves",
        type=int,
        help="the jmp/flax select-whole-tree patterns are left out above this many leaves",
    )
    p.add_argument(
        "--compile-budget",
        type=float,
        help="skip a case at a leaf count where its growth predicts more seconds than this",
    )
    p.add_argument("--memory-size", help="params for the memory section, e.g. 16M")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="dtype of the params and grads in the update, compile and memory sections "
        "(default float32; the LeNet section runs its own dtypes)",
    )
    p.add_argument("--lenet-batch", type=int, help="LeNet batch size")
    p.add_argument("--microbatch-batch", type=int, help="the micro-batching section's batch")
    p.add_argument("--microbatch-ks", help="its micro-batch counts, e.g. 1,2,4,8")
    p.add_argument("--gpt-size", choices=("tiny", "small", "gpt2"), help="the GPT model size")
    p.add_argument("--gpt-batch", type=int, help="the GPT section's batch (sequences)")
    p.add_argument("--gpt-seq", type=int, help="the GPT section's sequence length (bytes)")
    p.add_argument("--gpt-dtypes", help="the GPT section's compute dtypes: float32,bfloat16")
    p.add_argument(
        "--out",
        help=f"write the Markdown report here (default: {RESULTS}, but only for a run of every "
        "section and every case without --quick; a partial run only prints it)",
    )
    p.add_argument("--json", help="also write every row as JSON here")
    p.add_argument(
        "--from-json",
        nargs="+",
        help="run nothing: render the report of a run saved with --json (e.g. after editing "
        "benchmarks/ANALYSIS.md); several files, runs of one machine, are merged into one "
        "report (and into one file with --json)",
    )
    args = p.parse_args(argv)
    _check_args(p, args)

    if args.from_json:
        runs = [json.loads(Path(f).read_text()) for f in args.from_json]
        results = runs[0] if len(runs) == 1 else report.merge(runs)
        _write_report(_render(results), args.out, results["meta"]["config"])
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
        return results

    base = QUICK if args.quick else Config()
    changes: dict[str, Any] = {}
    if args.sections:
        changes["sections"] = tuple(s.strip() for s in args.sections.split(","))
    if args.sizes:
        changes["sizes"] = _counts(args.sizes)
    if args.leaves:
        changes["leaves"] = _counts(args.leaves)
    if not (args.quick or args.sizes or args.leaves):
        changes["extra_configs"] = FULL_EXTRA_CONFIGS
    if args.groups:
        changes["groups"] = tuple(g.strip() for g in args.groups.split(","))
    if args.configs:
        changes["configs"] = parse_configs(args.configs)
    if args.compile_match:
        changes["compile_match"] = args.compile_match
    if args.match:
        changes["match"] = args.match
    if args.reps:
        for key in ("reps", "lenet_reps", "microbatch_reps", "gpt_reps"):
            changes[key] = args.reps
    if args.compile_leaves:
        changes["compile_leaves"] = _counts(args.compile_leaves)
    if args.compile_reps:
        changes["compile_reps"] = args.compile_reps
    if args.select_max_leaves is not None:
        changes["select_max_leaves"] = args.select_max_leaves
    if args.compile_budget:
        changes["compile_budget_s"] = args.compile_budget
    if args.memory_size:
        changes["memory_params"] = parse_count(args.memory_size)
    if args.lenet_batch:
        changes["lenet_batch"] = args.lenet_batch
    if args.dtype:
        changes["dtype"] = args.dtype
    if args.microbatch_batch:
        changes["microbatch_batch"] = args.microbatch_batch
    if args.microbatch_ks:
        changes["microbatch_ks"] = _counts(args.microbatch_ks)
    for key in ("gpt_size", "gpt_batch", "gpt_seq"):
        if getattr(args, key):
            changes[key] = getattr(args, key)
    if args.gpt_dtypes:
        changes["gpt_dtypes"] = tuple(d.strip() for d in args.gpt_dtypes.split(","))
    config = dataclasses.replace(base, **changes)

    command = "python -m benchmarks" + ("".join(f" {a}" for a in argv) if argv else "")
    if argv is None:
        command = "python -m benchmarks" + "".join(f" {a}" for a in sys.argv[1:])
    results = run(config, command=command)
    text = _render(results)
    print(text)
    _write_report(text, args.out, results["meta"]["config"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return results
