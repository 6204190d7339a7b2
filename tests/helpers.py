"""Helpers for the test suite: backends, random inputs, dtype-aware comparisons."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (runs on the GPU machine)")

FLOAT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64]

# Relative tolerances for results computed in float32 and rounded to the dtype.
RTOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-3, jnp.float64: 1e-10}
ATOL = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2, jnp.float16: 1e-3, jnp.float64: 1e-12}


def tol(dtype):
    d = jnp.dtype(dtype).type
    return {"rtol": RTOL[d], "atol": ATOL[d]}


def normal(key, shape, dtype=jnp.float32, scale=1.0):
    """Fresh standard-normal data (never zeros) of the given dtype."""
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def assert_close(actual, expected, dtype=None, **kw):
    """Compares in float64; NaN must sit where the reference has NaN, infs must match exactly."""
    dtype = dtype or actual.dtype
    opts = tol(dtype)
    opts.update(kw)
    a = np.asarray(jnp.asarray(actual).astype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32))
    e = np.asarray(jnp.asarray(expected).astype(a.dtype))
    assert a.shape == e.shape, (a.shape, e.shape)
    np.testing.assert_allclose(a, e, equal_nan=True, **opts)


def skip_f64_without_x64(dtype):
    if jnp.dtype(dtype) == jnp.float64 and not jax.config.jax_enable_x64:
        pytest.skip("float64 needs jax_enable_x64")
