"""Owns: the collectives (all-gather into one tensor, reduce-scatter,
all-reduce) and the process groups of one unit (shard group and, for hybrid
sharding, replicate group).

Knows nothing of: modules, flat parameters, streams.

Only this module calls ``torch.distributed`` collectives, so tests can wrap it
to count or order them (a spy that calls through).

Public names: ``ShardGroups``, ``all_gather_into``, ``reduce_scatter`` (and
its per-backend ``reduce_scatter_method``, ``ChunkOfAllReduce``),
``all_reduce``, ``broadcast``, ``Work``, ``PendingCollective``,
``inputs_in_use``; for state
dicts and checkpoints, ``broadcast_object`` and ``all_gather_object``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import host_shared_memory
from .host_shared_memory import HostSharedMemory, SharedMemoryWork

__all__ = [
    "ShardGroups",
    "Work",
    "all_gather_into",
    "reduce_scatter",
    "reduce_scatter_method",
    "ChunkOfAllReduce",
    "all_reduce",
    "broadcast",
    "broadcast_object",
    "all_gather_object",
    "PendingCollective",
    "inputs_in_use",
]

# Work handle returned by asynchronous collectives (``None`` when synchronous).
Work = dist.Work

# torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
# in favour of the ``*_single`` names; older releases only have the former.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# Older releases (2.4 among them) name a broadcast's source by its global
# rank only (see ``_source``).
_TAKES_GROUP_SRC = "group_src" in inspect.signature(dist.broadcast).parameters


class PendingCollective(NamedTuple):
    """An issued collective and the tensors it reads or writes.

    Whoever holds this keeps ``output`` and ``inputs`` alive until the work is
    waited on (the backend may still be reading or writing them).
    """

    work: Work | ChunkOfAllReduce | SharedMemoryWork | None
    output: torch.Tensor
    inputs: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class ShardGroups:
    """The process groups a unit communicates over.

    Parameters are sharded over ``shard_group`` and replicated over
    ``replicate_group`` (hybrid sharding). ``NO_SHARD`` is a shard group of one
    rank replicated over all ranks, so every strategy is a point in this one
    2-D space.
    """

    # Group the flat parameter is sharded over; None means "this rank alone".
    shard_group: ProcessGroup | None
    # Group the shards are replicated over; None means no replication.
    replicate_group: ProcessGroup | None
    shard_rank: int = field(init=False)
    shard_world_size: int = field(init=False)
    replicate_world_size: int = field(init=False)

    def __post_init__(self) -> None:
        shard_rank, shard_size = 0, 1
        if self.shard_group is not None:
            shard_rank = dist.get_rank(self.shard_group)
            shard_size = dist.get_world_size(self.shard_group)
        replicate_size = 1
        if self.replicate_group is not None:
            replicate_size = dist.get_world_size(self.replicate_group)
        object.__setattr__(self, "shard_rank", shard_rank)
        object.__setattr__(self, "shard_world_size", shard_size)
        object.__setattr__(self, "replicate_world_size", replicate_size)

    @property
    def data_parallel_world_size(self) -> int:
        """Number of ranks whose gradients are averaged."""
        return self.shard_world_size * self.replicate_world_size

    @property
    def is_sharded(self) -> bool:
        return self.shard_world_size > 1


def all_gather_into(
    output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup | None, *, async_op: bool
) -> Work | None:
    """Gather every rank's equal-sized ``shard`` into ``output`` (rank order).
    CPU tensors of a group on one host go through shared memory (see
    [Note: shared-memory collectives] in host_shared_memory.py)."""
    transport = _host_transport(shard, group)
    if transport is not None:
        return transport.all_gather(output, shard, async_op=async_op)
    return _all_gather_single(output, shard, group=group, async_op=async_op)


def inputs_in_use(work: Any) -> bool:
    """Whether the backend may still read a collective's inputs until its
    work is waited on (False for shared-memory work, which copied them out
    when it was issued, so their memory can be freed at once)."""
    return not isinstance(work, SharedMemoryWork)


def _host_transport(tensor: torch.Tensor, group: ProcessGroup | None) -> HostSharedMemory | None:
    # Under torch.compile, gloo's collectives, which dynamo traces: the
    # shared-memory path's file I/O would break the graph at every call.
    if tensor.device.type != "cpu" or torch.compiler.is_compiling() or not host_shared_memory.enabled():
        return None
    return HostSharedMemory.for_group(group)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None,
    *,
    async_op: bool,
    method: str | None = None,
) -> Work | ChunkOfAllReduce | None:
    """Sum ``input`` over the group and keep this rank's chunk in ``output``.

    ``input`` may be overwritten (it is scratch for the reduction), and
    ``output`` holds the result only once the returned work was waited on.
    ``method`` (``"reduce_scatter"``, ``"all_reduce"`` or
    ``"shared_memory"``) overrides the per-backend choice of
    ``reduce_scatter_method``.
    """
    if method in (None, "shared_memory"):
        # The transport is looked up once per call: this runs every step.
        transport = _host_transport(input, group)
        if transport is not None:
            return transport.reduce_scatter(output, input, async_op=async_op)
        if method == "shared_memory":
            raise ValueError(
                "comm.reduce_scatter: method 'shared_memory' needs CPU tensors and a gloo group whose ranks share "
                f"a host, with {host_shared_memory.ENV_SWITCH} not set to 0"
            )
        method = _message_method(input, group)
    if method == "reduce_scatter":
        return _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    if method != "all_reduce":
        raise ValueError(
            f"comm.reduce_scatter: method must be 'reduce_scatter', 'all_reduce' or 'shared_memory', got {method!r}"
        )
    size = output.numel()
    chunk = input[dist.get_rank(group) * size : (dist.get_rank(group) + 1) * size]
    work = dist.all_reduce(input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    if work is None:
        output.copy_(chunk)
        return None
    return ChunkOfAllReduce(work, output, chunk)


def reduce_scatter_method(input: torch.Tensor, group: ProcessGroup | None) -> str:
    """How ``reduce_scatter`` reduces ``input`` over ``group``.

    [Note: gradient collective per backend]
    NCCL (and any backend but gloo): a reduce-scatter, which moves each byte
    once. gloo on CPU with every rank on one host: shared memory (measured in
    [Note: shared-memory collectives], host_shared_memory.py: about half the
    time and CPU of the all-reduce below). Other gloo groups on CPU: an in-place all-reduce of the whole input, keeping this
    rank's chunk. gloo's reduce-scatter copies its whole input before
    reducing and reaches about half the bus bandwidth of its all-reduce, so
    the all-reduce is faster although it moves twice the bytes. Measured with
    ``scripts/bench_comm.py`` (world size 2, one thread per rank, 2 shared
    cores under load, 40 calls each interleaved), all-reduce + chunk copy /
    reduce-scatter median time: 0.92 at 1 MiB, 0.80 at 4 MiB, 0.81 at
    16 MiB, although the all-reduce side also paid a full copy of its input
    there; the handle's reduction on this path / raw reduce-scatter: 0.95,
    0.79, 0.74. (An all-gather done as an all-reduce was slower at 1 and
    4 MiB, so all-gathers stay all-gathers.) It costs no memory: the
    padded gradient exists anyway and is freed after the reduction, and the
    chunk is copied out of it (``ChunkOfAllReduce``), never kept as a view
    that would hold the whole buffer alive.
    """
    if _host_transport(input, group) is not None:
        return "shared_memory"
    return _message_method(input, group)


def _message_method(input: torch.Tensor, group: ProcessGroup | None) -> str:
    """The choice among collectives that send messages (see the Note above)."""
    if input.device.type == "cpu" and "gloo" in str(dist.get_backend(group)):
        return "all_reduce"
    return "reduce_scatter"


class ChunkOfAllReduce:
    """The work of a reduce-scatter done as an in-place all-reduce: waiting
    on it waits for the all-reduce, then copies this rank's chunk into the
    output (so the output never aliases the input)."""

    def __init__(self, work: Work, output: torch.Tensor, chunk: torch.Tensor) -> None:
        self._work: Work | None = work
        self._output = output
        self._chunk: torch.Tensor | None = chunk

    def wait(self, *timeout: Any) -> bool:
        """As ``Work.wait`` (an optional timeout is passed on)."""
        if self._work is not None and self._chunk is not None:
            self._work.wait(*timeout)
            self._output.copy_(self._chunk)
            self._work, self._chunk = None, None  # drop the reference to the input
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, *, async_op: bool) -> Work | None:
    """Sum ``tensor`` in place over the group."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_max(tensor: torch.Tensor, group: ProcessGroup | None) -> None:
    """Element-wise maximum of ``tensor`` in place over the group (synchronous)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


def broadcast(tensor: torch.Tensor, src_group_rank: int, group: ProcessGroup | None) -> None:
    """Overwrite ``tensor`` with the one on group rank ``src_group_rank`` (synchronous)."""
    dist.broadcast(tensor, group=group, **_source(src_group_rank, group))


def broadcast_object(obj: Any, src_group_rank: int = 0, group: ProcessGroup | None = None) -> Any:
    """The picklable ``obj`` of group rank ``src_group_rank``, on every rank."""
    holder = [obj]
    dist.broadcast_object_list(holder, group=group, **_source(src_group_rank, group))
    return holder[0]


def _source(src_group_rank: int, group: ProcessGroup | None) -> dict[str, int]:
    """The keyword naming a broadcast's source, for this torch release."""
    if _TAKES_GROUP_SRC:
        return {"group_src": src_group_rank}
    if group is None:
        return {"src": src_group_rank}
    return {"src": dist.get_global_rank(group, src_group_rank)}


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in group rank order, on every rank."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
