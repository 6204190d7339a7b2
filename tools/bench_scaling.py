#!/usr/bin/env python3
"""Multi-GPU scaling of jaxops' sharded ops: throughput on N devices over one device.

Run on the two-GPU machine (nvidia-h200-x2) after installing jaxops:
    python tools/bench_scaling.py                      # all ops, 1 vs every GPU
    python tools/bench_scaling.py --ops knn --json scaling.json
The issue's target: throughput on two GPUs >= 1.8x one GPU for softmax, layer_norm,
batch_norm (SyncBatchNorm: statistics all-reduced) and knn with 2^21 references.

Strong scaling: the same global problem runs on one device and then sharded over all of
them (batch/rows/queries... as the op's rule wants: rows for softmax and layer_norm, the
batch for batch_norm, the references for knn); throughput ratio = t(1 device) / t(N devices).
Sizes are large enough that each device still gets >= 256 MB (beyond the 50 MB L2).
Times are medians of many back-to-back calls (jaxops.bench.timing.time_fn). Every row also
checks that the sharded result equals the single-device one and that the compiled HLO has
no all-gather of a large operand.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxops
from jaxops.bench.timing import time_fn


def _gathers(hlo: str) -> list[int]:
    sizes = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*(.*?)\s+all-gather(?:-start)?\(", line)
        if m:
            dims = re.findall(r"\w+\[([\d,]*)\]", m.group(1))
            sizes.append(max(math.prod(int(d) for d in ds.split(",") if d) for ds in dims))
    return sizes


def _cases(scale: float):
    """(name, fn, make_inputs(key), specs for the sharded run, bytes moved, small-gather limit)."""
    r = lambda n: max(int(n * scale) // 64 * 64, 64)  # noqa: E731  (--scale: smaller smoke run)
    rows, cols = r(2 ** 15), 8192  # 1 GiB f32 in: 512 MiB per GPU on two
    yield ("softmax", jaxops.softmax if hasattr(jaxops, "softmax") else None,
           lambda k: (jax.random.normal(k, (rows, cols), jnp.float32),),
           (P("d", None),), 2 * rows * cols * 4, 0)
    yield ("softmax_bf16", jaxops.softmax if hasattr(jaxops, "softmax") else None,
           lambda k: (jax.random.normal(k, (2 * rows, cols), jnp.bfloat16),),
           (P("d", None),), 2 * 2 * rows * cols * 2, 0)
    ln = getattr(jaxops, "layer_norm", None)
    yield ("layer_norm", None if ln is None else (lambda x, s, b: ln(x, s, b)),
           lambda k: (jax.random.normal(k, (rows, cols), jnp.float32),
                      1 + 0.1 * jax.random.normal(jax.random.fold_in(k, 1), (cols,)),
                      0.1 * jax.random.normal(jax.random.fold_in(k, 2), (cols,))),
           (P("d", None), P(), P()), 2 * rows * cols * 4 + 2 * cols * 4, 0)
    bn = getattr(jaxops, "batch_norm", None)
    n_img = r(512)  # NHWC (512, 56, 56, 64) f32: 411 MB in
    shape = (n_img, 56, 56, 64)
    yield ("batch_norm", None if bn is None else (lambda x, s, b: bn(x, s, b, activation="relu")),
           lambda k: (jax.random.normal(k, shape, jnp.float32),
                      1 + 0.1 * jax.random.normal(jax.random.fold_in(k, 1), (64,)),
                      0.1 * jax.random.normal(jax.random.fold_in(k, 2), (64,))),
           (P("d", None, None, None), P(), P()), 2 * math.prod(shape) * 4 + 4 * 64 * 4, 0)
    # Training step of SyncBatchNorm+ReLU: forward and backward (gradients of x, scale, bias).
    train = None if bn is None else jax.grad(
        lambda x, s, b: jnp.sum(bn(x, s, b, activation="relu")[0]), argnums=(0, 1, 2))
    yield ("batch_norm_fwd_bwd", train,
           lambda k: (jax.random.normal(k, shape, jnp.float32),
                      1 + 0.1 * jax.random.normal(jax.random.fold_in(k, 1), (64,)),
                      0.1 * jax.random.normal(jax.random.fold_in(k, 2), (64,))),
           (P("d", None, None, None), P(), P()), 5 * math.prod(shape) * 4, 0)
    knn = getattr(jaxops, "knn", None)
    m, n, d, k = r(4096), r(2 ** 21), 128, 32
    yield ("knn", None if knn is None else (lambda q, x: knn(q, x, k)),
           lambda key: (jax.random.normal(key, (m, d), jnp.float32),
                        jax.random.normal(jax.random.fold_in(key, 1), (n, d), jnp.float32)),
           (P(), P("d", None)), (m + n) * d * 4 + m * k * 8, 2 * m * k * len(jax.devices()) + 1)


def run(ops: set[str] | None, repeats: int, copies: int, scale: float) -> list[dict]:
    devices = jax.devices()
    if len(devices) < 2:
        sys.exit(f"bench_scaling: needs two or more devices, found {devices}")
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    rows = []
    for name, fn, make, specs, nbytes, max_gather in _cases(scale):
        if ops and name not in ops:
            continue
        if fn is None:
            print(f"{name}: not in this jaxops, skipped", file=sys.stderr)
            continue
        keys = jax.random.split(jax.random.key(hash(name) % 2 ** 31), copies)
        host = [tuple(np.asarray(a) for a in make(k)) for k in keys]
        one = [tuple(jax.device_put(a, devices[0]) for a in s) for s in host]
        many = [tuple(jax.device_put(a, NamedSharding(mesh, sp)) for a, sp in zip(s, specs))
                for s in host]
        t1 = time_fn(fn, one, repeats)
        y1 = jax.jit(fn)(*one[0])
        del one
        tn = time_fn(fn, many, repeats)
        compiled = jax.jit(fn).lower(*many[0]).compile()
        yn = compiled(*many[0])
        same = all(np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                               rtol=1e-3, atol=1e-3, equal_nan=True)
                   for a, b in zip(jax.tree.leaves(y1), jax.tree.leaves(yn)))
        big = [g for g in _gathers(compiled.as_text()) if g > max_gather]
        del many, y1, yn
        row = {"op": name, "devices": len(devices), "t1_us": t1 * 1e6, "tn_us": tn * 1e6,
               "speedup": t1 / tn, "tb_s_1": nbytes / t1 / 1e12, "tb_s_n": nbytes / tn / 1e12,
               "same_as_single": bool(same), "large_all_gathers": big,
               "meets_1.8x": t1 / tn >= 1.8 if len(devices) == 2 else None}
        rows.append(row)
        print(f"{name:<14} 1 dev {t1 * 1e6:10.1f} us   {len(devices)} dev {tn * 1e6:10.1f} us   "
              f"x{t1 / tn:5.2f}   same={same} gathers={big or 'none'}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", help="comma-separated: softmax,softmax_bf16,layer_norm,batch_norm,"
                                 "batch_norm_fwd_bwd,knn")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--copies", type=int, default=2, help="distinct input sets per timed dispatch")
    p.add_argument("--scale", type=float, default=1.0, help="shrink sizes (smoke test: 0.01)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    rows = run(set(args.ops.split(",")) if args.ops else None, args.repeats, args.copies, args.scale)
    device = str(jax.devices()[0].device_kind)
    print(f"\n| op | 1 x {device} (us) | {len(jax.devices())} x (us) | speed-up | "
          f"same result | large all-gathers |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['t1_us']:.1f} | {r['tn_us']:.1f} | {r['speedup']:.2f} | "
              f"{r['same_as_single']} | {r['large_all_gathers'] or 'none'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
                       "rows": rows}, f, indent=1)
    ok = all(r["same_as_single"] and not r["large_all_gathers"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
