"""One small input recipe and a pure-JAX reference per public jaxops op.

Shared by tools/smoke_test.py (the installed-wheel smoke test) and tests/test_cuda_graphs.py.
Sizes: "small" runs in well under a second per op on a CPU; "gpu" reaches the multi-warp,
multi-block and split paths of the CUDA kernels (a few MB per op) while staying quick.
Recipes name ops that may not exist yet; callers skip those, and report public ops that have
no recipe here (every public op must get one).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

NOT_OPS = {"build_info", "has_cuda"}  # public names of jaxops that are not ops


@dataclass
class Case:
    label: str
    args: tuple
    kwargs: dict = field(default_factory=dict)


@dataclass
class Recipe:
    cases: Callable[[jax.Array, str], list[Case]]  # (key, size) -> cases
    reference: Callable[..., Any]
    diff_argnums: tuple[int, ...] = ()  # positional float args to differentiate; () = not diff
    rtol: float = 2e-3  # against the reference, for float32 data (bfloat16 cases get 5e-2)
    atol: float = 2e-3
    check: Callable[[Any, Any, Case], None] | None = None  # custom comparison, else allclose


def _normal(key, shape, dtype=jnp.float32):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _keys(key, n):
    return list(jax.random.split(key, n))


# ----------------------------------------------------------------------------- softmax family


def _rows_cases(key, size, small, gpu, axes=(-1,)):
    shapes = small if size == "small" else gpu
    cases = []
    for i, (shape, dtype) in enumerate(shapes):
        for axis in axes:
            k = jax.random.fold_in(key, i)
            cases.append(Case(f"{jnp.dtype(dtype).name}{list(shape)} axis={axis}",
                              (_normal(k, shape, dtype),), {"axis": axis}))
    return cases


_SOFTMAX_SMALL = [((3, 37), jnp.float32), ((2, 5, 300), jnp.bfloat16)]
# warp-per-row, block-per-row, and a row too long for one block's shared memory
_SOFTMAX_GPU = [((512, 100), jnp.float32), ((64, 4096), jnp.bfloat16), ((16, 40000), jnp.float32),
                ((2, 300_000), jnp.float32)]


def _softmax_cases(key, size):
    return _rows_cases(key, size, _SOFTMAX_SMALL, _SOFTMAX_GPU)


# ----------------------------------------------------------------------------- normalization


def _relu_cases(key, size):
    shapes = [((7, 33), jnp.float32), ((300,), jnp.bfloat16)] if size == "small" else \
        [((1000, 1031), jnp.float32), ((4096, 257), jnp.bfloat16)]
    return [Case(f"{jnp.dtype(d).name}{list(s)}", (_normal(jax.random.fold_in(key, i), s, d),))
            for i, (s, d) in enumerate(shapes)]


def _bn_inputs(key, shape, dtype):
    kx, ks, kb, kr = _keys(key, 4)
    c = shape[-1]
    x = 3.0 + 2.0 * _normal(kx, shape, jnp.float32)  # a mean far from 0 exercises stable stats
    return (x.astype(dtype), 1.0 + 0.1 * _normal(ks, (c,)), 0.1 * _normal(kb, (c,)),
            _normal(kr, shape, dtype))


def _bn_shapes(size):
    return [((4, 5, 5, 8), jnp.float32), ((6, 3, 3, 16), jnp.bfloat16)] if size == "small" else \
        [((8, 14, 14, 64), jnp.float32), ((64, 28, 28, 32), jnp.bfloat16), ((2, 3, 3, 1000), jnp.float32)]


def _batch_norm_cases(key, size):
    cases = []
    for i, (shape, dtype) in enumerate(_bn_shapes(size)):
        x, scale, bias, res = _bn_inputs(jax.random.fold_in(key, i), shape, dtype)
        name = f"{jnp.dtype(dtype).name}{list(shape)}"
        cases.append(Case(name, (x, scale, bias)))
        cases.append(Case(name + " +res+relu", (x, scale, bias), {"residual": res, "activation": "relu"}))
    return cases


def _stats(x, axis=-1):
    axes = tuple(a for a in range(x.ndim) if a != axis % x.ndim)
    xf = x.astype(jnp.float32)
    return xf.mean(axes), xf.var(axes)


def _host_stats(x, axis=-1):
    # Given statistics for batch_norm_inference, computed on the host: XLA's GPU reductions can
    # differ in the last bits from process to process, and test_cuda_graphs compares two processes
    # bit for bit (seen: batch_norm_inference's scale gradient).
    axes = tuple(a for a in range(x.ndim) if a != axis % x.ndim)
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    return jnp.asarray(xf.mean(axes), jnp.float32), jnp.asarray(xf.var(axes), jnp.float32)


def _bn_apply(x, scale, bias, mean, var, axis=-1, epsilon=1e-5, residual=None, activation=None):
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    xf = x.astype(jnp.float32)
    y = (xf - mean.reshape(shape)) * jax.lax.rsqrt(var.reshape(shape) + epsilon)
    y = y * scale.reshape(shape) + bias.reshape(shape)
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    if activation == "relu":
        y = jax.nn.relu(y)
    return y.astype(x.dtype)


def _batch_norm_ref(x, scale, bias, axis=-1, epsilon=1e-5, residual=None, activation=None):
    mean, var = _stats(x, axis)
    return _bn_apply(x, scale, bias, mean, var, axis, epsilon, residual, activation), mean, var


def _batch_norm_inference_cases(key, size):
    cases = []
    for i, (shape, dtype) in enumerate(_bn_shapes(size)):
        x, scale, bias, res = _bn_inputs(jax.random.fold_in(key, i), shape, dtype)
        mean, var = _host_stats(x)
        mean, var = mean + 0.01, var * 1.1  # given statistics, not the batch's
        name = f"{jnp.dtype(dtype).name}{list(shape)}"
        cases.append(Case(name, (x, scale, bias, mean, var)))
        cases.append(Case(name + " +res+relu", (x, scale, bias, mean, var),
                          {"residual": res, "activation": "relu"}))
    return cases


def _norm_cases(key, size, with_bias):
    shapes = [((5, 48), jnp.float32), ((3, 7, 130), jnp.bfloat16)] if size == "small" else \
        [((2048, 1024), jnp.float32), ((512, 4096), jnp.bfloat16), ((8, 65536), jnp.float32),
         ((37, 2056), jnp.bfloat16), ((3, 262152), jnp.float32),  # pair-row / long-row backward
         # rows that are not whole 16-byte packs (each row starts at a different alignment): the
         # skewed forwards and backward_block_skew (whose racecheck report session 57 fixed), and
         # the 16-bit lean team at 257-512 columns
         ((301, 1001), jnp.float32), ((65, 2047), jnp.bfloat16), ((129, 300), jnp.float16)]
    cases = []
    for i, (shape, dtype) in enumerate(shapes):
        kx, ks, kb = _keys(jax.random.fold_in(key, i), 3)
        c = shape[-1]
        args = (_normal(kx, shape, dtype), (1.0 + 0.1 * _normal(ks, (c,))).astype(dtype))
        if with_bias:
            args += ((0.1 * _normal(kb, (c,))).astype(dtype),)
        cases.append(Case(f"{jnp.dtype(dtype).name}{list(shape)}", args))
    return cases


def _layer_norm_ref(x, scale, bias, epsilon=1e-5):
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = ((xf - mean) ** 2).mean(-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + epsilon) * scale + bias).astype(x.dtype)


def _rms_norm_ref(x, scale, epsilon=1e-6):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + epsilon) * scale).astype(x.dtype)


# ----------------------------------------------------------------------------- reductions


def _reduce_cases(key, size, axes=((0, 2), None, -1, 0)):
    # (shape, dtype, how many of `axes`): contiguous, strided and mixed reductions
    shapes = [((6, 5, 9), jnp.float32, 4), ((4, 3, 70), jnp.bfloat16, 1)] if size == "small" else \
        [((64, 33, 1000), jnp.float32, 4), ((8, 16, 70000), jnp.bfloat16, 4), ((3000, 3, 41), jnp.float32, 4)]
    cases = []
    for i, (shape, dtype, n_axes) in enumerate(shapes):
        x = _normal(jax.random.fold_in(key, i), shape, dtype)
        for axis in axes[:n_axes]:
            cases.append(Case(f"{jnp.dtype(dtype).name}{list(shape)} axis={axis}", (x,), {"axis": axis}))
    cases[-1].kwargs["keepdims"] = True
    return cases


def _arg_cases(key, size):
    cases = _reduce_cases(key, size, axes=(-1, None, 0))
    if size != "small":  # 4096-long rows (blocks of 64); rows whose threads get >= 16 packs (the ring)
        for i, shape in enumerate([(16, 4096), (600, 32768)]):
            x = _normal(jax.random.fold_in(key, 100 + i), shape, jnp.bfloat16)
            cases.append(Case(f"bfloat16{list(shape)} axis=-1", (x,), {"axis": -1}))
    return cases


# ----------------------------------------------------------------------------- knn


def _knn_shapes(size):
    # (m, n, d, k): few queries (reference-split path); many queries past the GPU's TF32 filter
    # threshold (m*n*d >= 2^30) in a tile of odd width (the selection's element loads), with 5x
    # fewer distances than 2000x5000 had (the sanitizer's time); a large k
    return [(5, 40, 3, 4), (17, 100, 16, 10)] if size == "small" else \
        [(8, 20000, 64, 16), (1024, 2049, 512, 25), (300, 4000, 32, 300)]


def _knn_cases(key, size):
    cases = []
    for i, (m, n, d, k) in enumerate(_knn_shapes(size)):
        kq, kr = _keys(jax.random.fold_in(key, i), 2)
        cases.append(Case(f"m={m} n={n} d={d} k={k}", (_normal(kq, (m, d)), _normal(kr, (n, d)), k)))
    return cases


def _knn_ref(q, r, k):
    q64, r64 = np.asarray(q, np.float64), np.asarray(r, np.float64)
    d = (q64 * q64).sum(1)[:, None] + (r64 * r64).sum(1)[None, :] - 2 * q64 @ r64.T
    idx = np.argsort(d, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(d, idx, 1).astype(np.float32), idx.astype(np.int32)


def _knn_check(out, ref, case):
    dist, idx = (np.asarray(o) for o in out)
    ref_dist, _ = ref
    q, r, _k = case.args
    scale = 1e-4 * (1 + np.abs(ref_dist).max())
    np.testing.assert_allclose(dist, ref_dist, rtol=1e-4, atol=scale)
    # the returned indices must be neighbours at the returned distances (near-ties may swap)
    q64, r64 = np.asarray(q, np.float64), np.asarray(r, np.float64)
    recomputed = ((q64[:, None, :] - r64[idx]) ** 2).sum(-1)
    np.testing.assert_allclose(recomputed, dist, rtol=1e-4, atol=scale)


def _knn_classify_cases(key, size):
    cases = []
    for i, (m, n, d, k) in enumerate(_knn_shapes(size)):
        kq, kr, kl = _keys(jax.random.fold_in(key, i), 3)
        labels = jax.random.randint(kl, (n,), 0, 7)
        cases.append(Case(f"m={m} n={n} d={d} k={k}",
                          (_normal(kq, (m, d)), _normal(kr, (n, d)), labels, k, 7)))
    return cases


def _knn_classify_ref(q, r, labels, k, num_classes):
    _, idx = _knn_ref(q, r, k)
    votes = np.zeros((idx.shape[0], num_classes), np.int64)
    np.add.at(votes, (np.arange(idx.shape[0])[:, None], np.asarray(labels)[idx]), 1)
    return votes.argmax(1).astype(np.int32)  # argmax: first (smallest) label on ties


def _knn_classify_check(out, ref, case):
    agree = float(np.mean(np.asarray(out) == np.asarray(ref)))
    assert agree >= 0.97, f"only {agree:.1%} of the predictions match the brute-force vote"


# ----------------------------------------------------------------------------- the table

RECIPES: dict[str, Recipe] = {
    "softmax": Recipe(_softmax_cases, jax.nn.softmax, (0,)),
    "log_softmax": Recipe(_softmax_cases, jax.nn.log_softmax, (0,)),
    "relu": Recipe(_relu_cases, jax.nn.relu, (0,)),
    "batch_norm": Recipe(_batch_norm_cases, _batch_norm_ref, (0, 1, 2), rtol=5e-3, atol=5e-3),
    "batch_norm_inference": Recipe(_batch_norm_inference_cases, _bn_apply, (0, 1, 2, 3, 4)),
    "layer_norm": Recipe(lambda k, s: _norm_cases(k, s, True), _layer_norm_ref, (0, 1, 2)),
    "rms_norm": Recipe(lambda k, s: _norm_cases(k, s, False), _rms_norm_ref, (0, 1)),
    "sum": Recipe(_reduce_cases, jnp.sum, (0,)),
    "mean": Recipe(_reduce_cases, jnp.mean, (0,)),
    "max": Recipe(_reduce_cases, jnp.max, (0,)),
    "min": Recipe(_reduce_cases, jnp.min, (0,)),
    "logsumexp": Recipe(_reduce_cases, jax.nn.logsumexp, (0,)),
    "argmax": Recipe(_arg_cases, jnp.argmax),
    "argmin": Recipe(_arg_cases, jnp.argmin),
    "knn": Recipe(_knn_cases, _knn_ref, check=_knn_check),
    "knn_classify": Recipe(_knn_classify_cases, _knn_classify_ref, check=_knn_classify_check),
}


def public_ops(module) -> list[str]:
    """The op names jaxops exports (``__all__`` minus the helpers that are not ops)."""
    return [name for name in module.__all__ if name not in NOT_OPS]
