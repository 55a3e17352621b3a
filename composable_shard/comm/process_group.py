"""Owns: collectives sent as messages through a process group's backend
(gloo on CPU, NCCL on CUDA): all-gather into one tensor, reduce-scatter (as
a reduce-scatter or as an in-place all-reduce, per backend), all-reduce,
broadcast and the object collectives of state dicts and checkpoints, and the
differences between torch releases in how they are called.

Knows nothing of: shared memory (the other transport), which transport a
collective takes (``transport``), modules, flat parameters, streams.

Public names: ``all_gather_into``, ``reduce_scatter``, ``message_method``,
``ChunkOfAllReduce``, ``FreedAtWait``, ``free_storage``, ``all_reduce``, ``all_reduce_max``, ``max_over_groups``, ``broadcast``,
``broadcast_object``, ``all_gather_object``.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "all_gather_into",
    "reduce_scatter",
    "message_method",
    "ChunkOfAllReduce",
    "FreedAtWait",
    "free_storage",
    "all_reduce",
    "all_reduce_max",
    "max_over_groups",
    "broadcast",
    "broadcast_object",
    "all_gather_object",
]

# torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
# in favour of the ``*_single`` names; older releases only have the former.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# Older releases (2.4 among them) name a broadcast's source by its global
# rank only (see ``_source``).
_TAKES_GROUP_SRC = "group_src" in inspect.signature(dist.broadcast).parameters


# Gather every rank's equal-sized shard into one output tensor (rank order):
# ``all_gather_into(output, shard, group=group, async_op=async_op)``. The
# torch function itself, not a wrapper: under torch.compile every Python
# frame between the hook and the collective adds a graph break.
all_gather_into = _all_gather_single


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, *, async_op: bool, method: str
) -> dist.Work | ChunkOfAllReduce | None:
    """Sum ``input`` over the group and keep this rank's chunk in ``output``,
    by ``method`` (``"reduce_scatter"`` or ``"all_reduce"``, see [Note:
    gradient collective per backend] in ``transport``). ``input`` may be
    overwritten."""
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


def message_method(input: torch.Tensor, group: ProcessGroup | None) -> str:
    """How the backend reduces a gradient (see [Note: gradient collective
    per backend] in ``transport``): an all-reduce on gloo, else a
    reduce-scatter."""
    if input.device.type == "cpu" and "gloo" in str(dist.get_backend(group)):
        return "all_reduce"
    return "reduce_scatter"


class ChunkOfAllReduce:
    """The work of a reduce-scatter done as an in-place all-reduce: waiting
    on it waits for the all-reduce, then copies this rank's chunk into the
    output (so the output never aliases the input)."""

    def __init__(self, work: dist.Work, output: torch.Tensor, chunk: torch.Tensor) -> None:
        self._work: dist.Work | None = work
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


class FreedAtWait:
    """A collective's work whose (first) wait also frees the storage of the
    temporaries handed to the backend (CPU tensors nobody reads after the
    wait). gloo's worker thread keeps its own references to a work's
    tensors and drops them after it marked the work complete, whenever the
    OS runs it: without this, a temporary the caller let go of first is
    freed later, on that thread, and the step's memory holds it past the
    wait where ``plan`` frees it (a CPU rank's peak up to 12% above the
    plan, measured by tests/planning/test_plan_message_path.py)."""

    def __init__(self, work: Any, temporaries: tuple[torch.Tensor, ...]) -> None:
        self._work: Any = work
        self._temporaries = temporaries

    @classmethod
    def around(cls, work: Any, temporaries: tuple[torch.Tensor, ...]) -> Any:
        """``work`` freeing ``temporaries`` at its wait where they are CPU
        tensors a backend's thread may hold; ``work`` itself otherwise (none
        to wait for, or CUDA: the caching allocator orders frees by stream)."""
        if work is None or temporaries[0].device.type != "cpu":
            return work
        return cls(work, temporaries)

    def wait(self, *timeout: Any) -> bool:
        """As ``Work.wait`` (an optional timeout is passed on)."""
        if self._work is not None:
            self._work.wait(*timeout)
            self._work = None
            free_storage(*self._temporaries)
            self._temporaries = ()
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


def free_storage(*tensors: torch.Tensor | None) -> None:
    """Release the bytes of tensors a collective used, now and on this
    thread, whoever else still references them (None: nothing); their views
    must not be read afterwards. gloo's ``Work`` drops its own references on
    its worker thread, after marking the work complete and outside the
    profiler's view of memory (``FreedAtWait``)."""
    for tensor in tensors:
        if tensor is not None:
            tensor.untyped_storage().resize_(0)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, *, async_op: bool) -> dist.Work | None:
    """Sum ``tensor`` in place over the group."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_max(tensor: torch.Tensor, group: ProcessGroup | None) -> None:
    """Element-wise maximum of ``tensor`` in place over the group (synchronous)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


def all_reduce_max_with_nan(tensor: torch.Tensor, group: ProcessGroup | None) -> None:
    """``all_reduce_max`` of a floating-point ``tensor`` where a NaN on any
    rank gives NaN, as ``torch.maximum`` does (gloo's MAX keeps or drops a
    peer's NaN by the order it compares in: an inf-norm over shards missed
    a NaN gradient). Twice the bytes: for values that may be NaN only."""
    flat = tensor.view(-1)
    packed = torch.cat([flat.nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf), flat.isnan().to(flat.dtype)])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    value, nan = packed.split(flat.numel())
    flat.copy_(value.masked_fill(nan > 0, math.nan))


def max_over_groups(
    flags: list[int], groups: tuple[ProcessGroup | None, ...], device: torch.device
) -> list[int]:
    """Each of ``flags``' maximum over every rank of ``groups`` in turn (a
    shard group, then its replicate group: the whole product), reduced on
    ``device``; a group that is None or of one rank is passed over."""
    values = torch.tensor(flags, dtype=torch.int32, device=device)
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            all_reduce_max(values, group)
    return values.tolist()


def all_to_all(
    output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
    group: ProcessGroup | None,
) -> None:
    """Rank ``r``'s ``input_splits[q]`` elements go to rank ``q``, landing
    after what lower ranks sent (synchronous)."""
    dist.all_to_all_single(output, input, output_splits, input_splits, group=group)


def broadcast(tensor: torch.Tensor, src_group_rank: int, group: ProcessGroup | None) -> None:
    """Overwrite ``tensor`` with the one on group rank ``src_group_rank`` (synchronous)."""
    dist.broadcast(tensor, group=group, **_source(src_group_rank, group))


def broadcast_object(obj: Any, src_group_rank: int = 0, group: ProcessGroup | None = None) -> Any:
    """The picklable ``obj`` of group rank ``src_group_rank``, on every rank."""
    holder = [obj]
    dist.broadcast_object_list(holder, group=group, **_source(src_group_rank, group))
    return holder[0]


class _Source(TypedDict, total=False):
    """A broadcast's source keyword: one of the two."""

    src: int
    group_src: int


def _source(src_group_rank: int, group: ProcessGroup | None) -> _Source:
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
