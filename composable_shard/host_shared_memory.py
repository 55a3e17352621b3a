"""Owns: all-gather and reduce-scatter between the processes of one host
through shared-memory files, and the decision whether a process group can
use them.

Knows nothing of: parameters, modules, streams, scheduling (``comm`` decides
which collectives come here and keeps their buffers alive).

Public names: ``HostSharedMemory``, ``SharedMemoryWork``, ``enabled``, ``expected``,
``ENV_SWITCH``, ``SLOTS``.

[Note: shared-memory collectives]
Why: on CPU, gloo moves every byte through TCP over loopback: the kernel
copies it twice and runs the TCP stack on gloo's own threads, which compete
with compute for the same cores. ``scripts/bench_comm.py`` at world size 2,
one thread per rank, 3.1 MiB unsharded, 40 interleaved calls each (median
wall time; median CPU time of rank 0's process, all threads): all-gather
2.60 ms (1.90 ms CPU) through gloo, 1.26 ms (1.20 ms CPU) here; gradient
reduction 5.23 ms (3.41 ms CPU) through gloo's faster method (in-place
all-reduce and chunk copy, see [Note: gradient collective per backend] in
comm.py; its reduce-scatter took 5.96 ms), 1.81 ms (1.64 ms CPU) here. A
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
(collectives are issued in the same order on every rank).

- issue: until every peer has read the operation that last used this slot
  (their "read" entries; normally true already), wait; write this rank's
  bytes with ``pwritev``; then publish the operation in the "written" entry.
- wait: until every peer's "written" entry shows the operation, wait; read
  their bytes with ``preadv`` straight into the output (reduce-scatter:
  this rank's own chunk was copied into it at issue, the peers' are added
  in rank order through one scratch chunk); publish the "read" entry.

Waiting polls the peers' headers with ``pread`` and sleeps with back-off
(5 us, growing by half each time up to 0.2 ms, so a wait overshoots little
and a long one costs a few microseconds of CPU per 0.2 ms): no thread spins
and no gloo thread competes with compute. Reuse cannot deadlock: before
waiting for its peers to read a slot, a rank finishes its own older
operation on that slot (reading early is harmless), so no two ranks wait on
each other; a dropped operation (its work freed unwaited) counts as read.

Ordering: bytes and header entries are written and read only through system
calls on the files (the kernel's page cache), one thread per rank, entry
after bytes. The path is enabled on Linux on x86-64, where stores become
visible to other cores in program order, so a peer that sees the entry sees
the bytes.

Memory: tmpfs pages, per rank at most ``SLOTS`` times the largest operation's
bytes (an all-gather writes its shard; a reduce-scatter its input without
this rank's chunk). They are no process's RSS; ``shared_bytes`` reports
them, and ``scripts/bench.py`` adds them to composable_shard's memory.

The group is checked once, collectively, at its first collective: every rank
creates its file and tries to open every peer's; the path is used only if
all of them succeeded (ranks on several hosts or with private ``/dev/shm``
fall back to gloo). ``COMPOSABLE_SHARD_SHARED_MEMORY=0`` turns it off (read
at every call, so it must be set alike on every rank).
"""

from __future__ import annotations

import ctypes
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
# Linux returns short counts above this per read/write call.
_MAX_IO = 1 << 30
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
    return "gloo" in str(dist.get_backend(group)) and dist.get_world_size(group) > 1


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy. Through ctypes,
    not ``numpy()``: a NumPy view marks the storage as not resizable for
    good, and unsharded buffers are freed by resizing their storage."""
    if not tensor.is_contiguous():
        raise ValueError("shared-memory collectives need contiguous tensors")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _has_storage(tensor: torch.Tensor) -> bool:
    """False once the tensor's storage was resized away (a freed buffer)."""
    needed = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    return tensor.untyped_storage().nbytes() >= needed


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwritev(fd, [data[done : done + _MAX_IO]], offset + done)


def _pread_all(fd: int, into: memoryview, offset: int) -> None:
    done = 0
    while done < len(into):
        count = os.preadv(fd, [into[done : done + _MAX_IO]], offset + done)
        if count == 0:
            raise RuntimeError(
                "composable_shard shared-memory collective: a peer's file ended early (the peer process died, or "
                f"/dev/shm is full). Free space in /dev/shm or set {ENV_SWITCH}=0 to use gloo."
            )
        done += count


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
        self._slot_bytes = [0] * SLOTS
        weakref.finalize(self, _close_all, list(fds))

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
        world_size = dist.get_world_size(group)
        if world_size == 1 or "gloo" not in str(dist.get_backend(group)):
            return None
        rank = dist.get_rank(group)
        own_path, own_fd = None, None
        if enabled() and os.access(_DIRECTORY, os.W_OK):
            own_path = os.path.join(_DIRECTORY, f"composable_shard_{os.getpid()}_{uuid.uuid4().hex}")
            try:
                own_fd = os.open(own_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.pwrite(own_fd, _HEADER.pack(*([0] * 3 * SLOTS)), 0)
            except OSError:
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
        data = _byte_view(shard)
        _pwrite_all(self._fds[self.rank], data, SLOT_STRIDE * (slot + 1))
        self._slot_bytes[slot] = max(self._slot_bytes[slot], len(data))
        output.narrow(0, self.rank * chunk, chunk).copy_(shard)

        def read() -> None:
            if not _has_storage(output):
                return  # its owner freed it before waiting: nobody reads the result
            for peer in range(self.world_size):
                if peer != self.rank:
                    into = _byte_view(output.narrow(0, peer * chunk, chunk))
                    _pread_all(self._fds[peer], into, SLOT_STRIDE * (slot + 1))

        return self._start(slot, seq, read, async_op, _signature(_ALL_GATHER, len(data)))

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
        base = SLOT_STRIDE * (slot + 1)
        itemsize = flat.element_size()
        # Peers read their own chunks only; this rank's chunk stays local.
        before = _byte_view(flat[: self.rank * chunk])
        after = _byte_view(flat[(self.rank + 1) * chunk :])
        _pwrite_all(self._fds[self.rank], before, base)
        _pwrite_all(self._fds[self.rank], after, base + (self.rank + 1) * chunk * itemsize)
        self._slot_bytes[slot] = max(self._slot_bytes[slot], len(before) + len(after))
        output.copy_(flat[self.rank * chunk : (self.rank + 1) * chunk])
        offset = base + self.rank * chunk * itemsize

        def read() -> None:
            if not _has_storage(output):
                return  # its owner freed it before waiting: nobody reads the result
            scratch = None
            for peer in range(self.world_size):
                if peer != self.rank:
                    scratch = torch.empty_like(output) if scratch is None else scratch
                    _pread_all(self._fds[peer], _byte_view(scratch), offset)
                    output.add_(scratch)

        return self._start(slot, seq, read, async_op, _signature(_REDUCE_SCATTER, len(before) + len(after)))

    def _check_sizes(self, what: str, whole: torch.Tensor, chunk: torch.Tensor) -> None:
        if whole.numel() != chunk.numel() * self.world_size or whole.dtype != chunk.dtype:
            raise ValueError(
                f"shared-memory {what} has {whole.numel()} {whole.dtype} elements, expected "
                f"{chunk.numel() * self.world_size} {chunk.dtype} ({self.world_size} chunks of {chunk.numel()})"
            )

    @property
    def shared_bytes(self) -> int:
        """Bytes of shared memory this rank's file holds (its slots' largest
        writes)."""
        return _HEADER.size + sum(self._slot_bytes)

    @classmethod
    def process_shared_bytes(cls) -> int:
        """Shared memory held by this process's files, over all its groups:
        memory no RSS figure shows."""
        return sum(transport.shared_bytes for transport in cls._by_group.values() if transport is not None)

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


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
