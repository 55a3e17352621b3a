"""Owns: the collectives the package calls (all-gather into one tensor,
reduce-scatter, all-reduce, broadcast, object collectives), each handed to
the transport that carries it.

Knows nothing of: modules, flat parameters, streams.

Collectives live in this folder, one file per concern:

- ``transport.py``: which transport carries a collective (shared memory or
  the backend's messages), and which method reduces a gradient;
- ``process_group.py``: the gloo/NCCL path, through ``torch.distributed``;
- ``shared_memory/``: the shared-memory transport between the processes
  of one host (its files, its slots and waits, its collectives);
- ``groups.py``: the process groups of one unit (``ShardGroups``);
- ``tags.py`` and ``tag_check.py``: the unit a collective belongs to, so
  ranks that issue different units' collectives fail naming them;
- ``reduction.py``: a gradient reduction's settings and arithmetic (divide
  factors, dtype casts), which ``reduce_grad`` and
  ``finish_grad_reduction`` here run around the collectives;
- ``overrides.py``: a unit's overrides of its reduction (divide factor,
  skipped replica all-reduce, communication and all-reduce hooks).

Only this folder calls ``torch.distributed`` collectives, and the rest of
the package calls them through the functions defined here, so tests can
wrap this module to count or order them (a spy that calls through).

Public names: ``ShardGroups``, ``all_gather_into`` (several at once:
``GATHER_BUCKET_BYTES``, ``gatherable_bytes``, ``all_gather_together``,
``GatheredThenCopied``), ``reduce_scatter`` (and
its per-backend ``reduce_scatter_method``, ``ChunkOfAllReduce``),
``all_reduce``, ``all_reduce_max``, ``all_to_all`` (in place where the
transport allows: ``all_to_all_in_place``, ``all_to_all_pieces``),
``broadcast``, ``Work``,
``PendingCollective``, ``inputs_in_use``, ``expect_collective_bytes``; a
gradient's reduction: ``GradReduceSettings``, ``reduce_grad``,
``finish_grad_reduction``, several at once: ``REDUCE_BUCKET_BYTES``,
``bucketable_bytes``, ``collective_bytes_per_group``, ``can_reduce_together``,
``reduce_grads_together``, ``split_reduced``; ``ReductionOverrides``, ``settings_with``,
``check_overrides``; a gradient norm from per-group parts:
``total_norm_of_parts``; for state dicts and checkpoints,
``broadcast_object`` and ``all_gather_object``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import process_group, transport
from .groups import ShardGroups
from .process_group import ChunkOfAllReduce, FreedAtWait
from .overrides import ReductionOverrides, check_overrides, settings_with
from .reduction import GradReduceSettings, mean_of_sum, owned, prepare_for_sum
from .shared_memory import SharedMemoryWork, eagerly, outside_graph
from .tag_check import TagCheckedWork, checked
from .transport import expect_collective_bytes

__all__ = [
    "ShardGroups",
    "Work",
    "all_gather_into",
    "GATHER_BUCKET_BYTES",
    "gatherable_bytes",
    "all_gather_together",
    "GatheredThenCopied",
    "reduce_scatter",
    "reduce_scatter_method",
    "ChunkOfAllReduce",
    "all_reduce",
    "all_reduce_max",
    "all_to_all",
    "all_to_all_in_place",
    "all_to_all_pieces",
    "broadcast",
    "broadcast_object",
    "all_gather_object",
    "PendingCollective",
    "inputs_in_use",
    "expect_collective_bytes",
    "GradReduceSettings",
    "reduce_grad",
    "REDUCE_BUCKET_BYTES",
    "bucketable_bytes",
    "collective_bytes_per_group",
    "can_reduce_together",
    "reduce_grads_together",
    "split_reduced",
    "finish_grad_reduction",
    "ReductionOverrides",
    "settings_with",
    "check_overrides",
]

# Work handle returned by asynchronous collectives (``None`` when synchronous).
Work = dist.Work


@dataclass(eq=False)
class PendingCollective:
    """An issued collective and the tensors it reads or writes: whoever holds
    this keeps ``output`` and ``inputs`` alive until the work is waited on
    (the backend may still use them); then ``inputs`` may go (``Scheduler``
    drops them before a reduction's finish allocates)."""

    work: Work | ChunkOfAllReduce | SharedMemoryWork | TagCheckedWork | GatheredThenCopied | FreedAtWait | None
    output: torch.Tensor
    inputs: tuple[torch.Tensor, ...]
    # A coalesced reduction's outputs where each is a tensor of its own
    # (``output`` is the first): what ``split_reduced`` hands out.
    outputs: tuple[torch.Tensor, ...] = ()


def all_gather_into(
    output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup | None, *, async_op: bool
) -> Work | SharedMemoryWork | None:
    """Gather every rank's equal-sized ``shard`` into ``output`` (rank order).
    CPU tensors of a group on one host go through shared memory (see
    [Note: shared-memory collectives] in comm/shared_memory/collectives.py)."""
    # Compiled code takes the group's one transport too, run eagerly (see
    # [Note: one transport per group] in comm/transport.py).
    if shard.device.type == "cpu" and torch.compiler.is_compiling():
        return eagerly(_all_gather_into)(output, shard, group, async_op=async_op)
    return _all_gather_into(output, shard, group, async_op=async_op)


@outside_graph
def _all_gather_into(
    output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup | None, *, async_op: bool
) -> Work | SharedMemoryWork | None:
    shared = transport.host_transport(shard, group, shard.numel() * shard.element_size())
    if shared is not None:
        return shared.all_gather(output, shard, async_op=async_op)
    # The message path carries no tag: checked beside ([Note: tagged collectives] in tags.py).
    launch = functools.partial(process_group.all_gather_into, output, shard, group=group, async_op=async_op)
    return checked(launch, shard, group, async_op=async_op)


# The most unsharded bytes one coalesced all-gather fills ([Note: coalesced
# all-gathers] in runtime/gather_buckets.py; 0 switches coalescing off).
GATHER_BUCKET_BYTES = 1 << 20


def gatherable_bytes(padded_numel: int, param_dtype: torch.dtype, bucket_bytes: int) -> int:
    """An unsharded buffer's bytes where its all-gather may share one
    collective of ``bucket_bytes`` (size only: at most a quarter of it, so
    a bucket pays where it holds several, and a unit of its own size
    costs no extra memory), else 0."""
    nbytes = padded_numel * param_dtype.itemsize
    return nbytes if 0 < nbytes <= bucket_bytes // 4 else 0


def all_gather_together(
    outputs: list[torch.Tensor], shards: list[torch.Tensor], group: ProcessGroup | None, *, async_op: bool
) -> PendingCollective:
    """``all_gather_into`` for several flat buffers of one group, dtype and
    device in one collective: the shards laid one after another (each cast
    to the outputs' dtype), gathered rank by rank into one buffer, then
    each output gets its piece of every rank's row, in rank order: the same
    bytes as gathering each alone. The pieces are copied once the work is
    waited on (at once where the launch waited, or enqueued it in stream
    order: NCCL). Through shared memory, where no shard needs a cast, the
    same bytes move with neither buffer (``all_gather_pieces``)."""
    if shards[0].device.type == "cpu" and not torch.compiler.is_compiling():
        # Through shared memory each shard is written from, and each row read
        # into, where it lies: nothing side by side, no rows to copy out.
        # A cast (mixed precision) goes through the side-by-side buffer.
        nbytes = sum(shard.numel() for shard in shards) * outputs[0].element_size()
        shared = transport.host_transport(shards[0], group, nbytes)
        if shared is not None and all(shard.dtype == outputs[0].dtype for shard in shards):
            return PendingCollective(shared.all_gather_pieces(outputs, shards, async_op=async_op), outputs[0], ())
    sizes = [shard.numel() for shard in shards]
    world_size = outputs[0].numel() // sizes[0]
    combined = outputs[0].new_empty(sum(sizes))
    for piece, shard in zip(combined.split(sizes), shards):
        piece.copy_(shard, non_blocking=True)
    gathered = combined.new_empty(world_size * combined.numel())
    work = all_gather_into(gathered, combined, group, async_op=async_op)
    copy_out = functools.partial(_copy_rows_out, gathered.view(world_size, -1), outputs, sizes)
    if work is None:
        copy_out()
        return PendingCollective(None, gathered, ())
    inputs = (combined,) if inputs_in_use(work) else ()
    # On CPU both buffers go once copied out (``FreedAtWait``: a backend's
    # thread may hold them longer).
    freed = (gathered, combined) if combined.device.type == "cpu" else ()
    return PendingCollective(GatheredThenCopied(work, copy_out, freed), gathered, inputs)


class GatheredThenCopied:
    """An all-gather's work whose (first) wait also copies the result out
    (``all_gather_together``)."""

    def __init__(self, work: Any, copy_out: Any, freed: tuple[torch.Tensor, ...] = ()) -> None:
        self._work = work
        self._copy_out = copy_out
        self._freed = freed

    def wait(self, *timeout: Any) -> bool:
        if self._work is not None:
            self._work.wait(*timeout)
            self._work = None
            copy_out, self._copy_out = self._copy_out, None
            copy_out()
            process_group.free_storage(*self._freed)
            self._freed = ()
        return True


def _copy_rows_out(rows: torch.Tensor, outputs: list[torch.Tensor], sizes: list[int]) -> None:
    offset = 0
    for output, size in zip(outputs, sizes):
        # A buffer its owner freed before waiting (an error path): nobody reads it.
        if output.untyped_storage().nbytes() >= output.numel() * output.element_size():
            output.view(rows.shape[0], size).copy_(rows.narrow(1, offset, size), non_blocking=True)
        offset += size


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None,
    *,
    async_op: bool,
    method: str | None = None,
) -> Work | ChunkOfAllReduce | SharedMemoryWork | None:
    """Sum ``input`` over the group and keep this rank's chunk in ``output``.

    ``input`` may be overwritten (it is scratch for the reduction), and
    ``output`` holds the result only once the returned work was waited on.
    ``method`` (``"reduce_scatter"``, ``"all_reduce"`` or
    ``"shared_memory"``) overrides the per-backend choice of
    ``reduce_scatter_method``.
    """
    if input.device.type == "cpu" and torch.compiler.is_compiling():
        return eagerly(_reduce_scatter)(output, input, group, async_op=async_op, method=method)
    return _reduce_scatter(output, input, group, async_op=async_op, method=method)


@outside_graph
def _reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, *, async_op: bool, method: str | None
) -> Work | ChunkOfAllReduce | SharedMemoryWork | None:
    if method in (None, "shared_memory"):
        # The group's transport, decided at its first collective.
        shared = transport.host_transport(input, group, (input.numel() - output.numel()) * input.element_size())
        if shared is not None:
            return shared.reduce_scatter(output, input, async_op=async_op)
        if method == "shared_memory":
            raise ValueError(
                "comm.reduce_scatter: method 'shared_memory' needs CPU tensors and a gloo group whose ranks share "
                f"a host, with {transport.ENV_SWITCH} not set to 0 on any rank"
            )
        method = process_group.message_method(input, group)
    launch = functools.partial(process_group.reduce_scatter, output, input, group, async_op=async_op, method=method)
    return checked(launch, input, group, async_op=async_op)


def reduce_scatter_method(input: torch.Tensor, group: ProcessGroup | None) -> str:
    """How ``reduce_scatter`` reduces ``input`` over ``group`` (see [Note:
    gradient collective per backend] in comm/transport.py)."""
    return transport.reduce_scatter_method(input, group)


def inputs_in_use(work: Any) -> bool:
    """Whether the backend may still read a collective's inputs until its
    work is waited on (False for shared-memory work, which copied them out
    when it was issued)."""
    return transport.inputs_in_use(work)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, *, async_op: bool) -> Work | SharedMemoryWork | None:
    """Sum ``tensor`` in place over the group (every rank gets the same
    bits). CPU tensors of a group on one host go through shared memory."""
    if tensor.device.type == "cpu" and torch.compiler.is_compiling():
        return eagerly(_all_reduce)(tensor, group, async_op=async_op)
    return _all_reduce(tensor, group, async_op=async_op)


@outside_graph
def _all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, *, async_op: bool) -> Work | SharedMemoryWork | None:
    if tensor.is_contiguous():
        shared = transport.host_transport(tensor, group, tensor.numel() * tensor.element_size())
        if shared is not None:
            return shared.all_reduce(tensor, async_op=async_op)
    return checked(lambda: process_group.all_reduce(tensor, group, async_op=async_op), tensor, group, async_op=async_op)


def reduce_grad(
    unsharded_grad: torch.Tensor,
    settings: GradReduceSettings,
    *,
    async_op: bool,
    carried: torch.Tensor | None = None,
) -> PendingCollective:
    """Start reducing a padded unsharded gradient (see [Note: dividing
    around the reduction] in comm/reduction.py): cast to the reduce dtype and
    pre-divide, then reduce-scatter over the shard group or, unsharded,
    all-reduce over the replicate group (none: nothing to wait for). Its
    output is the summed shard; ``finish_grad_reduction`` makes the mean.
    ``carried`` is the partial sum earlier backwards kept ([Note: partial
    sums without the replica all-reduce] in comm/overrides.py): unsharded,
    it joins the sum before this all-reduce. With a communication hook the
    hook does all of it now ([Note: communication hooks]).

    The pending collective keeps ``unsharded_grad`` alive: on CUDA the cast
    reads it on the lane's stream, and compute (which allocated it) may
    reuse its memory only after waiting on the fence ([Note: buffer
    lifetimes across lanes] in runtime/scheduler.py)."""
    if settings.comm_hook is not None:
        return _reduce_with_comm_hook(unsharded_grad, settings)
    computed_grad = unsharded_grad
    summed_grad = prepare_for_sum(unsharded_grad, settings)
    groups = settings.groups
    if groups.is_sharded:
        shard_numel = summed_grad.numel() // groups.shard_world_size
        output = torch.empty(shard_numel, dtype=summed_grad.dtype, device=summed_grad.device)
        work = reduce_scatter(output, summed_grad, groups.shard_group, async_op=async_op)
        if not inputs_in_use(work):
            # Copied out already (shared memory): the padded gradient is
            # freed now rather than at the wait, one unit's less at peak.
            return PendingCollective(work, output, ())
        # Nobody reads the input after the wait.
        return PendingCollective(FreedAtWait.around(work, (summed_grad,)), output, (summed_grad, computed_grad))
    work = None
    if groups.replicate_group is not None and settings.all_reduce:
        if carried is not None:
            summed_grad.add_(carried)
        work = all_reduce(summed_grad, groups.replicate_group, async_op=async_op)
        if not inputs_in_use(work):
            # Shared memory copied it out: the computed gradient (when the
            # cast made another) is freed now; the output keeps the sum.
            return PendingCollective(work, summed_grad, ())
    return PendingCollective(work, summed_grad, (computed_grad,))


# Gradients of at most this many padded bytes are reduced together, up to
# this many bytes per collective ([Note: coalesced reductions] in
# runtime/grad_buckets.py; measured in docs/benchmarks.md, "Small units").
# Read when a root's tree is initialised (its first forward) and when a
# flat parameter reserves shared memory (``fully_shard``): set it before
# both; 0 reduces every flat parameter alone.
REDUCE_BUCKET_BYTES = 1 << 20


def bucketable_bytes(padded_numel: int, reduce_dtype: torch.dtype, bucket_bytes: int) -> int:
    """A gradient's padded bytes in the reduce dtype where it may join a
    bucket of ``bucket_bytes`` (size only), else 0."""
    nbytes = padded_numel * reduce_dtype.itemsize
    return nbytes if 0 < nbytes <= bucket_bytes else 0


def collective_bytes_per_group(
    *,
    shard_world_size: int,
    has_replicas: bool,
    shard_numel: int,
    dtypes: tuple[torch.dtype, ...],
    reduce_dtype: torch.dtype,
    requires_grad: bool,
    offload: bool,
) -> dict[str, int]:
    """The most one rank writes per collective of a flat parameter, by group
    (``"shard"``, ``"replicate"``): its all-gathers and reductions (alone,
    or in a bucket of ``REDUCE_BUCKET_BYTES``), and the replica all-reduce
    (hybrid: of the shard; unsharded: of the whole gradient), and the
    all-gathers of a bucket of ``GATHER_BUCKET_BYTES`` it may join. For the
    shared memory ``fully_shard`` reserves and ``plan`` counts."""
    bucket = REDUCE_BUCKET_BYTES if requires_grad and not offload else 0
    reduce_size = reduce_dtype.itemsize
    most: dict[str, int] = {}
    if shard_world_size > 1:
        itemsize = max(dtype.itemsize for dtype in (*dtypes, reduce_dtype))
        most["shard"] = shard_numel * itemsize * (shard_world_size - 1)
        if not offload and gatherable_bytes(shard_numel * shard_world_size, dtypes[-1], GATHER_BUCKET_BYTES):
            most["shard"] = max(most["shard"], GATHER_BUCKET_BYTES // shard_world_size)
        if bucketable_bytes(shard_numel * shard_world_size, reduce_dtype, bucket):
            most["shard"] = max(most["shard"], bucket // shard_world_size * (shard_world_size - 1))
        if has_replicas and requires_grad:
            most["replicate"] = shard_numel * reduce_size
    elif has_replicas and requires_grad:
        most["replicate"] = shard_numel * reduce_size
        if bucketable_bytes(shard_numel, reduce_dtype, bucket):
            most["replicate"] = max(most["replicate"], bucket)
    return most


def can_reduce_together(settings: GradReduceSettings, carried: torch.Tensor | None) -> bool:
    """Whether a gradient with these settings may share one collective with
    others of the same group and reduce dtype (``reduce_grads_together``):
    not with a communication hook (it replaces the whole reduction), nor a
    partial sum to add before an unsharded all-reduce, nor an unsharded one
    that skips its all-reduce (no collective at all)."""
    if settings.comm_hook is not None or carried is not None:
        return False
    return settings.groups.is_sharded or (settings.groups.replicate_group is not None and settings.all_reduce)


def reduce_grads_together(
    unsharded_grads: list[torch.Tensor], settings: list[GradReduceSettings], *, async_op: bool
) -> PendingCollective:
    """``reduce_grad`` for several padded gradients of one group and reduce
    dtype (each ``can_reduce_together``) in one collective: each cast and
    pre-divided by its own settings, then laid side by side per rank's
    chunk (a reduce-scatter's rank ``r`` gets every gradient's chunk ``r``,
    in order) or one after another (an all-reduce). Its output holds the
    summed shards in order; ``split_reduced`` hands each gradient its own.
    Through shared memory the same bytes move with no side-by-side copy, into
    one output per gradient (``reduce_scatter_pieces``) or each gradient
    itself (``all_reduce_pieces``)."""
    summed = [prepare_for_sum(grad, each) for grad, each in zip(unsharded_grads, settings)]
    groups = settings[0].groups
    # On CUDA the casts and the concatenation run on the reduction lane:
    # the gradients compute allocated stay referenced until compute waited
    # on its fence ([Note: buffer lifetimes across lanes] in
    # runtime/scheduler.py); on CPU they ran here, and only what the backend
    # still reads is kept (nothing, through shared memory).
    read_on_lane = (*summed, *unsharded_grads) if unsharded_grads[0].device.type == "cuda" else ()
    world_size = groups.shard_world_size if groups.is_sharded else 1
    if summed[0].device.type == "cpu" and not torch.compiler.is_compiling():
        # Through shared memory each gradient is read (and summed) where it lies, every
        # shard a tensor of its own; reserved: what this rank writes (peers' chunks, or all).
        nbytes = sum(grad.numel() for grad in summed) * summed[0].element_size()
        group = groups.shard_group if groups.is_sharded else groups.replicate_group
        shared = transport.host_transport(summed[0], group, nbytes - nbytes // world_size if groups.is_sharded else nbytes)
        if shared is not None and groups.is_sharded:
            outputs = tuple(grad.new_empty(grad.numel() // world_size) for grad in summed)
            return PendingCollective(shared.reduce_scatter_pieces(outputs, summed, async_op=async_op), outputs[0], (), outputs)
        if shared is not None:
            return PendingCollective(shared.all_reduce_pieces(summed, async_op=async_op), summed[0], (), tuple(summed))
    if groups.is_sharded:
        combined = torch.cat([grad.view(world_size, -1) for grad in summed], dim=1).view(-1)
        output = combined.new_empty(combined.numel() // world_size)
        work = reduce_scatter(output, combined, groups.shard_group, async_op=async_op)
        if not inputs_in_use(work):
            return PendingCollective(work, output, read_on_lane)
        # Nobody reads the input after the wait.
        return PendingCollective(FreedAtWait.around(work, (combined,)), output, (combined, *read_on_lane))
    combined = torch.cat(summed)
    work = all_reduce(combined, groups.replicate_group, async_op=async_op)
    return PendingCollective(work, combined, read_on_lane)


def split_reduced(reduced: PendingCollective, sizes: list[int]) -> list[PendingCollective]:
    """The finished collective of ``reduce_grads_together`` as one
    reduction per gradient (``sizes``: their shards' numels, in order), for
    ``finish_grad_reduction``: views of the output, each finished into a
    tensor of its own there (a sharded gradient's storage must be its own:
    parameters' ``.grad`` are views of it), by the division where that is
    all it does (no separate copy)."""
    pieces = reduced.outputs or reduced.output.split(sizes)
    return [PendingCollective(None, piece, ()) for piece in pieces]


def _reduce_with_comm_hook(unsharded_grad: torch.Tensor, settings: GradReduceSettings) -> PendingCollective:
    """Run the unit's communication hook on the gradient as backward
    computed it ([Note: communication hooks] in comm/overrides.py)."""
    state, hook = settings.comm_hook  # type: ignore[misc]  # checked by the caller
    if settings.groups.is_sharded:
        output = unsharded_grad.new_empty(unsharded_grad.numel() // settings.groups.shard_world_size)
        hook(state, unsharded_grad, output)
        return PendingCollective(None, output, (unsharded_grad,))
    hook(state, unsharded_grad)
    return PendingCollective(None, unsharded_grad, ())


def finish_grad_reduction(
    reduced: PendingCollective, settings: GradReduceSettings, *, carried: torch.Tensor | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """From a reduction whose work was waited on: ``(mean shard, None)`` in
    the gradient dtype, or ``(None, carry)`` when the replica all-reduce is
    skipped ([Note: partial sums without the replica all-reduce] in
    comm/overrides.py). Hybrid sharding sums over the replicate group here
    (synchronous, after adding ``carried``); the all-reduce hook runs on the
    sum; then it is post-divided and cast."""
    summed_grad = reduced.output  # a view of a bucket's output (split_reduced): kept only as ``owned``
    if settings.comm_hook is not None:  # the hook's result is the mean
        return owned(summed_grad.to(settings.grad_dtype)), None
    groups = settings.groups
    if settings.has_replicas and not settings.all_reduce:
        if carried is None:
            return None, owned(summed_grad)
        return None, carried.add_(summed_grad)
    if groups.is_sharded and groups.replicate_group is not None:
        if carried is not None:
            summed_grad.add_(carried)
        all_reduce(summed_grad, groups.replicate_group, async_op=False)
    if settings.all_reduce_hook is not None:
        summed_grad = owned(summed_grad)  # the hook is shown a tensor of its own
        _run_all_reduce_hook(summed_grad, settings)
    return mean_of_sum(summed_grad, settings), None


def _run_all_reduce_hook(summed_grad: torch.Tensor, settings: GradReduceSettings) -> None:
    """FSDP2's all-reduce hook, on the summed shard; in its own CUDA
    stream where one was given (ordered after and before the current one)."""
    hook, stream = settings.all_reduce_hook, settings.all_reduce_hook_stream
    if stream is None or summed_grad.device.type != "cuda":
        hook(summed_grad)  # type: ignore[misc]  # checked by the caller
        return
    current = torch.cuda.current_stream(summed_grad.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        hook(summed_grad)  # type: ignore[misc]
    # Compute waits for the hook; the lane that may reuse the shard's memory
    # waits on compute ([Note: what a lane waits for]): no record_stream.
    current.wait_stream(stream)


def all_reduce_max(tensor: torch.Tensor, group: ProcessGroup | None) -> None:
    """Element-wise maximum of ``tensor`` in place over the group (synchronous)."""
    process_group.all_reduce_max(tensor, group)


def all_to_all(
    output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
    group: ProcessGroup | None,
) -> None:
    """Exchange 1-D ``input`` in pieces: ``input_splits[q]`` elements to group
    rank ``q``; ``output`` receives ``output_splits[q]`` from rank ``q``, in
    rank order (synchronous; the owner step's one collective per direction).
    CPU tensors of a group on one host go through shared memory (see
    [Note: shared-memory all-to-all] in comm/shared_memory/collectives.py)."""
    # The group's one transport, whatever the tensors' layout: a rank whose
    # tensors are not contiguous must not take the other path.
    shared = transport.host_transport(input, group, input.numel() * input.element_size())
    if shared is None:
        process_group.all_to_all(output, input, output_splits, input_splits, group)
        return
    target = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    shared.all_to_all(target, input.contiguous(), output_splits, input_splits)
    if target is not output:
        output.copy_(target)


def all_to_all_in_place(device: torch.device, group: ProcessGroup | None) -> bool:
    """Whether ``all_to_all_pieces`` runs over ``group`` for tensors on
    ``device``: where its collectives go through shared memory, which reads
    and writes each piece where it lies (the same answer on every rank; the
    first call for a group decides its transport, collectively)."""
    return device.type == "cpu" and transport.shared_memory_of(group) is not None


def all_to_all_pieces(
    outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], output_splits: list[int], input_splits: list[int],
    group: ProcessGroup | None,
) -> None:
    """``all_to_all`` of the contiguous 1-D tensors ``inputs`` laid back to
    back (one dtype) into ``outputs`` laid back to back, each read or
    written where it is: no send or receive buffer (synchronous). Only where
    ``all_to_all_in_place`` says so."""
    shared = transport.shared_memory_of(group) if all(t.device.type == "cpu" for t in [*outputs, *inputs]) else None
    if shared is None:
        raise RuntimeError(
            "comm.all_to_all_pieces: this group's collectives do not go through shared memory; check "
            "all_to_all_in_place first and use all_to_all with one send and one receive buffer"
        )
    shared.all_to_all_pieces(outputs, inputs, output_splits, input_splits)


def broadcast(tensor: torch.Tensor, src_group_rank: int, group: ProcessGroup | None) -> None:
    """Overwrite ``tensor`` with the one on group rank ``src_group_rank`` (synchronous)."""
    process_group.broadcast(tensor, src_group_rank, group)


def broadcast_object(obj: Any, src_group_rank: int = 0, group: ProcessGroup | None = None) -> Any:
    """The picklable ``obj`` of group rank ``src_group_rank``, on every rank."""
    return process_group.broadcast_object(obj, src_group_rank, group)


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in group rank order, on every rank."""
    return process_group.all_gather_object(obj, group)


def total_norm_of_parts(
    parts: list[tuple[tuple[ProcessGroup | None, ...], torch.Tensor]], norm_type: float, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """The total ``norm_type``-norm in ``dtype`` from local parts in it (each
    ``max |g|`` for the inf-norm, else ``sum |g|^p``), each reduced over its
    groups (the ranks holding other pieces of the same tensors; ``None``:
    none), in order: every rank must pass its parts' groups in the same order."""
    is_inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=dtype, device=device)
    for groups, local in parts:
        for group in groups:
            if group is None:
                continue
            if is_inf:
                process_group.all_reduce_max_with_nan(local, group)
            else:
                all_reduce(local, group, async_op=False)
        total = torch.maximum(total, local) if is_inf else total + local
    return total if is_inf else total ** (1.0 / norm_type)
