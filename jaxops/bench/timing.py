"""Timing: many back-to-back calls inside one jit, median over repeats.

On a GPU the time of a dispatch is its device time (jaxops/bench/device_clock.py: first kernel
start to last kernel end, from the profiler's CUPTI timestamps); elsewhere, or with
JAXOPS_BENCH_CLOCK=wall, the wall clock around a blocking dispatch.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from jaxops.bench import device_clock


def _batched(fn: Callable[..., Any], inner: int):
    """One jit that calls `fn` `inner` times on each input set.

    Each call's inputs pass through an optimization barrier tagged with the call's number, so
    XLA can neither merge identical calls nor hoist them; one dispatch then carries many
    kernels, and on the wall clock its fixed launch/synchronisation cost (0.3-0.5 ms on the
    H100) is shared among them.
    """

    def run(*input_sets):
        outs = []
        for i in range(inner):
            for inputs in input_sets:
                tagged, _ = jax.lax.optimization_barrier((tuple(inputs), jnp.int32(i)))
                outs.append(fn(*tagged))
        return outs

    return jax.jit(run)


def dispatch_median(run: Callable[[], object], repeats: int) -> float:
    """Median seconds of one blocking dispatch `run()` over `repeats`: device time on a GPU,
    else (or if the profiler records nothing) the wall clock."""
    if device_clock.available():
        spans = device_clock.dispatch_seconds(run, repeats)
        if spans is not None:
            return statistics.median(spans)
        print("jaxops-bench: no device activity recorded; this case falls back to the wall clock",
              file=sys.stderr)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def time_fn(fn: Callable[..., Any], input_sets: Sequence[Sequence[jax.Array]], repeats: int,
            inner: int = 1) -> float:
    """Median seconds of one call of `fn`: len(input_sets) * inner calls per timed dispatch."""
    run = _batched(fn, inner)
    jax.block_until_ready(run(*input_sets))  # compile and warm up
    jax.block_until_ready(run(*input_sets))
    seconds = dispatch_median(lambda: jax.block_until_ready(run(*input_sets)), repeats)
    return seconds / (len(input_sets) * inner)


def clock_name() -> str:
    """Which clock time_fn reads here, for the record of a run."""
    return "device (CUPTI kernel spans)" if device_clock.available() else "wall"


# The GPU copy reference reads at least this many bytes, whatever the run's cases: a copy of a
# few tens of MB pays its launch gaps and tail over little work (H100, session 68: 2.77 TB/s at
# half of (64,28,28,128) bfloat16's bytes, 3.03 at half of (256,56,56,64) float32's, same machine),
# which inflated every fraction of copy of a run of small cases by ~9 %.
GPU_COPY_MIN_BYTES = 1 << 28
COPY_MAX_BYTES = 1 << 30


def copy_reference_bytes(largest_case_bytes: int, gpu: bool) -> int:
    """Array size for copy_bandwidth: half the largest case's bytes, filling the chip on a GPU."""
    floor = GPU_COPY_MIN_BYTES if gpu else 1 << 20
    return min(max(largest_case_bytes // 2, floor), COPY_MAX_BYTES)


def copy_bandwidth(nbytes: int, copies: int, repeats: int, inner: int = 1) -> float:
    """Bytes per second of a device-to-device copy (read + write) of an nbytes float32 array."""
    n = max(nbytes // 4, 1)
    keys = jax.random.split(jax.random.key(1234), copies)
    sets = [(jax.random.normal(k, (n,), jnp.float32),) for k in keys]
    seconds = time_fn(lambda x: jnp.negative(x), sets, repeats, inner)
    return 2 * n * 4 / seconds


def allocator_warning(env: Mapping[str, str] = os.environ) -> str | None:
    """Why this run's figures would not compare with others, or None.

    With XLA_PYTHON_CLIENT_ALLOCATOR=platform, XLA allocates and frees every buffer with the CUDA
    driver, which leaves the GPU idle between the calls of a dispatch; the device clock counts
    idle gaps inside a dispatch, so every case is charged for them, the copy reference most (its
    outputs are the largest): H100, session 14, 311 MB copies at 2.59 TB/s under it and 3.02
    without, which would inflate every fraction of copy by ~17 %.
    """
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").strip().lower() != "platform":
        return None
    return ("jaxops-bench: XLA_PYTHON_CLIENT_ALLOCATOR=platform allocates every buffer through the driver; "
            "the idle gaps this leaves between calls are charged to every case and to the copy reference "
            "(an H100 copied at 2.59 instead of 3.02 TB/s), so these figures do not compare with others. "
            "Unset it for benchmark numbers.")
