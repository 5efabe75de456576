"""A GPT-2-style byte-level language model in Flax NNX, with a compute dtype."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops

__all__ = [
    "DTYPES",
    "GPT",
    "PARAM_DTYPES",
    "SIZES",
    "Block",
    "Fp8Linear",
    "Fp8Meta",
    "GPTConfig",
    "count_params",
]

#: ``--precision`` names and the compute dtypes they select. ``fp8`` computes in
#: bfloat16 but for the blocks' matmuls, which run in fp8 (:class:`Fp8Linear`).
DTYPES = {
    "fp32": jnp.float32,
    "bf16": jnp.bfloat16,
    "fp16": jnp.float16,
    "fp16-noscale": jnp.float16,
    "fp8": jnp.bfloat16,
}

#: ``--param-dtype`` names and the dtypes the parameters are kept in.
PARAM_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}

#: The nnx variable type of flax's fp8 meta: the type ``nnx.bridge`` gives the linen
#: collection ``_overwrite_with_gradient``, which gradtools' step paths overwrite.
Fp8Meta = nnx.variable_type_from_name(fp8_ops.OVERWRITE_WITH_GRADIENT, allow_register=True)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The shape of a :class:`GPT`.

    Attributes:
      vocab_size: tokens; 256 for bytes.
      block_size: the longest context, in tokens.
      num_layers: transformer blocks.
      num_heads: attention heads per block; divides ``embed_dim``.
      embed_dim: the width of the residual stream.
    """

    vocab_size: int = 256
    block_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    embed_dim: int = 64


#: ``--size`` names. ``gpt2`` is GPT-2 small's body (Radford et al., 2019);
#: with 256 byte tokens instead of 50,257 it has 85.9M parameters, not 124M.
SIZES = {
    "tiny": GPTConfig(block_size=64, num_layers=2, num_heads=4, embed_dim=64),
    "small": GPTConfig(block_size=256, num_layers=6, num_heads=6, embed_dim=384),
    "gpt2": GPTConfig(block_size=1024, num_layers=12, num_heads=12, embed_dim=768),
}


class Fp8Linear(nnx.Module):
    """``nnx.Linear`` whose matmul runs in fp8 with delayed scaling (flax's fp8 ops).

    The input and the kernel are cast to float8_e4m3 and the output gradient
    to float8_e5m2, each with a scale taken from the largest magnitude in its
    history of ``history`` steps. The scales and histories are
    :data:`Fp8Meta` variables: the backward pass returns their new values as
    their gradients, and ``gradtools.Optimizer`` writes those into the model.
    Differentiate with respect to both types,
    ``nnx.grad(f, argnums=nnx.DiffState(0, (nnx.Param, Fp8Meta)))``.

    Args:
      n_in, n_out: the input and output widths.
      kernel_init: the kernel's initializer.
      dtype: the compute dtype around the fp8 matmul.
      param_dtype: the dtype of the kernel and bias.
      rngs: random numbers for the kernel.
      history: the length of each amax history.
    """

    def __init__(self, n_in, n_out, *, kernel_init, dtype, param_dtype, rngs, history=1024):
        self.kernel = nnx.Param(kernel_init(rngs.params(), (n_in, n_out), param_dtype))
        self.bias = nnx.Param(jnp.zeros((n_out,), param_dtype))
        self.dtype = dtype
        # a new array for each (the step donates them: one buffer may not back two)
        scale = lambda: Fp8Meta(jnp.ones((1,), jnp.float32))  # noqa: E731
        amax_history = lambda: Fp8Meta(jnp.zeros((history,), jnp.float32))  # noqa: E731
        self.input_scale, self.input_amax_history = scale(), amax_history()
        self.kernel_scale, self.kernel_amax_history = scale(), amax_history()
        self.output_grad_scale, self.output_grad_amax_history = scale(), amax_history()

    def __call__(self, x: jax.Array) -> jax.Array:
        x, kernel = x.astype(self.dtype), self.kernel[...].astype(self.dtype)
        y = fp8_ops.fp8_scaled_dot_general(
            x,
            kernel,
            (((x.ndim - 1,), (0,)), ((), ())),
            preferred_element_type=self.dtype,
            lhs_scale=self.input_scale[...],
            rhs_scale=self.kernel_scale[...],
            grad_scale=self.output_grad_scale[...],
            lhs_amax_history=self.input_amax_history[...],
            rhs_amax_history=self.kernel_amax_history[...],
            grad_amax_history=self.output_grad_amax_history[...],
            quantize_compute_type=self.dtype,
        )
        return jnp.asarray(y) + self.bias[...].astype(self.dtype)


class Block(nnx.Module):
    """A pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``.

    The attention is causal, of ``num_heads`` heads; the MLP is ``4 *
    embed_dim`` wide with GELU. The two projections back into the residual
    stream start with std ``0.02 / sqrt(2 * num_layers)``, as GPT-2's do.
    """

    def __init__(
        self, config: GPTConfig, *, dtype: Any, param_dtype: Any, fp8: bool, rngs: nnx.Rngs
    ):
        d, std = config.embed_dim, 0.02
        residual_std = std / math.sqrt(2 * config.num_layers)
        linear = Fp8Linear if fp8 else nnx.Linear

        def dense(n_in: int, n_out: int, init_std: float) -> nnx.Module:
            init = nnx.initializers.normal(init_std)
            return linear(
                n_in, n_out, kernel_init=init, dtype=dtype, param_dtype=param_dtype, rngs=rngs
            )

        def norm() -> nnx.LayerNorm:
            return nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        self.num_heads = config.num_heads
        self.ln1 = norm()
        self.qkv = dense(d, 3 * d, std)
        self.attn_proj = dense(d, d, residual_std)
        self.ln2 = norm()
        self.fc = dense(d, 4 * d, std)
        self.mlp_proj = dense(4 * d, d, residual_std)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        heads = (b, t, self.num_heads, d // self.num_heads)
        q, k, v = q.reshape(heads), k.reshape(heads), v.reshape(heads)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(heads[-1])
        causal = jnp.tril(jnp.ones((t, t), bool))  # query i sees keys 0..i
        scores = jnp.where(causal, scores.astype(jnp.float32), -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # softmax in float32
        y = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        x = x + self.attn_proj(y.reshape(b, t, d))
        return x + self.mlp_proj(nnx.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
    """A GPT-2-style decoder: token and position embeddings, blocks, a tied read-out.

    ``tokens (B, T) -> wte + wpe -> num_layers x Block -> ln_f -> wte.attend``:
    the logits are the final hidden states dotted with the token embedding
    (tied weights, no separate output matrix). Weights start as GPT-2's:
    normal with std 0.02, biases 0, LayerNorms 1 and 0.

    Mixed precision is two arguments, as in any Flax layer: parameters are
    kept in ``param_dtype`` (the master weights) and the layers compute in
    ``dtype``. The logits come back float32, so the loss is float32 whatever
    the precision.

    Parameter names (``gradtools.path_names(nnx.state(model, nnx.Param))``)
    say what each is: ``wte/embedding``, ``wpe/embedding``,
    ``blocks/0/ln1/scale``, ``blocks/0/qkv/kernel``, ``blocks/0/attn_proj/bias``,
    ``blocks/0/fc/kernel``, ``blocks/0/mlp_proj/kernel``, ``ln_f/bias``, ...

    Args:
      config: the shape.
      dtype: the compute dtype: ``jnp.float32``, ``jnp.bfloat16`` or
        ``jnp.float16``.
      param_dtype: the parameters' dtype (float32, or bfloat16 to keep no
        float32 master copy).
      fp8: run the blocks' matmuls in fp8 (:class:`Fp8Linear`).
      rngs: the initialisation's random numbers (``nnx.Rngs(seed)``).

    Example:
      >>> model = GPT(SIZES["tiny"], dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
      >>> logits = model(jnp.zeros((2, 16), jnp.int32))
      >>> logits.shape, logits.dtype
      ((2, 16, 256), dtype('float32'))

    References:
      Radford et al., `Language Models are Unsupervised Multitask Learners
      <https://cdn.openai.com/better-language-models/language_models_are_unsupervised_multitask_learners.pdf>`_,
      2019; Karpathy, `nanoGPT <https://github.com/karpathy/nanoGPT>`_.
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        fp8: bool = False,
        rngs: nnx.Rngs,
    ):
        d = config.embed_dim
        embed = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        init = nnx.initializers.normal(0.02)
        self.config = config
        self.wte = nnx.Embed(config.vocab_size, d, embedding_init=init, **embed)
        self.wpe = nnx.Embed(config.block_size, d, embedding_init=init, **embed)
        self.blocks = nnx.List(
            [
                Block(config, dtype=dtype, param_dtype=param_dtype, fp8=fp8, rngs=rngs)
                for _ in range(config.num_layers)
            ]
        )
        self.ln_f = nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Maps int tokens ``(B, T)``, ``T <= block_size``, to float32 logits ``(B, T, vocab)``."""
        x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.wte.attend(self.ln_f(x)).astype(jnp.float32)


def count_params(model: nnx.Module) -> int:
    """The number of scalars in the parameters of ``model``."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
