"""Shared test setup: four CPU devices for sharding tests, dtype helpers."""

import jax

# Must run before JAX creates its backends (the equinox way).
jax.config.update("jax_num_cpu_devices", 4)

import pytest  # noqa: E402


@pytest.fixture
def strict_dtypes():
    """Runs a test under strict dtype promotion (no silent up-casts)."""
    with jax.numpy_dtype_promotion("strict"):
        yield
