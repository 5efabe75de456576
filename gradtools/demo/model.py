"""LeNet-5 in Flax Linen, with a compute dtype for mixed precision."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["DTYPES", "LeNet5", "compiler_options", "count_params", "init_key", "max_pool_2x2"]

#: ``--precision`` names and the compute dtypes they select.
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


class LeNet5(nn.Module):
    """LeNet-5 (LeCun et al., 1998) with ReLU and max pooling.

    ``conv1`` 6@5x5 valid -> max pool 2 -> ``conv2`` 16@5x5 valid -> max pool 2
    -> ``fc1`` 120 -> ``fc2`` 84 -> ``fc3`` 10, ReLU after every layer but the
    last: 61,706 parameters for 32x32x1 inputs.

    Parameters are always float32 (the master weights); the layers compute in
    ``dtype`` and the logits come back as float32, so the loss is computed in
    float32 whatever the precision.

    Attributes:
      dtype: the compute dtype: ``jnp.float32``, ``jnp.bfloat16`` or
        ``jnp.float16``.
    """

    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps images of shape ``(batch, 32, 32, 1)`` to float32 logits ``(batch, 10)``."""
        layer = {"dtype": self.dtype, "param_dtype": jnp.float32}
        x = x.astype(self.dtype)
        for name, features in (("conv1", 6), ("conv2", 16)):
            x = nn.Conv(features, (5, 5), padding="VALID", name=name, **layer)(x)
            x = max_pool_2x2(nn.relu(x))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(120, name="fc1", **layer)(x))
        x = nn.relu(nn.Dense(84, name="fc2", **layer)(x))
        return nn.Dense(10, name="fc3", **layer)(x).astype(jnp.float32)


def max_pool_2x2(x: jax.Array) -> jax.Array:
    """Max pooling over 2x2 windows with stride 2 of ``(batch, height, width, channels)``.

    The values of ``nn.max_pool(x, (2, 2), strides=(2, 2))`` (height and width
    must be even), written as a reshape and a max so that its gradient is an
    elementwise select. ``nn.max_pool``'s gradient is a ``select_and_scatter``,
    which XLA:CPU expands into a scatter that took as long as both
    convolutions' gradients in a profile of this model's training step. Where a
    window holds several equal maxima the gradient is split between them;
    ``nn.max_pool`` gives it all to one.
    """
    b, h, w, c = x.shape
    return x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


#: XLA:CPU options for LeNet-5's programs: no YNNPACK fusions, so XLA:CPU's own
#: (Eigen) convolutions run. With its default YNNPACK convolutions the training
#: step ran at about 0.7x the images/s (``python -m benchmarks --sections lenet``).
_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def compiler_options() -> dict[str, str]:
    """The ``compiler_options`` to ``jax.jit`` LeNet-5's programs with.

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


def count_params(params: Any) -> int:
    """The number of scalars in a parameter tree."""
    return sum(int(x.size) for x in jax.tree.leaves(params))


def init_key(seed: int) -> jax.Array:
    """The PRNG key the demo initialises the parameters with.

    An RBG key: XLA:CPU compiles LeNet-5's five threefry-based initialisers in
    about 14 s, the RBG ones in under 4 s. Shuffling uses NumPy, not this key.
    """
    return jax.random.key(seed, impl="rbg")
