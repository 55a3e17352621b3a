"""Owns: all-gather, reduce-scatter, all-reduce and all-to-all between the processes
of one host through shared memory (``HostSharedMemory``): the group's setup
(its files, slots, published shards), each collective's rounds (which bytes
each writes and reads) and their checks.

Knows nothing of: how files are made and mapped (``files``), how rounds wait
for peers (``slots``), publishing (``published``), which collectives come
here and when a group sets up (``comm.transport``), the gloo/NCCL
collectives, parameters, modules, streams (``comm``'s callers keep their buffers alive).

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
the same bits, as replicas must. Several shards gathered in one collective
(``all_gather_pieces``, a bucket of small units) are one stream of their
bytes back to back, written from each shard and read into each output's
row where they lie; a bucket's gradients are reduce-scattered into one
output each (``reduce_scatter_pieces``) or all-reduced in place
(``all_reduce_pieces``) the same way. Measurements: docs/design/comm.md. Pinned by
tests/comm/test_shared_memory.py (test_all_gather_through_shared_memory_equals_gloo,
test_reduce_scatter_through_shared_memory_sums_own_chunk_then_peers,
test_collectives_larger_than_a_slot_stream_through_it_and_equal_gloo).

[Note: shared-memory all-to-all]
Each rank knows only its own splits, yet every rank must take part in the
same rounds. So an all-to-all is two operations in one call. First every
rank publishes, as an all-gather would (its own kind, ``ALL_TO_ALL``, so a
peer inside another collective fails naming both), its element size, the
bytes one of its rounds may carry (what its slots hold reserved already,
``GroupFiles.reserved_bytes``, at least 64 KiB and at most a slot: the
exchange does not grow the files past what the group's other collectives
reserved) and, in bytes, what it sends each rank and expects from each.
Every rank then holds the same table and derives the same plan, or raises
the same ``ValueError`` where the splits do not pair (rank ``w``'s
``input_splits[p]`` must be rank ``p``'s ``output_splits[w]``): nothing of
the data was sent, and the group goes on. Second, each rank's pieces for
its peers, back to back in rank order, stream in rounds of the smallest
of the ranks' round sizes; the rounds are as many as the rank sending most
needs, and a rank that has sent everything publishes empty rounds. A
reader knows where its piece lies in each writer's stream (the table), so
it copies out of each round the part of the piece the round holds. A rank
copies its own piece once its rounds are published, while its peers read
them. The data's signature is the group's total of bytes, the same on
every rank. Any failure once the table was published leaves the group
unusable, as a streamed collective's does. What is sent and received may
be several tensors each, laid back to back (``all_to_all_pieces``,
``pieces.py``): a round's bytes are written from and read into them where
they lie, with no buffer (the owner step's exchange in place). Pinned by
tests/comm/test_shared_memory_all_to_all.py.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .files import GroupFiles
from .pieces import Pieces, bytes_of, has_storage, offsets, overlap, transfer
from .published import PublishedShards
from .slots import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER, SharedMemoryWork, SlotRing, signature_of

__all__ = ["HostSharedMemory"]

# An all-to-all's table row (int64): the rank's element size, the bytes one
# of its rounds may carry, then per rank the bytes it sends, then per rank
# the bytes it expects ([Note: shared-memory all-to-all]).
_SENDS_AT = 2
# The least bytes an all-to-all's round may carry (a slot reserved for
# smaller collectives grows to it; the mapping granule of ``files``).
_LEAST_ROUND_BYTES = 1 << 16


class HostSharedMemory:
    """Shared-memory collectives for one process group whose ranks share a host."""

    def __init__(self, group: ProcessGroup, files: GroupFiles) -> None:
        self.files = files  # kept alive here: they close when this goes away
        self.slots = SlotRing(group, files)
        self.rank = dist.get_rank(group)
        self.world_size = files.world_size
        # The shards this rank publishes for a step (None: no area).
        self.published = PublishedShards(files, self.slots) if files.published_bytes else None

    @classmethod
    def connect(
        cls, group: ProcessGroup, largest_bytes: int, *, wanted: bool, slot_bytes: int, published_bytes: int = 0
    ) -> "HostSharedMemory":
        """Set up ``group``'s transport (collective, once): ``GroupFiles.open``."""
        files = GroupFiles.open(group, largest_bytes, wanted=wanted, slot_bytes=slot_bytes, published_bytes=published_bytes)
        return cls(group, files)

    @property
    def shared_bytes(self) -> int:
        return self.files.shared_bytes  # this rank's file (``GroupFiles``)

    @property
    def mapped_bytes(self) -> int:
        return self.files.mapped_bytes  # what this process's RSS counts (``GroupFiles``)

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, *, async_op: bool) -> SharedMemoryWork | None:
        """Every rank's ``shard`` into ``output`` in rank order (once waited on)."""
        self._check_sizes("all-gather: output", output, shard)
        if self.published is not None and (entries := self.published.entries([shard])) is not None:
            return self.published.all_gather([output], [shard], entries)
        self.slots.enter("an all-gather")
        try:
            work = self._gather(output, shard, ALL_GATHER, "an all-gather")
        finally:
            self.slots.leave()
        return _waited_unless(async_op, work)

    def all_gather_pieces(
        self, outputs: Sequence[torch.Tensor], shards: Sequence[torch.Tensor], *, async_op: bool
    ) -> SharedMemoryWork | None:
        """``all_gather`` of several shards in one collective: this rank's
        ``shards`` laid back to back are its stream, and each output
        (``world_size`` rows of its shard's size) gets every rank's shard of
        it in its row, in rank order, read and written where they lie (the
        bytes a peer sees are those of one all-gather of the shards side by
        side); published shards are read from the peers' areas instead
        ([Note: published shards]). ``shards`` are not used after this returns."""
        self._check_paired("all-gather", outputs, shards, "shard", outputs_are_wholes=True)
        if self.published is not None and (entries := self.published.entries(shards)) is not None:
            return self.published.all_gather(outputs, shards, entries)
        sent = Pieces(shards)  # refuses strided shards before anything is issued
        rows = [bytes_of(output).view(self.world_size, -1) for output in outputs]
        starts = offsets([row.shape[1] for row in rows])
        self.slots.enter("an all-gather")
        try:
            # One call copies every piece (_check_paired: one at least).
            torch._foreach_copy_([row[self.rank] for row in rows], [bytes_of(shard) for shard in shards])

            def write(region: torch.Tensor, start: int, length: int) -> None:
                transfer(sent, start, Pieces([region]), 0, length)

            def read(slot: int, start: int, length: int) -> None:
                targets, sources = [], []
                for peer in range(self.world_size):
                    if peer == self.rank:
                        continue
                    region = self.files.region(peer, slot, length)
                    for output, row, at in zip(outputs, rows, starts):
                        low, high = overlap(at, row.shape[1], start, length)
                        # A buffer its owner freed before waiting (an error path): nobody reads it.
                        if high > low and has_storage(output):
                            targets.append(row[peer, low - at : high - at])
                            sources.append(region[low - start : high - start])
                if targets:
                    torch._foreach_copy_(targets, sources)

            rounds = _rounds(sent.nbytes, self._gather_piece)
            work = self._stream("an all-gather", signature_of(ALL_GATHER, sent.nbytes), rounds, write, read)
        finally:
            self.slots.leave()
        return _waited_unless(async_op, work)

    def _gather(self, output: torch.Tensor, shard: torch.Tensor, kind: int, what: str) -> SharedMemoryWork:
        """Issue an all-gather's (or an all-to-all table's: ``kind``) rounds, holding the ring."""
        chunk = shard.numel()
        shard_bytes = bytes_of(shard)
        nbytes = shard_bytes.numel()
        output.narrow(0, self.rank * chunk, chunk).copy_(shard)

        def read(slot: int, start: int, length: int) -> None:
            if not has_storage(output):
                return  # its owner freed it before waiting: nobody reads the result
            output_bytes = bytes_of(output)
            for peer in range(self.world_size):
                if peer != self.rank:
                    at = peer * nbytes + start
                    output_bytes[at : at + length].copy_(self.files.region(peer, slot, length))

        rounds = _rounds(nbytes, self._gather_piece)
        return self._stream(what, signature_of(kind, nbytes), rounds, _writer(shard_bytes), read)

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
            input_bytes = bytes_of(flat)
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
                if not has_storage(output):
                    return  # its owner freed it before waiting: nobody reads the result
                target = bytes_of(output)[start : start + length].view(output.dtype)
                for peer in peers:
                    at = _chunk_offset(self.rank, peer, length)
                    target.add_(self.files.region(peer, slot, at + length)[at:].view(output.dtype))

            rounds = _rounds(chunk_bytes, self._reduce_piece(flat.element_size()))
            signature = signature_of(REDUCE_SCATTER, chunk_bytes * len(peers))
            work = self._stream("a reduce-scatter", signature, rounds, write, read, per_round=len(peers))
        finally:
            self.slots.leave()
        return _waited_unless(async_op, work)

    def reduce_scatter_pieces(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *, async_op: bool
    ) -> SharedMemoryWork | None:
        """``reduce_scatter`` of several tensors in one collective: rank
        ``r``'s chunk is every input's chunk ``r`` (``inputs[i]`` has
        ``world_size`` times ``outputs[i]``'s elements) back to back, and
        each output gets its input's chunk of this rank, summed. Read and
        written where they lie: no side-by-side copy of the inputs, and each
        output is a tensor of its own (the bytes a peer sees are those of one
        reduce-scatter of the inputs' chunks laid side by side, summed in the
        same order). ``inputs`` are not used after this call returns."""
        self._check_paired("reduce-scatter", outputs, inputs, "input", outputs_are_wholes=False)
        for output, input in zip(outputs, inputs):
            if not input.is_contiguous():
                raise ValueError("shared-memory collectives need contiguous tensors")
            if input.dtype != inputs[0].dtype or output.dtype != inputs[0].dtype:
                raise ValueError(
                    f"shared-memory reduce-scatter of pieces: inputs and outputs of one dtype, got {input.dtype} "
                    f"and {output.dtype} beside {inputs[0].dtype}"
                )
        targets = Pieces(outputs)  # refuses strided tensors before anything is issued
        chunks = [input.detach().view(self.world_size, -1) for input in inputs]
        peers = [peer for peer in range(self.world_size) if peer != self.rank]
        sources = {peer: Pieces([chunk[peer] for chunk in chunks]) for peer in peers}
        dtype = inputs[0].dtype
        self.slots.enter("a reduce-scatter")
        try:
            torch._foreach_copy_(list(outputs), [chunk[self.rank] for chunk in chunks])  # _check_paired: one at least

            def write(region: torch.Tensor, start: int, length: int) -> None:
                for index, peer in enumerate(peers):
                    transfer(sources[peer], start, Pieces([region[index * length : (index + 1) * length]]), 0, length)

            def read(slot: int, start: int, length: int) -> None:
                if not targets.has_storage():
                    return  # its owner freed it before waiting: nobody reads the result
                spans = [(target.view(dtype), offset, target.numel()) for target, offset in targets.spans(start, length)]
                for peer in peers:  # in rank order, each added to every target at once
                    at = _chunk_offset(self.rank, peer, length)
                    region = self.files.region(peer, slot, at + length)[at:]
                    added = [region[offset : offset + numel].view(dtype) for _, offset, numel in spans]
                    if added:
                        torch._foreach_add_([target for target, _, _ in spans], added)

            rounds = _rounds(targets.nbytes, self._reduce_piece(inputs[0].element_size()))
            signature = signature_of(REDUCE_SCATTER, targets.nbytes * len(peers))
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
            tensor_bytes = bytes_of(tensor)
            nbytes = tensor_bytes.numel()

            def read(slot: int, start: int, length: int) -> None:
                if not has_storage(tensor):
                    return  # its owner freed it before waiting: nobody reads the result
                target = bytes_of(tensor)[start : start + length].view(tensor.dtype)
                target.copy_(self.files.region(0, slot, length).view(tensor.dtype))
                for peer in range(1, self.world_size):
                    target.add_(self.files.region(peer, slot, length).view(tensor.dtype))

            rounds = _rounds(nbytes, _aligned(self.files.slot_bytes, tensor.element_size()))
            work = self._stream("an all-reduce", signature_of(ALL_REDUCE, nbytes), rounds, _writer(tensor_bytes), read)
        finally:
            self.slots.leave()
        return _waited_unless(async_op, work)

    def all_reduce_pieces(self, tensors: Sequence[torch.Tensor], *, async_op: bool) -> SharedMemoryWork | None:
        """``all_reduce`` of several tensors of one dtype in one collective,
        each summed in place where it lies (the bytes a peer sees are those
        of one all-reduce of the tensors laid back to back, summed in the
        same order)."""
        if not tensors:
            raise ValueError("shared-memory all-reduce of pieces: no tensor")
        for tensor in tensors:
            if tensor.dtype != tensors[0].dtype:
                raise ValueError(
                    f"shared-memory all-reduce of pieces: tensors of one dtype, got {tensor.dtype} beside "
                    f"{tensors[0].dtype}"
                )
        pieces = Pieces(tensors)  # refuses strided tensors before anything is issued
        dtype = tensors[0].dtype
        self.slots.enter("an all-reduce")
        try:

            def write(region: torch.Tensor, start: int, length: int) -> None:
                transfer(pieces, start, Pieces([region]), 0, length)

            def read(slot: int, start: int, length: int) -> None:
                if not pieces.has_storage():
                    return  # its owner freed it before waiting: nobody reads the result
                regions = [self.files.region(peer, slot, length) for peer in range(self.world_size)]
                for target, offset in pieces.spans(start, length):
                    summed = target.view(dtype)  # in rank order, as all_reduce
                    summed.copy_(regions[0][offset : offset + target.numel()].view(dtype))
                    for region in regions[1:]:
                        summed.add_(region[offset : offset + target.numel()].view(dtype))

            rounds = _rounds(pieces.nbytes, _aligned(self.files.slot_bytes, tensors[0].element_size()))
            work = self._stream("an all-reduce", signature_of(ALL_REDUCE, pieces.nbytes), rounds, write, read)
        finally:
            self.slots.leave()
        return _waited_unless(async_op, work)

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int]
    ) -> None:
        """Rank ``r``'s ``input_splits[q]`` elements of 1-D ``input`` go to
        rank ``q``, landing in ``output`` after what lower ranks sent it
        (synchronous): every rank's splits, then the pieces, in rounds
        ([Note: shared-memory all-to-all])."""
        self.all_to_all_pieces([output], [input], output_splits, input_splits)

    def all_to_all_pieces(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        output_splits: list[int],
        input_splits: list[int],
    ) -> None:
        """``all_to_all`` of ``inputs`` laid back to back into ``outputs``
        laid back to back (1-D tensors of one dtype), each read or written
        where it is: no send or receive buffer."""
        sends, expects, element_size = self._check_splits(outputs, inputs, output_splits, input_splits)
        received, sent = Pieces(outputs), Pieces(inputs)  # refuses strided tensors before anything is issued
        capacity = min(self.files.slot_bytes, max(self.files.reserved_bytes, _LEAST_ROUND_BYTES))
        row = torch.tensor([element_size, capacity, *sends, *expects], dtype=torch.int64)
        table = torch.empty(self.world_size * row.numel(), dtype=torch.int64)
        self.slots.enter("an all-to-all")
        try:
            work = self._gather(table, row, ALL_TO_ALL, "an all-to-all")
            try:
                work.wait_held()
            except BaseException as error:
                self._broken("an all-to-all", error)
                raise
            rows = table.view(self.world_size, row.numel()).tolist()
            _check_pairing(rows, self.world_size)  # alike on every rank: the group goes on
            try:
                self._exchange(received, sent, rows)
            except BaseException as error:
                self._broken("an all-to-all", error)
                raise
        finally:
            self.slots.leave()

    def _exchange(self, output: Pieces, input: Pieces, rows: list[list[int]]) -> None:
        """An all-to-all's pieces, once every rank holds every rank's ``rows``
        (the caller holds the ring; see the Note)."""
        rank, world_size = self.rank, self.world_size
        sends = [row[_SENDS_AT : _SENDS_AT + world_size] for row in rows]  # sends[w][p]: bytes w sends p
        capacity = min(row[1] for row in rows)
        input_at = offsets(sends[rank])
        output_at = offsets([sends[writer][rank] for writer in range(world_size)])
        own = sends[rank][rank]

        def copy_own() -> None:
            transfer(input, input_at[rank], output, output_at[rank], own)

        # Where each rank's piece for each peer starts in its stream (its own left out).
        streams = [offsets([0 if peer == writer else sends[writer][peer] for peer in range(world_size)]) for writer in range(world_size)]
        totals = [sum(row) - row[writer] for writer, row in enumerate(sends)]
        count = max(-(-total // capacity) for total in totals)
        if count == 0:
            copy_own()  # nothing for a peer anywhere: every rank knows it
            return
        peers = [peer for peer in range(world_size) if peer != rank]

        def write(region: torch.Tensor, start: int, length: int) -> None:
            into = Pieces([region])
            for peer in peers:
                low, high = overlap(streams[rank][peer], sends[rank][peer], start, length)
                if high > low:
                    transfer(input, input_at[peer] + low - streams[rank][peer], into, low - start, high - low)

        def read(slot: int, start: int, length: int) -> None:
            # The writer's round covers its stream from ``start``, up to ``capacity`` bytes.
            if not output.has_storage():
                return
            for writer in peers:
                low, high = overlap(streams[writer][rank], sends[writer][rank], start, capacity)
                if high > low:
                    region = Pieces([self.files.region(writer, slot, high - start)])
                    transfer(region, low - start, output, output_at[writer] + low - streams[writer][rank], high - low)

        mine = totals[rank]
        rounds = [(index * capacity, max(0, min(capacity, mine - index * capacity))) for index in range(count)]
        signature = signature_of(ALL_TO_ALL, sum(totals))
        work = self._stream("an all-to-all", signature, rounds, write, read)
        copy_own()  # while the peers read what this rank published
        work.wait_held()

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
            if published:
                self._broken(what, error)
            raise
        return work

    def _broken(self, what: str, error: BaseException) -> None:
        """Fail every later call of the group (unless a failure already
        does): ``what`` failed after some of its rounds were published."""
        if self.slots.failure is None:
            self.slots.failure = RuntimeError(
                f"composable_shard shared-memory collectives: {what} failed after part of it was sent "
                f"({error}); the process group cannot go on."
            )
            self.slots.failure.__cause__ = error

    @property
    def _gather_piece(self) -> int:  # bytes of its shard an all-gather moves per round
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

    def _check_splits(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        output_splits: list[int],
        input_splits: list[int],
    ) -> tuple[list[int], list[int], int]:
        """An all-to-all's bytes to and from each rank and its element size,
        once its tensors and splits fit each other (checked before anything
        is issued)."""
        tensors = [*inputs, *outputs]
        dtypes = {tensor.dtype for tensor in tensors}
        if not inputs or not outputs or len(dtypes) != 1 or any(tensor.dim() != 1 for tensor in tensors):
            raise ValueError(
                "shared-memory all-to-all: inputs and outputs must be 1-D tensors of one dtype, got "
                f"{[(t.dtype, tuple(t.shape)) for t in inputs]} and {[(t.dtype, tuple(t.shape)) for t in outputs]}"
            )
        for name, splits, numel in (
            ("input", input_splits, sum(t.numel() for t in inputs)),
            ("output", output_splits, sum(t.numel() for t in outputs)),
        ):
            if len(splits) != self.world_size or min(splits, default=0) < 0 or sum(splits) != numel:
                raise ValueError(
                    f"shared-memory all-to-all: {name}_splits {list(splits)} must be {self.world_size} counts "
                    f"(one per rank), none negative, summing to the {name}'s {numel} elements"
                )
        size = inputs[0].element_size()
        return [count * size for count in input_splits], [count * size for count in output_splits], size

    def _check_paired(
        self,
        what: str,
        outputs: Sequence[torch.Tensor],
        others: Sequence[torch.Tensor],
        other: str,
        *,
        outputs_are_wholes: bool,
    ) -> None:
        """One output per ``other`` tensor, at least one, each pair of sizes
        fitting (the whole ``world_size`` chunks: an all-gather's output, a
        reduce-scatter's input)."""
        if len(outputs) != len(others) or not others:
            raise ValueError(
                f"shared-memory {what} of pieces: {len(outputs)} outputs for {len(others)} {other}s "
                f"(one output per {other}, at least one)"
            )
        for output, each in zip(outputs, others):
            if outputs_are_wholes:
                self._check_sizes(f"{what}: output", output, each)
            else:
                self._check_sizes(f"{what}: {other}", each, output)

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


def _check_pairing(rows: list[list[int]], world_size: int) -> None:
    """Raise where an all-to-all's splits do not pair (every rank holds
    every rank's ``rows`` and raises alike, before any data was sent)."""
    sizes = [row[0] for row in rows]
    if len(set(sizes)) != 1:
        raise ValueError(
            f"shared-memory all-to-all: the ranks' tensors have elements of {sizes} bytes (by rank); every rank "
            "must pass the same dtype. No data was sent; the group can go on."
        )
    expects_at = _SENDS_AT + world_size
    for writer in range(world_size):
        for reader in range(world_size):
            sent, expected = rows[writer][_SENDS_AT + reader], rows[reader][expects_at + writer]
            if sent != expected:
                raise ValueError(
                    f"shared-memory all-to-all: rank {writer} sends {sent // sizes[0]} elements to rank {reader}, "
                    f"whose output_splits[{writer}] is {expected // sizes[0]}. Every rank r's input_splits[q] must "
                    "equal rank q's output_splits[r]. No data was sent; the group can go on."
                )


def _chunk_offset(chunk_rank: int, writer: int, chunk_bytes: int) -> int:
    """Where ``chunk_rank``'s chunk starts in a reduce-scatter region that
    rank ``writer`` wrote (every chunk but the writer's own, in rank order)."""
    return (chunk_rank if chunk_rank < writer else chunk_rank - 1) * chunk_bytes
