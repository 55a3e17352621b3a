"""Owns: a recording stand-in for ``torch.cuda``'s streams and events, with
the ordering rules of CUDA streams, so the scheduler's CUDA lanes can be
checked on CPU (CI has no GPU).

Knows nothing of: composable_shard (tests install it and describe memory
accesses themselves).

Public names: ``FakeCuda``, ``Op``, ``MemoryAudit``, ``happens_before``.

The model: every stream (and the host) keeps a vector clock. Enqueuing
work on a stream stamps it with the stream's clock; ``wait_stream`` and
``wait_event`` join another clock into the waiting stream; an event records
the clock of its stream (an unrecorded event waits for nothing, as on
CUDA); ``synchronize`` joins a stream's clock into the host's, and work the
host enqueues afterwards is ordered after what it waited for. Work A
happens before work B exactly when B's clock has seen A. ``MemoryAudit``
then reports every pair of conflicting accesses (one a write) that is not
so ordered — a data race on a GPU — and every allocation from a stream's
pool not ordered after the uses of the blocks freed into it (the caching
allocator hands a freed block back to its stream at once).

Installed with ``FakeCuda.installed()``, which patches ``torch.cuda.Stream``,
``Event``, ``current_stream`` and ``stream`` (the names the scheduler looks
up at call time) and restores them on exit; nothing touches a real device.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterator

import torch

__all__ = ["FakeCuda", "Op", "MemoryAudit", "happens_before"]

Clock = dict[str, int]


def _join(into: Clock, other: Clock) -> None:
    for name, count in other.items():
        if into.get(name, 0) < count:
            into[name] = count


@dataclass(frozen=True)
class Op:
    """One piece of work enqueued on a stream (or done by the host)."""

    stream: str
    seq: int
    clock: Clock = field(compare=False)
    what: str = ""


def happens_before(first: Op, second: Op) -> bool:
    """Whether ``first`` is finished before ``second`` may start."""
    return second.clock.get(first.stream, 0) >= first.seq


class FakeStream:
    """``torch.cuda.Stream`` as the scheduler uses it."""

    def __init__(self, cuda: FakeCuda, name: str, priority: int = 0) -> None:
        self.cuda = cuda
        self.name = name
        self.priority = priority
        self.clock: Clock = {}
        self.count = 0

    def enqueue(self, what: str) -> Op:
        """Work launched on this stream (a kernel, a copy, a collective)."""
        _join(self.clock, self.cuda.host.clock)  # what the host waited for is done
        self.count += 1
        self.clock[self.name] = self.count
        self.cuda.log.append(("launch", self.name, what))
        return Op(self.name, self.count, dict(self.clock), what)

    def wait_stream(self, other: FakeStream) -> None:
        self.cuda.log.append(("wait_stream", self.name, other.name))
        _join(self.clock, other.clock)

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log.append(("wait_event", self.name, event.label))
        if event.clock is not None:
            _join(self.clock, event.clock)

    def synchronize(self) -> None:
        self.cuda.log.append(("synchronize", self.name, ""))
        _join(self.cuda.host.clock, self.clock)

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    """``torch.cuda.Event``: records its stream's clock."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.clock: Clock | None = None
        cuda.events += 1
        self.label = f"event{cuda.events}"

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream if stream is not None else self.cuda.current
        self.cuda.log.append(("record", stream.name, self.label))
        self.clock = dict(stream.clock)

    def synchronize(self) -> None:
        if self.clock is not None:
            _join(self.cuda.host.clock, self.clock)


class FakeCuda:
    """One fake device: a compute (default) stream, the streams the code
    creates, the host, and a log of launches, records and waits."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []
        self.events = 0
        self.host = FakeStream(self, "host")
        self.compute = FakeStream(self, "compute")
        self.current = self.compute
        self.created: list[FakeStream] = []
        self.memory = MemoryAudit()

    def host_op(self, what: str) -> Op:
        """Work the host does itself (reads or writes host memory)."""
        return self.host.enqueue(what)

    def launch(self, what: str) -> Op:
        """Work launched on the current stream."""
        return self.current.enqueue(what)

    # ----------------------------------------------- the torch.cuda names
    def _stream_class(self, device: object = None, priority: int = 0) -> FakeStream:
        stream = FakeStream(self, f"stream{len(self.created) + 1}", priority)
        self.created.append(stream)
        return stream

    def _current_stream(self, device: object = None) -> FakeStream:
        return self.current

    @contextlib.contextmanager
    def _stream_context(self, stream: FakeStream) -> Iterator[None]:
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    @contextlib.contextmanager
    def installed(self) -> Iterator[FakeCuda]:
        names = {
            "Stream": self._stream_class,
            "Event": lambda *args, **kwargs: FakeEvent(self),
            "current_stream": self._current_stream,
            "stream": self._stream_context,
        }
        saved = {name: getattr(torch.cuda, name) for name in names}
        try:
            for name, value in names.items():
                setattr(torch.cuda, name, value)
            yield self
        finally:
            for name, value in saved.items():
                setattr(torch.cuda, name, value)


class MemoryAudit:
    """Accesses to named memory, and the races among them."""

    def __init__(self) -> None:
        self.accesses: dict[str, list[tuple[Op, bool]]] = defaultdict(list)
        # Accesses of blocks freed into each stream's pool (allocator reuse).
        self.pools: dict[str, list[tuple[Op, str]]] = defaultdict(list)
        self.races: list[str] = []

    def access(self, name: str, op: Op, *, write: bool) -> None:
        for previous, previous_write in self.accesses[name]:
            if (write or previous_write) and not happens_before(previous, op):
                self.races.append(
                    f"{op.what!r} on {op.stream} ({'write' if write else 'read'} of {name}) is not ordered after "
                    f"{previous.what!r} on {previous.stream} ({'write' if previous_write else 'read'})"
                )
        self.accesses[name].append((op, write))

    def free(self, name: str, *, allocated_on: str) -> None:
        """The host freed ``name``: its block may be handed to the next
        allocation on ``allocated_on``."""
        self.pools[allocated_on].extend((op, name) for op, _ in self.accesses.pop(name, []))

    def allocate(self, name: str, op: Op) -> None:
        """``op`` (on its stream) writes a block from that stream's pool,
        which may be any block freed into it."""
        for previous, freed in self.pools[op.stream]:
            if not happens_before(previous, op):
                self.races.append(
                    f"{op.what!r} on {op.stream} may reuse the block of {freed} before {previous.what!r} "
                    f"on {previous.stream} finished with it"
                )
        self.access(name, op, write=True)
