"""The CPU twins on XLA's intra-op thread pool (cc/common/cpu_parallel.h): rows, outer slices and
query rows are split between the pool's threads in chunks, and layer_norm's parameter gradients
are summed over a split of the rows that depends on the shape alone. JAXOPS_CPU_THREADS=1, read on
every call, keeps each twin on the calling thread; every result here must match that one bit for
bit (a lost, doubled or overlapping chunk, or a thread-dependent sum, shows), and the references.
The shapes split into many chunks whose boundaries fall off every power of two. (On one core the
pool has one thread and both sides run alone; CI and the development machine have two.)"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops
from helpers import ON_GPU, assert_close, normal
from test_batch_norm import ref_bn
from test_layer_norm import ln_ref, rms_ref

pytestmark = pytest.mark.skipif(ON_GPU, reason="the CPU twins' threading (the GPU runs CUDA kernels)")


def one_thread(fn, *args):
    """fn(*args) with JAXOPS_CPU_THREADS=1."""
    os.environ["JAXOPS_CPU_THREADS"] = "1"
    try:
        return jax.block_until_ready(fn(*args))
    finally:
        del os.environ["JAXOPS_CPU_THREADS"]


def same_bits(fn, *args):
    """fn(*args) on the pool and on one thread, bit for bit; returns the pool's result."""
    pooled = jax.block_until_ready(fn(*args))
    alone = one_thread(fn, *args)
    for a, b in zip(jax.tree_util.tree_leaves(pooled), jax.tree_util.tree_leaves(alone)):
        np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))
    return pooled


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("log", [False, True])
def test_softmax_threads(key, dtype, log):
    k1, k2, k3 = jax.random.split(key, 3)
    x = normal(k1, (3001, 333), dtype)
    g = normal(k2, (3001, 333), dtype)
    keep = jax.random.bernoulli(k3, 0.8, (3001, 333))
    op, ref = (jaxops.log_softmax, jax.nn.log_softmax) if log else (jaxops.softmax, jax.nn.softmax)
    f = jax.jit(lambda x, g: jax.vjp(lambda x: op(x, where=keep), x)[1](g)[0])
    y = same_bits(jax.jit(lambda x: op(x, where=keep)), x)
    assert_close(y, ref(x.astype(jnp.float32), where=keep), dtype)
    same_bits(f, x, g)
    same_bits(jax.jit(lambda x, g: jax.vjp(op, x)[1](g)[0]), x, g)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_norm_threads(key, dtype):
    # 5003 rows of 77: eight backward parts a group, their edges off the float runs of 8 rows.
    k1, k2, k3 = jax.random.split(key, 3)
    x = normal(k1, (5003, 77), dtype) + jnp.asarray(2.0, dtype)
    g = normal(k2, (5003, 77), dtype)
    scale = 1 + 0.1 * normal(k3, (77,), dtype)
    bias = 0.1 * normal(k3, (77,), dtype)

    def both(x, s, b, g):
        y, vjp = jax.vjp(jaxops.layer_norm, x, s, b)
        r, vjp2 = jax.vjp(jaxops.rms_norm, x, s)
        return y, vjp(g), r, vjp2(g)

    y, grads, r, rgrads = same_bits(jax.jit(both), x, scale, bias, g)
    assert_close(y, ln_ref(x, scale, bias), dtype)
    assert_close(r, rms_ref(x, scale), dtype)
    ref_grads = jax.vjp(lambda x, s, b: ln_ref(x.astype(jnp.float32), s.astype(jnp.float32), b.astype(jnp.float32)),
                        x, scale, bias)[1](g.astype(jnp.float32))
    for got, want in zip(grads, ref_grads):
        assert_close(got, want.astype(dtype), dtype, rtol=0.05, atol=0.05)
    # Per-example parameters (three groups: the groups split into parts too).
    xs, gs = x[:3 * 1601].reshape(3, 1601, 77), g[:3 * 1601].reshape(3, 1601, 77)
    s3, b3 = jnp.stack([scale, bias, scale]), jnp.stack([bias, scale, bias])
    same_bits(jax.jit(lambda x, s, b, g: jax.vjp(jax.vmap(jaxops.layer_norm), x, s, b)[1](g)), xs, s3, b3, gs)
    # 16 groups: one range a group, each piece writing its own group's dscale / dbias.
    x16, g16 = x[:16 * 301].reshape(16, 301, 77), g[:16 * 301].reshape(16, 301, 77)
    s16, b16 = jnp.tile(scale, (16, 1)), jnp.tile(bias, (16, 1))
    grouped = jax.jit(lambda x, s, b, g: jax.vjp(jax.vmap(jaxops.layer_norm), x, s, b)[1](g))
    got = same_bits(grouped, x16, s16, b16, g16)
    f32 = lambda *a: [v.astype(jnp.float32) for v in a]
    want = jax.vjp(jax.vmap(lambda x, s, b: ln_ref(*f32(x, s, b))), x16, s16, b16)[1](g16.astype(jnp.float32))
    for a, w in zip(got, want):
        assert_close(a, w.astype(dtype), dtype, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_relu_threads(key, dtype):
    # 1025 columns: each row's mask ends in a partial word.
    k1, k2 = jax.random.split(key)
    x = normal(k1, (777, 1025), dtype)
    g = normal(k2, (777, 1025), dtype)
    y, dx = same_bits(jax.jit(lambda x, g: (jaxops.relu(x), jax.vjp(jaxops.relu, x)[1](g)[0])), x, g)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.nn.relu(x)))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(jnp.where(x > 0, g, 0)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reductions_threads(key, dtype):
    x = normal(key, (37, 301, 29), dtype)
    for name in ("sum", "max", "logsumexp", "argmax"):
        for axis in (-1, 1):  # 37 x 301 outer slices of one row, then 37 of 301 x 29
            got = same_bits(jax.jit(lambda x: getattr(jaxops, name)(x, axis=axis)), x)
            want = getattr(jnp, name)(x.astype(jnp.float32), axis=axis) if name != "logsumexp" else \
                jax.nn.logsumexp(x.astype(jnp.float32), axis=axis)
            if name == "argmax":
                np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=axis)))
            else:
                assert_close(got, want.astype(dtype), dtype, rtol=0.02, atol=0.02)


REDUCTIONS = ("sum", "mean", "max", "min", "logsumexp", "argmax", "argmin")


def reduction_ref(name, x, axis):
    """The reference in float32: numpy's for the extrema and their indices (XLA:CPU's max of
    columns dropped a NaN, jax 0.10), JAX's for the rest."""
    x32 = x.astype(jnp.float32)
    if name in ("max", "min", "argmax", "argmin"):
        return getattr(np, name)(np.asarray(x32), axis=axis)
    return jax.nn.logsumexp(x32, axis=axis) if name == "logsumexp" else getattr(jnp, name)(x32, axis=axis)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape, axis", [((2100003,), -1), ((1031, 2039), None), ((70001, 37), 0), ((9001, 257), 0)])
def test_reduction_slice_threads(key, dtype, shape, axis):
    """One slice (a long row, the whole array, the columns of a matrix) split between threads in
    pieces of a power of two blocks / leaves (3 pieces here: at least 1M elements each, 32K for
    logsumexp): the serial answer bit for bit. The planted values sit in different pieces: a tie
    of the max (the first index wins), and NaNs (the first one wins argmax) in a second copy; the
    columns also get -inf and +inf ones."""
    x = normal(key, shape, dtype)
    if axis == 0:  # columns: planted along the rows
        n = shape[0]
        x = x.at[n // 5, 1].set(9).at[n * 9 // 10, 1].set(9).at[:, 2].set(-jnp.inf).at[n // 3, 3].set(jnp.inf)
        nans = x.at[n // 3, 5].set(jnp.nan).at[n * 19 // 20, 5].set(jnp.nan).at[n * 19 // 20, 6].set(jnp.nan)
    else:  # one row of every element
        flat = x.reshape(-1)
        size = flat.size
        x = flat.at[size // 5].set(9).at[size * 9 // 10].set(9).reshape(shape)
        nans = flat.at[size // 3].set(jnp.nan).at[size * 19 // 20].set(jnp.nan).reshape(shape)
    for name in REDUCTIONS:
        f = jax.jit(lambda x: getattr(jaxops, name)(x, axis=axis))
        for data in (x, nans):
            got = same_bits(f, data)
            want = reduction_ref(name, data, axis)
            if name.startswith("arg"):
                np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)
            else:
                assert_close(got, jnp.asarray(want).astype(dtype), dtype, rtol=0.02, atol=0.02, err_msg=name)


def test_knn_threads(key):
    k1, k2 = jax.random.split(key)
    q = normal(k1, (2049, 16), jnp.float32)
    r = normal(k2, (3001, 16), jnp.float32)
    d, i = same_bits(jax.jit(lambda q, r: jaxops.knn(q, r, 7)), q, r)
    full = jnp.sum((q[:, None, :] - r[None, :, :]) ** 2, axis=-1)
    assert_close(d, jnp.sort(full, axis=1)[:, :7], rtol=1e-4, atol=1e-4)
    assert_close(jnp.take_along_axis(full, i, axis=1), d, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("channels", [24, 77])
def test_batch_norm_threads(key, dtype, channels):
    # 24 channels: blocks of 4k rows keep each block's mask words whole; 77: of 32k rows. Both
    # with a residual and the relu mask, forward and backward, and a vmapped (grouped) call.
    k1, k2, k3, k4 = jax.random.split(key, 4)
    x = normal(k1, (3, 1009, channels), dtype) + jnp.asarray(1.0, dtype)
    res = normal(k2, x.shape, dtype)
    g = normal(k3, x.shape, dtype)
    scale = 1 + 0.1 * normal(k4, (channels,), jnp.float32)
    bias = 0.1 * normal(k4, (channels,), jnp.float32)

    def run(x, res, g):
        fn = lambda x, s, b, r: jaxops.batch_norm(x, s, b, residual=r, activation="relu")[0]
        y, vjp = jax.vjp(fn, x, scale, bias, res)
        return y, vjp(g), jax.vmap(lambda x: jaxops.batch_norm(x, scale, bias, activation="relu")[0])(x)

    y, grads, yv = same_bits(jax.jit(run), x, res, g)
    want = ref_bn(x, scale, bias, residual=res, activation="relu")[0]
    assert_close(y, want, dtype, rtol=0.05, atol=0.05)
    want_grads = jax.vjp(lambda x, s, b, r: ref_bn(x, s, b, residual=r, activation="relu")[0],
                         x, scale, bias, res)[1](g)
    for got, w in zip(grads, want_grads):
        assert_close(got, w, dtype, rtol=0.1, atol=0.1)
    assert_close(yv[1], ref_bn(x[1], scale, bias, activation="relu")[0], dtype, rtol=0.05, atol=0.05)
