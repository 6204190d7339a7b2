"""Benchmark cases of the reduction family: each op against jnp / jax.nn under jit.

Row reductions (last axis, rows of 1024 ... 2^20 elements, 8192 among them, and the full
reduction) and column reductions (leading axis of (R, C) for C = 64, 256, 4096) on 2^26
elements, as in the issue.
Minimal bytes: the input read once plus the output written once. Ops are named "<op>" for row
and full reductions (x = row length) and "<op>_cols" for column reductions (x = C).
With --shapes, "<op>" reduces each shape's last axis and "<op>_cols", when named in --ops, its
leading axis.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxops.bench.case import Case, Options, dtype_of, itemsize, wants

OPS = ("sum", "mean", "max", "min", "logsumexp", "argmax", "argmin")
TIMED_OPS = ("sum", "max", "logsumexp", "argmax")  # mean/min share kernels with sum/max


def _reference(op: str):
    return jax.nn.logsumexp if op == "logsumexp" else getattr(jnp, op)


def _case(op: str, name: str, shape: tuple[int, ...], axis, dtype: str, x: float, note: str) -> Case:
    import jaxops

    n_out = int(np.prod([d for i, d in enumerate(shape) if axis is not None and i != axis % len(shape)]))
    out_itemsize = 4 if op.startswith("arg") else itemsize(dtype)
    ours = getattr(jaxops, op)
    ref = _reference(op)
    return Case(
        op=name, shape=shape, dtype=dtype,
        make_inputs=lambda key: (jax.random.normal(key, shape, jnp.float32).astype(dtype_of(dtype)),),
        jaxops_fn=partial(ours, axis=axis),
        xla_fn=partial(ref, axis=axis),
        bytes=int(np.prod(shape)) * itemsize(dtype) + max(n_out, 1) * out_itemsize,
        x=float(x), note=note)


def cases(options: Options) -> list[Case]:
    total = 1 << 26 if options.gpu else 1 << 16
    # The CPU's short rows (16, 64) are where its per-row costs show (session 75: max of 16-element
    # rows had run at 0.1x XLA with nothing in the default table to say so).
    row_lengths = [1024, 4096, 8192, 16384, 65536, 1 << 20] if options.gpu else [16, 64, 1024, 4096]
    col_widths = [64, 256, 4096]
    out: list[Case] = []
    for dtype in options.dtypes:
        for op in OPS:
            if options.ops is None and op not in TIMED_OPS:
                continue
            if options.shapes:  # user shapes: rows reduce the last axis, named "_cols" ops the first
                if wants(options, op):
                    out += [_case(op, op, s, -1, dtype, s[-1], "rows") for s in options.shapes]
                if options.ops is not None and op + "_cols" in options.ops:
                    out += [_case(op, op + "_cols", s, 0, dtype, s[-1], "columns")
                            for s in options.shapes if len(s) > 1]
                continue
            if wants(options, op):
                out += [_case(op, op, (total // r, r), 1, dtype, r, "rows") for r in row_lengths]
                out.append(_case(op, op, (total,), None, dtype, total, "full"))
            if wants(options, op + "_cols"):
                out += [_case(op, op + "_cols", (total // c, c), 0, dtype, c, "columns") for c in col_widths]
    return out
