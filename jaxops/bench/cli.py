"""jaxops-bench: time jaxops ops against XLA and the copy bandwidth, in one process.

Every figure in the table is a same-run ratio: speed-up = XLA time / jaxops time, and
fraction of copy = (bytes / time) / copy bandwidth measured at the start of the run.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from typing import Any

import jax

from jaxops._ffi import device_plan
from jaxops.bench.case import Case, Options
from jaxops.bench.timing import allocator_warning, clock_name, copy_bandwidth, copy_reference_bytes, time_fn

FAMILIES = ("softmax", "layer_norm", "normalization", "reductions", "knn")


def _parse_shapes(text: str | None):
    if not text:
        return None
    return [tuple(int(d) for d in s.lower().split("x")) for s in text.split(",") if s]


def build_cases(options: Options) -> list[Case]:
    cases: list[Case] = []
    for family in FAMILIES:
        module = importlib.import_module(f"jaxops.bench.cases_{family}")
        cases.extend(module.cases(options))
    return cases


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:50]:<50}")
    sys.stderr.flush()
    if done == total:
        sys.stderr.write("\n")


def run_case(case: Case, copies: int, repeats: int, copy_bw: float, inner: int) -> dict[str, Any]:
    keys = jax.random.split(jax.random.key(hash((case.op, case.shape, case.dtype)) % 2**31), copies)
    sets = [tuple(case.make_inputs(k)) for k in keys]
    # Heavy cases need no amortising: one call per set once a call outlasts ~1 ms.
    probe = time_fn(case.jaxops_fn, sets[:1], 1, 1)
    inner = max(1, min(inner, math.ceil(1e-3 / max(probe, 1e-9))))
    t_ops = time_fn(case.jaxops_fn, sets, repeats, inner)
    t_xla = time_fn(case.xla_fn, sets, repeats, inner) if case.xla_fn is not None else float("nan")
    del sets
    return {
        "op": case.op, "shape": list(case.shape), "dtype": case.dtype, "note": case.note,
        "x": case.x, "bytes": case.bytes,
        "jaxops_us": t_ops * 1e6, "xla_us": t_xla * 1e6,
        "speedup": t_xla / t_ops,
        "jaxops_copy_fraction": case.bytes / t_ops / copy_bw,
        "xla_copy_fraction": case.bytes / t_xla / copy_bw,
        **case.extra,
    }


def format_table(rows: list[dict[str, Any]], copy_bw: float, device: str) -> str:
    head = (f"device: {device}   copy bandwidth: {copy_bw / 1e12:.3f} TB/s   clock: {clock_name()}\n"
            f"{'op':<24} {'shape':<22} {'dtype':<9} {'jaxops us':>10} {'XLA us':>10} "
            f"{'speed-up':>8} {'jaxops/copy':>11} {'XLA/copy':>9}  note")
    lines = [head, "-" * len(head.splitlines()[1])]
    for r in rows:
        shape = "x".join(str(d) for d in r["shape"])
        lines.append(
            f"{r['op']:<24} {shape:<22} {r['dtype']:<9} {r['jaxops_us']:>10.1f} {r['xla_us']:>10.1f} "
            f"{r['speedup']:>8.2f} {r['jaxops_copy_fraction']:>11.3f} {r['xla_copy_fraction']:>9.3f}  {r['note']}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], copy_bw: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r["x"]:
            groups.setdefault((r["op"], r["dtype"]), []).append(r)
    if not groups:
        return
    fig, axes = plt.subplots(len(groups), 1, figsize=(8, 3.2 * len(groups)), squeeze=False)
    for ax, ((op, dtype), rs) in zip(axes[:, 0], sorted(groups.items())):
        rs = sorted(rs, key=lambda r: r["x"])
        xs = [r["x"] for r in rs]
        ax.plot(xs, [r["bytes"] / (r["jaxops_us"] * 1e-6) / 1e12 for r in rs], "o-", label="jaxops")
        ax.plot(xs, [r["bytes"] / (r["xla_us"] * 1e-6) / 1e12 for r in rs], "s--", label="XLA")
        ax.axhline(copy_bw / 1e12, color="gray", linestyle=":", label="copy")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("row length")
        ax.set_ylabel("TB/s")
        ax.set_title(f"{op} {dtype}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jaxops-bench", description=__doc__)
    p.add_argument("--ops", help="comma-separated op names (default: all), e.g. softmax,log_softmax_bwd")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes")
    p.add_argument("--shapes", help="comma-separated shapes like 4096x16384 (family-specific meaning)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per case (median)")
    p.add_argument("--copies", type=int, default=None, help="distinct input sets per timed dispatch")
    p.add_argument("--inner", type=int, default=None, help="calls per input set per timed dispatch")
    p.add_argument("--json", metavar="FILE", help="write every result as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot bandwidth against row length")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    args = p.parse_args(argv)

    gpu = jax.default_backend() == "gpu"
    options = Options(
        ops=set(args.ops.split(",")) if args.ops else None,
        dtypes=args.dtypes.split(","),
        shapes=_parse_shapes(args.shapes),
        gpu=gpu,
    )
    cases = build_cases(options)
    if args.list:
        for c in cases:
            print(c.op, "x".join(map(str, c.shape)), c.dtype, c.note)
        return 0
    if not cases:
        print("no benchmark case matches the options", file=sys.stderr)
        return 1
    warning = allocator_warning() if gpu else None
    if warning:
        print(warning, file=sys.stderr)
    repeats = args.repeats or (20 if gpu else 3)
    copies = args.copies or (2 if gpu else 1)
    inner = args.inner or (8 if gpu else 2)
    largest = max(c.bytes for c in cases)
    copy_bw = copy_bandwidth(copy_reference_bytes(largest, gpu), copies, repeats, inner)
    device = str(jax.devices()[0].device_kind)
    plans = device_plan() if gpu else None
    label = device if plans is None else (
        f"{device} ({plans['dram_bytes_per_sm_cycle']:.1f} DRAM B/SM-cycle: "
        f"{'fast' if plans['fast_dram'] else 'H100'}-DRAM plans)")

    rows = []
    stream = not sys.stdout.isatty()  # logs keep every finished row even if the run is cut short
    for i, case in enumerate(cases):
        _progress(i, len(cases), f"{case.op} {case.shape} {case.dtype}")
        rows.append(run_case(case, copies, repeats, copy_bw, inner))
        if stream:
            print(format_table(rows[-1:], copy_bw, label).splitlines()[-1], flush=True)
        if args.json:  # rewritten after every case for the same reason
            with open(args.json, "w") as f:
                json.dump({"device": device, "plans": plans, "clock": clock_name(), "copy_bandwidth": copy_bw,
                           "date": time.strftime("%Y-%m-%d"),
                           "jax": jax.__version__, "command": " ".join(sys.argv), "warning": warning, "rows": rows},
                          f, indent=1)
    _progress(len(cases), len(cases), "done")

    print(format_table(rows, copy_bw, label))
    if args.plot:
        plot(rows, copy_bw, args.plot)
    return 0
