"""Where the time of a timed benchmark dispatch goes: kernel durations and the gaps between them.

Runs jaxops-bench cases through the same batched harness (jaxops/bench/timing.py), records one
dispatch with the JAX profiler (CUPTI), and prints, per case and side (jaxops / XLA / copy):
  time      seconds a call as jaxops-bench measures it (device time; JAXOPS_BENCH_CLOCK=wall
            for the wall clock, which also counts the host's dispatch cost)
  kernels   per kernel name: count a call, median duration, its bandwidth for the case's bytes
  busy      summed kernel time a call / wall time a call
  gaps      median and max idle time between consecutive kernels on the GPU
Gaps well above zero mean the loss is between the kernels (launches that cannot keep up);
otherwise the kernels themselves are what is slow. A kernel launched with programmatic dependent
launch (sm_90, the default) starts before its predecessor ends and waits inside, so its duration
here includes that wait (negative gaps); run with JAXOPS_PDL=0 to read each kernel's own time.

  python tools/trace_kernels.py --ops relu,softmax --dtypes float32 --shapes 67108864
  python tools/trace_kernels.py --ops knn --shapes 4096x262144x128x256 --inner 1 --copies 1 \
      --sides jaxops --sequence    # one call's kernels in launch order (knn: each tile's select)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import jax
import jax.numpy as jnp

from jaxops.bench import device_clock
from jaxops.bench.case import Options
from jaxops.bench.cli import _parse_shapes, build_cases
from jaxops.bench.timing import _batched, time_fn


def analyse(label, events, calls, wall_s, nbytes):
    """Print the per-call kernel budget of one traced dispatch."""
    if not events:
        print(f"  {label}: no GPU events recorded")
        return {}
    events = sorted((s / 1e3, (e - s) / 1e3, n) for s, e, n in events)  # microseconds
    kernels = {}
    for _, dur, name in events:
        kernels.setdefault(name, []).append(dur)
    busy = sum(d for _, d, _ in events) / calls
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(events, events[1:])]
    span = (max(t + d for t, d, _ in events) - events[0][0]) / calls
    print(f"  {label}: time {wall_s * 1e6:8.1f} us/call  span {span:8.1f}  busy {busy:8.1f}  "
          f"gap median {statistics.median(gaps) if gaps else 0:6.2f} max {max(gaps) if gaps else 0:7.1f} us")
    for name, durs in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
        med = statistics.median(durs)
        print(f"      {len(durs) / calls:5.2f}x  {med:8.1f} us  {nbytes / (med * 1e-6) / 1e12 if med else 0:6.2f} TB/s"
              f"  {name[:110]}")
    return {"label": label, "time_us": wall_s * 1e6, "span_us": span, "busy_us": busy,
            "gap_median_us": statistics.median(gaps) if gaps else 0.0,
            "kernels": {n: [len(d) / calls, statistics.median(d)] for n, d in kernels.items()}}


def print_sequence(events, calls):
    """One call's kernels in start order with their durations (the first 1/calls of the events)."""
    events = sorted(events)
    for s, e, name in events[: max(1, len(events) // calls)]:
        print(f"        {(e - s) / 1e3:9.1f} us  {name[:90]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", required=True)
    p.add_argument("--dtypes", default="float32")
    p.add_argument("--shapes")
    p.add_argument("--inner", type=int, default=8)
    p.add_argument("--copies", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--sides", default="jaxops,xla,copy", help="which of jaxops, xla, copy to trace")
    p.add_argument("--sequence", action="store_true",
                   help="also list one call's kernels in launch order (e.g. knn's per-tile selects)")
    args = p.parse_args(argv)
    traced = set(args.sides.split(","))
    if traced - {"jaxops", "xla", "copy"}:
        p.error(f"--sides takes jaxops, xla and copy, not {args.sides!r}")
    options = Options(ops=set(args.ops.split(",")), dtypes=args.dtypes.split(","),
                      shapes=_parse_shapes(args.shapes), gpu=jax.default_backend() == "gpu")
    results = []
    for case in build_cases(options):
        keys = jax.random.split(jax.random.key(7), args.copies)
        sets = [tuple(case.make_inputs(k)) for k in keys]
        calls = args.copies * args.inner
        print(f"{case.op} {'x'.join(map(str, case.shape))} {case.dtype}: {calls} calls a dispatch, "
              f"{case.bytes / 1e6:.1f} MB a call", flush=True)
        sides = [("jaxops", case.jaxops_fn), ("xla", case.xla_fn)]
        if case.op in ("relu", "softmax", "layer_norm"):
            sides.append(("copy", lambda *a: jnp.negative(a[0])))
        for label, fn in sides:
            if fn is None or label not in traced:
                continue
            wall = time_fn(fn, sets, 5, args.inner)  # device time unless JAXOPS_BENCH_CLOCK=wall
            run = _batched(fn, args.inner)
            planes = device_clock.activity_events(lambda: jax.block_until_ready(run(*sets)))
            events = [ev for plane in planes.values() for ev in plane]
            nbytes = case.bytes if label != "copy" else 2 * sets[0][0].nbytes
            r = analyse(label, events, calls, wall, nbytes)
            if args.sequence:
                print_sequence(events, calls)
            results.append({"op": case.op, "shape": list(case.shape), "dtype": case.dtype, **r})
        del sets
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
