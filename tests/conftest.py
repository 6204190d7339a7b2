"""Shared fixtures. Tests run on JAX's default backend: the CPU in CI, the GPU on a GPU machine."""
import os
import zlib

import jax
import pytest

jax.config.update("jax_enable_x64", os.environ.get("JAXOPS_TEST_X64", "1") == "1")


@pytest.fixture
def key(request):
    """A PRNG key per test, different for every test id and the same on every run (crc32, not
    hash(), which Python salts per process and would make failures unreproducible)."""
    return jax.random.key(zlib.crc32(request.node.nodeid.encode()))
