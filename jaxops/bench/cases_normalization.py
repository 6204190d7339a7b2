"""Benchmark cases of the relu / batch_norm family.

Byte bounds (the `bytes` of each case; fraction of copy = bytes / time / copy bandwidth):
- relu fwd: read x, write y, write the mask (n/8 bytes).
- relu bwd: read dy and the mask, write dx.
- batch_norm fwd (3-pass bound): read x twice (statistics, then normalize), write y, plus the
  residual read and the mask write when fused.
- batch_norm bwd (2 passes): read dy, x and the mask twice (sums, then dx), write dx (and
  dresidual when fused).
The XLA reference is the same math in pure JAX (jax.nn.relu; mean/var/normalize/add/relu).
Backward cases time only the backward: the vjp function (its saved residuals) is built once.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxops.bench.case import Case, Options, dtype_of, itemsize, wants

GPU_BN_SHAPES = [(16, 112, 112, 32), (256, 56, 56, 64), (128, 28, 28, 256)]
CPU_BN_SHAPES = [(4, 28, 28, 32), (2, 14, 14, 64)]
GPU_RELU_SHAPES = [(64 * 1024 * 1024,), (16 * 1024 * 1024 + 17,)]
CPU_RELU_SHAPES = [(1 << 20,)]


def _xla_bn(x, scale, bias, residual=None, activation=None, epsilon=1e-5):
    axes = tuple(range(x.ndim - 1))
    xs = x.astype(jnp.float32)
    mean = jnp.mean(xs, axes)
    var = jnp.mean(jnp.square(xs - mean), axes)
    z = (xs - mean) * jax.lax.rsqrt(var + epsilon) * scale + bias
    if residual is not None:
        z = z + residual.astype(jnp.float32)
    if activation == "relu":
        z = jax.nn.relu(z)
    return z.astype(x.dtype), mean, var


def _saved_bytes(vjp_fn) -> int:
    return int(sum(l.nbytes for l in jax.tree_util.tree_leaves(vjp_fn) if hasattr(l, "nbytes")))


def _relu_cases(options: Options) -> list[Case]:
    import jaxops

    out = []
    shapes = options.shapes or (GPU_RELU_SHAPES if options.gpu else CPU_RELU_SHAPES)
    for dname in options.dtypes:
        dt = dtype_of(dname)
        for shape in shapes:
            n = int(np.prod(shape))
            nbytes = n * itemsize(dname)
            mask_bytes = -(-n // 32) * 4
            make_x = lambda k, shape=shape, dt=dt: (jax.random.normal(k, shape, jnp.float32).astype(dt),)
            if wants(options, "relu"):
                out.append(Case("relu", shape, dname, make_x, lambda x: jaxops.relu(x), jax.nn.relu,
                                2 * nbytes + mask_bytes, note="fwd: x -> y + bit mask"))
            if wants(options, "relu_bwd"):
                def make_bwd(k, shape=shape, dt=dt):
                    kx, kd = jax.random.split(k)
                    x = jax.random.normal(kx, shape, jnp.float32).astype(dt)
                    dy = jax.random.normal(kd, shape, jnp.float32).astype(dt)
                    return jax.vjp(jaxops.relu, x)[1], jax.vjp(jax.nn.relu, x)[1], dy

                out.append(Case("relu_bwd", shape, dname, make_bwd, lambda f, g, dy: f(dy),
                                lambda f, g, dy: g(dy), 2 * nbytes + mask_bytes,
                                note="dy + mask -> dx (XLA: from its own residuals)"))
    return out


def _bn_cases(options: Options) -> list[Case]:
    import jaxops

    out = []
    shapes = options.shapes or (GPU_BN_SHAPES if options.gpu else CPU_BN_SHAPES)
    for dname in options.dtypes:
        dt = dtype_of(dname)
        for shape in shapes:
            n = int(np.prod(shape))
            c = shape[-1]
            nbytes = n * itemsize(dname)
            mask_bytes = -(-n // 32) * 4
            for fused_add in (False, True):
                op = "bn_add_relu" if fused_add else "bn_relu"

                def make(k, shape=shape, dt=dt, c=c, fused_add=fused_add):
                    ks = jax.random.split(k, 4)
                    x = (2 * jax.random.normal(ks[0], shape, jnp.float32) + 0.5).astype(dt)
                    s = 1 + jax.random.normal(ks[1], (c,), jnp.float32)
                    b = jax.random.normal(ks[2], (c,), jnp.float32)
                    r = jax.random.normal(ks[3], shape, jnp.float32).astype(dt) if fused_add else None
                    return x, s, b, r

                def ours(x, s, b, r):
                    return jaxops.batch_norm(x, s, b, residual=r, activation="relu")

                def xla(x, s, b, r):
                    return _xla_bn(x, s, b, residual=r, activation="relu")

                res_bytes = nbytes if fused_add else 0
                if wants(options, op):
                    out.append(Case(op, shape, dname, make, ours, xla,
                                    3 * nbytes + res_bytes + mask_bytes,
                                    note="fwd, 3-pass bound: 2 reads of x + y (+residual, mask)"))
                if wants(options, op + "_bwd"):
                    def make_bwd(k, make=make, ours=ours, xla=xla, shape=shape, dt=dt):
                        x, s, b, r = make(k)
                        dy = jax.random.normal(jax.random.fold_in(k, 9), shape, jnp.float32).astype(dt)
                        f_ours = jax.vjp(lambda *a: ours(*a)[0], x, s, b, r)[1]
                        f_xla = jax.vjp(lambda *a: xla(*a)[0], x, s, b, r)[1]
                        return f_ours, f_xla, dy

                    k0 = jax.random.key(0)
                    sample = make_bwd(k0) if options.gpu or n <= 1 << 22 else None
                    extra = {}
                    if sample is not None:
                        extra = {"saved_bytes_jaxops": _saved_bytes(sample[0]),
                                 "saved_bytes_xla": _saved_bytes(sample[1]), "input_bytes": nbytes}
                        note = (f"bwd, 2-pass bound; saved {extra['saved_bytes_jaxops'] / 1e6:.1f} MB vs XLA "
                                f"{extra['saved_bytes_xla'] / 1e6:.1f} MB (x {nbytes / 1e6:.1f} MB)")
                        del sample
                    else:
                        note = "bwd, 2-pass bound"
                    out.append(Case(op + "_bwd", shape, dname, make_bwd, lambda f, g, dy: f(dy),
                                    lambda f, g, dy: g(dy), 2 * (2 * nbytes + mask_bytes) + nbytes + res_bytes,
                                    note=note, extra=extra))
    return out


def cases(options: Options) -> list[Case]:
    return _relu_cases(options) + _bn_cases(options)
