"""layer_norm and rms_norm over the last axis, with fused FFI forward and backward kernels."""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxops._checks import check_float
from jaxops._ffi import ffi_call
from jaxops._sharding import row_axes, rows_rule, sharded_call

__all__ = ["layer_norm", "rms_norm"]

# Workspace slots per group: runs of rows whose dscale/dbias column sums the backward writes
# as partial rows (one block owns a slot), added in a fixed order afterwards. At least 4 per SM
# of an H100 (when there are that many rows), so the 16-bit register-row backward (<= 64
# registers, 256 threads at 4096 columns) keeps 4 blocks on every SM (session 5, H100 bfloat16
# 16384x4096: layer_norm_bwd 163.6 vs 176.2 us with 264 slots, rms_norm_bwd 157.4 vs 159.2);
# beyond that one slot per 64 rows, so the partials (8 bytes per column per slot, written and
# re-read) stay a few percent of the backward's traffic; at most 1024. The CUDA handler may use
# fewer (occupancy).
_MIN_SLOTS = 528
_ROWS_PER_SLOT = 64
_MAX_SLOTS = 1024


def _num_slots(rows: int) -> int:
    return max(1, min(rows, max(_MIN_SLOTS, min(_MAX_SLOTS, rows // _ROWS_PER_SLOT))))


def layer_norm(x: jax.typing.ArrayLike, scale: jax.typing.ArrayLike, bias: jax.typing.ArrayLike, *,
               epsilon: float = 1e-5) -> jax.Array:
    """Layer normalization over the last axis.

    ``y = (x - mean) / sqrt(var + epsilon) * scale + bias`` with the mean and the biased
    variance of each row (``x[..., :]``), like ``flax.linen.LayerNorm``.

    Args:
      x: float32, bfloat16, float16 or float64 array of rank >= 1 (statistics in float32, or
        float64 for float64 input).
      scale: float array of shape ``(x.shape[-1],)``. Another dtype than ``x``'s (float32
        parameters of a bfloat16 model) is cast to ``x``'s first, like flax's
        ``LayerNorm(dtype=x.dtype)``; its gradient comes back in its own dtype.
      bias: float array of shape ``(x.shape[-1],)``, cast like ``scale``.
      epsilon: non-negative Python float added to the variance.

    Returns:
      An array of ``x``'s shape and dtype. Differentiable in ``x``, ``scale`` and ``bias``
      through fused backward kernels (parameter gradients are reduced deterministically);
      works under ``jax.jit`` and ``jax.vmap``.
    """
    fn = "layer_norm"
    x = _check_x(fn, x)
    scale = _check_param(fn, "scale", scale, x)
    bias = _check_param(fn, "bias", bias, x)
    eps = _check_epsilon(fn, epsilon)
    if x.size == 0:
        return _layer_norm_reference(x, scale, bias, eps)
    return _layer_norm(x, scale, bias, eps)


def rms_norm(x: jax.typing.ArrayLike, scale: jax.typing.ArrayLike, *, epsilon: float = 1e-6) -> jax.Array:
    """Root-mean-square normalization over the last axis.

    ``y = x * rsqrt(mean(x**2) + epsilon) * scale``, like ``flax.linen.RMSNorm``.

    Args:
      x: float32, bfloat16, float16 or float64 array of rank >= 1.
      scale: float array of shape ``(x.shape[-1],)``, cast to ``x``'s dtype like
        :func:`layer_norm`'s.
      epsilon: non-negative Python float added to the mean square.

    Returns:
      An array of ``x``'s shape and dtype; differentiable in ``x`` and ``scale``, under
      ``jax.jit`` and ``jax.vmap``, like :func:`layer_norm`.
    """
    fn = "rms_norm"
    x = _check_x(fn, x)
    scale = _check_param(fn, "scale", scale, x)
    eps = _check_epsilon(fn, epsilon)
    if x.size == 0:
        return _rms_norm_reference(x, scale, eps)
    return _rms_norm(x, scale, eps)


# ----------------------------------------------------------------------------------------------
# Argument checks (raise before anything runs).

def _check_x(fn: str, x) -> jax.Array:
    x = jnp.asarray(x)
    check_float(fn, "x", x)
    if x.ndim == 0:
        raise ValueError(f"jaxops.{fn}: x must have at least one dimension, got a scalar")
    return x


def _check_param(fn: str, name: str, p, x: jax.Array) -> jax.Array:
    p = jnp.asarray(p)
    check_float(fn, name, p)
    if p.shape != (x.shape[-1],):
        raise ValueError(f"jaxops.{fn}: {name} must have shape {(x.shape[-1],)} (x.shape[-1],), "
                         f"got {p.shape}")
    # Mixed precision (float32 parameters, bfloat16 activations): the kernels read parameters in
    # x's dtype, so cast here, as flax's LayerNorm(dtype=x.dtype) does; the cast's transpose
    # returns the gradient in the parameter's own dtype.
    return p if p.dtype == x.dtype else p.astype(x.dtype)


def _check_epsilon(fn: str, epsilon) -> float:
    if isinstance(epsilon, (bool, np.bool_)) or not isinstance(epsilon, (int, float, np.integer, np.floating)):
        raise ValueError(f"jaxops.{fn}: epsilon must be a non-negative Python float, got {epsilon!r}")
    eps = float(epsilon)
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"jaxops.{fn}: epsilon must be finite and >= 0, got {epsilon!r}")
    return eps


# ----------------------------------------------------------------------------------------------
# Pure-JAX formulas: used for empty arrays (nothing for a kernel to do) and as test references.

def _stats_dtype(dtype) -> jnp.dtype:
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _layer_norm_reference(x, scale, bias, epsilon):
    a = _stats_dtype(x.dtype)
    xf = x.astype(a)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + epsilon) * scale.astype(a) + bias.astype(a)
    return y.astype(x.dtype)


def _rms_norm_reference(x, scale, epsilon):
    a = _stats_dtype(x.dtype)
    xf = x.astype(a)
    ms = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    return (xf * jax.lax.rsqrt(ms + epsilon) * scale.astype(a)).astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# FFI calls. vmap_method="broadcast_all": under vmap every operand gets the batch dims in front,
# so scale becomes (batch..., cols) and the kernels pick scale row r // rows_per_group.

def _rows(x) -> int:
    return math.prod(x.shape[:-1])


def _stats_shape(x, dtype):
    return jax.ShapeDtypeStruct(x.shape[:-1], _stats_dtype(dtype))


def _workspace_shape(x, nacc: int):
    slots = _num_slots(_rows(x))
    return jax.ShapeDtypeStruct((slots, nacc, x.shape[-1]), _stats_dtype(x.dtype))


def _forward_call(fn, target, results, *args, epsilon):
    return ffi_call(fn, target, results, *args, epsilon=float(epsilon))


def _ln_forward_block(x, scale, bias, epsilon):
    return _forward_call("layer_norm", "jaxops_layer_norm_fwd",
                         (jax.ShapeDtypeStruct(x.shape, x.dtype), _stats_shape(x, x.dtype),
                          _stats_shape(x, x.dtype)),
                         x, scale, bias, epsilon=epsilon)


def _rms_forward_block(x, scale, epsilon):
    return _forward_call("rms_norm", "jaxops_rms_norm_fwd",
                         (jax.ShapeDtypeStruct(x.shape, x.dtype), _stats_shape(x, x.dtype)),
                         x, scale, epsilon=epsilon)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x, scale, bias, epsilon):
    return _ln_forward(x, scale, bias, epsilon)[0]


def _layer_norm_fwd(x, scale, bias, epsilon):
    y, mean, rstd = _ln_forward(x, scale, bias, epsilon)
    return y, (x, scale, mean, rstd)


def _layer_norm_bwd_block(epsilon, residuals, dy):
    x, scale, mean, rstd = residuals
    dx, dscale, dbias, _ = ffi_call(
        "layer_norm", "jaxops_layer_norm_bwd",
        (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(scale.shape, scale.dtype),
         jax.ShapeDtypeStruct(scale.shape, scale.dtype), _workspace_shape(x, 2)),
        x, scale, mean, rstd, dy.astype(x.dtype))
    return dx, dscale, dbias


# Across devices (jaxops._sharding): rows split, each row whole on one device; the parameter
# gradients, summed over rows, are summed over the devices holding rows too.

def _ln_forward(x, scale, bias, epsilon):
    return sharded_call("layer_norm", partial(_ln_forward_local, epsilon=epsilon),
                        rows_rule(x.ndim - 1, "xpp", "xss"), x, scale, bias)


def _ln_forward_local(x, scale, bias, *, axes, epsilon):
    del axes  # rows are independent
    return _ln_forward_block(x, scale, bias, epsilon)


def _layer_norm_bwd(epsilon, residuals, dy):
    x, scale, mean, rstd = residuals
    return sharded_call("layer_norm", partial(_ln_backward_local, epsilon=epsilon),
                        rows_rule(x.ndim - 1, "xpssx", "xpp"), x, scale, mean, rstd, dy)


def _ln_backward_local(x, scale, mean, rstd, dy, *, axes, epsilon):
    dx, dscale, dbias = _layer_norm_bwd_block(epsilon, (x, scale, mean, rstd), dy)
    dscale, dbias = _sum_over_devices((dscale, dbias), row_axes(axes))
    return dx, dscale, dbias


def _sum_over_devices(grads, names):
    """Parameter gradients of rows split across devices: each device summed its own rows."""
    if not names:
        return grads
    total = jax.lax.psum(tuple(g.astype(_stats_dtype(g.dtype)) for g in grads), names)
    return tuple(t.astype(g.dtype) for t, g in zip(total, grads))


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x, scale, epsilon):
    return _rms_forward(x, scale, epsilon)[0]


def _rms_norm_fwd(x, scale, epsilon):
    y, rstd = _rms_forward(x, scale, epsilon)
    return y, (x, scale, rstd)


def _rms_norm_bwd_block(epsilon, residuals, dy):
    x, scale, rstd = residuals
    dx, dscale, _ = ffi_call(
        "rms_norm", "jaxops_rms_norm_bwd",
        (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(scale.shape, scale.dtype),
         _workspace_shape(x, 1)),
        x, scale, rstd, dy.astype(x.dtype))
    return dx, dscale


def _rms_forward(x, scale, epsilon):
    return sharded_call("rms_norm", partial(_rms_forward_local, epsilon=epsilon),
                        rows_rule(x.ndim - 1, "xp", "xs"), x, scale)


def _rms_forward_local(x, scale, *, axes, epsilon):
    del axes
    return _rms_forward_block(x, scale, epsilon)


def _rms_norm_bwd(epsilon, residuals, dy):
    x, scale, rstd = residuals
    return sharded_call("rms_norm", partial(_rms_backward_local, epsilon=epsilon),
                        rows_rule(x.ndim - 1, "xpsx", "xp"), x, scale, rstd, dy)


def _rms_backward_local(x, scale, rstd, dy, *, axes, epsilon):
    dx, dscale = _rms_norm_bwd_block(epsilon, (x, scale, rstd), dy)
    (dscale,) = _sum_over_devices((dscale,), row_axes(axes))
    return dx, dscale


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)
