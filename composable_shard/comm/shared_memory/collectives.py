"""Owns: all-gather, reduce-scatter and all-reduce between the processes of one host
through shared memory (``HostSharedMemory``): the group's setup (its files
and slots), each collective's rounds (which bytes each writes and reads)
and their checks.

Knows nothing of: how files are made and mapped (``files``), how rounds
wait for peers (``slots``), which collectives come here and when a group
sets up (``comm.transport``), the gloo/NCCL collectives, parameters,
modules, streams (``comm``'s callers keep their buffers alive).

Public names: ``HostSharedMemory``.

[Note: shared-memory collectives]
On CPU, gloo moves every byte through TCP over loopback: the kernel copies
it twice and gloo's threads compete with compute for the cores. Here every
rank writes into its own slots, mapped into every process (``mmap``), and
peers copy straight out of them into their output: one ``copy_`` each way,
and no message per operation (the "written" signal is a header entry; see
[Note: slots and waits] in slots.py). An all-gather's round carries
consecutive pieces of this rank's shard; a reduce-scatter's round carries
the same piece of every chunk but this rank's, side by side, so every round
feeds every rank; an operation that fits one slot (the common case) is one
round. A reduce-scatter sums this rank's own chunk first, then the peers'
pieces in rank order, read where they lie, so each element sums in the same
order whatever the rounds. An all-reduce's round carries a piece of this
rank's whole tensor, as an all-gather's does; every rank sums every rank's
piece in rank order (its own read back from its slot), so every rank gets
the same bits, as replicas must. The measurements behind the transport and the
slot size are in docs/design/comm.md. Pinned by
tests/comm/test_shared_memory.py (test_all_gather_through_shared_memory_equals_gloo,
test_reduce_scatter_through_shared_memory_sums_own_chunk_then_peers,
test_collectives_larger_than_a_slot_stream_through_it_and_equal_gloo).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .files import GroupFiles
from .slots import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, SharedMemoryWork, SlotRing, signature_of

__all__ = ["HostSharedMemory"]


class HostSharedMemory:
    """Shared-memory collectives for one process group whose ranks share a host."""

    def __init__(self, group: ProcessGroup, files: GroupFiles) -> None:
        # The files (kept alive here: they close when this goes away).
        self.files = files
        self.slots = SlotRing(group, files)
        self.rank = dist.get_rank(group)
        self.world_size = files.world_size

    @classmethod
    def connect(
        cls, group: ProcessGroup, largest_bytes: int, *, wanted: bool, slot_bytes: int
    ) -> "HostSharedMemory":
        """Set up the transport of ``group`` (collective: every rank of the
        group calls it, once): see ``GroupFiles.open``."""
        return cls(group, GroupFiles.open(group, largest_bytes, wanted=wanted, slot_bytes=slot_bytes))

    @property
    def shared_bytes(self) -> int:
        """Bytes of shared memory this rank's file holds (``GroupFiles``)."""
        return self.files.shared_bytes

    @property
    def mapped_bytes(self) -> int:
        """Bytes of shared memory this process's RSS counts (``GroupFiles``)."""
        return self.files.mapped_bytes

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, *, async_op: bool) -> SharedMemoryWork | None:
        """Every rank's ``shard`` into ``output`` in rank order; ``output``
        holds the result once the returned work was waited on."""
        chunk = shard.numel()
        self._check_sizes("all-gather: output", output, shard)
        self.slots.enter("an all-gather")
        try:
            shard_bytes = _bytes_of(shard)
            nbytes = shard_bytes.numel()
            output.narrow(0, self.rank * chunk, chunk).copy_(shard)

            def read(slot: int, start: int, length: int) -> None:
                if not _has_storage(output):
                    return  # its owner freed it before waiting: nobody reads the result
                output_bytes = _bytes_of(output)
                for peer in range(self.world_size):
                    if peer != self.rank:
                        at = peer * nbytes + start
                        output_bytes[at : at + length].copy_(self.files.region(peer, slot, length))

            rounds = _rounds(nbytes, self._gather_piece)
            work = self._stream("an all-gather", signature_of(ALL_GATHER, nbytes), rounds, _writer(shard_bytes), read)
        finally:
            self.slots.leave()
        return _waited_unless(async_op, work)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool) -> SharedMemoryWork | None:
        """Sum ``input`` over the group, keeping this rank's chunk in
        ``output``: this rank's own chunk first, then the peers' in rank
        order (at two ranks the same bits as rank order: addition commutes).
        ``input`` is not used after this call returns."""
        chunk = output.numel()
        self._check_sizes("reduce-scatter: input", input, output)
        self.slots.enter("a reduce-scatter")
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
                    target.add_(self.files.region(peer, slot, at + length)[at:].view(output.dtype))

            rounds = _rounds(chunk_bytes, self._reduce_piece(flat.element_size()))
            signature = signature_of(REDUCE_SCATTER, chunk_bytes * len(peers))
            work = self._stream("a reduce-scatter", signature, rounds, write, read, per_round=len(peers))
        finally:
            self.slots.leave()
        return _waited_unless(async_op, work)

    def all_reduce(self, tensor: torch.Tensor, *, async_op: bool) -> SharedMemoryWork | None:
        """Sum ``tensor`` over the group in place, in rank order on every
        rank (the same bits everywhere); ``tensor`` holds the sum once the
        returned work was waited on and must not change before then."""
        self.slots.enter("an all-reduce")
        try:
            tensor_bytes = _bytes_of(tensor)
            nbytes = tensor_bytes.numel()

            def read(slot: int, start: int, length: int) -> None:
                if not _has_storage(tensor):
                    return  # its owner freed it before waiting: nobody reads the result
                target = _bytes_of(tensor)[start : start + length].view(tensor.dtype)
                target.copy_(self.files.region(0, slot, length).view(tensor.dtype))
                for peer in range(1, self.world_size):
                    target.add_(self.files.region(peer, slot, length).view(tensor.dtype))

            rounds = _rounds(nbytes, _aligned(self.files.slot_bytes, tensor.element_size()))
            work = self._stream("an all-reduce", signature_of(ALL_REDUCE, nbytes), rounds, _writer(tensor_bytes), read)
        finally:
            self.slots.leave()
        return _waited_unless(async_op, work)

    def _stream(
        self,
        what: str,
        signature: int,
        rounds: list[tuple[int, int]],
        write: Callable[[torch.Tensor, int, int], None],
        read: Callable[[int, int, int], None],
        per_round: int = 1,
    ) -> SharedMemoryWork:
        """Issue one operation as ``rounds`` (byte ranges of what it moves
        per peer), one slot each: claim the slot, ``write`` this rank's bytes
        into it (``per_round`` ranges side by side), publish. A round older
        than the last ``SLOTS`` is read (``read``) when its slot is claimed
        again, here; the work waits for the rest. A failure after a round
        was published leaves the group unusable: every later call raises it."""
        work = SharedMemoryWork(self.slots, signature, read)
        published = False
        try:
            for start, length in rounds:
                slot, seq = self.slots.claim_slot()
                write(self.files.region(self.rank, slot, per_round * length), start, length)
                self.slots.publish(work, slot, seq, start, length)
                published = True
        except BaseException as error:
            if published and self.slots.failure is None:
                self.slots.failure = RuntimeError(
                    f"composable_shard shared-memory collectives: {what} failed after part of it was sent "
                    f"({error}); the process group cannot go on."
                )
                self.slots.failure.__cause__ = error
            raise
        return work

    @property
    def _gather_piece(self) -> int:
        """Bytes of its shard an all-gather moves per round."""
        return _aligned(self.files.slot_bytes, 1)

    def _reduce_piece(self, element_size: int) -> int:
        """Bytes of each peer's chunk a reduce-scatter moves per round."""
        capacity = self.files.slot_bytes
        piece = _aligned(capacity // (self.world_size - 1), element_size)
        if piece < element_size:
            raise ValueError(
                f"shared-memory reduce-scatter: slots of {capacity} bytes cannot hold one {element_size}-byte "
                f"element for each of {self.world_size - 1} peers"
            )
        return piece

    def _check_sizes(self, what: str, whole: torch.Tensor, chunk: torch.Tensor) -> None:
        if whole.numel() != chunk.numel() * self.world_size or whole.dtype != chunk.dtype:
            raise ValueError(
                f"shared-memory {what} has {whole.numel()} {whole.dtype} elements, expected "
                f"{chunk.numel() * self.world_size} {chunk.dtype} ({self.world_size} chunks of {chunk.numel()})"
            )


def _writer(source_bytes: torch.Tensor) -> Callable[[torch.Tensor, int, int], None]:
    """A round's write of ``source_bytes[start : start + length]`` into this
    rank's region (an all-gather's shard, an all-reduce's tensor)."""

    def write(region: torch.Tensor, start: int, length: int) -> None:
        region.copy_(source_bytes[start : start + length])

    return write


def _waited_unless(async_op: bool, work: SharedMemoryWork) -> SharedMemoryWork | None:
    """The work to wait on later, or None once waited here (``async_op=False``)."""
    if async_op:
        return work
    work.wait()
    return None


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D ``uint8`` view (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("shared-memory collectives need contiguous tensors")
    return tensor.reshape(-1).view(torch.uint8)


def _has_storage(tensor: torch.Tensor) -> bool:
    """False once the tensor's storage was resized away (a freed buffer)."""
    needed = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    return tensor.untyped_storage().nbytes() >= needed


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


def _chunk_offset(chunk_rank: int, writer: int, chunk_bytes: int) -> int:
    """Where ``chunk_rank``'s chunk starts in a reduce-scatter region that
    rank ``writer`` wrote (every chunk but the writer's own, in rank order)."""
    return (chunk_rank if chunk_rank < writer else chunk_rank - 1) * chunk_bytes
