"""Owns: where and when communication runs — the lanes (a CUDA stream beside
the compute stream, or asynchronous gloo work on CPU), the events between
them, keeping buffers alive until their consumer has finished, and the limit
on all-gathers in flight.

Knows nothing of: parameters, modules (work is issued through callables and
tracked by opaque keys).

Public names: ``Scheduler``, ``Lane``, ``InFlight``.

[Note: buffer lifetimes across lanes]
Buffers are never tied to a stream through the caching allocator. A collective's buffers travel in an ``InFlight`` with
the lane's completion event; the scheduler drops that reference only after
the consumer (the compute stream, or the CPU) waited on the event. Before a
lane issues work it waits for everything the compute stream enqueued so far,
so a buffer freed by compute (a resharded unsharded buffer, say) is never
reused by the lane while compute may still read it. On CPU the "event" is
the gloo work handle; waiting on it blocks the calling thread only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, Hashable, NamedTuple, Protocol

import torch

from .comm import PendingCollective

__all__ = ["Scheduler", "Lane", "InFlight"]

logger = logging.getLogger(__name__)


class InFlight(NamedTuple):
    """An issued collective, its buffers, and the event that marks its end
    on the lane (None on CPU, where the work handle is the event)."""

    pending: PendingCollective
    event: torch.cuda.Event | None


class Lane(Protocol):
    """Somewhere collectives run beside compute."""

    def issue(self, launch: Callable[[], PendingCollective | None]) -> InFlight | None:
        """Launch a collective on this lane; None if nothing was launched."""
        ...

    def wait(self, in_flight: InFlight) -> None:
        """Make compute wait until ``in_flight`` finished."""
        ...


class CpuLane:
    """Collectives as asynchronous gloo work run by the backend's threads."""

    async_op = True

    def issue(self, launch: Callable[[], PendingCollective | None]) -> InFlight | None:
        pending = launch()
        return None if pending is None else InFlight(pending, None)

    def wait(self, in_flight: InFlight) -> None:
        if in_flight.pending.work is not None:
            in_flight.pending.work.wait()


class CudaStreamLane:
    """Collectives on their own CUDA stream, ordered by events."""

    # NCCL work is already asynchronous to the host; issuing it synchronously
    # inside the stream context orders it on this stream.
    async_op = False

    def __init__(self, device: torch.device, priority: int) -> None:
        # High priority for the all-gather stream: it gates the next compute.
        self.stream = torch.cuda.Stream(device=device, priority=priority)
        self.device = device

    def issue(self, launch: Callable[[], PendingCollective | None]) -> InFlight | None:
        # See [Note: buffer lifetimes across lanes]: everything compute has
        # enqueued so far (gradients written, buffers last read) comes first.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            pending = launch()
            if pending is None:
                return None
            event = torch.cuda.Event()
            event.record(self.stream)
        return InFlight(pending, event)

    def wait(self, in_flight: InFlight) -> None:
        if in_flight.event is not None:
            # No host sync: the compute stream waits on the device.
            torch.cuda.current_stream(self.device).wait_event(in_flight.event)


class Scheduler:
    """The lanes of one root's tree of units and what is in flight on them."""

    # At most this many all-gathers issued and not yet consumed when limiting.
    MAX_ALL_GATHERS_IN_FLIGHT = 2
    # Reductions in flight before the oldest is finished. Each holds a padded
    # unsharded gradient, so a bound keeps gradient memory at about one unit
    # instead of the whole model until the end of backward.
    MAX_REDUCTIONS_IN_FLIGHT = 1

    def __init__(self, device: torch.device, *, limit_all_gathers: bool) -> None:
        self.device = device
        self.limit_all_gathers = limit_all_gathers
        if device.type == "cuda":
            self.all_gather_lane: CpuLane | CudaStreamLane = CudaStreamLane(device, priority=-1)
            self.reduce_scatter_lane: CpuLane | CudaStreamLane = CudaStreamLane(device, priority=0)
        else:
            self.all_gather_lane = CpuLane()
            self.reduce_scatter_lane = CpuLane()
        # Issued all-gathers by key, oldest first; the entry keeps the
        # gathered buffer and its source alive until wait_for_unshard.
        self._all_gathers: OrderedDict[Hashable, InFlight] = OrderedDict()
        # Issued reductions with what to do once each is done, in issue order.
        self._reductions: list[tuple[InFlight, Callable[[PendingCollective], None]]] = []

    @property
    def async_op(self) -> bool:
        return self.all_gather_lane.async_op

    # --------------------------------------------------------- all-gathers
    def unshard(self, key: Hashable, launch: Callable[[bool], PendingCollective | None]) -> None:
        """Issue an all-gather for ``key`` (``launch(async_op)`` starts it)."""
        if key in self._all_gathers:
            return
        if self.limit_all_gathers:
            while len(self._all_gathers) >= self.MAX_ALL_GATHERS_IN_FLIGHT:
                oldest = next(iter(self._all_gathers))
                self.wait_for_unshard(oldest)
        in_flight = self.all_gather_lane.issue(lambda: launch(self.all_gather_lane.async_op))
        if in_flight is not None:
            self._all_gathers[key] = in_flight

    def wait_for_unshard(self, key: Hashable) -> None:
        """Make compute wait for ``key``'s all-gather (no-op if none pending)."""
        in_flight = self._all_gathers.pop(key, None)
        if in_flight is not None:
            self.all_gather_lane.wait(in_flight)

    def has_pending_unshard(self, key: Hashable) -> bool:
        return key in self._all_gathers

    # ----------------------------------------------------------- reductions
    def reduce(
        self,
        launch: Callable[[bool], PendingCollective | None],
        on_done: Callable[[PendingCollective], None],
    ) -> None:
        """Issue a gradient reduction; ``on_done`` runs once it finished:
        when a later reduction pushes it out, or in ``wait_for_reductions``."""
        while len(self._reductions) >= self.MAX_REDUCTIONS_IN_FLIGHT:
            oldest, oldest_done = self._reductions.pop(0)
            self.reduce_scatter_lane.wait(oldest)
            oldest_done(oldest.pending)
        in_flight = self.reduce_scatter_lane.issue(lambda: launch(self.reduce_scatter_lane.async_op))
        if in_flight is not None:
            self._reductions.append((in_flight, on_done))

    def wait_for_reductions(self) -> None:
        """Wait for every issued reduction, oldest first, and finish each."""
        reductions, self._reductions = self._reductions, []
        for in_flight, on_done in reductions:
            self.reduce_scatter_lane.wait(in_flight)
            on_done(in_flight.pending)

    def wait_for_all(self) -> None:
        """Drain both lanes (end of backward, or before a state change)."""
        for key in list(self._all_gathers):
            self.wait_for_unshard(key)
        self.wait_for_reductions()
