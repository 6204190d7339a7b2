"""jaxops.knn / knn_classify against a float64 NumPy brute force (stable, lexicographic order)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ON_GPU, gpu_only

import jaxops
from jaxops import _knn as knn_module

FLOATS = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64]


# ----------------------------------------------------------------------------- reference


def exact_sq_dists(q, r):
    """float64 squared distances (q, r as given, upcast exactly), NaN where features are NaN/inf."""
    q = np.asarray(jnp.asarray(q).astype(jnp.float64))
    r = np.asarray(jnp.asarray(r).astype(jnp.float64))
    if q.shape[0] * r.shape[0] * max(q.shape[1], 1) <= 4_000_000:
        with np.errstate(invalid="ignore", over="ignore"):
            d = ((q[:, None, :] - r[None, :, :]) ** 2).sum(-1)
    else:  # exact enough in float64 for float32 data; non-finite rows are replaced below
        with np.errstate(invalid="ignore", over="ignore"):
            d = (q * q).sum(1)[:, None] + (r * r).sum(1)[None, :] - 2 * q @ r.T
        d = np.maximum(d, 0)
    # Rows with inf/NaN features follow the GEMM expansion jaxops documents: inf - inf = NaN.
    bad_q = ~np.isfinite(q).all(1)
    bad_r = ~np.isfinite(r).all(1)
    if bad_q.any() or bad_r.any():
        with np.errstate(invalid="ignore", over="ignore"):
            expansion = (q * q).sum(1)[:, None] + (r * r).sum(1)[None, :] - 2 * q @ r.T
            expansion = np.where(expansion > 0, expansion, np.where(np.isnan(expansion), np.nan, 0))
        bad = bad_q[:, None] | bad_r[None, :]
        d = np.where(bad, expansion, d)
    return d


def ref_order(d):
    """Row-wise order: ascending distance, NaN last, ties to the lower index (stable)."""
    nan = np.isnan(d)
    return np.lexsort((np.broadcast_to(np.arange(d.shape[1]), d.shape), np.where(nan, 0, d), nan),
                      axis=-1)


def ref_knn(q, r, k):
    d = exact_sq_dists(q, r)
    order = ref_order(d)[:, :k]
    return np.take_along_axis(d, order, 1), order, d


def scale_tol(q, r):
    """Per-row tolerance of the float32 GEMM expansion: a few ulps of ||q||^2 + max ||r||^2."""
    q = np.asarray(jnp.asarray(q).astype(jnp.float64))
    r = np.asarray(jnp.asarray(r).astype(jnp.float64))
    qn = np.nan_to_num((q * q).sum(1), nan=0, posinf=0)
    rn = np.nan_to_num((r * r).sum(1), nan=0, posinf=0)
    return 4e-6 * (qn + (rn.max() if rn.size else 0))[:, None] + 1e-30


def check_knn(q, r, k, dists, idx, exact=False):
    dists, idx = np.asarray(dists), np.asarray(idx)
    m, n = q.shape[0], r.shape[0]
    assert dists.shape == (m, k) and idx.shape == (m, k)
    assert dists.dtype == np.float32 and idx.dtype == np.int32
    rd, ri, full = ref_knn(q, r, k)
    if exact:
        np.testing.assert_array_equal(idx, ri)
        np.testing.assert_array_equal(dists, rd.astype(np.float32))
        return
    assert ((idx >= 0) & (idx < n)).all()
    assert all(len(set(row)) == k for row in idx.tolist()), "repeated neighbour"
    tol = scale_tol(q, r)
    true_of_returned = np.take_along_axis(full, idx, 1)
    np.testing.assert_array_equal(np.isnan(dists), np.isnan(true_of_returned))
    fin = ~np.isnan(dists)
    with np.errstate(invalid="ignore"):
        near = (np.abs(dists - true_of_returned) <= tol) | (dists == true_of_returned)
    assert near[fin].all()
    # The returned list is sorted by its own (distance, index) order, NaN last.
    assert _sorted_with_index_ties(dists, idx)
    # Same neighbours as the reference except where distances tie within tolerance.
    differ = idx != ri
    both_nan = np.isnan(true_of_returned) & np.isnan(rd)
    with np.errstate(invalid="ignore"):
        close = (np.abs(true_of_returned - rd) <= tol) | (true_of_returned == rd)
    assert (~differ | both_nan | close).all()


def _sorted_with_index_ties(dists, idx):
    d = np.where(np.isnan(dists), np.inf, dists)
    nan = np.isnan(dists)
    ok = (d[:, 1:] >= d[:, :-1]) | nan[:, 1:]
    ok &= ~(nan[:, :-1] & ~nan[:, 1:])
    tie = (dists[:, 1:] == dists[:, :-1]) | (nan[:, 1:] & nan[:, :-1])
    ok &= ~tie | (idx[:, 1:] > idx[:, :-1])
    return bool(ok.all())


def ref_vote(labels, idx, num_classes):
    lab = np.asarray(labels)[np.asarray(idx)]
    out = []
    for row in lab:
        row = row[(row >= 0) & (row < num_classes)]
        out.append(np.bincount(row, minlength=num_classes).argmax() if row.size else 0)
    return np.array(out, np.int32)


def data(key, m, n, d, dtype=jnp.float32):
    kq, kr = jax.random.split(key)
    return (jax.random.normal(kq, (m, d), jnp.float32).astype(dtype),
            jax.random.normal(kr, (n, d), jnp.float32).astype(dtype))


def small_ints(key, shape, high=4):
    """Integer-valued features: exact in every dtype, so distances are exact and tie often."""
    return jax.random.randint(key, shape, 0, high).astype(jnp.float32)


# ----------------------------------------------------------------------------- correctness

SHAPES = [  # (m, n, d, k): ones, k = n, odd sizes, k > 1024, k > 2048 (sort path), few/many rows
    (1, 1, 1, 1),
    (1, 5, 3, 5),
    (7, 33, 5, 4),
    (33, 257, 17, 16),
    (130, 3001, 24, 64),
    (5, 9000, 6, 1500),
    (3, 20000, 8, 100),     # few queries: references split across lists (GPU; CPU: see below)
    (9, 2600, 5, 2600),     # k = n > 2048: XLA-sort merge path
]


@pytest.mark.parametrize("m,n,d,k", SHAPES)
def test_matches_reference(key, m, n, d, k):
    q, r = data(key, m, n, d)
    dists, idx = jaxops.knn(q, r, k)
    check_knn(q, r, k, dists, idx)


@pytest.mark.parametrize("dtype", FLOATS)
def test_dtypes(key, dtype):
    q, r = data(key, 21, 700, 13, dtype)
    dists, idx = jaxops.knn(q, r, 9)
    check_knn(q, r, 9, dists, idx)


@pytest.mark.parametrize("dtype", FLOATS)
def test_integer_features_exact_with_ties(key, dtype):
    """Integer features: exact distances, many exact ties, which must go to the lower index."""
    kq, kr = jax.random.split(key)
    q, r = small_ints(kq, (40, 6)).astype(dtype), small_ints(kr, (1500, 6)).astype(dtype)
    for k in (1, 7, 300):
        dists, idx = jaxops.knn(q, r, k)
        check_knn(q, r, k, dists, idx, exact=True)


@pytest.mark.parametrize("m,n,d,k", [(1, 20000, 8, 100), (3, 20000, 8, 100), (5, 30001, 6, 7)])
def test_split_lists(key, monkeypatch, m, n, d, k):
    """Few queries: each query's references split across independent lists, merged by a sort
    (the CPU splits fewer queries than the GPU, so its threshold is raised here)."""
    monkeypatch.setattr(knn_module, "_CPU_SPLIT_ROWS", 64)
    assert knn_module._plan(m, n, k, True)[0] > 1
    q, r = data(key, m, n, d)
    dists, idx = jaxops.knn(q, r, k)
    check_knn(q, r, k, dists, idx)


@pytest.mark.skipif(ON_GPU, reason="the CPU's plan")
def test_cpu_plan(key):
    """The CPU splits only below 4 queries: elsewhere the merge's XLA sort costs more than the
    split saves (2 cores, 64 x 16384, k = 256: 13.2 ms split 4 ways against 3.2 unsplit). Its
    tiles hold 2^22 distances, which stay in cache (2^28: 1.1-2.2x slower)."""
    plan = lambda m, n, k: knn_module._plan(m, n, k, True)  # noqa: E731
    splits = lambda m, n, k: plan(m, n, k)[0]  # noqa: E731
    assert splits(64, 16384, 256) == 1 and splits(4, 1 << 20, 10) == 1
    assert splits(1, 1 << 20, 10) == 4 and splits(3, 1 << 20, 10) == 2
    assert splits(1, 1 << 16, 256) == 4 and splits(1, 1 << 16, 512) == 2  # the sort stays small
    assert splits(1, 8191, 1) == 1  # too short to split
    assert plan(1024, 65536, 16) == (1, 1024, 4096, 16)
    assert plan(10000, 8192, 5) == (1, 3334, 1024, 8)
    assert plan(4096, 65536, 1024) == (1, 64, 65536, 1)  # tiles of >= 64 k columns
    assert knn_module._kernel_takes(1 << 20)  # the twin takes any k (no XLA-sort path)
    # The default CPU tiles, unpatched: two reference tiles, the second one padded.
    m, n, k = 600, 9000, 20
    assert plan(m, n, k) == (1, m, 4608, 2)
    q, r = data(key, m, n, 8)
    dists, idx = jaxops.knn(q, r, k)
    check_knn(q, r, k, dists, idx)


def test_tiled_paths(key, monkeypatch):
    """Tiny tiles force the scan over reference tiles, query tiles, splits and padding."""
    monkeypatch.setattr(knn_module, "_TILE_ELEMS", 1 << 14)
    monkeypatch.setattr(knn_module, "_MIN_TILE_COLS", 128)
    monkeypatch.setattr(knn_module, "_MIN_SPLIT_COLS", 256)
    monkeypatch.setattr(knn_module, "_CPU_SPLIT_ROWS", 64)
    monkeypatch.setattr(knn_module, "_CPU_SPLIT_COLS_PER_K", 1)
    monkeypatch.setattr(knn_module, "_CPU_TILE_COLS_PER_K", 0)  # the CPU's tiles >= 64 k wide
    kq, kr = jax.random.split(key)
    for m, n, k in [(300, 1001, 5), (3, 5000, 40), (50, 777, 300)]:
        q, r = small_ints(kq, (m, 5)), small_ints(kr, (n, 5))
        dists, idx = jaxops.knn(q, r, k)
        check_knn(q, r, k, dists, idx, exact=True)
    assert knn_module._plan(300, 1001, 5, True)[3] > 1  # the scan really ran
    assert knn_module._plan(3, 5000, 40, True)[0] > 1  # and the split lists


def _tiles_with_nan_and_ties(key, m, n, d=5):
    """Integer features (exact distances, many ties), a NaN query row, NaN and inf references."""
    kq, kr = jax.random.split(key)
    q, r = small_ints(kq, (m, d)), small_ints(kr, (n, d))
    q = q.at[1].set(jnp.nan)
    r = r.at[jnp.array([0, n // 2, n - 1])].set(jnp.nan).at[n // 3, 0].set(jnp.inf)
    return q, r


def test_tiny_tiles(key, monkeypatch):
    """Tiny tiles cross every tile boundary: n not a multiple of the tile, k larger than a
    tile, NaN rows and references, ties. The running lists are updated in place across the
    7 tiles."""
    monkeypatch.setattr(knn_module, "_TILE_ELEMS", 1 << 16)
    monkeypatch.setattr(knn_module, "_MIN_TILE_COLS", 128)
    monkeypatch.setattr(knn_module, "_CPU_TILE_COLS_PER_K", 0)  # the CPU's tiles >= 64 k wide
    m, n = 300, 1601  # 2^16: 256-column tiles (7 tiles, the last one of 65 columns)
    q, r = _tiles_with_nan_and_ties(key, m, n)
    splits, tm, tn, nt = knn_module._plan(m, n, 300, True)
    assert (splits, tm, nt) == (1, m, -(-n // tn)) and nt > 1 and n % tn and tn < 300
    for k in (7, 300):
        dists, idx = jaxops.knn(q, r, k)
        check_knn(q, r, k, dists, idx, exact=True)


@pytest.mark.parametrize("path", ["twin", "sort"])
def test_large_k(key, monkeypatch, path):
    """k past the CUDA kernel's 2048: the CPU twin takes any k; the XLA-sort path (the GPU's
    there) forced on the CPU too. Tiles narrower than k, n not a multiple of them, NaN and ties."""
    monkeypatch.setattr(knn_module, "_TILE_ELEMS", 1 << 16)
    monkeypatch.setattr(knn_module, "_MIN_TILE_COLS", 128)
    monkeypatch.setattr(knn_module, "_CPU_TILE_COLS_PER_K", 0)
    if path == "sort":
        monkeypatch.setattr(knn_module, "_CPU_MAX_KERNEL_K", 2048)
    m, n, k = 24, 5001, 2100
    assert knn_module._kernel_takes(k) == (path == "twin" and not ON_GPU)
    assert knn_module._plan(m, n, k, True)[3] > 1
    q, r = _tiles_with_nan_and_ties(key, m, n)
    hlo = jax.jit(lambda q, r: jaxops.knn(q, r, k)).lower(q, r).as_text()  # a new trace
    assert ("jaxops_knn_select" in hlo) == (path == "twin" and not ON_GPU)  # the path that ran
    dists, idx = jaxops.knn(q, r, k)
    check_knn(q, r, k, dists, idx, exact=True)


def test_balanced_query_tiles(key, monkeypatch):
    """Query tiles are of equal size (fewest tiles of at most tile / min-cols rows), so m just
    above a multiple of the largest query tile is not padded by nearly a whole tile."""
    monkeypatch.setattr(knn_module, "_TILE_ELEMS", 1 << 14)
    monkeypatch.setattr(knn_module, "_MIN_TILE_COLS", 128)
    monkeypatch.setattr(knn_module, "_CPU_TILE_COLS_PER_K", 0)
    assert knn_module._plan(129, 1000, 5, True)[1] == 65  # 2 tiles of 65 rows (max 128), not 128 + 1
    q, r = _tiles_with_nan_and_ties(key, 129, 1000)
    dists, idx = jaxops.knn(q, r, 9)
    check_knn(q, r, 9, dists, idx, exact=True)


@gpu_only
@pytest.mark.parametrize("log2", [28, 22, 24])
def test_gpu_small_tiles(key, monkeypatch, log2):
    """GPU: small tiles (m = 2048: 2^22 -> 13 tiles of 2048 columns, 2^24 -> 4 of 6400;
    2^28, the default: one tile) with n not a multiple of the tile, k = 2100 > a 2048-column
    tile (kernel's largest list, and the XLA-sort path past 2048), k = 256, a NaN query row,
    NaN/inf references and integer ties; the kernel updates the running lists in place."""
    monkeypatch.setattr(knn_module, "_TILE_ELEMS", 1 << log2)
    m, n = 2048, 3 * 8192 + 1000
    assert knn_module._plan(m, n, 256, True)[3] == {28: 1, 22: 13, 24: 4}[log2]
    q, r = _tiles_with_nan_and_ties(key, m, n, d=8)
    rows = np.array([0, 1, 777, m - 1])
    for k in (256, 2048, 2100):
        dists, idx = jaxops.knn(q, r, k)
        check_knn(q[rows], r, k, np.asarray(dists)[rows], np.asarray(idx)[rows], exact=True)


def test_digits_exact_and_vote():
    datasets = pytest.importorskip("sklearn.datasets")
    x, y = datasets.load_digits(return_X_y=True)
    refs, queries = jnp.asarray(x[:1500], jnp.float32), jnp.asarray(x[1500:], jnp.float32)
    labels = jnp.asarray(y[:1500], jnp.int32)
    for k in (1, 5, 25):
        dists, idx = jax.jit(jaxops.knn, static_argnums=2)(queries, refs, k)
        check_knn(queries, refs, k, dists, idx, exact=True)
        pred = jaxops.knn_classify(queries, refs, labels, k, 10)
        np.testing.assert_array_equal(np.asarray(pred), ref_vote(labels, idx, 10))
    assert (np.asarray(pred) == y[1500:]).mean() > 0.9


def test_nan_and_inf_rank_last(key):
    q, r = data(key, 9, 200, 4)
    q = q.at[2].set(jnp.nan)                 # every distance NaN: indices 0..k-1
    r = r.at[jnp.array([3, 50, 51])].set(jnp.nan)
    r = r.at[7, 1].set(jnp.inf)
    for k in (5, 200):
        dists, idx = jaxops.knn(q, r, k)
        check_knn(q, r, k, dists, idx)
        d, i = np.asarray(dists), np.asarray(idx)
        np.testing.assert_array_equal(i[2], np.arange(k))
        assert np.isnan(d[2]).all()
        if k == 200:  # the NaN (and inf) references close every other row
            other = np.delete(np.arange(9), 2)
            assert np.isin(i[other, -3:], [3, 7, 50, 51]).all()
            assert np.isnan(d[other, -3:]).all() and not np.isnan(d[other, :-4]).any()


def test_empty_and_zero_features(key):
    q, r = data(key, 0, 10, 3)
    dists, idx = jaxops.knn(q, r, 4)
    assert dists.shape == (0, 4) and idx.shape == (0, 4)
    dists, idx = jaxops.knn(jnp.ones((3, 0)), jnp.ones((6, 0)), 4)
    np.testing.assert_array_equal(np.asarray(idx), np.tile(np.arange(4), (3, 1)))
    np.testing.assert_array_equal(np.asarray(dists), 0)
    assert jaxops.knn_classify(jnp.ones((0, 2)), jnp.ones((4, 2)), jnp.arange(4), 2, 3).shape == (0,)


# ----------------------------------------------------------------------------- transformations


def test_jit_matches_eager(key):
    q, r = data(key, 17, 400, 7)
    eager = jaxops.knn(q, r, 11)
    jitted = jax.jit(jaxops.knn, static_argnums=2)(q, r, 11)
    for a, b in zip(eager, jitted):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("in_axes", [(0, 0), (0, None), (None, 0), (1, 0)])
def test_vmap(key, in_axes):
    kq, kr = jax.random.split(key)
    b = 3
    qs = small_ints(kq, (b, 11, 4)) if in_axes[0] == 0 else small_ints(kq, (11, 4))
    if in_axes[0] == 1:
        qs = small_ints(kq, (11, b, 4))
    rs = small_ints(kr, (b, 300, 4)) if in_axes[1] == 0 else small_ints(kr, (300, 4))
    dists, idx = jax.vmap(lambda q, r: jaxops.knn(q, r, 6), in_axes=in_axes)(qs, rs)
    assert dists.shape == (b, 11, 6)
    for j in range(b):
        q = qs[j] if in_axes[0] == 0 else (qs[:, j] if in_axes[0] == 1 else qs)
        r = rs[j] if in_axes[1] == 0 else rs
        check_knn(q, r, 6, dists[j], idx[j], exact=True)


def test_nested_vmap_and_classify_vmap(key):
    kq, kr, kl = jax.random.split(key, 3)
    qs, rs = small_ints(kq, (2, 3, 5, 4)), small_ints(kr, (2, 3, 90, 4))
    labels = jax.random.randint(kl, (2, 3, 90), -1, 5)
    f = jax.vmap(jax.vmap(lambda q, r: jaxops.knn(q, r, 8)))
    g = jax.jit(jax.vmap(jax.vmap(lambda q, r, l: jaxops.knn_classify(q, r, l, 8, 4))))
    dists, idx = f(qs, rs)
    pred = g(qs, rs, labels)
    for a in range(2):
        for b in range(3):
            check_knn(qs[a, b], rs[a, b], 8, dists[a, b], idx[a, b], exact=True)
            np.testing.assert_array_equal(np.asarray(pred[a, b]),
                                          ref_vote(labels[a, b], idx[a, b], 4))


def test_not_differentiable(key):
    q, r = data(key, 4, 20, 3)
    with pytest.raises(TypeError, match="not differentiable"):
        jax.grad(lambda q: jaxops.knn(q, r, 3)[0].sum())(q)
    with pytest.raises(TypeError, match="not differentiable"):
        jax.grad(lambda r: jaxops.knn(q, r, 3)[0].sum())(r)
    # stop_gradient is the documented way to use it inside a differentiated function.
    g = jax.grad(lambda q: jaxops.knn(jax.lax.stop_gradient(q), r, 3)[0].sum() + q.sum())(q)
    np.testing.assert_array_equal(np.asarray(g), 1)


# ----------------------------------------------------------------------------- classify


def test_classify_vote_rules(key):
    kq, kr, kl = jax.random.split(key, 3)
    q, r = data(key, 60, 500, 5)
    labels = jax.random.randint(kl, (500,), -2, 6)  # -2, -1 and 4, 5 are outside [0, 4)
    for k in (1, 4, 64):
        _, idx = jaxops.knn(q, r, k)
        pred = jaxops.knn_classify(q, r, labels, k, 4)
        assert pred.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(pred), ref_vote(labels, idx, 4))


def test_classify_tie_goes_to_smallest_label():
    refs = jnp.array([[0.0], [1.0], [2.0], [3.0], [10.0]])
    q = jnp.array([[1.5]])
    # neighbours (ascending): 1, 2, 0, 3 with labels 3, 1, 1, 3 -> tie 2-2 -> label 1
    labels = jnp.array([1, 3, 1, 3, 0])
    assert int(jaxops.knn_classify(q, refs, labels, 4, 4)[0]) == 1
    # with invalid labels only, every class ties at zero votes -> 0
    assert int(jaxops.knn_classify(q, refs, jnp.array([9, 9, 9, 9, 9]), 2, 4)[0]) == 0
    # int64 labels beyond int32 are invalid, not wrapped
    if jax.config.jax_enable_x64:
        big = jnp.array([2**33 + 1, 2, 2**33 + 1, 2, 0], jnp.int64)
        assert int(jaxops.knn_classify(q, refs, big, 3, 4)[0]) == 2


# ----------------------------------------------------------------------------- errors


def test_bad_inputs():
    q, r = jnp.ones((3, 4)), jnp.ones((5, 4))
    cases = [
        ((q, r, 0), ValueError, "k must satisfy"),
        ((q, r, 6), ValueError, "k must satisfy"),
        ((q, r, 2.0), TypeError, "k must be a Python int"),
        ((q, r, True), TypeError, "k must be a Python int"),
        ((q, jnp.ones((5, 3)), 2), ValueError, "features"),
        ((jnp.ones(4), r, 2), ValueError, "queries must have shape"),
        ((q, jnp.ones((1, 5, 4)), 2), ValueError, "refs must have shape"),
        ((q.astype(jnp.int32), r, 2), TypeError, "queries must be float"),
        ((q, r.astype(jnp.int32), 2), TypeError, "refs must be float"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg) as info:
            jaxops.knn(*args)
        assert "jaxops.knn" in str(info.value)
    with pytest.raises(TypeError, match="labels must be an integer"):
        jaxops.knn_classify(q, r, jnp.ones(5), 2, 3)
    with pytest.raises(ValueError, match="labels must have shape"):
        jaxops.knn_classify(q, r, jnp.ones(4, jnp.int32), 2, 3)
    with pytest.raises(ValueError, match="num_classes"):
        jaxops.knn_classify(q, r, jnp.ones(5, jnp.int32), 2, 0)
    with pytest.raises(ValueError, match="jaxops.knn_classify: k must"):
        jaxops.knn_classify(q, r, jnp.ones(5, jnp.int32), 9, 3)
    with pytest.raises(TypeError, match="jaxops.knn: precision"):
        jaxops.knn(q, r, 2, precision=3)
    with pytest.raises(ValueError, match="jaxops.knn: unknown precision"):
        jaxops.knn(q, r, 2, precision="bogus")


def test_precision_argument(key):
    q, r = data(key, 9, 300, 7)
    for p in ("highest", jax.lax.Precision.HIGHEST, jax.lax.DotAlgorithmPreset.F32_F32_F32):
        dists, idx = jaxops.knn(q, r, 5, precision=p)
        check_knn(q, r, 5, dists, idx)


@gpu_only
def test_gpu_tf32x3_precision(key):
    """The fast, nearly-float32 preset the benchmark reports for the 10x target."""
    q, r = data(key, 1200, 32768, 256)
    dists, idx = jaxops.knn(q[:64], r, 25, precision=jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
    check_knn(q[:64], r, 25, dists, idx)


def test_handler_validates_again():
    """The FFI handler checks shapes itself and names the op."""
    f32 = jax.ShapeDtypeStruct
    call = jax.ffi.ffi_call("jaxops_knn_select", (f32((2, 3), jnp.float32), f32((2, 3), jnp.int32)))
    tile, qn, rn = jnp.ones((2, 8)), jnp.ones(2), jnp.ones(7)  # rn has the wrong length
    with pytest.raises(Exception, match="jaxops.knn"):
        jax.block_until_ready(call(tile, qn, rn, jnp.ones((2, 3)), jnp.zeros((2, 3), jnp.int32),
                                   jnp.zeros((), jnp.int32), n=np.int64(8), mode=np.int64(0)))


# ----------------------------------------------------------------------------- GPU paths


@gpu_only
@pytest.mark.parametrize("k", [1, 25, 32, 33, 100, 128, 256, 500, 1024, 2048])
def test_gpu_kernel_k_buckets(key, monkeypatch, k):
    """Every list size K (32..2048, 128 and 256 threads), the float4 path (n % 4 == 0); k = 128
    is the largest k with a seeded first tile, k = 500 one round of the flush's selection.
    The exact search's kernel (the TF32 filter, default at this size, would ask for kp > k)."""
    monkeypatch.setenv("JAXOPS_KNN_FILTER", "0")
    q, r = data(key, 1200, 32768, 64)
    dists, idx = jaxops.knn(q, r, k)
    check_knn(q[:128], r, k, dists[:128], idx[:128])


@gpu_only
@pytest.mark.parametrize("m,n,k", [(1200, 32767, 25), (2, 1 << 20, 32), (4096, 65536 * 3, 256)])
def test_gpu_paths(key, monkeypatch, m, n, k):
    """Scalar loads (odd n), split references (few queries), several tiles (scan), in the
    exact search (the filter's own tests follow)."""
    monkeypatch.setenv("JAXOPS_KNN_FILTER", "0")
    q, r = data(key, m, n, 32)
    dists, idx = jaxops.knn(q, r, k)
    check_knn(q[-64:], r, k, dists[-64:], idx[-64:])


@gpu_only
def test_gpu_large_problem_completes(key):
    """m = 10000, n = 2^20, d = 128, k = 32: XLA runs out of memory here; spot-check rows."""
    q, r = data(key, 10000, 1 << 20, 128)
    dists, idx = jax.block_until_ready(jax.jit(jaxops.knn, static_argnums=2)(q, r, 32))
    rows = np.array([0, 4999, 9999])
    check_knn(q[rows], r, 32, dists[rows], idx[rows])


@gpu_only
@pytest.mark.parametrize("order", ["ascending", "descending", "equal"])
@pytest.mark.parametrize("k", [32, 128, 256])
def test_gpu_first_tile_orders(key, order, k):
    """The first tile's seeded threshold and eager flushes under adversarial column orders:
    nearest references first (tight seed, almost nothing admitted later), farthest first
    (useless seed, every step admits keys, many flushes), or all at one distance (ties by
    index only). One tile, no split (m >= 1024). Integer features: exact comparison."""
    m, n = 1024, 16384
    kq, kr = jax.random.split(key)
    q = small_ints(kq, (m, 8))
    far = jnp.arange(n, dtype=jnp.float32) // 64  # distance grows with the index
    if order == "descending":
        far = far[::-1]
    r = small_ints(kr, (n, 8)).at[:, 0].add(0.0 if order == "equal" else 8.0 * far)
    if order == "equal":
        r = jnp.broadcast_to(r[:1], r.shape)
    dists, idx = jaxops.knn(q, r, k)
    rows = np.arange(0, m, 97)
    check_knn(q[rows], r, k, dists[rows], idx[rows], exact=True)


# ----------------------------------------------------------------------------- TF32 filter
# The default search on large problems ranks TF32 lower bounds, then recomputes the kept
# candidates' float32 distances (jaxops/_knn.py, "TF32 filter"). JAXOPS_KNN_FILTER=1 forces it
# at every size and, on the CPU, emulates TF32 by truncating the operands' mantissas.


def _filter_flag(q, r, k):
    """(k best of the filter's candidates, per query whether the filter proved them exact)."""
    q, r = knn_module._compute_dtype(jnp.asarray(q), jnp.asarray(r))
    kp = knn_module._filter_list(k, r.shape[0])
    plan = knn_module._plan(q.shape[0], r.shape[0], kp, True)
    f = jax.jit(lambda q, r: knn_module._filter(q, r, jnp.sum(q * q, -1), jnp.sum(r * r, -1),
                                                k, kp, plan))
    (dists, idx), proved = f(q, r)
    return dists, idx, np.asarray(proved)


@pytest.mark.parametrize("m,n,d,k", [(50, 3000, 32, 10), (7, 600, 5, 1), (40, 2000, 64, 100),
                                     (300, 5000, 16, 25), (3, 20000, 8, 200)])
def test_filter_matches_reference(key, monkeypatch, m, n, d, k):
    """Random data: the filter proves its candidates exact, and the result is the exact one."""
    monkeypatch.setenv("JAXOPS_KNN_FILTER", "1")
    q, r = data(key, m, n, d)
    dists, idx, proved = _filter_flag(q, r, k)
    assert proved.all()
    check_knn(q, r, k, dists, idx)
    full_d, full_i = jaxops.knn(q, r, k)
    check_knn(q, r, k, full_d, full_i)
    monkeypatch.setenv("JAXOPS_KNN_FILTER", "0")
    exact_d, exact_i = jaxops.knn(q, r, k)
    np.testing.assert_allclose(np.asarray(full_d), np.asarray(exact_d), rtol=1e-5, atol=1e-5)


def test_filter_falls_back_when_it_cannot_prove(key, monkeypatch):
    """A large common offset (TF32 error far above the gaps between distances) and non-finite
    inputs: the filter cannot prove its candidates, and the exact search answers."""
    monkeypatch.setenv("JAXOPS_KNN_FILTER", "1")
    q, r = data(key, 60, 3000, 32)
    for qq, rr in [(q + 100, r + 100), (q.at[3, 1].set(jnp.nan), r),
                   (q, r.at[7, 0].set(jnp.inf)), (q * 1e15, r * 1e15)]:
        assert not _filter_flag(qq, rr, 20)[2].all()
        dists, idx = jaxops.knn(qq, rr, 20)
        check_knn(qq, rr, 20, dists, idx)


def test_filter_researches_the_queries_it_cannot_prove(key, monkeypatch):
    """Two queries sit on 100 identical references far from the rest (ties at their k-th
    distance, beyond the filter's candidate list): only they fail the proof, only they are searched again exactly
    (the rest keep the filter's result), and every row matches the reference with ties to the
    lower index."""
    monkeypatch.setenv("JAXOPS_KNN_FILTER", "1")
    q, r = data(key, 100, 3000, 16)
    r = r.at[1000:1100].set(r[5] + 6)
    q = q.at[jnp.array([7, 42])].set(r[5] + 6.001)
    assert knn_module._filter_list(10, 3000) == 32
    np.testing.assert_array_equal(np.where(~_filter_flag(q, r, 10)[2])[0], [7, 42])
    assert knn_module._fallback_rows(100) < 100  # the re-search branch, not the whole search
    dists, idx = jaxops.knn(q, r, 10)
    check_knn(q, r, 10, dists, idx)
    np.testing.assert_array_equal(np.asarray(idx)[[7, 42]], np.tile(np.arange(1000, 1010), (2, 1)))


def test_filter_margin_is_what_makes_it_exact(key, monkeypatch):
    """Without the error margin the same check passes on offset data while the TF32 ranking
    has lost true neighbours: the margin, not luck, keeps the filter exact."""
    monkeypatch.setenv("JAXOPS_KNN_FILTER", "1")
    monkeypatch.setattr(knn_module, "_filter_slack", lambda d: 0.0)
    kq, kr = jax.random.split(key)
    q = jax.random.normal(kq, (60, 32), jnp.float32) + 40
    r = jax.random.normal(kr, (3000, 32), jnp.float32) + 40
    dists, idx, proved = _filter_flag(q, r, 20)
    assert proved.all()
    with pytest.raises(AssertionError):
        check_knn(q, r, 20, dists, idx)


def test_filter_exact_ties_and_vmap(key, monkeypatch):
    """Integer features (many exact ties at the k-th distance) under vmap: filtered or not,
    the result is the exact one with ties to the lower index."""
    monkeypatch.setenv("JAXOPS_KNN_FILTER", "1")
    kq, kr = jax.random.split(key)
    qs, rs = small_ints(kq, (3, 30, 6)), small_ints(kr, (3, 2000, 6))
    dists, idx = jax.vmap(lambda q, r: jaxops.knn(q, r, 9))(qs, rs)
    for j in range(3):
        check_knn(qs[j], rs[j], 9, dists[j], idx[j], exact=True)


def test_filter_default_sizes(monkeypatch):
    """The filter is the default only where it pays: GPUs, big problems, k leaving a slack list
    of at most 2048 below n / 2, float32/16-bit inputs, no explicit precision, not under vmap."""
    monkeypatch.delenv("JAXOPS_KNN_FILTER", raising=False)
    q, r = jnp.ones((1200, 256), jnp.float32), jnp.ones((32768, 256), jnp.float32)
    assert knn_module._use_filter(q, r, 25, None) == (jax.default_backend() == "gpu")
    batched, use_filter = [], knn_module._use_filter

    def spy(*args):
        batched.append(knn_module.in_batched_trace())
        return use_filter(*args)

    monkeypatch.setattr(knn_module, "_use_filter", spy)
    jax.eval_shape(lambda q, r: jaxops.knn(q, r, 25), q, r)
    assert batched and not any(batched)
    batched.clear()  # under vmap the exact search: the proof's switch would run it anyway
    jax.eval_shape(jax.vmap(lambda q, r: jaxops.knn(q, r, 25)), q[None], r[None])
    assert batched[-1]  # the batched trace (custom_vmap first traces the plain function)
    monkeypatch.setattr(knn_module, "_use_filter", use_filter)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the rules below, on any machine
    assert knn_module._use_filter(q, r, 25, None)
    assert knn_module._filter_list(25, 32768) == 64 and knn_module._filter_list(256, 10**6) == 512
    assert knn_module._filter_list(1700, 10**6) is None  # 2125 candidates: exact search
    assert not knn_module._use_filter(q, r, 25, jax.lax.Precision.HIGHEST)
    assert not knn_module._use_filter(q[:10], r[:100], 5, None)  # too small to pay
    assert not knn_module._use_filter(q.astype(jnp.float64), r, 25, None)
    monkeypatch.setattr(knn_module, "in_batched_trace", lambda: True)
    assert not knn_module._use_filter(q, r, 25, None)


@gpu_only
def test_gpu_tf32_error_within_filter_bound(key):
    """The filter's premise on this GPU: for operands rounded to TF32, |q.r by TF32 - q.r in
    float32| <= the bound's product and accumulation terms, sum |q_i r_i| (2^-10 + 2^-22 +
    3 d 2^-23); the filter's slack is twice that (H200, session 34: raw operands reached 0.43
    of it at d = 32, 0.14 at d = 256)."""
    dims = (((1,), (1,)), ((), ()))
    for d in (32, 256, 1024):
        kq, kr = jax.random.split(jax.random.fold_in(key, d))
        for scale in (1e-3, 1.0, 1e3):
            q = jax.random.normal(kq, (256, d), jnp.float32) * scale
            r = (jax.random.normal(kr, (2048, d), jnp.float32) + 0.3) * scale
            t = jax.lax.dot_general(knn_module._round_tf32(q), knn_module._round_tf32(r), dims,
                                    precision=jax.lax.DotAlgorithmPreset.TF32_TF32_F32)
            e = jax.lax.dot_general(q, r, dims, precision=jax.lax.Precision.HIGHEST)
            s = jax.lax.dot_general(jnp.abs(q), jnp.abs(r), dims, precision=jax.lax.Precision.HIGHEST)
            bound = 2.0 ** -10 + 2.0 ** -22 + 3 * d * 2.0 ** -23
            assert float(jnp.max(jnp.abs(t - e) / s)) <= bound


@gpu_only
@pytest.mark.parametrize("m,n,d,k", [(1200, 32768, 256, 25), (2048, 65536, 128, 256),
                                     (5, 100000, 64, 1000), (1100, 8193, 33, 7)])
def test_gpu_filter_matches_reference(key, monkeypatch, m, n, d, k):
    """The TF32 filter on the tensor cores: proved exact on random data, same neighbours as the
    reference (split lists for few queries, k = 1000, odd n and d)."""
    monkeypatch.setenv("JAXOPS_KNN_FILTER", "1")
    q, r = data(key, m, n, d)
    dists, idx, proved = _filter_flag(q, r, k)
    assert proved.all()
    rows = np.unique(np.array([0, 1, m // 2, m - 1]))
    check_knn(q[rows], r, k, np.asarray(dists)[rows], np.asarray(idx)[rows])
