"""layer_norm / rms_norm against their pure-JAX formulas (float32 math, float64 under x64)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxops
from helpers import FLOAT_DTYPES, ON_GPU, gpu_only, normal, tol

DTYPES = FLOAT_DTYPES

# Row lengths covering every kernel path: lanes-per-row teams of 1..32 lanes (cols <= 32 packs),
# full warps with 2/4/8 packs per lane (<= 1024), one block per row with the row in shared
# memory, odd lengths that cannot use 16-byte packs.
# On the CPU every length runs the same C++ loop, so a few lengths suffice there.
# 4096 (backward, 16-bit dtypes) and 12288 (forward, float32) ask for exactly 48 KB of dynamic
# shared memory on top of the kernels' static scratch: the opt-in boundary.
# 400: 4 packs per lane for float, 2 for 16-bit types, 8 for float64 (the backward's shared-memory
# accumulator kernel at 16 columns per lane); 1000/1024: 8 packs (float) / 4 (16-bit).
COLS = ([1, 3, 4, 8, 17, 32, 100, 256, 400, 1000, 1024, 1536, 4100, 8192, 12288] if ON_GPU
        else [1, 4, 17, 256, 1000, 4100])
# Enough rows that the backward splits groups into many workspace slots (> 256 rows).
ROWS = {1: 300, 3: 300, 4: 300, 8: 300, 17: 70, 32: 300, 100: 33, 256: 300, 400: 300, 1000: 5, 1024: 260,
        1536: 3, 4096: 3, 4100: 2, 8192: 3, 12288: 2}


def ln_ref(x, scale, bias, epsilon=1e-5):
    """The pure-JAX formula: float32 math (float64 for float64), biased variance."""
    a = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    xf = x.astype(a)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + epsilon) * scale.astype(a) + bias.astype(a)).astype(x.dtype)


def rms_ref(x, scale, epsilon=1e-6):
    a = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    xf = x.astype(a)
    ms = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    return (xf * jax.lax.rsqrt(ms + epsilon) * scale.astype(a)).astype(x.dtype)


def close(actual, expected, dtype, factor=1.0):
    """Relative tolerance of the dtype; absolute tolerance relative to the largest reference
    value, since sums of many terms (dscale, dbias) may cancel to near zero."""
    t = tol(dtype)
    a = np.asarray(jnp.asarray(actual).astype(jnp.float32 if dtype != jnp.float64 else jnp.float64))
    e = np.asarray(jnp.asarray(expected).astype(a.dtype))
    assert a.shape == e.shape, (a.shape, e.shape)
    finite = e[np.isfinite(e)]
    big = float(np.max(np.abs(finite))) if finite.size else 0.0
    np.testing.assert_allclose(a, e, rtol=t["rtol"] * factor, atol=(t["atol"] + t["rtol"] * big) * factor,
                               equal_nan=True)


def assert_unit_layer_norm(y, x, dtype):
    """y, layer_norm of x with scale 1 and bias 0, against the float64 formula over x's values."""
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    exact = (xf - xf.mean(-1, keepdims=True)) / np.sqrt(xf.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), exact, rtol=2 * tol(dtype)["rtol"],
                               atol=2 * tol(dtype)["rtol"] * 4)


def params(key, cols, dtype, n=2):
    ks = jax.random.split(key, n)
    return [normal(k, (cols,), dtype) for k in ks]


def skip_x64(dtype):
    if jnp.dtype(dtype) == jnp.float64 and not jax.config.jax_enable_x64:
        pytest.skip("float64 needs x64")


# ------------------------------------------------------------------------------- forward

@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_reference(key, cols, dtype):
    skip_x64(dtype)
    k1, k2 = jax.random.split(key)
    x = normal(k1, (ROWS[cols], cols), dtype, scale=3.0) + jnp.asarray(1.5, dtype)
    scale, bias = params(k2, cols, dtype)
    close(jaxops.layer_norm(x, scale, bias), ln_ref(x, scale, bias), dtype)
    close(jaxops.rms_norm(x, scale), rms_ref(x, scale), dtype)


@pytest.mark.parametrize("shape", [(7,), (2, 3, 40), (3, 1, 5, 16)])
def test_any_rank_and_epsilon(key, shape):
    k1, k2 = jax.random.split(key)
    x = normal(k1, shape, jnp.float32)
    scale, bias = params(k2, shape[-1], jnp.float32)
    close(jaxops.layer_norm(x, scale, bias, epsilon=0.5), ln_ref(x, scale, bias, 0.5), jnp.float32)
    close(jaxops.rms_norm(x, scale, epsilon=0.25), rms_ref(x, scale, 0.25), jnp.float32)


def test_variance_is_stable_far_from_zero(key):
    # mean 1e4, std 0.1: E[x^2] - E[x]^2 would lose every digit in float32.
    k1, k2 = jax.random.split(key)
    x = (1e4 + 0.1 * jax.random.normal(k1, (16, 1000), jnp.float32)).astype(jnp.float32)
    scale, bias = params(k2, 1000, jnp.float32)
    y = jaxops.layer_norm(x, scale, bias)
    x64 = np.asarray(x, np.float64)
    mean = x64.mean(-1, keepdims=True)
    exact = (x64 - mean) / np.sqrt(((x64 - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
    exact = exact * np.asarray(scale, np.float64) + np.asarray(bias, np.float64)
    np.testing.assert_allclose(np.asarray(y, np.float64), exact, rtol=1e-3, atol=1e-3)
    _, vjp = jax.vjp(jaxops.layer_norm, x, scale, bias)
    rstd = [r for r in jax.tree_util.tree_leaves(vjp) if getattr(r, "shape", None) == (16,)]
    assert rstd, "per-row statistics are saved as residuals"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("cols", [2055, 2056, 4096, 8192, 16392, 262152])
@pytest.mark.parametrize("center,spread", [(3.0, 2.0), (1e4, 0.1)])
def test_variance_whatever_the_first_element(key, dtype, cols, center, spread):
    # The GPU block, split and uncached forwards (2056+ columns; per-example parameters under vmap
    # take forward_block) take the variance in one pass around the row's first element when that
    # element lies within sqrt(3) standard deviations of the mean, else in two passes around the
    # mean (session 37). First elements 0 ... 1000 standard deviations off, on both sides: every
    # row must match the float64 formula. 2055 columns are not whole 16-byte packs: one element
    # a load, in the same lean block kernel since session 55.
    if dtype == jnp.bfloat16 and center > 100:
        pytest.skip("bfloat16 cannot hold 1e4 + 0.1 z")
    offsets = jnp.asarray([0.0, 0.5, 1.0, 1.7, 1.8, -2.0, 3.0, -30.0, 1000.0], jnp.float32)
    z = jax.random.normal(key, (2 * offsets.size, cols), jnp.float32)
    z = z.at[:, 0].set(jnp.tile(offsets, 2))
    x = (center + spread * z).astype(dtype)
    assert_unit_layer_norm(jaxops.layer_norm(x, jnp.ones((cols,), dtype), jnp.zeros((cols,), dtype)), x, dtype)
    ones = jnp.ones((2, cols), dtype)
    assert_unit_layer_norm(jax.vmap(jaxops.layer_norm)(x.reshape(2, -1, cols), ones, 0 * ones).reshape(x.shape),
                           x, dtype)


def test_inf_and_nan_rows(key):
    k1, k2 = jax.random.split(key)
    x = normal(k1, (4, 64), jnp.float32)
    x = x.at[1, 5].set(jnp.inf).at[2, 7].set(jnp.nan).at[3, 0].set(-jnp.inf)
    scale, bias = params(k2, 64, jnp.float32)
    y = jaxops.layer_norm(x, scale, bias)
    close(y, ln_ref(x, scale, bias), jnp.float32)
    assert np.all(np.isfinite(np.asarray(y[0]))) and np.all(np.isnan(np.asarray(y[1:])))
    close(jaxops.rms_norm(x, scale), rms_ref(x, scale), jnp.float32)


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (2, 0, 5)])
def test_empty(shape):
    x = jnp.ones(shape, jnp.float32)
    scale = jnp.ones(shape[-1:], jnp.float32)
    assert jaxops.layer_norm(x, scale, scale).shape == shape
    assert jaxops.rms_norm(x, scale).shape == shape
    g = jax.grad(lambda x, s: jaxops.layer_norm(x, s, s).sum(), (0, 1))(x, scale)
    assert g[0].shape == shape and g[1].shape == scale.shape


def test_residuals_are_small(key):
    x = normal(key, (32, 128), jnp.bfloat16)
    scale = jnp.ones((128,), jnp.bfloat16)
    _, vjp = jax.vjp(lambda x, s: jaxops.rms_norm(x, s), x, scale)
    leaves = [l for l in jax.tree_util.tree_leaves(vjp) if hasattr(l, "shape")]
    extra = [l for l in leaves if l.shape == (32,)]
    assert [l.dtype for l in extra] == [jnp.float32]  # rstd only, float32 per row
    nbytes = sum(l.size * l.dtype.itemsize for l in leaves)
    assert nbytes <= x.size * 2 + 128 * 2 + 32 * 4 + 64


# ------------------------------------------------------------------------------ backward

def _loss_fns(ln, rms, x):
    # A non-constant cotangent: sum(y * w) with fixed random w.
    w = jax.random.normal(jax.random.key(7), x.shape, jnp.float32).astype(x.dtype)

    def ln_loss(x, s, b):
        return jnp.sum((ln(x, s, b) * w).astype(jnp.float32))

    def rms_loss(x, s):
        return jnp.sum((rms(x, s) * w).astype(jnp.float32))

    return ln_loss, rms_loss


@pytest.mark.parametrize("cols", [1, 4, 17, 32, 256, 400, 1000, 1024, 4096, 4100] if ON_GPU else [1, 17, 256, 4100])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grads_match_reference(key, cols, dtype):
    skip_x64(dtype)
    k1, k2 = jax.random.split(key)
    x = normal(k1, (ROWS[cols], cols), dtype) + jnp.asarray(0.5, dtype)
    scale, bias = params(k2, cols, dtype)
    ln, rms = _loss_fns(jaxops.layer_norm, jaxops.rms_norm, x)
    ln_r, rms_r = _loss_fns(ln_ref, rms_ref, x)
    got = jax.jit(jax.grad(ln, (0, 1, 2)))(x, scale, bias)
    want = jax.grad(ln_r, (0, 1, 2))(x, scale, bias)
    # bfloat16/float16 gradients: reference and kernel round dx differently near cancellation.
    factor = 2.0 if dtype in (jnp.bfloat16, jnp.float16) else 5.0
    for g, w in zip(got, want):
        assert g.dtype == dtype
        close(g, w, dtype, factor)
    got = jax.jit(jax.grad(rms, (0, 1)))(x, scale)
    want = jax.grad(rms_r, (0, 1))(x, scale)
    for g, w in zip(got, want):
        close(g, w, dtype, factor)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_column_dx_is_exactly_zero(key, dtype):
    # x - mean is exactly 0 for a single column, so dx must be exactly 0 (not rounding noise
    # amplified by rstd = 1/sqrt(epsilon)); dbias is dy and dscale 0.
    skip_x64(dtype)
    k1, k2 = jax.random.split(key)
    x = normal(k1, (300, 1), dtype) + jnp.asarray(0.5, dtype)
    scale, bias = params(k2, 1, dtype)
    ln, _ = _loss_fns(jaxops.layer_norm, jaxops.rms_norm, x)
    dx, dscale, dbias = jax.jit(jax.grad(ln, (0, 1, 2)))(x, scale, bias)
    np.testing.assert_array_equal(np.asarray(dx.astype(jnp.float32)), 0.0)
    np.testing.assert_array_equal(np.asarray(dscale.astype(jnp.float32)), 0.0)
    ln_r, _ = _loss_fns(ln_ref, rms_ref, x)
    close(dbias, jax.grad(ln_r, 2)(x, scale, bias), dtype)


@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 33), (300, 8), (4, 130)])
def test_check_grads_float64(key, shape):
    if not jax.config.jax_enable_x64:
        pytest.skip("needs x64")
    k1, k2 = jax.random.split(key)
    x = normal(k1, shape, jnp.float64)
    scale, bias = params(k2, shape[-1], jnp.float64)
    check_grads(lambda x, s, b: jaxops.layer_norm(x, s, b), (x, scale, bias), order=1, modes=("rev",))
    check_grads(lambda x, s: jaxops.rms_norm(x, s), (x, scale), order=1, modes=("rev",))


def test_check_grads_float32(key):
    k1, k2 = jax.random.split(key)
    x = normal(k1, (6, 24), jnp.float32)
    scale, bias = params(k2, 24, jnp.float32)
    check_grads(lambda x, s, b: jaxops.layer_norm(x, s, b), (x, scale, bias), order=1, modes=("rev",),
                eps=1e-2, atol=5e-2, rtol=5e-2)


# 1024 columns: the backward kernel with per-warp shared-memory accumulators.
# 4096 columns: backward_rows (register rows, per-thread column sums written per slot).
@pytest.mark.parametrize("cols", [256, 1024, 4096] if ON_GPU else [256])
def test_parameter_grads_are_deterministic(key, cols):
    k1, k2 = jax.random.split(key)
    x = normal(k1, (4096, cols), jnp.float32)
    scale, bias = params(k2, cols, jnp.float32)
    f = jax.jit(jax.grad(lambda x, s, b: jnp.sum(jaxops.layer_norm(x, s, b) * x), (1, 2)))
    a, b = f(x, scale, bias), f(x, scale, bias)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


# ------------------------------------------------------------------------- transformations

def test_jit_and_static_epsilon(key):
    k1, k2 = jax.random.split(key)
    x = normal(k1, (5, 48), jnp.float32)
    scale, bias = params(k2, 48, jnp.float32)
    f = jax.jit(jaxops.layer_norm, static_argnames="epsilon")
    close(f(x, scale, bias, epsilon=1e-3), ln_ref(x, scale, bias, 1e-3), jnp.float32)
    close(f(x, scale, bias, epsilon=2.0), ln_ref(x, scale, bias, 2.0), jnp.float32)


@pytest.mark.parametrize("in_axes", [(0, None, None), (1, None, None), (0, 0, 0), (None, 0, None),
                                     (2, 0, None)])
def test_vmap(key, in_axes):
    k1, k2 = jax.random.split(key)
    xshape = [6, 40]
    if in_axes[0] is not None:
        xshape.insert(in_axes[0], 3)
    x = normal(k1, tuple(xshape), jnp.float32)
    ps = []
    for k, ax in zip(jax.random.split(k2, 2), in_axes[1:]):
        ps.append(normal(k, (3, 40) if ax == 0 else (40,), jnp.float32))
    got = jax.vmap(jaxops.layer_norm, in_axes)(x, *ps)
    close(got, jax.vmap(ln_ref, in_axes)(x, *ps), jnp.float32)
    got = jax.vmap(jaxops.rms_norm, in_axes[:2])(x, ps[0])
    close(got, jax.vmap(rms_ref, in_axes[:2])(x, ps[0]), jnp.float32)

    # Gradients through the vmapped function: per-example scales get per-example gradients,
    # shared ones get the sum.
    def loss(f):
        return lambda x, s, b: jnp.sum(jnp.sin(jax.vmap(f, in_axes)(x, s, b)))

    got = jax.grad(loss(jaxops.layer_norm), (0, 1, 2))(x, *ps)
    want = jax.grad(loss(ln_ref), (0, 1, 2))(x, *ps)
    for g, w in zip(got, want):
        close(g, w, jnp.float32, 5.0)


def test_nested_vmap_and_vmap_of_grad(key):
    k1, k2 = jax.random.split(key)
    x = normal(k1, (2, 3, 4, 24), jnp.float32)
    scale, bias = params(k2, 24, jnp.float32)
    f = jax.vmap(jax.vmap(jaxops.layer_norm, (0, None, None)), (1, None, None))
    close(f(x, scale, bias), jax.vmap(jax.vmap(ln_ref, (0, None, None)), (1, None, None))(x, scale, bias),
          jnp.float32)
    per_example = jax.vmap(jax.grad(lambda x, s: jnp.sum(jaxops.rms_norm(x, s) ** 2), (0, 1)), (0, None))
    want = jax.vmap(jax.grad(lambda x, s: jnp.sum(rms_ref(x, s) ** 2), (0, 1)), (0, None))
    for g, w in zip(per_example(x, scale), want(x, scale)):
        close(g, w, jnp.float32, 5.0)


# ------------------------------------------------------------------- mixed-precision params

@pytest.mark.parametrize("x_dtype,p_dtype", [(jnp.bfloat16, jnp.float32), (jnp.float16, jnp.float32),
                                             (jnp.float32, jnp.bfloat16)])
def test_params_of_another_dtype_are_cast_to_x(x_dtype, p_dtype):
    """float32 parameters of a bfloat16 model (flax's param_dtype): the same bits as parameters
    cast to x's dtype by hand, and each parameter's gradient in its own dtype."""
    k1, k2 = jax.random.split(jax.random.key(31))
    x = normal(k1, (37, 200), x_dtype, scale=2.0) + jnp.asarray(0.5, x_dtype)
    scale, bias = params(k2, 200, p_dtype)
    cast = lambda p: p.astype(x_dtype)
    np.testing.assert_array_equal(jax.jit(jaxops.layer_norm)(x, scale, bias),
                                  jaxops.layer_norm(x, cast(scale), cast(bias)))
    np.testing.assert_array_equal(jaxops.rms_norm(x, scale), jaxops.rms_norm(x, cast(scale)))
    w = normal(jax.random.key(5), x.shape, jnp.float32)
    loss_ln = lambda x, s, b: jnp.sum(jaxops.layer_norm(x, s, b).astype(jnp.float32) * w)
    loss_rms = lambda x, s: jnp.sum(jaxops.rms_norm(x, s).astype(jnp.float32) * w)
    got = jax.grad(loss_ln, (0, 1, 2))(x, scale, bias) + jax.grad(loss_rms, (0, 1))(x, scale)
    want = jax.grad(loss_ln, (0, 1, 2))(x, cast(scale), cast(bias)) + jax.grad(loss_rms, (0, 1))(x, cast(scale))
    for g, e, d in zip(got, want, (x_dtype, p_dtype, p_dtype, x_dtype, p_dtype)):
        assert g.dtype == d, (g.dtype, d)
        np.testing.assert_array_equal(g, e.astype(d))


# ---------------------------------------------------------------------------- bad input

def test_bad_input_raises_before_running():
    x = jnp.ones((4, 8), jnp.float32)
    s = jnp.ones((8,), jnp.float32)
    with pytest.raises(ValueError, match=r"jaxops.layer_norm: scale must have shape \(8,\).*\(7,\)"):
        jaxops.layer_norm(x, jnp.ones((7,), jnp.float32), s)
    with pytest.raises(ValueError, match=r"jaxops.layer_norm: bias must have shape .*\(4, 8\)"):
        jaxops.layer_norm(x, s, jnp.ones((4, 8), jnp.float32))
    with pytest.raises(TypeError, match=r"jaxops.rms_norm: scale must be .*float.*int32"):
        jaxops.rms_norm(x, jnp.ones((8,), jnp.int32))
    with pytest.raises(ValueError, match=r"jaxops.rms_norm: scale must have shape \(8,\).*\(8, 1\)"):
        jaxops.rms_norm(x, jnp.ones((8, 1), jnp.bfloat16))
    with pytest.raises(TypeError, match=r"jaxops.layer_norm: x must be float.*int32"):
        jaxops.layer_norm(jnp.ones((4, 8), jnp.int32), s, s)
    with pytest.raises(ValueError, match=r"jaxops.rms_norm: x must have at least one dimension"):
        jaxops.rms_norm(jnp.float32(1.0), jnp.ones((1,), jnp.float32))
    with pytest.raises(ValueError, match=r"jaxops.layer_norm: epsilon must be finite and >= 0, got -1"):
        jaxops.layer_norm(x, s, s, epsilon=-1.0)
    with pytest.raises(ValueError, match=r"jaxops.rms_norm: epsilon must be finite and >= 0, got nan"):
        jaxops.rms_norm(x, s, epsilon=float("nan"))
    with pytest.raises(ValueError, match=r"jaxops.rms_norm: epsilon must be a non-negative Python float"):
        jaxops.rms_norm(x, s, epsilon="small")
    with pytest.raises(ValueError, match=r"jaxops.layer_norm: epsilon must be a non-negative Python float"):
        jax.jit(lambda e: jaxops.layer_norm(x, s, s, epsilon=e))(1e-5)


# --------------------------------------------------------------------------- GPU paths

@gpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("cols", [131072, 100003, 524296, 1048584])
def test_long_rows_paths(key, dtype, cols):
    # Rows beyond shared memory (forward: > ~227 KB per row; backward: x, dy and the
    # accumulators beyond it) take the uncached kernels; on Hopper 131072-column rows instead
    # split over clusters of 16 blocks, forward and backward (100003 columns, not whole packs,
    # stay). 524296 and 1048584 columns are past 64 KB a split block: since session 39 the
    # forward splits them over 16 blocks that cache nothing (kFromL2; the last block's part is
    # shorter, its write pass walks backwards); since session 40 their backward takes the three
    # long-row kernels (test_long_rows_backward_gpu has more of them).
    k1, k2 = jax.random.split(key)
    x = normal(k1, (3, cols), dtype, scale=2.0) + jnp.asarray(3.0, dtype)
    scale, bias = params(k2, cols, dtype)
    close(jaxops.layer_norm(x, scale, bias), ln_ref(x, scale, bias), dtype)
    close(jaxops.rms_norm(x, scale), rms_ref(x, scale), dtype)
    _check_both_grads(x, scale, bias, dtype)


@gpu_only
@pytest.mark.parametrize("dtype,groups,rows,cols", [(jnp.float32, 1, 1, 262144), (jnp.float16, 1, 7, 131080),
                                                    (jnp.bfloat16, 1, 5, 1048584), (jnp.float32, 3, 2, 262148),
                                                    (jnp.bfloat16, 2, 3, 524296)])
def test_long_rows_backward_gpu(key, dtype, groups, rows, cols):
    # Backward rows past the cluster split (> 131072 columns in whole packs): long_row_sums (a
    # block per row and chunk of 1024 packs; 131080 16-bit columns end in a chunk of one pack),
    # long_row_coefs, long_row_dx (a block per column tile and parameter group walks the group's
    # rows four at a time: 1, 2, 3, 5 and 7 rows leave partial steps). Groups > 1: per-example
    # parameters under vmap.
    _check_grouped(key, dtype, groups, rows, cols)


def _check_grouped(key, dtype, groups, rows, cols):
    """Per-example parameters (jax.vmap over x, scale, bias: `groups` groups of `rows` rows):
    both ops' outputs and gradients against the references; dscale / dbias bit-identical over
    two runs."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    x = normal(k1, (groups, rows, cols), dtype, scale=2.0) + jnp.asarray(3.0, dtype)
    scale = (1.0 + 0.1 * normal(k2, (groups, cols), jnp.float32)).astype(dtype)
    bias = normal(k3, (groups, cols), dtype, scale=0.1)
    w = normal(k4, x.shape, dtype)

    def loss(f):
        return lambda *a: jnp.sum((jax.vmap(f)(*a) * w).astype(jnp.float32))

    ln_args, rms_args = (x, scale, bias), (x, scale)
    for f, ref, args in ((jaxops.layer_norm, ln_ref, ln_args), (jaxops.rms_norm, rms_ref, rms_args)):
        close(jax.jit(jax.vmap(f))(*args), jax.vmap(ref)(*args), dtype)
        argnums = tuple(range(len(args)))
        grad = jax.jit(jax.grad(loss(f), argnums))
        got, again = grad(*args), grad(*args)
        for g, r in zip(got, jax.grad(loss(ref), argnums)(*args)):
            close(g, r, dtype, 2.0)
        for g, h in zip(got[1:], again[1:]):
            np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(h.astype(jnp.float32)))


@gpu_only
@pytest.mark.parametrize("dtype,groups,rows,cols", [(jnp.float32, 8, 16, 65536), (jnp.bfloat16, 8, 16, 65536),
                                                    (jnp.float32, 8, 128, 8192), (jnp.bfloat16, 3, 100, 12296),
                                                    (jnp.float16, 300, 2, 2056), (jnp.float32, 5, 3, 40000),
                                                    (jnp.bfloat16, 4, 70, 4096), (jnp.float32, 3, 40, 8192)])
def test_grouped_rows_gpu(key, dtype, groups, rows, cols):
    # Per-example parameters (vmap) on the paths session 41 opened to them: forwards of 2056+
    # columns take forward_block_lean with the row's group (kGroups; 8192 f32, 4096 / 12296 16-bit)
    # and rows past a block's shared memory split over a cluster (40000, 65536); backward slots
    # per group fill at most the resident blocks; groups of <= 16 slots are added by
    # reduce_few_slots (16 rows of 65536, 8 groups of 128 rows of 8192, 300 groups of 2 rows: more
    # groups than blocks), of 17-64 by reduce_slots with 8 lanes (3 groups of 40 rows of 8192).
    _check_grouped(key, dtype, groups, rows, cols)


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_long_rows_grouped_forward_gpu(key, dtype):
    # Per-example parameters (vmap: groups > 1), 524296-column rows: the split over 16 blocks
    # that re-read their parts from L2 (forward_uncached before session 41).
    k1, k2, k3 = jax.random.split(key, 3)
    cols = 524296
    x = normal(k1, (2, 2, cols), dtype, scale=2.0) + jnp.asarray(3.0, dtype)
    scale = (1.0 + 0.1 * normal(k2, (2, cols), jnp.float32)).astype(dtype)
    bias = normal(k3, (2, cols), dtype, scale=0.1)
    close(jax.vmap(jaxops.layer_norm)(x, scale, bias), jax.vmap(ln_ref)(x, scale, bias), dtype)
    close(jax.vmap(jaxops.rms_norm)(x, scale), jax.vmap(rms_ref)(x, scale), dtype)


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_many_rows_gpu(key, dtype):
    # Many slots per group and grid-stride loops over rows and slots.
    k1, k2 = jax.random.split(key)
    x = normal(k1, (20000, 768), dtype)
    scale, bias = params(k2, 768, dtype)
    close(jaxops.layer_norm(x, scale, bias), ln_ref(x, scale, bias), dtype)
    ln, _ = _loss_fns(jaxops.layer_norm, jaxops.rms_norm, x)
    ln_r, _ = _loss_fns(ln_ref, rms_ref, x)
    for g, w in zip(jax.grad(ln, (0, 1, 2))(x, scale, bias), jax.grad(ln_r, (0, 1, 2))(x, scale, bias)):
        close(g, w, dtype, 2.0)


def _check_both_grads(x, scale, bias, dtype):
    """layer_norm's and rms_norm's gradients (jitted) against the pure-JAX references."""
    ln, rms = _loss_fns(jaxops.layer_norm, jaxops.rms_norm, x)
    ln_r, rms_r = _loss_fns(ln_ref, rms_ref, x)
    for g, w in zip(jax.jit(jax.grad(ln, (0, 1, 2)))(x, scale, bias), jax.grad(ln_r, (0, 1, 2))(x, scale, bias)):
        close(g, w, dtype, 2.0)
    for g, w in zip(jax.jit(jax.grad(rms, (0, 1)))(x, scale), jax.grad(rms_r, (0, 1))(x, scale)):
        close(g, w, dtype, 2.0)


def _check_param_grads_repeat(x, scale, bias, dtype, wkey):
    """dscale / dbias of both ops bit-identical over two runs (fixed-order column sums); returns
    the cotangent weights used."""
    w = jax.random.normal(wkey, x.shape, jnp.float32).astype(dtype)
    f = jax.jit(jax.grad(lambda x, s, b: jnp.sum((jaxops.layer_norm(x, s, b) * w).astype(jnp.float32)), (1, 2)))
    g = jax.jit(jax.grad(lambda x, s: jnp.sum((jaxops.rms_norm(x, s) * w).astype(jnp.float32)), 1))
    for u, v in zip(f(x, scale, bias) + (g(x, scale),), f(x, scale, bias) + (g(x, scale),)):
        np.testing.assert_array_equal(np.asarray(u.astype(jnp.float32)), np.asarray(v.astype(jnp.float32)))
    return w


def _check_forward(key, dtype, rows, cols, offset):
    """Both ops' forwards on fresh (rows, cols) data, scaled by 2 and shifted by `offset`, against
    the references; returns x, scale and bias."""
    k1, k2 = jax.random.split(key)
    x = normal(k1, (rows, cols), dtype, scale=2.0) + jnp.asarray(offset, dtype)
    scale, bias = params(k2, cols, dtype)
    close(jaxops.layer_norm(x, scale, bias), ln_ref(x, scale, bias), dtype)
    close(jaxops.rms_norm(x, scale), rms_ref(x, scale), dtype)
    return x, scale, bias


def _check_backward(key, dtype, rows, cols, wkey):
    """Both ops' gradients on fresh (rows, cols) data against the references, and their dscale /
    dbias bit-identical over two runs."""
    k1, k2 = jax.random.split(key)
    x = normal(k1, (rows, cols), dtype) + jnp.asarray(1.0, dtype)
    scale, bias = params(k2, cols, dtype)
    _check_both_grads(x, scale, bias, dtype)
    _check_param_grads_repeat(x, scale, bias, dtype, wkey)


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 2048), (3, 1032), (1999, 1032), (2001, 2048), (1001, 3592), (533, 4096)])
def test_pair_row_backward_gpu(key, dtype, rows, cols):
    # 16-bit rows of 1032-4096 columns: layer_norm two rows an iteration (backward_rows_lean_pair;
    # odd slot lengths leave a single last row), rms_norm too unless the row fills every thread's
    # two packs (2048, 4096: the prefetch kernel). 1 and 3 rows: fewer rows than slots.
    _check_backward(key, dtype, rows, cols, jax.random.key(9))


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows,cols", [(2000, 4096), (700, 8192), (1500, 2056), (600, 6152)])
def test_register_row_backward_gpu(key, dtype, rows, cols):
    # backward_rows (2048-8192 columns, x/dy in registers): several rows per slot (at most 528 slots:
    # 2000 rows -> 3-8 a slot by occupancy), so the next-row loads at the end of the row loop and
    # the slot-end accumulator writes run; 2056/6152 columns leave the threads' last pack partly
    # past the row (float 514/1538 packs over 4 a thread, 16-bit 257/769 packs over 2).
    k1, k2 = jax.random.split(key)
    x = normal(k1, (rows, cols), dtype) + jnp.asarray(0.5, dtype)
    scale, bias = params(k2, cols, dtype)
    _check_both_grads(x, scale, bias, dtype)


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows,cols", [(1100, 8192), (263, 6152), (5, 8192)])
def test_row_ring_matches_register_prefetch_gpu(key, monkeypatch, dtype, rows, cols):
    # 16-bit layer_norm rows past 6144 columns read the next 4 rows through a cp.async ring in
    # shared memory (session 44); where the ring does not fit (sm_80) the kernel prefetches the next
    # row into registers instead, which JAXOPS_LN_NO_RING=1 forces here. 1100 rows: several a slot
    # (the ring refills and wraps); 263: one a slot (three empty entries); 5: fewer rows than slots.
    # The same arithmetic on the same values: dx, dscale and dbias must be the same bits, and the
    # fallback's gradients match the references.
    k1, k2, k3 = jax.random.split(key, 3)
    x = normal(k1, (rows, cols), dtype) + jnp.asarray(2.0, dtype)
    scale, bias = params(k2, cols, dtype)
    g = normal(k3, (rows, cols), dtype)
    f = jax.jit(lambda x, s, b, g: jax.vjp(jaxops.layer_norm, x, s, b)[1](g))
    monkeypatch.setenv("JAXOPS_FAST_DRAM", "1")  # the ring's plan on any chip (session 61)
    ring = f(x, scale, bias, g)
    monkeypatch.setenv("JAXOPS_LN_NO_RING", "1")
    prefetch = f(x, scale, bias, g)
    for u, v in zip(ring, prefetch):
        np.testing.assert_array_equal(np.asarray(u.astype(jnp.float32)).view(np.uint32),
                                      np.asarray(v.astype(jnp.float32)).view(np.uint32))
    _check_both_grads(x, scale, bias, dtype)


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows,cols", [(3000, 8192), (1000, 4104), (7, 6152), (1, 8192)])
def test_held_params_forward_matches_lean_gpu(key, monkeypatch, dtype, rows, cols):
    # 16-bit layer_norm rows of 8-16 KB run forward_block_async_held (session 46: persistent
    # blocks keep their scale and bias packs in registers and copy the next row by cp.async);
    # JAXOPS_LN_NO_HELD=1 forces forward_block_lean. 3000 rows: several a block; 7 and 1: fewer
    # rows than blocks; 4104 columns (513 packs on 160 threads) leave threads 0-32 4 packs and the
    # rest 3. The same arithmetic in the same order: y, and dx through the saved mean and rstd,
    # must be the same bits; rows far from zero with a large first element check the shift and the
    # third pass.
    k1, k2, k3 = jax.random.split(key, 3)
    x = normal(k1, (rows, cols), dtype) + jnp.asarray(3.0, dtype)
    x = x.at[:, 0].set(jnp.asarray(300.0, dtype))
    scale, bias = params(k2, cols, dtype)
    g = normal(k3, (rows, cols), dtype)

    def fwd_bwd(x, s, b, g):
        y, vjp = jax.vjp(jaxops.layer_norm, x, s, b)
        return (y,) + vjp(g)

    f = jax.jit(fwd_bwd)
    monkeypatch.setenv("JAXOPS_FAST_DRAM", "1")  # the held kernel's plan on any chip (session 61)
    held = f(x, scale, bias, g)
    monkeypatch.setenv("JAXOPS_LN_NO_HELD", "1")
    lean = f(x, scale, bias, g)
    for u, v in zip(held, lean):
        np.testing.assert_array_equal(np.asarray(u.astype(jnp.float32)).view(np.uint32),
                                      np.asarray(v.astype(jnp.float32)).view(np.uint32))
    monkeypatch.delenv("JAXOPS_LN_NO_HELD")
    _check_forward(key, dtype, rows, cols, 1.5)


@gpu_only
@pytest.mark.parametrize("fast_dram", ["0", "1"])
@pytest.mark.parametrize("dtype,cols", [(jnp.float32, 2048), (jnp.float32, 4096), (jnp.float32, 8192),
                                        (jnp.bfloat16, 2048), (jnp.bfloat16, 4096), (jnp.float16, 6152),
                                        (jnp.bfloat16, 8192)])
def test_dram_plans_gpu(key, monkeypatch, fast_dram, dtype, cols):
    # Session 61: where DRAM does not outrun the SMs (the H100; cuda::dram_outruns_sms) the
    # forward keeps float32 2048 on the block kernel and float32 4-32 KB / 16-bit 8-16 KB rows
    # off the cp.async kernels, and the layer_norm backward takes the 16-bit prefetch kernel in
    # clusters of 4 at 2048-4096 columns, the register prefetch (no ring) past 6144 and no
    # cp.async for float32 past 2048; where it does (the H200), session 37-46's plans.
    # JAXOPS_FAST_DRAM forces each, so either chip runs both: forward, gradients and per-example
    # parameters against the references.
    monkeypatch.setenv("JAXOPS_FAST_DRAM", fast_dram)
    _check_lean_forward(key, dtype, rows=1500, cols=cols, grad_rows=700, vmap_rows=10)


@gpu_only
@pytest.mark.parametrize("fast_dram", ["0", "1"])
@pytest.mark.parametrize("dtype,rows,cols", [(jnp.bfloat16, 4001, 128), (jnp.float16, 30001, 8),
                                             (jnp.bfloat16, 997, 256), (jnp.bfloat16, 3, 64),
                                             (jnp.float32, 2001, 128)])
def test_narrow_backward_dram_plans_gpu(key, monkeypatch, fast_dram, dtype, rows, cols):
    # Session 63: rows of <= 32 16-byte packs take backward_team for 16-bit types where DRAM does
    # not outrun the SMs (the H100) and backward_team_lean elsewhere (float32 always). Both plans
    # on any chip: 1, 8, 16 and 32 packs a row, 3 rows (fewer than a team's block), gradients of
    # both ops against the references and dscale / dbias bit-identical over two runs.
    monkeypatch.setenv("JAXOPS_FAST_DRAM", fast_dram)
    _check_backward(key, dtype, rows, cols, jax.random.key(63))


@gpu_only
@pytest.mark.parametrize("cluster", ["1", "2", "8"])
@pytest.mark.parametrize("dtype,rows,cols", [(jnp.bfloat16, 3001, 4096), (jnp.bfloat16, 13, 8192),
                                             (jnp.float16, 7000, 1024), (jnp.float32, 2000, 4096),
                                             (jnp.bfloat16, 3, 2056), (jnp.bfloat16, 20000, 1032)])
def test_cluster_slot_sums_gpu(key, monkeypatch, cluster, dtype, rows, cols):
    # On Hopper the register-row backward kernels run in clusters whose blocks add their column
    # sums through distributed shared memory and write one partial row a cluster (default 4
    # blocks, covered by every other backward test; JAXOPS_LN_CLUSTER is read at every launch).
    # 1 = no clusters; 2 and 8; 13 rows on 8-block clusters leave empty slots in the cluster;
    # 3 rows are fewer than a cluster (falls back to plain slots); 20000 bf16 rows of 1032 columns
    # run more blocks than the workspace has slots (16-bit: one slot a cluster). Gradients against the
    # references, dscale / dbias of both ops bit-identical over two runs.
    monkeypatch.setenv("JAXOPS_LN_CLUSTER", cluster)
    _check_backward(key, dtype, rows, cols, jax.random.key(5))


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows,cols", [(300, 12288), (7, 16392), (130, 40000), (40, 65536)])
def test_split_rows_backward_gpu(key, dtype, rows, cols):
    # Rows past one block's registers (> 8192 columns) split over the blocks of a cluster on
    # Hopper: 12288 columns over 6 blocks (16-bit) or 3 (float); 16392 over 9 (2049 / 4098 packs:
    # the last block owns fewer); 40000 over 10 / 5; 65536 over 16 (non-portable clusters) / 8;
    # 7 rows give most clusters no rows.
    _check_backward(key, dtype, rows, cols, jax.random.key(6))


@gpu_only
@pytest.mark.parametrize("split", ["2", "3", "5", "8"])
@pytest.mark.parametrize("dtype,rows,cols", [(jnp.bfloat16, 1000, 2048), (jnp.float32, 513, 2056),
                                             (jnp.float16, 3, 4104), (jnp.bfloat16, 40, 12296)])
def test_forced_split_rows_backward_gpu(key, monkeypatch, split, dtype, rows, cols):
    # JAXOPS_LN_SPLIT (read at every launch) splits rows the one-block kernels hold, so the split
    # runs on short rows too: 256 / 514 packs over 3 / 5 blocks are uneven shares; 3 rows are fewer
    # than the clusters; 12296 columns over 2 or 3 blocks take the 16-bit kernel without the
    # prefetch (shares of 769 / 513 packs), the only place besides 131072 columns that does.
    monkeypatch.setenv("JAXOPS_LN_SPLIT", split)
    _check_backward(key, dtype, rows, cols, jax.random.key(7))


@gpu_only
@pytest.mark.parametrize("dtype,rows,cols", [(jnp.float32, 600, 65536), (jnp.bfloat16, 5, 262152),
                                             (jnp.float16, 40, 131072), (jnp.float32, 3, 100000),
                                             (jnp.float32, 5, 262136), (jnp.float32, 37, 12296),
                                             (jnp.bfloat16, 9, 30000)])
def test_split_rows_forward_gpu(key, dtype, rows, cols):
    # Forward rows beyond one block's shared memory split over a cluster's blocks on Hopper, about
    # 32 KB a block: 65536 float32 columns over 8 blocks with several rows a cluster; 262152 bf16
    # over 16 (the last block owns fewer packs); 100000 float32 over 13; 262136 float32 over 16
    # at 64 KB a block (512 threads; one pack more a block and the row goes uncached). layer_norm
    # (not rms_norm) rows of 32-64 KB split into 2 (session 38): 12296 float32, 30000 bf16 columns.
    # y and the gradients against the references.
    _check_both_grads(*_check_forward(key, dtype, rows, cols, 3.0), dtype)


@gpu_only
def test_split_rows_backward_vmap_gpu(key):
    # Two groups (a batched scale under vmap): each cluster's slots belong to one group.
    k1, k2, k3 = jax.random.split(key, 3)
    x = normal(k1, (2, 50, 12288), jnp.bfloat16)
    scale = (1.0 + 0.1 * normal(k2, (2, 12288), jnp.float32)).astype(jnp.bfloat16)
    w = normal(k3, x.shape, jnp.bfloat16)

    def loss(f):
        return lambda x, s: jnp.sum((jax.vmap(f)(x, s) * w).astype(jnp.float32))

    got = jax.jit(jax.grad(loss(jaxops.rms_norm), (0, 1)))(x, scale)
    want = jax.grad(loss(rms_ref), (0, 1))(x, scale)
    for g, r in zip(got, want):
        close(g, r, jnp.bfloat16, 2.0)


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("cols", [12, 16, 24, 32, 64, 100, 128, 136, 256])
def test_narrow_team_forward_gpu(key, dtype, cols):
    # The lean narrow forward (blocks of 128 threads, a grid-stride loop over row groups). Rows of
    # 4 or 5-32 16-byte packs: one row a team of half the lanes, two packs a lane (16-bit session
    # 48, float32 session 49), pack k of lane l at l + k * lanes: float32 16 columns 2 lanes, 24
    # columns (6 packs) 4 lanes where lanes 0-1 have a second pack, 100 columns (25 packs) 16 lanes
    # where lanes 0-8 do, 128 columns 16 lanes with both full; 16-bit 32 columns 2 lanes, 136
    # columns (17 packs) 16 lanes where only lane 0 has a second pack, 256 columns 16 lanes full.
    # Rows of 1-3 packs (float32 12 columns, 16-bit 16 and 24): one pack a lane, two rows a team
    # (rows base + r * teams + team): 40013 rows leave a partial last iteration (16-bit 24 columns:
    # 32 teams of 4 lanes, the last idle, 64 rows an iteration, 13 left: teams 0-12 one row each).
    # 16-bit 12 and 100 columns are not whole packs: one-element packs, forward_lean on 8 lanes of
    # two at 12 and 16 lanes of 8 at 100 (session 53). At 128 columns the grid (<= 132
    # SMs x blocks per SM) is smaller than the iterations: the grid-stride loop runs.
    # The gradients use the forward's saved mean/rstd of every row.
    rows = 40013
    k1, k2 = jax.random.split(key)
    x = normal(k1, (rows, cols), dtype, scale=2.0) + jnp.asarray(1.5, dtype)
    scale, bias = params(k2, cols, dtype)
    close(jaxops.layer_norm(x, scale, bias), ln_ref(x, scale, bias), dtype)
    close(jaxops.rms_norm(x, scale), rms_ref(x, scale), dtype)
    _check_both_grads(x, scale, bias, dtype)


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("cols", [132, 200, 252, 256])
def test_team_lean_backward_gpu(key, dtype, cols):
    # backward_team_lean (session 50). float32 rows of 33-63 packs: two packs a lane over a full
    # warp (132 columns: only lane 0 has a second pack; 200: lanes 0-17; 252: all but lane 31);
    # 256 (64 packs) keeps backward_team. 16-bit 200 / 256 columns: one pack a lane (25 / 32
    # packs); 132 / 252 are not whole packs (scalar packs: full-warp teams of 8 elements a lane).
    # 40013 rows leave a partial last iteration of teams; per-example parameters (vmap) run it
    # with groups, and the grouped check also wants dscale / dbias bit-identical over two runs.
    x, scale, bias = _check_forward(key, dtype, 40013, cols, 3.0)
    _check_both_grads(x, scale, bias, dtype)
    _check_grouped(key, dtype, 3, 701, cols)


def test_misaligned_rows_fall_back_to_scalar_packs(key):
    # cols not a multiple of the 16-byte pack: scalar loads in every path.
    k1, k2 = jax.random.split(key)
    for cols in (31, 33, 1023, 2047, 6001) if ON_GPU else (33, 1023):
        x = normal(k1, (9, cols), jnp.bfloat16)
        scale, bias = params(k2, cols, jnp.bfloat16)
        close(jaxops.layer_norm(x, scale, bias), ln_ref(x, scale, bias), jnp.bfloat16)
        close(jaxops.rms_norm(x, scale), rms_ref(x, scale), jnp.bfloat16)


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("cols", [5, 21, 31, 33, 63, 97, 131, 255, 257, 509, 1001, 2047])
def test_misaligned_rows_gpu(key, dtype, cols):
    # Rows that are not whole 16-byte packs (float32 odd widths; 16-bit widths not a multiple of
    # 8) take one-element packs. Up to 256 columns the lean team kernels (session 53; float32
    # rms_norm's backward, one-column backwards and per-example parameters' forward keep the older
    # teams). Forward: 5 columns 4 lanes of 2, 21 and 31 8 lanes of 4 (21: lanes 5-7 idle in the
    # third round, all in the fourth), 33 and 63 16 lanes of 4, 97 16 lanes of 8, 131-256 a full
    # warp of 8 (float32: 16 lanes of 16, two rows a warp, session 58). Backward: one element a
    # lane up to 32 columns, then a full warp of 2-8 (16-bit rms_norm 129-256: 16 lanes of 16, two
    # rows a warp, session 59). One block a row past 256. Forward past 256: a warp a row up to 1024 columns (session 56,
    # forward_warp_skew: 1-8 packs a lane between a head and a tail, the row's own skew at each of
    # 3001 rows), forward_block_skew past that (2047); per-example parameters under vmap
    # forward_block. Backward past 256: 257 / 509 on the lean team, 16 elements a lane (sessions
    # 57-58), backward_block_skew past 512 (1001, 2047). 3001 rows leave partial
    # iterations. Both gradients; per-example parameters under vmap, with dscale / dbias
    # bit-identical over two runs.
    x, scale, bias = _check_forward(key, dtype, 3001, cols, 3.0)
    _check_both_grads(x, scale, bias, dtype)
    _check_grouped(key, dtype, 3, 101, cols)


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("cols", [66, 98, 126, 132, 196, 252])
def test_eight_byte_rows_gpu(key, dtype, cols):
    # Rows whose width is a whole number of 8-byte packs but not of 16-byte ones (16-bit 132, 196,
    # 252 columns: 33-63 packs of 4; float32 66, 98, 126: 33-63 packs of 2), the widths where an
    # 8-byte pack is the widest aligned load of every row. Since session 59 the lean teams take
    # them in 8-byte packs: forward 8 lanes of 5-7 packs up to 56 packs (132, 196; float32 66, 98),
    # 16 lanes of 4 past that (252, 126); backward 16 lanes of 3 up to 48 packs (132; float32 66),
    # 16-bit 32 lanes of 2 past that (196, 252); float32 past 48 packs (98, 126) and per-example
    # parameters' forward keep single elements. The checks are the misaligned rows' (both ops,
    # both gradients, per-example parameters), on 3001 rows so that the last iteration of every
    # team is partial.
    x, scale, bias = _check_forward(key, dtype, 3001, cols, 3.0)
    _check_both_grads(x, scale, bias, dtype)
    _check_grouped(key, dtype, 3, 101, cols)


def _check_lean_forward(key, dtype, rows, cols, grad_rows, vmap_rows):
    """The lean forward kernels' checks: both ops against the references, y against the float64
    formula, gradients through the saved mean / rstd, and per-example parameters under vmap (the
    team widths take forward_team; block widths forward_block_lean with groups since session 41)."""
    k1, k2 = jax.random.split(key)
    x = normal(k1, (rows, cols), dtype, scale=2.0) + jnp.asarray(3.0, dtype)
    scale, bias = params(k2, cols, dtype)
    close(jaxops.layer_norm(x, scale, bias), ln_ref(x, scale, bias), dtype)
    close(jaxops.rms_norm(x, scale), rms_ref(x, scale), dtype)
    assert_unit_layer_norm(jaxops.layer_norm(x, jnp.ones_like(scale), jnp.zeros_like(bias)), x, dtype)
    _check_both_grads(x[:grad_rows], scale, bias, dtype)
    xs = x[:3 * vmap_rows].reshape(3, vmap_rows, cols)
    s3 = jnp.stack([scale, bias, scale])
    b3 = jnp.stack([bias, scale, bias])
    close(jax.vmap(jaxops.layer_norm)(xs, s3, b3), jax.vmap(ln_ref)(xs, s3, b3), dtype)


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("cols", [8, 16, 24, 40, 72, 128, 136, 264, 520, 776, 1024])
def test_lean_team_forward_gpu(key, dtype, cols):
    # forward_lean (session 5): every team width (1..32 lanes of one pack; 8 columns of 16-bit =
    # 1 lane, 24/40/72/136 = lanes past the row's last pack), wide teams of 2/4/8 packs with a
    # partial last round (264, 520, 776 columns), odd row counts (partial last block and float's
    # partial last 2-row team), rows
    # off zero (the row shift comes from lane 0 by a shuffle), and the saved mean / rstd, checked
    # through the residuals against the float64 formula. Per-example parameters (vmap, groups > 1)
    # take forward_team: checked too.
    _check_lean_forward(key, dtype, rows=3001, cols=cols, grad_rows=3001, vmap_rows=20)


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("cols", [1032, 1536, 2048])
@pytest.mark.parametrize("widest", ["1", "0"])
def test_widest_team_forward_gpu(key, monkeypatch, widest, dtype, cols):
    # 1032-2048 columns: the widest lean team (session 33: a warp per row, 64 values a lane,
    # 16-bit 8 packs / float 16; 1032 / 1536 leave lanes or rounds past the row) or
    # forward_block_lean, each forced (JAXOPS_LN_FWD_WIDE) whichever the launcher would pick.
    monkeypatch.setenv("JAXOPS_LN_FWD_WIDE", widest)
    _check_lean_forward(key, dtype, rows=3001, cols=cols, grad_rows=1000, vmap_rows=20)


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("cols", [2056, 4096, 6152, 8192, 12296, 16384])
def test_lean_block_forward_gpu(key, dtype, cols):
    # forward_block_lean (session 5): one block per row, row cached in shared memory, for 16-byte
    # packs with one parameter group, past the widest team (2048 columns). layer_norm rows of
    # 16-32 KB (16-bit 12296 / 16384; float32 8-32 KB since session 46: 2056-8192) take
    # forward_block_async instead (session 41: next row by cp.async, persistent grid, 2500 rows =
    # several a block), 16-bit rows of 8-16 KB (6152 / 8192) forward_block_async_held (session 46:
    # the same with the parameters in registers).
    # 2056 / 6152 leave the last load chunk of 4 packs a thread partly past the row; rows far
    # from zero check the shift (first element) and the saved mean / rstd (through the gradients
    # and the float64 formula). Per-example parameters (vmap, groups > 1) take forward_block_lean
    # with groups (session 41; forward_block before): checked too.
    _check_lean_forward(key, dtype, rows=2500, cols=cols, grad_rows=600, vmap_rows=10)


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows", [1, 3, 9, 131, 4103])
@pytest.mark.parametrize("cols", [8, 128, 1024, 1536, 2056, 4096, 8192])
def test_forward_grid_partial_blocks_gpu(key, dtype, rows, cols):
    # Non-persistent forward grids (session 5: grid = ceil(rows / rows a block), one row group a
    # block): row counts that leave the last block partly empty (lean team blocks hold 4-256 rows:
    # rows of 4 or 5-32 16-byte packs one a team, other narrow rows two) or give fewer blocks than
    # SMs, for the narrow (8, 128), wide (1024, 1536) and block (2056, 4096) lean kernels;
    # float32 2056-8192 and 16-bit 8192: the persistent forward_block_async and
    # forward_block_async_held with fewer rows than blocks (a block's only request is its first row).
    _check_forward(key, dtype, rows, cols, 1.5)


@gpu_only
@pytest.mark.parametrize("rows,cols", [(8 * 65537 + 5, 128), (65539, 2056)])
def test_forward_large_grid_gpu(key, rows, cols):
    # The largest grids the tests can afford (135-270 MB of bfloat16): bfloat16 128 columns (8 rows
    # a block: 65538 blocks, the last with 5 rows) and 2056 columns (forward_block_lean, one row a
    # block: 65539 blocks), past the 65535 limit of the other grid dimensions and with 64-bit row
    # offsets past 2^26 elements. Every row is checked against the reference.
    k1, k2 = jax.random.split(key)
    x = normal(k1, (rows, cols), jnp.bfloat16) + jnp.asarray(1.0, jnp.bfloat16)
    scale, bias = params(k2, cols, jnp.bfloat16)
    close(jaxops.layer_norm(x, scale, bias), ln_ref(x, scale, bias), jnp.bfloat16)
    close(jaxops.rms_norm(x, scale), rms_ref(x, scale), jnp.bfloat16)


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows,cols", [(5000, 2056), (3001, 4096), (263, 6152), (1100, 8192),
                                       (7000, 1024), (3001, 520), (263, 776)])
def test_lean_backward_rows_gpu(key, dtype, rows, cols):
    # backward_rows_lean (session 5, 16-bit 2048-8192 columns; session 6 also 520-1024 columns, one
    # pack a thread, and the next-row prefetch at <= 4096 columns): column sums in shared memory,
    # several rows a slot (5000 / <= 528 slots -> >= 9 a slot; 3001 -> >= 5, uneven; 7000 -> 13-14),
    # so the prefetched row is used, fewer rows than slots (263: one row a slot, one slot empty),
    # partial last packs (2056 = 257 packs over 2 a thread, 6152 = 769) and idle threads (520 = 65
    # packs on 96 threads, 776 = 97 on 128), rows off zero. layer_norm past 6144 columns takes
    # backward_rows_lean_1024 (session 42: one pack a thread, 6152 = 769 packs on 800 threads).
    # dx / dscale / dbias against the formula for both ops, and dscale / dbias bit-identical over
    # two runs (fixed-order sums).
    k1, k2 = jax.random.split(key)
    x = normal(k1, (rows, cols), dtype) + jnp.asarray(2.0, dtype)
    scale, bias = params(k2, cols, dtype)
    _check_both_grads(x, scale, bias, dtype)
    w = _check_param_grads_repeat(x, scale, bias, dtype, jax.random.key(3))
    if cols in (1024, 4096, 8192):  # per-example parameters (vmap: groups > 1, each its own slots)
        xs = x[:600].reshape(3, 200, cols)
        s3, b3 = jnp.stack([scale, bias, scale]), jnp.stack([bias, scale, bias])
        ws = w[:600].reshape(3, 200, cols)

        def loss(fn):
            return lambda x, s, b: jnp.sum((jax.vmap(fn)(x, s, b) * ws).astype(jnp.float32))

        got = jax.jit(jax.grad(loss(jaxops.layer_norm), (0, 1, 2)))(xs, s3, b3)
        want = jax.grad(loss(ln_ref), (0, 1, 2))(xs, s3, b3)
        for u, v in zip(got, want):
            close(u, v, dtype, 2.0)
