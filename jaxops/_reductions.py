"""Reductions: drop-ins for ``jnp.sum/mean/max/min/argmax/argmin`` and ``jax.nn.logsumexp``.

Every op runs on an (outer, reduced, inner) view of its input: when the reduced axes are one
contiguous block of the row-major layout (ignoring extent-1 axes) the view is a free reshape,
so last-axis (row) and leading-axis (column) reductions each take one pass over memory with no
transpose. A non-contiguous axis tuple, e.g. ``axis=(0, 2)`` of a rank-3 array, transposes the
reduced axes to the end first (correct, but one extra read and write of the input).

Results are deterministic (no atomics: partial results of a split reduced axis are merged in
a fixed order), accumulate in float32 for the half types (float64 for float64) and follow the
jnp rules for NaN, infinities, ties and empty axes.
"""
from __future__ import annotations

import builtins
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxops._checks import canonical_axes, check_float
from jaxops._ffi import ffi_call
from jaxops._sharding import Rule, in_batched_trace, sharded_call

__all__ = ["sum", "mean", "max", "min", "logsumexp", "argmax", "argmin"]

# Values of the FFI `op` attribute (cc/reduce/reduce_ops.h: OpKind).
_OPS = {"sum": 0, "mean": 1, "max": 2, "min": 3, "logsumexp": 4, "argmax": 5, "argmin": 6}
_ARG_OPS = ("argmax", "argmin")
_WIDE_STATE_OPS = ("argmax", "argmin", "logsumexp")  # 8-byte partial states in float32
_LIGHT_ROW_OPS = ("sum", "mean", "max", "min")  # and 16-bit logsumexp / arg ops: see _splits
# Value of an empty reduction where jnp has one.
_EMPTY = {"sum": 0.0, "mean": float("nan"), "logsumexp": -float("inf")}

# Launch plan constants. Rows up to this length are never split (a warp or a block a row,
# cc/reduce/reduce_plan.cuh decides); longer ones may be cut into chunks whose partial states
# a second kernel (merge_kernel) merges in a fixed order. See _splits for how many chunks.
_WARP_ROW_MAX = 4096
_TARGET_BLOCKS = 1024     # split rows/full (and float64 columns): about this many blocks
_TARGET_BLOCKS_LIGHT = 4096  # split rows (not full) of the light ops (_LIGHT_ROW_OPS)
_BUSY_BLOCKS = 512        # this many blocks without splitting already fill an H100
_MIN_ROW_CHUNK = 8192     # elements per block of a split row
_TARGET_BLOCKS_LSE16 = 16384  # split rows of 16-bit logsumexp: chunks of 4096, see _splits
_MIN_ROW_CHUNK_LSE16 = 4096
_MAX_SPLITS_LSE16 = 2048      # a row's partials merged by one block
_COLUMN_THREADS = 256
_PLAN_SMS = 132           # H100 SMs: a constant of the plan, so results never depend on the device


def _wave_blocks(itemsize: int, rows: bool) -> int:
    """Blocks of a split launch that are resident at once on an H100 under the kernels' launch
    bounds (cc/reduce/reduce_plan.cuh: min_blocks): 256-thread blocks, >= 3 per SM for every
    2- and 4-byte kernel; float32 split rows use 512-thread blocks, >= 2 per SM."""
    per_sm = 2 if (rows and itemsize == 4) else 3
    return per_sm * _PLAN_SMS


def _column_wave_blocks(itemsize: int, fn: str) -> int:
    """Blocks a column plan fills: one resident wave (_wave_blocks), but 2 blocks an SM for the
    light ops (sum, mean, max, min). H200, session 44 runs 1-2, same process, 3 -> 2 an SM, µs:
    bf16 sum 16384x4096 36.7 -> 34.1, 8192x8192 36.9 -> 35.2, 32768x2048 35.1 -> 35.4; bf16 max
    36.4 -> 34.7, 35.9 -> 35.4, 36.1 -> 35.6 (2048, 4096, 8192 columns); float32 sum and max 1.5 to
    3.4 % faster at the three widths; bf16 sum at 64 / 256 columns within 0.5 %. bf16 argmax was
    within 0.8 % at 64-4096 columns (so arg ops and logsumexp keep 3). Not explained: the blocks
    stream longer runs of rows, which may suit the DRAM pages better."""
    if fn in _LIGHT_ROW_OPS:
        return 2 * _PLAN_SMS
    return _wave_blocks(itemsize, False)


def sum(x: jax.typing.ArrayLike, axis: int | tuple[int, ...] | None = None,
        keepdims: bool = False) -> jax.Array:
    """Sum over ``axis``, like :func:`jnp.sum` (float inputs; float32 accumulation for halves).

    Args:
      x: float32, bfloat16, float16 or float64 array.
      axis: None (all axes), an int (negative counts from the end) or a tuple of ints.
      keepdims: keep the reduced axes with extent 1.

    Returns:
      An array of ``x``'s dtype. An empty reduced axis gives 0. Differentiable; works under
      ``jax.jit`` and ``jax.vmap``.
    """
    return _reduce("sum", x, axis, keepdims)


def mean(x: jax.typing.ArrayLike, axis: int | tuple[int, ...] | None = None,
         keepdims: bool = False) -> jax.Array:
    """Mean over ``axis``, like :func:`jnp.mean`; an empty reduced axis gives NaN.

    Same arguments, dtypes and transformations as :func:`sum`.
    """
    return _reduce("mean", x, axis, keepdims)


def max(x: jax.typing.ArrayLike, axis: int | tuple[int, ...] | None = None,
        keepdims: bool = False) -> jax.Array:
    """Maximum over ``axis``, like :func:`jnp.max`: NaN propagates.

    Reducing an empty axis raises ValueError (there is no identity), as jnp does. The gradient
    is shared equally among tied maxima, like jnp's. Same arguments as :func:`sum`.
    """
    return _reduce("max", x, axis, keepdims)


def min(x: jax.typing.ArrayLike, axis: int | tuple[int, ...] | None = None,
        keepdims: bool = False) -> jax.Array:
    """Minimum over ``axis``, like :func:`jnp.min`; see :func:`max`."""
    return _reduce("min", x, axis, keepdims)


def logsumexp(x: jax.typing.ArrayLike, axis: int | tuple[int, ...] | None = None,
              keepdims: bool = False) -> jax.Array:
    """``log(sum(exp(x)))`` over ``axis`` in one pass, like :func:`jax.nn.logsumexp`.

    Stable for any magnitude (an online running max). A slice of all ``-inf`` (or an empty
    axis) gives ``-inf``, any ``+inf`` gives ``+inf``, any NaN gives NaN. The gradient is the
    softmax of ``x`` over ``axis``. Same arguments as :func:`sum`.
    """
    return _reduce("logsumexp", x, axis, keepdims)


def argmax(x: jax.typing.ArrayLike, axis: int | None = None, keepdims: bool = False) -> jax.Array:
    """Index of the maximum along ``axis`` (flat index when None), like :func:`jnp.argmax`.

    Returns int32. Ties give the first index; a NaN counts as the maximum (the first NaN wins).
    An empty axis raises ValueError, as jnp does. Not differentiable (an integer result).
    """
    return _reduce("argmax", x, axis, keepdims)


def argmin(x: jax.typing.ArrayLike, axis: int | None = None, keepdims: bool = False) -> jax.Array:
    """Index of the minimum along ``axis``, like :func:`jnp.argmin`; see :func:`argmax`."""
    return _reduce("argmin", x, axis, keepdims)


def _reduce(fn: str, x, axis, keepdims: bool) -> jax.Array:
    x = jnp.asarray(x)
    check_float(fn, "x", x)
    arg = fn in _ARG_OPS
    if arg and axis is not None and (isinstance(axis, bool) or not isinstance(axis, (int, np.integer))):
        raise TypeError(f"jaxops.{fn}: axis must be None or an int, got {axis!r}")
    if not isinstance(keepdims, (bool, np.bool_)):
        raise TypeError(f"jaxops.{fn}: keepdims must be a bool, got {keepdims!r}")
    axes = canonical_axes(fn, axis, x.ndim)
    out_shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
    final_shape = (tuple(1 if i in axes else d for i, d in enumerate(x.shape)) if keepdims
                   else out_shape)
    n = math.prod(x.shape[a] for a in axes)
    if n == 0 and fn in ("max", "min"):
        raise ValueError(f"jaxops.{fn}: zero-size array to reduction operation {fn} which has no identity")
    if n == 0 and arg:
        raise ValueError(f"jaxops.{fn}: attempt to get {fn} of an empty sequence")
    if arg and n > np.iinfo(np.int32).max:
        raise ValueError(f"jaxops.{fn}: {n} elements along the reduced axes do not fit int32 indices")
    if n == 0 or math.prod(out_shape) == 0:
        dtype = jnp.int32 if arg else x.dtype
        return jnp.full(final_shape, 0 if arg else _EMPTY.get(fn, 0.0), dtype)

    perm, outer, inner = _view(x.shape, axes)
    x3 = (x if perm is None else jnp.transpose(x, perm)).reshape(outer, n, inner)
    if arg:  # integer result: keep autodiff away from the FFI call
        y = _call(fn, jax.lax.stop_gradient(x3))
    else:
        y = _reduce3(fn, n, x3)
    return y.reshape(final_shape)


def _view(shape: tuple[int, ...], axes: tuple[int, ...]):
    """(permutation or None, outer, inner) so that x viewed as (outer, n, inner) reduces axis 1."""
    big = [i for i, d in enumerate(shape) if d != 1]  # extent-1 axes do not affect the layout
    where = [k for k, i in enumerate(big) if i in axes]
    if not where or where == list(range(where[0], where[-1] + 1)):
        first = big[where[0]] if where else len(shape)
        last = big[where[-1]] if where else len(shape) - 1
        return None, math.prod(shape[:first]), math.prod(shape[last + 1:])
    kept = tuple(i for i in range(len(shape)) if i not in axes)
    return kept + axes, math.prod(shape[i] for i in kept), 1


def _next_pow2(v: int, cap: int) -> int:
    p = 1
    while p < v and p < cap:
        p *= 2
    return p


def _splits(outer: int, n: int, inner: int, itemsize: int, fn: str = "sum") -> int:
    """How many chunks the reduced axis is cut into (a fixed function of the shape, dtype size and
    op, so results do not depend on the device); mirrors the block shapes of reduce_plan.cuh.

    Columns (2- and 4-byte types): one resident H100 wave of blocks (_column_wave_blocks), ~80+
    rows a thread, so the per-block fixed costs (first-load latency, the fold) are paid rarely and
    no wave is partly empty (H100, session 5: bf16 argmax_cols 77 -> 54 µs, sum_cols unchanged).

    Rows with few long rows, and full reductions: about _TARGET_BLOCKS blocks of >= 8192
    elements (several waves, which the block scheduler balances across SMs). The one-wave plan
    was measured worse there (H100, session 5: full f32 sum 94 vs 89 µs, bf16 split rows and
    full 1-3 µs slower): with exactly one block per slot, an SM that streams slower than the
    others sets the end of the launch, and the last microseconds have few loads in flight.
    One exception, the only cases where one wave measured better: float32 argmax/argmin/
    logsumexp (8-byte states, compute-heavy loops at 4 packs a thread) on more than one row,
    64x2^20: 92.6 / 93.3 µs vs 95.7 / 96.2. Their full reduction (one row) keeps the ~1024-block
    plan (one wave: 97.7 vs 95.8 µs).
    Several split rows of the light ops (sum, mean, max, min; 16-bit logsumexp, argmax, argmin)
    take ~4096 blocks: 16384-element chunks, one round of 8 packs a thread (H100, session 16 runs
    2-3, 64x2^20, µs: float32 sum 89.8 -> 87.8, max 90.5 -> 88.3; bf16 sum 46.6 -> 46.2, max 47.2
    -> 46.5, logsumexp 51.6 -> 50.5). 16-bit arg ops joined in session 21 (run 8, same build,
    bf16 argmax µs: 64x2^20 49.2 -> 47.6, 64x1048575 52.9 -> 48.4, 16x2^22 48.9 -> 47.5,
    2x2^25 49.2 -> 48.0; argmin and f16 alike): ~1024 chunks of 65536 through the cp.async ring
    had left the SMs fewer, longer blocks; since session 36 their 16384-element chunks take 64
    threads of 32 packs (cc/reduce/reduce_plan.cuh; H200, bf16 argmax 64x2^20 43.3 -> 36.7 µs).
    16-bit logsumexp takes chunks of 4096 (blocks of 64
    threads, one round each, as its 16384x4096 rows; ~16384 blocks), at most 2048 a row, since
    one block merges a row's partials (run 8, µs: 64x2^20 51.0 -> 49.5, 64x1048575 53.6 -> 51.6,
    256x262144 50.8 -> 49.9, 16x2^22 50.5 -> 49.7; 2x2^25 with 8192 chunks a row 50.5 -> 54.4,
    hence the cap). A full reduction keeps ~1024: one merge block folding 4096 partials cost more
    than the chunks saved (float32 sum 88.6 -> 89.8; bf16 logsumexp 51.7 -> 53.8 with 8192).
    """
    if inner == 1:
        if n <= _WARP_ROW_MAX or outer >= _BUSY_BLOCKS:
            return 1
        if itemsize == 4 and fn in _WIDE_STATE_OPS and outer > 1:
            return builtins.max(1, builtins.min(_wave_blocks(itemsize, True) // outer, n // _MIN_ROW_CHUNK))
        if outer == 1 or not (fn in _LIGHT_ROW_OPS or itemsize == 2):
            return builtins.max(1, builtins.min(-(-_TARGET_BLOCKS // outer), -(-n // _MIN_ROW_CHUNK)))
        if fn == "logsumexp" and itemsize == 2:
            return builtins.max(1, builtins.min(-(-_TARGET_BLOCKS_LSE16 // outer), -(-n // _MIN_ROW_CHUNK_LSE16),
                                                _MAX_SPLITS_LSE16))
        return builtins.max(1, builtins.min(-(-_TARGET_BLOCKS_LIGHT // outer), -(-n // _MIN_ROW_CHUNK)))
    pack = 16 // itemsize if inner % (16 // itemsize) == 0 else 1
    tx = _next_pow2(-(-inner // pack), 32)
    ty = _COLUMN_THREADS // tx
    blocks = outer * -(-inner // (tx * pack))
    if blocks >= _BUSY_BLOCKS:
        return 1
    if itemsize > 4:  # float64: no measured reason to change its plan
        return builtins.max(1, builtins.min(-(-_TARGET_BLOCKS // blocks), n // (4 * ty)))
    return builtins.max(1, builtins.min(_column_wave_blocks(itemsize, fn) // blocks, n // (4 * ty)))


def _state_bytes(fn: str, dtype) -> int:
    """Bytes of one partial state (cc/reduce/reduce_ops.h: state_bytes)."""
    acc = 8 if jnp.dtype(dtype) == jnp.float64 else 4
    if fn == "logsumexp":
        return 2 * acc
    if fn in _ARG_OPS:
        return 16 if acc == 8 else 8
    return acc


def _call(fn: str, x3: jax.Array) -> jax.Array:
    """The reduction of x3's axis 1; split across devices (jaxops._sharding), outer and inner
    stay split and a split reduced axis gives per-device partials merged by all-reduces."""
    return sharded_call(fn, partial(_call_local, fn=fn), _REDUCE_RULE, x3)


_REDUCE_RULE = Rule(operands=(("o", "n", "i"),), results=(("o", "i"),), reduced=("n",))


def _call_local(x3: jax.Array, *, axes, fn: str) -> jax.Array:
    y = _call_block(fn, x3)
    names = axes.get("n", ())
    return _merge_partials(fn, x3, y, names) if names else y


def _merge_partials(fn: str, x3, y, names):
    """Global result from this device's partial `y` over its block of the reduced axis.

    Only all-reduces of output-sized arrays, in the accumulation dtype. max/min/arg* carry a
    NaN flag explicitly, so NaN wins whatever the collective's own NaN handling is.
    """
    acc = jnp.promote_types(x3.dtype, jnp.float32)
    if fn in ("sum", "mean"):
        total = jax.lax.psum(y.astype(acc), names)
        return (total if fn == "sum" else total / jax.lax.psum(1, names)).astype(y.dtype)
    if fn == "logsumexp":  # max, then sum of exp relative to it
        ya = y.astype(acc)
        top = jax.lax.pmax(ya, names)
        finite = jnp.isfinite(top)
        total = jax.lax.psum(jnp.exp(ya - jnp.where(finite, top, 0)), names)
        return jnp.where(finite, top + jnp.log(total), top).astype(y.dtype)
    if fn in ("max", "min"):
        nan = jnp.isnan(y)
        extreme = jax.lax.pmax if fn == "max" else jax.lax.pmin
        best, any_nan = extreme(jnp.where(nan, 0, y), names), _any(nan, names)
        return jnp.where(any_nan, jnp.nan, best).astype(y.dtype)
    # argmax / argmin: (value, global index) pairs; NaN first, then the extreme, then the index.
    n_local = x3.shape[1]
    value = jnp.take_along_axis(x3, y[:, None, :], axis=1)[:, 0, :]
    index = y + (jax.lax.axis_index(names) * n_local).astype(y.dtype)
    nan = jnp.isnan(value)
    any_nan = _any(nan, names)
    masked = jnp.where(nan, -jnp.inf if fn == "argmax" else jnp.inf, value)
    best = (jax.lax.pmax if fn == "argmax" else jax.lax.pmin)(masked, names)
    hit = jnp.where(any_nan, nan, (value == best) & ~nan)
    return jax.lax.pmin(jnp.where(hit, index, np.iinfo(np.int32).max), names)


def _any(flags, names):
    return jax.lax.pmax(flags.astype(jnp.int32), names) > 0


def _call_block(fn: str, x3: jax.Array) -> jax.Array:
    outer, n, inner = x3.shape
    splits = _splits(outer, n, inner, jnp.dtype(x3.dtype).itemsize, fn)
    ws_bytes = outer * inner * splits * _state_bytes(fn, x3.dtype) if splits > 1 else 0
    out_dtype = jnp.int32 if fn in _ARG_OPS else x3.dtype
    # Rows go in as a rank-2 (outer, n) view: given (outer, n, 1), XLA:CPU laid the bfloat16
    # reshape out as {1,0,2} and copied the whole input to the operand's {2,1,0} first. Not
    # under vmap: its leading batch axis would turn (outer, n) into (outer, n, inner).
    rows = inner == 1 and not in_batched_trace()
    y, _ = ffi_call(fn, "jaxops_reduce",
                    (jax.ShapeDtypeStruct((outer,) if rows else (outer, inner), out_dtype),
                     jax.ShapeDtypeStruct((ws_bytes,), jnp.uint8)),
                    x3.reshape(outer, n) if rows else x3, op=_OPS[fn], splits=splits)
    return y.reshape(outer, inner)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _reduce3(fn: str, n: int, x3: jax.Array) -> jax.Array:
    return _call(fn, x3)


def _reduce3_fwd(fn, n, x3):
    y = _call(fn, x3)
    # sum and mean need only the shape; the others need x and the result.
    return y, ((None, None) if fn in ("sum", "mean") else (x3, y))


def _reduce3_bwd(fn, n, residuals, g):
    outer, inner = g.shape
    shape = (outer, n, inner)
    if fn == "sum":
        return (jnp.broadcast_to(g[:, None, :], shape),)
    if fn == "mean":
        acc = jnp.promote_types(g.dtype, jnp.float32)
        return (jnp.broadcast_to((g.astype(acc) / n).astype(g.dtype)[:, None, :], shape),)
    x3, y = residuals
    if fn == "logsumexp":  # d/dx logsumexp = softmax(x) = exp(x - logsumexp(x))
        acc = jnp.promote_types(x3.dtype, jnp.float32)
        p = jnp.exp(x3.astype(acc) - y.astype(acc)[:, None, :])
        return ((g.astype(acc)[:, None, :] * p).astype(x3.dtype),)
    # max / min: jnp's rule, ties share equally (and a NaN result gives NaN gradients). Rows
    # (inner 1) in 2-D: on (outer, n, 1) XLA:CPU copied bfloat16 operands into new layouts.
    if inner == 1:
        hit = (x3.reshape(outer, n) == y).astype(g.dtype)
        return ((hit * (g / jnp.sum(hit, axis=1, keepdims=True))).reshape(shape),)
    hit = (x3 == y[:, None, :]).astype(g.dtype)
    counts = jnp.sum(hit, axis=1)
    return (hit * (g / counts)[:, None, :],)


_reduce3.defvjp(_reduce3_fwd, _reduce3_bwd)
