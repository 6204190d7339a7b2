"""jaxops.relu against jax.nn.relu: values, the 1-bit mask residual, gradients, transformations."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxops
from helpers import FLOAT_DTYPES, gpu_only, skip_f64_without_x64

# 1, odd sizes (scalar tails of the 16-byte packs and of the 32-bit words), whole words, and a
# size large enough for many warps per block and several grid-stride rounds on a GPU.
SHAPES = [(), (1,), (31,), (33,), (7, 13), (3, 5, 7, 9), (128, 96), (2049, 1025)]


def rng(key):
    """A numpy generator seeded by the test's key (numpy draws need no XLA compile per shape)."""
    return np.random.default_rng(np.asarray(jax.random.key_data(key)).tolist())


def npnormal(key, shape, dtype=jnp.float32):
    return jnp.asarray(rng(key).standard_normal(shape).astype(jnp.dtype(dtype)))


def with_specials(key, shape, dtype):
    """Random normal data with exact zeros, +-inf and NaN mixed in (never all zeros)."""
    x = rng(key).standard_normal(shape).astype(np.float32).reshape(-1)
    if x.size >= 8:
        x[::7] = 0.0
        x[1] = np.inf
        x[2] = -np.inf
        x[3] = np.nan
        x[4] = -0.0
    return jnp.asarray(x.reshape(shape).astype(jnp.dtype(dtype)))


def expected_mask(x) -> np.ndarray:
    """uint32 words, bit j of word i = (flattened x)[32 i + j] > 0."""
    pos = np.asarray(jnp.asarray(x).astype(jnp.float32)).reshape(-1) > 0
    pad = (-pos.size) % 32
    bits = np.packbits(np.concatenate([pos, np.zeros(pad, bool)]), bitorder="little")
    return bits.view("<u4")


# Each shape with two dtypes (shape i: dtypes i and i + 1), so every dtype meets two of the odd
# sizes (31, 33, 7x13, 3x5x7x9: the 16-byte packs' scalar tails differ per dtype) and two others.
@pytest.mark.parametrize("shape,dtype", [(s, FLOAT_DTYPES[(i + j) % 4]) for i, s in enumerate(SHAPES) for j in (0, 1)])
def test_forward_and_grad_match_jax(key, shape, dtype):
    skip_f64_without_x64(dtype)
    kx, kw = jax.random.split(key)
    x = with_specials(kx, shape, dtype)
    w = npnormal(kw, shape, dtype)
    y, vjp_fn = jax.vjp(jaxops.relu, x)
    assert y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)),
                                  np.asarray(jax.nn.relu(x).astype(jnp.float32)))
    (g,) = vjp_fn(w)
    # the rule jax.nn.relu follows: dy where x > 0, else 0 (also at 0, -0, NaN and -inf)
    ref = jnp.where(x > 0, w, jnp.zeros_like(w))
    assert g.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("n", [1, 33, 4096 + 17])
def test_residual_is_only_the_bit_mask(key, n, dtype):
    skip_f64_without_x64(dtype)
    x = with_specials(key, (n,), dtype)
    _, vjp_fn = jax.vjp(jaxops.relu, x)
    leaves = [l for l in jax.tree_util.tree_leaves(vjp_fn) if hasattr(l, "dtype")]
    assert len(leaves) == 1, [(l.dtype, l.shape) for l in leaves]
    (mask,) = leaves
    assert mask.dtype == jnp.uint32 and mask.shape == (-(-n // 32),)
    np.testing.assert_array_equal(np.asarray(mask), expected_mask(x))
    # jax.nn.relu keeps more than 4 bytes per element; the mask keeps 1/8.
    ref_bytes = sum(l.nbytes for l in jax.tree_util.tree_leaves(jax.vjp(jax.nn.relu, x)[1]) if hasattr(l, "nbytes"))
    assert mask.nbytes <= -(-n // 32) * 4 < ref_bytes or n < 32


def test_backward_jaxpr_reads_only_dy_and_mask(key):
    x = npnormal(key, (1000,))
    _, vjp_fn = jax.vjp(jaxops.relu, x)
    jaxpr = jax.make_jaxpr(vjp_fn)(x)
    consts = [c for c in jaxpr.consts if hasattr(c, "dtype")]
    assert all(c.dtype == jnp.uint32 for c in consts), [c.dtype for c in consts]


def test_mask_layout_nd(key):
    x = with_specials(key, (3, 5, 7), jnp.float32)
    _, vjp_fn = jax.vjp(jaxops.relu, x)
    (mask,) = [l for l in jax.tree_util.tree_leaves(vjp_fn) if hasattr(l, "dtype")]
    np.testing.assert_array_equal(np.asarray(mask), expected_mask(x))


def test_jit(key):
    x = with_specials(key, (37, 41), jnp.float32)
    f = jax.jit(lambda x: jax.value_and_grad(lambda x: jnp.sum(jaxops.relu(x) ** 2))(x))
    v, g = f(x)
    vr, gr = jax.value_and_grad(lambda x: jnp.sum(jax.nn.relu(x) ** 2))(x)
    np.testing.assert_allclose(v, vr, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(gr))


@pytest.mark.parametrize("in_axes", [0, 1, 2])
def test_vmap(key, in_axes):
    x = with_specials(key, (5, 6, 37), jnp.float32)  # 37: rows of the mask do not end on a word
    np.testing.assert_array_equal(np.asarray(jax.vmap(jaxops.relu, in_axes)(x)),
                                  np.asarray(jax.vmap(jax.nn.relu, in_axes)(x)))
    gf = jax.vmap(jax.grad(lambda v: jnp.sum(jaxops.relu(v) * v)), in_axes)
    gr = jax.vmap(jax.grad(lambda v: jnp.sum(jax.nn.relu(v) * v)), in_axes)
    np.testing.assert_array_equal(np.asarray(gf(x)), np.asarray(gr(x)))


def test_nested_vmap_and_grad_of_vmap(key):
    x = with_specials(key, (3, 4, 45), jnp.float32)
    f = jax.vmap(jax.vmap(jaxops.relu, 1), 0)
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(jax.nn.relu(x).transpose(0, 2, 1)))
    w = npnormal(key, (3, 45, 4))
    g = jax.grad(lambda x: jnp.sum(f(x) * w))(x)
    gr = jax.grad(lambda x: jnp.sum(jax.nn.relu(x).transpose(0, 2, 1) * w))(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(gr))


def test_check_grads(key):
    dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    x = npnormal(key, (5, 9), dtype)
    x = x + jnp.sign(x) * 0.5  # away from the kink, where finite differences are valid
    check_grads(jaxops.relu, (x,), order=1, modes=("rev",), eps=1e-3 if dtype == jnp.float32 else None)


def test_empty():
    for shape in [(0,), (3, 0), (0, 5, 2)]:
        x = jnp.zeros(shape, jnp.float32)
        assert jaxops.relu(x).shape == shape
        assert jax.grad(lambda x: jnp.sum(jaxops.relu(x)))(x).shape == shape


@pytest.mark.parametrize("bad", [jnp.arange(4), jnp.ones(3, jnp.bool_), jnp.ones(2, jnp.complex64)])
def test_bad_dtype(bad):
    with pytest.raises(TypeError, match=r"jaxops\.relu: x must be"):
        jaxops.relu(bad)


@gpu_only
def test_gpu_large_deterministic(key):
    x = with_specials(key, (64, 1024, 1031), jnp.bfloat16)
    y1, vjp1 = jax.vjp(jaxops.relu, x)
    y2, vjp2 = jax.vjp(jaxops.relu, x)
    (m1,), (m2,) = [[l for l in jax.tree_util.tree_leaves(v) if hasattr(l, "dtype")] for v in (vjp1, vjp2)]
    np.testing.assert_array_equal(np.asarray(m1), np.asarray(m2))
    np.testing.assert_array_equal(np.asarray(m1), expected_mask(x))
    np.testing.assert_array_equal(np.asarray(y1.astype(jnp.float32)), np.asarray(jax.nn.relu(x).astype(jnp.float32)))


# ---- element counts that are not whole 16-byte packs or mask words (session 6) ----
# On the GPU a row is cut into chunks of 32*P elements (P = 16 bytes / itemsize: 4 float32,
# 8 bfloat16/float16); whole 16-byte-aligned chunks take 16-byte packs, the rest (a row's partial
# last chunk; every chunk of a vmapped row that does not start 16-byte aligned) the coalesced
# element path with one ballot per mask word. These counts put the tail at every kind of place:
# inside the first word (1, 31), one past a word (33), one past a pack (8k+1), mid-word (32k+17).
ODD_COUNTS = [1, 31, 33, 8 * 4099 + 1, 32 * 3001 + 17]
HALF_AND_SINGLE = [jnp.float32, jnp.bfloat16, jnp.float16]


def _check_fwd_mask_bwd(x, w):
    """y, the saved mask words and dx of jaxops.relu equal jax.nn.relu's y, (x > 0) bits and vjp."""
    y, vjp_fn = jax.vjp(jaxops.relu, x)
    y_ref, vjp_ref = jax.vjp(jax.nn.relu, x)
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(y_ref.astype(jnp.float32)))
    (mask,) = [l for l in jax.tree_util.tree_leaves(vjp_fn) if hasattr(l, "dtype")]
    np.testing.assert_array_equal(np.asarray(mask).reshape(-1), expected_mask(x))
    (dx,), (dx_ref,) = vjp_fn(w), vjp_ref(w)
    assert dx.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(dx.astype(jnp.float32)), np.asarray(dx_ref.astype(jnp.float32)))


@pytest.mark.parametrize("dtype", HALF_AND_SINGLE)
@pytest.mark.parametrize("n", ODD_COUNTS)
def test_odd_counts(key, n, dtype):
    kx, kw = jax.random.split(key)
    _check_fwd_mask_bwd(with_specials(kx, (n,), dtype), npnormal(kw, (n,), dtype))


@gpu_only
@pytest.mark.parametrize("dtype", HALF_AND_SINGLE)
def test_gpu_large_odd_count(key, dtype):
    # > 2^24 elements, 32k+17: many grid-stride rounds of vector chunks, then the coalesced tail
    n = (1 << 24) + 17
    kx, kw = jax.random.split(key)
    _check_fwd_mask_bwd(with_specials(kx, (n,), dtype), npnormal(kw, (n,), dtype))


# Under vmap each example is a row of its own mask words. cols 1025 / 4099: most rows start
# misaligned (row r at element r*cols), so whole rows take the coalesced path and rows with
# r*cols % P == 0 the vector path; cols 264 = 8*33: every row aligned, partial last chunk per row.
@pytest.mark.parametrize("dtype", HALF_AND_SINGLE)
@pytest.mark.parametrize("shape", [(9, 1025), (5, 4099), (17, 264)])
def test_vmap_rows_of_odd_length(key, shape, dtype):
    kx, kw = jax.random.split(key)
    x, w = with_specials(kx, shape, dtype), npnormal(kw, shape, dtype)
    y, vjp_fn = jax.vjp(jax.vmap(jaxops.relu), x)
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(jax.nn.relu(x).astype(jnp.float32)))
    (mask,) = [l for l in jax.tree_util.tree_leaves(vjp_fn) if hasattr(l, "dtype")]
    assert mask.shape == (shape[0], -(-shape[1] // 32))
    np.testing.assert_array_equal(np.asarray(mask), np.stack([expected_mask(r) for r in x]))
    (dx,) = vjp_fn(w)
    (dx_ref,) = jax.vjp(jax.nn.relu, x)[1](w)
    np.testing.assert_array_equal(np.asarray(dx.astype(jnp.float32)), np.asarray(dx_ref.astype(jnp.float32)))
