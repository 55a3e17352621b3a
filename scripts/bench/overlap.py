"""Owns: ``--overlap-report`` — per profiled step, how much of the device
time of the streams other than compute (the communication lanes: gathers,
uploads, reductions, downloads) overlaps the compute stream's, from
torch.profiler's CUDA intervals per stream.

Knows nothing of: how a mode wraps the model or which streams it creates
(every stream but compute counts as a lane), the printed table.

Public names: ``Overlap``, ``union``, ``comm_overlap``, ``device_intervals``,
``profile_overlap``, ``format_overlap``.

The arithmetic (``union``, ``comm_overlap``) is plain interval algebra on
``(stream, start, end)`` triples, tested on CPU with synthetic intervals
(tests/bench/test_overlap.py). Lane time is the measure of the union of
every lane's intervals (two lanes busy at once count once); overlapped time
is the measure of its intersection with the union of compute's intervals.
Per lane, the same against compute alone.

Which stream is compute: right before the step, a ``torch.cuda._sleep`` of
a few cycles is enqueued on the current stream; its kernel (the only
"spin_kernel" in the step) names the stream. Intervals are the profiler's
CUDA events of the step (kernels, copies, memsets), user annotations left
out.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

__all__ = ["Overlap", "union", "comm_overlap", "device_intervals", "profile_overlap", "format_overlap"]

Triple = tuple[str, float, float]  # (stream, start, end), end >= start, any time unit

_MARKER_KERNEL = "spin_kernel"  # what torch.cuda._sleep launches
_MARKER_CYCLES = 1000


@dataclass(frozen=True)
class Overlap:
    """One step's lane time and how much of it overlaps compute (the unit of
    the intervals given)."""

    compute: float  # measure of compute's busy time
    comm: float  # measure of the union of every lane's busy time
    overlapped: float  # of ``comm``, while compute was busy too
    # Per lane: (busy time, of it while compute was busy).
    per_stream: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def fraction(self) -> float:
        """Overlapped share of lane time (1.0 when there is no lane time:
        nothing is exposed)."""
        return self.overlapped / self.comm if self.comm > 0 else 1.0


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering exactly the given ones (touching
    intervals merge; empty ones vanish)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(interval for interval in intervals if interval[1] > interval[0]):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _measure(disjoint: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in disjoint)


def _intersection_measure(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> float:
    """Measure of the intersection of two sorted disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(first) and j < len(second):
        start = max(first[i][0], second[j][0])
        end = min(first[i][1], second[j][1])
        if end > start:
            total += end - start
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return total


def comm_overlap(events: Iterable[Triple], compute: str) -> Overlap:
    """How much of the busy time of every stream but ``compute`` overlaps
    ``compute``'s busy time."""
    by_stream: dict[str, list[tuple[float, float]]] = {}
    for stream, start, end in events:
        if end < start:
            raise ValueError(f"overlap: interval on {stream} ends ({end}) before it starts ({start})")
        by_stream.setdefault(stream, []).append((start, end))
    compute_busy = union(by_stream.pop(compute, []))
    lanes = {stream: union(intervals) for stream, intervals in by_stream.items()}
    comm_busy = union(interval for busy in lanes.values() for interval in busy)
    per_stream = {stream: (_measure(busy), _intersection_measure(busy, compute_busy)) for stream, busy in sorted(lanes.items())}
    return Overlap(_measure(compute_busy), _measure(comm_busy), _intersection_measure(comm_busy, compute_busy), per_stream)


def format_overlap(mode: str, steps: list[Overlap]) -> str:
    """One line per profiled step (times in ms)."""
    lines = [f"{mode}: lane device time overlapped by compute, per profiled step"]
    for index, step in enumerate(steps):
        if step.comm == 0:
            lines.append(f"  step {index}: no lane work; compute {step.compute:.2f} ms")
            continue
        lanes = ", ".join(f"{stream} {busy:.2f} ms ({over / busy:.0%})" for stream, (busy, over) in step.per_stream.items() if busy > 0)
        lines.append(
            f"  step {index}: lanes {step.comm:.2f} ms, overlapped {step.overlapped:.2f} ms ({step.fraction:.0%}); "
            f"compute {step.compute:.2f} ms; per lane: {lanes}"
        )
    return "\n".join(lines)


# ------------------------------------------------------- the CUDA part
def device_intervals(prof: torch.profiler.profile) -> tuple[list[Triple], str]:
    """The CUDA intervals (ms) of a profiled step per stream, and the name of
    the compute stream (the one that ran the marker)."""
    triples: list[Triple] = []
    compute = None
    for event in prof.profiler.kineto_results.events():
        if event.device_type() != torch.autograd.DeviceType.CUDA or event.is_user_annotation():
            continue
        stream = f"stream {event.device_resource_id()}"
        if _MARKER_KERNEL in event.name():
            compute = stream
            continue
        triples.append((stream, event.start_ns() / 1e6, event.end_ns() / 1e6))
    if compute is None:
        raise RuntimeError("overlap: the marker kernel on the compute stream was not profiled; is the profiler recording CUDA?")
    return triples, compute


def profile_overlap(
    run: object, corpus: object, args: argparse.Namespace, device: torch.device, steps: int
) -> list[Overlap]:
    """Profile ``steps`` training steps of ``run``, one profiler each, and
    measure each step's overlap."""
    from .training import next_batch, synchronize, train_step  # the data module only where it is needed

    results = []
    for _ in range(steps):
        x, y = next_batch(run, corpus, args, device)
        synchronize(device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.cuda._sleep(_MARKER_CYCLES)  # names the compute stream
            train_step(run, x, y, args, device)
            synchronize(device)
        triples, compute = device_intervals(prof)
        results.append(comm_overlap(triples, compute))
    return results
