"""Owns: all-gather and reduce-scatter between the processes of one host
through shared-memory files, and the decision whether a process group can
use them.

Knows nothing of: parameters, modules, streams, scheduling, the gloo/NCCL
path (``comm.transport`` decides which collectives come here; ``comm``'s
callers keep their buffers alive).

Public names: ``HostSharedMemory``, ``SharedMemoryWork``, ``enabled``, ``expected``,
``ENV_SWITCH``, ``SLOTS``.

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
files, by the one thread that issues the group's collectives, after the
bytes were copied (``copy_`` may use intra-op threads; it returns after they
joined, so their stores precede the entry's). The path is enabled on Linux on
x86-64, where stores become visible to other cores in program order and
loads are not reordered with older loads, so a peer that sees the entry sees
the bytes.

Memory: tmpfs pages, per rank at most ``SLOTS`` times the largest operation's
bytes (an all-gather writes its shard; a reduce-scatter its input without
this rank's chunk), reserved with ``posix_fallocate`` before the first write
(a full ``/dev/shm`` is an error naming the fix, not a SIGBUS) and reported
by ``shared_bytes``. RSS counts the pages a process touched through its
mappings, its peers' included (``mapped_bytes``); ``scripts/bench.py``
counts each page once, for the rank that owns it.

The group is checked once, collectively, at its first collective: every rank
creates its file and tries to open every peer's; the path is used only if
all of them succeeded (ranks on several hosts or with private ``/dev/shm``
fall back to gloo). ``COMPOSABLE_SHARD_SHARED_MEMORY=0`` turns it off (read
at every call, so it must be set alike on every rank).
"""

from __future__ import annotations

import mmap
import os
import platform
import struct
import sys
import time
import uuid
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["HostSharedMemory", "SharedMemoryWork", "enabled", "expected", "ENV_SWITCH", "SLOTS"]

ENV_SWITCH = "COMPOSABLE_SHARD_SHARED_MEMORY"
_DIRECTORY = "/dev/shm"
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
# A peer that has not read an old slot after this long is not coming.
_PEER_TIMEOUT_S = 1800.0


# See "Ordering" in the Note.
_PLATFORM_SUPPORTED = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


def enabled() -> bool:
    """Whether this process may use shared-memory collectives (checked at
    every collective: kept cheap)."""
    return _PLATFORM_SUPPORTED and os.environ.get(ENV_SWITCH, "1") != "0"


def expected(group: ProcessGroup | None, device_type: str) -> bool:
    """Whether collectives of ``group`` (None: the default group) on
    ``device_type`` go through shared memory, without a collective (for
    memory plans): the group's decision once made; before that, a gloo group
    of two or more ranks on one host is assumed, and with no process group
    at all (a plan before the run), one host with gloo."""
    if device_type != "cpu" or not enabled():
        return False
    if not dist.is_initialized():
        return True
    group = group if group is not None else dist.group.WORLD
    if group in HostSharedMemory._by_group:
        return HostSharedMemory._by_group[group] is not None
    return _may_share(group)


def _may_share(group: ProcessGroup) -> bool:
    """Whether ``group`` is one the path can serve at all (gloo, two or more
    ranks); whether its ranks share a host is decided collectively."""
    return dist.get_world_size(group) > 1 and "gloo" in str(dist.get_backend(group))


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


class HostSharedMemory:
    """Shared-memory collectives for one process group whose ranks share a host."""

    _by_group: "weakref.WeakKeyDictionary[ProcessGroup, HostSharedMemory | None]" = weakref.WeakKeyDictionary()

    def __init__(self, rank: int, world_size: int, fds: list[int]) -> None:
        # No reference to the group: it is this cache's weak key, and the
        # files close when the group goes away.
        self.rank = rank
        self.world_size = world_size
        self._fds = fds
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
        weakref.finalize(self, _close_all, list(fds), self._mappings)

    # ------------------------------------------------------------- creation
    @classmethod
    def for_group(cls, group: ProcessGroup | None) -> "HostSharedMemory | None":
        """The transport of ``group`` (None: the default group), created at
        the first call (collective: every rank of the group calls it then),
        or None where the group cannot use it."""
        if group is None:
            group = dist.group.WORLD
        if group in cls._by_group:
            return cls._by_group[group]
        transport = cls._create(group)
        cls._by_group[group] = transport
        return transport

    @classmethod
    def _create(cls, group: ProcessGroup) -> "HostSharedMemory | None":
        if not _may_share(group):
            return None
        world_size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        own_path, own_fd = None, None
        if enabled() and os.access(_DIRECTORY, os.W_OK):
            own_path = os.path.join(_DIRECTORY, f"composable_shard_{os.getpid()}_{uuid.uuid4().hex}")
            try:
                own_fd = os.open(own_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.pwrite(own_fd, _HEADER.pack(*([0] * 3 * SLOTS)), 0)
                # Sized before any peer maps it (sparse: costs nothing), so no
                # mapping ever reaches past the end of the file.
                os.ftruncate(own_fd, SLOT_STRIDE * (SLOTS + 1))
            except OSError:
                if own_fd is not None:
                    os.close(own_fd)
                    os.unlink(own_path)
                own_path, own_fd = None, None
        paths: list[Any] = [None] * world_size
        dist.all_gather_object(paths, own_path, group=group)
        fds: list[int] = []
        opened = all(path is not None for path in paths)
        if opened:
            for peer, path in enumerate(paths):
                if peer == rank:
                    fds.append(own_fd)
                    continue
                try:
                    fds.append(os.open(path, os.O_RDWR))
                except OSError:
                    opened = False
                    break
        everyone: list[Any] = [None] * world_size
        dist.all_gather_object(everyone, opened, group=group)
        if own_path is not None:
            os.unlink(own_path)  # every rank that could open it has it open now
        if not all(everyone):
            _close_all(fds if own_fd in fds else fds + ([own_fd] if own_fd is not None else []))
            return None
        return cls(rank, world_size, fds)

    # ---------------------------------------------------------- collectives
    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, *, async_op: bool) -> "SharedMemoryWork | None":
        """Every rank's ``shard`` into ``output`` in rank order; ``output``
        holds the result once the returned work was waited on."""
        chunk = shard.numel()
        self._check_sizes("all-gather: output", output, shard)
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

        return self._start(slot, seq, read, async_op, _signature(_ALL_GATHER, nbytes))

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool
    ) -> "SharedMemoryWork | None":
        """Sum ``input`` over the group, keeping this rank's chunk in
        ``output``: this rank's own chunk first, then the peers' in rank
        order (at two ranks the same bits as rank order: addition commutes).
        ``input`` is not used after this call returns."""
        chunk = output.numel()
        self._check_sizes("reduce-scatter: input", input, output)
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

        return self._start(slot, seq, read, async_op, _signature(_REDUCE_SCATTER, region.numel()))

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
                f"({error.strerror}). Free space there (Docker: --shm-size) or set {ENV_SWITCH}=0 to use gloo."
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

    @classmethod
    def process_shared_bytes(cls) -> int:
        """Shared memory held by this process's files, over all its groups."""
        return sum(transport.shared_bytes for transport in cls._live())

    @classmethod
    def process_mapped_bytes(cls) -> int:
        """Shared memory of any rank's files in this process's RSS, over all
        its groups. ``RSS - process_mapped_bytes() + process_shared_bytes()``
        counts every page of shared memory once, in the process that owns it."""
        return sum(transport.mapped_bytes for transport in cls._live())

    @classmethod
    def _live(cls) -> list["HostSharedMemory"]:
        return [transport for transport in cls._by_group.values() if transport is not None]

    # ----------------------------------------------------------------- slots
    def _start(
        self, slot: int, seq: int, read: Any, async_op: bool, signature: int
    ) -> "SharedMemoryWork | None":
        # Published only after the bytes (system calls on one thread, in
        # order); the signature comes first in the pair, so a peer that sees
        # the number sees it too.
        os.pwrite(self._fds[self.rank], _PUBLISHED.pack(signature, seq), (SLOTS + 2 * slot) * _ENTRY.size)
        work = SharedMemoryWork(self, slot, seq, read, signature)
        self._slot_works[slot] = weakref.ref(work)
        if async_op:
            return work
        work.wait()
        return None

    def _claim_slot(self) -> tuple[int, int]:
        seq = self._next_seq
        self._next_seq += 1
        slot = seq % SLOTS
        previous = self._slot_works[slot]
        earlier = previous() if previous is not None else None
        if earlier is not None:
            earlier.wait()  # read our own older operation first: see the Note
        if seq > SLOTS:
            self._await_peers(slot, seq - SLOTS, written=False)
        return slot, seq

    def _await_peers(self, slot: int, seq: int, *, written: bool, signature: int = 0) -> None:
        """Until every peer has written (``written``: the same kind and size
        of operation as ``signature``) or read operation ``seq`` of
        ``slot``: polls their headers, sleeping with back-off."""
        entry = SLOTS + 2 * slot + 1 if written else slot
        deadline, pause = None, 5e-6
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
            deadline = deadline or now + _PEER_TIMEOUT_S
            if now > deadline:
                raise RuntimeError(
                    f"composable_shard shared-memory collective: ranks {peers} of the group did not "
                    f"{'write' if written else 'read'} operation {seq} within {_PEER_TIMEOUT_S:.0f} s; they are stuck "
                    f"or issue collectives in another order. Set {ENV_SWITCH}=0 to use gloo."
                )
            time.sleep(pause)
            pause = min(pause * 1.5, 2e-4)

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
        """As ``Work.wait``: blocks until the result is in the output (a
        timeout argument is accepted and ignored)."""
        transport = self._transport
        if transport is None:
            return True
        transport._await_peers(self._slot, self._seq, written=True, signature=self._signature)
        self._read()
        self._transport, self._read = None, None
        transport._mark_read(self._slot, self._seq)
        return True

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
