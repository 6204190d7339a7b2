"""Property-based tests: every family against its pure-JAX / NumPy reference on shapes, axes,
dtypes, masks and special values that hypothesis draws, beyond the hand-picked cases of the other
files (odd extents next to 1, several axes at once, NaN and infinities anywhere).

The examples are derandomized (the same on every run, like the crc32 keys of conftest.py);
JAXOPS_FUZZ_EXAMPLES raises their number, e.g. for a longer run on the GPU machine."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxops
from helpers import assert_close
from test_knn import check_knn, ref_vote
from test_reductions import _check_value, _f64, _np_ref

EXAMPLES = int(os.environ.get("JAXOPS_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16])


def _extent():
    """Mostly small extents (1 and odd ones included), sometimes past a 16-byte pack or a warp row."""
    return st.one_of(st.integers(1, 9), st.integers(10, 70), st.sampled_from([127, 255, 1023, 1025, 2049]))


@st.composite
def arrays(draw, min_ndim=1, max_ndim=3, max_size=1 << 16):
    """(numpy float64 data, dtype): normal data of a drawn scale, optionally with repeated values
    (ties) and a few NaN / +-inf at drawn positions."""
    ndim = draw(st.integers(min_ndim, max_ndim))
    shape = tuple(draw(_extent()) for _ in range(ndim))
    while int(np.prod(shape)) > max_size:
        shape = tuple(max(1, s // 2) for s in shape)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = draw(st.sampled_from([0.5, 3.0, 40.0])) * rng.standard_normal(shape)
    if draw(st.booleans()):
        x = np.round(x)  # ties
    specials = draw(st.integers(0, 3))
    if specials and x.size:
        flat = x.reshape(-1)
        flat[rng.integers(0, x.size, specials)] = rng.choice([np.nan, np.inf, -np.inf], specials)
    return x, draw(DTYPES)


@st.composite
def axes(draw, ndim):
    """None, one axis (negative too) or a tuple of distinct axes in any order."""
    kind = draw(st.sampled_from(["none", "int", "tuple"]))
    if kind == "none" or ndim == 0:
        return None
    if kind == "int":
        return draw(st.integers(-ndim, ndim - 1))
    picked = draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True))
    return tuple(a - ndim if draw(st.booleans()) else a for a in picked)


@FUZZ
@given(data=st.data(), op=st.sampled_from(["sum", "mean", "max", "min", "logsumexp"]))
def test_reductions(data, op):
    x64, dtype = data.draw(arrays())
    x = jnp.asarray(x64.astype(np.float32)).astype(dtype)
    axis = data.draw(axes(x.ndim))
    keepdims = data.draw(st.booleans())
    got = getattr(jaxops, op)(x, axis, keepdims)
    ref = _np_ref(op, _f64(x), axis, keepdims)
    fin = np.isfinite(ref) & np.all(np.isfinite(_f64(x)))
    if fin.all():
        _check_value(op, got, x, axis, keepdims)
    else:  # specials: NaN where the reference has NaN, infinities exact
        g = _f64(got)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(ref), err_msg=f"{op} {x.shape} {axis}")
        inf = np.isinf(ref)
        np.testing.assert_array_equal(g[inf], ref[inf], err_msg=f"{op} {x.shape} {axis}")


@FUZZ
@given(data=st.data(), op=st.sampled_from(["argmax", "argmin"]))
def test_arg_reductions(data, op):
    x64, dtype = data.draw(arrays())
    x = jnp.asarray(x64.astype(np.float32)).astype(dtype)
    axis = data.draw(st.one_of(st.none(), st.integers(-x.ndim, x.ndim - 1)))
    keepdims = data.draw(st.booleans())
    got = getattr(jaxops, op)(x, axis, keepdims)
    ref = _np_ref(op, _f64(x), axis, keepdims)  # numpy: first index on ties, the first NaN
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), ref, err_msg=f"{op} {x.shape} {axis}")


@FUZZ
@given(data=st.data(), name=st.sampled_from(["softmax", "log_softmax"]))
def test_softmax(data, name):
    x64, dtype = data.draw(arrays())
    x = jnp.asarray(x64.astype(np.float32)).astype(dtype)
    axis = data.draw(st.one_of(st.integers(-x.ndim, x.ndim - 1),
                               st.lists(st.integers(0, x.ndim - 1), min_size=1, max_size=x.ndim,
                                        unique=True).map(tuple)))
    where = None
    if data.draw(st.booleans()):
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        where = jnp.asarray(rng.uniform(size=x.shape) < data.draw(st.sampled_from([0.1, 0.7, 1.0])))
    got = getattr(jaxops, name)(x, axis=axis, where=where)
    ref = getattr(jax.nn, name)(x.astype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32),
                                axis=axis, where=where)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert_close(got, ref, dtype)


@FUZZ
@given(data=st.data(), rms=st.booleans())
def test_layer_and_rms_norm(data, rms):
    x64, dtype = data.draw(arrays(min_ndim=1, max_ndim=3))
    x = jnp.asarray(x64.astype(np.float32)).astype(dtype)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    c = x.shape[-1]
    scale = jnp.asarray(rng.standard_normal(c).astype(np.float32)).astype(dtype)
    bias = jnp.asarray(rng.standard_normal(c).astype(np.float32)).astype(dtype)
    acc = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    xs, ss, bs = x.astype(acc), scale.astype(acc), bias.astype(acc)
    if rms:
        got = jaxops.rms_norm(x, scale, epsilon=1e-6)
        ref = xs * jax.lax.rsqrt(jnp.mean(xs * xs, -1, keepdims=True) + 1e-6) * ss
    else:
        got = jaxops.layer_norm(x, scale, bias, epsilon=1e-5)
        mean = jnp.mean(xs, -1, keepdims=True)
        ref = (xs - mean) * jax.lax.rsqrt(jnp.mean(jnp.square(xs - mean), -1, keepdims=True) + 1e-5) * ss + bs
    assert got.dtype == x.dtype and got.shape == x.shape
    # Normalized values are O(1) times the scale: compare against the row's largest magnitude.
    big = np.maximum(1.0, np.nanmax(np.abs(np.where(np.isinf(_f64(ref)), 0, _f64(ref))), initial=1.0))
    assert_close(got, ref, dtype, atol=4 * float(jnp.finfo(dtype).eps) * big)


@FUZZ
@given(data=st.data(), activation=st.sampled_from([None, "relu"]), with_residual=st.booleans())
def test_batch_norm(data, activation, with_residual):
    x64, dtype = data.draw(arrays(min_ndim=2, max_ndim=4, max_size=1 << 15))
    x64 = np.nan_to_num(x64, nan=0.25, posinf=2.0, neginf=-2.0)  # finite statistics
    x = jnp.asarray(x64.astype(np.float32)).astype(dtype)
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1))
    c = x.shape[axis]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    scale = jnp.asarray(rng.standard_normal(c).astype(np.float32))
    bias = jnp.asarray(rng.standard_normal(c).astype(np.float32))
    residual = (jnp.asarray(rng.standard_normal(x.shape).astype(np.float32)).astype(dtype)
                if with_residual else None)
    y, mean, var = jaxops.batch_norm(x, scale, bias, axis=axis, residual=residual, activation=activation)
    acc = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    ax = axis % x.ndim
    red = tuple(i for i in range(x.ndim) if i != ax)
    shape = [1] * x.ndim
    shape[ax] = c
    xs = x.astype(acc)
    m = jnp.mean(xs, red)
    v = jnp.mean(jnp.square(xs - m.reshape(shape)), red)
    z = (xs - m.reshape(shape)) * jax.lax.rsqrt(v.reshape(shape) + 1e-5) * scale.astype(acc).reshape(shape)
    z = z + bias.astype(acc).reshape(shape)
    if residual is not None:
        z = z + residual.astype(acc)
    if activation == "relu":
        z = jax.nn.relu(z)
    assert y.dtype == x.dtype and y.shape == x.shape and mean.shape == var.shape == (c,)
    assert_close(mean, m, jnp.float32, atol=1e-5 * float(jnp.max(jnp.abs(m), initial=1.0)))
    assert_close(var, v, jnp.float32, atol=1e-5 * float(jnp.max(v, initial=1.0)))
    big = max(1.0, float(jnp.max(jnp.abs(z), initial=1.0)))
    assert_close(y, z, dtype, atol=4 * float(jnp.finfo(dtype).eps) * big)


@FUZZ
@given(data=st.data())
def test_relu(data):
    x64, dtype = data.draw(arrays(max_ndim=4))
    x = jnp.asarray(x64.astype(np.float32)).astype(dtype)
    y, pullback = jax.vjp(jaxops.relu, x)
    np.testing.assert_array_equal(_f64(y), _f64(jax.nn.relu(x)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    dy = jnp.asarray(rng.standard_normal(x.shape).astype(np.float32)).astype(dtype)
    (dx,) = pullback(dy)
    np.testing.assert_array_equal(_f64(dx), np.where(_f64(x) > 0, _f64(dy), 0.0))


@FUZZ
@given(data=st.data())
def test_knn_and_classify(data):
    m, n, d = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 300)), data.draw(st.integers(1, 40))
    k = data.draw(st.integers(1, n))
    dtype = data.draw(DTYPES)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    ints = data.draw(st.booleans())  # integer features: exact distances, many ties
    q = rng.integers(-3, 4, (m, d)) if ints else rng.standard_normal((m, d))
    r = rng.integers(-3, 4, (n, d)) if ints else rng.standard_normal((n, d))
    if not ints and data.draw(st.booleans()):  # NaN features: those distances rank last
        r[rng.integers(0, n, max(1, n // 10)), rng.integers(0, d)] = np.nan
        q[rng.integers(0, m), rng.integers(0, d)] = np.nan
    q = jnp.asarray(q.astype(np.float32)).astype(dtype)
    r = jnp.asarray(r.astype(np.float32)).astype(dtype)
    dists, idx = jaxops.knn(q, r, k)
    check_knn(q, r, k, dists, idx, exact=ints)
    num_classes = data.draw(st.integers(1, 6))
    labels = jnp.asarray(rng.integers(-1, num_classes + 1, n).astype(np.int32))  # some out of range
    got = jaxops.knn_classify(q, r, labels, k, num_classes)
    np.testing.assert_array_equal(np.asarray(got), ref_vote(np.asarray(labels), np.asarray(idx), num_classes))



# Gradients: the custom_vjp of each op against the VJP of its pure-JAX reference (float64 where
# x64 is on), with a random cotangent, on finite data (NaN gradients are covered elsewhere).
ACC = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32


def _vjp_close(fn, ref_fn, args, dtype, rng, error_scale=None):
    """Gradients against the reference's, to 8 eps of max(1, max|reference|). `error_scale(cot)`,
    if given, returns per-gradient arrays (broadcastable; None to skip) that raise that scale where
    a float32 formula cannot do better: where it cancels terms larger than its result."""
    out, pullback = jax.vjp(fn, *args)
    ref_out, ref_pullback = jax.vjp(ref_fn, *[a.astype(ACC) for a in args])
    cot = jax.tree.map(lambda o: jnp.asarray(rng.standard_normal(o.shape).astype(np.float32)).astype(o.dtype), out)
    grads = pullback(cot)
    ref_grads = ref_pullback(jax.tree.map(lambda c: c.astype(ACC), cot))
    scales = error_scale(cot) if error_scale else [None] * len(grads)
    for g, r, e in zip(grads, ref_grads, scales):
        assert g.shape == r.shape
        big = max(1.0, float(jnp.max(jnp.abs(r), initial=1.0)))
        if e is not None:  # compare g / w against r / w: the absolute tolerance becomes 8 eps w
            w = jnp.maximum(big, e)
            g, r, big = g.astype(ACC) / w, r / w, 1.0
        assert_close(g, r, dtype, atol=8 * float(jnp.finfo(dtype).eps) * big)


def _normalized_dx_scale(x, scale, cot, red, shape, eps, centred=True):
    """The size of the terms a normalization's float32 dx cancels, per group of `red`:
    rstd * max|scale * dy| * (1 + rstd * max|x|). dx = rstd (g - mean(g) - xhat mean(g xhat)) with
    g = scale * dy cancels terms of size rstd |g| (2-element groups: 1 - xhat^2 = eps / (var +
    eps)), and x - mean loses eps |x| where the spread is small next to |x| (xhat is then off by
    eps |x| rstd). Pure-JAX float32 has the same errors on those inputs."""
    xs = x.astype(ACC)
    d = xs - jnp.mean(xs, red, keepdims=True) if centred else xs
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(d), red, keepdims=True) + eps)
    g = jnp.abs(scale.astype(ACC).reshape(shape) * cot.astype(ACC))
    return rstd * jnp.max(g, red, keepdims=True) * (1 + rstd * jnp.max(jnp.abs(xs), red, keepdims=True))


def _finite(data, **kw):
    x64, dtype = data.draw(arrays(**kw))
    x64 = np.nan_to_num(x64, nan=0.5, posinf=3.0, neginf=-3.0)
    return jnp.asarray(x64.astype(np.float32)).astype(dtype), dtype


@FUZZ
@given(data=st.data(), op=st.sampled_from(["sum", "mean", "max", "min", "logsumexp"]))
def test_reduction_grads(data, op):
    x, dtype = _finite(data, max_size=1 << 14)  # max/min: ties share the gradient, as in jnp
    axis = data.draw(axes(x.ndim))
    keepdims = data.draw(st.booleans())
    ref = {"sum": jnp.sum, "mean": jnp.mean, "max": jnp.max, "min": jnp.min,
           "logsumexp": jax.nn.logsumexp}[op]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    _vjp_close(lambda v: getattr(jaxops, op)(v, axis, keepdims), lambda v: ref(v, axis=axis, keepdims=keepdims),
               (x,), dtype, rng)


@FUZZ
@given(data=st.data(), name=st.sampled_from(["softmax", "log_softmax"]))
def test_softmax_grads(data, name):
    x, dtype = _finite(data, max_size=1 << 14)
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    where = jnp.asarray(rng.uniform(size=x.shape) < 0.8) if data.draw(st.booleans()) else None
    if where is not None and name == "log_softmax":
        where = where | jnp.ones_like(where)  # masked log_softmax outputs are -inf: no finite VJP to compare
    _vjp_close(lambda v: getattr(jaxops, name)(v, axis=axis, where=where),
               lambda v: getattr(jax.nn, name)(v, axis=axis, where=where), (x,), dtype, rng)


@FUZZ
@given(data=st.data(), rms=st.booleans())
def test_layer_and_rms_norm_grads(data, rms):
    x, dtype = _finite(data, max_size=1 << 14)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    c = x.shape[-1]
    scale = jnp.asarray(rng.standard_normal(c).astype(np.float32)).astype(dtype)
    bias = jnp.asarray(rng.standard_normal(c).astype(np.float32)).astype(dtype)

    def ref_ln(v, s, b):
        m = jnp.mean(v, -1, keepdims=True)
        return (v - m) * jax.lax.rsqrt(jnp.mean(jnp.square(v - m), -1, keepdims=True) + 1e-5) * s + b

    def ref_rms(v, s):
        return v * jax.lax.rsqrt(jnp.mean(v * v, -1, keepdims=True) + 1e-6) * s

    def dx_scale(cot):
        return [_normalized_dx_scale(x, scale, cot, -1, (c,), 1e-6 if rms else 1e-5, centred=not rms)] + [None] * 2

    if rms:
        _vjp_close(lambda v, s: jaxops.rms_norm(v, s), ref_rms, (x, scale), dtype, rng, dx_scale)
    else:
        _vjp_close(lambda v, s, b: jaxops.layer_norm(v, s, b), ref_ln, (x, scale, bias), dtype, rng, dx_scale)


@FUZZ
@given(data=st.data(), with_residual=st.booleans())
def test_batch_norm_grads(data, with_residual):
    x, dtype = _finite(data, min_ndim=2, max_ndim=4, max_size=1 << 13)
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1))
    c = x.shape[axis]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    scale = jnp.asarray(rng.standard_normal(c).astype(np.float32))
    bias = jnp.asarray(rng.standard_normal(c).astype(np.float32))
    res = jnp.asarray(rng.standard_normal(x.shape).astype(np.float32)).astype(dtype)
    ax = axis % x.ndim
    red = tuple(i for i in range(x.ndim) if i != ax)
    shape = [1] * x.ndim
    shape[ax] = c

    def ref(v, s, b, r):
        m = jnp.mean(v, red, keepdims=True)
        z = (v - m) * jax.lax.rsqrt(jnp.mean(jnp.square(v - m), red, keepdims=True) + 1e-5)
        return z * s.reshape(shape) + b.reshape(shape) + (r if with_residual else 0)

    def ours(v, s, b, r):
        return jaxops.batch_norm(v, s, b, axis=axis, residual=r if with_residual else None)[0]

    def dx_scale(cot):
        return [_normalized_dx_scale(x, scale, cot, red, shape, 1e-5), None, None, None]

    _vjp_close(ours, ref, (x, scale, bias, res), dtype, rng, dx_scale)


# vmap over a drawn axis (nested once, sometimes): the batched op against the same vmap of the
# reference, so batching rules (custom_vmap / batched FFI calls) see odd layouts too.
VMAP_OPS = {
    "sum": (lambda v: jaxops.sum(v, -1), lambda v: jnp.sum(v, -1)),
    "argmax": (lambda v: jaxops.argmax(v, 0), lambda v: jnp.argmax(v, 0)),
    "logsumexp": (lambda v: jaxops.logsumexp(v, None), lambda v: jax.nn.logsumexp(v, None)),
    "softmax": (lambda v: jaxops.softmax(v, -1), lambda v: jax.nn.softmax(v, -1)),
    "layer_norm": (lambda v: jaxops.layer_norm(v, jnp.ones(v.shape[-1], v.dtype), jnp.zeros(v.shape[-1], v.dtype)),
                   lambda v: (v - jnp.mean(v, -1, keepdims=True))
                   * jax.lax.rsqrt(jnp.var(v, -1, keepdims=True) + 1e-5)),
    "relu": (jaxops.relu, jax.nn.relu),
}


@FUZZ
@given(data=st.data(), name=st.sampled_from(sorted(VMAP_OPS)))
def test_vmap_any_axis(data, name):
    x, dtype = _finite(data, min_ndim=2, max_ndim=3, max_size=1 << 14)
    ours, ref = VMAP_OPS[name]
    axis = data.draw(st.integers(0, x.ndim - 1))
    got = jax.vmap(ours, in_axes=axis)(x)
    want = jax.vmap(ref, in_axes=axis)(x.astype(ACC))
    if x.ndim == 3 and data.draw(st.booleans()):  # nested, the inner map over the next axis
        got = jax.vmap(jax.vmap(ours, in_axes=0), in_axes=axis)(x)
        want = jax.vmap(jax.vmap(ref, in_axes=0), in_axes=axis)(x.astype(ACC))
    if name == "argmax":  # x converts to ACC exactly, so the reference's indices are exact
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        assert_close(got, want, dtype, atol=8 * float(jnp.finfo(dtype).eps) * max(1.0, float(jnp.max(jnp.abs(want)))))

if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
