"""Smoke test of ``benchmarks/``: the code runs at a tiny size and reports what it should.

Structure only: no assertion here depends on a timing.
"""

import dataclasses
import functools
import json
import math
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradtools
from benchmarks import _steps
from benchmarks import _timing
from benchmarks import cli
from benchmarks import gpt
from benchmarks import microbatch
from benchmarks import report
from benchmarks.cases import MICRO_K
from benchmarks.cases import param_shapes
from benchmarks.cases import update_cases
from benchmarks.lenet import GRADTOOLS_STACK
from benchmarks.lenet import PLAIN_OPTAX

pytestmark = pytest.mark.slow  # CI runs these after the README's command

# Few cases, few leaves, one round: seconds, not minutes.
TINY = cli.Config(
    # The microbatch and gpt sections have their own smoke run (STEPS, below).
    sections=("update", "compile", "memory", "lenet"),
    sizes=(1024,),
    leaves=(2,),
    reps=1,
    sample_s=0.0,
    compile_leaves=(2, 3),
    compile_reps=1,
    compile_params=64,
    select_max_leaves=2,
    memory_params=1024,
    memory_leaves=2,
    lenet_batch=2,
    lenet_reps=1,
    quick=True,
    match=(
        r"^gradtools\.(accumulate|dynamic_loss_scale|apply_gradients)|^jmp"
        r"|^gradtools stack|^plain optax|fp32 \(adam\)|eager fp32"
    ),
)

UPDATE_KEYS = {
    "params", "leaves", "group", "case", "median_s", "min_s", "max_s", "samples_s", "reps",
    "words", "bound_s", "x_bound", "baseline", "x_baseline", "bandwidth_gbs", "xla_words",
    "temp_bytes", "page_faults", "copies", "copy_words", "compile_s",
}  # fmt: skip


@pytest.fixture(scope="module")
def results():
    return cli.run(TINY, log=lambda line: None, command="test")


def test_update_rows_cover_every_group_with_its_triad(results):
    rows = results["update"]
    groups = {r["group"] for r in rows}
    assert groups == {"loss_scale", "accumulate"}
    for g in groups:
        cases = [r["case"] for r in rows if r["group"] == g]
        assert cases[0] == "triad"
        assert len(cases) >= 2
    for r in rows:
        assert UPDATE_KEYS <= set(r)
        assert (r["params"], r["leaves"], r["reps"]) == (1024, 2, 1)
        assert len(r["samples_s"]) == 1
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        assert math.isfinite(r["x_bound"]) and r["x_bound"] > 0
    acc = next(r for r in rows if r["case"].startswith("gradtools.accumulate"))
    assert acc["baseline"] is None  # MultiSteps was filtered out by `match`
    assert acc["words"] == 6
    fused = {r["group"]: r for r in rows if r["case"].startswith("gradtools.apply_gradients")}
    assert set(fused) == {"loss_scale", "accumulate"}  # the apply_gradients path runs too
    assert fused["accumulate"]["words"] == 3  # a micro-step leaves the params alone


def test_select_tree_patterns_are_capped_by_leaves(results):
    pytest.importorskip("jmp")
    update = [r["case"] for r in results["update"]]
    assert any(c.startswith("jmp.") for c in update)  # 2 leaves <= select_max_leaves
    compiled = {(r["case"].split("(")[0], r["leaves"]) for r in results["compile"]}
    assert ("jmp.DynamicLossScale+select_tree", 2) in compiled
    assert ("jmp.DynamicLossScale+select_tree", 3) not in compiled
    assert any("not compiled at 3 leaves" in n for n in results["notes"])


def test_compile_rows_split_lowering_and_compiling(results):
    rows = results["compile"]
    assert {r["leaves"] for r in rows} == {2, 3}
    for r in rows:
        assert r["lower_s"] > 0 and r["compile_s"] > 0
        assert r["median_s"] == pytest.approx(r["lower_s"] + r["compile_s"])


def test_memory_rows_count_state_bytes(results):
    rows = {r["case"]: r for r in results["memory"]}
    acc = rows["gradtools.accumulate(adam) micro-step"]
    # adam's two moments plus one float32 buffer, a few scalars aside.
    assert acc["state_bytes"] // acc["param_bytes"] == 3
    dls = next(r for k, r in rows.items() if k.startswith("gradtools.dynamic_loss_scale"))
    assert dls["state_bytes"] // dls["param_bytes"] == 2
    for r in rows.values():
        assert r["peak_bytes"] >= r["temp_bytes"] >= 0


def test_lenet_rows_or_a_note(results):
    rows = {r["variant"]: r for r in results["lenet"]}
    space_to_depth = [v for v in rows if "space-to-depth" in v]
    assert {GRADTOOLS_STACK, PLAIN_OPTAX, "gradtools fp32 (adam)"} <= set(rows)
    assert len(space_to_depth) == 1  # the variant in benchmarks/lenet_s2d.py
    for r in rows.values():
        assert r["batch"] == 2 and r["images_per_s"] > 0
        assert len(r["samples_s"]) == 1 and r["x_plain_optax"] > 0
    assert rows[PLAIN_OPTAX]["x_plain_optax"] == 1.0
    torch_rows = [r for v, r in rows.items() if v.startswith("PyTorch")]
    if torch_rows:
        assert all(r["baseline"] == torch_rows[0]["variant"] for r in rows.values())
    else:
        assert any("PyTorch is not installed" in n for n in results["notes"])
    found = {t["target"]: t for t in report.targets(results)}
    assert "LeNet images/s: gradtools stack / plain optax" in found
    if report.on_cpu(results["meta"]):  # the PyTorch comparison is for GPU runs
        assert "LeNet fp32 images/s: gradtools / PyTorch eager" not in found


def _lenet_run(device: str, stack_s, plain_s, x_torch=None):
    """A LeNet section as a run on ``device`` records it, with the given seconds per round."""

    def row(variant, samples, **extra):
        return {"batch": 256, "variant": variant, "samples_s": samples, "median_s": 0.004,
                "min_s": 0.004, "max_s": 0.004, "images_per_s": 256.0, **extra}  # fmt: skip

    rows = [
        row(GRADTOOLS_STACK, stack_s),
        row(PLAIN_OPTAX, plain_s),
        row("gradtools fp32 (adam)", [1.0], x_baseline=x_torch),
    ]
    return {"lenet": rows, "meta": {"machine": {"JAX devices": f"1 x {device} ({device})"}}}


def test_lenet_target_is_the_median_per_round_throughput_ratio():
    # Per round, plain optax's time over the stack's: 1.1, 0.9, 0.99; median 0.99.
    run = _lenet_run("cpu", [2.0, 4.0, 1.0], [2.2, 3.6, 0.99])
    [target] = report.targets(run)
    assert target["target"] == "LeNet images/s: gradtools stack / plain optax"
    assert (target["where"], target["limit"], target["at_most"]) == ("batch 256", 0.97, False)
    assert target["value"] == pytest.approx(0.99) and target["pass"]
    # 0.9, 0.8, 1.2: median 0.9, short of 0.97.
    [target] = report.targets(_lenet_run("cpu", [1.0, 1.0, 1.0], [0.9, 0.8, 1.2]))
    assert target["value"] == pytest.approx(0.9) and not target["pass"]


def _micro_step_run(samples):
    """Accumulate micro-step rows of one 16M-param group, with the given seconds per round."""

    def row(case, samples_s):
        return {"params": 16 << 20, "leaves": 8, "group": "accumulate", "case": case,
                "samples_s": samples_s, "median_s": sorted(samples_s)[len(samples_s) // 2],
                "x_bound": 1.0, "words": 6}  # fmt: skip

    return {"update": [row(case, s) for case, s in samples.items()]}


def test_noise_scale_targets_are_the_median_per_round_ratio_to_the_micro_step():
    plain, fused = report.ACC, report.ACC_FUSED
    noisy = "gradtools.accumulate(adam, noise_scale) micro-step"
    noisy_fused = "gradtools.apply_gradients(accumulate(adam, noise_scale)) micro-step"
    # Per round: 1.1, 1.3, 1.05 (median 1.1, within 1.15); fused 1.2, 1.25, 1.0 (1.2, over).
    run = _micro_step_run({plain: [1.0, 1.0, 2.0], noisy: [1.1, 1.3, 2.1],
                           fused: [1.0, 2.0, 1.0], noisy_fused: [1.2, 2.5, 1.0]})  # fmt: skip
    found = {t["target"]: t for t in report.targets(run)}
    on = found["accumulate(noise_scale) micro-step / accumulate micro-step"]
    assert (on["where"], on["limit"], on["at_most"]) == ("16M params, 8 leaves", 1.15, True)
    assert on["value"] == pytest.approx(1.1) and on["pass"]
    on_fused = found[
        "apply_gradients(accumulate(noise_scale)) / apply_gradients(accumulate) micro-step"
    ]
    assert on_fused["value"] == pytest.approx(1.2) and not on_fused["pass"]
    # The micro-step's own targets see the micro-step rows only, not the noise-scale ones.
    assert [t["target"] for t in report.targets(run)].count(
        "accumulate micro-step / its bandwidth bound (6 words, apply_updates included)"
    ) == 1


def test_lenet_compares_with_pytorch_on_a_gpu_only():
    found = report.targets(_lenet_run("gpu", [1.0], [1.0], x_torch=4.5))
    assert [(t["target"], t["value"]) for t in found] == [
        ("LeNet images/s: gradtools stack / plain optax", 1.0),
        ("LeNet fp32 images/s: gradtools / PyTorch eager", 4.5),
    ]
    on_cpu = report.targets(_lenet_run("cpu", [1.0], [1.0], x_torch=1.4))
    assert [t["target"] for t in on_cpu] == ["LeNet images/s: gradtools stack / plain optax"]


def test_lenet_section_shows_the_pytorch_column_only_with_pytorch_rows():
    run = _lenet_run("cpu", [1.0], [1.0])
    for r in run["lenet"]:
        r["x_plain_optax"] = 1.25
    text = report.render({**run, "meta": {**run["meta"], **_META}})
    assert "| variant | images/s | ms/step | x plain optax |\n" in text
    assert f"| {GRADTOOLS_STACK} | 256 | 4.00 [4.00-4.00] | 1.25 |" in text
    run["lenet"][2]["x_baseline"] = 1.5
    text = report.render({**run, "meta": {**run["meta"], **_META}})
    assert "| variant | images/s | ms/step | x plain optax | x PyTorch fp32 |\n" in text
    assert "| gradtools fp32 (adam) | 256 | 4.00 [4.00-4.00] | 1.25 | 1.50 |" in text


_META = {"command": "test", "date": "today", "wall_s": 60.0, "versions": {}}


def test_diagnostics_targets_compare_with_the_chain_alone_round_by_round():
    def row(case, samples, group="diagnostics"):
        return {"params": 16 << 20, "leaves": 8, "group": group, "case": case,
                "samples_s": samples, "median_s": sorted(samples)[1], "x_bound": 1.0}  # fmt: skip

    rows = [
        row("gradtools.clip+adam", [1.0, 2.0, 1.0]),
        row("gradtools.clip+adam", [9.0, 9.0, 9.0], group="clip"),  # another group: not used
        # per round 1.05, 0.9, 1.2: median 1.05; and 1.1, 1.3, 1.15: median 1.15
        row("gradtools.spike_guard(gradtools.clip+adam)", [1.05, 1.8, 1.2]),
        row("gradtools.group_norms+clip+adam", [1.1, 2.6, 1.15]),
    ]
    found = {t["target"]: t for t in report.targets({"update": rows})}
    guard = found["spike_guard(gradtools.clip+adam) / gradtools.clip+adam"]
    norms = found["group_norms+gradtools.clip+adam / gradtools.clip+adam"]
    assert guard["where"] == norms["where"] == "16M params, 8 leaves"
    assert guard["value"] == pytest.approx(1.05) and guard["pass"] and guard["limit"] == 1.1
    assert norms["value"] == pytest.approx(1.15) and not norms["pass"]
    assert names_of_update_cases_in("diagnostics") == [
        "triad",
        "gradtools.clip+adam",
        "gradtools.spike_guard(gradtools.clip+adam)",
        "gradtools.group_norms+clip+adam",
    ]


def names_of_update_cases_in(group):
    return [c.name for c in update_cases() if group in c.groups or "*" in c.groups]


def test_report_renders_every_section_and_checks_targets(results):
    text = report.render(results)
    for heading in ("## Machine and versions", "## Targets", "## Update cost", "## Compile time",
                    "## Memory", "## Notes"):  # fmt: skip
        assert heading in text
    found = report.targets(results)
    names = {t["target"].split(" / ")[0] for t in found}
    assert "accumulate micro-step" in names
    for t in found:
        assert set(t) == {"target", "where", "value", "limit", "at_most", "pass"}
        assert t["pass"] == (t["value"] <= t["limit"] if t["at_most"] else t["value"] >= t["limit"])


def test_command_line_writes_the_report_and_json(tmp_path):
    out, data = tmp_path / "r.md", tmp_path / "r.json"
    argv = ["--quick", "--sections", "memory", "--memory-size", "1K", "--match",
            r"^gradtools.accumulate\(adam\)", "--out", str(out), "--json", str(data)]  # fmt: skip
    cli.main(argv)
    assert out.read_text().startswith("# Benchmark results")
    rows = json.loads(data.read_text())["memory"]
    assert [r["case"] for r in rows] == ["gradtools.accumulate(adam) micro-step"]


def test_a_partial_run_prints_its_report_but_leaves_results_md_alone(tmp_path, monkeypatch, capsys):
    results_md = tmp_path / "RESULTS.md"
    monkeypatch.setattr(cli, "RESULTS", results_md)
    cli.main(["--sections", "memory", "--memory-size", "1K", "--match", "^gradtools.accumulate"])
    assert not results_md.exists()
    assert "## Memory" in capsys.readouterr().out
    saved = tmp_path / "partial.json"
    cli.main(["--sections", "memory", "--memory-size", "1K", "--match", "^gradtools.accumulate",
              "--json", str(saved)])  # fmt: skip
    cli.main(["--from-json", str(saved)])  # re-rendering a partial run does not write it either
    assert not results_md.exists()


def test_only_a_run_of_every_section_and_case_is_whole():
    full = cli.Config(configs=((1 << 20, 8, None), (1 << 26, 1000, ("accumulate",))),
                      compile_leaves=(8, 1000), compile_budget_s=200.0)  # fmt: skip
    assert not cli.is_partial(dataclasses.asdict(full))
    for change in ({"sections": ("update", "memory")}, {"groups": ("clip",)},
                   {"match": "adam"}, {"compile_match": "."}):  # fmt: skip
        assert cli.is_partial(dataclasses.asdict(dataclasses.replace(full, **change))), change


def test_cases_and_shapes():
    shapes = param_shapes(10, 3)
    assert [s.shape for s in shapes.values()] == [(4,), (3,), (3,)]
    names = [c.name for c in update_cases()]
    assert names[0] == "triad" and len(names) == len(set(names))
    assert MICRO_K > 1 << 20
    with pytest.raises(ValueError, match="n_leaves"):
        param_shapes(2, 3)


@pytest.mark.parametrize("text,count", [("64M", 64 << 20), ("16K", 16 << 10), ("1000", 1000)])
def test_parse_count(text, count):
    assert cli.parse_count(text) == count


def test_parse_configs():
    got = cli.parse_configs("1M:8, 64M:1000:loss_scale+accumulate")
    assert got == ((1 << 20, 8, None), (64 << 20, 1000, ("loss_scale", "accumulate")))
    with pytest.raises(ValueError, match="SIZE:LEAVES"):
        cli.parse_configs("64M")


BAD_ARGS = [
    (["--sections", "foo"], "--sections 'foo': unknown ['foo']; choose from update,compile"),
    (["--groups", "clip,foo"], "--groups 'clip,foo': unknown ['foo']; choose from clip,"),
    (["--sizes", "3X"], "--sizes '3X': could not convert"),
    (["--leaves", "0"], "--leaves '0': every count must be >= 1"),
    (["--configs", "1M"], "expected SIZE:LEAVES[:GROUP+GROUP]"),
    (["--match", "("], "--match '(': missing )"),
    (["--reps", "0"], "--reps 0: must be >= 1"),
    (["--microbatch-ks", "2,0"], "--microbatch-ks '2,0': every count must be >= 1"),
    (["--gpt-dtypes", "float16"], "--gpt-dtypes 'float16': unknown ['float16']"),
    (["--gpt-seq", "0"], "--gpt-seq 0: must be >= 1"),
    (["--from-json", "no/such.json"], "--from-json no/such.json: no such file"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_options_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


class _Leaky:
    """A call that returns at once and leaves a thread burning CPU, as XLA:CPU's
    unmapping of a call's temporaries does after the result is ready."""

    def __init__(self, burn_s: float = 0.05):
        self.burn_s = burn_s
        self.busy = threading.Event()

    def __call__(self) -> None:
        self.busy.set()

        def burn():
            end = time.perf_counter() + self.burn_s
            while time.perf_counter() < end:
                pass
            self.busy.clear()

        threading.Thread(target=burn).start()


# A quiet spell longer than the default 10 ms, so that a loaded machine (pytest
# workers on every core) descheduling the burning thread cannot end the wait early.
QUIET_S = 0.1


# settle waits only on XLA:CPU, whose threads free a call's temporaries after it returns.
_cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="settle waits on CPU only")


@_cpu_only
def test_settle_waits_for_other_threads_work():
    leaky = _Leaky()
    leaky()
    assert leaky.busy.is_set()
    _timing.settle(QUIET_S)
    assert not leaky.busy.is_set()


@_cpu_only
def test_interleave_keeps_a_case_apart_from_the_leftovers_of_the_one_before(monkeypatch):
    monkeypatch.setattr(_timing, "settle", functools.partial(_timing.settle, QUIET_S))
    leaky = _Leaky()
    seen = []  # whether the leaky case's thread still ran when `other` was called

    def other():
        seen.append(leaky.busy.is_set())

    stats = _timing.interleave({"leaky": leaky, "other": other}, reps=4, calls={"other": 2})
    assert len(stats["other"].samples) == 4
    # every sample follows one untimed call of its own case: 4 rounds x (1 + 2) calls
    assert seen == [False] * 12
    _timing.settle(QUIET_S)


# --- half-precision params, and a GPU run's report beside the CPU run's -------------------


@pytest.fixture(scope="module")
def bf16_results():
    config = dataclasses.replace(TINY, sections=("update",), dtype="bfloat16")
    return cli.run(config, log=lambda line: None, command="test bf16")


def test_half_precision_bounds_count_bytes(bf16_results):
    rows = bf16_results["update"]
    assert {r["dtype"] for r in rows} == {"bfloat16"}
    by_case = {(r["group"], r["case"]): r for r in rows}
    triad = by_case["accumulate", "triad"]
    acc = by_case["accumulate", "gradtools.accumulate(adam) micro-step"]
    # The triad moves 3 bfloat16 words; accumulate 4 of them and its float32 buffer's 2.
    assert (triad["bytes_per_param"], acc["bytes_per_param"]) == (6, 4 * 2 + 2 * 4)
    assert triad["bandwidth_gbs"] == pytest.approx(6 * 1024 / triad["median_s"] / 1e9)
    per_round = sorted(a / t for a, t in zip(acc["samples_s"], triad["samples_s"]))
    assert acc["x_bound"] == pytest.approx(per_round[len(per_round) // 2] * 6 / 16)
    assert acc["bound_s"] == pytest.approx(16 / 6 * triad["median_s"])


def test_half_precision_targets_and_sections_name_the_dtype(bf16_results):
    found = report.targets(bf16_results)
    assert found and all(t["where"].endswith(", bfloat16") for t in found)
    acc = next(
        r for r in bf16_results["update"] if r["case"] == "gradtools.accumulate(adam) micro-step"
    )
    alone = next(t for t in found if "buffer alone" in t["target"])
    # against the buffer's own read-add-write: read g (2 bytes), read and write acc (4 + 4)
    assert alone["value"] == pytest.approx(acc["x_bound"] * 16 / 10)
    text = report.render(bf16_results)
    assert "### 1K bfloat16 params in 2 leaves" in text
    assert cli.is_partial(bf16_results["meta"]["config"])


def test_runs_merge_and_a_gpu_run_gets_its_own_section(results, bf16_results, tmp_path):
    merged = report.merge([results, bf16_results])
    assert len(merged["update"]) == len(results["update"]) + len(bf16_results["update"])
    assert merged["compile"] == results["compile"]
    assert merged["meta"]["command"] == "test; test bf16"
    assert merged["meta"]["wall_s"] == results["meta"]["wall_s"] + bf16_results["meta"]["wall_s"]
    gpu = {**merged, "meta": {**merged["meta"], "machine": {"GPU": "Some GPU"}}}
    text = report.render(results, gpu=gpu)
    head, tail = text.split("## GPU run: Some GPU\n")
    assert "#### Update cost" not in head and "## Update cost" in head
    assert "### Update cost" in tail and "\n## Update cost" not in tail
    assert "\n### Machine and versions" in tail
    assert "#### 1K bfloat16 params in 2 leaves" in tail
    # The same merge through the command line, saved as one file.
    files = []
    for i, run in enumerate((results, bf16_results)):
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(run))
    out = tmp_path / "merged.json"
    cli.main(["--from-json", *map(str, files), "--json", str(out), "--out", str(tmp_path / "m.md")])
    assert json.loads(out.read_text())["meta"]["command"] == "test; test bf16"


# --- whole training steps: micro-batching and the demo GPT ----------------------------------

#: Two variants of each section (the matching names), one k, the smallest sizes.
STEPS = dataclasses.replace(
    cli.QUICK,
    sections=("microbatch", "gpt"),
    microbatch_reps=1,
    gpt_reps=1,
    gpt_seq=4,
    match=r"^\(a\)|micro",
)


@pytest.fixture(scope="module")
def step_results():
    return cli.run(STEPS, log=lambda line: None, command="test steps")


def test_microbatch_rows_time_both_forms_and_read_temp_bytes(step_results):
    rows = {(r["k"], r["variant"]): r for r in step_results["microbatch"]}
    assert set(rows) == {(2, microbatch.GRADTOOLS), (2, microbatch.OPTAX)}
    for r in rows.values():
        assert r["batch"] == 32 and len(r["samples_s"]) == 1 and r["median_s"] > 0
        assert r["peak_bytes"] >= r["temp_bytes"] > 0
    theirs = rows[2, microbatch.OPTAX]
    assert theirs["x_optax"] == 1.0 and theirs["temp_x_optax"] == 1.0
    assert "## Micro-batching" in report.render(step_results)
    found = {t["target"]: t for t in report.targets(step_results)}
    temp = found["microbatch: train_step(micro_batches=k) temp bytes / optax.microbatching's"]
    mine = rows[2, microbatch.GRADTOOLS]
    assert temp["value"] == mine["temp_bytes"] / theirs["temp_bytes"] and temp["limit"] == 1.0


def test_gpt_rows_or_a_note(step_results):
    rows = {r["variant"]: r for r in step_results["gpt"]}
    if not rows:
        assert any("gradtools.demo.gpt is not in this build" in n for n in step_results["notes"])
        return
    assert set(rows) == {gpt.A_OPTAX, gpt.A_GRADTOOLS, gpt.C_MICROBATCH, gpt.C_TRAIN_STEP}
    for r in rows.values():
        assert (r["size"], r["batch"], r["seq"], r["k"]) == ("tiny", 4, 4, 4)
        assert len(r["samples_s"]) == 1 and r["temp_bytes"] >= 0
    found = {t["target"]: t for t in report.targets(step_results)}
    assert found["GPT step (a) train_step(gradtools chain) / optax step"]["limit"] == 1.02
    assert "## GPT training step" in report.render(step_results)


def _gpt_row(variant, samples, median):
    return {"variant": variant, "dtype": "float32", "size": "small", "batch": 4, "seq": 32,
            "samples_s": samples, "median_s": median}  # fmt: skip


def test_gpt_accumulation_target_is_against_the_faster_optax_form():
    rows = [
        _gpt_row(gpt.C_MULTISTEPS, [2.0, 2.0, 2.0], 2.0),
        _gpt_row(gpt.C_MICROBATCH, [1.0, 1.0, 2.0], 1.0),  # the faster by median
        # per round against microbatching: 0.9, 1.2, 0.5: median 0.9
        _gpt_row(gpt.C_TRAIN_STEP, [0.9, 1.2, 1.0], 1.0),
    ]
    [target] = report.targets({"gpt": rows})
    assert target["target"].startswith("GPT step (c) train_step(micro_batches)")
    assert target["value"] == pytest.approx(0.9) and target["pass"]
    assert target["where"].endswith("vs microbatching(k) + tx.update")


def test_microbatch_time_target_is_the_median_per_round_ratio_at_each_k():
    def row(k, variant, samples, temp):
        return {"k": k, "batch": 64, "variant": variant, "samples_s": samples,
                "median_s": sorted(samples)[1], "temp_bytes": temp}  # fmt: skip

    rows = [
        row(2, microbatch.GRADTOOLS, [1.0, 2.2, 1.1], 90),  # per round 1.0, 1.1, 1.1
        row(2, microbatch.OPTAX, [1.0, 2.0, 1.0], 100),
        row(4, microbatch.GRADTOOLS, [1.0, 1.0, 1.0], 120),
        row(4, microbatch.OPTAX, [1.0, 1.0, 1.0], 100),
    ]
    found = report.targets({"microbatch": rows})
    got = [(t["where"], t["target"].split(" ")[2], round(t["value"], 6), t["pass"]) for t in found]
    assert got == [
        ("k=2, batch 64", "time", 1.1, False),
        ("k=2, batch 64", "temp", 0.9, True),
        ("k=4, batch 64", "time", 1.0, True),
        ("k=4, batch 64", "temp", 1.2, False),
    ]


def test_the_compared_steps_take_the_same_step():
    """optax.microbatching's step and gradtools' micro-batched one move the params as one
    full-batch optax step does; so do k calls of accumulate over contiguous micro-batches."""
    params = microbatch.mlp_params(8, 2)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(16, microbatch.IN_DIM)), jnp.float32)
    y = jnp.asarray(rng.integers(0, microbatch.CLASSES, size=16), jnp.int32)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))

    def after(step, tx, batches):
        p, s = params, tx.init(params)
        for b in batches:
            p, s, _ = jax.jit(step)(p, s, *b)
        return p

    want = after(_steps.optax_step(microbatch.mlp_loss, tx), tx, [(x, y)])
    acc = gradtools.accumulate(tx, 4)
    got = {
        "optax.microbatching": after(
            _steps.optax_microbatch_step(microbatch.mlp_loss, tx, 4, 16), tx, [(x, y)]
        ),
        "accumulate": after(
            gradtools.train_step(microbatch.mlp_loss, acc), acc, _steps.split_batch((x, y), 4)
        ),
        "micro_batches": after(
            gradtools.train_step(microbatch.mlp_loss, tx, micro_batches=4), tx, [(x, y)]
        ),
    }
    before = jax.tree.leaves(params)
    for name, p in got.items():
        for a, b, p0 in zip(jax.tree.leaves(p), jax.tree.leaves(want), before):
            assert not np.allclose(b, p0), name  # the step moved the params
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
