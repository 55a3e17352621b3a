"""Owns: all-gather and reduce-scatter between the processes of one host
through shared-memory files: their setup (agreed by every rank of a group),
their waits, and their failures (a dead or late peer, no room in
``/dev/shm``, a second thread).

Knows nothing of: parameters, modules, streams, scheduling, the gloo/NCCL
collectives (``comm.transport`` decides which collectives come here and
when a group sets up; the setup's agreement goes over the group's backend
as picklable objects; ``comm``'s callers keep their buffers alive).

Public names: ``HostSharedMemory``, ``SharedMemoryWork``,
``SharedMemoryUnavailable``, ``PLATFORM_SUPPORTED``, ``SLOTS``,
``SLOT_BYTES``, ``slot_reservation``, ``bytes_per_rank``,
``outside_graph``, ``eagerly``, ``prepare_for_compile``.

[Note: shared-memory collectives]
Why: on CPU, gloo moves every byte through TCP over loopback: the kernel
copies it twice and runs the TCP stack on gloo's own threads, which compete
with compute for the same cores. ``scripts/bench_comm.py`` at world size 2,
one thread per rank, 3.1 MiB unsharded, 40 interleaved calls each (median
wall time; median CPU time of rank 0's process, all threads): all-gather
3.00 ms (2.08 ms CPU) through gloo, 1.25 ms (1.13 ms CPU) here; gradient
reduction 5.58 ms (4.42 ms CPU) through gloo's reduce-scatter and 5.70 ms
(3.51 ms CPU) through its in-place all-reduce and chunk copy (see [Note:
gradient collective per backend] in comm/transport.py), 1.29 ms (1.23 ms CPU) here
(1.81 ms when the bytes still went through ``pwritev``/``preadv``). A
first version signalled "written" with a one-element gloo all-reduce per
operation; under load that cost more than the copies (1.6 ms per call in a
profile), so the signal is a header entry and no operation sends a message.
On a quiet machine the training step gains little from it (GPT 8x256: the
step moved within run-to-run noise); on a loaded one, where gloo's threads
take cores from compute, it gains most.

How: every rank of the group owns one file in ``/dev/shm``, unlinked as soon
as every rank opened every file (nothing outlives the processes). It has
``SLOTS`` slots of ``SLOT_BYTES`` each (rank 0's value, agreed at setup).
An operation moves its bytes in rounds of at most one slot each (an
all-gather: consecutive pieces of this rank's shard; a reduce-scatter: the
same piece of every chunk but this rank's, side by side, so every round
feeds every rank); an operation that fits one slot, the common case, is one
round. The header holds, per slot, the last round whose bytes this rank
finished writing (with its operation's kind and size, which peers check:
ranks that issue different collectives get an error naming both, not each
other's bytes) and the last one it finished reading from its peers; slot
``s`` starts at ``(s + 1)`` times the slot size rounded up to 64 KiB.
Rounds take slots round-robin and every rank numbers them alike
(collectives are issued in the same order on every rank, and every rank
splits one alike). Slots are mapped into every process (``mmap``), so bytes
move with one ``copy_`` each way: through ``pwritev``/``preadv`` the same
moves took about twice as long (1.6 MB from and to buffers not in cache:
0.33 and 0.32 ms against 0.16 and 0.18 ms), and the reduce-scatter needed a
scratch chunk to add from.

- issue, per round: until every peer has read the round that last used this
  slot (their "read" entries; normally true already), wait; copy this
  rank's bytes into its slot; then publish the round in the "written" entry.
- wait, per round still unread: until every peer's "written" entry shows the
  round, wait; copy their bytes from their slots straight into the output
  (reduce-scatter: this rank's own chunk was copied into it at issue, the
  peers' pieces are added to it in rank order, read where they lie, so each
  element sums in the same order as in one round); publish the "read" entry.

The slot size was chosen with both transports in the same processes, calls
interleaved (world size 2, one thread per rank, 2 shared cores under heavy
load, median of 30; all-gather / reduce-scatter ms): at 4 MiB unsharded,
slots sized by the operation 0.93 / 0.85, 4 slots of 1, 2, 4 MiB
1.02 / 0.96, 0.88 / 0.92, 0.90 / 0.92; at 80 MiB unsharded (a block of a
GPT of width 1280) 14.7 / 14.8 against 15.6 / 15.2, 16.1 / 15.2,
15.6 / 16.1 (10 to 20 rounds: within the run's noise, a few percent at
most). 2 MiB keeps a 7.4M GPT's collectives (1.6 MB per rank) in one round
and costs 8 MiB per rank (Docker's default 64 MiB ``/dev/shm`` holds 7 ranks).
In training (``scripts/bench.py``, 2 ranks, the slots of the operation's
size and these as two modes of one interleaved run, under heavy load): GPT
8 x 256 median step 2296 / 2240 ms, peak RSS per rank 194 / 190 MB; GPT
4 x 1280 (the 326M model's 79 MB blocks, 20 rounds per collective) 15380 /
15357 ms, 1142 / 1073 MB.

Streaming (an operation of more rounds than ``SLOTS``): its round ``k`` reuses
the slot of its own round ``k - SLOTS``, which every peer must have read
first, and peers read during their own calls only (no thread serves them).
So the issue itself streams: before claiming a slot a rank reads its own
older round there (the rule below: reading early is harmless), then waits
for its peers to have read it, which they do when they reach the same round
of the same operation. Every rank thus reads all but the last ``SLOTS``
rounds during the issue, in step with its peers (a large operation's issue
returns once every peer has issued it too); the wait reads the last
``SLOTS``. An operation of at most ``SLOTS`` rounds issues as before,
asynchronously: it waits for nobody but the readers of its slots' older
rounds. Doing the whole stream at the wait instead would not make it more
asynchronous: the next collective's issue would have to finish it first (it
needs those slots), and what is copied costs the same CPU either way.

Waiting polls the peers' headers with ``pread`` and sleeps with back-off
(5 us, growing by half each time up to 0.2 ms, so a wait overshoots little
and a long one costs a few microseconds of CPU per 0.2 ms): no thread spins
and no gloo thread competes with compute. Reuse cannot deadlock: before
waiting for its peers to read a slot, a rank finishes its own older round
on that slot (reading early is harmless; its peers wrote it, since they
issue in the same order), so no two ranks wait on each other: the ranks
that wrote the fewest rounds read first and then wait only for ranks that
wrote as many or more, which read that round before writing their next; a
dropped operation (its work freed unwaited) counts as read.

Ordering: header entries are written and read through system calls on the
files, by one thread at a time (see "Threads"), after the
bytes were copied (``copy_`` may use intra-op threads; it returns after they
joined, so their stores precede the entry's). The path is enabled on Linux on
x86-64, where stores become visible to other cores in program order and
loads are not reordered with older loads, so a peer that sees the entry sees
the bytes.

Memory: tmpfs pages, per rank one page of header and ``SLOTS`` slots of at
most ``SLOT_BYTES`` whatever the model (``bytes_per_rank``: 8 MiB and a
page at the defaults; before streaming, each slot held the largest
operation whole, 4 x 40 MB per rank for a GPT of 16 blocks of width 1280).
Each slot reserves (``posix_fallocate``, when the group sets up) the largest
collective announced then, up to ``SLOT_BYTES`` (``slot_reservation``: a
small model's slots stay smaller; see [Note: one transport per group] in
comm/transport.py), and grows up to it before a write that needs more (a
full ``/dev/shm`` is then an error naming the fix, not a SIGBUS); reported
by ``shared_bytes``, and counted by ``composable_shard.plan``. RSS counts
the pages a process touched through its mappings, its peers' included
(``mapped_bytes``: up to the world size times ``shared_bytes``);
``scripts/bench.py`` counts each page once, for the rank that owns it.

Setup (``connect``, collective, once per group): the ranks exchange their
facts over the backend (host, ``/dev/shm`` mount and pid namespace; pid;
free bytes in ``/dev/shm`` by ``statvfs``; their switch). Every rank decides
alike from them: shared memory only if every rank wants it, all share one
host's ``/dev/shm`` and pid numbers, and each has room for every rank's
slots; else ``SharedMemoryUnavailable`` on every rank. The file names derive
from rank 0's pid and a token it sent, so every rank knows every name
before any file exists. Each rank creates its file and reserves its slots
(the group agrees on the outcome), opens its peers' files and a pidfd of
each peer's process (agreed again); then, or on any failure (a peer killed
meanwhile makes the backend's exchange fail), every rank removes every name
(``finally``): from then on the files live only as long as a process holds
them, and nothing is left in ``/dev/shm`` whatever fails.

Failures: a wait checks every ``_LIVENESS_PERIOD_S`` of waiting whether a
peer's process exited (one ``poll`` of their pidfds: readable once the
process ended, even unreaped, and never another process that reused the
pid): the hot path makes no system call for it, since the first check comes
only after 50 ms of waiting. A dead peer fails the wait with a
"communication failure" naming the collective, its operation number and
size, and the peer's group rank, global rank and pid; every later call on
the group raises the same error at once. A peer that is alive but does not
come fails the wait at the group's timeout (read from its backend at every
wait: what ``init_process_group``/``new_group`` received, or
``set_timeout``), or at ``wait(timeout)``'s; a timed-out wait may be retried
(it resumes at the first round still unread). An issue that fails after it
published a round (a dead peer, a timeout or a mismatch in the middle of a
stream) leaves the peers' rounds out of step: every later call raises that
error at once.

Threads: one thread at a time may be inside a group's collective (issue or
wait); another thread that calls in meanwhile gets an error at once, not a
race on the operation counter. Calls from different threads one after the
other are fine (every rank must still issue them in the same order).
"""

from __future__ import annotations

import datetime
import mmap
import os
import platform
import select
import struct
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "HostSharedMemory",
    "SharedMemoryWork",
    "SharedMemoryUnavailable",
    "PLATFORM_SUPPORTED",
    "SLOTS",
    "SLOT_BYTES",
    "slot_reservation",
    "bytes_per_rank",
    "outside_graph",
    "eagerly",
    "prepare_for_compile",
]

_DIRECTORY = "/dev/shm"
_FILE_PREFIX = "composable_shard_"
SLOTS = 4
# The most bytes one rank writes into one slot: an operation that moves more
# streams through its slots in rounds (see "Streaming" in the Note). Read
# when a group sets up (rank 0's value holds for the group).
SLOT_BYTES = 2 << 20
# Per slot, the last operation this rank finished reading from its peers;
# then per slot a pair: the signature (kind and size) of the last operation
# this rank wrote, and its number, published together by one write.
_HEADER = struct.Struct(f"<{3 * SLOTS}q")
_ENTRY = struct.Struct("<q")
_PUBLISHED = struct.Struct("<2q")
_ALL_GATHER, _REDUCE_SCATTER = 1, 2
# Slot regions are reserved and mapped in multiples of this, so that units
# of slightly different sizes share one mapping.
_MAP_GRANULE = 1 << 16
_PAGE = mmap.PAGESIZE
# How often a wait looks whether its peers' processes are still alive (see
# "Failures" in the Note): one poll of their pidfds, so the hot path makes
# no system call for it.
_LIVENESS_PERIOD_S = 0.05
# The timeout of a group whose backend does not say (torch's default).
_DEFAULT_TIMEOUT_S = 1800.0

# See "Ordering" in the Note.
PLATFORM_SUPPORTED = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


class SharedMemoryUnavailable(Exception):
    """The group cannot use shared memory; every rank of it raises this
    alike (the reasons were agreed over the backend). ``warn``: the ranks
    share a host, so the user expected the fast path and is told why not."""

    def __init__(self, reason: str, *, warn: bool) -> None:
        super().__init__(reason)
        self.warn = warn


@dataclass(frozen=True)
class _RankFacts:
    """What one rank tells its peers at setup, all in one message."""

    # Equal on every rank that shares this host's /dev/shm and pid numbers:
    # the kernel's boot id, the /dev/shm mount and the pid namespace.
    place: tuple[str, int, int]
    pid: int
    global_rank: int
    # Bytes free in /dev/shm (statvfs) before any rank reserved its slots;
    # None when this rank cannot write there.
    free_bytes: int | None
    # Names this setup's files (rank 0's is used).
    token: str
    # ``SLOT_BYTES`` on this rank (rank 0's is used).
    slot_bytes: int
    # This rank's switch (``COMPOSABLE_SHARD_SHARED_MEMORY``): off on any
    # rank means off for the group.
    wanted: bool


def outside_graph(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` (a decorator) as one that torch.compile must run eagerly
    (``eagerly``): the shared-memory path's file I/O cannot be traced."""
    _OUTSIDE_GRAPH[fn] = None
    return fn


def eagerly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (marked ``outside_graph``) as a function torch.compile runs
    eagerly: one graph break, as a gloo collective with ``async_op=True``
    makes one. Built by ``prepare_for_compile`` where it could (made here,
    while dynamo traces, it costs a few more breaks, once)."""
    wrapped = _OUTSIDE_GRAPH.get(fn)
    if wrapped is None:
        wrapped = _OUTSIDE_GRAPH[fn] = torch.compiler.disable(fn)
    return wrapped


def prepare_for_compile() -> None:
    """Build the eager versions of the functions marked ``outside_graph``
    if dynamo is loaded (importing it only for this would cost a second)."""
    if "torch._dynamo" not in sys.modules or SharedMemoryWork.wait is not SharedMemoryWork._traced_wait:
        return
    for fn, wrapped in list(_OUTSIDE_GRAPH.items()):
        if wrapped is None:
            _OUTSIDE_GRAPH[fn] = torch.compiler.disable(fn)
    # Called from compiled code, a Python ``wait`` would be traced as a
    # frame of its own before its eager part (two graph breaks per call
    # site); disabled itself, it breaks once, where gloo's C++ ``wait`` does.
    SharedMemoryWork.wait = torch.compiler.disable(SharedMemoryWork._traced_wait)  # type: ignore[method-assign]


# Function -> its torch.compiler.disable'd version (None until built).
_OUTSIDE_GRAPH: dict[Callable[..., Any], Callable[..., Any] | None] = {}


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D ``uint8`` view (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("shared-memory collectives need contiguous tensors")
    return tensor.reshape(-1).view(torch.uint8)


def _has_storage(tensor: torch.Tensor) -> bool:
    """False once the tensor's storage was resized away (a freed buffer)."""
    needed = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    return tensor.untyped_storage().nbytes() >= needed


def _round_up(nbytes: int, granule: int) -> int:
    return -(-nbytes // granule) * granule


def _group_timeout_s(group: ProcessGroup) -> float:
    """The timeout the group's backend was given (``init_process_group`` or
    ``new_group``'s ``timeout``)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return _DEFAULT_TIMEOUT_S


def _timeout_s(timeout: Any) -> float | None:
    """A ``Work.wait`` timeout (a ``timedelta``, seconds, or none) in seconds."""
    if not timeout or timeout[0] is None:
        return None
    value = timeout[0]
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else float(value)
    return seconds if seconds > 0 else None  # torch's "no timeout given"


def _own_facts(wanted: bool) -> _RankFacts:
    try:
        boot_id = open("/proc/sys/kernel/random/boot_id").read().strip()
        place = (boot_id, os.stat(_DIRECTORY).st_dev, os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        place = (uuid.uuid4().hex, 0, 0)  # shares with nobody
    free: int | None = None
    if os.access(_DIRECTORY, os.W_OK):
        stats = os.statvfs(_DIRECTORY)
        free = stats.f_bavail * stats.f_frsize
    return _RankFacts(place, os.getpid(), dist.get_rank(), free, uuid.uuid4().hex, SLOT_BYTES, wanted)


def _unlink_quietly(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _check_facts(facts: list[_RankFacts], largest_bytes: int) -> None:
    """Whether the group can share memory at all, decided alike on every
    rank from the facts every rank sent."""
    if any(not rank_facts.wanted for rank_facts in facts):
        off = [rank for rank, rank_facts in enumerate(facts) if not rank_facts.wanted]
        raise SharedMemoryUnavailable(f"shared memory is switched off on ranks {off}", warn=False)
    if any(rank_facts.place != facts[0].place for rank_facts in facts):
        raise SharedMemoryUnavailable("the ranks do not share one host's /dev/shm and process ids", warn=False)
    unwritable = [rank for rank, rank_facts in enumerate(facts) if rank_facts.free_bytes is None]
    if unwritable:
        raise SharedMemoryUnavailable(f"{_DIRECTORY} is not writable on ranks {unwritable}", warn=True)
    per_slot = slot_reservation(largest_bytes, facts[0].slot_bytes)
    needed = bytes_per_rank(largest_bytes, facts[0].slot_bytes) * len(facts)
    short = [rank for rank, rank_facts in enumerate(facts) if rank_facts.free_bytes < needed]
    if short:
        free = min(facts[rank].free_bytes for rank in short)
        raise SharedMemoryUnavailable(
            f"{_DIRECTORY} has {free / 2**20:.1f} MiB free on ranks {short}; the group needs {needed / 2**20:.1f} MiB "
            f"({len(facts)} ranks x {SLOTS} slots x {per_slot / 2**20:.1f} MiB). Free space there (Docker: "
            "--shm-size)",
            warn=True,
        )


def _create_file(path: str, stride: int, reserved: int) -> int:
    """This rank's file, its header zeroed and every slot's ``reserved``
    bytes reserved (``posix_fallocate``: a full ``/dev/shm`` is an error
    here, not a SIGBUS at a later write through a mapping)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.pwrite(fd, _HEADER.pack(*([0] * 3 * SLOTS)), 0)
        # Sized before any peer maps it (sparse: costs nothing), so no
        # mapping ever reaches past the end of the file.
        os.ftruncate(fd, stride * (SLOTS + 1))
        if reserved:
            for slot in range(SLOTS):
                os.posix_fallocate(fd, stride * (slot + 1), reserved)
    except OSError:
        os.close(fd)
        raise
    return fd


def _agree(group: ProcessGroup, error: str | None, step: str) -> None:
    """Every rank's outcome of a setup step, raised alike on every rank if
    any failed."""
    errors: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    failed = {rank: failure for rank, failure in enumerate(errors) if failure is not None}
    if failed:
        reasons = "; ".join(f"rank {rank}: {failure}" for rank, failure in failed.items())
        raise SharedMemoryUnavailable(f"cannot {step} the files in {_DIRECTORY} ({reasons})", warn=True)


class HostSharedMemory:
    """Shared-memory collectives for one process group whose ranks share a host."""

    def __init__(self, group: ProcessGroup, facts: list[_RankFacts], fds: list[int], pidfds: dict[int, int]) -> None:
        # A weak reference to the group (for its timeout, read at every wait:
        # ``set_timeout`` may change it): ``transport`` keys its decision by
        # the group, weakly, and the files close when the group goes away.
        self._group = weakref.ref(group)
        self.rank = dist.get_rank(group)
        self.world_size = len(facts)
        self._facts = facts
        self._fds = fds
        # Peer rank -> a pidfd of its process (readable once it exited).
        self._pidfds = pidfds
        self._liveness = select.poll()
        for pidfd in pidfds.values():
            self._liveness.register(pidfd, select.POLLIN)
        # Bytes one slot holds (agreed: rank 0's ``SLOT_BYTES``) and where
        # slot ``s`` starts in every file: ``(s + 1) * stride``.
        self._capacity = facts[0].slot_bytes
        self._stride = _stride(self._capacity)
        self._next_seq = 1  # header entries start at 0: "nothing read yet"
        # Per slot, this rank's work that used it last and its round's number.
        self._slot_rounds: list[tuple[weakref.ReferenceType[SharedMemoryWork], int] | None] = [None] * SLOTS
        # Bytes reserved in this rank's file per slot (``posix_fallocate``).
        self._reserved = [0] * SLOTS
        # (rank, slot) -> the mapping of that slot of that rank's file and a
        # uint8 tensor over it; replaced by a longer one when an operation
        # needs more.
        self._mappings: dict[tuple[int, int], tuple[mmap.mmap, torch.Tensor]] = {}
        # (rank, slot) -> bytes touched through the mapping so far (resident
        # in this process: RSS counts them).
        self._touched: dict[tuple[int, int], int] = {}
        # Held by the thread inside a collective (see "Threads" in the Note).
        self._busy = threading.Lock()
        # Set once a peer died: every later call raises it at once.
        self._failure: RuntimeError | None = None
        weakref.finalize(self, _close_all, list(fds) + list(pidfds.values()), self._mappings)

    # ------------------------------------------------------------- creation
    @classmethod
    def connect(cls, group: ProcessGroup, largest_bytes: int, *, wanted: bool) -> "HostSharedMemory":
        """Set up the transport of ``group`` (collective: every rank of the
        group calls it, once), its slots reserved for collectives writing up
        to ``largest_bytes`` per rank (``slot_reservation``); ``wanted``:
        this rank's switch. Raises
        ``SharedMemoryUnavailable`` on every rank alike where the group
        cannot use shared memory, and the backend's error where a peer fails
        meanwhile; no file of the group is left in ``/dev/shm`` either way."""
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        facts: list[Any] = [None] * world_size
        dist.all_gather_object(facts, _own_facts(wanted), group=group)
        _check_facts(facts, largest_bytes)
        reserved = slot_reservation(largest_bytes, facts[0].slot_bytes)
        # Every path is known to every rank before any file exists, so
        # whichever rank survives a failure can remove them all.
        paths = [
            os.path.join(_DIRECTORY, f"{_FILE_PREFIX}{facts[0].pid}_{facts[0].token}_{peer}")
            for peer in range(world_size)
        ]
        fds = [-1] * world_size
        pidfds: dict[int, int] = {}
        done = False
        try:
            error = None
            try:
                fds[rank] = _create_file(paths[rank], _stride(facts[0].slot_bytes), reserved)
            except OSError as failure:
                error = failure.strerror
            _agree(group, error, "create and reserve")
            try:
                for peer in range(world_size):
                    if peer != rank:
                        fds[peer] = os.open(paths[peer], os.O_RDWR)
                        pidfds[peer] = os.pidfd_open(facts[peer].pid)
            except OSError as failure:
                error = f"{failure.strerror} ({failure.filename or 'pidfd_open'})"
            _agree(group, error, "open")
            done = True
        finally:
            # Every rank has every file open (or the setup failed): the names
            # can go; the files live as long as a process holds them.
            _unlink_quietly(paths)
            if not done:
                _close_all([fd for fd in fds if fd >= 0] + list(pidfds.values()))
        transport = cls(group, facts, fds, pidfds)
        transport._reserved = [reserved] * SLOTS
        return transport

    # ---------------------------------------------------------- collectives
    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, *, async_op: bool) -> "SharedMemoryWork | None":
        """Every rank's ``shard`` into ``output`` in rank order; ``output``
        holds the result once the returned work was waited on."""
        chunk = shard.numel()
        self._check_sizes("all-gather: output", output, shard)
        self._enter("an all-gather")
        try:
            shard_bytes = _bytes_of(shard)
            nbytes = shard_bytes.numel()
            output.narrow(0, self.rank * chunk, chunk).copy_(shard)

            def write(region: torch.Tensor, start: int, length: int) -> None:
                region.copy_(shard_bytes[start : start + length])

            def read(slot: int, start: int, length: int) -> None:
                if not _has_storage(output):
                    return  # its owner freed it before waiting: nobody reads the result
                output_bytes = _bytes_of(output)
                for peer in range(self.world_size):
                    if peer != self.rank:
                        at = peer * nbytes + start
                        output_bytes[at : at + length].copy_(self._region(peer, slot, length))

            rounds = _rounds(nbytes, self._gather_piece)
            work = self._stream("an all-gather", _signature(_ALL_GATHER, nbytes), rounds, write, read)
        finally:
            self._busy.release()
        if async_op:
            return work
        work.wait()
        return None

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool
    ) -> "SharedMemoryWork | None":
        """Sum ``input`` over the group, keeping this rank's chunk in
        ``output``: this rank's own chunk first, then the peers' in rank
        order (at two ranks the same bits as rank order: addition commutes).
        ``input`` is not used after this call returns."""
        chunk = output.numel()
        self._check_sizes("reduce-scatter: input", input, output)
        self._enter("a reduce-scatter")
        try:
            flat = input.detach().reshape(-1)
            input_bytes = _bytes_of(flat)
            chunk_bytes = chunk * flat.element_size()
            peers = [peer for peer in range(self.world_size) if peer != self.rank]
            output.copy_(flat[self.rank * chunk : (self.rank + 1) * chunk])

            # A round carries the same piece of every chunk but this rank's,
            # in rank order (see _chunk_offset): each peer reads its own.
            def write(region: torch.Tensor, start: int, length: int) -> None:
                for index, peer in enumerate(peers):
                    at = peer * chunk_bytes + start
                    region[index * length : (index + 1) * length].copy_(input_bytes[at : at + length])

            def read(slot: int, start: int, length: int) -> None:
                if not _has_storage(output):
                    return  # its owner freed it before waiting: nobody reads the result
                target = _bytes_of(output)[start : start + length].view(output.dtype)
                for peer in peers:
                    at = _chunk_offset(self.rank, peer, length)
                    target.add_(self._region(peer, slot, at + length)[at:].view(output.dtype))

            rounds = _rounds(chunk_bytes, self._reduce_piece(flat.element_size()))
            signature = _signature(_REDUCE_SCATTER, chunk_bytes * len(peers))
            work = self._stream("a reduce-scatter", signature, rounds, write, read, per_round=len(peers))
        finally:
            self._busy.release()
        if async_op:
            return work
        work.wait()
        return None

    def _stream(
        self,
        what: str,
        signature: int,
        rounds: list[tuple[int, int]],
        write: Callable[[torch.Tensor, int, int], None],
        read: Callable[[int, int, int], None],
        per_round: int = 1,
    ) -> "SharedMemoryWork":
        """Issue one operation as ``rounds`` (byte ranges of what it moves
        per peer), one slot each: claim the slot, ``write`` this rank's bytes
        into it (``per_round`` ranges side by side), publish. A round older
        than the last ``SLOTS`` is read (``read``) when its slot is claimed
        again, here; the work waits for the rest (see "Streaming" in the
        Note). A failure after a round was published leaves the group
        unusable: every later call raises it."""
        work = SharedMemoryWork(self, signature, read)
        published = False
        try:
            for start, length in rounds:
                slot, seq = self._claim_slot()
                write(self._region(self.rank, slot, per_round * length), start, length)
                # Published only after the bytes (system calls on one thread,
                # in order); the signature comes first in the pair, so a peer
                # that sees the number sees it too.
                os.pwrite(self._fds[self.rank], _PUBLISHED.pack(signature, seq), (SLOTS + 2 * slot) * _ENTRY.size)
                published = True
                work._pending.append((slot, seq, start, length))
                self._slot_rounds[slot] = (weakref.ref(work), seq)
        except BaseException as error:
            if published and self._failure is None:
                self._failure = RuntimeError(
                    f"composable_shard shared-memory collectives: {what} failed after part of it was sent "
                    f"({error}); the process group cannot go on."
                )
                self._failure.__cause__ = error
            raise
        return work

    @property
    def _gather_piece(self) -> int:
        """Bytes of its shard an all-gather moves per round."""
        return _aligned(self._capacity, 1)

    def _reduce_piece(self, element_size: int) -> int:
        """Bytes of each peer's chunk a reduce-scatter moves per round."""
        piece = _aligned(self._capacity // (self.world_size - 1), element_size)
        if piece < element_size:
            raise ValueError(
                f"shared-memory reduce-scatter: slots of {self._capacity} bytes cannot hold one {element_size}-byte "
                f"element for each of {self.world_size - 1} peers"
            )
        return piece

    def _enter(self, what: str) -> None:
        """Take the transport for one call, or refuse: a peer died (every
        later call fails at once), or another thread is inside a call (see
        "Threads" in the Note)."""
        if self._failure is not None:
            raise self._failure
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"composable_shard shared-memory collectives: {what} was issued from thread "
                f"'{threading.current_thread().name}' while another thread was inside a collective of the same "
                "process group. Issue a group's collectives from one thread at a time (every rank must issue them "
                f"in the same order), or give each thread its own process group."
            )

    def _region(self, rank: int, slot: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of ``slot`` in ``rank``'s file, mapped into
        this process, as a uint8 tensor. This rank's own slot is reserved
        first (``posix_fallocate``), so a full ``/dev/shm`` is an error here
        rather than a SIGBUS at the first write through the mapping."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        key = (rank, slot)
        mapped = self._mappings.get(key)
        if mapped is None or mapped[1].numel() < nbytes:
            length = min(_round_up(nbytes, _MAP_GRANULE), self._stride)
            if rank == self.rank:
                self._reserve(slot, length)
            region = mmap.mmap(self._fds[rank], length, offset=self._stride * (slot + 1))
            # The replaced mapping is unmapped once no tensor views it.
            mapped = self._mappings[key] = (region, torch.frombuffer(region, dtype=torch.uint8))
        if self._touched.get(key, 0) < nbytes:
            self._touched[key] = nbytes
        return mapped[1][:nbytes]

    def _reserve(self, slot: int, nbytes: int) -> None:
        if self._reserved[slot] >= nbytes:
            return
        try:
            os.posix_fallocate(self._fds[self.rank], self._stride * (slot + 1), nbytes)
        except OSError as error:
            raise RuntimeError(
                f"composable_shard shared-memory collective: cannot reserve {nbytes} bytes in {_DIRECTORY} "
                f"({error.strerror}), more than the group reserved at its setup. Free space there (Docker: "
                "--shm-size) or set COMPOSABLE_SHARD_SHARED_MEMORY=0 to use gloo."
            ) from error
        self._reserved[slot] = nbytes

    def _check_sizes(self, what: str, whole: torch.Tensor, chunk: torch.Tensor) -> None:
        if whole.numel() != chunk.numel() * self.world_size or whole.dtype != chunk.dtype:
            raise ValueError(
                f"shared-memory {what} has {whole.numel()} {whole.dtype} elements, expected "
                f"{chunk.numel() * self.world_size} {chunk.dtype} ({self.world_size} chunks of {chunk.numel()})"
            )

    @property
    def shared_bytes(self) -> int:
        """Bytes of shared memory this rank's file holds (its header's page
        and its slots' reservations): at most ``bytes_per_rank`` of any
        size, since no slot grows past ``SLOT_BYTES``."""
        return _PAGE + sum(self._reserved)

    @property
    def mapped_bytes(self) -> int:
        """Bytes of shared memory (this rank's files and its peers') this
        process touched through its mappings: pages its RSS counts."""
        return sum(_round_up(nbytes, _PAGE) for nbytes in self._touched.values())

    # ----------------------------------------------------------------- slots
    def _claim_slot(self) -> tuple[int, int]:
        seq = self._next_seq
        self._next_seq += 1
        slot = seq % SLOTS
        previous = self._slot_rounds[slot]
        earlier = previous[0]() if previous is not None else None
        if earlier is not None:
            earlier._complete(previous[1], None)  # read our own older round first: see the Note
        if seq > SLOTS:
            self._await_peers(slot, seq - SLOTS, written=False, timeout_s=None)
        return slot, seq

    def _await_peers(
        self, slot: int, seq: int, *, written: bool, timeout_s: float | None, signature: int = 0
    ) -> None:
        """Until every peer has written (``written``: the same kind and size
        of operation as ``signature``) or read operation ``seq`` of
        ``slot``: polls their headers, sleeping with back-off, and every
        ``_LIVENESS_PERIOD_S`` of waiting, whether they are alive."""
        entry = SLOTS + 2 * slot + 1 if written else slot
        deadline, next_check, pause = 0.0, 0.0, 5e-6
        peers = [peer for peer in range(self.world_size) if peer != self.rank]
        while True:
            waiting = []
            for peer in peers:
                header = _HEADER.unpack(os.pread(self._fds[peer], _HEADER.size, 0))
                if header[entry] < seq:
                    waiting.append(peer)
                elif written and header[entry - 1] != signature:
                    raise RuntimeError(
                        f"composable_shard shared-memory collective (round {seq}): rank {peer} of the group issued "
                        f"{_describe(header[entry - 1])} where this rank (rank {self.rank}) issued "
                        f"{_describe(signature)}. Every rank must run the same collectives in the same order "
                        "(the same modules in forward and backward, the same no_sync and state-dict calls)."
                    )
            peers = waiting
            if not peers:
                return
            now = time.monotonic()
            if not deadline:  # the first wait: nothing was ready
                limit = self._group_timeout_s() if timeout_s is None else timeout_s
                deadline, next_check = now + limit, now + _LIVENESS_PERIOD_S
            elif now >= next_check:
                self._check_alive(seq, signature, written)
                next_check = now + _LIVENESS_PERIOD_S
                if now > deadline:
                    self._time_out(peers, seq, signature, written, timeout_s)
            time.sleep(pause)
            pause = min(pause * 1.5, 2e-4)

    def _check_alive(self, seq: int, signature: int, written: bool) -> None:
        """Raise (and fail every later call) if a peer's process exited."""
        exited = {pidfd for pidfd, _ in self._liveness.poll(0)}
        if not exited:
            return
        dead = sorted(peer for peer, pidfd in self._pidfds.items() if pidfd in exited)
        who = ", ".join(f"rank {peer} (global rank {self._facts[peer].global_rank}, pid {self._facts[peer].pid})" for peer in dead)
        self._failure = RuntimeError(
            f"composable_shard: communication failure in a shared-memory {_operation(seq, signature, written)}: "
            f"{who} of the group exited while this rank (rank {self.rank}) waited for it. The group cannot go on; "
            "see that rank's own output for why it exited."
        )
        raise self._failure

    def _group_timeout_s(self) -> float:
        group = self._group()
        return _DEFAULT_TIMEOUT_S if group is None else _group_timeout_s(group)

    def _time_out(self, peers: list[int], seq: int, signature: int, written: bool, timeout_s: float | None) -> None:
        limit = self._group_timeout_s() if timeout_s is None else timeout_s
        source = "the group's timeout" if timeout_s is None else "the timeout given to wait()"
        raise RuntimeError(
            f"composable_shard: communication timeout in a shared-memory {_operation(seq, signature, written)}: "
            f"ranks {peers} of the group did not {'write' if written else 'read'} it within {limit:g} s ({source}). "
            "They are alive but stuck, or issue collectives in another order."
        )

    def _mark_read(self, slot: int, seq: int) -> None:
        os.pwrite(self._fds[self.rank], _ENTRY.pack(seq), slot * _ENTRY.size)


class SharedMemoryWork:
    """An issued shared-memory collective; ``wait`` completes it (idempotent).

    Its inputs were copied out when it was issued: unlike a gloo or NCCL
    work, nothing needs to keep them alive until the wait."""

    def __init__(self, transport: HostSharedMemory, signature: int, read: Callable[[int, int, int], None]) -> None:
        self._transport: HostSharedMemory | None = transport
        self._signature = signature
        self._read: Callable[[int, int, int], None] | None = read
        # Rounds published and not yet read, oldest first: (slot, number,
        # start, length) of the bytes it moved per peer.
        self._pending: list[tuple[int, int, int, int]] = []

    def wait(self, *timeout: Any) -> bool:
        """As ``Work.wait``: blocks until the result is in the output, at most
        ``timeout`` (a ``timedelta``; default: the group's timeout), and
        raises once a peer died. A timed-out wait may be retried."""
        if torch.compiler.is_compiling():
            return eagerly(SharedMemoryWork._wait_eagerly)(self, _timeout_s(timeout))
        return self._wait_eagerly(_timeout_s(timeout))

    _traced_wait = wait  # ``wait`` before ``prepare_for_compile`` (see there)

    @outside_graph
    def _wait_eagerly(self, timeout_s: float | None) -> bool:
        transport = self._transport
        if transport is None:
            return True
        transport._enter("a wait")
        try:
            self._complete(None, timeout_s)
        finally:
            transport._busy.release()
        return True

    def _complete(self, through: int | None, timeout_s: float | None) -> None:
        """Read the pending rounds up to number ``through`` (None: all), in
        order, the caller holding the transport; each one's peers must have
        written it. The work is complete once none is pending."""
        transport = self._transport
        if transport is None:
            return
        while self._pending and (through is None or self._pending[0][1] <= through):
            slot, seq, start, length = self._pending[0]
            transport._await_peers(slot, seq, written=True, timeout_s=timeout_s, signature=self._signature)
            self._read(slot, start, length)  # type: ignore[misc]
            self._pending.pop(0)
            transport._mark_read(slot, seq)
        if through is None:
            self._transport, self._read = None, None

    def is_completed(self) -> bool:
        return self._transport is None

    def __del__(self) -> None:
        # Dropped without a wait (an error reset): peers must still be free
        # to reuse its slots, and nothing here will read them any more.
        transport = self._transport
        if transport is not None:
            try:
                for slot, seq, _, _ in self._pending:
                    transport._mark_read(slot, seq)
            except OSError:
                pass


def _stride(slot_bytes: int) -> int:
    """How far apart slots lie in a file (sparse: the gaps cost nothing)."""
    return _round_up(max(slot_bytes, 1), _MAP_GRANULE)


def slot_reservation(largest_bytes: int, slot_bytes: int | None = None) -> int:
    """Bytes reserved per slot at setup for collectives writing up to
    ``largest_bytes`` per rank: all of them while they fit one slot of
    ``slot_bytes`` (default ``SLOT_BYTES``), else the whole slot, through
    which larger ones stream."""
    slot_bytes = SLOT_BYTES if slot_bytes is None else slot_bytes
    if largest_bytes <= 0:
        return 0
    return min(_round_up(largest_bytes, _MAP_GRANULE), _stride(slot_bytes))


def bytes_per_rank(largest_bytes: int, slot_bytes: int | None = None) -> int:
    """Shared memory one rank's file holds once set up for collectives
    writing up to ``largest_bytes`` per rank: its header's page and its
    slots' reservations; at most ``PAGE + SLOTS * SLOT_BYTES`` (rounded to
    the mapping granule) whatever the size."""
    return _PAGE + SLOTS * slot_reservation(largest_bytes, slot_bytes)


def _aligned(nbytes: int, element_size: int) -> int:
    """``nbytes`` rounded down to a multiple of 64 bytes (a cache line, so
    that rounds start aligned), or of ``element_size`` where it is smaller."""
    align = 64 if nbytes >= 64 else element_size
    return nbytes // align * align


def _rounds(nbytes: int, piece: int) -> list[tuple[int, int]]:
    """``nbytes`` as (start, length) pieces of at most ``piece`` bytes; one
    empty round for nothing (every rank still takes part)."""
    if nbytes == 0:
        return [(0, 0)]
    return [(start, min(piece, nbytes - start)) for start in range(0, nbytes, piece)]


def _signature(kind: int, nbytes: int) -> int:
    """What a peer must have written for the same operation: every rank
    writes the same number of bytes for a given collective."""
    return nbytes * 4 + kind


def _describe(signature: int) -> str:
    kind = {_ALL_GATHER: "an all-gather", _REDUCE_SCATTER: "a reduce-scatter"}.get(signature % 4, "an unknown operation")
    return f"{kind} writing {signature // 4} bytes"


def _operation(seq: int, signature: int, written: bool) -> str:
    """The collective a wait is for, in words, with its round's number (a
    wait for a slot's readers names the round that will reuse it)."""
    if not written:
        return f"collective (round {seq + SLOTS}, waiting for its slot to be read)"
    kind = {_ALL_GATHER: "all-gather", _REDUCE_SCATTER: "reduce-scatter"}.get(signature % 4, "collective")
    return f"{kind} (round {seq}, {signature // 4} bytes per rank)"


def _chunk_offset(chunk_rank: int, writer: int, chunk_bytes: int) -> int:
    """Where ``chunk_rank``'s chunk starts in a reduce-scatter region that
    rank ``writer`` wrote (every chunk but the writer's own, in rank order)."""
    return (chunk_rank if chunk_rank < writer else chunk_rank - 1) * chunk_bytes


def _close_all(fds: list[int], mappings: dict | None = None) -> None:
    while mappings:
        _, (region, view) = mappings.popitem()
        del view  # the mapping's own tensor: it holds the buffer open
        try:
            region.close()
        except BufferError:
            pass  # another tensor still views it: unmapped when that one goes
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
