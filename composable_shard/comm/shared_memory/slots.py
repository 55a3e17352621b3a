"""Owns: the slots' protocol of one group's shared memory: numbering rounds
and claiming their slots, publishing a written round, waiting until peers
wrote or read one (polling with back-off, their liveness, timeouts), the
work that completes an issued collective (``SharedMemoryWork``), and one
thread at a time.

Knows nothing of: what a round's bytes are (``collectives``), how the files
are made and mapped (``files``), which groups use shared memory
(``comm.transport``), parameters, modules, streams.

Public names: ``SlotRing``, ``SharedMemoryWork``, ``prepare_for_compile``,
``signature_of``, ``ALL_GATHER``, ``REDUCE_SCATTER``, ``ALL_REDUCE``,
``ALL_TO_ALL``, ``PUBLISH``.

[Note: slots and waits]
Every rank's file has ``SLOTS`` slots. A collective moves its bytes in
rounds of at most one slot; rounds take slots round-robin and every rank
numbers them alike (collectives are issued in the same order on every
rank). The header holds, per slot, the last round this rank finished
writing (with its operation's kind and size, which peers check: ranks that
issue different collectives get an error naming both, not each other's
bytes) and the last one it finished reading from its peers.

- issue, per round: until every peer has read the round that last used this
  slot, wait; write this rank's bytes; publish the round ("written").
- wait, per round still unread: until every peer's "written" entry shows the
  round, wait; read their bytes; publish "read".

Reuse cannot deadlock: before waiting for its peers to read a slot, a rank
reads its own older round there (its peers wrote it: same order), so the
ranks that wrote the fewest rounds read first. A round of more than
``SLOTS`` back is read during the issue (streaming; the wait reads the last
``SLOTS``). A dropped work (freed unwaited) counts as read.

Waiting reads the peers' headers with ``pread`` and, while one is behind,
sleeps in the kernel on its entry until the peer, having written it, wakes
it ([Note: waking a waiting peer] in futex.py), or until the next liveness
check: no thread spins (spinning even 50 us slowed the fast path on an
oversubscribed machine, docs/design/comm.md), and a peer that comes is
seen within a wake-up (about 8 us here), not at the end of a pause (the
shortest ``time.sleep`` lasts 80 us on a 2-core VM). Where the kernel has
no futexes the wait polls with back-off instead: pauses start at 5 us and grow
by half up to 0.2 ms, so waits under about 2 ms (the fast path, and a peer
a little behind) overshoot little; past that each pause may grow to a tenth
of the time waited so far (a peer that comes is seen at most that fraction
late), at most 20 ms: a peer seconds late costs one poll and one wake-up
per 20 ms (50-70 us of CPU each on a busy 2-core VM), 0.4-0.6% of a core in
the waiting thread over 1.5 s where a 0.2 ms cap cost 4-9% (measured by
test_waiting_for_a_late_peer_costs_under_one_percent_of_a_core; a longer
cap costs less CPU but notices a peer later).
Every ``_LIVENESS_PERIOD_S`` of waiting it polls the peers' pidfds; a dead
peer fails the wait naming it, a live one that does not come fails it at
the group's timeout (or ``wait(timeout=...)``'s; a timed-out wait may be
retried). A failure after a round was published, or a dead
peer, fails every later call at once.

A round is numbered when it is published, not when its slot is claimed: a
failure before that (a claim that times out, a reservation refused by a
full ``/dev/shm``) leaves this rank's numbering where its peers expect it,
so the same call retried takes the same round and pairs with what the peers
published (test_failed_round_before_publishing_leaves_the_group_usable).

Ordering: header entries are written and read through system calls by one
thread at a time, after the bytes were copied; on x86-64 stores become
visible in program order, so a peer that sees the entry sees the bytes.
Another thread that calls in while one is inside gets an error at once.

Pinned by tests/comm/test_shared_memory.py
(test_more_operations_in_flight_than_slots_stay_correct,
test_late_peer_in_the_middle_of_a_streamed_collective_times_out_at_issue,
test_wait_timeout_and_group_timeout_end_a_wait_for_a_late_peer,
test_collective_from_a_second_thread_at_the_same_time_is_refused,
test_ranks_issuing_different_collectives_get_an_error_not_wrong_data),
tests/comm/test_shared_memory_all_to_all.py
(test_all_to_all_beside_another_collective_gets_an_error_not_wrong_data) and
tests/comm/test_failures.py (killed and stopped peers).
"""

from __future__ import annotations

import datetime
import os
import select
import struct
import sys
import threading
import time
import weakref
from typing import Any, Callable

import torch
from torch.distributed import ProcessGroup

from ..tags import current_tag, name_of
from .eager import build_eager_versions, eagerly, outside_graph
from .files import HEADER, SLOTS, GroupFiles
from .futex import FUTEX_SUPPORTED, wait_while_equal, wake_all

__all__ = [
    "SlotRing",
    "SharedMemoryWork",
    "prepare_for_compile",
    "signature_of",
    "ALL_GATHER",
    "REDUCE_SCATTER",
    "ALL_REDUCE",
    "ALL_TO_ALL",
    "PUBLISH",
]

# One header entry (a round's number), and the published pair (signature,
# number) of a written round; see ``files.HEADER``.
_ENTRY = struct.Struct("<q")
_PUBLISHED = struct.Struct("<2q")
ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL, PUBLISH = 1, 2, 3, 4, 5
# What each kind is called in errors.
_KINDS = {
    ALL_GATHER: "all-gather",
    REDUCE_SCATTER: "reduce-scatter",
    ALL_REDUCE: "all-reduce",
    ALL_TO_ALL: "all-to-all",
    PUBLISH: "publish of shards",
}
# How often a wait looks whether its peers' processes are still alive: one
# poll of their pidfds, so the hot path makes no system call for it.
_LIVENESS_PERIOD_S = 0.05
# A wait's back-off (see the Note): pauses start at _FIRST_PAUSE_S and grow
# by half up to _SHORT_WAIT_PAUSE_S, or, once the wait is longer, up to
# _PAUSE_FRACTION of the time waited so far, at most _MAX_PAUSE_S.
_FIRST_PAUSE_S = 5e-6
_SHORT_WAIT_PAUSE_S = 2e-4
_PAUSE_FRACTION = 0.1
_MAX_PAUSE_S = 20e-3
# A signature's bits: kind (3), bytes per rank (43: up to 8 TiB), tag above.
_KIND_BITS = 3
_TAG_SHIFT = 46
# The timeout of a group whose backend does not say (torch's default).
_DEFAULT_TIMEOUT_S = 1800.0


def signature_of(kind: int, nbytes: int) -> int:
    """What a peer must have written for the same operation: every rank
    writes the same number of bytes for a given collective, tagged with the
    same unit ([Note: tagged collectives] in comm/tags.py)."""
    return (current_tag() << _TAG_SHIFT) + (nbytes << _KIND_BITS) + kind


class SlotRing:
    """The rounds of one group's collectives on this rank, over its files."""

    def __init__(self, group: ProcessGroup, files: GroupFiles) -> None:
        # A weak reference to the group (for its timeout, read at every wait:
        # ``set_timeout`` may change it): the files close when it goes away.
        self._group = weakref.ref(group)
        self.files = files
        self.rank = files.rank
        self.world_size = files.world_size
        self._liveness = select.poll()
        for pidfd in files.pidfds.values():
            self._liveness.register(pidfd, select.POLLIN)
        self._next_seq = 1  # header entries start at 0: "nothing read yet"
        # Per slot, this rank's work that used it last and its round's number.
        self._slot_rounds: list[tuple[weakref.ReferenceType[SharedMemoryWork], int] | None] = [None] * SLOTS
        # Held by the thread inside a collective.
        self._busy = threading.Lock()
        # Set once a peer died or a stream broke: every later call raises it.
        self.failure: RuntimeError | None = None
        # Whether waits sleep on futexes (else they poll: [Note: waking a
        # waiting peer] in futex.py); off for good once the kernel refuses one.
        self._futexes = FUTEX_SUPPORTED

    def enter(self, what: str) -> None:
        """Take the ring for one call (issue or wait), or refuse: the group
        failed (every later call fails at once), or another thread is inside
        a call."""
        if self.failure is not None:
            raise self.failure
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"composable_shard shared-memory collectives: {what} was issued from thread "
                f"'{threading.current_thread().name}' while another thread was inside a collective of the same "
                "process group. Issue a group's collectives from one thread at a time (every rank must issue them "
                f"in the same order), or give each thread its own process group."
            )

    def leave(self) -> None:
        self._busy.release()

    def claim_slot(self) -> tuple[int, int]:
        """The next round's slot and number, once every peer read the round
        that used the slot before (this rank reads its own first). The
        number is taken by ``publish``: a failure before leaves it free."""
        seq = self._next_seq
        slot = seq % SLOTS
        previous = self._slot_rounds[slot]
        if previous is not None:
            earlier_ref, earlier_seq = previous
            earlier = earlier_ref()
            if earlier is not None:
                earlier._complete(earlier_seq, None)  # read our own older round first: see the Note
        if seq > SLOTS:
            self.await_peers(slot, seq - SLOTS, written=False, timeout_s=None)
        return slot, seq

    def publish(self, work: "SharedMemoryWork", slot: int, seq: int, start: int, length: int) -> None:
        """Announce round ``seq`` written (its bytes already copied: system
        calls on one thread, in order; the signature comes first in the
        pair, so a peer that sees the number sees it too), pending in ``work``."""
        os.pwrite(self.files.fds[self.rank], _PUBLISHED.pack(work.signature, seq), (SLOTS + 2 * slot) * _ENTRY.size)
        self._wake_peers(SLOTS + 2 * slot + 1)
        self._next_seq = seq + 1
        work._pending.append((slot, seq, start, length))
        self._slot_rounds[slot] = (weakref.ref(work), seq)

    def mark_read(self, slot: int, seq: int) -> None:
        os.pwrite(self.files.fds[self.rank], _ENTRY.pack(seq), slot * _ENTRY.size)
        self._wake_peers(slot)

    def _wake_peers(self, entry: int) -> None:
        """Wake the peers sleeping on this rank's header ``entry``, just
        written (also where this rank's own waits fell back to polling: its
        peers' may not have)."""
        if FUTEX_SUPPORTED:
            wake_all(self.files.header_addresses[self.rank] + entry * _ENTRY.size)

    def await_peers(self, slot: int, seq: int, *, written: bool, timeout_s: float | None, signature: int = 0) -> None:
        """Until every peer has written (``written``: the same kind and size
        of operation as ``signature``) or read round ``seq`` of ``slot``."""
        if written:
            self.await_entry(SLOTS + 2 * slot + 1, seq, signature, timeout_s, "round {}")
        else:
            self.await_entry(slot, seq, None, timeout_s, "round {}, waiting for its slot to be read", seq + SLOTS)

    def await_entry(
        self,
        entry: int,
        seq: int,
        signature: int | None,
        timeout_s: float | None,
        where: str,
        named: int | None = None,
        verb: str = "",
    ) -> None:
        """Until every peer's header ``entry`` reaches ``seq`` (with
        ``signature``, the entry before it must hold it: the same kind and
        size of operation): reads their headers, sleeping on a late peer's
        entry until it is written (or polling with back-off without
        futexes), and every ``_LIVENESS_PERIOD_S`` of waiting, whether they
        are alive. ``where`` names the operation in errors, a template
        filled with ``named`` (default ``seq``) only when one is raised
        ("round {}"); ``verb`` what a late peer did not do (default: write
        it, or read it without a signature)."""
        started, deadline, next_check, pause = 0.0, 0.0, 0.0, _FIRST_PAUSE_S
        peers = [peer for peer in range(self.world_size) if peer != self.rank]
        seen = 0  # the first waited-for peer's entry, as last read
        while True:
            waiting: list[int] = []
            for peer in peers:
                header = HEADER.unpack(os.pread(self.files.fds[peer], HEADER.size, 0))
                if header[entry] < seq:
                    if not waiting:
                        seen = header[entry]
                    waiting.append(peer)
                elif signature is not None and header[entry - 1] != signature:
                    raise RuntimeError(
                        f"composable_shard shared-memory collective ({where.format(seq if named is None else named)}): "
                        f"rank {peer} of the group issued "
                        f"{_describe(header[entry - 1])} where this rank (rank {self.rank}) issued "
                        f"{_describe(signature)}. Every rank must run the same collectives in the same order "
                        "(the same modules in forward and backward, the same no_sync and state-dict calls); mark "
                        "units that some ranks skip (conditional compute) with composable_shard.set_may_be_skipped."
                    )
            peers = waiting
            if not peers:
                return
            now = time.monotonic()
            if not deadline:  # the first wait: nothing was ready
                limit = self._group_timeout_s() if timeout_s is None else timeout_s
                started, deadline, next_check = now, now + limit, now + _LIVENESS_PERIOD_S
            elif now >= next_check:
                operation = _operation(where.format(seq if named is None else named), signature)
                self._check_alive(operation)
                next_check = now + _LIVENESS_PERIOD_S
                if now > deadline:
                    verb = verb or ("write" if signature is not None else "read")
                    self._time_out(peers, operation, verb, timeout_s)
            if self._futexes:
                # Until that peer writes the entry (or the next liveness check).
                address = self.files.header_addresses[peers[0]] + entry * _ENTRY.size
                if wait_while_equal(address, seen, next_check - now):
                    continue
                self._futexes = False  # refused: poll from now on
            time.sleep(pause)
            pause = min(pause * 1.5, max(_SHORT_WAIT_PAUSE_S, (now - started) * _PAUSE_FRACTION), _MAX_PAUSE_S)

    def publish_entry(self, entry: int, values: bytes) -> None:
        """Write ``values`` (packed entries) into this rank's header from
        ``entry`` on and wake the peers sleeping on the last of them."""
        os.pwrite(self.files.fds[self.rank], values, entry * _ENTRY.size)
        self._wake_peers(entry + len(values) // _ENTRY.size - 1)

    def _check_alive(self, operation: str) -> None:
        """Raise (and fail every later call) if a peer's process exited."""
        exited = {pidfd for pidfd, _ in self._liveness.poll(0)}
        if not exited:
            return
        facts = self.files.facts
        dead = sorted(peer for peer, pidfd in self.files.pidfds.items() if pidfd in exited)
        who = ", ".join(f"rank {peer} (global rank {facts[peer].global_rank}, pid {facts[peer].pid})" for peer in dead)
        self.failure = RuntimeError(
            f"composable_shard: communication failure in a shared-memory {operation}: "
            f"{who} of the group exited while this rank (rank {self.rank}) waited for it. The group cannot go on; "
            "see that rank's own output for why it exited."
        )
        raise self.failure

    def _group_timeout_s(self) -> float:
        group = self._group()
        return _DEFAULT_TIMEOUT_S if group is None else _group_timeout_s(group)

    def _time_out(self, peers: list[int], operation: str, verb: str, timeout_s: float | None) -> None:
        limit = self._group_timeout_s() if timeout_s is None else timeout_s
        source = "the group's timeout" if timeout_s is None else "the timeout given to wait()"
        raise RuntimeError(
            f"composable_shard: communication timeout in a shared-memory {operation}: "
            f"ranks {peers} of the group did not {verb} it within {limit:g} s ({source}). "
            "They are alive but stuck, or issue collectives in another order."
        )


class SharedMemoryWork:
    """An issued shared-memory collective; ``wait`` completes it (idempotent).

    Its inputs were copied out when it was issued: unlike a gloo or NCCL
    work, nothing needs to keep them alive until the wait."""

    def __init__(self, ring: SlotRing, signature: int, read: Callable[[int, int, int], None]) -> None:
        self._ring: SlotRing | None = ring
        # The kind and size every peer must have written for it.
        self.signature = signature
        self._read: Callable[[int, int, int], None] | None = read
        # Rounds published and not yet read, oldest first: (slot, number,
        # start, length) of the bytes it moved per peer.
        self._pending: list[tuple[int, int, int, int]] = []

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """As ``Work.wait``: blocks until the result is in the output, at most
        ``timeout`` (positional or keyword: a ``timedelta`` or seconds; none
        or zero: the group's timeout), and raises once a peer died. Past
        the timeout it raises a ``RuntimeError`` naming the collective, the
        late ranks and the timeout; a timed-out wait may be retried."""
        if torch.compiler.is_compiling():
            return eagerly(SharedMemoryWork._wait_eagerly)(self, _timeout_s(timeout))
        return self._wait_eagerly(_timeout_s(timeout))

    _traced_wait = wait  # ``wait`` before ``prepare_for_compile`` (see there)

    @outside_graph
    def _wait_eagerly(self, timeout_s: float | None) -> bool:
        ring = self._ring
        if ring is None:
            return True
        ring.enter("a wait")
        try:
            self._complete(None, timeout_s)
        finally:
            ring.leave()
        return True

    def wait_held(self) -> None:
        """``wait`` (the group's timeout) from inside a call that already
        holds the ring: a collective made of several operations, whose
        later ones need the first's result (the all-to-all)."""
        self._complete(None, None)

    def _complete(self, through: int | None, timeout_s: float | None) -> None:
        """Read the pending rounds up to number ``through`` (None: all), in
        order, the caller holding the ring; each one's peers must have
        written it. The work is complete once none is pending."""
        ring = self._ring
        if ring is None:
            return
        while self._pending and (through is None or self._pending[0][1] <= through):
            slot, seq, start, length = self._pending[0]
            ring.await_peers(slot, seq, written=True, timeout_s=timeout_s, signature=self.signature)
            self._read(slot, start, length)  # type: ignore[misc]
            self._pending.pop(0)
            ring.mark_read(slot, seq)
        if through is None:
            self._ring, self._read = None, None

    def is_completed(self) -> bool:
        return self._ring is None

    def __del__(self) -> None:
        # Dropped without a wait (an error reset): peers must still be free
        # to reuse its slots, and nothing here will read them any more.
        ring = self._ring
        if ring is not None:
            try:
                for slot, seq, _, _ in self._pending:
                    ring.mark_read(slot, seq)
            except OSError:
                pass


def prepare_for_compile() -> None:
    """Build the eager versions of the functions marked ``outside_graph``
    if dynamo is loaded (importing it only for this would cost a second)."""
    if "torch._dynamo" not in sys.modules or SharedMemoryWork.wait is not SharedMemoryWork._traced_wait:
        return
    build_eager_versions()
    # Called from compiled code, a Python ``wait`` would be traced as a
    # frame of its own before its eager part (two graph breaks per call
    # site); disabled itself, it breaks once, where gloo's C++ ``wait`` does.
    SharedMemoryWork.wait = torch.compiler.disable(SharedMemoryWork._traced_wait)  # type: ignore[method-assign]


def _group_timeout_s(group: ProcessGroup) -> float:
    """The timeout the group's backend was given (``init_process_group`` or
    ``new_group``'s ``timeout``)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return _DEFAULT_TIMEOUT_S


def _timeout_s(timeout: Any) -> float | None:
    """A ``Work.wait`` timeout (a ``timedelta``, seconds, or none) in seconds."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"SharedMemoryWork.wait(timeout=...) takes a datetime.timedelta (as torch's Work.wait) or seconds, "
            f"got {type(timeout).__name__}: {timeout!r}"
        )
    return seconds if seconds > 0 else None  # torch's "no timeout given"


def _describe(signature: int) -> str:
    kind = _KINDS.get(signature % (1 << _KIND_BITS))
    named = "an unknown operation" if kind is None else f"{'an' if kind[0] == 'a' else 'a'} {kind}"
    return f"{named} writing {_size(signature)} bytes{_of_unit(signature)}"


def _size(signature: int) -> int:
    return (signature & ((1 << _TAG_SHIFT) - 1)) >> _KIND_BITS


def _of_unit(signature: int) -> str:
    tag = signature >> _TAG_SHIFT
    return f" for {name_of(tag)}" if tag else ""


def _operation(where: str, signature: int | None) -> str:
    """The collective a wait is for, in words, with its round's number (a
    wait for a slot's readers names the round that will reuse it)."""
    if signature is None:
        return f"collective ({where})"
    kind = _KINDS.get(signature % (1 << _KIND_BITS), "collective")
    return f"{kind} ({where}, {_size(signature)} bytes per rank{_of_unit(signature)})"
