"""The space-to-depth LeNet-5 of the benchmarks against Flax's own layers and the demo's model."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.lenet_s2d import ConvReluPool
from benchmarks.lenet_s2d import LeNet5S2D
from benchmarks.lenet_s2d import compiler_options
from gradtools.demo import LeNet5

pytestmark = pytest.mark.slow  # CI runs these after the README's command


def _assert_trees_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


class _FlaxConvReluPool(nn.Module):
    """The reference: flax's own convolution, ReLU and max pooling."""

    features: int
    kernel_size: int = 5

    @nn.compact
    def __call__(self, x):
        k = self.kernel_size
        x = nn.Conv(self.features, (k, k), padding="VALID", name="conv")(x)
        return nn.max_pool(nn.relu(x), (2, 2), strides=(2, 2))


_full_float32 = jax.default_matmul_precision("highest")


@pytest.mark.parametrize(
    "kernel_size, shape, features",
    [(5, (3, 32, 32, 1), 6), (5, (3, 14, 14, 6), 16), (3, (2, 10, 12, 3), 4), (1, (2, 4, 6, 2), 3)],
)
@_full_float32  # GPUs convolve float32 in TF32 by default: two ways of it differ by ~1e-3
def test_conv_relu_pool_matches_flax_conv_relu_max_pool(kernel_size, shape, features):
    # LeNet-5's two layers, and other kernel sizes and non-square inputs. Continuous
    # random values have no ties in a pooling window, where the gradients agree.
    x = jax.random.normal(jax.random.key(1), shape)
    ref = _FlaxConvReluPool(features, kernel_size)
    ours = ConvReluPool(features, kernel_size)
    params = ref.init(jax.random.key(0), x)["params"]["conv"]
    params = {**params, "bias": jax.random.normal(jax.random.key(2), (features,))}
    ours_shapes = jax.eval_shape(ours.init, jax.random.key(0), x)["params"]
    assert jax.tree.map(jnp.shape, ours_shapes) == jax.tree.map(jnp.shape, params)

    def value_and_grads(apply, variables):
        cotangent = jax.random.normal(jax.random.key(3), apply(variables, x).shape)
        loss = lambda v, x: jnp.vdot(apply(v, x), cotangent)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, (0, 1)))(variables, x), apply(variables, x)

    (r, (r_params, r_x)), r_out = value_and_grads(ref.apply, {"params": {"conv": params}})
    (o, (o_params, o_x)), o_out = value_and_grads(ours.apply, {"params": params})
    np.testing.assert_allclose(o_out, r_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o, r, rtol=1e-5)
    for name in ("kernel", "bias"):
        np.testing.assert_allclose(
            o_params["params"][name], r_params["params"]["conv"][name], rtol=1e-4, atol=1e-4
        )
    np.testing.assert_allclose(o_x, r_x, rtol=1e-4, atol=1e-5)


def test_conv_relu_pool_splits_the_gradient_between_equal_maxima():
    # A 1x1 kernel of 1 and no bias: the output is max(relu(window)).
    layer = ConvReluPool(1, kernel_size=1)
    params = {"kernel": jnp.ones((1, 1, 1, 1)), "bias": jnp.zeros((1,))}
    tie = jnp.array([[2.0, 2.0], [0.0, -1.0]]).reshape(1, 2, 2, 1)
    out, grad = jax.value_and_grad(lambda x: layer.apply({"params": params}, x).sum())(tie)
    assert out == 2.0
    np.testing.assert_array_equal(grad.ravel(), [0.5, 0.5, 0.0, 0.0])


@pytest.mark.parametrize(
    "kernel_size, shape, match",
    [
        (4, (1, 8, 8, 1), "kernel_size must be odd and positive, got 4"),
        (0, (1, 8, 8, 1), "kernel_size must be odd and positive, got 0"),
        (5, (1, 9, 8, 1), r"even and at least kernel_size=5, got \(9, 8\)"),
        (5, (1, 4, 4, 1), r"even and at least kernel_size=5, got \(4, 4\)"),
    ],
)
def test_conv_relu_pool_rejects_what_it_cannot_compute(kernel_size, shape, match):
    with pytest.raises(ValueError, match=match):
        ConvReluPool(2, kernel_size).init(jax.random.key(0), jnp.zeros(shape))


@_full_float32
def test_space_to_depth_lenet5_initialises_and_computes_as_the_demos():
    x = jax.random.normal(jax.random.key(4), (4, 32, 32, 1))
    ours, ref = LeNet5S2D().init(jax.random.key(0), x[:1]), LeNet5().init(jax.random.key(0), x[:1])
    _assert_trees_equal(ours, ref)
    np.testing.assert_allclose(LeNet5S2D().apply(ours, x), LeNet5().apply(ref, x), atol=1e-5)


def test_compiler_options_compile_the_variant_to_the_same_logits():
    options = compiler_options()
    assert options == (
        {"xla_cpu_experimental_ynn_fusion_type": ""} if jax.default_backend() == "cpu" else {}
    )
    model = LeNet5S2D()
    params = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 1)))
    x = jax.random.normal(jax.random.key(3), (8, 32, 32, 1))
    tuned = jax.jit(model.apply, compiler_options=options)(params, x)
    default = jax.jit(model.apply)(params, x)
    np.testing.assert_allclose(tuned, default, rtol=1e-5, atol=1e-5)
