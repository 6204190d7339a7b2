"""Timing: many back-to-back calls inside one jit, median over repeats.

On a GPU the time of a dispatch is its device time (jaxops/bench/device_clock.py: first kernel
start to last kernel end, from the profiler's CUPTI timestamps); elsewhere, or with
JAXOPS_BENCH_CLOCK=wall, the wall clock around a blocking dispatch.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable, Sequence

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


def copy_bandwidth(nbytes: int, copies: int, repeats: int, inner: int = 1) -> float:
    """Bytes per second of a device-to-device copy (read + write) of an nbytes float32 array."""
    n = max(nbytes // 4, 1)
    keys = jax.random.split(jax.random.key(1234), copies)
    sets = [(jax.random.normal(k, (n,), jnp.float32),) for k in keys]
    seconds = time_fn(lambda x: jnp.negative(x), sets, repeats, inner)
    return 2 * n * 4 / seconds
