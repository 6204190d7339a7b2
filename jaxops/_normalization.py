"""relu with a 1-bit mask, and fused BatchNorm(+Add)(+ReLU) for training and inference.

Memory is the point of this family: ``relu``'s backward keeps only a bit mask (1/8 byte per
element where ``jax.nn.relu`` keeps 5), and ``batch_norm(..., activation="relu")`` keeps x, the
mask and per-channel statistics (never the residual, never y).
"""
from __future__ import annotations

import math
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxops._checks import canonical_axis, check_float
from jaxops._ffi import ffi_call
from jaxops._sharding import Rule, sharded_call

__all__ = ["relu", "batch_norm", "batch_norm_inference"]

_ACTIVATIONS = (None, "relu")
_MAX_ROW_BLOCKS = 1024  # capacity of the per-row-block partial statistics workspace


def _mask_words(n: int) -> int:
    return (n + 31) // 32


# ---------------------------------------------------------------------------------------------
# relu


def relu(x: jax.typing.ArrayLike) -> jax.Array:
    """Rectified linear unit ``max(x, 0)``, like :func:`jax.nn.relu` (NaN stays NaN, grad at 0 is 0).

    The gradient rule saves only a bit mask of ``x > 0`` (uint32 words, bit j of word i is
    element 32*i+j of the flattened input), so backward memory is 1/8 byte per element.

    Args:
      x: float32, bfloat16, float16 or float64 array of any shape.

    Returns:
      An array of ``x``'s shape and dtype. Works under ``jax.jit``, ``jax.vmap`` and ``jax.grad``.
    """
    x = jnp.asarray(x)
    check_float("relu", "x", x)
    if x.size == 0:
        return x
    # Rows of whole mask words keep x's shape, so a sharded x needs no reshape across devices.
    keep = x.ndim > 0 and x.shape[-1] % 32 == 0
    return _relu_flat(x if keep else x.reshape(-1)).reshape(x.shape)


def _relu_call(x, with_mask: bool):
    # Elements split across devices (jaxops._sharding); see _relu_rule for the mask.
    return sharded_call("relu", partial(_relu_local, with_mask=with_mask),
                        _relu_rule(x.shape, False, with_mask), x)


def _mask_shape(shape) -> tuple[int, ...]:
    """The bit mask of an array of `shape`: the same words as the flat mask, shaped as
    (rows..., words per row) when rows are whole words (a free reshape), else flat."""
    if shape[-1] % 32 == 0:
        return tuple(shape[:-1]) + (shape[-1] // 32,)
    return (_mask_words(math.prod(shape)),)


def _relu_rule(shape, mask_in: bool, mask_out: bool) -> Rule:
    """Rule for x (and dy) -> y (+ mask): every element independent. With a mask, each
    device's block of elements must own whole mask words: rows of whole words ((w, 32), split
    on w, the mask (..., w)); a flat size that is not a multiple of 32 stays whole."""
    lead = tuple(f"e{i}" for i in range(len(shape) - 1))
    if not (mask_in or mask_out):
        el = lead + ("e",)
        return Rule(operands=(el,), results=(el, ("z",)))
    if shape[-1] % 32 == 0:
        el, words, sizes, whole = lead + (("w", "t"),), lead + ("w",), (("w", shape[-1] // 32), ("t", 32)), ()
    else:
        el, words, sizes, whole = lead + ("e",), ("m",), (), lead + ("e", "m")
    if mask_in:
        return Rule(operands=(el, words), results=(el,), replicated=whole, factor_sizes=sizes)
    return Rule(operands=(el,), results=(el, words), replicated=whole, factor_sizes=sizes)


def _relu_local(x, *, axes, with_mask: bool):
    del axes  # elementwise: the kernel runs on this device's block, flattened
    y, mask = _relu_flat_call(x.reshape(-1), with_mask)
    return y.reshape(x.shape), mask.reshape(_mask_shape(x.shape) if with_mask else (0,))


def _relu_flat_call(x, with_mask: bool):
    words = _mask_words(x.shape[-1]) if with_mask else 0
    return ffi_call("relu", "jaxops_relu_fwd",
                    (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((words,), jnp.uint32)),
                    x, with_mask=with_mask)


@jax.custom_vjp
def _relu_flat(x):
    return _relu_call(x, False)[0]


def _relu_flat_fwd(x):
    y, mask = _relu_call(x, True)
    return y, mask  # the mask is the only residual


def _relu_flat_bwd(mask, dy):
    return (sharded_call("relu", _relu_bwd_local, _relu_rule(dy.shape, True, False), dy, mask),)


def _relu_bwd_local(dy, mask, *, axes):
    del axes
    flat = dy.reshape(-1)
    dx = ffi_call("relu", "jaxops_relu_bwd", jax.ShapeDtypeStruct(flat.shape, dy.dtype), flat,
                  mask.reshape(-1))
    return dx.reshape(dy.shape)


_relu_flat.defvjp(_relu_flat_fwd, _relu_flat_bwd)


# ---------------------------------------------------------------------------------------------
# batch_norm: argument checks and layout


def _stats_dtype(dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _check_common(fn: str, x, scale, bias, axis, epsilon, residual, activation):
    x = jnp.asarray(x)
    check_float(fn, "x", x)
    if x.ndim == 0:
        raise ValueError(f"jaxops.{fn}: x must have at least one dimension, got a scalar")
    ax = canonical_axis(fn, axis, x.ndim)
    channels = x.shape[ax]
    params = []
    for name, p in (("scale", scale), ("bias", bias)):
        p = jnp.asarray(p)
        check_float(fn, name, p)
        if p.shape != (channels,):
            raise ValueError(f"jaxops.{fn}: {name} must have shape ({channels},) (x.shape[{axis}]), "
                             f"got {p.shape}")
        params.append(p)
    if isinstance(epsilon, (jax.Array, np.ndarray)) or not isinstance(epsilon, (int, float, np.floating)):
        raise TypeError(f"jaxops.{fn}: epsilon must be a Python float, got {epsilon!r}")
    if not (epsilon >= 0 and math.isfinite(epsilon)):
        raise ValueError(f"jaxops.{fn}: epsilon must be a finite number >= 0, got {epsilon!r}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"jaxops.{fn}: activation must be None or 'relu', got {activation!r}")
    if residual is not None:
        residual = jnp.asarray(residual)
        check_float(fn, "residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"jaxops.{fn}: residual must have x's shape {x.shape}, got {residual.shape}")
        if residual.dtype != x.dtype:
            raise TypeError(f"jaxops.{fn}: residual must have x's dtype {x.dtype}, got {residual.dtype}")
    return x, ax, params[0], params[1], residual


def _to_rows(x, ax):
    """(..., C at ax, ...) -> (R, C) with the channel axis last; a transpose unless ax is last."""
    if x is None:
        return None
    xt = jnp.moveaxis(x, ax, -1)
    return xt.reshape(-1, x.shape[ax])


def _from_rows(y2, shape, ax):
    moved = tuple(d for i, d in enumerate(shape) if i != ax) + (shape[ax],)
    return jnp.moveaxis(y2.reshape(moved), -1, ax)


def _axis_names(axis_name) -> tuple:
    if axis_name is None:
        return ()
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


# ---------------------------------------------------------------------------------------------
# batch_norm: FFI calls on the (R, C) view (leading vmap dims are handled by the kernels)


def _row_block_cap(rows: int) -> int:
    return max(1, min(_MAX_ROW_BLOCKS, -(-rows // 32)))


def _stats_results(x2):
    """mean, var and the row-block workspace the statistics targets write."""
    rows, c = x2.shape
    sd = _stats_dtype(x2.dtype)
    return (jax.ShapeDtypeStruct((c,), sd), jax.ShapeDtypeStruct((c,), sd),
            jax.ShapeDtypeStruct((_row_block_cap(rows), 3, c), sd))


def _apply_io(x2, res2, relu_on, with_mask):
    """The apply targets' results (y, mask, coefficient workspace), residual operand and attributes."""
    rows, c = x2.shape
    words = _mask_words(rows * c) if (relu_on and with_mask) else 0
    has_res = res2 is not None
    results = (jax.ShapeDtypeStruct(x2.shape, x2.dtype), jax.ShapeDtypeStruct((words,), jnp.uint32),
               jax.ShapeDtypeStruct((4, c), _stats_dtype(x2.dtype)))
    res_arg = res2 if has_res else jnp.zeros((), x2.dtype)
    return results, res_arg, dict(relu=relu_on, with_mask=with_mask, has_residual=has_res)


def _stats_call(x2):
    mean, var, _ = ffi_call("batch_norm", "jaxops_bn_stats", _stats_results(x2), x2)
    return mean, var


def _apply_call(x2, scale, bias, mean, var, res2, eps, relu_on, with_mask):
    results, res_arg, attrs = _apply_io(x2, res2, relu_on, with_mask)
    y, mask, _ = ffi_call("batch_norm", "jaxops_bn_apply", results, x2, scale, bias, mean, var, res_arg,
                          epsilon=float(eps), **attrs)
    return y, mask


def _forward_call(x2, scale, bias, res2, eps, relu_on, with_mask):
    """Statistics and apply in one custom call (on a GPU one kernel when x fits in shared memory)."""
    results, res_arg, attrs = _apply_io(x2, res2, relu_on, with_mask)
    results = results[:2] + _stats_results(x2) + results[2:]  # y, mask, mean, var, ws, coef
    y, mask, mean, var, _, _ = ffi_call("batch_norm", "jaxops_bn_forward", results, x2, scale, bias, res_arg,
                                        epsilon=float(eps), **attrs)
    return y, mean, var, mask


def _backward_sums(dy2, x2, mask, mean, var, eps, relu_on):
    rows, c = x2.shape
    sd = _stats_dtype(x2.dtype)
    m = mask if relu_on else jnp.zeros((0,), jnp.uint32)
    sum_dy, sum_dyxhat, _ = ffi_call("batch_norm", "jaxops_bn_bwd_reduce",
                                     (jax.ShapeDtypeStruct((c,), sd), jax.ShapeDtypeStruct((c,), sd),
                                      jax.ShapeDtypeStruct((_row_block_cap(rows), 2, c), sd)),
                                     dy2, x2, m, mean, var, epsilon=float(eps), relu=relu_on)
    return sum_dy, sum_dyxhat


def _backward_dx(dy2, x2, mask, scale, mean, var, sum_dy, sum_dyxhat, dmean, dvar, eps, relu_on,
                 has_res, train, count):
    c = x2.shape[1]
    sd = _stats_dtype(x2.dtype)
    m = mask if relu_on else jnp.zeros((0,), jnp.uint32)
    dres_shape = x2.shape if has_res else (0,)
    dx, dres, _ = ffi_call("batch_norm", "jaxops_bn_bwd_dx",
                           (jax.ShapeDtypeStruct(x2.shape, x2.dtype), jax.ShapeDtypeStruct(dres_shape, x2.dtype),
                            jax.ShapeDtypeStruct((4, c), sd)),
                           dy2, x2, m, scale, mean, var, sum_dy, sum_dyxhat, dmean, dvar,
                           epsilon=float(eps), relu=relu_on, has_residual=has_res, train=train, count=int(count))
    return dx, (dres if has_res else None)


def _backward_fused(dy2, x2, mask, scale, mean, var, dmean, dvar, eps, relu_on, has_res):
    """The training backward in one custom call (on a GPU one kernel with a slice of dy and x in
    shared memory): dx, dres, sum_dy, sum_dyxhat, with every row of x2 in the statistics."""
    rows, c = x2.shape
    sd = _stats_dtype(x2.dtype)
    m = mask if relu_on else jnp.zeros((0,), jnp.uint32)
    dres_shape = x2.shape if has_res else (0,)
    dx, dres, sum_dy, sum_dyxhat, _, _ = ffi_call(
        "batch_norm", "jaxops_bn_backward",
        (jax.ShapeDtypeStruct(x2.shape, x2.dtype), jax.ShapeDtypeStruct(dres_shape, x2.dtype),
         jax.ShapeDtypeStruct((c,), sd), jax.ShapeDtypeStruct((c,), sd),
         jax.ShapeDtypeStruct((_row_block_cap(rows), 2, c), sd), jax.ShapeDtypeStruct((4, c), sd)),
        dy2, x2, m, scale, mean, var, dmean, dvar, epsilon=float(eps), relu=relu_on, has_residual=has_res)
    return dx, (dres if has_res else None), sum_dy, sum_dyxhat


@jax.custom_vjp
def _local_stats(x2):
    return _stats_call(x2)


def _local_stats_fwd(x2):
    mean, var = _stats_call(x2)
    return (mean, var), (x2, mean)


def _local_stats_bwd(saved, cotangents):
    x2, mean = saved
    dmean, dvar = cotangents
    rows = x2.shape[0]
    dx = (dmean + 2.0 * dvar * (x2.astype(mean.dtype) - mean)) / rows
    return (dx.astype(x2.dtype),)


_local_stats.defvjp(_local_stats_fwd, _local_stats_bwd)


def _sharded_train(x2, scale, bias, res2, eps, relu_on, names):
    """Training batch norm whose statistics also span the mapped axes `names`.

    Built from differentiable pieces so JAX transposes the collectives itself (a custom_vjp
    backward may not call psum: under grad-of-vmap it is traced outside the axis). Equal-sized
    shards merge exactly and stably (Chan): mean = pmean(mean_k) and
    var = pmean(var_k + (mean_k - mean)^2); no sum of squares is ever formed.
    """
    mean, var = _local_stats(x2)
    gmean = jax.lax.pmean(mean, names)
    gvar = jax.lax.pmean(var + jnp.square(mean - gmean), names)
    y = _bn_infer(x2, scale, bias, gmean, gvar, res2, eps, relu_on)
    return y, gmean, gvar


# ---------------------------------------------------------------------------------------------
# batch_norm across devices under jit (jaxops._sharding): the (R, C) view's rows split across
# devices; statistics and their backward sums merged with all-reduces of (C,) vectors
# (SyncBatchNorm), so every device normalizes with the global statistics and the result equals
# the single-device one. (axis_name, inside shard_map/pmap, is _sharded_train above.)


def _bn_dims(rows: int, c: int, mask: bool):
    """(rows dim, channel dim, mask dim, factor sizes, whole factors) of the (R, C) view.

    Channels are independent (split freely) unless a bit mask packs whole rows: then rows
    are split in groups of g rows (g*C a multiple of 32), so each device's mask words are its
    own block of the mask."""
    if not mask:
        return "r", "c", "z", (), ()
    g = 32 // math.gcd(c, 32)
    if rows % g:
        return "r", "c", "w", (), ("r", "c", "w")
    return ("r", "g"), "c", ("r", "w"), (("r", rows // g), ("g", g), ("w", g * c // 32)), ("c",)


def _bn_rule(x2, mask: bool, kinds: str, results: str) -> Rule:
    """Letters: x a (R, C) array, c a (C,) vector, m the mask, 0 a scalar, z an empty array."""
    row, ch, words, sizes, whole = _bn_dims(x2.shape[-2], x2.shape[-1], mask)
    dims = {"x": (row, ch), "c": (ch,), "m": (words,), "0": (), "z": ("z",)}
    return Rule(operands=tuple(dims[k] for k in kinds), results=tuple(dims[k] for k in results),
                replicated=whole, factor_sizes=sizes)


def _bn_forward(x2, scale, bias, res2, eps, relu_on, with_mask):
    has_res = res2 is not None
    res = res2 if has_res else jnp.zeros((), x2.dtype)
    mask = relu_on and with_mask
    rule = _bn_rule(x2, mask, "xcc" + ("x" if has_res else "0"), "xcc" + ("m" if mask else "z"))
    local = partial(_bn_forward_local, eps=eps, relu_on=relu_on, with_mask=with_mask, has_res=has_res)
    return sharded_call("batch_norm", local, rule, x2, scale, bias, res)


def _bn_forward_local(x2, scale, bias, res, *, axes, eps, relu_on, with_mask, has_res):
    rows = axes.get("r", ())
    if not rows:
        return _forward_call(x2, scale, bias, res if has_res else None, eps, relu_on, with_mask)
    # Rows split across devices: equal-sized shards merge exactly and stably (Chan), as in
    # _sharded_train, but from one all-gather of every shard's (mean, var): one collective
    # latency, not two.
    mean, var = _stats_call(x2)
    parts = jax.lax.all_gather(jnp.stack([mean, var]), rows, tiled=False)
    parts = parts.reshape(-1, 2, mean.shape[0])
    gmean = jnp.mean(parts[:, 0], axis=0)
    var = jnp.mean(parts[:, 1] + jnp.square(parts[:, 0] - gmean), axis=0)
    mean = gmean
    y, mask = _apply_call(x2, scale, bias, mean, var, res if has_res else None, eps, relu_on,
                          with_mask)
    return y, mean, var, mask


def _bn_backward(x2, mask, scale, mean, var, dy2, dmean, dvar, eps, relu_on, has_res):
    m = mask if relu_on else jnp.zeros((0,), jnp.uint32)
    rule = _bn_rule(x2, relu_on, "x" + ("m" if relu_on else "z") + "cccxcc",
                    "xcc" + ("x" if has_res else "z"))
    local = partial(_bn_backward_local, eps=eps, relu_on=relu_on, has_res=has_res)
    dx, dscale, dbias, dres = sharded_call("batch_norm", local, rule, x2, m, scale, mean, var, dy2,
                                           dmean, dvar)
    return dx, dscale, dbias, (dres if has_res else None)


def _bn_backward_local(x2, mask, scale, mean, var, dy2, dmean, dvar, *, axes, eps, relu_on, has_res):
    rows = axes.get("r", ())
    if not rows:  # every row here: sums and dx in one call
        dx, dres, sum_dy, sum_dyxhat = _backward_fused(dy2, x2, mask, scale, mean, var, dmean, dvar, eps,
                                                       relu_on, has_res)
        return dx, sum_dyxhat, sum_dy, (dres if has_res else jnp.zeros((0,), x2.dtype))
    # rows on other devices: per-channel sums (reads dy, x, mask), summed across devices, then dx
    sum_dy, sum_dyxhat = jax.lax.psum(_backward_sums(dy2, x2, mask, mean, var, eps, relu_on), rows)
    count = x2.shape[0] * jax.lax.psum(1, rows)
    dx, dres = _backward_dx(dy2, x2, mask, scale, mean, var, sum_dy, sum_dyxhat, dmean, dvar, eps,
                            relu_on, has_res, True, count)
    return dx, sum_dyxhat, sum_dy, (dres if has_res else jnp.zeros((0,), x2.dtype))


# ---------------------------------------------------------------------------------------------
# batch_norm (training): custom_vjp over the (R, C) view


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _bn_train(x2, scale, bias, res2, eps, relu_on):
    y, mean, var, _ = _bn_forward(x2, scale, bias, res2, eps, relu_on, with_mask=False)
    return y, mean, var


def _bn_train_fwd(x2, scale, bias, res2, eps, relu_on):
    y, mean, var, mask = _bn_forward(x2, scale, bias, res2, eps, relu_on, with_mask=True)
    # Saved for backward: x, the 1-bit mask, O(C) statistics; never y, never the residual.
    return (y, mean, var), (x2, mask if relu_on else None, scale, mean, var, res2 is not None)


def _bn_train_bwd(eps, relu_on, saved, cotangents):
    x2, mask, scale, mean, var, has_res = saved
    dy2, dmean, dvar = cotangents
    return _bn_backward(x2, mask, scale, mean, var, dy2, dmean, dvar, eps, relu_on, has_res)


_bn_train.defvjp(_bn_train_fwd, _bn_train_bwd)


def batch_norm(x: jax.typing.ArrayLike, scale: jax.typing.ArrayLike, bias: jax.typing.ArrayLike, *,
               axis: int = -1, epsilon: float = 1e-5, residual: jax.typing.ArrayLike | None = None,
               activation: str | None = None,
               axis_name: str | Sequence[str] | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Training-mode batch normalization, optionally fused with a residual add and a relu.

    ``y = act((x - mean) / sqrt(var + epsilon) * scale + bias + residual)`` with ``mean`` and
    the biased ``var`` taken per channel over every axis of ``x`` but ``axis`` (numerically
    stable: Welford/Chan merges, so large means do not cancel).

    Args:
      x: float32, bfloat16, float16 or float64 array; ``axis`` is the channel axis. Channel-last
        (NHWC, ``axis=-1``) is the fast path; other axes are transposed to the end and back.
      scale, bias: shape ``(C,)`` float arrays.
      axis: the channel axis.
      epsilon: added to the variance.
      residual: optional array of ``x``'s shape and dtype added after the affine step and
        before the activation (ResNet's BN+Add+ReLU).
      activation: None or ``"relu"``. With ``"relu"`` the forward saves a 1-bit mask and the
        backward uses it: it never needs y nor the residual.
      axis_name: a mapped axis name (or tuple of names) of ``jax.vmap``/``shard_map``/``pmap``
        to compute the statistics over as well, like flax's ``BatchNorm(axis_name=...)``
        (shards must be equal-sized).

    Returns:
      ``(y, mean, var)``: ``y`` of ``x``'s shape and dtype; ``mean`` and biased ``var`` of shape
      ``(C,)`` in float32 (float64 when ``x`` is float64). Differentiable with respect to
      ``x``, ``scale``, ``bias`` and ``residual`` (including through ``mean`` and ``var``).
    """
    fn = "batch_norm"
    x, ax, scale, bias, residual = _check_common(fn, x, scale, bias, axis, epsilon, residual, activation)
    names = _axis_names(axis_name)
    sd = _stats_dtype(x.dtype)
    if x.size == 0:
        return _reference_train(x, ax, scale, bias, residual, epsilon, activation, names)
    x2, res2 = _to_rows(x, ax), _to_rows(residual, ax)
    if names:
        y2, mean, var = _sharded_train(x2, scale.astype(sd), bias.astype(sd), res2, float(epsilon),
                                       activation == "relu", names)
    else:
        y2, mean, var = _bn_train(x2, scale.astype(sd), bias.astype(sd), res2, float(epsilon),
                                  activation == "relu")
    return _from_rows(y2, x.shape, ax), mean, var


# ---------------------------------------------------------------------------------------------
# batch_norm_inference: given statistics


@partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _bn_infer(x2, scale, bias, mean, var, res2, eps, relu_on):
    return _infer_apply(x2, scale, bias, mean, var, res2, eps, relu_on, with_mask=False)[0]


def _infer_apply(x2, scale, bias, mean, var, res2, eps, relu_on, with_mask):
    has_res = res2 is not None
    res = res2 if has_res else jnp.zeros((), x2.dtype)
    mask = relu_on and with_mask
    rule = _bn_rule(x2, mask, "xcccc" + ("x" if has_res else "0"), "x" + ("m" if mask else "z"))
    local = partial(_infer_apply_local, eps=eps, relu_on=relu_on, with_mask=with_mask, has_res=has_res)
    return sharded_call("batch_norm_inference", local, rule, x2, scale, bias, mean, var, res)


def _infer_apply_local(x2, scale, bias, mean, var, res, *, axes, eps, relu_on, with_mask, has_res):
    del axes  # given statistics: rows are independent
    return _apply_call(x2, scale, bias, mean, var, res if has_res else None, eps, relu_on, with_mask)


def _infer_sums(dy2, x2, mask, mean, var, eps, relu_on):
    m = mask if relu_on else jnp.zeros((0,), jnp.uint32)
    rule = _bn_rule(x2, relu_on, "x" + ("m" if relu_on else "z") + "xcc", "cc")
    local = partial(_infer_sums_local, eps=eps, relu_on=relu_on)
    return sharded_call("batch_norm_inference", local, rule, dy2, m, x2, mean, var)


def _infer_sums_local(dy2, mask, x2, mean, var, *, axes, eps, relu_on):
    sums = _backward_sums(dy2, x2, mask, mean, var, eps, relu_on)
    rows = axes.get("r", ())
    return jax.lax.psum(sums, rows) if rows else sums


def _infer_dx(dy2, x2, mask, scale, mean, var, sum_dy, sum_dyxhat, eps, relu_on, has_res):
    m = mask if relu_on else jnp.zeros((0,), jnp.uint32)
    rule = _bn_rule(x2, relu_on, "xx" + ("m" if relu_on else "z") + "ccccc",
                    "x" + ("x" if has_res else "z"))
    local = partial(_infer_dx_local, eps=eps, relu_on=relu_on, has_res=has_res)
    dx, dres = sharded_call("batch_norm_inference", local, rule, dy2, x2, m, scale, mean, var, sum_dy,
                            sum_dyxhat)
    return dx, (dres if has_res else None)


def _infer_dx_local(dy2, x2, mask, scale, mean, var, sum_dy, sum_dyxhat, *, axes, eps, relu_on, has_res):
    del axes  # given statistics: rows are independent
    zeros = jnp.zeros_like(mean)
    dx, dres = _backward_dx(dy2, x2, mask, scale, mean, var, sum_dy, sum_dyxhat, zeros, zeros, eps,
                            relu_on, has_res, False, 1)
    return dx, (dres if has_res else jnp.zeros((0,), x2.dtype))


def _bn_infer_fwd(x2, scale, bias, mean, var, res2, eps, relu_on):
    y, mask = _infer_apply(x2, scale, bias, mean, var, res2, eps, relu_on, with_mask=True)
    return y, (x2, mask if relu_on else None, scale, mean, var, res2 is not None)


def _bn_infer_bwd(eps, relu_on, saved, dy2):
    x2, mask, scale, mean, var, has_res = saved
    sum_dy, sum_dyxhat = _infer_sums(dy2, x2, mask, mean, var, eps, relu_on)
    dx, dres = _infer_dx(dy2, x2, mask, scale, mean, var, sum_dy, sum_dyxhat, eps, relu_on, has_res)
    invstd = jax.lax.rsqrt(var + eps)
    dmean = -scale * invstd * sum_dy
    dvar = -0.5 * scale * invstd * invstd * sum_dyxhat
    return dx, sum_dyxhat, sum_dy, dmean, dvar, dres


_bn_infer.defvjp(_bn_infer_fwd, _bn_infer_bwd)


def batch_norm_inference(x: jax.typing.ArrayLike, scale: jax.typing.ArrayLike, bias: jax.typing.ArrayLike,
                         mean: jax.typing.ArrayLike, var: jax.typing.ArrayLike, *, axis: int = -1,
                         epsilon: float = 1e-5, residual: jax.typing.ArrayLike | None = None,
                         activation: str | None = None) -> jax.Array:
    """Batch normalization with given statistics (e.g. running averages), same fusions as
    :func:`batch_norm`: ``act((x - mean) / sqrt(var + epsilon) * scale + bias + residual)``.

    ``mean`` and ``var`` have shape ``(C,)``. Differentiable with respect to every array argument.
    """
    fn = "batch_norm_inference"
    x, ax, scale, bias, residual = _check_common(fn, x, scale, bias, axis, epsilon, residual, activation)
    c = x.shape[ax]
    stats = []
    for name, s in (("mean", mean), ("var", var)):
        s = jnp.asarray(s)
        check_float(fn, name, s)
        if s.shape != (c,):
            raise ValueError(f"jaxops.{fn}: {name} must have shape ({c},), got {s.shape}")
        stats.append(s)
    sd = _stats_dtype(x.dtype)
    if x.size == 0:
        return _reference_apply(x, ax, scale, bias, stats[0], stats[1], residual, epsilon, activation)
    x2, res2 = _to_rows(x, ax), _to_rows(residual, ax)
    y2 = _bn_infer(x2, scale.astype(sd), bias.astype(sd), stats[0].astype(sd), stats[1].astype(sd), res2,
                   float(epsilon), activation == "relu")
    return _from_rows(y2, x.shape, ax)


# ---------------------------------------------------------------------------------------------
# empty arrays: the pure-JAX formula (nothing to launch)


def _reference_apply(x, ax, scale, bias, mean, var, residual, eps, activation):
    sd = _stats_dtype(x.dtype)
    shape = [1] * x.ndim
    shape[ax] = x.shape[ax]
    z = ((x.astype(sd) - mean.astype(sd).reshape(shape)) * jax.lax.rsqrt(var.astype(sd).reshape(shape) + eps)
         * scale.astype(sd).reshape(shape) + bias.astype(sd).reshape(shape))
    if residual is not None:
        z = z + residual.astype(sd)
    if activation == "relu":
        z = jax.nn.relu(z)
    return z.astype(x.dtype)


def _reference_train(x, ax, scale, bias, residual, eps, activation, names):
    sd = _stats_dtype(x.dtype)
    axes = tuple(i for i in range(x.ndim) if i != ax)
    xs = x.astype(sd)
    mean = jnp.mean(xs, axis=axes)
    var = jnp.mean(jnp.square(xs - mean.reshape([-1 if i == ax else 1 for i in range(x.ndim)])), axis=axes)
    if names:
        gmean = jax.lax.pmean(mean, names)
        var = jax.lax.pmean(var + jnp.square(mean - gmean), names)
        mean = gmean
    return _reference_apply(x, ax, scale, bias, mean, var, residual, eps, activation), mean, var
