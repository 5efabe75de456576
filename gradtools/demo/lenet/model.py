"""LeNet-5 in Flax Linen, with a compute dtype for mixed precision."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["DTYPES", "LeNet5", "count_params"]

#: ``--precision`` names and the compute dtypes they select.
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


class LeNet5(nn.Module):
    """LeNet-5 (LeCun et al., 1998) with ReLU and max pooling.

    ``conv1`` 6@5x5 valid -> max pool 2 -> ``conv2`` 16@5x5 valid -> max pool 2
    -> ``fc1`` 120 -> ``fc2`` 84 -> ``fc3`` 10, ReLU after every layer but the
    last: 61,706 parameters for 32x32x1 inputs.

    Mixed precision is two attributes, as in any Flax layer: the parameters
    are kept in ``param_dtype`` (the master weights) and the layers compute in
    ``dtype``. The logits come back as float32, so the loss is computed in
    float32 whatever the precision.

    Attributes:
      dtype: the compute dtype: ``jnp.float32``, ``jnp.bfloat16`` or
        ``jnp.float16``.
      param_dtype: the parameters' dtype (float32).

    Example:
      >>> model = LeNet5(dtype=jnp.bfloat16)
      >>> variables = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 1)))
      >>> logits = model.apply(variables, jnp.zeros((8, 32, 32, 1)))
      >>> logits.shape, logits.dtype
      ((8, 10), dtype('float32'))

    References:
      LeCun et al., `Gradient-based learning applied to document recognition
      <https://doi.org/10.1109/5.726791>`_, 1998.
    """

    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps images of shape ``(batch, 32, 32, 1)`` to float32 logits ``(batch, 10)``."""
        layer = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        x = x.astype(self.dtype)
        x = nn.Conv(features=6, kernel_size=(5, 5), padding="VALID", name="conv1", **layer)(x)
        x = nn.max_pool(nn.relu(x), window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=16, kernel_size=(5, 5), padding="VALID", name="conv2", **layer)(x)
        x = nn.max_pool(nn.relu(x), window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        x = nn.relu(nn.Dense(features=120, name="fc1", **layer)(x))
        x = nn.relu(nn.Dense(features=84, name="fc2", **layer)(x))
        x = nn.Dense(features=10, name="fc3", **layer)(x)
        return x.astype(jnp.float32)


def count_params(params: Any) -> int:
    """The number of scalars in a parameter tree."""
    return sum(int(x.size) for x in jax.tree.leaves(params))
