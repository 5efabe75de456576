"""LeNet-5 training throughput: what the gradtools stack costs, and PyTorch eager beside it.

The JAX side is the demo's model (``gradtools.demo.lenet.model.LeNet5``, plain Flax
``nn.Conv``, ``nn.max_pool`` and ``nn.Dense``), compiled with XLA's default
options, params and state donated. Two rows measure what gradtools costs:
the demo's step, ``gradtools.train_step`` of
``dynamic_loss_scale(chain(gradtools.clip_by_global_norm(1.0), optax.sgd))``,
against the same model and optimizer written with plain optax
(``chain(optax.clip_by_global_norm(1.0), optax.sgd)``, ``jax.value_and_grad``,
``tx.update`` and ``optax.apply_updates``, no loss scale). Other rows train
with Adam in fp32, bf16, fp16 with a loss scale and with accumulation, and
one row trains the space-to-depth variant ``benchmarks/lenet_s2d.py`` (with its
XLA:CPU options on the CPU). The PyTorch side is the same network (same layers,
61,706 parameters) trained eagerly with ``torch.optim.Adam``, on the GPU when JAX
runs on one (there with fp16 autocast and ``GradScaler`` too). All see the same
random 32x32 images, a fixed batch, and are timed interleaved. PyTorch is
optional (``pip install gradtools[bench-torch]``); without it its rows are
skipped with a note.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradtools
from benchmarks import _timing

__all__ = ["GRADTOOLS_STACK", "PLAIN_OPTAX", "run_lenet"]

ACCUM_K = 4
#: The two rows whose ratio is the LeNet target: the demo's gradtools stack and plain optax.
GRADTOOLS_STACK = "gradtools stack fp32: dynamic_loss_scale(gradtools.clip+sgd)"
PLAIN_OPTAX = "plain optax fp32: optax.clip+sgd"


def _sgd() -> optax.GradientTransformation:
    return optax.sgd(0.01, momentum=0.9)


def _jax_variants() -> tuple[dict[str, Callable[[int], Callable[[], None]]], list[str]]:
    """name -> (batch -> a warm, blocking step callable)."""
    try:
        from benchmarks.lenet_s2d import LeNet5S2D
        from benchmarks.lenet_s2d import compiler_options
        from gradtools.demo.lenet.model import LeNet5
    except ImportError:
        return {}, ["gradtools.demo is not in this build: the JAX LeNet rows are skipped"]

    def setup(model: Any, batch: int):
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=(batch, 32, 32, 1)), jnp.float32)
        y = jnp.asarray(rng.integers(0, 10, size=batch), jnp.int32)
        params = model.init(jax.random.key(0), x[:1])["params"]

        def loss_fn(p, x, y):
            logits = model.apply({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        return params, loss_fn, x, y

    def variant(
        dtype: Any,
        tx: optax.GradientTransformation,
        model_class: Any = LeNet5,
        options: dict[str, str] | None = None,
    ) -> Callable[[int], Callable[[], None]]:
        """A ``gradtools.train_step`` of ``tx``, as the demo jits it."""

        def build(batch: int) -> Callable[[], None]:
            params, loss_fn, x, y = setup(model_class(dtype=dtype), batch)
            step = jax.jit(
                gradtools.train_step(loss_fn, tx), donate_argnums=(0, 1), compiler_options=options
            )
            carry = [params, tx.init(params)]

            def run() -> None:
                carry[0], carry[1], m = step(carry[0], carry[1], x, y)
                jax.block_until_ready(m["loss"])

            run()
            return run

        return build

    def plain_optax(batch: int) -> Callable[[], None]:
        """The same model and optimizer as the gradtools stack, in plain optax."""
        params, loss_fn, x, y = setup(LeNet5(), batch)
        tx = optax.chain(optax.clip_by_global_norm(1.0), _sgd())

        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        step = jax.jit(step, donate_argnums=(0, 1))
        carry = [params, tx.init(params)]

        def run() -> None:
            carry[0], carry[1], loss = step(carry[0], carry[1], x, y)
            jax.block_until_ready(loss)

        run()
        return run

    stack = gradtools.dynamic_loss_scale(optax.chain(gradtools.clip_by_global_norm(1.0), _sgd()))
    adam = optax.adam(1e-3)
    out = {
        GRADTOOLS_STACK: variant(jnp.float32, stack),
        PLAIN_OPTAX: plain_optax,
        "gradtools fp32 (adam)": variant(jnp.float32, adam),
        "gradtools bf16 (adam)": variant(jnp.bfloat16, adam),
        "gradtools fp16 + dynamic_loss_scale(adam)": variant(
            jnp.float16, gradtools.dynamic_loss_scale(adam)
        ),
        f"gradtools fp32 accumulate(adam, {ACCUM_K})": variant(
            jnp.float32, gradtools.accumulate(adam, ACCUM_K)
        ),
    }
    s2d = "gradtools fp32 (adam), space-to-depth LeNet"
    if compiler_options():
        s2d += ", no YNNPACK"
    out[s2d] = variant(jnp.float32, adam, LeNet5S2D, compiler_options())
    return out, []


def _torch_variants() -> tuple[dict[str, Callable[[int], Callable[[], None]]], list[str]]:
    try:
        import torch
    except ImportError:
        return {}, [
            "PyTorch is not installed: its LeNet rows are skipped "
            "(pip install 'gradtools[bench-torch]')"
        ]
    from torch import nn

    # The device JAX runs on: PyTorch's CUDA build against XLA:GPU, its CPU build against XLA:CPU.
    device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None

    def variant(autocast: Any) -> Callable[[int], Callable[[], None]]:
        def build(batch: int) -> Callable[[], None]:
            torch.manual_seed(0)
            model = nn.Sequential(
                nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
                nn.Flatten(),
                nn.Linear(400, 120), nn.ReLU(),
                nn.Linear(120, 84), nn.ReLU(),
                nn.Linear(84, 10),
            ).to(device)  # fmt: skip
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            # fp16 needs a loss scale: GradScaler is PyTorch's dynamic_loss_scale.
            scaler = torch.amp.GradScaler(device, enabled=autocast is torch.float16)
            rng = np.random.default_rng(0)
            x = torch.from_numpy(rng.normal(size=(batch, 1, 32, 32)).astype(np.float32))
            y = torch.from_numpy(rng.integers(0, 10, size=batch).astype(np.int64))
            x, y = x.to(device), y.to(device)

            def run() -> None:
                opt.zero_grad(set_to_none=True)
                with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
                    loss = nn.functional.cross_entropy(model(x).float(), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                sync()

            run()
            return run

        return build

    name = f"PyTorch {torch.__version__} eager"
    out = {
        f"{name} fp32 (Adam)": variant(None),
        f"{name} bf16 autocast (Adam)": variant(torch.bfloat16),
    }
    if device == "cuda":
        out[f"{name} fp16 autocast + GradScaler (Adam)"] = variant(torch.float16)
        return out, [f"PyTorch runs on CUDA ({torch.cuda.get_device_name()})"]
    return out, [f"PyTorch uses {torch.get_num_threads()} threads"]


def run_lenet(
    batch: int,
    reps: int,
    *,
    match: str | None = None,
    sample_s: float = 0.2,
    log: Callable[[str], None] = print,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Images per second of one training step at ``batch``, per variant."""
    jax_v, notes = _jax_variants()
    torch_v, torch_notes = _torch_variants()
    builders = {**jax_v, **torch_v}
    if match:
        builders = {k: v for k, v in builders.items() if re.search(match, k)}
    notes += torch_notes
    if not builders:
        return [], notes
    log(f"lenet batch {batch}: building {len(builders)} variants")
    with warnings.catch_warnings():
        # Scalar counters in the state may find no output to alias; that is expected.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        runners = {name: build(batch) for name, build in builders.items()}
    calls = {k: _timing.calibrate(r, sample_s) for k, r in runners.items()}
    stats = _timing.interleave(runners, reps, calls)
    ref = next((k for k in stats if k.startswith("PyTorch") and "fp32" in k), None)
    optax_ref = PLAIN_OPTAX if PLAIN_OPTAX in stats else None
    rows = []
    for name, s in stats.items():
        rows.append(
            {
                "batch": batch,
                "variant": name,
                **s.as_dict(),
                "samples_s": list(s.samples),
                "reps": reps,
                "images_per_s": batch / s.median,
                "baseline": ref,
                "x_baseline": _timing.ratio(stats[ref], s) if ref else None,
                "x_plain_optax": _timing.ratio(stats[optax_ref], s) if optax_ref else None,
            }
        )
        log(f"  {name:60s} {batch / s.median:10.0f} images/s")
    return rows, notes
