"""Owns: where and when communication runs — the lanes (a CUDA stream beside
the compute stream, or asynchronous gloo work on CPU), the fences between
them, keeping buffers alive until their consumer has finished, the limit on
all-gathers in flight, and the host's wait for the device.

Knows nothing of: parameters, modules (work is issued through callables and
tracked by opaque keys).

Public names: ``Scheduler``, ``Lane``, ``InFlight``.

[Note: lane fences]
Whatever a lane runs is fenced, whether or not it launched a collective: a
``launch`` may enqueue only copies and casts (the shard copied into its own
unsharded buffer when the shard group has one rank, gradients cast to the
reduction dtype) and return no ``PendingCollective``, and compute must still
not read what those kernels write before they ran. So ``issue`` always
returns an ``InFlight`` and the scheduler always keeps it until compute
waited on it (``wait_for_unshard``; reductions before ``on_done``).

Why that is enough on CUDA, from the stream semantics: kernels on one stream
run in the order they were enqueued; two streams are ordered only by events.
``CudaStreamLane.issue`` enqueues ``launch`` on the lane's stream and then
records an event on that stream. An event completes only once every piece
of work enqueued on its stream before the record has completed, whatever
that work is (a cast, a ``copy_`` from pinned host memory, an NCCL
collective: with ``async_op=False`` the process group makes the issuing
stream, here the lane, wait for its own NCCL stream before returning).
``wait`` makes the compute stream wait on that event (``wait_event``, no host
sync), so every kernel compute enqueues afterwards — building views, forward
and backward reading the unsharded buffer, finishing a reduction — runs after
all of the lane's work for that key. Before the fix an issue that returned no
collective recorded no event, and compute read a buffer the lane was still
filling (wrong results, NaN, at world size 1 and under ``NO_SHARD`` with
mixed precision or CPU offload). In the other direction, ``issue`` first
makes the lane wait on the compute events it is given, so the lane never
reads a gradient or a shard before compute finished writing it, nor reuses
a block compute still reads: which events, see [Note: what a lane waits
for]. On CPU the lane's copies run synchronously in the calling thread and
only gloo work is asynchronous; waiting on its handle orders the rest.

The host is a third party: CPU offload has the device read pinned host
memory (shard uploads) and write it (gradient downloads) without blocking
the host. The downloads — and everything else that finishes an offloaded
reduction: the hybrid all-reduce, the post-divide, the cast, and, when
accumulating, the upload and add — run on the reduction lane, after the
reduction in stream order (``Scheduler.reduce`` with ``finish_on_lane``),
so they never hold up the backward kernels compute runs meanwhile (issue
23, finding 2). Each such finish is fenced by one event recorded on the
lane after it, the post-reduce fence. Compute waits on it in two places:
before the next finish on the lane (one finish in flight: it may read a
block compute allocated — the gradient itself under ``NO_SHARD`` without a
cast — which the scheduler keeps referenced until then), and at the end of
backward (``wait_for_reductions``), so every later kernel is ordered after
every download. ``synchronize_host`` then blocks the calling thread until
the compute stream is done: a stream's synchronisation includes the event
waits enqueued on it, so this one wait covers the compute stream, every
fence compute waited on (uploads on the all-gather lane, reductions) and the
downloads on the reduction lane. The runtime calls it once at the end of
backward, before the optimizer may read the gradients or write the shards.
Finishes whose result stays on the device run on compute as before: the
user's post-accumulate-grad hooks read them on compute right away.

[Note: what a lane waits for]
A launch waits for exactly two things, never for everything compute has
queued: the producer of its input, and the last use of the memory it may
reuse. Each is an event recorded on compute (``Lane.mark_compute``, on the
stream current in the hook) and waited by the lane before the launch
(``issue(after=...)``):

- A reduction reads the gradient backward has just written: it is issued
  from the post-accumulate-grad hook right after that write, so its mark is
  recorded then. Its pool holds reduce-scatter outputs and casts the host
  freed after compute used them (the sharded gradient, freed by
  ``zero_grad``), all enqueued before that mark.
- An all-gather reads the shard. Compute (or, with CPU offload, the host)
  writes shards between steps only — the optimizer, the user, state-dict
  loads, the root's write-back — and, inside backward, in the user's
  post-accumulate-grad hooks (an optimizer in backward). The runtime calls
  ``mark_shards_written`` where a forward or a backward starts and after
  such hooks; the next all-gather waits on that mark, and every later one
  is behind it on the lane's stream. (Host writes end before the host
  enqueues the upload that reads them.)
- An all-gather allocates the unsharded buffer on its lane, and the caching
  allocator may hand it any block freed into the lane's pool ([Note: buffer
  lifetimes across lanes]); the last users of those blocks are compute
  kernels. Every free of an unsharded buffer goes through
  ``free_unsharded``, which records an event on compute after the host
  enqueued the buffer's last use, then frees the block; the next all-gather
  waits on the events of every block freed since the previous all-gather
  (blocks freed earlier were waited on by an earlier all-gather, so they are
  behind the lane's stream order). The lane's own temporaries (the upload,
  the cast source) are used on the lane only, in stream order.

Why that is enough, from the stream semantics: an event completes once
everything its stream had queued before the record completed; a stream
that waited on it runs nothing enqueued afterwards before that. So the
all-gather's reads of the shard and its writes into a reused block come
after the last compute write of the shard and after every compute kernel
that used the block. Nothing else on compute matters to it: the kernels of
the unit running now read their own buffer, which this launch cannot be
handed (it is still allocated).

Why events alone would not overlap anything: without prefetch, unit i+1's
all-gather is issued right after unit i's post-forward freed unit i's
buffer, so the newest block in the pool is unit i's, and its event IS the
end of unit i's forward: the all-gather could start only once unit i's
forward finished, and compute then waits for it (issue 23, finding 1). So
the post-forward of a unit inside the root's forward frees with ``hold``:
the scheduler keeps the block allocated (its event recorded) until the next
all-gather has allocated its own buffer, and frees it right after. Unit
i+1's all-gather then finds unit i-1's block in the pool, waits for the end
of unit i-1's forward, and runs during unit i's forward, as FSDP2 frees its
all-gather output only after the next unit's copy-in. The cost is one more
unit buffer allocated at the moment of that allocation (the plan's replay
counts it on CUDA: ``holds_freed_buffer`` in plan/memory.py). Nothing is
held when an all-gather is already in flight (a prefetch issued before the
unit's forward overlaps it already), in backward (the default
``BACKWARD_PRE`` prefetch is issued before the current unit's backward
kernels), for a unit run on its own, or past ``wait_for_all`` (end of
backward, ``reshard_held_units``): between steps nothing is held. A held
buffer is freed before its own unit is gathered again, since its storage is
refilled in place.

On CPU compute runs in the host's order: a block the host frees has no
pending reader and a shard the host wrote is written. ``mark_compute``
returns None, frees are immediate and nothing is held; gloo reads the shard
and writes the buffer from the backend's threads between the issue and the
wait. tests/test_scheduler_cuda_lanes.py checks these rules against a fake
of CUDA's stream semantics, with a 4-unit model.

[Note: buffer lifetimes across lanes]
Buffers are never tied to a stream through the caching allocator. The
allocator gives a freed block back to the stream it was allocated on, and
that stream's next allocation may reuse it at once; so a block is safe to
free on the host when every stream other than its own that uses it is
ordered before the allocating stream's next work. The scheduler keeps that
true in both directions:

- Lane work reading or writing a tensor that compute allocated (a gradient
  cast from, a shard copied from): ``launch`` puts every such tensor in the
  ``PendingCollective`` it returns, which the ``InFlight`` keeps referenced
  until compute waited on the fence; only then may compute's stream reuse
  the block, and all its later work is ordered after the fence. A finish
  run on the reduction lane (``finish_on_lane``) may read such a block too
  (the gradient under ``NO_SHARD``): its reduction stays referenced by the
  post-reduce ``InFlight`` until compute waited on that fence.
- Blocks allocated on a lane (unsharded buffers refilled in ``unshard``,
  all-gather sources, reduce-scatter outputs that become the sharded
  gradient) and freed by the host after compute used them (``reshard``,
  ``zero_grad``): the lane's next allocation waits on a compute event
  recorded after those uses — ``free_unsharded``'s event for an unsharded
  buffer, the mark taken when a reduction is issued for the reduction
  lane's blocks — so every use compute had enqueued before the free is
  ordered before the lane reuses the block ([Note: what a lane waits
  for]). Temporaries a lane both allocates and frees (the fp32 upload
  before the cast) are only used on that lane, in stream order; so are
  those of a finish on the lane (casts, the upload of the host gradient to
  accumulate into).

On CPU the "event" is the gloo work handle; waiting on it blocks the calling
thread only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, Hashable, NamedTuple, Protocol, Sequence

import torch

from .comm import PendingCollective

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

    def __init__(self, device: torch.device, *, limit_all_gathers: bool) -> None:
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
        # Compute events the next all-gather waits on: one per unsharded
        # buffer freed since the last all-gather, and the latest mark of
        # shard writes (see [Note: what a lane waits for]). Empty on CPU.
        self._all_gather_after: list[torch.cuda.Event] = []
        self._shards_written: torch.cuda.Event | None = None
        # The unsharded buffer freed last with ``hold``: allocated until the
        # next all-gather allocated its own (None: nothing held).
        self._held: _HeldFree | None = None
        # Issued reductions with what to do once each is done, in issue order.
        self._reductions: list[_Reduction] = []
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
        if key in self._all_gathers:
            return
        if self._held is not None and self._held.key == key:
            self._release_held()  # its storage is about to be refilled
        if self.limit_all_gathers:
            while len(self._all_gathers) >= self.MAX_ALL_GATHERS_IN_FLIGHT:
                oldest = next(iter(self._all_gathers))
                self.wait_for_unshard(oldest)
        after = self._all_gather_after
        if self._shards_written is not None:
            after.append(self._shards_written)
        self._all_gather_after, self._shards_written = [], None
        self._all_gathers[key] = self.all_gather_lane.issue(
            lambda: launch(self.all_gather_lane.async_op), after=after
        )
        # This launch allocated its buffer: the held block may go to the next.
        self._release_held()

    def wait_for_unshard(self, key: Hashable) -> None:
        """Make compute wait for ``key``'s all-gather (no-op if none pending)."""
        in_flight = self._all_gathers.pop(key, None)
        if in_flight is not None:
            self.all_gather_lane.wait(in_flight)

    def has_pending_unshard(self, key: Hashable) -> bool:
        return key in self._all_gathers

    def free_unsharded(self, key: Hashable, free: Callable[[], None], *, hold: bool = False) -> None:
        """The host is done with ``key``'s unsharded buffer (every use of it
        is enqueued on compute): make compute wait for any fill still
        pending, then ``free`` it — now, or, with ``hold`` and no all-gather
        in flight, right after the next all-gather allocated its own buffer,
        so that one cannot reuse this block. The next all-gather after the
        free waits for this moment of compute. See [Note: what a lane waits
        for]."""
        self.wait_for_unshard(key)
        self._release_held()
        event = self.all_gather_lane.mark_compute()
        if event is None:
            free()  # CPU: no reader left
        elif hold and not self._all_gathers:
            self._held = _HeldFree(key, free, event)
        else:
            free()
            self._all_gather_after.append(event)

    def mark_shards_written(self) -> None:
        """Compute may have written shards (a forward or backward starts, or
        user hooks ran): the next all-gather waits for everything compute
        has queued so far (see [Note: what a lane waits for])."""
        self._shards_written = self.all_gather_lane.mark_compute()

    def _release_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.free()
            self._all_gather_after.append(held.event)

    # ----------------------------------------------------------- reductions
    def reduce(
        self,
        launch: Callable[[bool], PendingCollective | None],
        on_done: Callable[[PendingCollective], None],
        *,
        finish_on_lane: bool = False,
    ) -> None:
        """Issue a gradient reduction; ``on_done`` runs once it finished
        (when a later reduction pushes it out, or in ``wait_for_reductions``),
        and not at all if ``launch`` returned None: on the compute side, or,
        with ``finish_on_lane``, on the reduction lane after it (for work only
        the host reads, after ``synchronize_host``: the offloaded gradient
        downloads; see [Note: lane fences])."""
        while len(self._reductions) >= self.MAX_REDUCTIONS_IN_FLIGHT:
            self._finish_reduction(self._reductions.pop(0))
        # Issued from the post-accumulate-grad hook: compute has just queued
        # the write of the gradient it reads (see [Note: what a lane waits for]).
        written = self.reduce_scatter_lane.mark_compute()
        in_flight = self.reduce_scatter_lane.issue(
            lambda: launch(self.reduce_scatter_lane.async_op), after=() if written is None else (written,)
        )
        self._reductions.append(_Reduction(in_flight, on_done, finish_on_lane))

    def wait_for_reductions(self) -> None:
        """Wait for every issued reduction, oldest first, and finish each;
        compute is then ordered after all of the reduction lane's work."""
        reductions, self._reductions = self._reductions, []
        for reduction in reductions:
            self._finish_reduction(reduction)
        self._wait_for_post_reduce()

    def wait_for_reductions_holding_inputs(self) -> None:
        """Finish the reductions in flight (oldest first) if one of them
        still holds buffers compute allocated: the padded gradient a backend
        reduces in place or still reads. Those that copied their inputs out
        (shared memory) stay in flight."""
        if any(r.in_flight.pending is not None and r.in_flight.pending.inputs for r in self._reductions):
            self.wait_for_reductions()

    def _finish_reduction(self, reduction: _Reduction) -> None:
        # The fence first, also when nothing was returned: the launch may
        # still have enqueued work (see [Note: lane fences]). Compute waits
        # for the collective only, so the blocks of its inputs that compute
        # allocated may be reused once the InFlight is dropped.
        in_flight = reduction.in_flight
        self.reduce_scatter_lane.wait(in_flight)
        pending = in_flight.pending
        if pending is None:
            return
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
        """Drain both lanes and free the held buffer (end of backward, or
        before a state change): between steps nothing is held."""
        for key in list(self._all_gathers):
            self.wait_for_unshard(key)
        self.wait_for_reductions()
        self._release_held()

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


class _HeldFree(NamedTuple):
    """An unsharded buffer whose free waits for the next all-gather's
    allocation (see [Note: what a lane waits for])."""

    key: Hashable
    # Frees the buffer's storage (a no-op if it was refilled meanwhile).
    free: Callable[[], None]
    # Recorded on compute after the buffer's last use was enqueued.
    event: torch.cuda.Event
