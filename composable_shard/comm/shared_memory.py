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
as every rank opened every file (nothing outlives the processes). Its header
holds, per slot, the last operation whose bytes this rank finished writing
(with its kind and size, which peers check: ranks that issue different
collectives get an error naming both, not each other's bytes) and the last
one it finished reading from its peers; slot ``s`` starts at
``(s + 1) * SLOT_STRIDE`` (a sparse file: the stride costs nothing).
Operations take slots round-robin and every rank numbers them alike
(collectives are issued in the same order on every rank). Slots are mapped
into every process (``mmap``, grown when an operation needs more), so bytes
move with one ``copy_`` each way: through ``pwritev``/``preadv`` the same
moves took about twice as long (1.6 MB from and to buffers not in cache:
0.33 and 0.32 ms against 0.16 and 0.18 ms), and the reduce-scatter needed a
scratch chunk to add from.

- issue: until every peer has read the operation that last used this slot
  (their "read" entries; normally true already), wait; copy this rank's
  bytes into its slot; then publish the operation in the "written" entry.
- wait: until every peer's "written" entry shows the operation, wait; copy
  their bytes from their slots straight into the output (reduce-scatter:
  this rank's own chunk was copied into it at issue, the peers' chunks are
  added to it in rank order, read where they lie); publish the "read" entry.

Waiting polls the peers' headers with ``pread`` and sleeps with back-off
(5 us, growing by half each time up to 0.2 ms, so a wait overshoots little
and a long one costs a few microseconds of CPU per 0.2 ms): no thread spins
and no gloo thread competes with compute. Reuse cannot deadlock: before
waiting for its peers to read a slot, a rank finishes its own older
operation on that slot (reading early is harmless), so no two ranks wait on
each other; a dropped operation (its work freed unwaited) counts as read.

Ordering: header entries are written and read through system calls on the
files, by one thread at a time (see "Threads"), after the
bytes were copied (``copy_`` may use intra-op threads; it returns after they
joined, so their stores precede the entry's). The path is enabled on Linux on
x86-64, where stores become visible to other cores in program order and
loads are not reordered with older loads, so a peer that sees the entry sees
the bytes.

Memory: tmpfs pages, per rank ``SLOTS`` times the largest operation's bytes
(an all-gather writes its shard; a reduce-scatter its input without this
rank's chunk), reserved with ``posix_fallocate`` when the group sets up, for
the largest collective announced then (see [Note: one transport per group]
in comm/transport.py), and grown before a write that needs more (a full
``/dev/shm`` is then an error naming the fix, not a SIGBUS); reported by
``shared_bytes``. RSS counts the pages a process touched through its
mappings, its peers' included (``mapped_bytes``); ``scripts/bench.py``
counts each page once, for the rank that owns it.

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
``set_timeout``), or at ``wait(timeout)``'s; a timed-out wait may be retried.

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
    "outside_graph",
    "eagerly",
    "prepare_for_compile",
]

_DIRECTORY = "/dev/shm"
_FILE_PREFIX = "composable_shard_"
SLOTS = 4
SLOT_STRIDE = 1 << 40  # 1 TiB apart in a sparse file: no operation is larger
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
    return _RankFacts(place, os.getpid(), dist.get_rank(), free, uuid.uuid4().hex, wanted)


def _unlink_quietly(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _check_facts(facts: list[_RankFacts], slot_bytes: int) -> None:
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
    per_rank = _PAGE + SLOTS * _round_up(slot_bytes, _MAP_GRANULE)
    needed = per_rank * len(facts)
    short = [rank for rank, rank_facts in enumerate(facts) if rank_facts.free_bytes < needed]
    if short:
        free = min(facts[rank].free_bytes for rank in short)
        raise SharedMemoryUnavailable(
            f"{_DIRECTORY} has {free / 2**20:.1f} MiB free on ranks {short}; the group needs {needed / 2**20:.1f} MiB "
            f"({len(facts)} ranks x {SLOTS} slots x {_round_up(slot_bytes, _MAP_GRANULE) / 2**20:.1f} MiB for its "
            "largest collective). Free space there (Docker: --shm-size)",
            warn=True,
        )


def _create_file(path: str, slot_bytes: int) -> int:
    """This rank's file, its header zeroed and every slot's ``slot_bytes``
    reserved (``posix_fallocate``: a full ``/dev/shm`` is an error here, not
    a SIGBUS at a later write through a mapping)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.pwrite(fd, _HEADER.pack(*([0] * 3 * SLOTS)), 0)
        # Sized before any peer maps it (sparse: costs nothing), so no
        # mapping ever reaches past the end of the file.
        os.ftruncate(fd, SLOT_STRIDE * (SLOTS + 1))
        if slot_bytes:
            for slot in range(SLOTS):
                os.posix_fallocate(fd, SLOT_STRIDE * (slot + 1), _round_up(slot_bytes, _MAP_GRANULE))
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
        self._next_seq = 1  # header entries start at 0: "nothing read yet"
        self._slot_works: list[weakref.ReferenceType[SharedMemoryWork] | None] = [None] * SLOTS
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
    def connect(cls, group: ProcessGroup, slot_bytes: int, *, wanted: bool) -> "HostSharedMemory":
        """Set up the transport of ``group`` (collective: every rank of the
        group calls it, once), with ``slot_bytes`` reserved in each of this
        rank's slots; ``wanted``: this rank's switch. Raises
        ``SharedMemoryUnavailable`` on every rank alike where the group
        cannot use shared memory, and the backend's error where a peer fails
        meanwhile; no file of the group is left in ``/dev/shm`` either way."""
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        facts: list[Any] = [None] * world_size
        dist.all_gather_object(facts, _own_facts(wanted), group=group)
        _check_facts(facts, slot_bytes)
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
                fds[rank] = _create_file(paths[rank], slot_bytes)
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
        transport._reserved = [_round_up(slot_bytes, _MAP_GRANULE) if slot_bytes else 0] * SLOTS
        return transport

    # ---------------------------------------------------------- collectives
    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, *, async_op: bool) -> "SharedMemoryWork | None":
        """Every rank's ``shard`` into ``output`` in rank order; ``output``
        holds the result once the returned work was waited on."""
        chunk = shard.numel()
        self._check_sizes("all-gather: output", output, shard)
        self._enter("an all-gather")
        try:
            slot, seq = self._claim_slot()
            shard_bytes = _bytes_of(shard)
            nbytes = shard_bytes.numel()
            self._region(self.rank, slot, nbytes).copy_(shard_bytes)
            output.narrow(0, self.rank * chunk, chunk).copy_(shard)

            def read() -> None:
                if not _has_storage(output):
                    return  # its owner freed it before waiting: nobody reads the result
                output_bytes = _bytes_of(output)
                for peer in range(self.world_size):
                    if peer != self.rank:
                        output_bytes[peer * nbytes : (peer + 1) * nbytes].copy_(self._region(peer, slot, nbytes))

            work = self._start(slot, seq, read, _signature(_ALL_GATHER, nbytes))
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
            slot, seq = self._claim_slot()
            flat = input.detach().reshape(-1)
            input_bytes = _bytes_of(flat)
            chunk_bytes = chunk * flat.element_size()
            own_start = self.rank * chunk_bytes
            # Peers read their own chunks only: the region holds every chunk but
            # this rank's, in rank order (see _chunk_offset).
            region = self._region(self.rank, slot, input_bytes.numel() - chunk_bytes)
            region[:own_start].copy_(input_bytes[:own_start])
            region[own_start:].copy_(input_bytes[own_start + chunk_bytes :])
            output.copy_(flat[self.rank * chunk : (self.rank + 1) * chunk])

            def read() -> None:
                if not _has_storage(output):
                    return  # its owner freed it before waiting: nobody reads the result
                for peer in range(self.world_size):
                    if peer != self.rank:
                        start = _chunk_offset(self.rank, peer, chunk_bytes)
                        peer_chunk = self._region(peer, slot, start + chunk_bytes)[start:]
                        output.add_(peer_chunk.view(output.dtype))

            work = self._start(slot, seq, read, _signature(_REDUCE_SCATTER, region.numel()))
        finally:
            self._busy.release()
        if async_op:
            return work
        work.wait()
        return None

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
            length = _round_up(nbytes, _MAP_GRANULE)
            if rank == self.rank:
                self._reserve(slot, length)
            region = mmap.mmap(self._fds[rank], length, offset=SLOT_STRIDE * (slot + 1))
            # The replaced mapping is unmapped once no tensor views it.
            mapped = self._mappings[key] = (region, torch.frombuffer(region, dtype=torch.uint8))
        if self._touched.get(key, 0) < nbytes:
            self._touched[key] = nbytes
        return mapped[1][:nbytes]

    def _reserve(self, slot: int, nbytes: int) -> None:
        if self._reserved[slot] >= nbytes:
            return
        try:
            os.posix_fallocate(self._fds[self.rank], SLOT_STRIDE * (slot + 1), nbytes)
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
        """Bytes of shared memory this rank's file holds (its header and its
        slots' reservations)."""
        return _HEADER.size + sum(self._reserved)

    @property
    def mapped_bytes(self) -> int:
        """Bytes of shared memory (this rank's files and its peers') this
        process touched through its mappings: pages its RSS counts."""
        return sum(_round_up(nbytes, _PAGE) for nbytes in self._touched.values())

    # ----------------------------------------------------------------- slots
    def _start(self, slot: int, seq: int, read: Any, signature: int) -> "SharedMemoryWork":
        # Published only after the bytes (system calls on one thread, in
        # order); the signature comes first in the pair, so a peer that sees
        # the number sees it too.
        os.pwrite(self._fds[self.rank], _PUBLISHED.pack(signature, seq), (SLOTS + 2 * slot) * _ENTRY.size)
        work = SharedMemoryWork(self, slot, seq, read, signature)
        self._slot_works[slot] = weakref.ref(work)
        return work

    def _claim_slot(self) -> tuple[int, int]:
        seq = self._next_seq
        self._next_seq += 1
        slot = seq % SLOTS
        previous = self._slot_works[slot]
        earlier = previous() if previous is not None else None
        if earlier is not None:
            earlier._complete(None)  # read our own older operation first: see the Note
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
                        f"composable_shard shared-memory collective {seq}: rank {peer} of the group issued "
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

    def __init__(self, transport: HostSharedMemory, slot: int, seq: int, read: Any, signature: int) -> None:
        self._transport: HostSharedMemory | None = transport
        self._slot = slot
        self._seq = seq
        self._read = read
        self._signature = signature

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
            self._complete(timeout_s)
        finally:
            transport._busy.release()
        return True

    def _complete(self, timeout_s: float | None) -> None:
        """The wait, its caller holding the transport."""
        transport = self._transport
        if transport is None:
            return
        transport._await_peers(self._slot, self._seq, written=True, timeout_s=timeout_s, signature=self._signature)
        self._read()
        self._transport, self._read = None, None
        transport._mark_read(self._slot, self._seq)

    def is_completed(self) -> bool:
        return self._transport is None

    def __del__(self) -> None:
        # Dropped without a wait (an error reset): peers must still be free
        # to reuse the slot, and nothing here will read it any more.
        transport = self._transport
        if transport is not None:
            try:
                transport._mark_read(self._slot, self._seq)
            except OSError:
                pass


def _signature(kind: int, nbytes: int) -> int:
    """What a peer must have written for the same operation: every rank
    writes the same number of bytes for a given collective."""
    return nbytes * 4 + kind


def _describe(signature: int) -> str:
    kind = {_ALL_GATHER: "an all-gather", _REDUCE_SCATTER: "a reduce-scatter"}.get(signature % 4, "an unknown operation")
    return f"{kind} writing {signature // 4} bytes"


def _operation(seq: int, signature: int, written: bool) -> str:
    """The collective a wait is for, in words (a wait for a slot's readers
    names the operation that will reuse it)."""
    if not written:
        return f"collective (operation {seq + SLOTS}, waiting for its slot to be read)"
    kind = {_ALL_GATHER: "all-gather", _REDUCE_SCATTER: "reduce-scatter"}.get(signature % 4, "collective")
    return f"{kind} (operation {seq}, {signature // 4} bytes per rank)"


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
