"""The GPT demo (``python -m gradtools.demo.gpt``): model, data, training, resume, CLI, study.

Runs are short (a few steps of the ``tiny`` model, or of a smaller one the
study's smoke test swaps in) so that the file runs in well under a minute.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import math
import os
import re
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import gradtools
from gradtools.demo.checkpoint import Checkpoints
from gradtools.demo.gpt import data
from gradtools.demo.gpt import study
from gradtools.demo.gpt.__main__ import main
from gradtools.demo.gpt.config import Config
from gradtools.demo.gpt.model import GPT
from gradtools.demo.gpt.model import SIZES
from gradtools.demo.gpt.model import Fp8Meta
from gradtools.demo.gpt.model import GPTConfig
from gradtools.demo.gpt.model import count_params
from gradtools.demo.gpt.optim import decay
from gradtools.demo.gpt.train import train_and_evaluate

LAST_LINE = re.compile(r"validation bits/byte: (\d+\.\d{3}) \(unigram baseline: (\d+\.\d{3})\)")


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """``python -m gradtools.demo.gpt`` on tiny: 40 updates, a checkpoint and a plot."""
    folder = tmp_path_factory.mktemp("gpt")
    argv = ["--steps", "40", "--accum-steps", "1", "--batch-size", "32", "--no-progress"]
    argv += ["--checkpoint-dir", str(folder / "ckpt"), "--plot", str(folder / "run.png")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue(), folder


def test_tiny_trains_below_its_unigram_baseline_and_says_so_last(cli_run):
    code, out, folder = cli_run
    assert code == 0
    lines = out.strip().splitlines()
    m = LAST_LINE.fullmatch(lines[-1])
    assert m, lines[-1]
    bits, baseline = float(m.group(1)), float(m.group(2))
    text = data.load()
    assert baseline == round(data.unigram_bits_per_byte(text.train, text.valid), 3)
    assert bits < baseline
    assert "GPT tiny (2 layers, 4 heads, 64 wide, block 64), 120,576 parameters, fp32" in out
    assert f"checkpoint: {folder / 'ckpt' / '40'}" in out
    with open(folder / "run.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv", [["--precision", "fp8"], ["--param-dtype", "bf16"]], ids=["fp8", "bf16-params"]
)
def test_fp8_and_bfloat16_params_train_below_the_unigram_baseline(argv):
    config = Config(steps=80, accum_steps=1, batch_size=32, progress=False)
    config = dataclasses.replace(config, **{argv[0][2:].replace("-", "_"): argv[1]})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = train_and_evaluate(config)
    m = LAST_LINE.fullmatch(out.getvalue().strip().splitlines()[-1])
    assert m and float(m.group(1)) < float(m.group(2))
    params = jax.tree.leaves(nnx.state(result.model, nnx.Param))
    if config.precision == "fp8":  # the delayed-scaling meta was written, never optimized
        meta = nnx.to_pure_dict(nnx.state(result.model, Fp8Meta))
        qkv = meta["blocks"][0]["qkv"]
        assert np.all(np.isfinite(jax.tree.leaves(meta)[0]))
        assert float(qkv["input_scale"][0]) != 1.0 and float(np.max(qkv["input_amax_history"])) > 0
        assert {p.dtype for p in params} == {jnp.dtype(jnp.float32)}
    else:
        assert {p.dtype for p in params} == {jnp.dtype(jnp.bfloat16)}
        assert "(bf16 params, stochastic rounding)" in out.getvalue()


def _state(result):
    return jax.device_get(
        (nnx.to_pure_dict(nnx.state(result.model)), nnx.to_pure_dict(nnx.state(result.optimizer)))
    )


@pytest.mark.slow
def test_a_resumed_run_equals_an_uninterrupted_one_bit_for_bit(tmp_path):
    """Stopped after update 2 of 3 (windows of 2) with a float16 loss scale, then resumed."""
    config = Config(
        steps=3, batch_size=8, accum_steps=2, precision="fp16", eval_every=1, eval_windows=8,
        progress=False,
    )  # fmt: skip
    whole = train_and_evaluate(config)
    folder = str(tmp_path / "ckpt")
    stopped = train_and_evaluate(dataclasses.replace(config, checkpoint_dir=folder, max_steps=2))
    assert stopped.step == 2 and sorted(os.listdir(folder), key=int) == ["1", "2"]
    resumed = train_and_evaluate(Config(checkpoint_dir=folder, resume=True, progress=False))
    assert resumed.step == whole.step == 3
    jax.tree.map(np.testing.assert_array_equal, _state(resumed), _state(whole))
    assert resumed.history == whole.history
    assert resumed.val_bits_per_byte == whole.val_bits_per_byte


# One run of 4 updates of 2 micro-batches, through the CLI: stopped, resumed and asked for more.
SHORT = ["--steps", "4", "--batch-size", "8", "--accum-steps", "2", "--no-progress"]


def _ctrl_c() -> None:
    """What Ctrl-C does: SIGINT's current handler runs."""
    signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # type: ignore[operator]


def _cli(argv, ctrl_c_at=()):
    """``main(argv)``: its exit status, what it printed, and the checkpoint folders after it.

    Ctrl-C comes before each micro-batch that ``ctrl_c_at`` numbers (1 is the run's
    first), once per time it is listed.
    """
    calls, train_windows = [], data.train_windows

    def interrupted(*args, **kwargs):
        calls.append(None)
        for _ in range(ctrl_c_at.count(len(calls))):
            _ctrl_c()
        return train_windows(*args, **kwargs)

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(data, "train_windows", interrupted)
        with contextlib.redirect_stderr(out):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code
    folder = argv[argv.index("--checkpoint-dir") + 1]
    return code, out.getvalue(), sorted(os.listdir(folder), key=int)


@pytest.fixture(scope="module")
def stop_and_go(tmp_path_factory):
    """The runs, in order, on one checkpoint directory; and the run uninterrupted."""
    folder = tmp_path_factory.mktemp("gpt_resume") / "ckpt"
    argv = [*SHORT, "--checkpoint-dir", str(folder)]
    runs = {
        # Ctrl-C before the first micro-batch of update 2: update 2 is finished, then saved
        "ctrl_c": _cli(argv, ctrl_c_at=(3,)),
        # Ctrl-C twice inside update 3 (before its second micro-batch): stops, saves nothing
        "ctrl_c_twice": _cli([*argv, "--resume"], ctrl_c_at=(2, 2)),
        "resume": _cli([*argv, "--resume"]),
        "resume_finished": _cli([*argv, "--resume"]),
        "resume_longer": _cli([*argv, "--resume", "--steps", "8"]),
        "fresh": _cli(argv),
    }
    whole = train_and_evaluate(Config(steps=4, batch_size=8, accum_steps=2, progress=False))
    return folder, runs, whole


def test_ctrl_c_finishes_the_update_and_counts_updates(stop_and_go):
    folder, runs, _ = stop_and_go
    code, out, saved = runs["ctrl_c"]
    assert code == 130
    assert "update 1/4 " in out and "update 2/4 " in out and "update 3/4" not in out
    assert out.endswith(f"interrupted at update 2 of 4; checkpoint: {folder / '2'}; "
                        "continue with --resume\n")  # fmt: skip
    assert saved == ["1", "2"]  # each evaluation's, under its update
    code, out, saved = runs["ctrl_c_twice"]
    assert code == 130 and saved == ["1", "2"]
    assert out.endswith("interrupted inside update 3 of 4, not saved (half done); --resume "
                        f"continues from {folder / '2'}\n")  # fmt: skip


def test_resume_counts_updates_and_equals_the_uninterrupted_run(stop_and_go):
    folder, runs, whole = stop_and_go
    code, out, saved = runs["resume"]
    assert code == 0 and saved == ["3", "4"]
    assert f"resuming {folder / '2'} at update 2 of 4\n" in out
    assert "update 3/4 " in out and f"checkpoint: {folder / '4'}\n" in out
    ckpt = Checkpoints(folder)
    arrays = ckpt.restore(4, dict(zip(("model", "optimizer"), _state(whole))))
    history = ckpt.restore_meta(4)["history"]
    ckpt.close()
    jax.tree.map(np.testing.assert_array_equal, (arrays["model"], arrays["optimizer"]),
                 _state(whole))  # fmt: skip
    assert history == whole.history


def test_resume_with_other_steps_is_refused_in_one_line(stop_and_go):
    folder, runs, _ = stop_and_go
    code, out, saved = runs["resume_longer"]
    assert code == 2 and saved == ["3", "4"]
    assert out.splitlines()[-1] == (
        f"python -m gradtools.demo.gpt: error: --steps 8: --resume finishes the run in {folder} "
        "as it was set up, with --steps 4 (its learning-rate schedule ends there): leave out "
        "--steps, or start a new run with --steps 8 in another --checkpoint-dir"
    )
    assert "Traceback" not in out and "note:" not in out
    code, out, _ = runs["fresh"]
    assert code == 2 and f"--checkpoint-dir {folder} already holds a checkpoint (update 4)" in out


def test_resuming_a_finished_run_keeps_its_checkpoint_and_says_so(stop_and_go):
    folder, runs, _ = stop_and_go
    code, out, saved = runs["resume_finished"]
    assert code == 0 and saved == ["3", "4"]
    assert f"{folder / '4'}: the run finished at update 4 of 4, nothing to train\n" in out
    assert f"checkpoint: {folder / '4'} (unchanged: nothing new to save)\n" in out
    assert "not saved" not in out and "pass --checkpoint-dir" not in out


@pytest.mark.slow
def test_the_model_has_gpt2s_shapes_dtypes_and_a_tied_read_out():
    c = SIZES["tiny"]
    model = GPT(c, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    d, f = c.embed_dim, 4 * c.embed_dim
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    assert count_params(model) == c.vocab_size * d + c.block_size * d + c.num_layers * block + 2 * d
    params = nnx.state(model, nnx.Param)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    names = jax.tree.leaves(gradtools.path_names(params))
    assert not [n for n in names if "head" in n]  # no output matrix of its own
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)

    @nnx.jit
    def logits_and_tied(model, tokens):
        x = model.wte(tokens) + model.wpe(jnp.arange(16))
        for b in model.blocks:
            x = b(x)
        return model(tokens), model.ln_f(x).astype(jnp.float32) @ model.wte.embedding[...].T

    logits, tied = logits_and_tied(model, tokens)
    assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, tied, rtol=2e-2, atol=2e-2)
    std = float(jnp.std(model.blocks[0].qkv.kernel[...]))
    assert 0.018 < std < 0.022  # GPT-2's init
    assert [count_params(nnx.eval_shape(lambda s=s: GPT(s, rngs=nnx.Rngs(0)))) for s in (
        SIZES["small"], SIZES["gpt2"])] == [10_844_160, 86_039_040]  # fmt: skip


def test_weight_decay_is_off_for_biases_norms_and_embeddings_by_name():
    model = GPT(SIZES["tiny"], rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    mask = dict(zip(jax.tree.leaves(gradtools.path_names(params)), jax.tree.leaves(decay(params))))
    decayed = sorted(n for n, on in mask.items() if on)
    layers = ("qkv", "attn_proj", "fc", "mlp_proj")
    assert decayed == sorted(f"blocks/{i}/{layer}/kernel" for i in range(2) for layer in layers)


def test_the_unigram_baseline_is_the_validation_bytes_entropy():
    valid = np.frombuffer(b"abracadabra, said the cat", np.uint8)
    counts = collections.Counter(valid.tolist())
    entropy = -sum(c / len(valid) * math.log2(c / len(valid)) for c in counts.values())
    got = data.unigram_bits_per_byte(np.zeros(5, np.uint8), valid)
    assert got == pytest.approx(entropy, rel=1e-12)
    assert data.unigram_bits_per_byte(valid, valid) == got  # train does not enter


def test_the_split_and_the_batches_are_deterministic():
    from pydoc_data.topics import topics

    a, b = data.load(), data.load()
    joined = "\n\n".join(topics[k] for k in sorted(topics)).encode()
    assert a.train.tobytes() + a.valid.tobytes() == joined
    assert len(a.valid) == math.ceil(0.1 * len(joined))
    np.testing.assert_array_equal(a.valid, b.valid)
    w1 = data.train_windows(a.train, 64, 8, seed=3, step=5)
    np.testing.assert_array_equal(w1, data.train_windows(a.train, 64, 8, seed=3, step=5))
    assert not np.array_equal(w1, data.train_windows(a.train, 64, 8, seed=3, step=6))
    assert w1.shape == (8, 65) and w1.dtype == np.int32
    text = a.train.tobytes()
    assert all(bytes(row.astype(np.uint8)) in text for row in w1)  # contiguous windows


def test_data_dir_reads_the_txt_files_in_order(tmp_path):
    (tmp_path / "b.txt").write_text("second é")
    (tmp_path / "a.txt").write_text("first ")
    (tmp_path / "c.md").write_text("not read")
    text = data.load(tmp_path)
    assert text.train.tobytes() + text.valid.tobytes() == "first \n\nsecond é".encode()


BAD = [
    (["--size", "huge"], 2, "--size huge: not in ('tiny', 'small', 'gpt2')"),
    (
        ["--precision", "fp4"],
        2,
        "--precision fp4: not in ('fp32', 'bf16', 'fp16', 'fp16-noscale', 'fp8')",
    ),
    (["--param-dtype", "fp16"], 2, "--param-dtype fp16: not in ('fp32', 'bf16')"),
    (["--rounding", "up"], 2, "--rounding up: not in ('nearest', 'stochastic')"),
    (["--steps", "0"], 2, "--steps 0: must be an integer >= 1"),
    (["--data-dir", "EMPTY"], 1, "--data-dir EMPTY: no text in *.txt files (1 found)"),
]


def test_every_option_reaches_its_config_field_and_study_picks_the_study(monkeypatch):
    cli = sys.modules["gradtools.demo.gpt.__main__"]
    calls = []
    monkeypatch.setattr(cli, "train_and_evaluate", lambda c: calls.append(("train", c)))
    monkeypatch.setattr(study, "run_study", lambda c: calls.append(("study", c)))
    argv = [
        "--size", "small", "--precision", "bf16", "--param-dtype", "bf16", "--rounding",
        "nearest", "--steps", "7", "--seed", "9", "--batch-size", "4", "--accum-steps", "3",
        "--lr", "0.5", "--data-dir", "d", "--checkpoint-dir", "c", "--resume", "--plot",
        "p.png", "--no-progress", "--loss-multiplier", "0.25",
    ]  # fmt: skip
    assert main(argv) == 0 and main([*argv, "--study"]) == 0 and main([]) == 0
    want = Config(
        size="small", precision="bf16", param_dtype="bf16", rounding="nearest", steps=7, seed=9,
        batch_size=4, accum_steps=3, lr=0.5, data_dir="d", checkpoint_dir="c", resume=True,
        plot="p.png", progress=False, loss_multiplier=0.25,
    )  # fmt: skip
    assert calls == [("train", want), ("study", want), ("train", Config())]


@pytest.mark.parametrize(("argv", "code", "message"), BAD, ids=[a[1] for a, _, _ in BAD])
def test_bad_input_names_the_option_and_writes_nothing(tmp_path, capsys, argv, code, message):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("  \n")
    argv = [a.replace("EMPTY", str(empty)) for a in argv]
    message = message.replace("EMPTY", str(empty))
    out = tmp_path / "out"
    out.mkdir()
    full = [*argv, "--checkpoint-dir", str(out / "ckpt"), "--plot", str(out / "run.png")]
    if code == 2:
        with pytest.raises(SystemExit) as exit_info:
            main(full)
        assert exit_info.value.code == 2
    else:
        assert main(full) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert os.listdir(out) == []


def test_zero_fraction_counts_exact_zeros():
    tree = {"a": jnp.array([0.0, 1.0, -0.0]), "b": jnp.zeros(2, jnp.float16), "c": jnp.ones(3)}
    assert study.zero_fraction(tree) == 4 / 8


@pytest.mark.slow
def test_float16_gradients_flush_to_zero_where_float32_ones_do_not():
    model = GPT(SIZES["tiny"], rngs=nnx.Rngs(0))
    batch = jnp.asarray(data.eval_windows(data.load().valid, 64, 4))
    # loss * 2**-40: every float16 gradient underflows, float32 keeps them
    assert study.fp16_gradient_zeros(model, batch, 2.0**-40) == 1.0
    assert study.fp16_gradient_zeros(model, batch, 2.0**-40, jnp.float32) < 0.01
    assert study.fp16_gradient_zeros(model, batch, 2.0**10) < 0.01


def test_the_study_has_the_papers_five_runs_then_fp8_and_bf16_params():
    full = {"loss_scale": "none", "param_dtype": "fp32", "rounding": "stochastic"}
    runs = [({**full, **settings}) for _, settings in study.RUNS]
    assert [(r["precision"], r["loss_scale"]) for r in runs[:5]] == [
        ("fp32", "none"), ("bf16", "none"), ("fp16-noscale", "none"), ("fp16", "fixed"),
        ("fp16", "dynamic"),
    ]  # fmt: skip
    assert all(r["param_dtype"] == "fp32" for r in runs[:6]) and runs[5]["precision"] == "fp8"
    assert [(r["precision"], r["param_dtype"], r["rounding"]) for r in runs[6:]] == [
        ("bf16", "bf16", "nearest"), ("bf16", "bf16", "stochastic"),
    ]  # fmt: skip


@pytest.mark.slow
def test_the_study_trains_its_runs_and_tabulates_them(monkeypatch, capsys, tmp_path):
    """Two of the runs (each compiles its own step): float16 without a scale and with one."""
    monkeypatch.setitem(
        SIZES, "tiny", GPTConfig(block_size=16, num_layers=1, num_heads=2, embed_dim=32)
    )
    monkeypatch.setattr(study, "RUNS", (study.RUNS[2], study.RUNS[4]))
    config = Config(steps=2, batch_size=4, accum_steps=1, eval_windows=4, progress=False)
    rows = study.run_study(dataclasses.replace(config, plot=str(tmp_path / "study.png")))
    assert [r.name for r in rows] == ["fp16, no loss scale", "fp16, dynamic loss scale"]
    noscale, dynamic = rows
    assert (noscale.loss_scale, noscale.skipped_steps) == (1.0, 0)
    assert (dynamic.loss_scale, dynamic.skipped_steps) == (2.0**15, 0)
    assert noscale.zeros_scaled == noscale.zeros_unscaled  # its own scale is 1
    assert 0 <= dynamic.zeros_scaled <= dynamic.zeros_unscaled
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(rows)  # the header, its rule, a row per run
    assert "| fp16, no loss scale |" in out
    with open(tmp_path / "study.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
