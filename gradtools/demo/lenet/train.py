"""Training and evaluation of LeNet-5 with a gradtools optimizer.

Laid out as flax's ``examples/mnist``: :func:`train_epoch` makes one pass over
the training digits, :func:`evaluate` measures the test accuracy, and
:func:`train_and_evaluate` is the whole demo as a library call (the CLI in
``__main__`` only parses a :class:`~gradtools.demo.lenet.config.Config`). The
optimizer comes from :func:`gradtools.demo.lenet.optim.make_optimizer`; the step is
:func:`gradtools.train_step` under ``jax.jit``.

Training is data-parallel over a one-axis ``jax.sharding.Mesh`` of every
device (of every process, when ``jax.distributed`` is initialised): each batch
is split over the devices and the parameters and optimizer state are
replicated, so the jitted step is the one-device step and XLA adds the
all-reduce. Each process reads only its own rows of every batch; only process
0 prints and plots, and the checkpoint is written from it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any
from typing import NamedTuple
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

import gradtools
from gradtools.demo.checkpoint import Checkpoints
from gradtools.demo.checkpoint import save
from gradtools.demo.checkpoint import settings
from gradtools.demo.cli import log
from gradtools.demo.distributed import data_parallel
from gradtools.demo.distributed import describe_devices
from gradtools.demo.distributed import global_batch
from gradtools.demo.errors import ConfigError
from gradtools.demo.history import RunResult
from gradtools.demo.history import record
from gradtools.demo.interrupt import CtrlC
from gradtools.demo.interrupt import alive
from gradtools.demo.lenet import data
from gradtools.demo.lenet.config import RUN_OPTIONS
from gradtools.demo.lenet.config import Config
from gradtools.demo.lenet.config import validate
from gradtools.demo.lenet.model import DTYPES
from gradtools.demo.lenet.model import LeNet5
from gradtools.demo.lenet.model import count_params
from gradtools.demo.lenet.optim import make_optimizer
from gradtools.demo.plot import Panel
from gradtools.demo.plot import plot_history

__all__ = ["PANELS", "Result", "TrainState", "evaluate", "train_and_evaluate", "train_epoch"]

# The metrics of each step kept in the history (and so in checkpoints and the plot).
_RECORDED = ("loss", "learning_rate", "loss_scale", "grad_norm", "skipped_steps")
#: What ``--plot`` draws, top to bottom.
PANELS = (
    Panel(("loss", "train_loss"), "train loss", True),
    Panel(("test_accuracy",), "test accuracy (%)"),
    Panel(("learning_rate",), "learning rate"),
    Panel(("loss_scale",), "loss scale", True),
    Panel(("grad_norm",), "gradient norm\n(before clipping,\nof the last update)"),
)


class TrainState(NamedTuple):
    """What a training step advances.

    Attributes:
      step: micro-batches trained so far.
      params: the parameters (replicated over the devices).
      opt_state: the optimizer state (replicated).
    """

    step: int
    params: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class Result(RunResult):
    """What :func:`train_and_evaluate` returns.

    Its ``step`` counts micro-batches, and its ``history`` holds the metrics
    of each step and of each epoch (``history['epoch']``); ``checkpoint`` and
    ``plot`` are as in :class:`~gradtools.demo.history.RunResult`.

    Attributes:
      params: the trained parameters.
      opt_state: the optimizer state.
      test_accuracy: accuracy on the test digits, in percent.
    """

    params: Any
    opt_state: Any
    test_accuracy: float


class _Programs(NamedTuple):
    """The jitted functions of a run, and the shardings they use."""

    replicated: NamedSharding  # params and optimizer state: a copy on every device
    split: NamedSharding  # batches: split along their first axis
    init: Any  # key -> {'params', 'opt_state'}
    train_step: Any  # gradtools.train_step, params and state donated
    count_correct: Any  # (params, images, labels) -> correct predictions


@functools.lru_cache(maxsize=4)
def _programs(config: Config, total_updates: int) -> _Programs:
    """The model, optimizer and jitted step of ``config`` (cached: runs in one process
    share compilations)."""
    replicated, split = data_parallel(jax.devices()[: config.devices])
    model = LeNet5(dtype=DTYPES[config.precision])
    tx = make_optimizer(config, total_updates)

    def init(key):
        params = model.init(key, jnp.zeros((1, 32, 32, 1), jnp.float32))
        return {"params": params, "opt_state": tx.init(params)}

    def loss_fn(params, images, labels):
        logits = cast(jax.Array, model.apply(params, images))
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def count_correct(params, images, labels):
        logits = cast(jax.Array, model.apply(params, images))
        return jnp.sum(jnp.argmax(logits, -1) == labels)

    return _Programs(
        replicated=replicated,
        split=split,
        init=jax.jit(init, out_shardings=replicated),
        # Scales the loss, takes the gradients, runs the optimizer, applies the updates.
        train_step=jax.jit(
            gradtools.train_step(loss_fn, tx), donate_argnums=(0, 1), out_shardings=replicated
        ),
        count_correct=jax.jit(count_correct),
    )


def train_epoch(
    programs: _Programs,
    state: TrainState,
    ds: data.Dataset,
    config: Config,
    epoch: int,
    stop: int,
    stop_requested: Callable[[], bool] = lambda: False,
) -> tuple[TrainState, list[tuple[int, dict[str, jax.Array]]]]:
    """Trains on the batches of ``epoch`` (0-based) from ``state.step`` up to step ``stop``.

    The last batch of an epoch flushes a partial accumulation window. The
    epoch stops early, between two steps, when ``stop_requested()`` is true
    or on a ``KeyboardInterrupt``: the returned state's step then falls short
    of ``stop`` (and its arrays are deleted if the interrupt came during a
    step, which was handed them).

    Args:
      programs: the run's jitted step and shardings.
      state: where training stands; its arrays are donated to the first step.
      ds: the digits; each process reads its own rows of every batch.
      config: the run's settings (batch size, accumulation, seed, progress bar).
      epoch: which epoch's shuffled batches to train on.
      stop: the (global) step to stop at.
      stop_requested: asked before each step whether to stop early.

    Returns:
      The new state, and ``(step, metrics)`` of each step trained.
    """
    from tqdm import tqdm

    per_epoch = len(ds.train_labels) // config.batch_size
    batches = data.epoch_batches(len(ds.train_labels), config.batch_size, config.seed, epoch)
    bar = tqdm(
        total=per_epoch,
        initial=state.step - epoch * per_epoch,
        unit="batch",
        desc=f"epoch {epoch + 1}/{config.epochs}",
        leave=False,
        dynamic_ncols=True,
        disable=not config.progress or jax.process_index() != 0,
    )

    def read_images(indices):
        return data.preprocess(ds.train_images[indices])

    def read_labels(indices):
        return ds.train_labels[indices]

    recorded = []
    try:
        while state.step < stop and not stop_requested():
            i = state.step - epoch * per_epoch
            images = global_batch(programs.split, batches[i], read_images)
            labels = global_batch(programs.split, batches[i], read_labels)
            update_kwargs = None
            if config.accum_steps > 1:  # the epoch's last batch flushes a partial window
                update_kwargs = {"flush": np.asarray(i == per_epoch - 1)}
            params, opt_state, metrics = programs.train_step(
                state.params, state.opt_state, images, labels, update_kwargs=update_kwargs
            )
            if config.verbose:
                _report_skip(recorded, metrics, state.step + 1, opt_state, params)
            state = TrainState(state.step + 1, params, opt_state)
            recorded.append((state.step, metrics))
            bar.update()
            if not bar.disable and (i % 10 == 0 or state.step == stop):
                bar.set_postfix_str(_status(jax.device_get(metrics)), refresh=False)
    except KeyboardInterrupt:
        pass  # the caller sees state.step < stop
    finally:
        bar.close()
    return state, recorded


def evaluate(programs: _Programs, params: Any, images: np.ndarray, labels: np.ndarray) -> float:
    """The percentage of ``images`` that ``params`` label right.

    Args:
      programs: the run's jitted functions and shardings.
      params: the model's parameters.
      images: ``uint8`` digits ``(n, 28, 28)``, evaluated in chunks of about
        1,000 split over the devices.
      labels: their digits, ``(n,)``.

    Returns:
      The accuracy in percent.
    """
    n_devices = programs.split.mesh.size
    chunk = n_devices * -(-1000 // n_devices)
    pad = -len(labels) % chunk  # padded examples get label -1 and never count
    images = np.concatenate([images, np.zeros((pad, 28, 28), np.uint8)])
    padded = np.concatenate([labels, np.full(pad, -1, np.int32)])
    correct = 0
    for i in range(0, len(padded), chunk):
        indices = np.arange(i, i + chunk)
        x = global_batch(programs.split, indices, lambda rows: data.preprocess(images[rows]))
        y = global_batch(programs.split, indices, lambda rows: padded[rows])
        correct += int(programs.count_correct(params, x, y))
    return 100.0 * correct / len(labels)


def train_and_evaluate(config: Config, dataset: data.Dataset | None = None) -> Result:
    """Trains LeNet-5 as ``config`` says, evaluates it, and reports.

    Prints a progress bar per epoch (unless ``config.progress`` is false), a
    line per epoch and a summary; with ``config.checkpoint_dir`` it saves a
    checkpoint after every epoch and when stopped (``max_steps``, Ctrl-C).
    Ctrl-C stops the run after the step in flight, saves it, and raises
    ``KeyboardInterrupt``; a second Ctrl-C stops at once.

    Args:
      config: the settings. With ``resume`` or ``eval_only`` the training
        settings come from the newest checkpoint in ``checkpoint_dir``.
      dataset: digits to use instead of loading them as ``config.data_dir``
        says (tests pass a small set).

    Returns:
      A :class:`Result`; its ``test_accuracy`` is NaN when stopped early.

    Raises:
      ConfigError: for bad or conflicting settings, or a checkpoint directory
        that does not fit the request.
      DataError: for missing or damaged data files.
    """
    start = time.perf_counter()
    ckpt = Checkpoints(config.checkpoint_dir) if config.checkpoint_dir else None
    config, meta = settings(config, ckpt, RUN_OPTIONS)
    devices = jax.devices()[: config.devices]
    validate(config, len(devices))
    ds = dataset if dataset is not None else data.load(config.data_dir)
    per_epoch = _steps_per_epoch(config, ds, meta)
    total_steps = config.epochs * per_epoch
    updates = config.epochs * -(-per_epoch // config.accum_steps)  # last windows flushed
    programs = _programs(_program_key(config), updates)
    state, history = _initial_state(config, programs, ckpt, meta)

    def evaluate_test(params: Any) -> float:
        return evaluate(programs, params, ds.test_images, ds.test_labels)

    if config.eval_only:
        accuracy = evaluate_test(state.params)
        path = ckpt.path(state.step)  # type: ignore[union-attr]
        log(
            f"test accuracy {accuracy:.2f}% ({len(ds.test_labels):,} digits), "
            f"checkpoint at step {state.step:,}: {path}"
        )
        plot = _plot(history, config.plot)
        if plot:
            log(f"plot: {plot}")
        return _result(state, accuracy, history, path, plot)

    log(_describe(config, state.params, ds, devices))
    stop = total_steps
    if config.max_steps is not None:
        stop = min(stop, max(config.max_steps, state.step))
    written = None

    def end_epoch() -> None:
        """Evaluates and reports an epoch trained to its end, once."""
        done = history["epoch"]["step"]
        if state.step == 0 or state.step % per_epoch or (done and done[-1] == state.step):
            return
        accuracy = evaluate_test(state.params)
        train_loss = float(np.mean(history["loss"][-per_epoch:]))
        done.append(state.step)
        history["epoch"]["train_loss"].append(train_loss)
        history["epoch"]["test_accuracy"].append(accuracy)
        last = {k: history[k][-1] for k in _RECORDED if k in history}
        log(
            f"epoch {state.step // per_epoch:>{len(str(config.epochs))}}/{config.epochs}  "
            f"{_status({**last, 'loss': train_loss})}  test acc {accuracy:.2f}%  "
            f"[{time.perf_counter() - start:.0f} s]"
        )

    try:
        with CtrlC() as ctrl_c:
            end_epoch()  # in case a run was stopped between an epoch and its report
            while state.step < stop:
                ctrl_c.check()
                epoch = state.step // per_epoch
                epoch_stop = min(stop, (epoch + 1) * per_epoch)
                state, metrics = train_epoch(
                    programs, state, ds, config, epoch, epoch_stop, lambda: ctrl_c.requested
                )
                if _alive(state):
                    record(history, metrics, _RECORDED.__contains__)
                if state.step < epoch_stop:  # Ctrl-C
                    raise KeyboardInterrupt
                end_epoch()
                written = _save(ckpt, state, config, per_epoch, history) or written
    except KeyboardInterrupt:
        written = _save(ckpt, state, config, per_epoch, history) if _alive(state) else None
        log(
            f"interrupted at step {state.step:,}"
            + (f"; checkpoint: {written}; continue with --resume" if written else "")
        )
        raise

    stopped = state.step < total_steps
    accuracy = float("nan") if stopped else history["epoch"]["test_accuracy"][-1]
    plot = _plot(history, config.plot)
    elapsed = time.perf_counter() - start
    if stopped:
        log(f"stopped at step {state.step:,} of {total_steps:,} after {elapsed:.1f} s")
    else:
        log(
            f"test accuracy {accuracy:.2f}% ({len(ds.test_labels):,} digits) after "
            f"{config.epochs} epoch{'s' * (config.epochs != 1)} ({state.step:,} steps) "
            f"in {elapsed:.1f} s"
        )
    if written is None and ckpt is not None and ckpt.latest_step() == state.step:
        written = ckpt.path(state.step)  # resumed a finished run: nothing new to save
    log(f"checkpoint: {written or 'not saved (pass --checkpoint-dir DIR)'}")
    if plot:
        log(f"plot: {plot}")
    return _result(state, accuracy, history, written, plot)


# Setting up a run: its settings, and its first state (fresh or from a checkpoint).


def _result(
    state: TrainState, accuracy: float, history: dict[str, Any], checkpoint, plot
) -> Result:
    """The run's :class:`Result`, from its final state."""
    return Result(
        params=state.params,
        opt_state=state.opt_state,
        test_accuracy=accuracy,
        step=state.step,
        history=history,
        checkpoint=checkpoint,
        plot=plot,
    )


def _steps_per_epoch(config: Config, ds: data.Dataset, meta: dict[str, Any] | None) -> int:
    per_epoch = len(ds.train_labels) // config.batch_size
    if per_epoch == 0:
        raise ConfigError(
            f"--batch-size {config.batch_size} is larger than the "
            f"{len(ds.train_labels)} training digits"
        )
    if meta is not None and meta["steps_per_epoch"] != per_epoch:
        raise ConfigError(
            f"--checkpoint-dir {config.checkpoint_dir}: the checkpoint has "
            f"{meta['steps_per_epoch']} steps per epoch, these {len(ds.train_labels):,} "
            f"training digits give {per_epoch}: use the same data"
        )
    return per_epoch


def _initial_state(
    config: Config, programs: _Programs, ckpt: Checkpoints | None, meta: dict[str, Any] | None
) -> tuple[TrainState, dict[str, Any]]:
    """A freshly initialised state and an empty history, or the checkpoint's."""
    key = jax.random.key(config.seed)
    try:
        template = jax.eval_shape(programs.init, key)
    except ValueError as e:
        if not config.freeze:
            raise
        raise ConfigError(f"--freeze: {e}") from None  # a pattern that matches nothing
    if meta is None:
        init = programs.init(key)
        history = {"step": [], "epoch": {"step": [], "train_loss": [], "test_accuracy": []}}
        return TrainState(0, init["params"], init["opt_state"]), history
    template = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=programs.replicated), template
    )
    saved = ckpt.restore(meta["step"], template)  # type: ignore[union-attr]
    return TrainState(int(meta["step"]), saved["params"], saved["opt_state"]), meta["history"]


def _program_key(config: Config) -> Config:
    """``config`` without the fields that do not change what is compiled."""
    defaults = Config()
    unused = ("seed", "data_dir", *(k for k in RUN_OPTIONS if k != "devices"))
    return dataclasses.replace(config, **{k: getattr(defaults, k) for k in unused})


# Recording, saving and reporting.


def _alive(state: TrainState) -> bool:
    return alive((state.params, state.opt_state))


def _save(
    ckpt: Checkpoints | None,
    state: TrainState,
    config: Config,
    per_epoch: int,
    history: dict[str, Any],
) -> str | None:
    """Checkpoints the run at ``state.step`` (once), if it has a checkpoint directory."""
    arrays = {"params": state.params, "opt_state": state.opt_state}
    return save(ckpt, state.step, arrays, config, steps_per_epoch=per_epoch, history=history)


def _plot(history: dict[str, Any], path: str | None) -> str | None:
    """Plots ``history`` to ``path`` (on process 0) and returns the file written."""
    if not path or jax.process_index() != 0:
        return None
    return plot_history(history, path, PANELS, "gradtools LeNet-5 demo", "step (micro-batches)")


def _report_skip(recorded: list[Any], metrics: Any, step: int, opt_state: Any, params: Any):
    """Prints the step and the overflowing parameters if this step was skipped."""
    skipped = int(metrics.get("skipped_steps", 0))
    before = int(recorded[-1][1]["skipped_steps"]) if recorded else skipped - (skipped > 0)
    if skipped > before:
        try:
            names = ", ".join(gradtools.nonfinite_leaves(opt_state, params)) or "none"
        except ValueError:  # the scaler sits inside freeze: it saw the trainable params only
            names = f"{int(metrics['nonfinite_leaf_count'])} parameters"
        log(f"step {step}: skipped, non-finite gradients in {names}")


def _describe(config: Config, params: Any, ds: data.Dataset, devices: list[Any]) -> str:
    """Two lines on the model, data, devices and optimizer."""
    k = config.accum_steps
    batch = f"batch {config.batch_size}" + (
        f" x {k} accumulated = {config.batch_size * k} per update" if k > 1 else ""
    )
    schedule = config.schedule + (
        f" after {config.warmup_steps} warmup steps"
        if config.warmup_steps and config.schedule != "warmup"
        else ""
    )
    frozen = f"; frozen: {', '.join(config.freeze)}" if config.freeze else ""
    return (
        f"LeNet-5, {count_params(params):,} parameters, {config.precision}; "
        f"{ds.source}: {len(ds.train_labels):,} train / {len(ds.test_labels):,} test digits\n"
        f"{describe_devices(devices)}; {batch}; "
        f"{config.optimizer} lr {config.learning_rate:g} ({schedule}); "
        f"clip norm {config.clip_norm or 'off'}; loss scale {config.loss_scale}{frozen}"
    )


def _status(m: dict[str, Any]) -> str:
    parts = [f"loss {float(m['loss']):.4f}"]
    if "learning_rate" in m:
        parts.append(f"lr {float(m['learning_rate']):.3g}")
    if "loss_scale" in m:
        parts.append(f"scale {float(m['loss_scale']):g}")
        parts.append(f"skipped {int(m['skipped_steps'])}")
    return "  ".join(parts)
