"""softmax / log_softmax against jax.nn on fresh random data, every path, dtype and transform."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxops
from helpers import FLOAT_DTYPES, ON_GPU, assert_close, gpu_only, normal, skip_f64_without_x64, tol

OPS = {"softmax": (jaxops.softmax, jax.nn.softmax), "log_softmax": (jaxops.log_softmax, jax.nn.log_softmax)}

# Row lengths covering every kernel path: warp groups of 1..32 lanes, 1..32 values a lane,
# odd widths (scalar packs), block/cluster-cached rows, and rows beyond any cluster's shared memory.
COLS = [1, 2, 3, 31, 32, 33, 100, 1000, 1024, 1025, 4097, 12289, 70001, 262144]
BEYOND_SMEM_COLS = (1 << 20) + 3  # > 16 blocks x 227 KB of float32


def reference(name, x, axis=-1, where=None):
    """jax.nn in float64 (float32 without x64) to compare against."""
    ref_dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    return OPS[name][1](x.astype(ref_dtype), axis=axis, where=where)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("cols", COLS)
def test_row_lengths_float32(name, cols, key):
    rows = 3 if cols > 10000 else 37
    x = normal(key, (rows, cols), jnp.float32, scale=3.0)
    assert_close(OPS[name][0](x), reference(name, x), jnp.float32)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("cols", [1, 33, 1024, 1030, 4096, 20000])
def test_dtypes(name, dtype, cols, key):
    skip_f64_without_x64(dtype)
    x = normal(key, (5, cols), dtype, scale=2.0)
    y = OPS[name][0](x)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, reference(name, x), dtype)


@pytest.mark.parametrize("name", OPS)
def test_beyond_shared_memory(name, key):
    x = normal(key, (2, BEYOND_SMEM_COLS), jnp.float32, scale=4.0)
    assert_close(OPS[name][0](x), reference(name, x), jnp.float32, rtol=1e-4)


@pytest.mark.parametrize("name", OPS)
def test_many_rows(name, key):
    x = normal(key, (4099, 64), jnp.bfloat16)
    assert_close(OPS[name][0](x), reference(name, x), jnp.bfloat16)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("axis", [0, 1, -2, (0, 2), None])
def test_axes(name, axis, key):
    x = normal(key, (6, 7, 9), jnp.float32)
    assert_close(OPS[name][0](x, axis=axis), reference(name, x, axis=axis), jnp.float32)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("cols", [5, 64, 1000, 3000, 70001])
def test_where_with_fully_masked_rows(name, cols, key):
    kx, km = jax.random.split(key)
    x = normal(kx, (4, cols), jnp.float32)
    where = jax.random.bernoulli(km, 0.6, (4, cols)).at[1].set(False).at[2].set(True)
    y = OPS[name][0](x, where=where)
    assert_close(y, reference(name, x, where=where), jnp.float32)
    assert np.all(np.asarray(y[1]) == (0.0 if name == "softmax" else -np.inf))


@pytest.mark.parametrize("dtype,cols", [(jnp.bfloat16, 1_500_000), (jnp.float32, 800_000)])
def test_masked_rows_whose_mask_does_not_fit_the_cache(dtype, cols, key):
    """Rows that 16 blocks of shared memory cache without their mask (one byte a column) but not
    with it (H100: bf16 1.23M-1.85M columns, float32 741K-926K): the masked cp.async kernel must
    not run on a plan sized for the values alone (it wrote its mask slice past the cache); they
    take the uncached path. Forward and backward; row 1 fully masked."""
    kx, kw, km = jax.random.split(key, 3)
    x = normal(kx, (2, cols), dtype, scale=3.0)
    where = jax.random.bernoulli(km, 0.8, (2, cols)).at[1].set(False)
    cot = jnp.where(where, normal(kw, (2, cols), dtype), 0)
    for name in OPS:
        y, vjp = jax.vjp(lambda a: OPS[name][0](a, where=where), x)
        assert_close(y, reference(name, x, where=where), dtype, **({"rtol": 1e-4} if dtype == jnp.float32 else {}))
        want = jnp.where(where, backward_from_y(name, y, cot), 0)
        scale = float(jnp.max(jnp.abs(want)))
        assert_close(vjp(cot)[0], want, dtype, atol=tol(dtype)["atol"] * scale)


@pytest.mark.parametrize("name", OPS)
def test_where_broadcasts(name, key):
    x = normal(key, (3, 4, 50), jnp.float32)
    where = jnp.arange(50) % 3 != 0
    assert_close(OPS[name][0](x, where=where), reference(name, x, where=where), jnp.float32)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("cols", [8, 1000, 5000])
def test_inf_and_nan(name, cols, key):
    x = np.array(normal(key, (6, cols), jnp.float32))
    x[0, 3] = np.inf      # +inf: the whole row is NaN, like jax.nn
    x[1, :] = -np.inf     # all -inf: NaN
    x[2, 5] = np.nan      # NaN propagates
    x[3, ::2] = -np.inf   # some -inf: zero probability
    x[4, 1] = -np.inf
    x = jnp.asarray(x)
    assert_close(OPS[name][0](x), reference(name, x), jnp.float32)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("shape", [(0,), (0, 5), (5, 0), (2, 0, 3)])
def test_empty(name, shape):
    x = jnp.zeros(shape, jnp.float32)
    y = OPS[name][0](x)
    assert y.shape == shape and y.dtype == x.dtype


@pytest.mark.parametrize("name", OPS)
def test_jit_and_nested_vmap(name, key):
    x = normal(key, (3, 5, 4, 33), jnp.float32)
    f = jax.jit(jax.vmap(jax.vmap(OPS[name][0], in_axes=1), in_axes=2))
    g = jax.vmap(jax.vmap(functools.partial(reference, name), in_axes=1), in_axes=2)
    assert_close(f(x), g(x), jnp.float32)


@pytest.mark.parametrize("name", OPS)
def test_vmap_with_where_and_axis(name, key):
    kx, km = jax.random.split(key)
    x = normal(kx, (6, 40, 4), jnp.float32)
    where = jax.random.bernoulli(km, 0.7, (6, 40))
    f = jax.vmap(lambda a: OPS[name][0](a, axis=0, where=where), in_axes=2, out_axes=2)
    g = jax.vmap(lambda a: reference(name, a, axis=0, where=where), in_axes=2, out_axes=2)
    assert_close(f(x), g(x), jnp.float32)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("cols", [7, 33, 1500])
def test_check_grads(name, cols, key):
    x = normal(key, (3, cols), jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
    check_grads(lambda a: OPS[name][0](a), (x,), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("cols", [1, 40, 1024, 3000, 70001])
@pytest.mark.parametrize("masked", [False, True])
def test_grad_matches_jax(name, dtype, cols, masked, key):
    kx, kw, km = jax.random.split(key, 3)
    x = normal(kx, (3, cols), dtype)
    w = normal(kw, (3, cols), dtype)
    where = jax.random.bernoulli(km, 0.7, (3, cols)).at[0].set(False) if masked else None

    def loss(fn, a):
        y = fn(a, where=where)
        y = jnp.where(jnp.isfinite(y), y, 0)  # masked log_softmax entries are -inf
        return jnp.sum(y.astype(jnp.float32) * w.astype(jnp.float32))

    got = jax.grad(functools.partial(loss, OPS[name][0]))(x)
    want = jax.grad(functools.partial(loss, lambda a, where: reference(name, a, where=where)))(x)
    assert_close(got, want.astype(dtype), dtype, atol=1e-5 if dtype == jnp.float32 else 2e-2)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("cols", [77, 1001, 5000])
def test_masked_grad_in_rows_with_nan_and_inf(name, cols, key):
    """jax.nn gives masked entries no gradient, also in rows whose output is NaN (a NaN, +inf or
    all -inf among the unmasked entries), and masked cotangents (here NaN) take no part."""
    kx, kw, km = jax.random.split(key, 3)
    x = np.array(normal(kx, (8, cols), jnp.float32, scale=3.0))
    x[1, 3], x[2, 4], x[3, :] = np.nan, np.inf, -np.inf
    x = jnp.asarray(x)
    where = jax.random.bernoulli(km, 0.7, (8, cols)).at[:, 3:5].set(True).at[:, 0].set(False)
    w = jnp.where(where, normal(kw, (8, cols), jnp.float32), np.nan)
    _, vjp = jax.vjp(lambda a: OPS[name][0](a, where=where), x)
    _, ref_vjp = jax.vjp(lambda a: OPS[name][1](a, where=where), x)
    got = vjp(w)[0]
    assert_close(got, ref_vjp(w)[0], jnp.float32, atol=1e-6)
    assert np.all(np.asarray(got)[~np.asarray(where)] == 0)


@pytest.mark.parametrize("name", OPS)
def test_grad_under_jit_and_axis(name, key):
    x = normal(key, (5, 6, 7), jnp.float32)
    f = jax.jit(jax.grad(lambda a: jnp.sum(OPS[name][0](a, axis=1) ** 2)))
    g = jax.grad(lambda a: jnp.sum(reference(name, a, axis=1) ** 2))
    assert_close(f(x), g(x), jnp.float32, atol=1e-6)


def test_bad_input():
    x = jnp.ones((3, 4), jnp.float32)
    with pytest.raises(TypeError, match=r"jaxops\.softmax: x must be float.*int32"):
        jaxops.softmax(jnp.ones((3, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"jaxops\.log_softmax: axis 2 is out of bounds"):
        jaxops.log_softmax(x, axis=2)
    with pytest.raises(ValueError, match=r"jaxops\.softmax: repeated axis"):
        jaxops.softmax(x, axis=(0, 0))
    with pytest.raises(ValueError, match=r"jaxops\.softmax: where of shape \(5,\)"):
        jaxops.softmax(x, where=jnp.ones((5,), bool))
    with pytest.raises(TypeError, match=r"jaxops\.softmax: where must be a boolean"):
        jaxops.softmax(x, where=jnp.ones((3, 4), jnp.float32))
    with pytest.raises(ValueError, match=r"jaxops\.softmax: x must have at least one dimension"):
        jaxops.softmax(jnp.float32(1.0))


def test_handler_rejects_bad_buffers():
    """The C++ handler validates again: a mask of the wrong shape is an FFI error, not a crash."""
    call = jax.ffi.ffi_call("jaxops_softmax_fwd", jax.ShapeDtypeStruct((2, 3), jnp.float32))
    with pytest.raises(Exception, match="where must have the shape of x"):
        jax.block_until_ready(call(jnp.ones((2, 3), jnp.float32), jnp.ones((5,), bool),
                                   log=np.int64(0), masked=np.int64(1)))
    call = jax.ffi.ffi_call("jaxops_softmax_fwd", jax.ShapeDtypeStruct((2, 3), jnp.int32))
    with pytest.raises(Exception, match="unsupported element type"):
        jax.block_until_ready(call(jnp.ones((2, 3), jnp.int32), jnp.ones((), bool),
                                   log=np.int64(0), masked=np.int64(0)))


@gpu_only
def test_more_than_2_to_31_elements():
    rows, cols = (1 << 21) + 1, 1024  # 2^31 + 1024 bfloat16 elements
    x = jax.random.normal(jax.random.key(7), (rows, cols), jnp.bfloat16)
    y = jaxops.softmax(x)
    tail = x[-3:]
    assert_close(y[-3:], reference("softmax", tail), jnp.bfloat16)
    assert_close(y[:2], reference("softmax", x[:2]), jnp.bfloat16)


@gpu_only
@pytest.mark.parametrize("cols", [1 << 15, 1 << 17, 1 << 18])
def test_cluster_paths_bfloat16(cols, key):
    x = normal(key, (9, cols), jnp.bfloat16, scale=3.0)
    for name in OPS:
        assert_close(OPS[name][0](x), reference(name, x), jnp.bfloat16)
    assert ON_GPU


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("cols", [131072, 262144, 262152])
def test_special_values_across_cluster_slices(dtype, cols, key):
    """Unmasked rows on clusters of 4-16 blocks reduce one (max, sum) pair a row (session 12):
    each block's partial statistics merge across the cluster, so -inf, +inf and NaN must combine
    as in jax.nn whichever block's slice holds them: finite values only in the last slice (every
    other block sums nothing) or only in the first, all -inf, +inf or NaN in one slice, -inf on
    every other element, large equal values. 100 rows: each cluster loops over several rows,
    alternating its reduction slots; the special rows repeat in the second half of the grid."""
    rows = 100
    x = np.array(normal(key, (rows, cols), jnp.float32, scale=3.0))
    for r in (0, 57):
        x[r, : cols - 1000] = -np.inf
        x[r + 1, :] = -np.inf
        x[r + 2, 7] = np.inf
        x[r + 3, cols - 5] = np.nan
        x[r + 4, ::2] = -np.inf
        x[r + 5, :] = 60.0
        x[r + 6, 1000:] = -np.inf
    x = jnp.asarray(x, dtype)
    for name in OPS:
        assert_close(OPS[name][0](x), reference(name, x), dtype)
    assert ON_GPU


@gpu_only
@pytest.mark.parametrize("rows,cols", [(2000, 8192), (600, 32768), (64, 262144)])
@pytest.mark.parametrize("masked", [False, True])
def test_cached_paths_reuse_cache_across_rows(rows, cols, masked, key):
    """More rows than resident blocks/clusters. The backward, the masked forward and the unmasked
    forward of long rows (32768+ columns: persistent grid) loop each block or cluster over several
    rows, refilling its shared-memory cache (asynchronously when unmasked) after the previous
    row's output pass; the unmasked forward at 8192 columns launches one block per row (thousands
    of blocks). Forward and backward, every row checked."""
    kx, kw, km = jax.random.split(key, 3)
    x = normal(kx, (rows, cols), jnp.float32, scale=3.0)
    w = normal(kw, (rows, cols), jnp.float32)
    where = jax.random.bernoulli(km, 0.8, (rows, cols)) if masked else None
    for name in OPS:
        assert_close(OPS[name][0](x, where=where), reference(name, x, where=where), jnp.float32)
        _, vjp = jax.vjp(lambda a: OPS[name][0](a, where=where), x)
        _, ref_vjp = jax.vjp(lambda a: OPS[name][1](a, where=where), x)
        cot = jnp.where(where, w, 0) if masked else w  # masked log_softmax outputs are -inf
        assert_close(vjp(cot)[0], ref_vjp(cot)[0], jnp.float32, atol=1e-5)
    assert ON_GPU


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64])
@pytest.mark.parametrize("rows,cols", [(5000, 1028), (3000, 4096), (2000, 8192), (3000, 12292), (1500, 32772),
                                       (600, 131076)])
@pytest.mark.parametrize("masked", [False, True])
def test_cached_forward_refill_across_rows(dtype, rows, cols, masked, key):
    """Thousands of rows in every dtype. Unmasked 16-bit/float32 rows of up to one block's cache
    budget (1028-8192 columns) run the unmaskable kernel with one block per row (a grid of
    thousands of blocks; odd packs a thread at 1028 columns); longer rows its persistent grid,
    each block or cluster requesting its next row while writing the current one (several rows a
    cluster), with slices of up to 32 KB: float32 12292 columns 2-block clusters, 32772 / 131076
    columns larger ones (short last slices). float64 unmasked rows take the maskable kernel's
    persistent grid with the same refill (32 KB slices); masked rows the maskable kernel without
    it. Every row checked."""
    skip_f64_without_x64(dtype)
    kx, km = jax.random.split(key)
    x = normal(kx, (rows, cols), dtype, scale=3.0)
    where = jax.random.bernoulli(km, 0.8, (rows, cols)) if masked else None
    for name in OPS:
        assert_close(OPS[name][0](x, where=where), reference(name, x, where=where), dtype)
    assert ON_GPU


def backward_from_y(name, y, w):
    """The backward formula applied to the kernel's own y (in its dtype), in float64 where x64 is
    on: judges only the backward kernel, not the forward's rounding."""
    yr = y.astype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
    g = w.astype(yr.dtype)
    if name == "softmax":
        return yr * (g - jnp.sum(yr * g, axis=-1, keepdims=True))
    return g - jnp.exp(yr) * jnp.sum(g, axis=-1, keepdims=True)


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("cols", [4, 8, 16, 32, 64, 128, 256, 512, 768, 1024])
def test_every_warp_shape_over_many_rows(dtype, cols, key):
    """Every warp-group width with (at least) two packs a lane over many rows: the forward
    launches one row group per warp (tens of thousands of blocks); the backward's grid is capped
    at 32 blocks an SM, so each of its warps loops over several row groups. float32 backward rows
    of 768 and 1024 columns take the cached kernel instead (one block a row)."""
    rows = 600_000 if cols <= 64 else 40_000
    kx, kw = jax.random.split(key)
    x = normal(kx, (rows, cols), dtype, scale=3.0)
    w = normal(kw, (rows, cols), dtype)
    for name in OPS:
        y, vjp = jax.vjp(OPS[name][0], x)
        assert_close(y, reference(name, x), dtype)
        want = backward_from_y(name, y, w)
        assert_close(vjp(w)[0], want, dtype, **({"atol": 1e-5} if dtype == jnp.float32 else {}))
    assert ON_GPU


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("cols", [32, 128, 1024, 8192])
def test_inf_and_nan_in_16_bit_packs(name, dtype, cols, key):
    """16-bit rows take the packed paths (session 5): max over bf16x2/f16x2 pairs (HMNMX2.NAN),
    exp as ex2.approx with the max folded into one FFMA, pairwise conversions. NaN must win the
    packed max at every position of a pack, +inf/-inf must give jax.nn's NaN and zeros; warp
    (32/128/1024 columns) and cached (8192) paths, rows at several positions in the grid."""
    rows = 40
    x = np.array(normal(key, (rows, cols), jnp.float32, scale=3.0))
    for p in range(8):  # one special value at each position within a 16-byte pack
        x[p, (9 * p) % cols] = np.nan
        x[8 + p, (9 * p + 8) % cols] = np.inf
        x[16 + p, p] = -np.inf
    x[24, :] = -np.inf
    x[25, ::3] = -np.inf
    x[26, :] = 60.0  # large equal values: exp(0) everywhere, sum = cols
    x = jnp.asarray(x, dtype)
    assert_close(OPS[name][0](x), reference(name, x), dtype)


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("rows,cols", [(37, 262144), (20, 262152), (300, 131072), (1500, 32776), (3000, 5000)])
def test_lean_backward_over_rows(dtype, rows, cols, key):
    """The unmasked cached backward on a persistent grid (session 6's lean kernel: y and dy
    requested by cp.async, each block refilling its cache with its next row while writing dx).
    float32 at 262144/262152 columns: 16-block clusters of one block an SM, the only plans here
    whose blocks also have L2 prefetch their next row while the grid reduces (37 and 20 rows:
    not multiples of the resident clusters, so clusters finish different row counts); every
    other case runs the kernel without the prefetch. 262152 and 32776: a short last slice in
    every dtype (262152 float32: the prefetch clamped to it); 131072 and 16-bit 262144: 16-block
    clusters of several blocks an SM; 32776: 16-block (float32) and 8-block (16-bit) clusters
    over 1500 rows; 5000 float32: 2-block clusters (16-bit 5000 fits one block: the
    register-staged kernel). Row 0 of the cotangent carries a NaN and row 1 a +inf (a NaN
    row and a -inf/NaN row out). Judged against the formula applied to the kernel's own y."""
    kx, kw = jax.random.split(key)
    x = normal(kx, (rows, cols), dtype, scale=3.0)
    w = np.array(normal(kw, (rows, cols), jnp.float32))
    w[0, 5] = np.nan
    w[1, 7] = np.inf
    w = jnp.asarray(w, dtype)
    for name in OPS:
        y, vjp = jax.vjp(OPS[name][0], x)
        want = backward_from_y(name, y, w)
        got = vjp(w)[0]
        assert got.dtype == dtype
        # Softmax's dx is ~1/cols in size: an absolute tolerance relative to the largest value.
        scale = float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(want), want, 0))))
        assert_close(got, want, dtype, atol=tol(dtype)["atol"] * scale)
        assert bool(jnp.all(jnp.isnan(got[0])))
    assert ON_GPU


@gpu_only
@pytest.mark.parametrize("fast_dram", ["0", "1"])
@pytest.mark.parametrize("dtype,rows,cols,masked", [
    (jnp.float32, 700, 16384, False), (jnp.float32, 900, 12292, True), (jnp.float32, 1200, 8192, False),
    (jnp.bfloat16, 700, 32768, False), (jnp.bfloat16, 1500, 16384, True), (jnp.float16, 800, 24580, False)])
def test_one_block_rows_by_dram_speed(monkeypatch, fast_dram, dtype, rows, cols, masked, key):
    """Rows whose cached bytes are 32-64 KB take one 64 KB block a row where DRAM does not outrun
    the SMs (H100; cc/softmax/softmax_plan.cuh, cached_bytes_per_block): the forward one block a
    row, the backward the register-staged kernel; elsewhere a cluster of two 32 KB blocks on the
    persistent grid. JAXOPS_FAST_DRAM forces each plan (the plan memo keys on it), so either chip
    runs both: float32 16384 / bf16 32768 forwards (64 KB), float32 12292 masked (49 KB with the
    mask), float32 8192 and bf16 16384 backwards (y and dy: 64 KB), an f16 window row (24580).
    Forward against jax.nn, backward against the formula on the kernel's own y; row 0 of the
    cotangent carries a NaN."""
    monkeypatch.setenv("JAXOPS_FAST_DRAM", fast_dram)
    kx, kw, km = jax.random.split(key, 3)
    x = normal(kx, (rows, cols), dtype, scale=3.0)
    where = jax.random.bernoulli(km, 0.8, (rows, cols)) if masked else None
    w = np.array(normal(kw, (rows, cols), jnp.float32))
    w[0, 5] = np.nan
    w = jnp.asarray(w, dtype)
    for name in OPS:
        assert_close(OPS[name][0](x, where=where), reference(name, x, where=where), dtype)
        if masked:
            continue
        y, vjp = jax.vjp(OPS[name][0], x)
        want = backward_from_y(name, y, w)
        scale = float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(want), want, 0))))
        got = vjp(w)[0]
        assert_close(got, want, dtype, atol=tol(dtype)["atol"] * scale)
        assert bool(jnp.all(jnp.isnan(got[0])))
    assert ON_GPU


def _special_neighbours(x):
    """At any width that is not whole packs, a row's first and last 16-byte packs hold its
    neighbours' elements: row 4 sits between a NaN (row 3's last element) and +inf (row 5's
    first) and must stay finite; row 7 is all -inf, row 9 -inf on every other element."""
    x[3, -1] = np.nan
    x[5, 0] = np.inf
    x[7, :] = -np.inf
    x[9, ::2] = -np.inf
    return x


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("rows,cols", [(100_001, 5), (262_145, 77), (13_107, 197), (4_001, 1017), (3_001, 1018),
                                       (2_001, 1025), (1_201, 4097), (407, 30522), (301, 50257), (17, 131075)])
def test_rows_not_whole_packs(dtype, rows, cols, key):
    """Rows that are not whole 16-byte packs read and write whole packs through their aligned
    windows (session 29): the window's first and last packs are shared with the neighbouring rows,
    whose elements must count as -inf (forward) or 0 (backward) and must not be overwritten.
    Odd row counts: the array's last pack reaches past its end and is loaded element by element.
    Widths cover the warp path (5 .. 1017; 1017 bf16 spans exactly 1024 window columns), the
    cached path from 1018 bf16 and from 1017 float32 (its windows leave the warp kernels past 768
    columns forward, 512 backward; one block a row; 1025, 4097), persistent grids that
    prefetch the next row, whose window may hold one pack more (30522, 50257: 2-block clusters,
    several rows a cluster) and 16-block clusters (131075). Special values sit on the packs two
    rows share; forward every row, backward judged on the kernel's own y (NaN and +inf rows in
    the cotangent)."""
    kx, kw = jax.random.split(key)
    x = jnp.asarray(_special_neighbours(np.array(normal(kx, (rows, cols), jnp.float32, scale=3.0))), dtype)
    w = np.array(normal(kw, (rows, cols), jnp.float32))
    w[0, -1] = np.nan  # row 1 of dx sits between a NaN and +inf of the cotangent
    w[2, 0] = np.inf
    w = jnp.asarray(w, dtype)
    for name in OPS:
        y, vjp = jax.vjp(OPS[name][0], x)
        assert_close(y, reference(name, x), dtype)
        assert bool(jnp.all(jnp.isfinite(y[4])))
        want = backward_from_y(name, y, w)
        got = vjp(w)[0]
        scale = float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(want), want, 0))))
        assert_close(got, want, dtype, atol=tol(dtype)["atol"] * scale)
        assert bool(jnp.all(jnp.isnan(got[0]))) and bool(jnp.all(jnp.isfinite(got[1])))
        assert bool(jnp.all(jnp.isfinite(got[4])))
    assert ON_GPU


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("rows,cols", [(20_001, 77), (9_999, 197), (3_001, 601), (3_001, 1001), (1_201, 4097),
                                       (301, 50257), (17, 131075)])
def test_masked_rows_not_whole_packs(dtype, rows, cols, key):
    """`where` on rows that are not whole packs: the warp kernels read the mask through the same
    windows (77, 197, 601 bf16, 1001 bf16 forward); the cached kernels request each slice's mask
    with its values by cp.async and prefetch the next row's (601 float32, 1001 backward, 4097 one
    block a row, 50257 persistent grids whose next window may hold one pack more, 131075
    16-block clusters). Row 6 fully masked."""
    kx, kw, km = jax.random.split(key, 3)
    x = jnp.asarray(_special_neighbours(np.array(normal(kx, (rows, cols), jnp.float32, scale=3.0))), dtype)
    w = normal(kw, (rows, cols), dtype)
    where = jax.random.bernoulli(km, 0.7, (rows, cols)).at[6].set(False)
    for name in OPS:
        y, vjp = jax.vjp(lambda a: OPS[name][0](a, where=where), x)
        assert_close(y, reference(name, x, where=where), dtype)
        ref_y, ref_vjp = jax.vjp(lambda a: reference(name, a, where=where), x)
        cot = jnp.where(where, w, 0)  # masked log_softmax outputs are -inf
        got = vjp(cot)[0]
        # The backward on the kernel's own y; masked entries' gradients are 0, also in NaN rows.
        want = jnp.where(where, backward_from_y(name, y, cot), 0)
        scale = float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(want), want, 0))))
        assert_close(got, want, dtype, atol=tol(dtype)["atol"] * scale)
        if dtype == jnp.float32 or cols <= 1001:  # longer bf16 rows: y's rounding dominates
            want = jnp.where(where, ref_vjp(cot.astype(ref_y.dtype))[0], 0)  # jax.nn's are NaN there
            assert_close(got, want.astype(dtype), dtype,
                         **({"atol": 1e-5} if dtype == jnp.float32 else {"atol": 2e-2}))
    assert ON_GPU


# The launchers' rules (softmax_forward.cu, softmax_backward.cu) pick among three kernels for rows
# that are not whole packs: short rows staged by tiles (JAXOPS_SOFTMAX_TILED), the windows of the
# warp and cached kernels (JAXOPS_SOFTMAX_WINDOW), and element loads. Each mode forces one, so
# every kernel of each shape is checked whichever the rules pick. The probe writes x, the
# cotangent, y and dx per case.
_WINDOW_PROBE = """
import sys
import jax, jax.numpy as jnp, numpy as np
import jaxops
out = {}
for i, (rows, cols, dtype, masked) in enumerate([(20001, 77, "bfloat16", False), (20001, 77, "float32", True),
                                                 (9999, 197, "bfloat16", True), (9999, 197, "float32", False),
                                                 (50001, 13, "float32", False), (4001, 1001, "bfloat16", False),
                                                 (301, 50257, "bfloat16", False), (3, 9, "bfloat16", True),
                                                 (70001, 33, "float16", True), (2001, 509, "float32", True),
                                                 (11, 511, "bfloat16", False), (200003, 77, "bfloat16", True)]):
    kx, kw, km = jax.random.split(jax.random.key(i), 3)
    x = np.array(jax.random.normal(kx, (rows, cols), jnp.float32) * 3)
    x[3 % rows, -1], x[5 % rows, 0], x[7 % rows, :] = np.nan, np.inf, -np.inf
    x = jnp.asarray(x, dtype)
    where = jax.random.bernoulli(km, 0.7, (rows, cols)).at[min(9, rows - 1)].set(False) if masked else None
    w = jax.random.normal(kw, (rows, cols), jnp.float32).astype(dtype)
    w = jnp.where(where, w, 0) if masked else w
    for name, f in (("softmax", jaxops.softmax), ("log_softmax", jaxops.log_softmax)):
        y, vjp = jax.vjp(lambda a: f(a, where=where), x)
        key = f"{i}_{name}"
        out[key + "_x"], out[key + "_w"] = np.asarray(x.astype(jnp.float32)), np.asarray(w.astype(jnp.float32))
        out[key + "_y"], out[key + "_dx"] = np.asarray(y.astype(jnp.float32)), np.asarray(vjp(w)[0].astype(jnp.float32))
        out[key + "_m"] = np.asarray(where) if masked else np.ones((rows, cols), bool)
        out[key + "_dtype"] = np.array(dtype)
np.savez(sys.argv[1], **out)
"""


@gpu_only
@pytest.mark.parametrize("mode", ["tiled", "window", "element"])
def test_tiled_window_and_element_kernels_on_the_same_rows(tmp_path, mode):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("JAXOPS_SOFTMAX_WINDOW", "JAXOPS_SOFTMAX_TILED")}
    env.update({"tiled": {"JAXOPS_SOFTMAX_TILED": "1"},
                "window": {"JAXOPS_SOFTMAX_WINDOW": "1", "JAXOPS_SOFTMAX_TILED": "0"},
                "element": {"JAXOPS_SOFTMAX_WINDOW": "0"}}[mode])
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    path = tmp_path / f"{mode}.npz"
    # cwd: from the repository root the source jaxops/ would shadow the installed package.
    subprocess.run([sys.executable, "-c", _WINDOW_PROBE, str(path)], env=env, cwd=tmp_path, check=True, timeout=600)
    got = dict(np.load(path))
    keys = sorted(k[:-2] for k in got if k.endswith("_y"))
    assert len(keys) == 24
    for key in keys:
        name = key.split("_", 1)[1]
        dtype = jnp.dtype(str(got[key + "_dtype"]))
        x, where = jnp.asarray(got[key + "_x"], dtype), jnp.asarray(got[key + "_m"])
        ref_y, ref_vjp = jax.vjp(lambda a: reference(name, a, where=where), x)
        assert_close(jnp.asarray(got[key + "_y"]), ref_y, dtype)
        want = ref_vjp(jnp.asarray(got[key + "_w"], ref_y.dtype))[0].astype(jnp.float32)
        want = jnp.where(where, want, 0)  # masked entries' gradients are 0, also in NaN rows
        scale = float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(want), want, 0))))
        assert_close(jnp.asarray(got[key + "_dx"]), want, dtype, atol=max(tol(dtype)["atol"], 2e-2) * scale)
