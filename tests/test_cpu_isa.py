"""The CPU twins' three code paths: the baseline (SSE2 on x86-64, 4-float vectors), the AVX2+FMA
clone (8-float vectors) and the AVX-512 clone (16-float vectors; not batch_norm or relu) that
cc/common/cpu_vec.h's run_isa picks where the CPU has them. JAXOPS_CPU_ISA=baseline / avx2, read
on every call, forces the baseline / at most the AVX2 clone, so one machine checks every path it
has against the pure-JAX references, at lengths that leave every partial vector, lane block, mask
word offset and pairwise fold its tail."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops
from helpers import ON_GPU, assert_close, normal
from test_batch_norm import ref_bn
from test_layer_norm import ln_ref, rms_ref

pytestmark = pytest.mark.skipif(ON_GPU, reason="the CPU twins' code paths (the GPU runs CUDA kernels)")

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def forced(isa, fn, *args):
    """fn(*args) with JAXOPS_CPU_ISA=isa (read by the twins on every call)."""
    os.environ["JAXOPS_CPU_ISA"] = isa
    try:
        return jax.block_until_ready(fn(*args))
    finally:
        del os.environ["JAXOPS_CPU_ISA"]


def both_paths(fn, *args):
    """fn(*args) on the CPU's own path (AVX-512 or AVX2 where it has them) and on the forced
    baseline path."""
    return jax.block_until_ready(fn(*args)), forced("baseline", fn, *args)


def every_path(fn, *args):
    """fn(*args) on the CPU's own path, the forced AVX2 clone (the same path where the CPU has no
    AVX-512) and the forced baseline."""
    return (*both_paths(fn, *args), forced("avx2", fn, *args))


def in_f32(ref):
    """ref computed in float32 (bf16/f16 arithmetic in XLA is the less accurate side), cast back."""
    def run(*args):
        args32 = [a.astype(jnp.float32) if a is not None and jnp.issubdtype(a.dtype, jnp.floating) else a
                  for a in args]
        out = ref(*args32)
        return jax.tree_util.tree_map(lambda o, a=args[0]: o.astype(a.dtype), out)
    return run


def check(fn, ref, *args, dtype):
    expected = in_f32(ref)(*args)
    for got in every_path(fn, *args):
        for g, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
            assert_close(g, e, dtype=dtype)


def with_specials(x):
    """One row with NaN, one with +-inf (when there are rows enough), the rest random."""
    x = x.astype(jnp.float32)
    if x.shape[0] > 2 and x.shape[1] > 2:
        x = x.at[1, 1].set(jnp.nan).at[2, 0].set(jnp.inf).at[2, 2].set(-jnp.inf)
    return x


@pytest.mark.parametrize("cols", [1, 3, 17, 33, 1025, 4099])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("log", [False, True])
def test_softmax(cols, dtype, log):
    op, ref = (jaxops.log_softmax, jax.nn.log_softmax) if log else (jaxops.softmax, jax.nn.softmax)
    k1, k2, k3 = jax.random.split(jax.random.key(cols), 3)
    x = with_specials(normal(k1, (5, cols), dtype, scale=3.0)).astype(dtype)
    where = jax.random.bernoulli(k2, 0.7, (5, cols))
    dy = normal(k3, (5, cols), dtype)
    check(jax.jit(op), jax.jit(ref), x, dtype=dtype)
    check(jax.jit(lambda x, w: op(x, where=w)), jax.jit(lambda x, w: ref(x, where=w)), x, where, dtype=dtype)
    finite = normal(k1, (5, cols), dtype)
    vjp = lambda f: jax.jit(lambda x, g: jax.vjp(f, x)[1](g)[0])
    check(vjp(op), vjp(ref), finite, dy, dtype=dtype)
    masked_vjp = lambda f: jax.jit(lambda x, g, w: jax.vjp(lambda x: f(x, where=w), x)[1](g)[0])
    check(masked_vjp(op), masked_vjp(ref), finite, dy, where, dtype=dtype)


def np_reduce(name):
    """numpy's reductions in float32 as the reference: XLA:CPU's jnp.max / jnp.min (jax 0.10.2)
    drop a NaN in rows of 5000 elements (they propagate it in rows of 50), numpy never does."""
    def run(x, axis):
        a = np.asarray(x.astype(jnp.float32))
        if name == "logsumexp":
            return np.asarray(jax.nn.logsumexp(jnp.asarray(a), axis=axis))
        return getattr(np, name)(a, axis=axis)
    return run


# Columns: (150, 203) gives leaves of 64 rows and the rest, tiles of 8 vectors, single vectors and
# scalar columns on both paths.
@pytest.mark.parametrize("shape,axis", [((3, 1), -1), ((4, 17), -1), ((3, 5000), -1), ((2, 70001), -1),
                                        ((70001,), None), ((37, 5), 0), ((130, 33), 0), ((150, 203), 0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reductions(shape, axis, dtype):
    x = normal(jax.random.key(shape[0]), shape, dtype, scale=4.0)
    inputs = [x]
    if len(shape) == 2:  # a NaN and a -inf in the first / last row and column
        inputs.append(x.astype(jnp.float32).at[0, 0].set(jnp.nan).at[-1, -1].set(-jnp.inf).astype(dtype))
    for name in ["sum", "mean", "max", "min", "logsumexp"]:
        op = getattr(jaxops, name)
        for data in inputs:
            expected = jnp.asarray(np_reduce(name)(data, axis)).astype(dtype)
            for got in every_path(jax.jit(lambda v: op(v, axis=axis)), data):
                assert_close(got, expected, dtype=dtype)


@pytest.mark.parametrize("cols", [1, 17, 1024, 1025, 5000, 70001])
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows(cols, dtype):
    # Rows: their extremum, then the first index holding it (reduce_cpu.cc's row_arg). Values
    # rounded to a few integers, so every row has ties; a row with a NaN late and one early
    # (the first NaN is the answer), a row of -inf then +inf, a row of -0 and +0 (equal: the
    # first wins); past 1024 columns the extremum sits in a later block than its first tie
    # might. numpy's argmax / argmin are the reference (first occurrence, NaN first).
    x = jnp.round(normal(jax.random.key(cols), (6, cols), jnp.float32, scale=2.0))
    if cols > 1:
        x = x.at[1, cols - 1].set(jnp.nan).at[2, cols // 2].set(jnp.nan).at[2, cols - 1].set(jnp.nan)
        x = x.at[3].set(-jnp.inf).at[3, cols - 1].set(jnp.inf)
        x = x.at[4].set(0.0).at[4, : cols // 2].set(-0.0)
        x = x.at[5, cols - 1].set(100.0)
    x = x.astype(dtype)
    a = np.asarray(x.astype(jnp.float32))
    for op, ref in ((jaxops.argmax, np.argmax), (jaxops.argmin, np.argmin)):
        for got in every_path(jax.jit(lambda v: op(v, axis=-1)), x):
            np.testing.assert_array_equal(np.asarray(got), ref(a, axis=-1))


# Lengths that leave every width (4, 8, 16 lanes) each remainder, and rows shorter than a vector:
# the row extremum's overlapping last vector and half-width short rows, the exp sum's padded last
# vector, first_index_of's last vector (cpu_sums.h, session 75).
_SHORT_LENGTHS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 20, 24, 31, 33, 47, 64, 65, 100]


@pytest.mark.parametrize("dtype", DTYPES)
def test_short_rows_every_position(dtype):
    # For each length n, rows whose special element sits at every position p: a NaN (max, min and
    # logsumexp are NaN, argmax / argmin p), +inf (max +inf, argmax p), -inf (min -inf, argmin p)
    # and a dominant finite value (max and argmax p, logsumexp near it), over random small values.
    # An element the vector loops skip or read twice shows at its position.
    for n in _SHORT_LENGTHS:
        base = np.asarray(normal(jax.random.key(n), (4 * n, n), jnp.float32)).copy()
        for p in range(n):
            base[p, p] = np.nan
            base[n + p, p] = np.inf
            base[2 * n + p, p] = -np.inf
            base[3 * n + p, p] = 40.0
        x = jnp.asarray(base).astype(dtype)
        a = np.asarray(x.astype(jnp.float32))
        refs = {"max": np.max, "min": np.min, "argmax": np.argmax, "argmin": np.argmin,
                "logsumexp": lambda v, axis: np.asarray(jax.nn.logsumexp(jnp.asarray(v), axis=axis))}
        for name, ref in refs.items():
            op = getattr(jaxops, name)
            expected = ref(a, axis=-1)
            for got in every_path(jax.jit(lambda v, op=op: op(v, axis=-1)), x):
                if name.startswith("arg"):
                    np.testing.assert_array_equal(np.asarray(got), expected, err_msg=f"{name} n={n}")
                else:
                    assert_close(got, jnp.asarray(expected).astype(dtype), dtype=dtype)


@pytest.mark.parametrize("rows", [1, 64, 150])
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_columns(rows, dtype):
    # Columns: register tiles of values and row indices (cpu_columns.h's arg_tile), leaves of 64
    # rows merged pairwise. 203 columns give tiles of 4 vectors, single vectors and scalar columns
    # on both paths. Integer values, so every column has ties; column 1 a NaN late, column 2 a NaN
    # in the middle and at the end (the first NaN is the answer), column 3 -inf then +inf last,
    # column 4 -0 then +0, column 200 (a scalar column for W = 8) a NaN last.
    x = jnp.round(normal(jax.random.key(rows), (rows, 203), jnp.float32, scale=2.0))
    x = x.at[rows - 1, 1].set(jnp.nan).at[rows // 2, 2].set(jnp.nan).at[rows - 1, 2].set(jnp.nan)
    x = x.at[:, 3].set(-jnp.inf).at[rows - 1, 3].set(jnp.inf)
    x = x.at[:, 4].set(0.0).at[: rows // 2, 4].set(-0.0).at[rows - 1, 200].set(jnp.nan)
    x = x.astype(dtype)
    a = np.asarray(x.astype(jnp.float32))
    for op, ref in ((jaxops.argmax, np.argmax), (jaxops.argmin, np.argmin)):
        for got in every_path(jax.jit(lambda v: op(v, axis=0)), x):
            np.testing.assert_array_equal(np.asarray(got), ref(a, axis=0))


@pytest.mark.parametrize("cols", [1, 7, 33, 1025])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True])
def test_layer_norm(cols, dtype, rms):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(cols + 7), 4)
    # 19 rows: the backward's float column partials join the double sums every 8 rows, then the rest.
    x = normal(k1, (19, cols), dtype, scale=2.0)
    scale, bias, dy = normal(k2, (cols,), dtype), normal(k3, (cols,), dtype), normal(k4, (19, cols), dtype)
    if rms:
        op = lambda x, s, b: jaxops.rms_norm(x, s, epsilon=1e-6)
        ref = lambda x, s, b: rms_ref(x, s, 1e-6)
    else:
        op = lambda x, s, b: jaxops.layer_norm(x, s, b, epsilon=1e-5)
        ref = lambda x, s, b: ln_ref(x, s, b, 1e-5)
    check(jax.jit(op), jax.jit(ref), x, scale, bias, dtype=dtype)
    vjp = lambda f: jax.jit(lambda x, s, b, g: jax.vjp(f, x, s, b)[1](g)[:2])
    expected = in_f32(vjp(ref))(x, scale, bias, dy)
    for got in every_path(vjp(op), x, scale, bias, dy):
        # (one column: dx cancels to ~1e-4 of its terms, so the float32 reference is off there too)
        for g, e in zip(got, expected):
            assert_close(g, e, dtype=dtype, rtol=5e-2 if dtype != jnp.float32 else 1e-4, atol=5e-2 if dtype != jnp.float32 else 1e-5)


@pytest.mark.parametrize("channels", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
def test_batch_norm_relu(channels, dtype, residual):
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(channels), 5)
    x = normal(k1, (3, 5, 7, channels), dtype)
    res = normal(k5, x.shape, dtype) if residual else None
    scale = 1.0 + 0.1 * jax.random.normal(k2, (channels,))
    bias = 0.1 * jax.random.normal(k3, (channels,))
    dy = normal(k4, x.shape, dtype)
    op = lambda x, s, b, r: jaxops.batch_norm(x, s, b, residual=r, activation="relu")[0]
    ref = lambda x, s, b, r: ref_bn(x, s, b, residual=r, activation="relu")[0]
    check(jax.jit(op), jax.jit(ref), x, scale, bias, res, dtype=dtype)
    vjp = lambda f: jax.jit(lambda x, s, b, r, g: jax.vjp(lambda x, s, b: f(x, s, b, r), x, s, b)[1](g))
    expected = in_f32(vjp(ref))(x, scale, bias, res, dy)
    for got in every_path(vjp(op), x, scale, bias, res, dy):
        for g, e in zip(got, expected):
            assert_close(g, e, dtype=g.dtype, rtol=5e-2 if dtype != jnp.float32 else 1e-4, atol=5e-2)


@pytest.mark.parametrize("n", [1, 31, 33, 1000, 4099])
@pytest.mark.parametrize("dtype", DTYPES)
def test_relu(n, dtype):
    x = normal(jax.random.key(n), (n,), dtype).at[0].set(jnp.nan if n > 1 else 0.0)
    dy = normal(jax.random.key(n + 1), (n,), dtype)
    check(jax.jit(jaxops.relu), jax.jit(jax.nn.relu), x, dtype=dtype)
    vjp = lambda f: jax.jit(lambda x, g: jax.vjp(f, x)[1](g)[0])
    check(vjp(jaxops.relu), vjp(jax.nn.relu), x, dy, dtype=dtype)


def _cpu_has_avx2_fma():
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


@pytest.mark.skipif(not _cpu_has_avx2_fma(), reason="one code path only: the CPU has no AVX2+FMA")
def test_baseline_is_forced_and_differs_only_in_rounding():
    """JAXOPS_CPU_ISA=baseline reaches the other path: float32 softmax's exp rounds differently
    with and without fused multiply-adds, in the last bits only."""
    x = normal(jax.random.key(3), (64, 1000), jnp.float32, scale=5.0)
    out, base = both_paths(jax.jit(jaxops.softmax), x)
    out, base = np.asarray(out), np.asarray(base)
    assert not np.array_equal(out, base)
    np.testing.assert_allclose(out, base, rtol=2e-6, atol=1e-9)


def test_exp_at_the_underflow_edge():
    """Vec::exp computes its arguments at or below -87.3 as -87.3 (a normal product: subnormal ones
    take a microcode assist on x86) and returns 0 for them; the arguments just above must keep their
    values. Each row's maximum is 0, so its entries are the exps themselves (the sum is 1 + tiny)."""
    d = np.array([0.0, -80.0, -87.0, -87.2, -87.29, -87.31, -87.4, -87.5, -100.0, -np.inf], np.float32)
    x = jnp.asarray(np.tile(d, (3, 1)))
    exact = np.exp(d.astype(np.float64))
    normal = exact >= np.finfo(np.float32).tiny * 1.1
    for log in (False, True):
        op = jaxops.log_softmax if log else jaxops.softmax
        for y in every_path(jax.jit(op), x):
            y = np.asarray(y, np.float64)
            got = np.exp(y) if log else y
            np.testing.assert_allclose(got[:, normal], np.tile(exact[normal], (3, 1)), rtol=2e-6)
            if not log:  # below the edge: 0 (or XLA-like subnormals), never more than the edge's value
                assert np.all(y[:, ~normal] <= np.finfo(np.float32).tiny * 1.1)
