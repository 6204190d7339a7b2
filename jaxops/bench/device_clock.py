"""Device time of jitted dispatches, read from the GPU activity that the JAX profiler records.

Wall-clock timing of a dispatch also counts the host's launch and synchronisation cost. On the
H100 that cost was 0.3-0.5 ms a dispatch (measured in session 4 with tools/trace_kernels.py:
a call of a 178 us copy kernel read 200-250 us on the wall clock at 16 calls a dispatch), it
varies from case to case, and it shrank every ratio towards 1.0 - XLA's own softmax read 0.86
of the copy bandwidth where its kernel runs at 0.99. The profiler's CUPTI tracer timestamps
every kernel, memcpy and memset on the GPU itself, so a dispatch's device time is the span from
its first activity's start to its last activity's end: the kernels, and any idle gaps *between*
them (an op whose launches cannot keep the GPU busy still pays for that).
"""
from __future__ import annotations

import os
from typing import Callable

import jax

Event = tuple[int, int]  # (start ns, end ns) of one activity on one device


def available() -> bool:
    """Whether device timing applies: a GPU backend, and not switched off by the user."""
    if os.environ.get("JAXOPS_BENCH_CLOCK", "device") == "wall":
        return False
    return jax.default_backend() == "gpu"


def _record(run: Callable[[], object], times: int) -> bytes:
    """Calls `run` `times` times under one profiler session; returns the serialized XSpace."""
    from jax._src.lib import _profiler

    session = _profiler.ProfilerSession(_profiler.ProfileOptions())
    try:
        for _ in range(times):
            run()
    finally:
        xspace = session.stop()
    return xspace


def _stream_events(xspace: bytes) -> dict[str, list[tuple[int, int, str]]]:
    """(start ns, end ns, name) of each activity, sorted, per GPU plane that has any. Only the
    per-stream lines: the planes' derived lines ("XLA Ops", "XLA Modules", ...) repeat the same
    time ranges under other names."""
    from jax.profiler import ProfileData

    out: dict[str, list[tuple[int, int, str]]] = {}
    for plane in ProfileData.from_serialized_xspace(xspace).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        events = sorted((int(e.start_ns), int(e.start_ns + e.duration_ns), e.name)
                        for line in plane.lines if line.name.startswith("Stream")
                        for e in line.events)
        if events:
            out[plane.name] = events
    return out


def _split(events: list[Event], dispatches: int) -> list[list[Event]] | None:
    """The events of each dispatch. Consecutive dispatches are separated by the host's
    synchronise-and-launch time, so the dispatches-1 widest idle gaps are the boundaries; the
    split is accepted only if every dispatch holds the same number of activities."""
    if len(events) < dispatches or len(events) % dispatches:
        return None
    ends = [events[0][1]]
    for _, end in events[1:]:
        ends.append(max(ends[-1], end))
    gaps = sorted(range(1, len(events)), key=lambda i: events[i][0] - ends[i - 1], reverse=True)
    cuts = sorted(gaps[:dispatches - 1])
    chunks = [events[a:b] for a, b in zip([0] + cuts, cuts + [len(events)])]
    if len({len(c) for c in chunks}) != 1:
        return None
    return chunks


def dispatch_seconds(run: Callable[[], object], dispatches: int) -> list[float] | None:
    """Device seconds of each of `dispatches` calls of `run` (which must block until done), or
    None when the profiler recorded no usable GPU activity (another CUPTI client such as
    Nsight Compute holds the GPU, or the dispatches could not be told apart)."""
    try:
        xspace = _record(run, dispatches)
    except Exception:  # noqa: BLE001 - any failure to start tracing means: use the wall clock
        return None
    per_device = _stream_events(xspace)
    if not per_device:
        return None
    first = [float("inf")] * dispatches
    last = [float("-inf")] * dispatches
    for events in per_device.values():
        chunks = _split([(start, end) for start, end, _ in events], dispatches)
        if chunks is None:
            return None
        for i, chunk in enumerate(chunks):  # on several devices: earliest start to latest end
            first[i] = min(first[i], chunk[0][0])
            last[i] = max(last[i], max(e for _, e in chunk))
    return [(b - a) * 1e-9 for a, b in zip(first, last)]


def activity_events(run: Callable[[], object]) -> dict[str, list[tuple[int, int, str]]]:
    """(start ns, end ns, name) of every GPU activity of one call of `run`, per device plane;
    for tools that break a dispatch down by kernel (tools/trace_kernels.py)."""
    return _stream_events(_record(run, 1))
