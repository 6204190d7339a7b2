"""Back-to-back jaxops kernels overlap on sm_90+ (programmatic dependent launch).

Each kernel is scheduled while the previous one drains and must wait for it before touching
memory. A kernel that forgot to wait would read the previous op's output before it is written
(XLA reuses buffers, so it would see stale data), so chains of dependent ops in one jit, every
kernel family back to back, must equal the same ops dispatched one at a time, bit for bit, and the
float32 chain must match its pure-JAX reference. test_cuda_graphs compares every op's results with
the overlap switched off (JAXOPS_PDL=0) in another process.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops
from helpers import assert_close, gpu_only, normal

pytestmark = gpu_only

ROWS, COLS = 4096, 1024  # 4M elements: every kernel runs several waves, so tails overlap


def _params(key, dtype):
    k1, k2 = jax.random.split(key)
    return normal(k1, (COLS,), dtype, 0.5) + 1, normal(k2, (COLS,), dtype, 0.1)


def _chain_steps(lib):
    """The forward chain as (name, fn(previous, scale, bias)) steps, for jaxops or the reference."""
    return [
        ("softmax", lambda v, s, b: lib["softmax"](v)),
        ("layer_norm", lambda v, s, b: lib["layer_norm"](v, s, b)),
        ("relu", lambda v, s, b: lib["relu"](v)),
        ("log_softmax", lambda v, s, b: lib["log_softmax"](v)),
        ("rms_norm", lambda v, s, b: lib["rms_norm"](v, s)),
        ("batch_norm", lambda v, s, b: lib["batch_norm"](v, s, b)),
    ]


def _jaxops_lib():
    return {
        "softmax": jaxops.softmax, "log_softmax": jaxops.log_softmax, "relu": jaxops.relu,
        "layer_norm": lambda v, s, b: jaxops.layer_norm(v, s, b),
        "rms_norm": lambda v, s: jaxops.rms_norm(v, s),
        "batch_norm": lambda v, s, b: jaxops.batch_norm(v, s, b, activation="relu")[0],
    }


def _reference_lib():
    def layer_norm(v, s, b):
        v = v.astype(jnp.float32)
        mu = v.mean(-1, keepdims=True)
        var = ((v - mu) ** 2).mean(-1, keepdims=True)
        return (v - mu) * jax.lax.rsqrt(var + 1e-5) * s + b

    def rms_norm(v, s):
        v = v.astype(jnp.float32)
        return v * jax.lax.rsqrt((v * v).mean(-1, keepdims=True) + 1e-6) * s

    def batch_norm(v, s, b):
        v = v.astype(jnp.float32)
        mu = v.mean(0)
        var = ((v - mu) ** 2).mean(0)
        return jax.nn.relu((v - mu) * jax.lax.rsqrt(var + 1e-5) * s + b)

    return {"softmax": jax.nn.softmax, "log_softmax": jax.nn.log_softmax, "relu": jax.nn.relu,
            "layer_norm": layer_norm, "rms_norm": rms_norm, "batch_norm": batch_norm}


def _reduction_steps(lib_sum, lib_max, lib_argmax, lib_lse):
    """The reductions that end the chain, as name -> fn(previous)."""
    return {"sum_rows": lambda v: lib_sum(v, axis=-1), "sum_cols": lambda v: lib_sum(v, axis=0),
            "max_all": lib_max, "argmax_rows": lambda v: lib_argmax(v, axis=-1),
            "logsumexp_rows": lambda v: lib_lse(v, axis=-1)}


JAXOPS_REDUCTIONS = _reduction_steps(jaxops.sum, jaxops.max, jaxops.argmax, jaxops.logsumexp)


@jax.jit
def _fused_chain(x, scale, bias):
    out, v = {}, x
    for name, step in _chain_steps(_jaxops_lib()):
        v = out[name] = step(v, scale, bias)
    out.update({name: fn(v) for name, fn in JAXOPS_REDUCTIONS.items()})
    return out


def _one_at_a_time(x, scale, bias):
    """The same ops, each its own dispatch and finished before the next starts: nothing overlaps."""
    out, v = {}, x
    for name, step in _chain_steps(_jaxops_lib()):
        v = out[name] = jax.block_until_ready(jax.jit(step)(v, scale, bias))
    for name, fn in JAXOPS_REDUCTIONS.items():
        out[name] = jax.block_until_ready(jax.jit(fn)(v))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chain_in_one_jit_equals_one_at_a_time(seed, dtype):
    key = jax.random.PRNGKey(seed)
    kx, kp = jax.random.split(key)
    x = normal(kx, (ROWS, COLS), dtype, 3.0)
    scale, bias = _params(kp, dtype)
    fused = _fused_chain(x, scale, bias)
    serial = _one_at_a_time(x, scale, bias)
    for name in serial:
        np.testing.assert_array_equal(np.asarray(fused[name].astype(jnp.float32)),
                                      np.asarray(serial[name].astype(jnp.float32)), err_msg=name)


def test_chain_matches_reference():
    kx, kp = jax.random.split(jax.random.PRNGKey(7))
    x = normal(kx, (ROWS, COLS), jnp.float32, 3.0)
    scale, bias = _params(kp, jnp.float32)
    fused = _fused_chain(x, scale, bias)
    previous = x
    # Each step from jaxops' previous result; a race gives O(1) errors, rounding (layer_norm of
    # peaked softmax rows) up to 4e-4.
    for name, step in _chain_steps(_reference_lib()):
        assert_close(fused[name], step(previous, scale, bias), rtol=1e-3, atol=1e-3, err_msg=name)
        previous = fused[name]
    ref = _reduction_steps(jnp.sum, jnp.max, jnp.argmax, jax.nn.logsumexp)
    for name, fn in ref.items():
        want = fn(fused["batch_norm"])
        if name == "argmax_rows":
            np.testing.assert_array_equal(fused[name], want, err_msg=name)
        else:
            assert_close(fused[name], want, rtol=1e-5, atol=1e-4, err_msg=name)


def _loss_vjp(x, scale, bias, w):
    """Backward kernels back to back: layer_norm's two kernels, then softmax's."""
    f = lambda x, s, b: jaxops.layer_norm(jaxops.softmax(x), s, b)
    _, vjp = jax.vjp(f, x, scale, bias)
    return vjp(w)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_backward_chain_equals_one_at_a_time(dtype):
    kx, kp, kw = jax.random.split(jax.random.PRNGKey(3), 3)
    x = normal(kx, (ROWS, COLS), dtype, 3.0)
    scale, bias = _params(kp, dtype)
    w = normal(kw, (ROWS, COLS), dtype)
    fused = jax.jit(_loss_vjp)(x, scale, bias, w)
    a, softmax_vjp = jax.vjp(jax.jit(jaxops.softmax), x)
    jax.block_until_ready(a)
    _, ln_vjp = jax.vjp(jax.jit(lambda a, s, b: jaxops.layer_norm(a, s, b)), a, scale, bias)
    da, dscale, dbias = jax.block_until_ready(ln_vjp(w))
    (dx,) = softmax_vjp(da)
    for name, got, want in (("dx", fused[0], dx), ("dscale", fused[1], dscale), ("dbias", fused[2], dbias)):
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)),
                                      err_msg=name)
