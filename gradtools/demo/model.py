"""LeNet-5 in Flax Linen, with a compute dtype for mixed precision."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["DTYPES", "LeNet5", "count_params", "init_key"]

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
            x = nn.max_pool(nn.relu(x), (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(120, name="fc1", **layer)(x))
        x = nn.relu(nn.Dense(84, name="fc2", **layer)(x))
        return nn.Dense(10, name="fc3", **layer)(x).astype(jnp.float32)


def count_params(params: Any) -> int:
    """The number of scalars in a parameter tree."""
    return sum(int(x.size) for x in jax.tree.leaves(params))


def init_key(seed: int) -> jax.Array:
    """The PRNG key the demo initialises the parameters with.

    An RBG key: XLA:CPU compiles LeNet-5's five threefry-based initialisers in
    about 14 s, the RBG ones in under 4 s. Shuffling uses NumPy, not this key.
    """
    return jax.random.key(seed, impl="rbg")
