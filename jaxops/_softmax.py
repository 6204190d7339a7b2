"""softmax and log_softmax: drop-in for ``jax.nn.softmax`` / ``jax.nn.log_softmax``."""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from jaxops._checks import canonical_axes, check_float, move_axes_last, undo_move
from jaxops._ffi import ffi_call
from jaxops._sharding import rows_rule, sharded_call

__all__ = ["softmax", "log_softmax"]

_NO_MASK = None  # stands for "where=None" inside the custom_vjp


def softmax(x: jax.typing.ArrayLike, axis: int | tuple[int, ...] | None = -1,
            where: jax.typing.ArrayLike | None = None) -> jax.Array:
    """Softmax over ``axis``, like :func:`jax.nn.softmax`.

    Args:
      x: float32, bfloat16, float16 or float64 array (math is float32 for the half types).
      axis: an int, a tuple of ints, or None for all axes.
      where: optional boolean mask broadcastable to ``x``; masked-out entries give 0 and a
        fully masked slice gives all zeros.

    Returns:
      An array of ``x``'s shape and dtype. Differentiable (``jax.grad``) through a fused
      backward kernel; works under ``jax.jit`` and ``jax.vmap``.
    """
    return _normalized_exp("softmax", x, axis, where, log=False)


def log_softmax(x: jax.typing.ArrayLike, axis: int | tuple[int, ...] | None = -1,
                where: jax.typing.ArrayLike | None = None) -> jax.Array:
    """Log-softmax over ``axis``, like :func:`jax.nn.log_softmax`.

    Masked-out entries (``where`` False) give ``-inf``. Same dtypes, transformations and
    differentiability as :func:`softmax`.
    """
    return _normalized_exp("log_softmax", x, axis, where, log=True)


def _normalized_exp(fn: str, x, axis, where, *, log: bool) -> jax.Array:
    x = jnp.asarray(x)
    check_float(fn, "x", x)
    axes = canonical_axes(fn, axis, x.ndim) if x.ndim else ()
    if x.ndim == 0:
        raise ValueError(f"jaxops.{fn}: x must have at least one dimension, got a scalar")
    mask = None
    if where is not None:
        mask = jnp.asarray(where)
        if mask.dtype != jnp.bool_:
            raise TypeError(f"jaxops.{fn}: where must be a boolean array, got dtype {mask.dtype}")
        try:
            mask = jnp.broadcast_to(mask, x.shape)
        except ValueError:
            raise ValueError(
                f"jaxops.{fn}: where of shape {mask.shape} does not broadcast to x's shape {x.shape}"
            ) from None
    if x.size == 0:
        return jnp.zeros_like(x)

    xt, perm = move_axes_last(x, axes)
    lead = xt.shape[: x.ndim - len(axes)]
    rows_shape = lead + (math.prod(xt.shape[x.ndim - len(axes):]),)
    mask2 = None if mask is None else move_axes_last(mask, axes)[0].reshape(rows_shape)
    y = _last_axis(xt.reshape(rows_shape), mask2, log)
    return undo_move(y.reshape(xt.shape), perm)


def _forward_call(x, mask, log):
    masked = mask is not None
    m = mask if masked else jnp.zeros((), jnp.bool_)
    # Rows split across devices, the normalized (last) axis whole on each (jaxops._sharding).
    rule = rows_rule(x.ndim - 1, "x" + ("x" if masked else "0"), "x")
    return sharded_call("log_softmax" if log else "softmax",
                        partial(_forward_local, log=log, masked=masked), rule, x, m)


def _forward_local(x, m, *, axes, log, masked):
    del axes  # no reduced factor: rows are independent
    return ffi_call("log_softmax" if log else "softmax", "jaxops_softmax_fwd",
                    jax.ShapeDtypeStruct(x.shape, x.dtype), x, m, log=log, masked=masked)


def _backward_call(y, dy, mask, log):
    masked = mask is not None
    m = mask if masked else jnp.zeros((), jnp.bool_)
    rule = rows_rule(y.ndim - 1, "xx" + ("x" if masked else "0"), "x")
    return sharded_call("log_softmax" if log else "softmax",
                        partial(_backward_local, log=log, masked=masked), rule, y, dy, m)


def _backward_local(y, dy, m, *, axes, log, masked):
    del axes
    return ffi_call("log_softmax" if log else "softmax", "jaxops_softmax_bwd",
                    jax.ShapeDtypeStruct(y.shape, y.dtype), y, dy, m, log=log, masked=masked)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _last_axis(x, mask, log):
    return _forward_call(x, mask, log)


def _last_axis_fwd(x, mask, log):
    y = _forward_call(x, mask, log)
    return y, (y, mask)


def _last_axis_bwd(log, residuals, dy):
    y, mask = residuals
    # softmax's masked y is 0, but 0 * (dy - s) is NaN where the row's sum s is (a NaN or inf
    # row) or dy is: jax.nn gives masked entries no gradient, so both ops pass the mask.
    return _backward_call(y, dy, mask, log), None


_last_axis.defvjp(_last_axis_fwd, _last_axis_bwd)
