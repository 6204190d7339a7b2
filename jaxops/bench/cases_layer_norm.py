"""Benchmark cases for layer_norm / rms_norm: forward, backward and forward+backward, against
jax.jit of the pure-JAX formula (and its jax.vjp), across row lengths.

``layer_norm_vmap`` / ``rms_norm_vmap`` (only when named in --ops; shapes GxRxC) time the
forward and backward of jax.vmap over G examples that each carry their own scale / bias (the
kernels' parameter groups), against the vmapped pure-JAX formula.

Byte counts are the minimal traffic of each op: forward reads x and writes y; backward reads x
and dy and writes dx (the issue's 3-pass bound); forward+backward reads x and dy and writes y
and dx. The parameters (and the per-row statistics, 8 bytes a row) are added where they are
inputs or outputs; they are a small fraction at these sizes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxops import _layer_norm as ln
from jaxops.bench.case import Case, Options, dtype_of, itemsize, wants

GPU_BYTES = 1 << 28  # x alone is 256 MB: far beyond the 50 MB L2
GPU_COLS = [256, 512, 1024, 2048, 4096, 8192, 16384, 65536]
CPU_ELEMENTS = 1 << 16
CPU_COLS = [128, 1024]


def _shapes(options: Options, dtype: str) -> list[tuple[int, int]]:
    if options.shapes:
        return [(s[0], s[1]) for s in options.shapes if len(s) == 2]
    total = GPU_BYTES // itemsize(dtype) if options.gpu else CPU_ELEMENTS
    return [(total // c, c) for c in (GPU_COLS if options.gpu else CPU_COLS)]


# 1024 columns: the short-row team forward and the 16-bit lean backward with parameter groups
# (added after session 41 measured the other three; not measured yet).
VMAP_GPU_SHAPES = [(8, 4096, 1024), (8, 128, 8192), (8, 16, 65536), (8, 4, 524288)]
VMAP_CPU_SHAPES = [(3, 5, 256)]


def _vmap_shapes(options: Options) -> list[tuple[int, int, int]]:
    if options.shapes:
        return [(s[0], s[1], s[2]) for s in options.shapes if len(s) == 3]
    return VMAP_GPU_SHAPES if options.gpu else VMAP_CPU_SHAPES


def _vmap_cases(options: Options, name: str, rms: bool) -> list[Case]:
    """Forward + backward of the op vmapped over per-example parameters."""
    op = name + "_vmap"
    if options.ops is None or op not in options.ops:
        return []
    out = []
    for dtype in options.dtypes:
        dt, size = dtype_of(dtype), itemsize(dtype)
        for shape in _vmap_shapes(options):
            groups, rows, cols = shape
            params = (1 if rms else 2) * groups * cols * size
            make = functools.partial(_random_inputs, shape=shape, param_shape=(groups, cols), dt=dt)
            out.append(Case(
                op=op, shape=shape, dtype=dtype, make_inputs=make,
                jaxops_fn=_vjp(jax.vmap(_ours(rms))), xla_fn=_vjp(jax.vmap(_xla(rms))),
                bytes=4 * groups * rows * cols * size + 3 * params, x=cols,
                note="vmap, per-example scale/bias: x,dy->y,dx,dparams"))
    return out


def _xla(rms: bool):
    if rms:
        return lambda x, scale, bias: ln._rms_norm_reference(x, scale, 1e-6)
    return lambda x, scale, bias: ln._layer_norm_reference(x, scale, bias, 1e-5)


def _ours(rms: bool):
    if rms:
        return lambda x, scale, bias: ln.rms_norm(x, scale)
    return lambda x, scale, bias: ln.layer_norm(x, scale, bias)


def _ours_backward(rms: bool):
    """The backward FFI call alone, from saved statistics (what a training step runs)."""
    def run(x, scale, bias, dy, mean, rstd):
        if rms:
            return ln._rms_norm_bwd(1e-6, (x, scale, rstd), dy)
        return ln._layer_norm_bwd(1e-5, (x, scale, mean, rstd), dy)

    return run


def _vjp(fn):
    def run(x, scale, bias, dy, *unused):
        y, pullback = jax.vjp(fn, x, scale, bias)
        return y, pullback(dy)

    return run


def _xla_backward(fn):
    def run(x, scale, bias, dy, *unused):
        return jax.vjp(fn, x, scale, bias)[1](dy)

    return run


def _random_inputs(key, shape, param_shape, dt):
    """x (offset, so the mean matters), scale, bias of `param_shape`, and the cotangent dy."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    x = (jax.random.normal(k1, shape, jnp.float32) * 2.0 + 0.5).astype(dt)
    scale = (1.0 + 0.1 * jax.random.normal(k2, param_shape, jnp.float32)).astype(dt)
    bias = (0.1 * jax.random.normal(k3, param_shape, jnp.float32)).astype(dt)
    dy = jax.random.normal(k4, shape, jnp.float32).astype(dt)
    return x, scale, bias, dy


def _inputs(shape, dt, rms: bool):
    def make(key):
        x, scale, bias, dy = _random_inputs(key, shape, shape[-1:], dt)
        if rms:
            _, rstd = ln._rms_forward(x, scale, 1e-6)
            mean = rstd
        else:
            _, mean, rstd = ln._ln_forward(x, scale, bias, 1e-5)
        return x, scale, bias, dy, mean, rstd

    return make


def cases(options: Options) -> list[Case]:
    out: list[Case] = []
    for name, rms in (("layer_norm", False), ("rms_norm", True)):
        nparams = 1 if rms else 2
        fn, ref = _ours(rms), _xla(rms)
        for dtype in options.dtypes:
            dt, size = dtype_of(dtype), itemsize(dtype)
            for rows, cols in _shapes(options, dtype):
                n = rows * cols
                params = nparams * cols * size
                make = _inputs((rows, cols), dt, rms)
                if wants(options, name):
                    out.append(Case(
                        op=name, shape=(rows, cols), dtype=dtype, make_inputs=make,
                        jaxops_fn=lambda x, s, b, *unused, fn=fn: fn(x, s, b),
                        xla_fn=lambda x, s, b, *unused, ref=ref: ref(x, s, b),
                        bytes=2 * n * size + params, x=cols, note="x->y"))
                if wants(options, name + "_bwd"):
                    out.append(Case(
                        op=name + "_bwd", shape=(rows, cols), dtype=dtype, make_inputs=make,
                        jaxops_fn=_ours_backward(rms), xla_fn=_xla_backward(ref),
                        bytes=3 * n * size + 2 * params, x=cols,
                        note="x,dy->dx,dparams (XLA recomputes the statistics)"))
                if wants(options, name + "_fwd_bwd"):
                    out.append(Case(
                        op=name + "_fwd_bwd", shape=(rows, cols), dtype=dtype, make_inputs=make,
                        jaxops_fn=_vjp(fn), xla_fn=_vjp(ref),
                        bytes=4 * n * size + 3 * params, x=cols, note="x,dy->y,dx,dparams"))
        out += _vmap_cases(options, name, rms)
    return out
