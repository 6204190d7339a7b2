"""Timing: many back-to-back calls inside one jit on distinct inputs, median over repeats."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp


def _batched(fn: Callable[..., Any], copies: int):
    # Distinct inputs keep XLA from merging identical calls; one dispatch amortises launch cost.
    def run(*input_sets):
        return [fn(*inputs) for inputs in input_sets]

    return jax.jit(run)


def time_fn(fn: Callable[..., Any], input_sets: Sequence[Sequence[jax.Array]], repeats: int) -> float:
    """Median seconds of one call of `fn`, timed as len(input_sets) calls per dispatch."""
    run = _batched(fn, len(input_sets))
    jax.block_until_ready(run(*input_sets))  # compile and warm up
    jax.block_until_ready(run(*input_sets))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(*input_sets))
        samples.append((time.perf_counter() - start) / len(input_sets))
    return statistics.median(samples)


def copy_bandwidth(nbytes: int, copies: int, repeats: int) -> float:
    """Bytes per second of a device-to-device copy (read + write) of an nbytes float32 array."""
    n = max(nbytes // 4, 1)
    keys = jax.random.split(jax.random.key(1234), copies)
    sets = [(jax.random.normal(k, (n,), jnp.float32),) for k in keys]
    seconds = time_fn(lambda x: jnp.negative(x), sets, repeats)
    return 2 * n * 4 / seconds
