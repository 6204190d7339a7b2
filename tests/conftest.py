"""Shared fixtures. Tests run on JAX's default backend: the CPU in CI, the GPU on a GPU machine."""
import os

import jax
import pytest

jax.config.update("jax_enable_x64", os.environ.get("JAXOPS_TEST_X64", "1") == "1")


@pytest.fixture
def key(request):
    """A fresh PRNG key per test, different for every test id."""
    return jax.random.key(abs(hash(request.node.nodeid)) % (2**31))
