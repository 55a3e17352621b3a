"""Owns: coalescing the gradient reductions of small flat parameters —
which reductions may share one collective (their key), holding each until
its bucket is issued, and handing every flat parameter its own reduced
shard afterwards.

Knows nothing of: units, hooks, when a bucket is issued (the scheduler's
``reduce_together``), streams.

Public names: ``hold_for_bucket``.

[Note: coalesced reductions]
Every reduction is a collective, and a collective has a cost of its own
whatever its size: on CPU a wait for the slowest peer and a round through
shared memory, on NCCL a kernel launch. Units of a few hundred KB (many
narrow blocks, LoRA adapters) pay it once per unit, where DDP pays it once
per 25 MB bucket. So the reduction of a flat parameter whose padded
gradient is at most ``bucket_bytes`` (the scheduler's, from
``comm.REDUCE_BUCKET_BYTES`` when the tree is initialised; 0 switches this
off) and that has nothing of its own to run (no communication hook, no
partial sum to add, not offloaded) is held: its gradient is taken from the
flat parameter at once (as the reduction would) and kept with the others
of the same key (group, reduce dtype, device), in backward order. The
bucket is issued as one ``reduce`` when the next gradient would overflow
it, when a reduction of another key or one not held is issued (order is
kept: the bucket goes first), and at every wait for reductions (a unit's
backward never waits for a gradient still held; the end of backward, a
partial backward's end and every state change issue it). One collective
then reduces all of them: a reduce-scatter of the gradients laid side by
side per rank's chunk, or one all-reduce (``comm.reduce_grads_together``);
each flat parameter gets its shard of the result and finishes as if
reduced alone (division, hybrid all-reduce, accumulation, ``.grad``, user
hooks), in a tensor of its own (the division writes it where that is all
the finish does: ``comm.finish_grad_reduction``). Through shared memory
a reduce-scatter moves the same bytes without the side-by-side copy:
each gradient's chunks are written from where they lie and each shard is
summed into an output of its own, which the division then writes in
place (``reduce_scatter_pieces``). The sum of each element is the same as alone: the same
elements, the same ranks, the same order. Memory: the held gradients and
the bucket's side-by-side copy (none through shared memory), at most two
buckets' bytes (``plan`` counts them). Pinned by
tests/runtime/test_coalesced_reductions.py and, the in-place path, by
test_coalesced_reduce_scatter_through_shared_memory_reads_and_sums_in_place
(tests/comm/test_shared_memory.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from .. import comm
from ..comm import GradReduceSettings, PendingCollective
from ..comm.tags import collective_of
from ..handle import FlatParamHandle
from .scheduler import Scheduler

__all__ = ["hold_for_bucket"]



@dataclass(eq=False)
class _Held:
    """A flat parameter's gradient held for its bucket."""

    handle: FlatParamHandle
    # Dropped once the bucket's collective copied it (or read it, on NCCL).
    grad: torch.Tensor | None
    settings: GradReduceSettings
    # Elements of its reduced shard in the bucket's output.
    shard_numel: int


def hold_for_bucket(
    scheduler: Scheduler,
    handle: FlatParamHandle,
    settings: GradReduceSettings,
    finish: Callable[[FlatParamHandle, PendingCollective], None],
) -> bool:
    """Where ``handle``'s reduction (with ``settings``, its
    ``reduction_settings()``) may join a bucket, take its gradient and hold
    it in the scheduler's bucket of its key; ``finish(handle, reduced)``
    runs once the bucket's collective is done, as for a reduction of its
    own. Returns False, taking nothing, where it is reduced alone (see
    [Note: coalesced reductions])."""
    grad = handle.unsharded_flat_param.grad
    if scheduler.bucket_bytes <= 0 or grad is None or handle.offload_params:
        return False
    nbytes = comm.bucketable_bytes(grad.numel(), settings.reduce_dtype, scheduler.bucket_bytes)
    if not nbytes or not comm.can_reduce_together(settings, handle.partial_reduced_grad):
        return False
    handle.take_grad_for_reduction(settings)
    groups = settings.groups
    group = groups.shard_group if groups.is_sharded else groups.replicate_group
    key = (group, groups.is_sharded, settings.reduce_dtype, grad.device)
    shard_numel = grad.numel() // groups.shard_world_size if groups.is_sharded else grad.numel()
    held = _Held(handle, grad, settings, shard_numel)
    scheduler.reduce_together(key, nbytes, held, _launch_bucket, functools.partial(_finish_bucket, finish))
    return True


def _launch_bucket(held: list[_Held], async_op: bool) -> PendingCollective | None:
    grads = [item.grad for item in held]
    for item in held:
        item.grad = None  # the collective (or its pending inputs) keeps what it needs
    with collective_of(held[0].handle):  # [Note: tagged collectives] in comm/tags.py
        return comm.reduce_grads_together(grads, [item.settings for item in held], async_op=async_op)  # type: ignore[arg-type]


def _finish_bucket(
    finish: Callable[[FlatParamHandle, PendingCollective], None], held: list[_Held], reduced: PendingCollective
) -> None:
    for item, piece in zip(held, comm.split_reduced(reduced, [item.shard_numel for item in held])):
        finish(item.handle, piece)
