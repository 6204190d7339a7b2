"""Profile benchmark cases kernel by kernel (GPU machine, under Nsight Compute).

    ncu --profile-from-start off --section SpeedOfLight ... python3 tools/profile_cases.py \
        --ops relu,bn_relu --dtypes bfloat16 [--shapes ...] [--xla]

Each selected `jaxops-bench` case is built and compiled first, then exactly one call of it runs
between cuProfilerStart/Stop, so the report holds only that call's kernels (ours, plus any
XLA kernels the wrapper adds around them: converts, transposes, pads). `--xla` profiles the
XLA reference the same way, for comparison.
"""
from __future__ import annotations

import argparse
import ctypes
import sys

import jax

from jaxops.bench.case import Options
from jaxops.bench.cli import _parse_shapes, build_cases


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", required=True)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--shapes")
    p.add_argument("--xla", action="store_true", help="profile the XLA reference too")
    a = p.parse_args()
    cuda = ctypes.CDLL("libcuda.so.1")
    opts = Options(ops=set(a.ops.split(",")), dtypes=a.dtypes.split(","), shapes=_parse_shapes(a.shapes),
                   gpu=jax.default_backend() == "gpu")
    for case in build_cases(opts):
        args = tuple(case.make_inputs(jax.random.key(0)))
        fns = [("jaxops", case.jaxops_fn)] + ([("xla", case.xla_fn)] if a.xla and case.xla_fn else [])
        for who, fn in fns:
            f = jax.jit(fn)
            jax.block_until_ready(f(*args))
            print(f"### {who} {case.op} {'x'.join(map(str, case.shape))} {case.dtype} bytes={case.bytes}",
                  flush=True)
            cuda.cuProfilerStart()
            jax.block_until_ready(f(*args))
            cuda.cuProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
