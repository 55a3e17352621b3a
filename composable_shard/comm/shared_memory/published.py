"""Owns: the shards a rank publishes for one step, where its peers read them
(``PublishedShards``): their area in this rank's file and the shards that
live there, publishing (every rank arrives, then writes), all-gathers read
from the peers' areas, and a step's close (every rank ends it before a
shard living there changes).

Knows nothing of: which flat parameters publish, when a step starts or
ends (``runtime``), how files are made and mapped (``files``), how waits
sleep and time out (``slots``).

Public names: ``PublishedShards``.

[Note: published shards]
Measured on the many-small GPT (64 blocks of width 64, 2 ranks): the
ranks waited 30-50 ms a step for each other's all-gathers, a peer a few
ms behind at one round in two steps out of three, on either rank alike:
each all-gather of a unit needs the peer to have reached the same point,
so every stall of either rank (the machine's other work, a page fault)
stops both, where DDP's forward never waits; GPT 8 x 256's blocks waited
the same way (27-37 ms a step). Yet a shard does not change between the
start of a step's forward and the end of its backward (an optimizer step
there is refused: [Note: optimizer step between forward and backward] in
runtime/optimizer_checks.py). So every rank's shards are published in an
area of its own file once a step, at the root's forward, and the step's
all-gathers of them read every peer's shard from its area, where it lies:
no round, no slot, no waiting for the peer to reach the unit.

Publish ``n`` (every rank publishes the same groups in the same order, so
the numbers agree): this rank writes "arrived at ``n``" in its header, waits
until every peer arrived at ``n`` (a peer that arrived reads nothing of
publish ``n - 1`` any more: its step ended, since a forward cannot start
before the previous backward finished), copies into its area the shards
that do not live there, then writes "published ``n``" with a signature
(the kind and the area's size: ranks whose models differ get an error
naming both, not each other's bytes). An all-gather of publish ``n`` waits
until every peer published ``n`` (at once, but in the step's first
all-gathers) and copies each peer's piece of its area into that peer's
row; this rank's own row comes from its live shard. The one barrier a step,
at its start, stands where DDP's ranks meet at the end of backward. Waits
time out and notice dead peers as a round's do (``SlotRing.await_entry``).
Which shards publish, when a step's window opens and closes, and the check
that a published shard did not change in place meanwhile belong to the
runtime ([Note: all-gathers from published shards] in
runtime/published_shards.py). Pinned by
tests/comm/test_shared_memory_published.py.

[Note: shards that live in the area]
A copy of every shard in the area would cost the shards' bytes again
(12.8 MB a rank for GPT 8 x 256). So a shard moves into its slice of the
area for good (``home``: a tensor of its own over the slice; the runtime
puts it in the shard's place between steps) and is published with no copy
at all. Its owner then writes it in place (the optimizer, the user) while
peers may still read it: this rank's step may end (its backward returns)
while a peer still gathers in its own. So a step's end is a fence too:
``close(n)`` writes "closed ``n``" (entry ``n % CLOSED_ENTRIES`` of a ring in
the header) and, where every rank ends the step at the same call
(``wait``), waits until every peer wrote it, as DDP's ranks meet at their
last all-reduce. The ring lets up to
``MOST_OPEN`` publishes (roots sharing a group) be open at once; a peer's
entry at ``n`` or past it means it closed ``n``, since it cannot have
closed ``n + CLOSED_ENTRIES`` with ``n`` still open. Where a rank ends a
step alone (a reset after an error, a forward's autograd state dropped),
the runtime moves its shards out of the area first and closes without
waiting: its later writes go elsewhere, and the area keeps the step's
values until the next publish, which every peer must reach first. A shard
moves in (``home`` writes its slice at once, before any fence) only where
no peer may read that slice: no open publish holds it, and the last that
held it closed waiting (a peer that closed a tree's publish closed its
earlier ones: one tree's steps follow each other on every rank). The
mapping stays while a shard lives in it, also after the group is
destroyed (``files``).
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

import torch

from .files import ARRIVED_ENTRY, CLOSED_ENTRIES, CLOSED_ENTRY, PUBLISHED_ENTRY, GroupFiles
from .pieces import bytes_of
from .slots import _ENTRY, _KIND_BITS, _PUBLISHED, PUBLISH, SharedMemoryWork, SlotRing

__all__ = ["PublishedShards"]

# A published shard: its byte in the area, its bytes, what raises if it
# changed since, the publish's number, the shard (weakly).
_Entry = tuple[int, int, Callable[[], None], int, "weakref.ref[torch.Tensor]"]


class PublishedShards:
    """The published shards of one group on this rank: its area (every
    rank's, ``files.published_bytes`` each), the publishes' numbering, and
    the shards of steps still under way (published, not yet closed)."""

    # At most this many publishes open at once (the ring of "closed" entries).
    MOST_OPEN = CLOSED_ENTRIES

    def __init__(self, files: GroupFiles, slots: SlotRing) -> None:
        self.files = files
        self.slots = slots
        self.rank = files.rank
        self.world_size = files.world_size
        # The last publish this rank made (0: none yet).
        self.number = 0
        # A published shard's data pointer -> its entry (the shard held
        # weakly: another tensor at the same address later is not it).
        self._open: dict[int, _Entry] = {}
        # Open publish -> the first bytes of its shards in the area.
        self._open_numbers: dict[int, list[int]] = {}
        # Shards' first bytes in the area that a peer may still read for a
        # publish this rank closed without waiting ([Note: shards that live
        # in the area]).
        self._lingering: set[int] = set()

    @property
    def nbytes(self) -> int:
        """Bytes of every rank's area."""
        return self.files.published_bytes

    @property
    def open_publishes(self) -> int:
        """Publishes of this group not closed yet."""
        return len(self._open_numbers)

    def can_home(self, at: int) -> bool:
        """Whether no peer may read the shard at byte ``at`` of this rank's
        area now (no open publish holds it, and the last that held it was
        closed waiting for the peers): ``home`` may write it."""
        return at not in self._lingering and not any(at in ats for ats in self._open_numbers.values())

    def _signature(self) -> int:
        return (self.nbytes << _KIND_BITS) + PUBLISH  # no unit's tag: a publish is the group's

    def lives_in_area(self, at: int, shard: torch.Tensor) -> bool:
        """Whether ``shard`` is this rank's area from byte ``at`` (``home``'s)."""
        return self.nbytes > 0 and shard.data_ptr() == self.files.published_area(self.rank).data_ptr() + at

    def home(self, at: int, shard: torch.Tensor) -> torch.Tensor:
        """A copy of ``shard`` (1-D, contiguous) living in this rank's area
        from byte ``at``, a storage of its own: the caller puts it in the
        shard's place. Only where ``can_home``: peers read the area inside
        their steps."""
        nbytes = shard.numel() * shard.element_size()
        if not self.can_home(at) or at < 0 or at + nbytes > self.nbytes or shard.dim() != 1:
            raise ValueError(f"published shards: cannot keep a shard of {nbytes} bytes at byte {at} now")
        placed = self.files.own_published_slice(at, nbytes).view(shard.dtype)
        placed.copy_(shard)
        return placed

    def publish(self, shards: Sequence[tuple[int, torch.Tensor, Callable[[], None]]]) -> int:
        """Publish ``shards``, each with the byte in the area where it goes
        and a check that raises where it changed since (the caller's, which
        names what changed), run before each of its all-gathers: collective
        over the group, every rank publishing its own in the same call.
        Their all-gathers read the peers' areas from now until ``close``
        (of the number returned). A shard that lives in the area already
        (``home``) is not copied."""
        for at, shard, _ in shards:
            if at < 0 or at + shard.numel() * shard.element_size() > self.nbytes or not shard.is_contiguous():
                raise ValueError(
                    f"published shards: a shard of {shard.numel() * shard.element_size()} bytes at byte {at} does "
                    f"not fit the area of {self.nbytes} bytes (or is not contiguous)"
                )
        if len(self._open_numbers) >= self.MOST_OPEN:
            raise RuntimeError(f"published shards: {self.MOST_OPEN} publishes are open already; close one first")
        number = self.number + 1
        area = self.files.published_area(self.rank)
        copied = [(at, shard) for at, shard, _ in shards if not self.lives_in_area(at, shard)]
        self.slots.enter("a publish of shards")
        try:
            self.slots.publish_entry(ARRIVED_ENTRY, _ENTRY.pack(number))
            where = "publish {} of shards, every rank arriving"
            self.slots.await_entry(ARRIVED_ENTRY, number, None, None, where, verb="arrive at")
            targets = [area[at : at + shard.numel() * shard.element_size()] for at, shard in copied]
            if targets:
                torch._foreach_copy_(targets, [bytes_of(shard) for _, shard in copied])
            self.slots.publish_entry(PUBLISHED_ENTRY - 1, _PUBLISHED.pack(self._signature(), number))
        except BaseException as error:
            # Peers may wait for this publish, or have read a half-written area.
            self.slots.failure = RuntimeError(
                f"composable_shard: publish {number} of shards failed on rank {self.rank} ({error}); the group "
                "cannot go on."
            )
            raise
        finally:
            self.slots.leave()
        self.number = number
        self._open_numbers[number] = [at for at, _, _ in shards]
        for at, shard, check in shards:
            self._open[shard.data_ptr()] = (at, shard.numel() * shard.element_size(), check, number, weakref.ref(shard))
        return number

    def close(self, number: int, shards: Sequence[torch.Tensor], *, wait: bool) -> None:
        """Publish ``number``'s step ended on this rank: its shards'
        all-gathers go through rounds again, and this rank tells its peers
        it reads nothing more of their areas for it. With ``wait`` (where
        every rank closes alike: the end of a backward or of a forward
        without autograd), wait until every peer says the same: only then
        may this rank change a shard that lives in the area ([Note: shards
        that live in the area]). Without, a peer may read this rank's area
        for a while yet: none of its shards moves into it (``can_home``)
        until a close of theirs that waited."""
        for shard in shards:
            self._open.pop(shard.data_ptr(), None)
        ats = self._open_numbers.pop(number, [])
        if wait:
            self._lingering.difference_update(ats)
        else:
            self._lingering.update(ats)
        if self.slots.failure is not None:
            return  # the group cannot go on: its next call raises that
        entry = CLOSED_ENTRY + number % CLOSED_ENTRIES
        self.slots.enter("a close of published shards")
        try:
            self.slots.publish_entry(entry, _ENTRY.pack(number))
            if wait:
                where = "close of publish {} of shards, every rank's step ending"
                self.slots.await_entry(entry, number, None, None, where, verb="end its step at")
        finally:
            self.slots.leave()

    def entries(self, shards: Sequence[torch.Tensor]) -> list[_Entry] | None:
        """What was published of each of ``shards``, or None unless every
        one is published for a step under way."""
        if not self._open:
            return None
        entries = []
        for shard in shards:
            entry = self._open.get(shard.data_ptr())
            if entry is None or entry[4]() is not shard:
                return None
            entries.append(entry)
        return entries

    def holds(self, shards: Sequence[torch.Tensor]) -> bool:
        """Whether every one of ``shards`` is published for a step under way."""
        return self.entries(shards) is not None

    def all_gather(
        self, outputs: Sequence[torch.Tensor], shards: Sequence[torch.Tensor], entries: Sequence[_Entry]
    ) -> SharedMemoryWork | None:
        """Fill each output (``world_size`` rows of its shard's size) with
        every rank's shard of it, in rank order: this rank's from ``shards``,
        each peer's from its area as it published it (``entries``, of
        ``entries(shards)``). Complete when it returns (None: nothing to
        wait for; it waits for the peers' publish first)."""
        for _, _, check, _, _ in entries:
            check()  # before any wait: a rank that raises leaves the group as it was
        number = max(entry[3] for entry in entries)
        self.slots.enter("an all-gather of published shards")
        try:
            where = "all-gather of publish {} of shards"
            self.slots.await_entry(PUBLISHED_ENTRY, number, self._signature(), None, where)
            areas = [self.files.published_area(peer) for peer in range(self.world_size)]
            targets, sources = [], []
            for output, shard, (at, nbytes, _, _, _) in zip(outputs, shards, entries):
                rows = bytes_of(output).view(self.world_size, -1)
                if rows.shape[1] != nbytes:
                    raise ValueError(f"published shards: an output of {rows.shape[1]} bytes a rank for {nbytes}")
                for peer in range(self.world_size):
                    targets.append(rows[peer])
                    sources.append(bytes_of(shard) if peer == self.rank else areas[peer][at : at + nbytes])
            torch._foreach_copy_(targets, sources)
        finally:
            self.slots.leave()
        return None
