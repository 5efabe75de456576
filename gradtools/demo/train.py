"""Training and evaluation of LeNet-5 with a gradtools optimizer.

:func:`train_and_evaluate` is the whole demo as a library call (the CLI in
``__main__`` only parses a :class:`Config`); the optimizer comes from
:func:`gradtools.demo.optim.make_optimizer`.

Training is data-parallel over a one-axis ``jax.sharding.Mesh``: each batch is
split over the devices and the parameters and optimizer state are replicated,
so the jitted step is the one-device step and XLA adds the all-reduce.
"""

from __future__ import annotations

import dataclasses
import functools
import signal
import sys
import threading
import time
from typing import Any
from typing import NamedTuple
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradtools
from gradtools.demo import data
from gradtools.demo.checkpoint import Checkpoints
from gradtools.demo.config import RUN_OPTIONS
from gradtools.demo.config import Config
from gradtools.demo.config import ConfigError
from gradtools.demo.config import resumed
from gradtools.demo.config import validate
from gradtools.demo.model import DTYPES
from gradtools.demo.model import LeNet5
from gradtools.demo.model import compiler_options
from gradtools.demo.model import count_params
from gradtools.demo.model import init_key
from gradtools.demo.optim import make_optimizer

__all__ = ["Result", "train_and_evaluate"]

# The metrics of each step kept in the history (and so in checkpoints and the plot).
_RECORDED = ("loss", "learning_rate", "loss_scale", "grad_norm", "skipped_steps")


class Result(NamedTuple):
    """What :func:`train_and_evaluate` returns.

    Attributes:
      params: the trained parameters.
      opt_state: the optimizer state.
      step: micro-batches trained so far.
      test_accuracy: accuracy on the test digits, in percent.
      history: per-step and per-epoch metrics (as
        :func:`gradtools.demo.plot.plot_history` takes them).
      checkpoint: the directory of the last checkpoint written, or ``None``.
      plot: the PNG written, or ``None``.
    """

    params: Any
    opt_state: Any
    step: int
    test_accuracy: float
    history: dict[str, Any]
    checkpoint: str | None
    plot: str | None


def _log(message: str) -> None:
    if jax.process_index() == 0:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stdout)


class _CtrlC:
    """Defers Ctrl-C (SIGINT) inside its block to the next :meth:`check`.

    A training step is handed the params and optimizer state (donated): a
    ``KeyboardInterrupt`` raised while it is in flight loses both, and the
    checkpoint that Ctrl-C promises with them. So the first Ctrl-C only asks
    to stop, and the loop stops between steps; a second one stops at once.
    Outside the main thread (where Python delivers signals) nothing changes.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> _CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        # No printing here: a handler that writes to a stream the loop is writing
        # to raises RuntimeError (a reentrant call) in the middle of the step.
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def check(self) -> None:
        """Raises ``KeyboardInterrupt`` if a stop was asked for."""
        if self.requested:
            raise KeyboardInterrupt


def train_and_evaluate(config: Config, dataset: data.Dataset | None = None) -> Result:
    """Trains LeNet-5 as ``config`` says, evaluates it, and reports.

    Prints a progress bar per epoch (unless ``config.progress`` is false), a
    line per epoch and a summary; with ``config.checkpoint_dir`` it saves a
    checkpoint after every epoch and when stopped (``max_steps``, Ctrl-C).

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
    run = _Run(config, dataset)
    config, ckpt = run.config, run.ckpt
    if config.eval_only:
        accuracy = run.evaluate()
        path = ckpt.path(run.step)  # type: ignore[union-attr]
        _log(
            f"test accuracy {accuracy:.2f}% ({len(run.ds.test_labels):,} digits), "
            f"checkpoint at step {run.step:,}: {path}"
        )
        plot = _plot(run.history, config.plot)
        if plot:
            _log(f"plot: {plot}")
        return Result(run.params, run.opt_state, run.step, accuracy, run.history, path, plot)
    _log(run.describe())
    try:
        run.train(start)
    except KeyboardInterrupt:
        written = None
        if run.alive():
            run.record()
            written = run.save()
        _log(
            f"interrupted at step {run.step:,}"
            + (f"; checkpoint: {written}; continue with --resume" if written else "")
        )
        raise
    stopped = run.step < run.total_steps
    accuracy = float("nan") if stopped else run.history["epoch"]["test_accuracy"][-1]
    plot = _plot(run.history, config.plot)
    elapsed = time.perf_counter() - start
    if stopped:
        _log(f"stopped at step {run.step:,} of {run.total_steps:,} after {elapsed:.1f} s")
    else:
        _log(
            f"test accuracy {accuracy:.2f}% ({len(run.ds.test_labels):,} digits) after "
            f"{config.epochs} epoch{'s' * (config.epochs != 1)} ({run.step:,} steps) "
            f"in {elapsed:.1f} s"
        )
    written = run.written
    if written is None and run.ckpt is not None and run.ckpt.latest_step() == run.step:
        written = run.ckpt.path(run.step)  # resumed a finished run: nothing new to save
    _log(f"checkpoint: {written or 'not saved (pass --checkpoint-dir DIR)'}")
    if plot:
        _log(f"plot: {plot}")
    return Result(run.params, run.opt_state, run.step, accuracy, run.history, written, plot)


def _plot(history: dict[str, Any], path: str | None) -> str | None:
    """Plots ``history`` to ``path`` (on the first host) and returns the file written."""
    if not path or jax.process_index() != 0:
        return None
    from gradtools.demo.plot import plot_history

    return plot_history(history, path)


class _Programs(NamedTuple):
    """The jitted functions of a run, and the shardings they use."""

    replicated: NamedSharding
    split: NamedSharding
    init: Any  # key -> {'params', 'opt_state'}
    train_step: Any  # gradtools.train_step, params and state donated
    count_correct: Any  # (params, images, labels) -> correct predictions


def _program_key(config: Config) -> Config:
    """``config`` without the fields that do not change what is compiled."""
    defaults = Config()
    unused = ("seed", "data_dir", *(k for k in RUN_OPTIONS if k != "devices"))
    return dataclasses.replace(config, **{k: getattr(defaults, k) for k in unused})


@functools.lru_cache(maxsize=4)
def _programs(config: Config, total_updates: int) -> _Programs:
    """Builds (once per setting: runs in one process share compilations) the programs."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[: config.devices]), ("data",))
    replicated = NamedSharding(mesh, P())
    model = LeNet5(DTYPES[config.precision])
    tx = make_optimizer(config, total_updates)

    def init(key):
        params = model.init(key, jnp.zeros((1, 32, 32, 1), jnp.float32))
        return {"params": params, "opt_state": tx.init(params)}

    def logits_fn(params, images) -> jax.Array:
        return cast(jax.Array, model.apply(params, images))

    def loss_fn(params, images, labels):
        logits = logits_fn(params, images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def count_correct(params, images, labels):
        return jnp.sum(jnp.argmax(logits_fn(params, images), -1) == labels)

    return _Programs(
        replicated=replicated,
        split=NamedSharding(mesh, P("data")),
        init=jax.jit(init, out_shardings=replicated),
        train_step=jax.jit(
            gradtools.train_step(loss_fn, tx),
            donate_argnums=(0, 1),
            out_shardings=replicated,
            compiler_options=compiler_options(),
        ),
        count_correct=jax.jit(count_correct, compiler_options=compiler_options()),
    )


class _Run:
    """The state of one run: set up from a config (and a checkpoint), trained in place."""

    def __init__(self, config: Config, dataset: data.Dataset | None):
        self.ckpt = Checkpoints(config.checkpoint_dir) if config.checkpoint_dir else None
        latest = self.ckpt.latest_step() if self.ckpt else None
        meta = None
        if config.resume or config.eval_only:
            if config.resume and config.eval_only:
                raise ConfigError("--resume and --eval-only exclude each other")
            if config.checkpoint_dir is None:
                flag = "--resume" if config.resume else "--eval-only"
                raise ConfigError(f"{flag} needs --checkpoint-dir")
            if latest is None:
                raise ConfigError(f"--checkpoint-dir {config.checkpoint_dir}: holds no checkpoint")
            meta = self.ckpt.restore_meta(latest)  # type: ignore[union-attr]
            config, ignored = resumed(config, meta["config"])
            if ignored and config.resume:
                _log(f"note: continuing with the checkpoint's settings, not {', '.join(ignored)}")
        elif latest is not None:
            raise ConfigError(
                f"--checkpoint-dir {config.checkpoint_dir} already holds a checkpoint (step "
                f"{latest}): pass --resume to continue it, or choose another directory"
            )
        self.config = config
        self.devices = jax.devices()[: config.devices]
        validate(config, len(self.devices))
        self.ds = ds = dataset if dataset is not None else data.load(config.data_dir)
        self.steps_per_epoch = len(ds.train_labels) // config.batch_size
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"--batch-size {config.batch_size} is larger than the "
                f"{len(ds.train_labels)} training digits"
            )
        if meta is not None and meta["steps_per_epoch"] != self.steps_per_epoch:
            raise ConfigError(
                f"--checkpoint-dir {config.checkpoint_dir}: the checkpoint has "
                f"{meta['steps_per_epoch']} steps per epoch, these {len(ds.train_labels):,} "
                f"training digits give {self.steps_per_epoch}: use the same data"
            )
        self.total_steps = config.epochs * self.steps_per_epoch
        updates_per_epoch = -(-self.steps_per_epoch // config.accum_steps)  # last window flushed

        programs = _programs(_program_key(config), config.epochs * updates_per_epoch)
        self.replicated, self.split = programs.replicated, programs.split
        self._train_step, self._count_correct = programs.train_step, programs.count_correct
        key = init_key(config.seed)
        try:
            template = jax.eval_shape(programs.init, key)
        except ValueError as e:
            if not config.freeze:
                raise
            raise ConfigError(f"--freeze: {e}") from None  # a pattern that matches nothing
        if meta is None:
            state = programs.init(key)
            self.step = 0
            self.history: dict[str, Any] = {
                "step": [],
                "epoch": {"step": [], "train_loss": [], "test_accuracy": []},
            }
        else:
            template = jax.tree.map(
                lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self.replicated),
                template,
            )
            state = self.ckpt.restore(latest, template)  # type: ignore[union-attr]
            self.step, self.history = int(latest), meta["history"]  # type: ignore[arg-type]
        self.params, self.opt_state = state["params"], state["opt_state"]
        self.written: str | None = None
        self._pending: list[tuple[int, dict[str, jax.Array]]] = []  # steps not in history yet
        self._ctrl_c = _CtrlC()

    def put(self, x: np.ndarray) -> jax.Array:
        """A host batch as a global array split over the devices (on every host)."""
        return jax.make_array_from_callback(x.shape, self.split, lambda index: x[index])

    def alive(self) -> bool:
        """Whether params and state are intact (not donated to a step in flight)."""
        return not any(x.is_deleted() for x in jax.tree.leaves((self.params, self.opt_state)))

    def evaluate(self) -> float:
        """Accuracy on the test digits, in percent."""
        chunk = len(self.devices) * -(-1000 // len(self.devices))
        images, labels = self.ds.test_images, self.ds.test_labels
        pad = -len(labels) % chunk  # padded examples get label -1 and never count
        images = np.concatenate([images, np.zeros((pad, 28, 28), np.uint8)])
        labels = np.concatenate([labels, np.full(pad, -1, np.int32)])
        correct = 0
        for i in range(0, len(labels), chunk):
            x, y = data.preprocess(images[i : i + chunk]), labels[i : i + chunk]
            correct += int(self._count_correct(self.params, self.put(x), self.put(y)))
        return 100.0 * correct / len(self.ds.test_labels)

    def save(self) -> str | None:
        """Checkpoints the run at its current step, if it has a checkpoint directory."""
        if self.ckpt is not None and self.ckpt.latest_step() == self.step:
            self.written = self.ckpt.path(self.step)  # saved already (Ctrl-C during a save)
        elif self.ckpt is not None:
            meta = {
                "config": dataclasses.asdict(self.config),
                "steps_per_epoch": self.steps_per_epoch,
                "history": self.history,
            }
            state = {"params": self.params, "opt_state": self.opt_state}
            self.written = self.ckpt.save(self.step, state, meta)
        return self.written

    def train(self, start: float) -> None:
        """Trains to the end (or to ``max_steps``), one epoch at a time.

        Ctrl-C stops it between steps (:class:`_CtrlC`) with a ``KeyboardInterrupt``.
        """
        stop = self.total_steps
        if self.config.max_steps is not None:
            stop = min(stop, max(self.config.max_steps, self.step))
        with self._ctrl_c:
            self._end_epoch(start)  # in case a run was stopped between an epoch and its report
            while self.step < stop:
                self._ctrl_c.check()
                epoch = self.step // self.steps_per_epoch
                self._epoch(epoch, min(stop, (epoch + 1) * self.steps_per_epoch))
                self._end_epoch(start)
                self.save()

    def _end_epoch(self, start: float) -> None:
        """Evaluates and reports at the end of an epoch, once."""
        history = self.history
        done = history["epoch"]["step"]
        if self.step == 0 or self.step % self.steps_per_epoch or (done and done[-1] == self.step):
            return
        accuracy = self.evaluate()
        train_loss = float(np.mean(history["loss"][-self.steps_per_epoch :]))
        done.append(self.step)
        history["epoch"]["train_loss"].append(train_loss)
        history["epoch"]["test_accuracy"].append(accuracy)
        last = {k: history[k][-1] for k in _RECORDED if k in history}
        epochs = self.config.epochs
        _log(
            f"epoch {self.step // self.steps_per_epoch:>{len(str(epochs))}}/{epochs}  "
            f"{_status({**last, 'loss': train_loss})}  test acc {accuracy:.2f}%  "
            f"[{time.perf_counter() - start:.0f} s]"
        )

    def _epoch(self, epoch: int, stop: int) -> None:
        """Trains the steps of ``epoch`` up to (global) step ``stop``."""
        from tqdm import tqdm

        config, per_epoch = self.config, self.steps_per_epoch
        n = len(self.ds.train_labels)
        batches = data.epoch_batches(n, config.batch_size, config.seed, epoch)
        bar = tqdm(
            total=per_epoch,
            initial=self.step - epoch * per_epoch,
            unit="batch",
            desc=f"epoch {epoch + 1}/{config.epochs}",
            leave=False,
            dynamic_ncols=True,
            disable=not config.progress or jax.process_index() != 0,
        )
        try:
            while self.step < stop:
                i = self.step - epoch * per_epoch
                update_kwargs = None
                if config.accum_steps > 1:  # the last batch flushes a partial window
                    update_kwargs = {"flush": np.asarray(i == per_epoch - 1)}
                images, labels = self.ds.train_images[batches[i]], self.ds.train_labels[batches[i]]
                self.params, self.opt_state, metrics = self._train_step(
                    self.params,
                    self.opt_state,
                    self.put(data.preprocess(images)),
                    self.put(labels),
                    update_kwargs=update_kwargs,
                )
                self.step += 1
                self._pending.append((self.step, metrics))
                self._ctrl_c.check()
                bar.update()
                if not bar.disable and (i % 10 == 0 or self.step == stop):
                    bar.set_postfix_str(_status(jax.device_get(metrics)), refresh=False)
        finally:
            bar.close()
        self.record()

    def record(self) -> None:
        """Moves the metrics of the steps trained since the last call into the history.

        Waits for those steps to finish. Called after each epoch, and on Ctrl-C
        before the checkpoint is saved.
        """
        steps, records = zip(*jax.device_get(self._pending)) if self._pending else ((), ())
        self.history["step"].extend(steps)
        for key in _RECORDED:
            if records and key in records[0]:
                self.history.setdefault(key, []).extend(float(r[key]) for r in records)
        self._pending = []

    def describe(self) -> str:
        """Two lines on the model, data, devices and optimizer."""
        config, k, n = self.config, self.config.accum_steps, len(self.devices)
        batch = f"batch {config.batch_size}" + (
            f" x {k} accumulated = {config.batch_size * k} per update" if k > 1 else ""
        )
        schedule = config.schedule + (
            f" after {config.warmup_steps} warmup steps"
            if config.warmup_steps and config.schedule != "warmup"
            else ""
        )
        devices = f"{n} {self.devices[0].platform} device{'s' * (n > 1)}"
        frozen = f"; frozen: {', '.join(config.freeze)}" if config.freeze else ""
        return (
            f"LeNet-5, {count_params(self.params):,} parameters, {config.precision}; "
            f"{self.ds.source}: {len(self.ds.train_labels):,} train / "
            f"{len(self.ds.test_labels):,} test digits\n"
            f"{devices}; {batch}; {config.optimizer} lr {config.learning_rate:g} ({schedule}); "
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
