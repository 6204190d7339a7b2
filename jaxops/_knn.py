"""Exact brute-force k-nearest neighbours (squared Euclidean) and k-NN classification.

How it runs: distances come from the GEMM expansion ``||q||^2 + ||r||^2 - 2 q.r``. The
references are cut into tiles; for each tile XLA's own float32 dot (``precision=HIGHEST``, so
no TF32) computes ``q.r``, and one jaxops kernel fuses the rest of the epilogue with the
k-selection of the tile and the merge into each query's running top-k list, carried across
tiles by ``lax.scan``. The distance matrix is never materialised beyond one tile of 2^28
float32 distances (1 GB): XLA's temporaries are ~1.2 GB for float32/16-bit inputs with
k <= 2048, ~3.3 GB for float64 inputs or k > 2048 (XLA-sort path), ~4.3 GB for both, plus
a padded copy of the references when n is not a multiple of the tile width. So m = 10000
queries against n = 2^20 references fit easily on one GPU. When there are
few queries the reference tiles are also split across independent lists (more parallelism on
the GPU), merged at the end with one small sort.

Order: ascending distance, ties to the lower reference index, NaN distances last (then by
index). The kernel ranks by exactly this total order, so results are deterministic.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxops._checks import check_float
from jaxops._ffi import _check_backend
from jaxops._sharding import Rule, sharded_call

__all__ = ["knn", "knn_classify"]

# The jaxops kernel handles k up to this; larger k merges tiles with an XLA sort instead
# (correct on every platform, just slower).
_MAX_KERNEL_K = 2048
# Elements of one distance tile (float32): 2^28 = 1 GB of distances bounds the working set
# (H100, session 6: 2^28 is ~2.5 % faster than 2^27 and ~8 % faster than 2^26; session 7:
# 2^29 only ~1 % faster than 2^28 at twice the memory).
_TILE_ELEMS = 1 << 28
_MIN_TILE_COLS = 1024
# Below this many queries the GPU has too few rows to stream; split the references.
_SPLIT_BELOW_ROWS = 1024
_MIN_SPLIT_COLS = 4096
_INT32_MAX = np.iinfo(np.int32).max


def knn(queries: jax.typing.ArrayLike, refs: jax.typing.ArrayLike, k: int, *,
        precision=None) -> tuple[jax.Array, jax.Array]:
    """The ``k`` nearest references of every query, by exact squared Euclidean distance.

    Args:
      queries: (m, d) float32, bfloat16, float16 or float64 array.
      refs: (n, d) array of the same kinds of dtype (the two may differ).
      k: number of neighbours, a Python int with 1 <= k <= n.
      precision: precision of the ``q.r`` products, passed to :func:`jax.lax.dot_general`.
        None (the default) means ``lax.Precision.HIGHEST``: true float32 products (no TF32),
        as exact as the GEMM expansion allows. On GPUs with tensor cores,
        ``jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3`` keeps nearly float32 accuracy and is
        several times faster than the float32 GEMM for large problems; a one-pass setting such
        as ``lax.Precision.DEFAULT`` (TF32) is fastest but reorders near ties.

    Returns:
      ``(sq_dists, indices)``: (m, k) float32 squared distances sorted ascending and the (m, k)
      int32 indices of the matching rows of ``refs``. Ties go to the lower reference index;
      NaN distances (from NaN or infinite features) rank after every number, +inf included.

    Distances are ``max(||q||^2 + ||r||^2 - 2 q.r, 0)`` computed in float32 (half-precision
    inputs are upcast first; no TF32 or half-precision products), so they differ from the
    exact value by a few float32 ulps of ``||q||^2 + ||r||^2``; with float64 inputs they are
    computed in float64 and rounded to float32 for ranking and output.

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
    """None -> HIGHEST (true float32 products); else a lax.Precision (or its name) or preset."""
    if precision is None:
        return lax.Precision.HIGHEST
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
    tile_elems = _TILE_ELEMS  # read on every call; the plan is a static argument of _search
    splits = 1
    if kernel and m < _SPLIT_BELOW_ROWS and n >= 2 * _MIN_SPLIT_COLS:
        splits = max(1, min(-(-2 * _SPLIT_BELOW_ROWS // max(m, 1)), n // _MIN_SPLIT_COLS))
    per_split = -(-n // splits)
    tm = m
    tn_max = max(_MIN_TILE_COLS, tile_elems // (splits * max(m, 1)))
    if splits * tm * _MIN_TILE_COLS > tile_elems:
        # Query tiles of equal size (fewest tiles of at most tm_max rows): padding m up to a
        # multiple of tm_max could waste up to a whole tile of GEMM and selection work.
        tm_max = max(1, tile_elems // (splits * _MIN_TILE_COLS))
        tm = -(-m // -(-m // tm_max))
        tn_max = _MIN_TILE_COLS
    if splits == 1 and per_split <= tn_max:
        return 1, tm, n, 1  # one tile, no padding
    nt = -(-per_split // tn_max)
    tn = -(-per_split // nt)
    tn = -(-tn // 128) * 128  # 16-byte aligned rows for the kernel's vector loads
    nt = -(-per_split // tn)
    return splits, tm, tn, nt


@partial(jax.jit, static_argnums=(2, 3, 4))
def _search(q, r, k, plan, precision):
    m, d = q.shape
    n = r.shape[0]
    f64 = jnp.float64 in (q.dtype, r.dtype)
    cdt = jnp.float64 if f64 else jnp.float32
    q = q.astype(cdt)
    r = r.astype(cdt)
    if m == 0:
        return jnp.zeros((0, k), jnp.float32), jnp.zeros((0, k), jnp.int32)
    kernel = k <= _MAX_KERNEL_K
    splits, tm, tn, nt = plan
    qn = jnp.sum(q * q, axis=-1)
    rn = jnp.sum(r * r, axis=-1)

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

    if tm >= m:
        return one_query_tile(q, qn)
    mt = -(-m // tm)
    pad = mt * tm - m
    qp = jnp.pad(q, ((0, pad), (0, 0))).reshape(mt, tm, d)
    qnp = jnp.pad(qn, (0, pad)).reshape(mt, tm)
    best_d, best_i = lax.map(lambda a: one_query_tile(*a), (qp, qnp))
    return best_d.reshape(mt * tm, k)[:m], best_i.reshape(mt * tm, k)[:m]


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
    kernel = k <= _MAX_KERNEL_K
    return _search(q, r, k, _plan(q.shape[0], r.shape[0], k, kernel), precision)


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
