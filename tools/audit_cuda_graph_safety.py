#!/usr/bin/env python3
"""Static check that the CUDA handlers can be captured into CUDA graphs (XLA command buffers).

A handler may only enqueue work on the stream XLA gives it: no allocation, no synchronisation,
no stream/event queries, no synchronous copies or memsets (all break or serialize capture),
and it must be declared ``{ffi::Traits::kCmdBufferCompatible}`` or XLA never captures it.
This scans cc/*/*_cuda.cc and cc/*/*.cu (and cc/common/) and prints offenders, exit status 1.
It is a lint, not a proof: tests/test_cuda_graphs.py runs every op captured on a GPU.
"""
from __future__ import annotations

import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Calls that must not run while XLA executes (captures) a handler.
FORBIDDEN = {
    r"\bcudaMalloc\w*\s*\(": "allocates (take workspace as an FFI result instead)",
    r"\bcudaFree\w*\s*\(": "frees memory",
    r"\bcudaDeviceSynchronize\s*\(": "synchronises the device",
    r"\bcudaStreamSynchronize\s*\(": "synchronises the stream",
    r"\bcudaEventSynchronize\s*\(": "synchronises on an event",
    r"\bcudaStreamQuery\s*\(": "queries the stream",
    r"\bcudaEventQuery\s*\(": "queries an event",
    r"\bcudaMemcpy\s*\(": "synchronous copy (use cudaMemcpyAsync on the handler's stream)",
    r"\bcudaMemset\s*\(": "synchronous memset (use cudaMemsetAsync on the handler's stream)",
    r"\bcudaMemcpy(To|From)Symbol\s*\(": "synchronous symbol copy",
    r"\bcudaStreamCreate\w*\s*\(": "creates a stream (launch on the FFI stream only)",
    r"\bthrust::": "thrust allocates and synchronises",
    r"\bcudaDeviceSetLimit\s*\(": "changes device state",
}
HANDLER = re.compile(r"XLA_FFI_DEFINE_HANDLER(?:_SYMBOL)?\s*\(\s*(\w+)\s*,(.*?)\)\s*;", re.S)


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def cuda_sources(root: str = ROOT) -> list[str]:
    """The CUDA-side sources under cc/: kernels (.cu, .cuh) and the CUDA handlers and headers."""
    return sorted(set(glob.glob(os.path.join(root, "cc", "*", "*_cuda.cc")) +
                      glob.glob(os.path.join(root, "cc", "*", "*.cu")) +
                      glob.glob(os.path.join(root, "cc", "*", "*.cuh")) +
                      glob.glob(os.path.join(root, "cc", "*", "*_cuda.h"))))


def audit(root: str = ROOT) -> list[str]:
    """Offences as 'path:line: message'."""
    problems = []
    for path in cuda_sources(root):
        rel = os.path.relpath(path, root)
        with open(path) as f:
            text = _strip_comments(f.read())
        for pattern, why in FORBIDDEN.items():
            for m in re.finditer(pattern, text):
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{rel}:{line}: {m.group().strip('( ')} {why}")
        if path.endswith("_cuda.cc"):
            for m in HANDLER.finditer(text):
                if "kCmdBufferCompatible" not in m.group(2):
                    line = text.count("\n", 0, m.start()) + 1
                    problems.append(f"{rel}:{line}: handler {m.group(1)} is not declared "
                                    "{ffi::Traits::kCmdBufferCompatible}")
    return problems


def main() -> int:
    problems = audit()
    for p in problems:
        print(p)
    print(f"audit_cuda_graph_safety: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
