#!/usr/bin/env python3
"""Multi-GPU scaling of jaxops' sharded ops: throughput on N devices over one device.

Run on the two-GPU machine (nvidia-h200-x2) after installing jaxops, from outside the tree:
    python3 tools/bench_scaling.py --json scaling.json      # all ops, 1 GPU vs every GPU
    python3 tools/bench_scaling.py --ops knn
CPU dry run (2 virtual devices, small sizes):
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tools/bench_scaling.py --scale 0.01 --repeats 3
The issue's target: throughput on two GPUs >= 1.8x one GPU for softmax, layer_norm,
batch_norm (SyncBatchNorm: statistics all-reduced) and knn with 2^21 references.

Strong scaling: the same global problem runs on one device and then sharded over all of
them (rows for softmax and layer_norm, the batch for batch_norm, the references for knn);
throughput ratio = t(1 device) / t(N devices). At full scale every input is >= 800 MB
(>= 400 MB a device on two: far beyond the 50-60 MB L2). Each timed dispatch carries
`copies * inner` calls behind optimization barriers (jaxops.bench.timing), `inner` chosen
so one dispatch is ~30 ms of work on one GPU: launch and cross-device synchronisation costs
stay small next to the work. The timed programs themselves are checked: the sharded result
equals the single-device one, and the compiled sharded HLO has no all-gather of a large
operand. Each case runs in its own try/except; the JSON is rewritten after every case.

Full-scale budget on an H200 (~4 TB/s, ~50 TFLOP/s float32): the memory-bound cases take
< 1 ms a call, knn (4096 x 2^21 x 128, k=32) ~75 ms; the whole run is dominated by XLA
compilation (2 programs a case) and takes ~1-2 minutes. Device memory per case: < 25 GB.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import time
import traceback
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxops
from jaxops.bench.hlo import gather_sizes
from jaxops.bench.timing import _batched, dispatch_median

HBM_BYTES_PER_S = 4e12  # H200 achievable copy bandwidth, for the size/time plan only
F32_FLOPS = 50e12  # float32 (non-tensor-core) GEMM
DISPATCH_WORK_S = 0.030  # ~30 ms of one-GPU work a dispatch: with 2 GPUs a dispatch costs ~0.5 ms more (run 3)
MAX_INNER = 24
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


@dataclasses.dataclass
class Case:
    name: str
    fn: Callable[..., Any] | None
    make: Callable[[jax.Array], tuple[jax.Array, ...]]  # PRNG key -> inputs (on device 0)
    specs: tuple[P, ...]  # how the sharded run splits each input over mesh axis "d"
    shape: str
    dtype: str
    nbytes: int  # minimal bytes moved by one call (the memory-bound estimate)
    flops: float = 0.0  # for compute-bound cases (knn)
    max_gather: int = 0  # largest all-gather (elements) the sharded program may contain
    index_mismatch: float = 0.0  # fraction of integer outputs allowed to differ (near ties)
    # fraction of float outputs allowed beyond tolerance: relu's mask flips for the few elements
    # whose pre-activation is within rounding of 0 once statistics are summed in another order
    float_mismatch: float = 0.0

    def est_seconds(self) -> float:
        return max(self.nbytes / HBM_BYTES_PER_S, self.flops / F32_FLOPS)


def _normal(key, shape, dtype=jnp.float32):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _params(key, c):
    return (1 + 0.1 * _normal(jax.random.fold_in(key, 1), (c,)),
            0.1 * _normal(jax.random.fold_in(key, 2), (c,)))


def cases(scale: float, n_dev: int) -> list[Case]:
    """The benchmark problems; `scale` < 1 shrinks every size (CPU smoke run)."""
    def r(n, mult=64):
        return max(int(n * scale) // mult * mult, mult)

    rows, cols = r(2 ** 15), 8192  # (32768, 8192) float32: 1 GiB in
    out: list[Case] = []
    sm, ln, bn, knn = (getattr(jaxops, n, None) for n in ("softmax", "layer_norm", "batch_norm", "knn"))
    out.append(Case("softmax", sm, lambda k: (_normal(k, (rows, cols)),), (P("d", None),),
                    f"{rows}x{cols}", "float32", 2 * rows * cols * 4))
    out.append(Case("softmax_bf16", sm, lambda k: (_normal(k, (2 * rows, cols), jnp.bfloat16),),
                    (P("d", None),), f"{2 * rows}x{cols}", "bfloat16", 2 * 2 * rows * cols * 2))
    out.append(Case("layer_norm", ln, lambda k: (_normal(k, (rows, cols)), *_params(k, cols)),
                    (P("d", None), P(), P()), f"{rows}x{cols}", "float32",
                    2 * rows * cols * 4 + 2 * cols * 4))
    # NHWC (1024, 56, 56, 64) float32: 822 MB in. SyncBatchNorm + ReLU (training forward).
    shape = (r(1024, 8), 56, 56, 64)
    size = math.prod(shape)
    bn_fwd = None if bn is None else (lambda x, s, b: bn(x, s, b, activation="relu"))
    out.append(Case("batch_norm", bn_fwd, lambda k: (_normal(k, shape), *_params(k, 64)),
                    (P("d", None, None, None), P(), P()), "x".join(map(str, shape)), "float32",
                    2 * size * 4 + 4 * 64 * 4, max_gather=n_dev * 2 * 64))
    # Training step: forward and backward (gradients of x, scale and bias).
    train = None if bn is None else jax.grad(
        lambda x, s, b: jnp.sum(bn(x, s, b, activation="relu")[0]), argnums=(0, 1, 2))
    out.append(Case("batch_norm_fwd_bwd", train, lambda k: (_normal(k, shape), *_params(k, 64)),
                    (P("d", None, None, None), P(), P()), "x".join(map(str, shape)), "float32",
                    5 * size * 4, max_gather=n_dev * 2 * 64, float_mismatch=1e-6))
    # Exact knn, references split: 4096 x 2^21 x 128 is 2.2 TFLOP (~75 ms on one GPU).
    m, n, d, k = r(4096), r(2 ** 21), 128, 32
    out.append(Case("knn", None if knn is None else (lambda q, x: knn(q, x, k)),
                    lambda key: (_normal(key, (m, d)), _normal(jax.random.fold_in(key, 1), (n, d))),
                    (P(), P("d", None)), f"{m}x{n}x{d} k={k}", "float32",
                    (m + n) * d * 4 + m * k * 8, flops=2.0 * m * n * d,
                    max_gather=m * k * n_dev, index_mismatch=1e-3))
    return out


def _first_shard(a, spec, n_dev: int):
    """Device 0's block of `a` under `spec` (only the mesh axis "d" splits anything here)."""
    for axis, name in enumerate(tuple(spec)):
        if name == "d":
            return jax.lax.slice_in_dim(a, 0, a.shape[axis] // n_dev, axis=axis)
    return a


def _nbytes(tree) -> int:
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def _time(compiled, sets, calls: int, repeats: int):
    """Median seconds of one call; also returns the last dispatch's outputs.

    On GPUs the device clock (jaxops/bench/device_clock.py): from the first kernel on any device
    to the last kernel on any device, so the host's dispatch cost is left out but any skew
    between the devices' starts is counted."""
    outs = [compiled(*sets)]  # warm-up
    jax.block_until_ready(outs[0])

    def run():
        outs[0] = None
        outs[0] = compiled(*sets)
        jax.block_until_ready(outs[0])

    return dispatch_median(run, repeats) / calls, outs[0]


def compare(y1, yn, device, index_mismatch: float, float_mismatch: float = 0.0) -> tuple[bool, str]:
    """Sharded outputs `yn` against single-device `y1`, computed on `device` (no host copies)."""
    ok, notes = True, []
    for a, b in zip(jax.tree.leaves(y1), jax.tree.leaves(yn)):
        b = jax.device_put(b, device)
        if a.shape != b.shape or a.dtype != b.dtype:
            return False, f"shape/dtype {b.shape} {b.dtype} != {a.shape} {a.dtype}"
        if jnp.issubdtype(a.dtype, jnp.floating):
            tol = 1e-2 if jnp.dtype(a.dtype).itemsize < 4 else 1e-3
            a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
            both_nan = jnp.isnan(a32) & jnp.isnan(b32)
            diff = jnp.where(both_nan, 0.0, jnp.abs(a32 - b32))
            rel = diff / (tol + tol * jnp.abs(a32))
            worst = float(jnp.max(rel, initial=0.0))
            worst = math.inf if math.isnan(worst) else worst
            off = int(jnp.sum(~(rel <= 1.0)))
            ok &= worst <= 1.0 or off <= float_mismatch * a.size
            notes.append(f"max|d|={float(jnp.max(diff, initial=0.0)):.2g}" + (f" ({off} off)" if off else ""))
        else:
            bad = int(jnp.sum(a != b))
            ok &= bad <= index_mismatch * a.size
            notes.append(f"{bad}/{a.size} ints differ")
    return bool(ok), ", ".join(notes)


def run_case(c: Case, mesh, repeats: int, copies: int, inner: int | None) -> dict:
    dev0 = mesh.devices.flat[0]
    n_dev = mesh.devices.size
    if inner is None:  # GPU: ~30 ms of work a dispatch; CPU dry runs: one call a set
        inner = 1 if dev0.platform == "cpu" else int(min(MAX_INNER, max(1, math.ceil(
            DISPATCH_WORK_S / (copies * c.est_seconds())))))
    calls = copies * inner
    # Keys committed to device 0, so the inputs are generated there (no host round trip).
    keys = jax.device_put(jax.random.split(jax.random.key(zlib.crc32(c.name.encode())), copies), dev0)
    one = [tuple(jax.jit(c.make)(k)) for k in keys]
    out_bytes = _nbytes(jax.eval_shape(c.fn, *one[0]))
    mem = copies * _nbytes(one[0]) + calls * out_bytes
    log(f"{c.name} {c.shape} {c.dtype}: {copies} input sets x {inner} calls a dispatch, "
        f"~{mem / 1e9:.1f} GB on device 0, est. {c.est_seconds() * 1e3:.2f} ms a call on 1 GPU")

    program = _batched(c.fn, inner)
    log(f"{c.name}: compiling for 1 device")
    compiled1 = program.lower(*one).compile()
    log(f"{c.name}: timing 1 device")
    t1, outs = _time(compiled1, one, calls, repeats)
    y1 = outs[0]
    del outs, compiled1
    # One device on its share of the problem (each input cut along its sharded axis): tells
    # the kernels' own scaling (t1 / t_local) from the cost of running on several devices
    # (tn / t_local).
    local = [tuple(_first_shard(a, sp, n_dev) for a, sp in zip(s, c.specs)) for s in one]
    compiled_local = program.lower(*local).compile()
    t_local, _ = _time(compiled_local, local, calls, repeats)
    del local, compiled_local

    many = [tuple(jax.device_put(a, NamedSharding(mesh, sp)) for a, sp in zip(s, c.specs))
            for s in one]
    del one
    log(f"{c.name}: compiling for {n_dev} devices")
    compiledn = program.lower(*many).compile()
    gathers = gather_sizes(compiledn.as_text())
    big = sorted({g for g in gathers if g > c.max_gather})
    log(f"{c.name}: timing {n_dev} devices")
    tn, outs = _time(compiledn, many, calls, repeats)
    yn = outs[0]
    del outs, many, compiledn
    same, detail = compare(y1, yn, dev0, c.index_mismatch, c.float_mismatch)
    target = 0.9 * n_dev
    row = {"op": c.name, "shape": c.shape, "dtype": c.dtype, "devices": n_dev,
           "calls_per_dispatch": calls, "t1_ms": t1 * 1e3, "tn_ms": tn * 1e3,
           "t_local_ms": t_local * 1e3, "speedup": t1 / tn, "target": target, "meets_target": t1 / tn >= target,
           "tb_s_1": c.nbytes / t1 / 1e12, "tb_s_n": c.nbytes / tn / 1e12,
           "tflop_s_1": c.flops / t1 / 1e12 if c.flops else None,
           "same_as_single": same, "compare": detail,
           "large_all_gathers": big, "all_gathers": sorted(set(gathers)), "error": None}
    log(f"{c.name}: 1 dev {t1 * 1e3:.3f} ms, {n_dev} dev {tn * 1e3:.3f} ms, x{t1 / tn:.2f} "
        f"(1 dev on a 1/{n_dev} share {t_local * 1e3:.3f} ms) "
        f"(target {target:.1f}), same={same} ({detail}), large gathers={big or 'none'}")
    return row


def table(rows: list[dict], device: str, n_dev: int) -> str:
    lines = [f"| op | shape | dtype | 1 x {device} (ms) | {n_dev} x (ms) | throughput ratio | "
             f"target | meets | same result | large all-gathers | 1 x on a 1/{n_dev} share (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['op']} | {r['shape']} | {r['dtype']} | ERROR: {r['error']} |"
                         " | | | | | | |")
            continue
        lines.append(f"| {r['op']} | {r['shape']} | {r['dtype']} | {r['t1_ms']:.3f} | "
                     f"{r['tn_ms']:.3f} | {r['speedup']:.2f} | {r['target']:.1f} | "
                     f"{'yes' if r['meets_target'] else 'NO'} | {r['same_as_single']} | "
                     f"{r['large_all_gathers'] or 'none'} | {r['t_local_ms']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", help="comma-separated: softmax,softmax_bf16,layer_norm,batch_norm,"
                                 "batch_norm_fwd_bwd,knn (default: all)")
    p.add_argument("--repeats", type=int, default=20, help="timed dispatches (median)")
    p.add_argument("--copies", type=int, default=2, help="distinct input sets per timed dispatch")
    p.add_argument("--inner", type=int, default=None,
                   help="calls per input set per dispatch (default: ~30 ms of work on a GPU, 1 on CPU)")
    p.add_argument("--scale", type=float, default=1.0, help="shrink sizes (smoke test: 0.01)")
    p.add_argument("--json", metavar="FILE", help="results, rewritten after every case")
    args = p.parse_args(argv)

    devices = jax.devices()
    if len(devices) < 2:
        print(f"bench_scaling: needs two or more devices, found {devices}", file=sys.stderr)
        return 2
    n_dev = len(devices)
    device = str(devices[0].device_kind)
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    all_cases = cases(args.scale, n_dev)
    names = [c.name for c in all_cases]
    wanted = args.ops.split(",") if args.ops else names
    unknown = set(wanted) - set(names)
    if unknown:
        p.error(f"unknown --ops {sorted(unknown)}; choose from {names}")
    log(f"jax {jax.__version__}, jaxops {getattr(jaxops, '__version__', '?')}, "
        f"{n_dev} x {device}, scale {args.scale}")

    rows: list[dict] = []
    for c in all_cases:
        if c.name not in wanted:
            continue
        if c.fn is None:
            log(f"{c.name}: not in this jaxops, skipped")
            continue
        try:
            rows.append(run_case(c, mesh, args.repeats, args.copies, args.inner))
        except Exception as e:  # noqa: BLE001 - one failing case must not lose the others
            traceback.print_exc()
            sys.stderr.flush()
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
            log(f"{c.name}: FAILED {msg}")
            rows.append({"op": c.name, "shape": c.shape, "dtype": c.dtype, "devices": n_dev,
                         "error": msg.replace("|", "/")})
        gc.collect()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device, "devices": n_dev, "date": time.strftime("%Y-%m-%d"),
                           "jax": jax.__version__, "scale": args.scale, "rows": rows}, f, indent=1)

    print("\n" + table(rows, device, n_dev), flush=True)
    ok = all(not r["error"] and r["same_as_single"] and not r["large_all_gathers"] for r in rows)
    met = sum(1 for r in rows if not r["error"] and r["meets_target"])
    log(f"done: {len(rows)} cases, {'all correct' if ok else 'SOME FAILED'}, "
        f"{met}/{len(rows)} meet the {0.9 * n_dev:.1f}x target")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
