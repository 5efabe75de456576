"""Training and evaluation of a byte-level GPT with a gradtools optimizer, in Flax NNX.

Laid out as flax's ``examples/``: :func:`train_step` takes one micro-batch,
:func:`eval_step` scores a batch of validation windows, and
:func:`train_and_evaluate` is the whole demo as a library call (the CLI in
``__main__`` only parses a :class:`~gradtools.demo.gpt.config.Config`). The
optimizer is :class:`gradtools.Optimizer`, ``flax.nnx.Optimizer`` with
gradtools' fused update: a micro-step of ``accumulate`` or a step the loss
scaler skips leaves the model as it was.

Training is data-parallel over a one-axis mesh of every device (of every
process under ``jax.distributed``): each batch is split over the devices,
the model and optimizer state are replicated, and XLA adds the all-reduce.
Only process 0 prints, plots and writes the checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

import gradtools
from gradtools.demo.checkpoint import Checkpoints
from gradtools.demo.checkpoint import save
from gradtools.demo.checkpoint import settings
from gradtools.demo.cli import log
from gradtools.demo.distributed import data_parallel
from gradtools.demo.distributed import describe_devices
from gradtools.demo.distributed import global_batch
from gradtools.demo.errors import DataError
from gradtools.demo.gpt import data
from gradtools.demo.gpt.config import RUN_OPTIONS
from gradtools.demo.gpt.config import Config
from gradtools.demo.gpt.config import validate
from gradtools.demo.gpt.model import DTYPES
from gradtools.demo.gpt.model import GPT
from gradtools.demo.gpt.model import PARAM_DTYPES
from gradtools.demo.gpt.model import SIZES
from gradtools.demo.gpt.model import Fp8Meta
from gradtools.demo.gpt.model import count_params
from gradtools.demo.gpt.optim import make_optimizer
from gradtools.demo.history import RunResult
from gradtools.demo.history import record
from gradtools.demo.interrupt import CtrlC
from gradtools.demo.interrupt import alive
from gradtools.demo.plot import Panel
from gradtools.demo.plot import plot_history

__all__ = [
    "PANELS",
    "Result",
    "eval_step",
    "evaluate",
    "loss_fn",
    "train_and_evaluate",
    "train_step",
]

_RECORDED = ("loss", "learning_rate", "loss_scale", "skipped_steps", "grad_norm", "spikes")
PANELS = (
    Panel(("loss",), "train loss (nats)", True),
    Panel(("val_bits_per_byte", "unigram"), "validation\nbits/byte"),
    Panel(("learning_rate",), "learning rate"),
    Panel(("loss_scale",), "loss scale", True),
    Panel(("grad_norm",), "gradient norm\n(before clipping)", True),
    Panel(("grad_norm/",), "gradient norm\nper group", True),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Result(RunResult):
    """What :func:`train_and_evaluate` returns.

    Its ``step`` counts optimizer updates (the unit of ``--steps``), and its
    ``history`` holds the metrics of each micro-batch and of the evaluations
    (``history['eval']``), both ``'step'`` lists counting micro-batches;
    ``checkpoint`` and ``plot`` are as in :class:`~gradtools.demo.history.RunResult`.

    Attributes:
      model: the trained :class:`~gradtools.demo.gpt.model.GPT`.
      optimizer: its :class:`gradtools.Optimizer` (``opt_state``, ``step``).
      val_bits_per_byte: the validation loss in bits per byte, at the end.
      unigram_bits_per_byte: the baseline: the validation bytes' unigram entropy.
      seconds_per_step: wall time per micro-batch, compilation left out.
    """

    model: GPT
    optimizer: Any
    val_bits_per_byte: float
    unigram_bits_per_byte: float
    seconds_per_step: float


def loss_fn(model: GPT, batch: jax.Array) -> jax.Array:
    """The mean cross-entropy, in nats, of each window's next bytes."""
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@nnx.jit(donate_argnums=(0, 1))
def train_step(model: GPT, optimizer: Any, batch: jax.Array, loss_multiplier: jax.Array) -> Any:
    """One micro-batch: scaled gradients, then ``optimizer.update`` (which may only accumulate).

    The loss differentiated is ``loss * loss_multiplier``, times the loss scale
    when the optimizer has a scaler (which divides the scale back out).
    Returns the unscaled loss and :func:`gradtools.metrics` of the new state.
    """
    has_scaler = bool(optax.tree.get_all_with_path(optimizer.opt_state, "LossScaleState"))

    def scaled_loss(model: GPT) -> tuple[jax.Array, jax.Array]:
        loss = loss_fn(model, batch)
        scaled = loss * loss_multiplier
        if has_scaler:
            scaled = gradtools.scale_loss(scaled, optimizer.opt_state)
        return scaled, loss

    # The fp8 meta's "gradients" are its new values, which optimizer.update writes.
    wrt = nnx.DiffState(0, (nnx.Param, Fp8Meta))
    grads, loss = nnx.grad(scaled_loss, argnums=wrt, has_aux=True)(model)
    optimizer.update(model, grads)
    return {"loss": loss, **gradtools.metrics(optimizer.opt_state)}


@nnx.jit
def eval_step(model: GPT, batch: jax.Array, weights: jax.Array) -> jax.Array:
    """The summed cross-entropy, in nats, of the windows of ``batch``, each times its weight."""
    logits = model(batch[:, :-1])
    nats = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])
    return jnp.sum(nats.sum(axis=1) * weights)


def evaluate(model: GPT, windows: np.ndarray, chunk: int, split: NamedSharding) -> float:
    """The validation loss of ``model`` on ``windows``, in bits per byte.

    Scores ``chunk`` windows at a time, split over ``split``'s devices (the
    last chunk padded with windows of weight 0).
    """
    n = len(windows)
    pad = -n % chunk
    padded = np.concatenate([windows, np.repeat(windows[:1], pad, axis=0)])
    weights = np.concatenate([np.ones(n, np.float32), np.zeros(pad, np.float32)])
    nats = 0.0
    for i in range(0, len(padded), chunk):
        rows = np.arange(i, i + chunk)
        x = global_batch(split, rows, lambda r: padded[r])
        w = global_batch(split, rows, lambda r: weights[r])
        nats += float(eval_step(model, x, w))
    return nats / (n * (windows.shape[1] - 1)) / math.log(2)


def create_model(config: Config, replicated: NamedSharding) -> tuple[GPT, Any]:
    """A freshly initialised model and optimizer, replicated over the devices."""
    model = GPT(
        SIZES[config.size],
        dtype=DTYPES[config.precision],
        param_dtype=PARAM_DTYPES[config.param_dtype],
        fp8=config.precision == "fp8",
        rngs=nnx.Rngs(config.seed),
    )
    unused = {k: getattr(Config(), k) for k in (*RUN_OPTIONS, "seed", "data_dir")}
    tx = _transformation(dataclasses.replace(config, **unused))
    optimizer = gradtools.Optimizer(model, tx, wrt=nnx.Param)
    state = nnx.state((model, optimizer))
    nnx.update((model, optimizer), jax.device_put(state, replicated))
    return model, optimizer


def train_and_evaluate(config: Config, text: data.Text | None = None) -> Result:
    """Trains the GPT as ``config`` says, evaluates it, and reports.

    Prints a progress bar (unless ``config.progress`` is false), a line per
    evaluation, and last ``validation bits/byte: X.XXX (unigram baseline:
    Y.YYY)``. Everything is counted in optimizer updates, as ``steps`` is.
    With ``config.checkpoint_dir`` it saves a checkpoint at each evaluation,
    at the end and when stopped (``max_steps``, Ctrl-C), under the number of
    updates trained. Ctrl-C lets the update in flight finish its
    micro-batches, saves it, and raises ``KeyboardInterrupt``; a second
    Ctrl-C stops at once, and saves nothing if that is inside an update.

    Args:
      config: the settings. With ``resume`` the training settings come from
        the newest checkpoint in ``checkpoint_dir``, and training goes on to
        its ``steps`` (another ``steps`` is refused).
      text: bytes to use instead of loading them as ``config.data_dir`` says.

    Returns:
      A :class:`Result`.

    Raises:
      ConfigError: for bad or conflicting settings, or a checkpoint directory
        that does not fit the request.
      DataError: for a data directory without text, or text too short.
    """
    ckpt = Checkpoints(config.checkpoint_dir) if config.checkpoint_dir else None
    config, meta = settings(config, ckpt, RUN_OPTIONS, fixed=("steps",), unit="update")
    devices = jax.devices()[: config.devices]
    validate(config, len(devices))
    text = text if text is not None else data.load(config.data_dir)
    block = SIZES[config.size].block_size
    if min(len(text.train), len(text.valid)) < block + 2:
        raise DataError(
            f"--data-dir {config.data_dir}: {len(text.train) + len(text.valid):,} bytes are too "
            f"few for --size {config.size} (block {block}): the validation tenth needs {block + 2}"
        )
    replicated, split = data_parallel(devices)
    model, optimizer = create_model(config, replicated)
    step, history = 0, {"step": [], "eval": {"step": [], "val_bits_per_byte": [], "unigram": []}}
    if meta is not None:
        step, history = _restore(ckpt, meta, model, optimizer)
    windows = data.eval_windows(text.valid, block, config.eval_windows)
    unigram = data.unigram_bits_per_byte(text.train, text.valid)
    log(_describe(config, model, text, devices))
    if meta is not None and ckpt is not None:
        log(_resuming(ckpt, step, config.steps))

    accum, total = config.accum_steps, config.steps
    stop = total if config.max_steps is None else min(total, max(config.max_steps, step))
    multiplier = jnp.float32(config.loss_multiplier)
    trained = step * accum  # micro-batches, which say where the data stands
    written, recorded, timed = None, [], (trained, time.perf_counter())

    def checkpoint() -> str | None:
        arrays = {"model": _pure(model), "optimizer": _pure(optimizer)}
        return save(ckpt, step, arrays, config, history=history)

    def report() -> None:
        """Records the updates trained, evaluates, prints a line and saves a checkpoint."""
        nonlocal recorded, written
        record(history, recorded, lambda k: k in _RECORDED or k.startswith("grad_norm/"))
        recorded = []
        bits = evaluate(model, windows, config.batch_size, split)
        for key, value in (("step", trained), ("val_bits_per_byte", bits), ("unigram", unigram)):
            history["eval"][key].append(value)
        last = {k: v[-1] for k, v in history.items() if k not in ("step", "eval") and v}
        log(f"update {step:>{len(str(total))}}/{total}  {_status(last)}  val {bits:.3f} bits/byte")
        written = checkpoint() or written

    from tqdm import tqdm

    bar = tqdm(
        total=total,
        initial=step,
        unit="update",
        leave=False,
        dynamic_ncols=True,
        disable=not config.progress or jax.process_index() != 0,
    )
    try:
        with CtrlC() as ctrl_c:
            while step < stop:
                ctrl_c.check()  # only between updates: a checkpoint holds whole updates
                for _ in range(accum):
                    windows_of = data.train_windows(
                        text.train, block, config.batch_size, config.seed, trained
                    )
                    batch = global_batch(
                        split, np.arange(config.batch_size), windows_of.__getitem__
                    )
                    metrics = train_step(model, optimizer, batch, multiplier)
                    trained += 1
                    recorded.append((trained, metrics))
                    if trained == 1 + timed[0]:  # the first micro-batch compiles: time from its end
                        jax.block_until_ready(metrics)
                        timed = (trained, time.perf_counter())
                step += 1
                bar.update()
                if not bar.disable and step % 10 == 0:
                    bar.set_postfix_str(_status(jax.device_get(metrics)), refresh=False)
                if step % config.evaluate_every == 0 or step == total:
                    report()
    except KeyboardInterrupt:
        bar.close()
        whole = trained == step * accum and alive(nnx.state((model, optimizer)))
        if whole:
            record(history, recorded, lambda k: k in _RECORDED or k.startswith("grad_norm/"))
            written = checkpoint()
        log(_interrupted(ckpt, step, total, whole, written))
        raise
    bar.close()
    jax.block_until_ready(nnx.state(model))
    per_step = (time.perf_counter() - timed[1]) / max(trained - timed[0], 1)
    if step < total:  # stopped early (max_steps): keep its state, score it unrecorded
        record(history, recorded, lambda k: k in _RECORDED or k.startswith("grad_norm/"))
        written = checkpoint()
        log(f"stopped at update {step:,} of {total:,}")
        bits = evaluate(model, windows, config.batch_size, split)
    else:
        bits = history["eval"]["val_bits_per_byte"][-1]
    plot = _plot(history, config)
    if ckpt is None:
        log("checkpoint: not saved (pass --checkpoint-dir DIR)")
    else:  # nothing written: a finished run resumed, which had nothing left to train
        log(f"checkpoint: {written or ckpt.path(step) + ' (unchanged: nothing new to save)'}")
    if plot:
        log(f"plot: {plot}")
    log(f"validation bits/byte: {bits:.3f} (unigram baseline: {unigram:.3f})")
    return Result(
        model=model,
        optimizer=optimizer,
        val_bits_per_byte=bits,
        unigram_bits_per_byte=unigram,
        seconds_per_step=per_step,
        step=step,
        history=history,
        checkpoint=written,
        plot=plot,
    )


@functools.lru_cache(maxsize=4)
def _transformation(config: Config) -> optax.GradientTransformation:
    """The optimizer of ``config``, built once: runs in one process with the same training
    settings then share the compiled :func:`train_step` (it is part of the step's key)."""
    return make_optimizer(config, config.steps)


def _pure(node: Any) -> Any:
    """The arrays of an NNX object's state as plain nested dicts (what orbax saves)."""
    return nnx.to_pure_dict(nnx.state(node))


def _restore(ckpt: Any, meta: dict[str, Any], model: GPT, optimizer: Any) -> tuple[int, dict]:
    """Loads the checkpoint's arrays into ``model`` and ``optimizer``; its step and history."""
    template = {"model": _pure(model), "optimizer": _pure(optimizer)}
    template = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), template
    )
    saved = ckpt.restore(meta["step"], template)
    for node, key in ((model, "model"), (optimizer, "optimizer")):
        state = nnx.state(node)
        nnx.replace_by_pure_dict(state, saved[key])
        nnx.update(node, state)
    history = meta["history"]
    return int(meta["step"]), history


def _resuming(ckpt: Checkpoints, step: int, total: int) -> str:
    """The line a resumed run starts with: where it goes on from."""
    if step < total:
        return f"resuming {ckpt.path(step)} at update {step:,} of {total:,}"
    return f"{ckpt.path(step)}: the run finished at update {step:,} of {total:,}, nothing to train"


def _interrupted(
    ckpt: Checkpoints | None, step: int, total: int, whole: bool, written: str | None
) -> str:
    """The line Ctrl-C stops a run with; ``whole``: it stopped between two updates."""
    if whole:
        line = f"interrupted at update {step:,} of {total:,}"
        return line + (f"; checkpoint: {written}; continue with --resume" if written else "")
    line = f"interrupted inside update {step + 1:,} of {total:,}"
    if ckpt is None:
        return line
    latest = ckpt.latest_step()
    if latest is None:
        return f"{line}, not saved (half done); no checkpoint yet"
    return f"{line}, not saved (half done); --resume continues from {ckpt.path(latest)}"


def _plot(history: dict[str, Any], config: Config) -> str | None:
    """Plots the run to ``config.plot`` (on process 0), against updates; returns the file."""
    if not config.plot or jax.process_index() != 0:
        return None
    k = config.accum_steps  # the history counts micro-batches
    evals = {**history["eval"], "step": [s / k for s in history["eval"]["step"]]}
    in_updates = {**history, "step": [s / k for s in history["step"]], "eval": evals}
    title = f"gradtools GPT demo: {config.size}, {config.precision}"
    return plot_history(in_updates, config.plot, PANELS, title=title, xlabel="update")


def _describe(config: Config, model: GPT, text: data.Text, devices: list[Any]) -> str:
    """Two lines on the model, data, devices and optimizer."""
    k, c, where = config.accum_steps, SIZES[config.size], describe_devices(devices)
    return (
        f"GPT {config.size} ({c.num_layers} layers, {c.num_heads} heads, {c.embed_dim} wide, "
        f"block {c.block_size}), {count_params(model):,} parameters, {config.precision}"
        f"{_params_in(config)}; "
        f"{text.source}: {len(text.train):,} train / {len(text.valid):,} validation bytes\n"
        f"{where}; {config.steps} updates of {config.batch_size} x {k} windows; adamw lr "
        f"{config.learning_rate:g} (cosine after {config.warmup} warmup), weight decay "
        f"{config.weight_decay:g}; clip norm {config.clip_norm:g}; loss scale {config.scaler}"
    )


def _params_in(config: Config) -> str:
    """`` (bf16 params, stochastic rounding)``, or nothing for float32 params."""
    if config.param_dtype == "fp32":
        return ""
    return f" ({config.param_dtype} params, {config.rounding} rounding)"


def _status(m: dict[str, Any]) -> str:
    parts = [f"loss {float(m['loss']):.4f}", f"lr {float(m['learning_rate']):.3g}"]
    if "loss_scale" in m:
        parts.append(f"scale {float(m['loss_scale']):g}")
        parts.append(f"skipped {int(m['skipped_steps'])}")
    parts.append(f"grad norm {float(m['grad_norm']):.3g}")
    return "  ".join(parts)
