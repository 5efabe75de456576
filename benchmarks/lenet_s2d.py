"""LeNet-5 with space-to-depth convolutions: a faster variant on XLA:CPU, for the benchmarks.

``LeNet5S2D`` has the parameters, initial values and logits of the demo's
:class:`gradtools.demo.lenet.model.LeNet5`, but computes each convolution with its
ReLU and 2x2 max pooling as one :class:`ConvReluPool` layer over 2x2 blocks of
pixels: LeNet-5's convolutions over 1 and 6 input channels, which XLA:CPU's
convolutions handle poorly, become convolutions over 4 and 24. On the 2-core
CPU its training step ran about four times as fast as ``nn.Conv``'s (see
``benchmarks/ANALYSIS.md``); it measures XLA:CPU's convolutions, not
gradtools, so the demo keeps plain ``nn.Conv`` and this variant lives here.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype
from jax import lax

__all__ = ["ConvReluPool", "LeNet5S2D", "compiler_options"]


class LeNet5S2D(nn.Module):
    """The demo's LeNet-5, with each convolution, ReLU and pooling one :class:`ConvReluPool`.

    Attributes:
      dtype: the compute dtype.
      param_dtype: the parameters' dtype.
    """

    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps images of shape ``(batch, 32, 32, 1)`` to float32 logits ``(batch, 10)``."""
        layer = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        x = x.astype(self.dtype)
        x = ConvReluPool(6, name="conv1", **layer)(x)
        x = ConvReluPool(16, name="conv2", **layer)(x)
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(120, name="fc1", **layer)(x))
        x = nn.relu(nn.Dense(84, name="fc2", **layer)(x))
        return nn.Dense(10, name="fc3", **layer)(x).astype(jnp.float32)


class ConvReluPool(nn.Module):
    """A valid convolution, ReLU and 2x2 max pooling, computed on 2x2 blocks of pixels.

    The values of ``nn.max_pool(nn.relu(nn.Conv(features, (k, k),
    padding="VALID")(x)), (2, 2), strides=(2, 2))``, with the same parameters:
    ``kernel`` of shape ``(k, k, in_features, features)`` and ``bias`` of
    shape ``(features,)``, initialised as ``nn.Conv`` initialises them.

    The input is cut into 2x2 blocks of pixels, stacked along the channels
    (``4 * in_features`` of them; "space to depth"), and each output channel
    is likewise computed at the four pixels of a pooling window as four
    channels. The ``k x k`` convolution becomes a ``(k + 1) / 2``-square one
    over these blocks, with a kernel made of ``kernel``'s taps (and zeros)
    by padding and reshaping, and the pooling becomes a maximum over each
    channel's four. Its gradient, through the padding and reshaping, is
    ``nn.Conv``'s; where a pooling window holds several equal maxima it is
    split between them (``nn.max_pool`` gives it all to one).

    Attributes:
      features: output channels.
      kernel_size: ``k``, odd; the input's height and width must be even.
      dtype: the compute dtype.
      param_dtype: the parameters' dtype.
    """

    features: int
    kernel_size: int = 5
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """``(batch, h, w, c)`` -> ``(batch, (h - k + 1) / 2, (w - k + 1) / 2, features)``."""
        k, c, o = self.kernel_size, x.shape[-1], self.features
        if k < 1 or k % 2 == 0:
            raise ValueError(f"ConvReluPool: kernel_size must be odd and positive, got {k}")
        b, h, w, _ = x.shape
        if h % 2 or w % 2 or min(h, w) < k:
            raise ValueError(
                f"ConvReluPool: the input's height and width must be even and at least "
                f"kernel_size={k}, got {(h, w)}"
            )
        shape = (k, k, c, o)
        kernel = self.param("kernel", nn.initializers.lecun_normal(), shape, self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros_init(), (o,), self.param_dtype)
        x, kernel, bias = promote_dtype(x, kernel, bias, dtype=self.dtype)
        blocks = x.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 2, 4, 5)
        y = lax.conv_general_dilated(
            blocks.reshape(b, h // 2, w // 2, 4 * c),
            _block_kernel(kernel),
            window_strides=(1, 1),
            padding="VALID",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        pooled = y.reshape(*y.shape[:3], 4, o).max(axis=3)
        return nn.relu(pooled + bias)


def _block_kernel(kernel: jax.Array) -> jax.Array:
    """``(k, k, c, o)`` -> the ``(m, m, 4 * c, 4 * o)`` kernel over 2x2 blocks, ``m = (k + 1) / 2``.

    Output channel ``(a, d, j)`` (pixel ``(a, d)`` of a pooling window,
    channel ``j``) at block ``(p, q)`` reads input channel ``(r, s, i)`` of block
    ``(p + u, q + v)`` with weight ``kernel[2u + r - a, 2v + s - d, i, j]``, or
    0 where that tap is outside the kernel: padding ``a`` zeros in front (and
    ``1 - a`` behind) and splitting each spatial axis into ``(u, r)`` gives it.
    """
    k, _, c, o = kernel.shape
    m = (k + 1) // 2
    shifted = []
    for a in (0, 1):
        for d in (0, 1):
            padded = jnp.pad(kernel, ((a, 1 - a), (d, 1 - d), (0, 0), (0, 0)))
            shifted.append(padded.reshape(m, 2, m, 2, c, o).transpose(0, 2, 1, 3, 4, 5))
    return jnp.stack(shifted, axis=-2).reshape(m, m, 4 * c, 4 * o)


#: XLA:CPU options for this variant's programs: no YNNPACK fusions, so XLA:CPU's own
#: (Eigen) convolutions run; with YNNPACK's the step ran at about 0.6x the images/s.
_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def compiler_options() -> dict[str, str]:
    """The ``compiler_options`` to ``jax.jit`` this variant's programs with.

    Empty unless the default backend is CPU and its XLA knows the options (they
    are experimental: an XLA without them would reject the compile).
    """
    return dict(_CPU_OPTIONS) if _cpu_options_apply() else {}


@functools.cache
def _cpu_options_apply() -> bool:
    if jax.default_backend() != "cpu":
        return False
    try:
        jax.jit(lambda: 0, compiler_options=_CPU_OPTIONS).lower().compile()
    except jax.errors.JaxRuntimeError:
        return False
    return True
