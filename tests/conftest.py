"""Shared test setup: four CPU devices for sharding tests, dtype helpers."""

import jax

# Must run before JAX creates its backends (the equinox way).
jax.config.update("jax_num_cpu_devices", 4)

import os  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI sets HYPOTHESIS_PROFILE=ci: the property tests then draw the same examples
# on every run (so a red run reproduces and a green one stays green) and keep no
# example database.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def strict_dtypes():
    """Runs a test under strict dtype promotion (no silent up-casts)."""
    with jax.numpy_dtype_promotion("strict"):
        yield
