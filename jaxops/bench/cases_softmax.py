"""Benchmark cases for softmax / log_softmax, forward and backward, across row lengths; softmax
also masked (``where=``: an attention-style mask keeping 80 % of each row, read as one byte a flag)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxops import _softmax
from jaxops.bench.case import Case, Options, dtype_of, itemsize, wants

GPU_ELEMENTS = 1 << 26
GPU_COLS = [32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144]
CPU_ELEMENTS = 1 << 16
CPU_COLS = [16, 32, 1024, 8192]  # 16: the short rows' per-row cost (session 75)


def _xla_backward(log: bool):
    def run(y, dy):
        y32, g32 = y.astype(jnp.float32), dy.astype(jnp.float32)
        if log:
            dx = g32 - jnp.exp(y32) * jnp.sum(g32, axis=-1, keepdims=True)
        else:
            dx = y32 * (g32 - jnp.sum(y32 * g32, axis=-1, keepdims=True))
        return dx.astype(y.dtype)

    return run


def _xla_masked_backward(y, dy, mask):
    """jax.nn.softmax's gradient with ``where``: masked entries take no part and get none."""
    return jnp.where(mask, _xla_backward(False)(y, jnp.where(mask, dy, 0)), 0)


def _masked_cases(options: Options, dtype: str, rows: int, cols: int) -> list[Case]:
    dt, n = dtype_of(dtype), rows * cols

    def inputs(k, s=(rows, cols)):
        k1, k2 = jax.random.split(k)
        return jax.random.normal(k1, s, jnp.float32).astype(dt), jax.random.bernoulli(k2, 0.8, s)

    def backward_inputs(k, s=(rows, cols)):
        k1, k2 = jax.random.split(k)
        x, mask = inputs(k1)
        return jax.nn.softmax(x, where=mask), jax.random.normal(k2, s, jnp.float32).astype(dt), mask

    out = []
    if wants(options, "softmax_masked"):
        out.append(Case(op="softmax_masked", shape=(rows, cols), dtype=dtype, make_inputs=inputs,
                        jaxops_fn=lambda x, m: _softmax.softmax(x, where=m),
                        xla_fn=lambda x, m: jax.nn.softmax(x, where=m),
                        bytes=2 * n * itemsize(dtype) + n, x=cols, note="x,mask->y"))
    if wants(options, "softmax_masked_bwd"):
        out.append(Case(op="softmax_masked_bwd", shape=(rows, cols), dtype=dtype, make_inputs=backward_inputs,
                        jaxops_fn=lambda y, dy, m: _softmax._backward_call(y, dy, m, False),
                        xla_fn=_xla_masked_backward, bytes=3 * n * itemsize(dtype) + n, x=cols,
                        note="y,dy,mask->dx"))
    return out


def _shapes(options: Options) -> list[tuple[int, int]]:
    if options.shapes:
        return [(s[0], s[1]) for s in options.shapes if len(s) == 2]
    total, cols = (GPU_ELEMENTS, GPU_COLS) if options.gpu else (CPU_ELEMENTS, CPU_COLS)
    return [(total // c, c) for c in cols]


def cases(options: Options) -> list[Case]:
    out: list[Case] = []
    for name, log in (("softmax", False), ("log_softmax", True)):
        ours = _softmax.log_softmax if log else _softmax.softmax
        xla = jax.nn.log_softmax if log else jax.nn.softmax
        for dtype in options.dtypes:
            dt = dtype_of(dtype)
            for rows, cols in _shapes(options):
                n = rows * cols
                if wants(options, name):
                    out.append(Case(
                        op=name, shape=(rows, cols), dtype=dtype,
                        make_inputs=lambda k, s=(rows, cols), dt=dt: (jax.random.normal(k, s, jnp.float32).astype(dt),),
                        jaxops_fn=ours, xla_fn=xla, bytes=2 * n * itemsize(dtype), x=cols))
                if wants(options, name + "_bwd"):
                    def make(k, s=(rows, cols), dt=dt, xla=xla):
                        k1, k2 = jax.random.split(k)
                        y = xla(jax.random.normal(k1, s, jnp.float32)).astype(dt)
                        return y, jax.random.normal(k2, s, jnp.float32).astype(dt)

                    out.append(Case(
                        op=name + "_bwd", shape=(rows, cols), dtype=dtype, make_inputs=make,
                        jaxops_fn=lambda y, dy, log=log: _softmax._backward_call(y, dy, None, log),
                        xla_fn=_xla_backward(log), bytes=3 * n * itemsize(dtype), x=cols,
                        note="y,dy->dx"))
    for dtype in options.dtypes:
        for rows, cols in _shapes(options):
            out += _masked_cases(options, dtype, rows, cols)
    return out
