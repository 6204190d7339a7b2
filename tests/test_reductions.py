"""jaxops.sum/mean/max/min/logsumexp/argmax/argmin against jnp / jax.nn on fresh random data.

Shapes are chosen to reach every kernel path on the GPU: short rows (warp per row), long rows
(block per row), very long rows and full reductions (grid split + merge), columns with small,
odd and wide inner extents (with and without a split of the reduced axis), and non-contiguous
axis tuples (transpose). On the CPU the same cases check the C++ twin.
"""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxops
from helpers import FLOAT_DTYPES, ON_GPU, gpu_only, normal, skip_f64_without_x64

VALUE_OPS = ["sum", "mean", "max", "min", "logsumexp"]
ARG_OPS = ["argmax", "argmin"]
REF = {"sum": jnp.sum, "mean": jnp.mean, "max": jnp.max, "min": jnp.min,
       "logsumexp": jax.nn.logsumexp, "argmax": jnp.argmax, "argmin": jnp.argmin}

# (shape, axis): every axis form, extent-1 axes, odd extents and each kernel path.
CASES = [
    ((), None),
    ((1,), None),
    ((7,), 0),
    ((3, 5, 7), None),
    ((3, 5, 7), 0),
    ((3, 5, 7), 1),
    ((3, 5, 7), -1),
    ((3, 5, 7), (0, 1)),
    ((3, 5, 7), (1, 2)),
    ((3, 5, 7), (0, 2)),      # not contiguous: transposed
    ((3, 5, 7), (-1, 0)),
    ((3, 5, 7), ()),          # no reduction
    ((4, 1, 6), 1),           # extent-1 reduced axis
    ((2, 3, 1, 4), (1, 3)),   # contiguous once the extent-1 axis is ignored
    ((1, 1), None),
    ((300, 100), 1),          # short rows: warp per row (odd: scalar loads)
    ((37, 1024), -1),         # warp per row, 16-byte loads (16 lanes a row for 2-byte types)
    ((133, 64), 1),           # short rows: 2-4 lanes a row, 8-16 rows a warp, last warp partial
    ((45, 256), 1),           # 8 (2-byte) or 16 (4-byte) lanes a row, several packs a lane
    ((29, 128), -1),          # fewer packs a lane than the unrolled loop: the batched tail only
    ((61, 96), 1),            # tails of 3 (4-byte) and of 1 or 2 packs (2-byte): odd tail batches
    ((9, 8192), 1),           # block per row
    ((3, 65537), 1),          # split rows, odd length
    ((1 << 18,), None),       # full reduction: split + merge
    ((65537, 3), 0),          # columns, odd inner, split reduced axis
    ((1000, 64), 0),          # columns, 16-byte loads
    ((256, 4096), 0),         # wide columns: several tiles
    ((2, 513, 256), 1),       # columns with outer > 1
    ((64, 48, 40), (0, 1)),   # leading axes (BatchNorm statistics)
]


def _f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32),
                      dtype=np.float64)


def _eps(dtype):
    return float(jnp.finfo(dtype).eps)


def _rng(key):
    """A numpy generator seeded from the per-test key: fresh data without compiling anything."""
    return np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())


def _rand(rng, shape, dtype, scale=1.0):
    return jnp.asarray((scale * rng.standard_normal(shape)).astype(np.float32).astype(dtype))


def _np_ref(op, x64, axis, keepdims=False):
    """float64 numpy reference (numpy propagates NaN in max/min and picks the first NaN in argmax)."""
    if op == "logsumexp":
        with np.errstate(all="ignore"):
            m = np.max(x64, axis=axis, keepdims=True)
            m = np.where(np.isfinite(m), m, 0.0)
            out = np.log(np.sum(np.exp(x64 - m), axis=axis, keepdims=True)) + m
        return out if keepdims else np.squeeze(out, axis=axis)
    f = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "argmax": np.argmax,
         "argmin": np.argmin}[op]
    with np.errstate(all="ignore"):
        return f(x64, axis=axis, keepdims=keepdims)


def _check_value(op, got, x, axis, keepdims):
    """Accuracy against float64 on the same (rounded) inputs: output rounding plus a pairwise
    summation bound in the accumulation type; max/min must be exact."""
    xf = _f64(x)
    ref = np.asarray(_np_ref(op, xf, axis, keepdims), dtype=np.float64)
    assert got.shape == ref.shape and got.dtype == x.dtype, (op, got.shape, ref.shape, got.dtype)
    g = _f64(got)
    if op in ("max", "min"):
        np.testing.assert_array_equal(g, ref, err_msg=f"{op} {x.shape} {axis}")
        return
    n = max(1, x.size // max(1, got.size))
    eps_acc = _eps(jnp.float64) if x.dtype == jnp.float64 else _eps(jnp.float32)
    if op == "logsumexp":
        atol = 8 * eps_acc * math.log2(n + 2) * np.maximum(1.0, np.abs(ref))
    else:
        mag = np.sum(np.abs(xf), axis=axis, keepdims=keepdims) / (n if op == "mean" else 1)
        atol = 4 * eps_acc * math.log2(n + 2) * mag
    bound = _eps(x.dtype) * np.abs(ref) + atol
    ok = (np.abs(g - ref) <= bound) | (g == ref)
    assert np.all(ok), f"{op} {x.shape} {axis}: max error {np.max(np.abs(g - ref))}, got {g[~ok][:5]} ref {ref[~ok][:5]}"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_every_op_matches_reference(dtype, key):
    """All seven ops on every case (one jit per case keeps the CPU run short)."""
    skip_f64_without_x64(dtype)
    rng = _rng(key)
    for i, (shape, axis) in enumerate(CASES):
        keepdims = i % 2 == 1
        x = _rand(rng, shape, dtype, scale=3.0)
        # Few distinct values, so argmax/argmin meet ties: the first index must win.
        xt = jnp.asarray(np.round(2 * rng.standard_normal(shape)).astype(np.float32).astype(dtype))
        arg_axis = None if isinstance(axis, tuple) else axis

        @jax.jit
        def run(x, xt):
            vals = [getattr(jaxops, op)(x, axis, keepdims) for op in VALUE_OPS]
            return vals, [getattr(jaxops, op)(xt, arg_axis, keepdims) for op in ARG_OPS]

        vals, args = run(x, xt)
        for op, got in zip(VALUE_OPS, vals):
            _check_value(op, got, x, axis, keepdims)
        for op, got in zip(ARG_OPS, args):
            ref = np.asarray(REF[op](xt, axis=arg_axis, keepdims=keepdims))
            assert got.dtype == jnp.int32 and got.shape == ref.shape
            np.testing.assert_array_equal(np.asarray(got), ref, err_msg=f"{op} {shape} {arg_axis}")


# Rows on the GPU (cc/reduce/reduce_plan.cuh: warp_rows, row_block_threads; reduce_spans.cuh:
# add_row_span): a warp a row up to one round of loads, then blocks of 32 ... 512 threads by row
# length and op;
# rows that are not whole 16-byte packs (1021, 4097, 12289, 50257: split in 7) peel a head and a
# tail element-wise around their packs.
@pytest.mark.parametrize("n", [1021, 1024, 1028, 2048, 2056, 4096, 4097, 4100, 6000, 8192, 12289, 16384, 50257])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_row_lengths_across_thread_plans(n, dtype, key):
    skip_f64_without_x64(dtype)
    rng = _rng(key)
    x = _rand(rng, (7, n), dtype, scale=3.0)
    xt = jnp.asarray(np.round(2 * rng.standard_normal((7, n))).astype(np.float32).astype(dtype))
    run = jax.jit(lambda x, xt: ([getattr(jaxops, op)(x, 1) for op in VALUE_OPS],
                                 [getattr(jaxops, op)(xt, 1) for op in ARG_OPS]))
    vals, args = run(x, xt)
    for op, got in zip(VALUE_OPS, vals):
        _check_value(op, got, x, 1, False)
    for op, got in zip(ARG_OPS, args):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(REF[op](xt, axis=1)), err_msg=f"{op} {n}")


def _last_packs_of_last_threads(start, length, pack):
    """Offsets, in a span of `length` elements at logical offset `start` (a row: r * n; a chunk of
    a split row: r * n + its first element), of the last 16-byte pack that the last thread of a
    group of 2 ... 512 threads takes when the threads share the span's whole packs round-robin
    (reduce_spans.cuh): where a thread's partial last round ends. The packed 16-bit logsumexp
    loop loads such a round whole, repeating its last pack (reduce_fast16.cuh: load16_round), so
    a value there must be counted once."""
    skip = (-start) % pack
    packs = (length - skip) // pack
    out = []
    for threads in (2, 4, 8, 16, 32, 64, 128, 256, 512):
        if packs >= threads:
            last = threads - 1 + (packs - threads) // threads * threads
            out.append(skip + last * pack)
    return out


# Rows that peel a head and a tail fall a pack short of whole rounds of loads, so on the GPU a
# thread's last round is partial (reduce_spans.cuh: add_row_span, add_span_generic;
# reduce_fast16.cuh: arg16_stream): ties (first index), NaN (the first) and all -inf there.
@pytest.mark.parametrize("n", [1021, 4095, 8191, 12289])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_arg_peeled_rows_ties_and_nan_in_the_last_round(n, dtype, key):
    rng = _rng(key)
    rows = np.round(2 * rng.standard_normal((12, n)))
    rows[0] = 1.0                                 # ties everywhere: index 0
    rows[1] = -np.inf                             # argmax and argmin both 0
    for r, tail in ((2, 1), (3, 5), (4, 9), (5, 520)):  # the best value twice, late in the row
        rows[r, n - tail] = rows[r, n - tail - 2] = 50.0
        rows[r, n - tail - 1] = -50.0
    for r, at in ((6, n - 1), (7, n - 4), (8, n - 600)):  # a NaN late, another later still
        rows[r, at] = np.nan
        rows[r, min(at + 1, n - 1)] = np.nan
    rows[9, rng.integers(0, n, 3)] = np.nan      # NaNs anywhere
    # The last thread's first pack of a round, for blocks of 32 ... 512 threads, in each row's
    # pack grid (logical offset r * n): the one maximum and minimum there, or a NaN.
    pack = 16 // jnp.dtype(dtype).itemsize
    extra = []
    for threads in (32, 64, 128, 256, 512):
        for kind in ("extremes", "nan"):
            r = 12 + len(extra)
            line = np.round(2 * rng.standard_normal(n)).clip(-4, 4)
            at = (-r * n) % pack + (threads - 1) * pack + r % pack
            if at + 1 < n:
                line[at], line[at + 1] = (50.0, -50.0) if kind == "extremes" else (np.nan, np.nan)
            extra.append(line)
    # The last thread's last pack, where its partial last round ends: the one maximum and minimum
    # in its last two elements, a NaN, or the row's best value again there after an earlier copy
    # (the earlier index must win).
    for kind in ("extremes", "nan", "tie"):
        for i in range(9):  # one line a group size of _last_packs_of_last_threads
            r = 12 + len(extra)
            ends = _last_packs_of_last_threads(r * n, n, pack)
            if i >= len(ends):
                break
            line = np.round(2 * rng.standard_normal(n)).clip(-4, 4)
            last = ends[i] + pack - 1
            if kind == "extremes":
                line[last - 1], line[last] = 50.0, -50.0
            elif kind == "nan":
                line[last] = np.nan
            else:
                line[last - r % pack] = line[r % 7] = 50.0
            extra.append(line)
    rows = np.concatenate([rows, np.stack(extra)])
    x = jnp.asarray(rows.astype(np.float32).astype(dtype))
    got = jax.jit(lambda v: [getattr(jaxops, op)(v, 1) for op in ARG_OPS])(x)
    for op, g in zip(ARG_OPS, got):
        np.testing.assert_array_equal(np.asarray(g), _np_ref(op, _f64(x), 1), err_msg=f"{op} {n}")


# Rows that are not whole packs add their loose elements, the head up to the row's first pack
# boundary and the tail after its last, one a thread around the packs (reduce_spans.cuh:
# add_row_span). In each line one of them is the maximum and another the minimum, over small
# values: counted twice or at a wrong index, sum, logsumexp or the arg ops would show it.
@pytest.mark.parametrize("n", [1021, 4095, 8191, 12289, 50257])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_row_head_and_tail_elements_count_once_at_their_index(n, dtype, key):
    rng = _rng(key)
    pack = 16 // jnp.dtype(dtype).itemsize
    lines = []
    for r in range(2 * pack):
        skip = (-r * n) % pack
        loose = list(range(skip)) + list(range(n - (n - skip) % pack, n))
        line = rng.uniform(-0.0625, 0.0625, n)
        line[loose[r % len(loose)]] = 50.0
        if len(loose) > 1:
            line[loose[(r + 1 + r // len(loose)) % len(loose)]] = -50.0
        lines.append(line)
    x = jnp.asarray(np.stack(lines).astype(np.float32).astype(dtype))
    ops = ["sum", "max", "min", "logsumexp"] + ARG_OPS
    got = jax.jit(lambda v: [getattr(jaxops, op)(v, 1) for op in ops])(x)
    for op, g in zip(ops, got):
        if op in ARG_OPS or op in ("max", "min"):
            np.testing.assert_array_equal(_f64(g), _np_ref(op, _f64(x), 1), err_msg=f"{op} {n}")
        else:
            _check_value(op, g, x, 1, False)


# The arg ops' identity carries index -1 and their add() takes only strictly better elements
# (reduce_ops.h), so a line whose every element equals the identity value (-inf for argmax,
# +inf for argmin) keeps the identity through every slot, merge and split, and finish() must
# answer 0. One element off the identity value, placed last or first, must win instead. Lines of
# warp, block and split rows, columns and the full reduction.
@pytest.mark.parametrize("shape,axis", [((5, 33), 1), ((3, 4096), 1), ((3, 4095), 1), ((2, 1 << 20), 1),
                                        ((4097, 3), 0), ((1 << 21,), None)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_arg_of_lines_equal_to_the_identity(shape, axis, dtype):
    for op, fill in (("argmax", -np.inf), ("argmin", np.inf)):
        x = np.full(shape, fill, np.float32)
        np.testing.assert_array_equal(np.asarray(getattr(jaxops, op)(jnp.asarray(x, dtype), axis)),
                                      np.zeros(np.asarray(REF[op](x, axis=axis)).shape), err_msg=op)
        red = 0 if axis is None else axis
        for at in (shape[red] - 1, 0):
            y = x.copy()
            np.moveaxis(y, red, 0)[at] = 0.0
            np.testing.assert_array_equal(np.asarray(getattr(jaxops, op)(jnp.asarray(y, dtype), axis)),
                                          np.asarray(REF[op](y, axis=axis)), err_msg=f"{op} {at}")


@pytest.mark.parametrize("shape,axis", [((6, 9), 1), ((9, 6), 0), ((5, 3000), 1), ((3, 70000), 1),
                                        ((3000, 5), 0), ((40000,), None)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nan_and_inf(shape, axis, dtype, key):
    """NaN propagates (argmax/argmin pick the first NaN), +-inf as jnp / jax.nn.logsumexp.

    The reference is numpy: XLA:CPU's own max reduction drops NaN on some shapes."""
    rng = _rng(key)
    x = rng.standard_normal(shape)
    special = np.array([np.nan, np.inf, -np.inf, -np.inf])
    x = np.where(rng.uniform(size=shape) < 0.1, special[rng.integers(0, 4, shape)], x)
    if len(shape) == 2:  # dedicated slices: all -inf, +inf with -inf, only +inf, two NaNs, inf and NaN
        red = axis
        for lane, values in enumerate([(-np.inf,), (np.inf, -np.inf), (np.inf,), (np.nan, np.nan),
                                       (np.inf, np.nan)]):
            line = np.full(shape[red], -np.inf if lane == 0 else 0.5)
            for j, v in enumerate(values):
                line[3 + 2 * j] = v
            if red == 1:
                x[lane % shape[0], :] = line
            else:
                x[:, lane % shape[1]] = line
    x = jnp.asarray(x.astype(np.float32).astype(dtype))
    ops = VALUE_OPS + ARG_OPS
    got = jax.jit(lambda v: [getattr(jaxops, op)(v, axis) for op in ops])(x)
    for op, g in zip(ops, got):
        r = _np_ref(op, _f64(x), axis)
        g = np.asarray(g) if op in ARG_OPS else _f64(g)
        if op in ("sum", "mean", "logsumexp"):
            np.testing.assert_array_equal(np.isnan(g), np.isnan(r), err_msg=op)
            np.testing.assert_array_equal(np.isposinf(g), np.isposinf(r), err_msg=op)
            np.testing.assert_array_equal(np.isneginf(g), np.isneginf(r), err_msg=op)
        else:
            np.testing.assert_array_equal(g, r, err_msg=op)


def test_logsumexp_special_rows():
    x = jnp.array([[-jnp.inf, -jnp.inf, -jnp.inf], [jnp.inf, -jnp.inf, 1.0], [jnp.inf, jnp.nan, 0.0],
                   [1000.0, 1000.0, -1000.0], [-1e30, -1e30, -1e30]])
    got = jaxops.logsumexp(x, axis=1)
    np.testing.assert_array_equal(np.isnan(got), [False, False, True, False, False])
    assert got[0] == -jnp.inf and got[1] == jnp.inf
    np.testing.assert_allclose(got[3:], jax.nn.logsumexp(x[3:], axis=1), rtol=1e-6)


def _specials_for_half(rng, shape, axis):
    """Few distinct values (ties), 5 % NaN/+-inf, and dedicated lines along `axis`: all -inf, -0
    before +0 among negatives (argmax must pick the -0: equal values, first index), +0 before
    -0 among positives (argmin), NaN after an inf, two NaNs, +inf twice."""
    x = np.round(2 * rng.standard_normal(shape)).astype(np.float64)
    special = np.array([np.nan, np.inf, -np.inf, -np.inf])
    x = np.where(rng.uniform(size=shape) < 0.05, special[rng.integers(0, 4, shape)], x)
    x = np.ascontiguousarray(np.moveaxis(x, axis, -1))  # lines along the reduced axis are x[..., :]
    n = x.shape[-1]
    flat = x.reshape(-1, n)  # a view of x
    neg = -1.0 - np.abs(rng.standard_normal(n))
    dedicated = [{}, {3: -0.0, n - 2: 0.0}, {3: 0.0, n - 2: -0.0}, {n // 2: np.inf, n - 1: np.nan},
                 {1: np.nan, n - 3: np.nan}, {2: np.inf, n - 1: np.inf}]
    for line, values in enumerate(dedicated):
        if line >= flat.shape[0] or flat.shape[0] == 1:  # one line (full reduction): keep it random
            break
        row = np.full(n, -np.inf) if line == 0 else (neg if line == 1 else -neg if line == 2 else np.zeros(n))
        row = row.copy()
        for j, v in values.items():
            row[j] = v
        flat[line] = row
    return np.moveaxis(x, -1, axis)


# A thread's partial last round of packs is loaded whole, its last pack repeated (reduce_fast16.cuh:
# load16_round in the packed 16-bit logsumexp and max/min loops; reduce_spans.cuh: the generic
# loop of sum, mean, max and min, where the repeats are not added). A repeat may raise a block
# maximum but must add nothing, and no pack may be skipped. One dominant element a line, in the
# last pack of the last thread of each group size (for split rows: of one chunk of the plan):
# counted twice, logsumexp would be off by log 2 and sum by the element; missed, max and min
# would not be it.
_DOMINANT = {"logsumexp": ((-14.0, -10.0), 3.0), "sum": ((-0.0625, 0.0625), 1000.0),
             "max": ((-14.0, -10.0), 3.0), "min": ((10.0, 14.0), -3.0)}


@pytest.mark.parametrize("n", [500, 1001, 1021, 2001, 4095, 8191, 12289, 32001, 50257, (1 << 20) - 1])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("op", list(_DOMINANT))
def test_partial_last_round_counts_each_element_once(op, n, dtype, key):
    from jaxops._reductions import _splits

    rng = _rng(key)
    pack = 16 // jnp.dtype(dtype).itemsize
    splits = _splits(9, n, 1, jnp.dtype(dtype).itemsize, op)
    chunk = -(-(-(-n // splits)) // pack) * pack
    begin = chunk * (splits // 2)  # a chunk inside the row (the whole row when unsplit)
    length = min(chunk, n - begin)
    (low, high), dominant = _DOMINANT[op]
    lines = []
    for i in range(9):
        r = len(lines)
        ends = _last_packs_of_last_threads(r * n + begin, length, pack)
        if i >= len(ends):
            break
        line = rng.uniform(low, high, n)
        line[begin + ends[i] + pack - 1 - r % pack] = dominant
        lines.append(line)
    assert splits == 1 or len(lines) >= 8  # the plan above is that of the shape tested
    x = jnp.asarray(np.stack(lines).astype(np.float32).astype(dtype))
    got = _f64(getattr(jaxops, op)(x, 1))
    want = _np_ref(op, _f64(x), 1)
    if op in ("max", "min"):
        np.testing.assert_array_equal(got, want, err_msg=f"{n}")
    else:
        # float32: a few ulp of accumulation; the defect this catches is log 2 (or 1000) off
        np.testing.assert_allclose(got, want, rtol=max(2 * _eps(dtype), 1e-6), err_msg=f"{n}")


@pytest.mark.parametrize("shape,axis", [((37, 1024), 1), ((133, 64), 1), ((9, 8192), 1), ((3, 70000), 1),
                                        ((40000,), 0), ((1000, 64), 0), ((2, 513, 256), 1), ((65537, 8), 0)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_dtypes_packed_paths_nan_inf_ties(shape, axis, dtype, key):
    """bf16/f16 with 16-byte packs take the packed arg/max/logsumexp loops on sm_90 (rows by
    warp, block and split; columns): NaN, +-inf, ties and signed zeros against numpy."""
    x = _specials_for_half(_rng(key), shape, axis)
    x = jnp.asarray(x.astype(np.float32).astype(dtype))
    ops = ["max", "min", "logsumexp"] + ARG_OPS
    got = jax.jit(lambda v: [getattr(jaxops, op)(v, axis) for op in ops])(x)
    for op, g in zip(ops, got):
        r = _np_ref(op, _f64(x), axis)
        if op == "logsumexp":
            g = _f64(g)
            np.testing.assert_array_equal(np.isnan(g), np.isnan(r), err_msg=op)
            np.testing.assert_array_equal(np.isposinf(g), np.isposinf(r), err_msg=op)
            np.testing.assert_array_equal(np.isneginf(g), np.isneginf(r), err_msg=op)
            fin = np.isfinite(r)
            np.testing.assert_allclose(g[fin], r[fin], rtol=2 * _eps(dtype), atol=1e-6, err_msg=op)
        else:
            np.testing.assert_array_equal(np.asarray(g) if op in ARG_OPS else _f64(g), r, err_msg=op)


@pytest.mark.parametrize("dtype,big", [(jnp.bfloat16, 3.0e38), (jnp.float16, 6.0e4)])
def test_logsumexp_half_dtypes_near_overflow(dtype, big, key):
    """Maxima near the dtype's largest finite value (the packed loop's max * log2e overflows
    float32 for bf16 beyond 2.4e38): rows by warp (1024) and by split block (70000)."""
    rng = _rng(key)
    for shape in [(6, 1024), (2, 70000)]:
        x = rng.uniform(0.5, 1.0, shape) * big
        x[1] = rng.standard_normal(shape[1])
        x[0, 17] = -np.inf
        x = jnp.asarray(x.astype(np.float32)).astype(dtype)
        _check_value("logsumexp", jaxops.logsumexp(x, axis=1), x, 1, False)


@gpu_only
@pytest.mark.parametrize("shape,axis", [((512, (1 << 19) + 4096), 1), ((512, 8256, 64), 1)])
def test_packed_arg_segments(shape, axis, key):
    """More than 256 packs per thread (the packed arg loop's 16-bit pack numbers restart per
    segment): rows of one block each (512 rows of 2^19 + 4096) and columns without a split."""
    rng = _rng(key)
    x = jnp.asarray(np.round(2 * rng.standard_normal(shape, dtype=np.float32))).astype(jnp.bfloat16)
    idx = (slice(None),) * axis
    far = shape[axis] - 5
    x = x.at[idx + (far,)].set(jnp.bfloat16(100.0)).at[idx + (far + 2,)].set(jnp.bfloat16(100.0))
    x = x.at[idx + (300 * 8 + 1,)].set(jnp.bfloat16(-100.0))
    for op in ARG_OPS:
        got = getattr(jaxops, op)(x, axis)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(REF[op](x, axis=axis)), err_msg=op)
    assert np.all(np.asarray(jaxops.argmax(x, axis)) == far)


@gpu_only
@pytest.mark.parametrize("shape,axis", [((256, 65544), 1), ((8, 1 << 22), 1), (((1 << 26) + 2056,), 0),
                                        ((1001, 4096), 1), ((512, 32776), 1)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gpu_packed_arg_ring(shape, axis, dtype, key):
    """Blocks of 256 threads with >= 16 packs a thread take the shared-memory ring of the packed
    arg loop (cc/reduce: arg16_stream_ring; chunks of >= 65536 elements at 32 packs a thread):
    block rows with a partial last batch (32-33 packs a thread), a full reduction whose last
    split is shorter. Beside them the register loop: split rows (64 threads), 4096-long rows (16
    lanes of a warp, 32 packs each) and 32776-long ones (128 threads). NaN, +-inf, signed zeros
    and ties against numpy, then plain rounded normals (ties only)."""
    rng = _rng(key)
    plain = np.round(2 * rng.standard_normal(shape))
    for x in (_specials_for_half(rng, shape, axis), plain):
        x = jnp.asarray(x.astype(np.float32).astype(dtype))
        for op in ARG_OPS:
            np.testing.assert_array_equal(np.asarray(getattr(jaxops, op)(x, axis)), _np_ref(op, _f64(x), axis),
                                          err_msg=op)


@gpu_only
@pytest.mark.parametrize("fast_dram", ["0", "1"])
@pytest.mark.parametrize("shape", [(3001, 1024), (1001, 4096), (513, 8192), (257, 16384), (40, 2056), (600, 1000),
                                   (450, 12288)])
def test_gpu_arg16_plans_by_dram_speed(monkeypatch, fast_dram, shape, key):
    """16-bit argmax / argmin rows take 32 packs a thread where DRAM outruns the SMs (H200) and
    the unroll (8) elsewhere (H100; cc/reduce/reduce_plan.cuh, row_packs_per_thread).
    JAXOPS_FAST_DRAM (read at every launch) forces each plan, so either chip runs both: warp rows
    of 1000-2056 elements (fewer lanes of 32 packs or more of 8), block rows of 4096-16384 (64 or
    256 threads), 450 rows of 12288 (the capped blocks of 128 between one and two waves). NaN,
    +-inf, signed zeros and ties against numpy, both dtypes."""
    monkeypatch.setenv("JAXOPS_FAST_DRAM", fast_dram)
    x64 = _specials_for_half(_rng(key), shape, 1)
    for dtype in (jnp.bfloat16, jnp.float16):
        x = jnp.asarray(x64.astype(np.float32).astype(dtype))
        for op in ARG_OPS:
            np.testing.assert_array_equal(np.asarray(getattr(jaxops, op)(x, 1)), _np_ref(op, _f64(x), 1),
                                          err_msg=f"{op} {jnp.dtype(dtype).name}")


def test_bfloat16_accuracy_against_float64(key):
    """float32 accumulation: a bf16 sum of 65537 values is as good as rounding the exact sum."""
    x = normal(key, (4, 65537), jnp.bfloat16) + jnp.bfloat16(1.0)
    exact = np.sum(_f64(x), axis=1)
    got = _f64(jaxops.sum(x, axis=1))
    assert np.all(np.abs(got - exact) <= _eps(jnp.bfloat16) * np.abs(exact) + 1e-3), (got, exact)
    xc = x.reshape(65537, 4)
    exact = np.sum(_f64(xc), axis=0)
    got = _f64(jaxops.sum(xc, axis=0))
    assert np.all(np.abs(got - exact) <= _eps(jnp.bfloat16) * np.abs(exact) + 1e-3), (got, exact)


@pytest.mark.parametrize("shape,axis", [((1 << 20,), None), ((8, 1 << 17), 1), ((1 << 17, 8), 0),
                                        ((50000, 64), 0), ((17, 30), 0)])
def test_repeated_calls_are_bit_identical(shape, axis, key):
    x = normal(key, shape, jnp.float32)
    f = jax.jit(lambda v: [jaxops.sum(v, axis), jaxops.logsumexp(v, axis), jaxops.mean(v, axis)])
    first = [np.asarray(a) for a in f(x)]
    for _ in range(3):
        for a, b in zip(first, f(x)):
            np.testing.assert_array_equal(a.view(np.uint32), np.asarray(b).view(np.uint32))
    eager = np.asarray(jaxops.sum(x, axis))
    np.testing.assert_array_equal(first[0].view(np.uint32), eager.view(np.uint32))


def _transformed(f):
    """jit + keepdims, vmap over several in_axes, nested vmap, vmap of a full reduction."""
    return lambda x: [
        f(x, 1, True),
        *[jax.vmap(lambda v: f(v, -1), in_axes=a)(x) for a in (0, 1, 3)],
        jax.vmap(jax.vmap(lambda v: f(v, 0), in_axes=1), in_axes=2)(x),
        jax.vmap(lambda v: f(v, (0, 2)), in_axes=2)(x),
        jax.vmap(lambda v: f(v), in_axes=2)(x),
    ]


def test_jit_and_vmap(key):
    x = _rand(_rng(key), (4, 5, 6, 7), jnp.float32)
    ops = VALUE_OPS + ARG_OPS
    ref_fn = {op: (lambda v, a=None, k=False, op=op: REF[op](v, a, keepdims=k)) for op in ops}
    ref_fn["argmax"] = lambda v, a=None, k=False: jnp.argmax(v, None if isinstance(a, tuple) else a, keepdims=k)
    ref_fn["argmin"] = lambda v, a=None, k=False: jnp.argmin(v, None if isinstance(a, tuple) else a, keepdims=k)
    ours = {op: getattr(jaxops, op) for op in ops}
    ours["argmax"] = lambda v, a=None, k=False: jaxops.argmax(v, None if isinstance(a, tuple) else a, k)
    ours["argmin"] = lambda v, a=None, k=False: jaxops.argmin(v, None if isinstance(a, tuple) else a, k)
    got = jax.jit(lambda v: [_transformed(ours[op])(v) for op in ops])(x)
    ref = jax.jit(lambda v: [_transformed(ref_fn[op])(v) for op in ops])(x)
    for op, gs, rs in zip(ops, got, ref):
        for i, (g, r) in enumerate(zip(gs, rs)):
            assert g.shape == r.shape, (op, i, g.shape, r.shape)
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5, err_msg=f"{op} {i}")


@pytest.mark.parametrize("op", ["sum", "mean", "logsumexp", "max", "min"])
@pytest.mark.parametrize("axis", [None, -1, (0, 2)])
def test_grads(op, axis, key):
    dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    x = normal(key, (3, 4, 5), dtype)
    if op in ("max", "min"):
        # Distinct values 0.37 apart: a finite difference of size eps must not cross a near-tie,
        # which random normals sometimes contain (a flaky numerical gradient, seen on the GPU run).
        x = (jax.random.permutation(key, 60).reshape(3, 4, 5) * 0.37 - 10.0).astype(dtype)
    f = getattr(jaxops, op)
    check_grads(jax.jit(lambda v: f(v, axis)), (x,), order=1, modes=("rev",),
                eps=1e-4 if dtype == jnp.float64 else 1e-2, atol=1e-6 if dtype == jnp.float64 else 5e-2)
    w = jnp.arange(1.0, 1.0 + REF[op](x, axis).size, dtype=dtype).reshape(REF[op](x, axis).shape)
    g = jax.jit(jax.grad(lambda v: jnp.sum(f(v, axis) * w)))(x)
    gr = jax.jit(jax.grad(lambda v: jnp.sum(REF[op](v, axis) * w)))(x)
    np.testing.assert_allclose(g, gr, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("op", ["max", "min"])
def test_max_min_grad_splits_ties_like_jnp(op):
    x = jnp.array([[1.0, 3.0, 3.0, 2.0, 3.0], [-1.0, -1.0, 0.5, jnp.nan, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    if op == "min":
        x = -x
    got = jax.grad(lambda v: jnp.sum(getattr(jaxops, op)(v, axis=1) * jnp.array([1.0, 2.0, 3.0])))(x)
    ref = jax.grad(lambda v: jnp.sum(REF[op](v, axis=1) * jnp.array([1.0, 2.0, 3.0])))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    assert float(got[0, 1]) == pytest.approx(1 / 3) and np.all(np.isnan(got[1]))


def test_grad_half_dtypes_and_jit_vmap(key):
    x = normal(key, (6, 33), jnp.bfloat16)
    for op in ("sum", "mean", "logsumexp", "max"):
        f = jax.jit(jax.vmap(jax.grad(lambda v: getattr(jaxops, op)(v).astype(jnp.float32))))
        r = jax.vmap(jax.grad(lambda v: REF[op](v).astype(jnp.float32)))
        got, ref = f(x), r(x)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(_f64(got), _f64(ref), rtol=2e-2, atol=1e-2, err_msg=op)


def test_argmax_not_differentiable_but_usable_in_grad(key):
    x = normal(key, (4, 9), jnp.float32)
    g = jax.grad(lambda v: jnp.sum(jnp.take_along_axis(v, jaxops.argmax(v, 1, keepdims=True), 1)))(x)
    np.testing.assert_array_equal(g, jax.nn.one_hot(jnp.argmax(x, 1), 9))


def test_empty_reductions():
    e = jnp.zeros((0, 3), jnp.float32)
    np.testing.assert_array_equal(jaxops.sum(e, axis=0), jnp.zeros(3))
    assert np.all(np.isnan(jaxops.mean(e, axis=0)))
    assert np.all(jaxops.logsumexp(e, axis=0) == -jnp.inf)
    assert jaxops.sum(e).shape == () and float(jaxops.sum(e)) == 0.0
    assert jaxops.sum(e, axis=1).shape == (0,)
    assert jaxops.max(e, axis=1).shape == (0,)  # empty output, non-empty reduced axis
    assert jaxops.argmax(e, axis=1).shape == (0,)
    for op in ("max", "min"):
        with pytest.raises(ValueError, match=f"jaxops.{op}: zero-size array"):
            getattr(jaxops, op)(e, axis=0)
    for op in ARG_OPS:
        with pytest.raises(ValueError, match=f"jaxops.{op}: attempt to get {op} of an empty"):
            getattr(jaxops, op)(e)
    assert jax.grad(lambda v: jaxops.sum(v))(e).shape == (0, 3)


def test_bad_input_raises_before_running():
    x = jnp.ones((2, 3))
    for op in VALUE_OPS + ARG_OPS:
        f = getattr(jaxops, op)
        with pytest.raises(TypeError, match=f"jaxops.{op}: x must be float.*int32"):
            f(jnp.ones((2, 3), jnp.int32))
        with pytest.raises(TypeError, match=f"jaxops.{op}: x must be float"):
            f(jnp.ones((2, 3), jnp.bool_))
        with pytest.raises(ValueError, match=f"jaxops.{op}: axis 2 is out of bounds"):
            f(x, axis=2)
        with pytest.raises(ValueError, match=f"jaxops.{op}: axis -3 is out of bounds"):
            f(x, axis=-3)
        with pytest.raises(ValueError, match=f"jaxops.{op}: axis 0 is out of bounds.*rank 0"):
            f(jnp.float32(1.0), axis=0)
    for op in VALUE_OPS:
        with pytest.raises(ValueError, match=f"jaxops.{op}: repeated axis"):
            getattr(jaxops, op)(x, axis=(1, -1))
        with pytest.raises(ValueError, match=f"jaxops.{op}: axis .* out of bounds"):
            getattr(jaxops, op)(x, axis=(0, 5))
    for op in ARG_OPS:
        with pytest.raises(TypeError, match=f"jaxops.{op}: axis must be None or an int"):
            getattr(jaxops, op)(x, axis=(0, 1))


def test_ffi_handler_validates_again():
    """Calling the FFI target directly with inconsistent shapes returns an error, not a crash."""
    from jaxops._ffi import ffi_call

    x = jnp.ones((2, 3, 4), jnp.float32)
    bad = [((2, 5), jnp.float32, 0, 1), ((2, 4), jnp.int32, 0, 1), ((2, 4), jnp.float32, 9, 1),
           ((2, 4), jnp.float32, 0, 4)]  # last: splits > 1 with no workspace
    for shape, dtype, op, splits in bad:
        with pytest.raises(Exception, match="jaxops"):
            jax.block_until_ready(ffi_call("sum", "jaxops_reduce",
                                           (jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct((0,), jnp.uint8)),
                                           x, op=op, splits=splits))
    # Rank-2 (outer, reduced) row views: the output must be (outer,); rank 1 is no view at all.
    for x_shape, y_shape in [((2, 3), (3,)), ((2, 3), (2, 1)), ((6,), (1,))]:
        with pytest.raises(Exception, match="jaxops"):
            jax.block_until_ready(ffi_call("sum", "jaxops_reduce",
                                           (jax.ShapeDtypeStruct(y_shape, jnp.float32), jax.ShapeDtypeStruct((0,), jnp.uint8)),
                                           jnp.ones(x_shape, jnp.float32), op=0, splits=1))


@pytest.mark.skipif(ON_GPU, reason="XLA:CPU's layout assignment (the GPU's HLO has its own fusions)")
def test_rows_reach_the_handler_without_a_copy():
    """Row reductions pass a rank-2 view; an (outer, n, 1) one made XLA:CPU copy bfloat16 inputs."""
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.ones((64, 256), dtype)
        for fn in (jaxops.sum, jaxops.max, jaxops.logsumexp, jaxops.argmax):
            hlo = jax.jit(lambda v: fn(v, axis=-1)).lower(x).compile().as_text()
            assert not re.search(r"= \S+ copy\(", hlo), (fn.__name__, dtype)
        # max's backward (ties share the gradient) on (outer, n, 1) copied too
        grad = jax.grad(lambda v: jaxops.max(v, axis=-1).astype(jnp.float32).sum())
        assert not re.search(r"= \S+ copy\(", jax.jit(grad).lower(x).compile().as_text()), dtype


# (shape of the (outer, n, inner) view, splits): explicit split counts through the FFI target.
# On the GPU every split launch is row_block_kernel / column_kernel writing partial states,
# then merge_kernel: 1-column tiles (rows) and 2- to 8-column tiles (its one-barrier fold,
# 32 lanes a column for 1-2 columns), many units (1100 rows / 1100 column units: a grid of
# merge blocks), more splits than rows/packs (empty chunks), odd split counts, and 16-byte vs
# scalar packs. The CPU ignores splits.
EXPLICIT_SPLITS = [
    ((1, 70001, 1), 5),        # one row, odd length (scalar packs)
    ((3, 40960, 1), 7),        # rows, 16-byte packs
    ((1100, 300, 1), 2),       # 1100 rows: merge_kernel over many 1-column tiles; block rows
                               # even for a short row (explicit splits > 1 skip the warp kernel)
    ((2, 9, 1), 5),            # splits close to the row length: short and empty chunks
    ((1, 5000, 2), 13),        # 2 columns: fold_rows with 32 lanes a column
    ((1, 3001, 64), 9),        # 8-column tiles (bf16) / 16 (f32)
    ((1100, 40, 8), 3),        # 1100 column units through merge_kernel
    ((3, 700, 520), 4),        # several tiles per slab, partial last tile
    ((1, 6, 64), 11),          # more splits than rows: empty chunks in a column launch
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_explicit_splits_every_merge_path(dtype, key):
    """Every op with explicit split counts equals the unsplit reference; arg ops with ties
    across chunk boundaries keep the first index; repeated calls are bit-identical."""
    from jaxops._ffi import ffi_call
    from jaxops._reductions import _OPS, _state_bytes

    rng = _rng(key)
    ops = VALUE_OPS + ARG_OPS
    for (outer, n, inner), splits in EXPLICIT_SPLITS:
        x = _rand(rng, (outer, n, inner), dtype, scale=2.0)
        xt = jnp.asarray(np.round(2 * rng.standard_normal((outer, n, inner))).astype(np.float32).astype(dtype))

        @jax.jit
        def run(x, xt):  # one compilation per view: every op with `splits` chunks
            outs = []
            for op in ops:
                arg = op in ARG_OPS
                ws = outer * inner * splits * _state_bytes(op, dtype)
                outs.append(ffi_call(op, "jaxops_reduce",
                                     (jax.ShapeDtypeStruct((outer, inner), jnp.int32 if arg else dtype),
                                      jax.ShapeDtypeStruct((ws,), jnp.uint8)),
                                     xt if arg else x, op=_OPS[op], splits=splits)[0])
            return outs

        first, again = run(x, xt), run(x, xt)
        for op, got, got2 in zip(ops, first, again):
            what = f"{op} {(outer, n, inner)} splits={splits}"
            np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(got2).view(np.uint8),
                                          err_msg=f"{what}: not repeatable")
            if op in ARG_OPS:
                np.testing.assert_array_equal(np.asarray(got), np.asarray(REF[op](xt, axis=1)), err_msg=what)
            else:
                _check_value(op, got, x, 1, False)


def test_split_plan():
    """The shape-only plan (jaxops._reductions._splits): column splits fill one resident wave of
    the H100 (3 blocks of 256 threads per SM; 2 for sum, mean, max, min); split rows and full reductions take about 1024
    blocks of >= 8192 elements, except float32 arg/logsumexp over more than one row (one wave of
    2 blocks of 512 per SM), the light ops (sum, mean, max, min, 16-bit arg ops) over more than
    one row (about 4096 blocks) and 16-bit logsumexp over more than one row (chunks of 4096, at
    most 2048 a row); the benchmark shapes get the planned split counts."""
    from jaxops._reductions import (_MIN_ROW_CHUNK, _TARGET_BLOCKS, _TARGET_BLOCKS_LIGHT, _column_wave_blocks,
                                    _splits, _wave_blocks)

    plans = {  # (outer, n, inner, itemsize, fn): splits
        (1, 1 << 26, 1, 2, "sum"): 1024, (1, 1 << 26, 1, 2, "argmax"): 1024,
        (1, 1 << 26, 1, 4, "sum"): 1024, (1, 1 << 26, 1, 4, "argmax"): 1024,
        (1, 1 << 26, 1, 4, "logsumexp"): 1024,
        (64, 1 << 20, 1, 2, "sum"): 64, (64, 1 << 20, 1, 2, "logsumexp"): 256, (64, 1 << 20, 1, 2, "argmax"): 64,
        (16, 1 << 22, 1, 2, "logsumexp"): 1024, (2, 1 << 25, 1, 2, "logsumexp"): 2048,
        (64, 1 << 20, 1, 4, "sum"): 64, (64, 1 << 20, 1, 4, "max"): 64, (64, 1 << 20, 1, 4, "mean"): 64,
        (64, 1 << 20, 1, 2, "min"): 64, (1, 1 << 26, 1, 2, "max"): 1024, (1, 1 << 26, 1, 2, "logsumexp"): 1024,
        (64, 1 << 20, 1, 4, "argmax"): 4, (64, 1 << 20, 1, 4, "argmin"): 4, (64, 1 << 20, 1, 4, "logsumexp"): 4,
        (64, 1 << 20, 1, 8, "argmax"): 16,
        (1, 1 << 20, 64, 2, "sum"): 264, (1, 1 << 18, 256, 2, "argmax"): 396, (1, 1 << 14, 4096, 2, "sum"): 16,
        (1, 1 << 20, 64, 4, "sum"): 264, (1, 1 << 14, 4096, 4, "argmax"): 12, (1, 1 << 14, 4096, 4, "max"): 8,
        (1, 1 << 13, 8192, 2, "mean"): 8, (1, 1 << 18, 256, 2, "logsumexp"): 396,
        (1, 1 << 20, 64, 8, "sum"): 1024,  # float64 columns: about 1024 blocks
        (1024, 65536, 1, 2, "sum"): 1, (1024, 65536, 1, 4, "argmax"): 1, (8, 4096, 1, 4, "sum"): 1,
    }
    for (outer, n, inner, size, fn), want in plans.items():
        assert _splits(outer, n, inner, size, fn) == want, (outer, n, inner, size, fn)
    for outer in (1, 3, 64, 133, 200, 397, 511):
        for n, inner in ((1 << 20, 1), (1 << 16, 1), (1 << 16, 64), (1 << 16, 520)):
            for size in (2, 4):
                for fn in ("sum", "argmax"):
                    k = _splits(outer, n, inner, size, fn)
                    assert k >= 1
                    if inner == 1 and not (size == 4 and fn == "argmax" and outer > 1):
                        # about _TARGET_BLOCKS(_LIGHT) blocks, chunks of >= _MIN_ROW_CHUNK elements
                        target = _TARGET_BLOCKS_LIGHT if (fn == "sum" or size == 2) and outer > 1 else _TARGET_BLOCKS
                        assert k == min(-(-target // outer), -(-n // _MIN_ROW_CHUNK)), (outer, n, k)
                        continue
                    pack = 16 // size if inner % (16 // size) == 0 else 1
                    tx = min(32, 1 << (-(-inner // pack) - 1).bit_length())
                    units = outer if inner == 1 else outer * -(-inner // (tx * pack))
                    if k > 1:  # one resident wave, as full as the chunk floor allows
                        wave = _wave_blocks(size, True) if inner == 1 else _column_wave_blocks(size, fn)
                        assert units * k <= wave, (outer, n, inner, size, k)
                        assert units * (k + 1) > wave or k == n // _MIN_ROW_CHUNK \
                            or inner > 1


@gpu_only
def test_more_than_2_pow_31_elements():
    """64-bit offsets: rows and columns of arrays with more than 2^31 elements (bfloat16)."""
    n = (1 << 30) + 5
    x = jnp.ones((3, n), jnp.bfloat16).at[2, (1 << 30) + 1].set(5.0).at[1, 7].set(-4.0)
    np.testing.assert_array_equal(jaxops.argmax(x, axis=1), [0, 0, (1 << 30) + 1])
    np.testing.assert_array_equal(jaxops.argmin(x, axis=1), [0, 7, 0])
    assert float(jaxops.max(x)) == 5.0 and float(jaxops.min(x)) == -4.0
    np.testing.assert_allclose(_f64(jaxops.sum(x, axis=1)), [n, n - 5, n + 4], rtol=8e-3)
    del x
    r = (1 << 21) + 3
    y = jnp.ones((r, 1024), jnp.bfloat16).at[r - 2, 7].set(9.0)
    assert int(jaxops.argmax(y, axis=0)[7]) == r - 2 and float(jaxops.max(y, axis=0)[7]) == 9.0
    np.testing.assert_allclose(_f64(jaxops.sum(y, axis=0))[:8], [r] * 7 + [r + 8], rtol=8e-3)


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape,axis", [((1 << 26,), None), ((64, 1 << 20), 1), ((1 << 16, 1024), 1),
                                        ((1 << 20, 64), 1), ((1 << 20, 64), 0), ((1 << 18, 256), 0),
                                        ((1 << 14, 4096), 0), ((640, 20001), 1), ((792, 8192), 1),
                                        ((512, 65536), 1)])
def test_gpu_benchmark_shapes_bit_identical_and_accurate(shape, axis, dtype, key):
    """Every plan of the benchmark shapes, plus the capped row blocks of row_launch_threads
    (reduce_plan.cuh): 16-bit logsumexp/argmax rows of 397-792 in blocks of 128, float32
    logsumexp unsplit long rows and full reductions in blocks of 256."""
    x = normal(key, shape, dtype)
    for op in ("sum", "logsumexp", "argmax"):
        f = jax.jit(lambda v: getattr(jaxops, op)(v, axis))
        a, b = np.asarray(f(x)), np.asarray(f(x))
        assert a.shape == b.shape and a.dtype == b.dtype
        # atleast_1d: a full reduction is 0-d, and numpy cannot view a 0-d array as bytes.
        np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))
        if op == "argmax":
            np.testing.assert_array_equal(a, jnp.argmax(x, axis))
        else:
            _check_value(op, f(x), x, axis, False)


# Session 6 determinism check: the kernel plan must not depend on the operand's address (vector
# loads vs the element loads of a misaligned base must not change a bit). Every process computes
# the same inputs (fixed keys); the results are compared as bytes. Shapes reach every 16-byte-packed kernel: warp rows, block rows, split rows
# and full (merge), unsplit and split columns, several column tiles, and rows that are not whole
# packs (their head and tail are peeled at the same elements whatever the address).
_PLAN_PROBE = r"""
import sys
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
import numpy as np
import jaxops

SHAPES = [((300, 1024), 1), ((64, 16384), 1), ((4, 1 << 20), 1), ((3 << 18,), None),
          ((4096, 64), 0), ((1 << 16, 64), 0), ((2, 3000, 256), 1), ((512, 4096), 0),
          ((300, 1021), 1), ((64, 16389), 1), ((8, 50257), 1)]
if sys.argv[2] == "small":  # the CPU check of this script: same kinds of views, fewer elements
    SHAPES = [((30, 1024), 1), ((4, 16384), 1), ((2, 1 << 17), 1), ((3 << 14,), None),
              ((256, 64), 0), ((4096, 64), 0), ((2, 300, 256), 1), ((64, 4096), 0),
              ((30, 1021), 1), ((4, 16389), 1), ((2, 50257), 1)]
OPS = ["sum", "mean", "max", "min", "logsumexp", "argmax", "argmin"]
out = {}
for d, dtype in enumerate([jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64]):
    xs = [jax.random.normal(jax.random.PRNGKey(17 * d + i), s, jnp.float32).astype(dtype)
          for i, (s, _) in enumerate(SHAPES)]
    run = jax.jit(lambda xs: [getattr(jaxops, op)(x, a) for x, (_, a) in zip(xs, SHAPES) for op in OPS])
    for k, r in enumerate(run(xs)):
        out[f"{jnp.dtype(dtype).name}_{k}"] = np.atleast_1d(np.asarray(r)).view(np.uint8)
np.savez(sys.argv[1], **out)
"""


def _probe(tmp_path, name, env, size="full"):
    import os
    import subprocess
    import sys

    full = {k: v for k, v in os.environ.items() if k != "JAXOPS_REDUCE_ELEMENT_LOADS"}
    full.update(env)
    path = tmp_path / f"{name}.npz"
    # cwd: a `python -c` child puts its cwd first on sys.path, and the repository root's source
    # jaxops/ (no built library) would shadow the installed package.
    subprocess.run([sys.executable, "-c", _PLAN_PROBE, str(path), size], env=full, cwd=tmp_path, check=True, timeout=600)
    return dict(np.load(path))


@gpu_only
def test_gpu_results_independent_of_load_width(tmp_path):
    """Element loads (the path of a misaligned operand, forced by a test hook) give the same bits
    as the default vector loads: the plan and the order of operations do not depend on the
    pointer's alignment."""
    base = _probe(tmp_path, "base", {})
    got = _probe(tmp_path, "element_loads", {"JAXOPS_REDUCE_ELEMENT_LOADS": "1"})
    assert sorted(got) == sorted(base)
    for k in base:
        np.testing.assert_array_equal(got[k], base[k], err_msg=f"element_loads: {k}")


def test_plan_probe_runs_on_cpu(tmp_path):
    """The probe script itself (so the GPU test above cannot fail for a typo): CPU twin, one run."""
    if ON_GPU:
        pytest.skip("the GPU test runs it")
    got = _probe(tmp_path, "cpu", {}, "small")
    assert len(got) == 4 * 11 * 7 and all(v.size > 0 for v in got.values())
