"""Owns: where and when communication runs — the lanes (a CUDA stream beside
the compute stream, or asynchronous gloo work on CPU), the fences between
them, keeping buffers alive until their consumer has finished, the limit on
all-gathers in flight, and the host's wait for the device.

Knows nothing of: parameters, modules (work is issued through callables and
tracked by opaque keys).

Public names: ``Scheduler``, ``Lane``, ``InFlight``.

[Note: lane fences]
Whatever a lane runs is fenced, collective or not: a launch may enqueue only
copies and casts and return no ``PendingCollective``, and compute must still
not read what they write before they ran. So ``issue`` always returns an
``InFlight`` (an event recorded on the lane after the launch) and the
scheduler keeps it until compute waited on it. Offloaded reductions finish
on the reduction lane (``finish_on_lane``), fenced by one post-reduce event;
the host is a third party, so ``synchronize_host`` is its one wait per step,
before the optimizer reads downloaded gradients or writes uploaded shards.
Pinned by tests/scheduler/test_lane_fences.py, tests/scheduler/test_cuda_offload.py
and, on a GPU, tests/cuda/test_offload_fences.py (negative controls patch
each guard out).

[Note: what a lane waits for]
A launch waits for two things only, never for all of compute: the producer
of its input and the last use of the memory it may reuse, each an event
recorded on compute (``Lane.mark_compute``). A reduction waits for the
gradient write just enqueued; an all-gather waits for the latest shard
write (``mark_shards_written``, called where a forward or backward starts
and after user gradient hooks) and for the last use of every unsharded
buffer freed since the previous all-gather (``free_unsharded``). A freed
buffer's block would hand the next all-gather an event that is the end of
the unit running now, so a unit's post-forward inside the root's forward
frees with ``defer``: the block stays allocated until the next all-gather
allocated its own (one more unit buffer at that moment; ``plan`` counts
it), and nothing is deferred past ``wait_for_all``. On CPU compute runs in
the host's order: ``mark_compute`` is None, frees are immediate. Pinned by
tests/scheduler/test_cuda_lanes.py (a fake of CUDA's stream rules).

[Note: buffer lifetimes across lanes]
Buffers are never tied to a stream with ``record_stream``: a tensor compute
allocated and a lane reads stays referenced by its ``InFlight`` until
compute waited on the fence, and no longer (a reduction's inputs go before
its finish allocates); a block a lane allocated and the host frees is
reused by the lane only after the compute event recorded at the free.
docs/design/runtime.md has the stream-order argument behind the three notes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable, NamedTuple, Protocol, Sequence

import torch

from ..comm import PendingCollective

__all__ = ["Scheduler", "Lane", "InFlight"]

logger = logging.getLogger(__name__)


class InFlight(NamedTuple):
    """Work issued on a lane — a collective, copies, or nothing at all — the
    buffers it uses, and its fence (see [Note: lane fences])."""

    # The collective and its buffers; None when the launch returned none
    # (copies only, or nothing to do): the fence still covers it.
    pending: PendingCollective | None
    # Recorded on the lane's stream after the launch; None on CPU, where the
    # work handle (if any) is the fence.
    event: torch.cuda.Event | None


class Lane(Protocol):
    """Somewhere work runs beside compute."""

    # Whether collectives are launched with async_op=True on this lane.
    async_op: bool
    # Whether compute and this lane's collectives share host memory (CPU):
    # backward then bounds its peak ([Note: backward prefetch on CPU] in
    # runtime/prefetch.py).
    shares_host_memory: bool

    def mark_compute(self) -> torch.cuda.Event | None:
        """An event recorded on compute now: it completes once everything
        compute has queued so far has. None where compute runs in the
        host's order (CPU): nothing to wait for. See [Note: what a lane
        waits for]."""
        ...

    def issue(
        self, launch: Callable[[], PendingCollective | None], *, after: Sequence[torch.cuda.Event] = ()
    ) -> InFlight:
        """Run ``launch`` on this lane once the compute events ``after`` have
        completed; the returned fence covers everything it enqueued, whether
        or not it launched a collective."""
        ...

    def wait(self, in_flight: InFlight) -> None:
        """Make compute wait until everything ``in_flight`` fences finished."""
        ...

    def follow(self, work: Callable[[], None]) -> torch.cuda.Event | None:
        """Run ``work`` (host code enqueueing device work) on this lane, after
        everything issued on it so far; returns the fence of what it enqueued
        (None where ``work`` ran synchronously)."""
        ...


class CpuLane:
    """Collectives as asynchronous gloo work run by the backend's threads;
    anything else a launch does runs synchronously in the calling thread."""

    async_op = True
    shares_host_memory = True

    def mark_compute(self) -> torch.cuda.Event | None:
        return None  # compute ran in this thread: what it wrote is written

    def issue(
        self, launch: Callable[[], PendingCollective | None], *, after: Sequence[torch.cuda.Event] = ()
    ) -> InFlight:
        return InFlight(launch(), None)

    def wait(self, in_flight: InFlight) -> None:
        if in_flight.pending is not None and in_flight.pending.work is not None:
            in_flight.pending.work.wait()

    def follow(self, work: Callable[[], None]) -> torch.cuda.Event | None:
        work()  # copies run synchronously in this thread: nothing to fence
        return None


class CudaStreamLane:
    """Work on its own CUDA stream, fenced by an event (see [Note: lane fences])."""

    # NCCL work is already asynchronous to the host; issuing it synchronously
    # inside the stream context orders it on this stream.
    async_op = False
    shares_host_memory = False

    def __init__(self, device: torch.device, priority: int) -> None:
        # High priority for the all-gather stream: it gates the next compute.
        self.stream = torch.cuda.Stream(device=device, priority=priority)
        self.device = device

    def mark_compute(self) -> torch.cuda.Event | None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def issue(
        self, launch: Callable[[], PendingCollective | None], *, after: Sequence[torch.cuda.Event] = ()
    ) -> InFlight:
        # Only what the launch needs comes first: the producer of its input
        # and the last use of the blocks it may reuse, never the rest of
        # compute (see [Note: what a lane waits for]).
        for event in after:
            self.stream.wait_event(event)
        with torch.cuda.stream(self.stream):
            pending = launch()
            # The fence: recorded whether or not a collective was launched,
            # so copies and casts the launch enqueued are covered too.
            event = torch.cuda.Event()
            event.record(self.stream)
        return InFlight(pending, event)

    def wait(self, in_flight: InFlight) -> None:
        if in_flight.event is not None:
            # No host sync: the compute stream waits on the device.
            torch.cuda.current_stream(self.device).wait_event(in_flight.event)

    def follow(self, work: Callable[[], None]) -> torch.cuda.Event | None:
        # No wait on compute: ``work`` reads what the lane produced (in stream
        # order after it) and host memory; see "The host is a third party"
        # in [Note: lane fences].
        with torch.cuda.stream(self.stream):
            work()
            event = torch.cuda.Event()
            event.record(self.stream)
        return event


class Scheduler:
    """The lanes of one root's tree of units and what is in flight on them."""

    # At most this many all-gathers issued and not yet consumed when limiting.
    MAX_ALL_GATHERS_IN_FLIGHT = 2
    # Reductions in flight before the oldest is finished. Each holds a padded
    # unsharded gradient, so a bound keeps gradient memory at about one unit
    # instead of the whole model until the end of backward.
    MAX_REDUCTIONS_IN_FLIGHT = 1

    def __init__(
        self, device: torch.device, *, limit_all_gathers: bool, bucket_bytes: int = 0, gather_bucket_bytes: int = 0
    ) -> None:
        self.device = device
        self.limit_all_gathers = limit_all_gathers
        if device.type == "cuda":
            self.all_gather_lane: Lane = CudaStreamLane(device, priority=-1)
            self.reduce_scatter_lane: Lane = CudaStreamLane(device, priority=0)
        else:
            self.all_gather_lane = CpuLane()
            self.reduce_scatter_lane = CpuLane()
        # Issued unshards by key, oldest first (every issue, collective or
        # not: see [Note: lane fences]); the entry keeps the gathered buffer
        # and its source alive until wait_for_unshard.
        self._all_gathers: OrderedDict[Hashable, InFlight] = OrderedDict()
        # The other keys a coalesced all-gather fills, by each of its keys
        # (absent for one filled alone), and the collectives in flight:
        # kept as they change, so no hook iterates the entries (hooks
        # torch.compile traces would be guarded on them).
        self._filled_with: dict[Hashable, tuple[Hashable, ...]] = {}
        self.all_gathers_in_flight = 0
        # The most unsharded bytes one coalesced all-gather fills (0: none;
        # [Note: coalesced all-gathers] in runtime/gather_buckets.py).
        self.gather_bucket_bytes = gather_bucket_bytes
        # Compute events the next all-gather waits on: one per unsharded
        # buffer freed since the last all-gather, and the latest mark of
        # shard writes (see [Note: what a lane waits for]). Empty on CPU.
        self._all_gather_after: list[torch.cuda.Event] = []
        self._shards_written: torch.cuda.Event | None = None
        # The unsharded buffer freed last with ``defer``: allocated until the
        # next all-gather allocated its own (None: no free deferred).
        self._deferred_free: _DeferredFree | None = None
        # Issued reductions with what to do once each is done, in issue order.
        self._reductions: list[_Reduction] = []
        # Reductions held to share one collective, and the most bytes a
        # bucket holds (0: none held; [Note: coalesced reductions] in
        # runtime/grad_buckets.py).
        self._bucket: _Bucket | None = None
        self.bucket_bytes = bucket_bytes
        # The fence of the latest finish run on the reduction lane, with the
        # reduction it read (kept referenced until compute waited on the
        # fence: see "The host is a third party" in [Note: lane fences]).
        self._post_reduce: InFlight | None = None

    @property
    def async_op(self) -> bool:
        return self.all_gather_lane.async_op

    # --------------------------------------------------------- all-gathers
    def unshard(self, key: Hashable, launch: Callable[[bool], PendingCollective | None]) -> None:
        """Issue an all-gather for ``key`` (``launch(async_op)`` starts it)."""
        if key not in self._all_gathers:
            self.unshard_together((key,), launch)

    def unshard_together(self, keys: Sequence[Hashable], launch: Callable[[bool], PendingCollective | None]) -> None:
        """Issue one all-gather filling every key of ``keys`` (none of them
        issued yet): one entry in flight, waited on by whichever key is
        waited for first ([Note: coalesced all-gathers] in
        runtime/gather_buckets.py)."""
        if self._deferred_free is not None and self._deferred_free.key in keys:
            self._run_deferred_free()  # its storage is about to be refilled
        if self.limit_all_gathers:
            while self.all_gathers_in_flight >= self.MAX_ALL_GATHERS_IN_FLIGHT:
                oldest = next(iter(self._all_gathers))
                self.wait_for_unshard(oldest)
        after = self._all_gather_after
        if self._shards_written is not None:
            after.append(self._shards_written)
        self._all_gather_after, self._shards_written = [], None
        in_flight = self.all_gather_lane.issue(lambda: launch(self.all_gather_lane.async_op), after=after)
        for key in keys:
            self._all_gathers[key] = in_flight
        if len(keys) > 1:
            for key in keys:
                self._filled_with[key] = tuple(other for other in keys if other is not key)
        self.all_gathers_in_flight += 1
        # This launch allocated its buffers: the deferred block may go to the next.
        self._run_deferred_free()

    def wait_for_unshard(self, key: Hashable) -> None:
        """Make compute wait for ``key``'s all-gather (no-op if none pending)."""
        in_flight = self._all_gathers.pop(key, None)
        if in_flight is not None:
            # A coalesced one: compute waits once, for all its keys.
            for other in self._filled_with.pop(key, ()):
                del self._all_gathers[other]
                del self._filled_with[other]
            self.all_gathers_in_flight -= 1
            self.all_gather_lane.wait(in_flight)

    def has_pending_unshard(self, key: Hashable) -> bool:
        return key in self._all_gathers

    def use_gathered(self) -> None:
        """A flat parameter about to be used was gathered and waited for
        already (a coalesced all-gather's follower, a unit kept gathered):
        nothing is issued, and a buffer held back by ``free_unsharded``'s
        ``defer`` is freed now, as an issue would free it (this one's
        buffer was allocated before, so no all-gather is handed that block
        here; the next one waits for its free)."""
        self._run_deferred_free()

    def free_unsharded(self, key: Hashable, free: Callable[[], None], *, defer: bool = False) -> None:
        """The host is done with ``key``'s unsharded buffer (every use of it
        is enqueued on compute): make compute wait for any fill still
        pending, then ``free`` it — now, or, with ``defer`` and no all-gather
        in flight, right after the next all-gather allocated its own buffer,
        so that one cannot reuse this block. The next all-gather after the
        free waits for this moment of compute. See [Note: what a lane waits
        for]."""
        self.wait_for_unshard(key)
        self._run_deferred_free()
        event = self.all_gather_lane.mark_compute()
        if event is None:
            free()  # CPU: no reader left
        elif defer and not self._all_gathers:
            self._deferred_free = _DeferredFree(key, free, event)
        else:
            free()
            self._all_gather_after.append(event)

    def mark_shards_written(self) -> None:
        """Compute may have written shards (a forward or backward starts, or
        user hooks ran): the next all-gather waits for everything compute
        has queued so far (see [Note: what a lane waits for])."""
        self._shards_written = self.all_gather_lane.mark_compute()

    def _run_deferred_free(self) -> None:
        deferred, self._deferred_free = self._deferred_free, None
        if deferred is not None:
            deferred.free()
            self._all_gather_after.append(deferred.event)

    # ----------------------------------------------------------- reductions
    def reduce(
        self,
        launch: Callable[[bool], PendingCollective | None],
        on_done: Callable[[PendingCollective], None],
        *,
        finish_on_lane: bool = False,
        written: torch.cuda.Event | None = None,
    ) -> None:
        """Issue a gradient reduction; ``on_done`` runs once it finished
        (when a later reduction pushes it out, or in ``wait_for_reductions``),
        and not at all if ``launch`` returned None: on the compute side, or,
        with ``finish_on_lane``, on the reduction lane after it (for work only
        the host reads, after ``synchronize_host``: the offloaded gradient
        downloads; see [Note: lane fences])."""
        self.issue_bucket()  # held reductions go first: every rank issues in one order
        while len(self._reductions) >= self.MAX_REDUCTIONS_IN_FLIGHT:
            self._finish_reduction(self._reductions.pop(0))
        # Issued from the post-accumulate-grad hook: compute has just queued
        # the write of the gradient it reads (see [Note: what a lane waits
        # for]); a bucket's held gradients were written at its last hold.
        if written is None:
            written = self.reduce_scatter_lane.mark_compute()
        in_flight = self.reduce_scatter_lane.issue(
            lambda: launch(self.reduce_scatter_lane.async_op), after=() if written is None else (written,)
        )
        self._reductions.append(_Reduction(in_flight, on_done, finish_on_lane))

    def reduce_together(
        self,
        key: Hashable,
        nbytes: int,
        item: object,
        launch: Callable[[list, bool], PendingCollective | None],
        on_done: Callable[[list, PendingCollective], None],
    ) -> None:
        """Hold a reduction of ``nbytes`` that may share one collective with
        the next ones of the same ``key``; the bucket is issued as one
        ``reduce`` (``launch(items, async_op)``, ``on_done(items,
        pending)``) before it would exceed ``bucket_bytes``, once it is
        full, before any other reduction, and at every wait for reductions
        ([Note: coalesced reductions] in runtime/grad_buckets.py)."""
        bucket = self._bucket
        if bucket is not None and (bucket.key != key or bucket.nbytes + nbytes > self.bucket_bytes):
            self.issue_bucket()
        if self._bucket is None:
            self._bucket = _Bucket(key, launch, on_done)
        self._bucket.items.append(item)
        self._bucket.nbytes += nbytes
        # Its gradient is written now: the bucket's collective waits for the
        # last such write only, not for compute enqueued after it.
        self._bucket.written = self.reduce_scatter_lane.mark_compute()
        if self._bucket.nbytes >= self.bucket_bytes:
            self.issue_bucket()

    def issue_bucket(self) -> None:
        """Issue the held reductions' collective (no-op when none is held)."""
        bucket, self._bucket = self._bucket, None
        if bucket is not None:
            items = bucket.items
            self.reduce(
                lambda async_op: bucket.launch(items, async_op),
                lambda pending: bucket.on_done(items, pending),
                written=bucket.written,
            )

    def wait_for_reductions(self) -> None:
        """Wait for every issued reduction, oldest first, and finish each;
        compute is then ordered after all of the reduction lane's work."""
        self.issue_bucket()
        self._finish_issued_reductions()

    def _finish_issued_reductions(self) -> None:
        reductions, self._reductions = self._reductions, []
        for reduction in reductions:
            self._finish_reduction(reduction)
        self._wait_for_post_reduce()

    def abandon_reductions(self) -> None:
        """Wait for every issued reduction's collective, but run none of
        their ``on_done``: a backward that raised left them, and their
        results must not reach ``.grad`` after the user cleared it (the
        collectives still complete, as every rank issued them). Held
        reductions are dropped: no rank issued them."""
        self._bucket = None
        reductions, self._reductions = self._reductions, []
        for reduction in reductions:
            self.reduce_scatter_lane.wait(reduction.in_flight)
        self._wait_for_post_reduce()

    @property
    def prefetches_backward_after_reduction(self) -> bool:
        """Whether a unit's backward prefetch waits until its reduction was
        issued ([Note: backward prefetch on CPU] in runtime/prefetch.py)."""
        return self.reduce_scatter_lane.shares_host_memory

    def unit_backward_starts(self) -> None:
        """A unit's gradient computation is about to start. Where compute
        shares host memory with the collectives, finish the reduction in
        flight that still holds compute's buffers (the padded gradient a
        backend reduces in place or still reads), so the backward's peak
        holds one unit's gradient ([Note: backward prefetch on CPU] in
        runtime/prefetch.py); those that copied their inputs out (shared
        memory) stay in flight."""
        if self.reduce_scatter_lane.shares_host_memory:
            self.wait_for_reductions_holding_inputs()

    def wait_for_reductions_holding_inputs(self) -> None:
        """Finish the reductions in flight (oldest first) if one of them
        still holds buffers compute allocated."""
        if any(r.in_flight.pending is not None and r.in_flight.pending.inputs for r in self._reductions):
            self._finish_issued_reductions()  # held ones stay held: they hold no backend's buffer

    def _finish_reduction(self, reduction: _Reduction) -> None:
        # The fence first, also when nothing was returned: the launch may
        # still have enqueued work (see [Note: lane fences]).
        in_flight = reduction.in_flight
        self.reduce_scatter_lane.wait(in_flight)
        pending = in_flight.pending
        if pending is None:
            return
        # Compute is ordered after everything the collective read (on CPU the
        # backend is done with it): its inputs go now, before the finish
        # allocates ([Note: buffer lifetimes across lanes]).
        pending.inputs = ()
        if not reduction.finish_on_lane:
            reduction.on_done(pending)
            return
        self._wait_for_post_reduce()  # one finish in flight on the lane
        event = self.reduce_scatter_lane.follow(lambda: reduction.on_done(pending))
        self._post_reduce = InFlight(pending, event)

    def _wait_for_post_reduce(self) -> None:
        """Make compute wait for the last finish run on the reduction lane,
        then release what it read."""
        post_reduce, self._post_reduce = self._post_reduce, None
        if post_reduce is not None and post_reduce.event is not None:
            self.reduce_scatter_lane.wait(InFlight(None, post_reduce.event))

    def wait_for_all(self) -> None:
        """Drain both lanes and run the deferred free (end of backward, or
        before a state change): between steps no free is deferred."""
        for key in list(self._all_gathers):
            self.wait_for_unshard(key)
        self.wait_for_reductions()
        self._run_deferred_free()

    # ------------------------------------------------------------------ host
    def synchronize_host(self) -> None:
        """Block the calling thread until the compute stream finished all
        work enqueued so far (no-op on CPU): call after ``wait_for_all``,
        after which compute has waited on every lane's fences, the
        post-reduce fence of the gradient downloads included. The host's
        single wait for device copies from and to pinned host memory: see
        "The host is a third party" in [Note: lane fences]."""
        if self.device.type == "cuda":
            # Host-device sync: the optimizer reads the downloaded gradients
            # and writes the shards uploads read, on the host, next.
            torch.cuda.current_stream(self.device).synchronize()


class _Reduction(NamedTuple):
    """An issued reduction and how to finish it."""

    in_flight: InFlight
    # Run once the reduction is done (see ``Scheduler.reduce``).
    on_done: Callable[[PendingCollective], None]
    # Whether ``on_done`` runs on the reduction lane (downloads for the host).
    finish_on_lane: bool


@dataclass(eq=False)
class _Bucket:
    """Reductions held to share one collective (see ``reduce_together``)."""

    key: Hashable
    launch: Callable[[list, bool], PendingCollective | None]
    on_done: Callable[[list, PendingCollective], None]
    items: list = field(default_factory=list)
    nbytes: int = 0
    # Compute's event at the latest hold (None on CPU).
    written: torch.cuda.Event | None = None


class _DeferredFree(NamedTuple):
    """An unsharded buffer whose free waits for the next all-gather's
    allocation (see [Note: what a lane waits for])."""

    key: Hashable
    # Frees the buffer's storage (a no-op if it was refilled meanwhile).
    free: Callable[[], None]
    # Recorded on compute after the buffer's last use was enqueued.
    event: torch.cuda.Event
