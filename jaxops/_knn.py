"""Exact brute-force k-nearest neighbours (squared Euclidean) and k-NN classification.

How it runs: distances come from the GEMM expansion ``||q||^2 + ||r||^2 - 2 q.r``. The
references are cut into tiles; for each tile XLA's own dot computes ``q.r``, and one jaxops
kernel fuses the rest of the epilogue with the k-selection of the tile and the merge into each
query's running top-k list, carried across tiles by ``lax.scan``. The distance matrix is never
materialised beyond one tile of 2^28 float32 distances (1 GB; on the CPU 2^22, 16 MB, which
stays in cache): on a GPU XLA's temporaries are ~1.2 GB for float32/16-bit inputs with k <= 2048,
~3.3 GB for float64 inputs or k > 2048 (XLA-sort path), ~4.3 GB for both, plus a padded copy
of the references when n is not a multiple of the tile width. So m = 10000 queries against
n = 2^20 references fit easily on one GPU. When there are few queries the reference tiles are
also split across independent lists (more parallelism: GPUs below 1024 queries, the CPU below
4), merged at the end with one small sort.

On GPUs, large float32/16-bit searches run that scan on the tensor cores (one-pass TF32) as a
*filter* only: it keeps a few more candidates than k by provable lower bounds of their
distances, whose exact float32 distances then decide; a query whose candidates cannot be proved
to hold its k nearest is searched again exactly (see "TF32 filter" below). The results are
those of the float32 search either way, at a fraction of the float32 GEMM's time.

Order: ascending distance, ties to the lower reference index, NaN distances last (then by
index). The kernel ranks by exactly this total order, so results are deterministic.
"""
from __future__ import annotations

import math
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxops._checks import check_float
from jaxops._ffi import _check_backend
from jaxops._sharding import Rule, in_batched_trace, sharded_call

__all__ = ["knn", "knn_classify"]

# The CUDA kernel handles k up to this (its lists live in shared memory); larger k merges tiles
# with an XLA sort instead (correct on every platform, just slower). The CPU twin takes any k:
# XLA:CPU's sort ran ~100x slower than the twin (1000 x 100000, k = 3000: 27 s).
_MAX_KERNEL_K = 2048
_CPU_MAX_KERNEL_K = np.iinfo(np.int32).max
# Elements of one distance tile (float32): 2^28 = 1 GB of distances bounds the working set
# (H100, session 6: 2^28 is ~2.5 % faster than 2^27 and ~8 % faster than 2^26; session 7:
# 2^29 only ~1 % faster than 2^28 at twice the memory).
_TILE_ELEMS = 1 << 28
# The CPU's tiles: 2^22 distances (16 MB) stay in cache between the GEMM that writes them and
# the twin that reads them (2 cores, jax 0.10: 1.1-2.2x faster than 2^28 at 2^24-2^26 distances;
# 2^21 and 2^23 were 2-10 % slower). The twin sorts each row's k keys once a tile, so a tile
# is at least 64 k columns wide, with fewer query rows (4096 x 65536, k = 1024: 4690 ms with
# 1024-column tiles, 1138 with 8 k, 859 with 32 k, 789 with 64 k).
_CPU_TILE_ELEMS = 1 << 22
_CPU_TILE_COLS_PER_K = 64
_MIN_TILE_COLS = 1024
# Below this many queries the GPU has too few rows to stream; split the references.
_SPLIT_BELOW_ROWS = 1024
_MIN_SPLIT_COLS = 4096
# The CPU twin runs whole query rows on XLA's threads; below this many queries it splits the
# references too (a fixed count, so that no result depends on the machine's core count). The
# lists are merged by an XLA sort, ~200 ns an element there against ~11 ns an element of the
# search itself (2 cores, jax 0.10), so each list keeps this many references per list element
# (at 32, two queries of 200000 with k = 2500 in 2 lists ran at 0.94x XLA, the sort's 2 ms
# cancelling the second thread's gain).
_CPU_SPLIT_ROWS = 4
_CPU_SPLIT_COLS_PER_K = 64
_INT32_MAX = np.iinfo(np.int32).max


def knn(queries: jax.typing.ArrayLike, refs: jax.typing.ArrayLike, k: int, *,
        precision=None) -> tuple[jax.Array, jax.Array]:
    """The ``k`` nearest references of every query, by exact squared Euclidean distance.

    Args:
      queries: (m, d) float32, bfloat16, float16 or float64 array.
      refs: (n, d) array of the same kinds of dtype (the two may differ).
      k: number of neighbours, a Python int with 1 <= k <= n.
      precision: None (the default): distances from float32 products (no TF32 or
        half-precision products decide the result), as exact as the GEMM expansion allows;
        on GPUs large searches get there through the tensor cores (a TF32 filter whose
        candidates are proved, then ranked by their float32 distances). Otherwise the
        precision of the one ``q.r`` GEMM, passed to :func:`jax.lax.dot_general` as given
        (``lax.Precision.HIGHEST``: the float32 GEMM alone, no filter; a one-pass setting
        such as ``lax.Precision.DEFAULT`` (TF32) ranks by TF32 products and reorders near ties).

    Returns:
      ``(sq_dists, indices)``: (m, k) float32 squared distances sorted ascending and the (m, k)
      int32 indices of the matching rows of ``refs``. Ties go to the lower reference index;
      NaN distances (from NaN or infinite features) rank after every number, +inf included.

    Distances are ``max(||q||^2 + ||r||^2 - 2 q.r, 0)`` computed in float32 (half-precision
    inputs are upcast first), so they differ from the exact value by a few float32 ulps of
    ``||q||^2 + ||r||^2``; with float64 inputs they are computed in float64 and rounded to
    float32 for ranking and output.

    ``JAXOPS_KNN_FILTER=0`` in the environment turns the TF32 filter off (``1`` forces it at
    every size and on the CPU, where it is emulated: for tests).

    Works under ``jax.jit`` and ``jax.vmap`` (batched query and/or reference sets). Not
    differentiable: ``jax.grad`` through it raises a TypeError (wrap the inputs in
    ``jax.lax.stop_gradient`` if the neighbours only feed a differentiable computation).
    """
    q, r = _check_inputs("knn", queries, refs, k)
    return _knn(q, r, int(k), _check_precision("knn", precision))


def knn_classify(queries: jax.typing.ArrayLike, refs: jax.typing.ArrayLike,
                 labels: jax.typing.ArrayLike, k: int, num_classes: int, *,
                 precision=None) -> jax.Array:
    """Majority vote of the labels of each query's ``k`` nearest references.

    Args:
      queries: (m, d) float array; refs: (n, d) float array (see :func:`knn`).
      labels: (n,) integer array, the class of each reference.
      k: neighbours per query, 1 <= k <= n.
      num_classes: number of classes; labels outside ``[0, num_classes)`` are not counted
        (and never index anything).
      precision: as for :func:`knn`.

    Returns:
      (m,) int32 predicted classes, computed on the device. Vote ties go to the smallest label
      (scikit-learn's rule); a query none of whose neighbours has a valid label gets 0 (every
      class ties at zero votes). Neighbours are exactly those of :func:`knn`.
    """
    fn = "knn_classify"
    q, r = _check_inputs(fn, queries, refs, k)
    labels = jnp.asarray(labels)
    if not (jnp.issubdtype(labels.dtype, jnp.integer)):
        raise TypeError(f"jaxops.{fn}: labels must be an integer array, got dtype {labels.dtype}")
    if labels.shape != (r.shape[0],):
        raise ValueError(
            f"jaxops.{fn}: labels must have shape ({r.shape[0]},) to match refs, got {labels.shape}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)):
        raise TypeError(f"jaxops.{fn}: num_classes must be an int, got {num_classes!r}")
    if not 1 <= num_classes <= _INT32_MAX - 1:
        raise ValueError(f"jaxops.{fn}: num_classes must be in [1, 2^31 - 1), got {num_classes}")
    return _classify(q, r, labels, int(num_classes), int(k), _check_precision(fn, precision))


# --------------------------------------------------------------------------- checks


def _check_inputs(fn: str, queries, refs, k):
    q = jnp.asarray(queries)
    r = jnp.asarray(refs)
    check_float(fn, "queries", q)
    check_float(fn, "refs", r)
    if q.ndim != 2:
        raise ValueError(f"jaxops.{fn}: queries must have shape (m, d), got rank {q.ndim} {q.shape}")
    if r.ndim != 2:
        raise ValueError(f"jaxops.{fn}: refs must have shape (n, d), got rank {r.ndim} {r.shape}")
    if q.shape[1] != r.shape[1]:
        raise ValueError(f"jaxops.{fn}: queries have {q.shape[1]} features but refs have "
                         f"{r.shape[1]}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"jaxops.{fn}: k must be a Python int, got {k!r}")
    n = r.shape[0]
    if n > _INT32_MAX:
        raise ValueError(f"jaxops.{fn}: at most 2^31 - 1 references are supported, got {n}")
    if not 1 <= k <= n:
        raise ValueError(f"jaxops.{fn}: k must satisfy 1 <= k <= n = {n}, got k = {k}")
    return q, r


def _check_precision(fn: str, precision):
    """None stays None (exact float32 distances, by the filter where it pays; see _search_all);
    else a lax.Precision (or its name) or a preset, used for the one GEMM as given."""
    if precision is None:
        return None
    if isinstance(precision, str):
        try:
            return lax.Precision(precision)
        except ValueError:
            raise ValueError(f"jaxops.{fn}: unknown precision {precision!r}") from None
    if isinstance(precision, (lax.Precision, lax.DotAlgorithmPreset)):
        return precision
    raise TypeError(f"jaxops.{fn}: precision must be None, a lax.Precision or a "
                    f"lax.DotAlgorithmPreset, got {precision!r}")


# --------------------------------------------------------------------------- search


@partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _knn(q, r, k, precision):
    return sharded_call("knn", partial(_search_local, k=k, precision=precision), _KNN_RULE, q, r)


@_knn.defjvp
def _knn_jvp(k, precision, primals, tangents):
    raise TypeError(
        "jaxops.knn is not differentiable (neighbour indices are discrete and the selection has "
        "no gradient rule); apply jax.lax.stop_gradient to its inputs, or compute distances of "
        "the returned indices with jnp to differentiate them")


def _plan(m: int, n: int, k: int, kernel: bool):
    """(splits, query tile, column tile, column tiles per split)."""
    # Read on every call (tests shrink them); the plan is a static argument of _search.
    if jax.default_backend() == "gpu":
        tile_elems, min_cols = _TILE_ELEMS, _MIN_TILE_COLS
    else:
        tile_elems = min(_TILE_ELEMS, _CPU_TILE_ELEMS)
        min_cols = max(_MIN_TILE_COLS, _CPU_TILE_COLS_PER_K * k) if kernel else _MIN_TILE_COLS
    splits = _splits(m, n, k) if kernel else 1
    per_split = -(-n // splits)
    tm = m
    tn_max = max(min_cols, tile_elems // (splits * max(m, 1)))
    if splits * tm * min_cols > tile_elems:
        # Query tiles of equal size (fewest tiles of at most tm_max rows): padding m up to a
        # multiple of tm_max could waste up to a whole tile of GEMM and selection work.
        tm_max = max(1, tile_elems // (splits * min_cols))
        tm = -(-m // -(-m // tm_max))
        tn_max = min_cols
    if splits == 1 and per_split <= tn_max:
        return 1, tm, n, 1  # one tile, no padding
    nt = -(-per_split // tn_max)
    tn = -(-per_split // nt)
    tn = -(-tn // 128) * 128  # 16-byte aligned rows for the kernel's vector loads
    nt = -(-per_split // tn)
    return splits, tm, tn, nt


def _kernel_takes(k: int) -> bool:
    """Whether the selection kernel keeps lists of k (else the XLA-sort path merges the tiles)."""
    return k <= (_MAX_KERNEL_K if jax.default_backend() == "gpu" else _CPU_MAX_KERNEL_K)


def _splits(m: int, n: int, k: int) -> int:
    """Independent lists each query's references are cut into, merged at the end by one sort:
    enough (query, list) pairs to run in parallel. A GPU wants ~2048 row streams. On the CPU the
    merge's sort costs ~20x the search per element, so it splits only a few queries, and only
    where the sort stays small: on 2 cores, 64 x 16384 with k = 256 took 13.2 ms split 4 ways
    (the GPU's plan), 3.2 ms unsplit; one query of 2^20 gained 12 % from 2 lists."""
    if n < 2 * _MIN_SPLIT_COLS:
        return 1
    if jax.default_backend() == "gpu":
        want = -(-2 * _SPLIT_BELOW_ROWS // max(m, 1)) if m < _SPLIT_BELOW_ROWS else 1
        return max(1, min(want, n // _MIN_SPLIT_COLS))
    want = -(-_CPU_SPLIT_ROWS // max(m, 1)) if m < _CPU_SPLIT_ROWS else 1
    return max(1, min(want, n // _MIN_SPLIT_COLS, n // (_CPU_SPLIT_COLS_PER_K * k)))


@partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _search(q, r, k, plan, precision, kernel):
    q, r = _compute_dtype(q, r)
    if q.shape[0] == 0:
        return jnp.zeros((0, k), jnp.float32), jnp.zeros((0, k), jnp.int32)
    return _search_tiles(q, r, jnp.sum(q * q, axis=-1), jnp.sum(r * r, axis=-1), k, plan, precision,
                         kernel)


def _compute_dtype(q, r):
    cdt = jnp.float64 if jnp.float64 in (q.dtype, r.dtype) else jnp.float32
    return q.astype(cdt), r.astype(cdt)


def _search_tiles(q, r, qn, rn, k, plan, precision, kernel=True):
    """Top-k by the GEMM expansion (qn + rn - 2 q.r), given the squared norms (or, for the
    filter, lowered stand-ins for them); q and r already in the compute dtype, m >= 1.
    kernel: the selection kernel merges each tile (_kernel_takes(k)), else an XLA sort. A
    static argument of the callers' jit, so a trace never outlives the choice."""
    m, d = q.shape
    n = r.shape[0]
    f64 = q.dtype == jnp.float64
    splits, tm, tn, nt = plan

    # References as (nt, splits, tn, d): step j of the scan handles tiles j*splits + s, whose
    # first reference is (j*splits + s)*tn. Padding rows sit past n and are never selected.
    total = splits * nt * tn
    if total != n:
        r = jnp.pad(r, ((0, total - n), (0, 0)))
        rn = jnp.pad(rn, (0, total - n))
    r_tiles = r.reshape(nt, splits, tn, d)
    rn_tiles = rn.reshape(nt, splits, tn)
    bases = (jnp.arange(nt * splits, dtype=jnp.int32) * tn).reshape(nt, splits)

    def one_query_tile(qt, qnt):
        rows = qt.shape[0]
        empty_index = -1 if kernel else _INT32_MAX
        init = (jnp.full((splits, rows, k), jnp.nan, jnp.float32),
                jnp.full((splits, rows, k), empty_index, jnp.int32))

        def step(carry, xs):
            rt, rnt, base = xs
            return _merge_tile(carry, qt, qnt, rt, rnt, base, n, k, kernel, f64, precision), None

        if nt == 1:
            best_d, best_i = step(init, (r_tiles[0], rn_tiles[0], bases[0]))[0]
        else:
            (best_d, best_i), _ = lax.scan(step, init, (r_tiles, rn_tiles, bases))
        if splits > 1:
            best_d, best_i = _merge_splits(best_d, best_i, k)
        else:
            best_d, best_i = best_d[0], best_i[0]
        return best_d, best_i

    return _map_row_chunks(one_query_tile, tm, q, qn)


def _map_row_chunks(fn, per, *xs):
    """fn(*xs) computed over chunks of `per` rows (lax.map; the last chunk zero-padded), its
    results' rows put back together: bounds the working set of row-independent work."""
    m = xs[0].shape[0]
    if per >= m:
        return fn(*xs)
    chunks = -(-m // per)
    pad = chunks * per - m
    split = lambda x: jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(  # noqa: E731
        (chunks, per) + x.shape[1:])
    out = lax.map(lambda a: fn(*a), tuple(split(x) for x in xs))
    return jax.tree.map(lambda o: o.reshape((chunks * per,) + o.shape[2:])[:m], out)


def _inner_products(q, rt, precision):
    """(splits, rows, tn) = q . rt^T for every split, in the compute dtype."""
    if rt.shape[0] == 1:
        ip = lax.dot_general(q, rt[0], (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=q.dtype)
        return ip[None]
    qb = jnp.broadcast_to(q, (rt.shape[0],) + q.shape)
    return lax.dot_general(qb, rt, (((2,), (2,)), ((0,), (0,))), precision=precision,
                           preferred_element_type=q.dtype)


def _merge_tile(carry, qt, qnt, rt, rnt, base, n, k, kernel, f64, precision):
    prev_d, prev_i = carry
    splits, rows = prev_d.shape[0], prev_d.shape[1]
    ip = _inner_products(qt, rt, precision)
    if f64 or not kernel:
        # Epilogue in the compute dtype (float64 keeps its precision), then ranked as float32.
        dist = (qnt[None, :, None] + rnt[:, None, :]) - 2 * ip
        tile, mode = dist.astype(jnp.float32), 1
    else:
        tile, mode = ip, 0
    if not kernel:
        return _merge_tile_sort(prev_d, prev_i, tile, base, n, k)
    qn32 = jnp.broadcast_to(qnt.astype(jnp.float32), (splits, rows))
    rn32 = rnt.astype(jnp.float32)
    out = (jax.ShapeDtypeStruct(prev_d.shape, jnp.float32),
           jax.ShapeDtypeStruct(prev_i.shape, jnp.int32))
    _check_backend("knn")
    # The running lists are updated in place (outputs alias prev_d / prev_i): each row's list is
    # read whole before that row's result is written (kernel: into shared memory; CPU twin: into
    # a candidate vector), and rows never touch each other's lists. Without the alias XLA copies
    # the outputs back into the scan's carry every tile (2 x m x k x 4 B a tile).
    call = jax.ffi.ffi_call("jaxops_knn_select", out, vmap_method="broadcast_all",
                            input_output_aliases={3: 0, 4: 1})
    return tuple(call(tile, qn32, rn32, prev_d, prev_i, base.astype(jnp.int32),
                      n=np.int64(n), mode=np.int64(mode)))


def _canonical(dist):
    """Clamps at 0 (folding -0 into +0) and makes every NaN the positive quiet NaN, so XLA's
    total-order float sort ranks them like the kernel does."""
    return jnp.where(dist > 0, dist, jnp.where(jnp.isnan(dist), jnp.nan, 0.0)).astype(jnp.float32)


def _sort_take(d, i, k):
    d, i = lax.sort((d, i), dimension=d.ndim - 1, num_keys=2)
    return d[..., :k], i[..., :k]


def _merge_tile_sort(prev_d, prev_i, tile, base, n, k):
    """Large-k path: one XLA sort of (running list ++ tile) per tile."""
    tn = tile.shape[-1]
    idx = base[:, None] + jnp.arange(tn, dtype=jnp.int32)[None, :]  # (splits, tn)
    valid = idx < n
    d = jnp.where(valid[:, None, :], _canonical(tile), jnp.nan)
    i = jnp.broadcast_to(jnp.where(valid, idx, _INT32_MAX)[:, None, :], d.shape)
    return _sort_take(jnp.concatenate([prev_d, d], -1), jnp.concatenate([prev_i, i], -1), k)


def _merge_splits(best_d, best_i, k):
    """(splits, rows, k) lists -> (rows, k), with empty slots (-1) ranked last."""
    splits, rows, _ = best_d.shape
    d = jnp.moveaxis(best_d, 0, 1).reshape(rows, splits * k)
    i = jnp.moveaxis(best_i, 0, 1).reshape(rows, splits * k)
    i = jnp.where(i < 0, _INT32_MAX, i)
    return _sort_take(_canonical(d), i, k)



# --------------------------------------------------------------------------- TF32 filter
# The exact float32 GEMM runs on the SIMT cores; a one-pass TF32 GEMM runs on the tensor cores
# several times faster but gets q.r wrong by up to ~2^-10 |q||r|, which would reorder near
# neighbours. So TF32 only filters: with the squared norms lowered by a bound on that error,
# the search keeps the kp > k smallest *lower bounds* of each query's distances; the kp
# candidates' exact float32 distances are then computed, and the k best by (distance, index)
# returned. A query's result is exact when its kp-th lower bound exceeds U, the k-th smallest
# *upper* bound among its candidates: every reference left out then lies strictly beyond k
# candidates. Every query is checked on the device. The few that fail (many references within
# the error bound of their k-th distance: exact ties, huge common offsets) are searched again
# exactly, up to _fallback_rows of them; past that, or if an input is not finite, the whole
# exact search runs instead (lax.switch). Results never depend on the filter.
#
# The bound, per query and reference (u = 2^-24, S = sum |q_i r_i| <= (|q|^2 + |r|^2) / 2):
#   operands rounded to TF32 here:       product error  <= (2 * 2^-11 + 2^-22) S
#   accumulation, tensor core / exact:   <= d 2^-22 S + d 2^-23 S  (4x / 2x the f32 ideal)
#   the epilogues' roundings:            <= 2^-21 (qn + rn)
# so |dist_tf32 - dist_f32| <= c/2 (qn + rn) with c = 2 (2^-10 + 2^-22 + 3 d 2^-23) + 2^-18, and
# the search ranks (1 - c)(qn + rn) - tau - 2 q.r_tf32 <= dist_f32 (tau covers flushed subnormal
# inputs and products, absolutely). Linear in the norms, it runs through the unchanged kernel.
# Rounding the operands here (to nearest) halves the bound of the hardware's truncation, and
# the tensor cores then see exact TF32 values. H200 (session 34), raw operands: observed errors
# 6-43 % of the product and accumulation terms (d = 1024 ... 32), so the slack is 2.3-16x them.

# Filter only when the TF32 GEMM saves more than the rerank costs (H100: from ~2^30 MACs).
_FILTER_MIN_WORK = 1 << 30
_FILTER_MAX_D = 4096
_FILTER_ENV = "JAXOPS_KNN_FILTER"  # "1": filter at every size and on every platform; "0": never


def _filter_slack(d: int) -> float:
    return 2.0 * (2.0 ** -10 + 2.0 ** -22 + 3.0 * d * 2.0 ** -23) + 2.0 ** -18


def _filter_list(k: int, n: int):
    """Candidates kept per query: k plus a quarter (at least 16), to a power of two (the
    kernel's list size), at most the kernel's largest list and below n; None if none fits."""
    kp = 32
    while kp < k + max(k // 4, 16):
        kp *= 2
    return kp if kp <= _MAX_KERNEL_K and kp < n else None


def _fallback_rows(m: int) -> int:
    """How many unproved queries are searched again on their own; past that, all m are."""
    return min(m, max(64, m // 128))


def _use_filter(q, r, k, precision) -> bool:
    forced = os.environ.get(_FILTER_ENV, "")
    if forced == "0" or precision is not None or jnp.float64 in (q.dtype, r.dtype):
        return False
    m, d = q.shape
    n = r.shape[0]
    kp = _filter_list(k, n)
    if m == 0 or d == 0 or kp is None:
        return False
    if forced == "1":
        return True
    # The filter pays where the one-pass TF32 GEMM is several times faster than the float32
    # one (GPU tensor cores); on the CPU both GEMMs cost the same. Under vmap the proof's
    # lax.switch would run the exact search as well, always.
    return (jax.default_backend() == "gpu" and not in_batched_trace() and 2 * kp <= n
            and m * n * d >= _FILTER_MIN_WORK and d <= _FILTER_MAX_D)


def _filter_precision():
    """The filter's GEMM of TF32-valued operands: one-pass TF32 on the tensor cores (GPUs), or
    float32 products on the CPU (tests: the same products of such operands, up to the
    accumulation). Chosen in Python by the default backend, not by lax.platform_dependent:
    jax 0.5 lowers every branch of that, and its CPU rejects the TF32 preset."""
    if jax.default_backend() == "gpu":
        return lax.DotAlgorithmPreset.TF32_TF32_F32
    return lax.Precision.HIGHEST


def _round_tf32(x):
    """float32 -> nearest TF32 value (10 mantissa bits; ties away from zero), as float32."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return lax.bitcast_convert_type((bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000),
                                    jnp.float32)


@partial(jax.jit, static_argnames=("k", "kp", "plan", "exact_plan"))
def _filtered_search(q, r, *, k, kp, plan, exact_plan):
    q, r = _compute_dtype(q, r)
    m, n = q.shape[0], r.shape[0]
    qn = jnp.sum(q * q, axis=-1)
    rn = jnp.sum(r * r, axis=-1)
    best, proved = _filter(q, r, qn, rn, k, kp, plan)
    failed = m - jnp.sum(proved.astype(jnp.int32))
    rows = _fallback_rows(m)

    def all_exact():
        return _search_tiles(q, r, qn, rn, k, exact_plan, lax.Precision.HIGHEST)

    def some_exact():  # the failed queries (at most `rows`) searched again; padding dropped
        which = jnp.nonzero(~proved, size=rows, fill_value=m)[0]
        safe = jnp.minimum(which, m - 1)
        again = _search_tiles(q[safe], r, qn[safe], rn, k, _plan(rows, n, k, True),
                              lax.Precision.HIGHEST)
        return tuple(b.at[which].set(a, mode="drop") for b, a in zip(best, again))

    branches = [lambda: best, all_exact] if rows >= m else [lambda: best, some_exact, all_exact]
    choice = jnp.where(failed == 0, 0, jnp.where(failed <= rows, 1, len(branches) - 1))
    return lax.switch(choice, branches)


def _filter(q, r, qn, rn, k, kp, plan):
    """((sq_dists, indices) of the k best of each query's kp candidates, and per query whether
    they are proved to be its exact k nearest)."""
    c = _filter_slack(q.shape[1])
    big = jnp.maximum(jnp.max(qn), jnp.max(rn))
    finite = jnp.isfinite(big) & (big < 2.0 ** 100)
    tau = jnp.where(finite, q.shape[1] * 2.0 ** -100 * (1 + jnp.sqrt(big)), 0).astype(jnp.float32)
    lower, cand = _search_tiles(_round_tf32(q), _round_tf32(r), (1 - c) * qn - tau,
                                (1 - c) * rn, kp, plan, _filter_precision())
    cand = jnp.clip(cand, 0, r.shape[0] - 1)  # lists are full (kp < n); clip is insurance
    rn_c = jnp.take(rn, cand, axis=0)
    dist = _exact_distances(q, qn, r, rn_c, cand)
    upper = (lower + 2 * (c * (qn[:, None] + rn_c) + tau)) * (1 + 2.0 ** -20)
    u_k = lax.sort(upper, dimension=1)[:, k - 1]
    proved = finite & (lower[:, kp - 1] > u_k)
    return _sort_take(_canonical(dist), cand, k), proved


_RERANK_ELEMS = 1 << 25  # gathered reference values per chunk of queries (128 MB)


def _exact_distances(q, qn, r, rn_c, cand):
    """float32 squared distances of each query to its candidates, by the same expansion as
    the exact search (products summed in float32; no tensor cores), chunked over queries."""
    def rows(q, qn, rn_c, cand):
        ip = jnp.sum(q[:, None, :] * jnp.take(r, cand, axis=0), axis=-1)
        return (qn[:, None] + rn_c) - 2 * ip

    per = max(1, _RERANK_ELEMS // (cand.shape[1] * max(q.shape[1], 1)))
    return _map_row_chunks(rows, per, q, qn, rn_c, cand)


# --------------------------------------------------------------------------- many devices
# (jaxops._sharding) Queries split across devices are independent. References split across
# devices: each device finds the top-k of its own block, with global indices, and one
# all-gather of those small (m, k) lists feeds a merge by (distance, index): the order of the
# single-device search. The feature axis is never split (resharded if a user splits it).

_KNN_RULE = Rule(operands=(("m", "d"), ("n", "d")), results=(("m", "k"), ("m", "k")),
                 replicated=("d",), reduced=("n",))
_CLASSIFY_RULE = Rule(operands=(("m", "d"), ("n", "d"), ("n",)), results=(("m",),),
                      replicated=("d",), reduced=("n",))


@partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5))
def _classify(q, r, labels, num_classes, k, precision):
    local = partial(_classify_local, num_classes=num_classes, k=k, precision=precision)
    return sharded_call("knn_classify", local, _CLASSIFY_RULE, q, r, labels)


@_classify.defjvp
def _classify_jvp(num_classes, k, precision, primals, tangents):
    return _knn_jvp(k, precision, primals[:2], tangents[:2])


def _search_all(q, r, k, precision):
    """The search of every reference held here (all of them on one device)."""
    m, n = q.shape[0], r.shape[0]
    kernel = _kernel_takes(k)
    plan = _plan(m, n, k, kernel)
    if not _use_filter(q, r, k, precision):
        return _search(q, r, k, plan, lax.Precision.HIGHEST if precision is None else precision, kernel)
    kp = _filter_list(k, n)
    return _filtered_search(q, r, k=k, kp=kp, plan=_plan(m, n, kp, True), exact_plan=plan)


def _local_top_k(q, r, k, names, extra, *values):
    """This device's top-k with global indices, gathered over the devices of `names`:
    (m, devices * k') lists, k' = min(k, references here), plus `values` (per reference)
    looked up at the local indices and gathered alike."""
    n_local = r.shape[0]
    d, i = _search_all(q, r, min(k, n_local), *extra)
    looked_up = [jnp.take(v, i, axis=0, mode="clip") for v in values]
    i = i + (lax.axis_index(names) * n_local).astype(jnp.int32)
    gather = lambda v: lax.all_gather(v, names, axis=v.ndim - 1, tiled=True)  # noqa: E731
    return _canonical(gather(d)), gather(i), [gather(v) for v in looked_up]


def _search_local(q, r, *, axes, k, precision):
    names = axes.get("n", ())
    if not names:
        return _search_all(q, r, k, precision)
    d, i, _ = _local_top_k(q, r, k, names, (precision,))
    return _sort_take(d, i, k)


def _classify_local(q, r, labels, *, axes, num_classes, k, precision):
    names = axes.get("n", ())
    if not names:
        return _vote(labels, _search_all(q, r, k, precision)[1], num_classes)
    d, i, (lab,) = _local_top_k(q, r, k, names, (precision,), labels)
    _, _, lab = lax.sort((d, i, lab), dimension=d.ndim - 1, num_keys=2)
    lab = lab[..., :k]
    # _vote looks labels up by index: hand it the k labels themselves, indexed 0..k-1 per row.
    return jax.vmap(lambda row: _vote(row, jnp.arange(k, dtype=jnp.int32), num_classes))(lab)

# --------------------------------------------------------------------------- vote


@partial(jax.jit, static_argnums=2)
def _vote(labels, idx, num_classes):
    """Majority label of each row of idx; ties to the smallest label; invalid labels ignored."""
    lab = jnp.take(labels, idx, axis=0, mode="clip")
    valid = (lab >= 0) & (lab < num_classes)
    s = jnp.sort(jnp.where(valid, lab, num_classes).astype(jnp.int32), axis=-1)
    k = s.shape[-1]
    pos = jnp.arange(k, dtype=jnp.int32)
    starts = jnp.concatenate(
        [jnp.ones(s.shape[:-1] + (1,), bool), s[..., 1:] != s[..., :-1]], axis=-1)
    run_start = lax.cummax(jnp.where(starts, pos, 0), axis=s.ndim - 1)
    count = jnp.where(s < num_classes, pos - run_start + 1, 0)
    # The first position reaching the largest count ends the smallest label's winning run.
    best = jnp.argmax(count, axis=-1)
    winner = jnp.take_along_axis(s, best[..., None], axis=-1)[..., 0]
    return jnp.where(jnp.max(count, axis=-1) > 0, winner, 0).astype(jnp.int32)
