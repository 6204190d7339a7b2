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
from typing import Callable, Sequence

import jax

Event = tuple[int, int]  # (start ns, end ns) of one activity on one device


def available() -> bool:
    """Whether device timing applies: a GPU backend, and not switched off by the user."""
    if os.environ.get("JAXOPS_BENCH_CLOCK", "device") == "wall":
        return False
    return jax.default_backend() == "gpu"


def _device_events(xspace: bytes) -> dict[str, list[Event]]:
    """Activities per device plane. Only the per-stream lines: the planes' derived lines
    ("XLA Ops", "XLA Modules", ...) repeat the same time ranges under other names."""
    from jax.profiler import ProfileData

    out: dict[str, list[Event]] = {}
    for plane in ProfileData.from_serialized_xspace(xspace).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        events = [(int(e.start_ns), int(e.start_ns + e.duration_ns))
                  for line in plane.lines if line.name.startswith("Stream")
                  for e in line.events]
        if events:
            out[plane.name] = sorted(events)
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
    from jax._src.lib import _profiler

    try:
        session = _profiler.ProfilerSession(_profiler.ProfileOptions())
    except Exception:  # noqa: BLE001 - any failure to start tracing means: use the wall clock
        return None
    try:
        for _ in range(dispatches):
            run()
    finally:
        xspace = session.stop()
    per_device = _device_events(xspace)
    if not per_device:
        return None
    first = [float("inf")] * dispatches
    last = [float("-inf")] * dispatches
    for events in per_device.values():
        chunks = _split(events, dispatches)
        if chunks is None:
            return None
        for i, chunk in enumerate(chunks):  # on several devices: earliest start to latest end
            first[i] = min(first[i], chunk[0][0])
            last[i] = max(last[i], max(e for _, e in chunk))
    spans = [(b - a) * 1e-9 for a, b in zip(first, last)]
    return spans


def activity_events(run: Callable[[], object]) -> dict[str, list[tuple[int, int, str]]]:
    """(start ns, end ns, name) of every GPU activity of one call of `run`, per device plane;
    for tools that break a dispatch down by kernel (tools/trace_kernels.py)."""
    from jax._src.lib import _profiler
    from jax.profiler import ProfileData

    session = _profiler.ProfilerSession(_profiler.ProfileOptions())
    try:
        run()
    finally:
        xspace = session.stop()
    out: dict[str, list[tuple[int, int, str]]] = {}
    for plane in ProfileData.from_serialized_xspace(xspace).planes:
        if os.environ.get("JAXOPS_TRACE_LINES"):
            print(plane.name, [(line.name, len(list(line.events))) for line in plane.lines])
        if plane.name.startswith("/device:GPU"):
            out[plane.name] = sorted(
                (int(e.start_ns), int(e.start_ns + e.duration_ns), e.name)
                for line in plane.lines if line.name.startswith("Stream") for e in line.events)
    return out


__all__: Sequence[str] = ("available", "dispatch_seconds", "activity_events")
