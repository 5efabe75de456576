"""Doctest namespace for `pytest --doctest-modules gradtools`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradtools


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace.update(gradtools=gradtools, jax=jax, jnp=jnp, np=np)
