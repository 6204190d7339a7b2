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


def _median_seconds(run, input_sets, repeats: int) -> float:
    jax.block_until_ready(run(*input_sets))  # compile and warm up
    jax.block_until_ready(run(*input_sets))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(*input_sets))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def time_fn(fn: Callable[..., Any], input_sets: Sequence[Sequence[jax.Array]], repeats: int) -> float:
    """Median seconds of one call of `fn`.

    Times one dispatch over all input sets and one over the first third of them; the slope
    between the two cancels the fixed dispatch and synchronisation cost, which is otherwise
    ~10% of a 200 us kernel.
    """
    many = len(input_sets)
    few = max(many // 3, 1)
    t_many = _median_seconds(_batched(fn, many), input_sets, repeats)
    if few == many:
        return t_many / many
    t_few = _median_seconds(_batched(fn, few), input_sets[:few], repeats)
    slope = (t_many - t_few) / (many - few)
    return slope if slope > 0 else t_many / many


def copy_bandwidth(nbytes: int, copies: int, repeats: int) -> float:
    """Bytes per second of a device-to-device copy (read + write) of an nbytes float32 array."""
    n = max(nbytes // 4, 1)
    keys = jax.random.split(jax.random.key(1234), copies)
    sets = [(jax.random.normal(k, (n,), jnp.float32),) for k in keys]
    seconds = time_fn(lambda x: jnp.negative(x), sets, repeats)
    return 2 * n * 4 / seconds
