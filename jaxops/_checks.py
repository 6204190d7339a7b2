"""Argument checks shared by every public function: they raise before anything runs."""
from __future__ import annotations

from typing import Iterable

import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


def check_float(fn: str, name: str, x) -> None:
    """TypeError unless `x` has a supported floating dtype."""
    dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
    if dtype not in [np.dtype(d) for d in FLOAT_DTYPES]:
        raise TypeError(
            f"jaxops.{fn}: {name} must be float32, bfloat16, float16 or float64, got {dtype}"
        )


def canonical_axis(fn: str, axis, ndim: int) -> int:
    """A single axis in [0, ndim), or ValueError naming the function and value."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise ValueError(f"jaxops.{fn}: axis must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"jaxops.{fn}: axis {axis} is out of bounds for an array of rank {ndim}")
    return int(axis) % ndim


def canonical_axes(fn: str, axis, ndim: int) -> tuple[int, ...]:
    """Sorted, unique axes from None / int / tuple; ValueError on out-of-range or repeated axes."""
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, Iterable) and not isinstance(axis, (str, bytes)):
        axes = [canonical_axis(fn, a, ndim) for a in axis]
        if len(set(axes)) != len(axes):
            raise ValueError(f"jaxops.{fn}: repeated axis in {tuple(axis)!r}")
        return tuple(sorted(axes))
    return (canonical_axis(fn, axis, ndim),)


def move_axes_last(x, axes: tuple[int, ...]):
    """Transposes `axes` to the end; returns (array, permutation) so callers can undo it."""
    ndim = x.ndim
    perm = tuple(a for a in range(ndim) if a not in axes) + tuple(axes)
    if perm == tuple(range(ndim)):
        return x, None
    return jnp.transpose(x, perm), perm


def undo_move(y, perm):
    """Inverse of move_axes_last's permutation."""
    if perm is None:
        return y
    return jnp.transpose(y, tuple(np.argsort(perm)))
