"""LeNet-5 training throughput: gradtools train steps against PyTorch eager.

The JAX side is the demo's model (``gradtools.demo.model.LeNet5``, whose
convolutions, ReLUs and poolings run as ``ConvReluPool`` layers) trained by
``gradtools.train_step`` under ``jax.jit`` with params and state donated and
the demo's ``compiler_options()`` (one row compiles with XLA's defaults); the
PyTorch side is the same network (same layers, 61,706 parameters) trained
eagerly with ``torch.optim.Adam``, on the GPU when JAX runs on one (there
with fp16 autocast and ``GradScaler`` too). Both see the same random 32x32 images, a
fixed batch, and are timed interleaved. PyTorch is optional
(``pip install gradtools[bench-torch]``); without it its rows are skipped with
a note.
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

__all__ = ["run_lenet"]

ACCUM_K = 4


def _jax_variants() -> tuple[dict[str, Callable[[int], Callable[[], None]]], list[str]]:
    """name -> (batch -> a warm, blocking step callable)."""
    try:
        from gradtools.demo.model import LeNet5
        from gradtools.demo.model import compiler_options
    except ImportError:
        return {}, ["gradtools.demo is not in this build: the JAX LeNet rows are skipped"]

    def variant(
        dtype: Any, tx: optax.GradientTransformation, options: dict[str, str] | None = None
    ) -> Callable[[int], Callable[[], None]]:
        def build(batch: int) -> Callable[[], None]:
            model = LeNet5(dtype=dtype)
            rng = np.random.default_rng(0)
            x = jnp.asarray(rng.normal(size=(batch, 32, 32, 1)), jnp.float32)
            y = jnp.asarray(rng.integers(0, 10, size=batch), jnp.int32)
            params = model.init(jax.random.key(0), x[:1])["params"]

            def loss_fn(p, x, y):
                logits = model.apply({"params": p}, x)
                return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

            step = jax.jit(
                gradtools.train_step(loss_fn, tx),
                donate_argnums=(0, 1),
                compiler_options=compiler_options() if options is None else options,
            )
            carry = [params, tx.init(params)]

            def run() -> None:
                carry[0], carry[1], m = step(carry[0], carry[1], x, y)
                jax.block_until_ready(m["loss"])

            run()
            return run

        return build

    adam = optax.adam(1e-3)
    out = {"gradtools fp32 (adam)": variant(jnp.float32, adam)}
    if compiler_options():  # XLA:CPU's options: the same model without them
        out["gradtools fp32 (adam), XLA default options"] = variant(jnp.float32, adam, {})
    out |= {
        "gradtools bf16 (adam)": variant(jnp.bfloat16, adam),
        "gradtools fp16 + dynamic_loss_scale(adam)": variant(
            jnp.float16, gradtools.dynamic_loss_scale(adam)
        ),
    }
    notes = []
    if hasattr(gradtools, "accumulate"):
        tx = gradtools.accumulate(adam, ACCUM_K)  # pyright: ignore
        out[f"gradtools fp32 accumulate(adam, {ACCUM_K})"] = variant(jnp.float32, tx)
    else:
        notes.append("gradtools.accumulate is not in this build: its LeNet row is skipped")
    return out, notes


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
    rows = []
    for name, s in stats.items():
        rows.append(
            {
                "batch": batch,
                "variant": name,
                **s.as_dict(),
                "reps": reps,
                "images_per_s": batch / s.median,
                "baseline": ref,
                "x_baseline": _timing.ratio(stats[ref], s) if ref else None,
            }
        )
        log(f"  {name:50s} {batch / s.median:10.0f} images/s")
    return rows, notes
