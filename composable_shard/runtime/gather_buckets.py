"""Owns: coalescing the all-gathers of small units — which units' all-gathers
join the one a unit issues (the units that follow it in the phase's order,
up to a bucket's bytes) and launching them as one collective.

Knows nothing of: hooks and prefetch policies (they pass the order), when
compute waits (the scheduler), streams.

Public names: ``unshard_with_followers``.

[Note: coalesced all-gathers]
An all-gather has a cost of its own whatever its size (a wait for the
slowest peer, a round through shared memory, a kernel launch), and a unit
of a few hundred KB pays it twice a step, where DDP pays nothing. So when a
unit's all-gather is issued in forward or backward (its own, or a prefetch
of the policy) and each of its flat parameters' padded unsharded buffers
is at most a quarter of ``bucket_bytes`` (the scheduler's, from
``comm.GATHER_BUCKET_BYTES``, 1 MiB, when the tree is initialised; 0
switches this off: a bucket pays where it holds several units, and units
of 256 KiB and more keep today's memory), the all-gathers of the units
that follow it in that phase's order join it: forward follows the previous
forward's order, backward the current forward's in reverse (the orders
prefetch uses, the same on every rank; the first forward, which has no
previous one, follows the tree's module pre-order). Followers are taken while each
needs an all-gather (a unit already gathered is passed over), all its flat
parameters are that small and share the first one's key (shard group,
compute dtype, device), none is offloaded, and the bucket stays within
``bucket_bytes``; the first
unit that does not qualify ends the bucket. A unit's flat parameters (a
frozen one beside a trainable one) join together or not at all, as the
plan counts them (``UnitPlan.gather_key``). One collective then gathers
them all (``comm.all_gather_together``: every rank's shards of the bucket
side by side, then each buffer gets its pieces, the same bytes as alone),
and compute waits for it once, at the first use of any of them. A
follower's own pre-forward or pre-backward then finds it gathered. A unit
of several such flat parameters (a LoRA block's frozen base and adapters)
shares one collective among them even where no follower joins.

Where the user ordered the all-gathers (``set_modules_to_forward_prefetch``
or ``set_modules_to_backward_prefetch`` anywhere in the tree) that phase is
not coalesced: exactly the listed order is issued, one collective each.
Hooks ``torch.compile`` traces gather unit by unit (dynamo would guard on
the orders and handles). Units some ranks skip never join (they leave the forward order, and the
first forward's order leaves them out).

Memory: the followers' buffers exist from the bucket's issue, at most
``bucket_bytes`` beyond what would be gathered anyway. Through shared
memory nothing else (each shard is written from, and each row read into,
where it lies: ``all_gather_pieces``); otherwise, or where a shard needs a
cast, the issue holds the side-by-side shards and the gathered rows until
the wait (``plan`` counts them: [Note: coalesced all-gathers, planned] in
planning/step_replay.py). Pinned by tests/runtime/test_coalesced_all_gathers.py.
"""

from __future__ import annotations

import functools
from typing import Hashable, Iterable

from .. import comm
from ..comm import PendingCollective
from ..comm.tags import collective_of
from ..handle import FlatParamHandle
from .scheduler import Scheduler

__all__ = ["unshard_with_followers"]


def unshard_with_followers(
    scheduler: Scheduler, handles: list[FlatParamHandle], followers: Iterable[list[FlatParamHandle]]
) -> None:
    """Issue one all-gather for ``handles`` (a unit's flat parameters) that
    need one and for the followers' (each unit's flat parameters, in the
    phase's order, consumed lazily) that may share it ([Note: coalesced
    all-gathers]).
    Issues nothing where that is one flat parameter alone: the caller's
    usual all-gather then runs."""
    bucket_bytes = scheduler.gather_bucket_bytes
    if bucket_bytes <= 0:
        return
    own = [handle for handle in handles if _needs_all_gather(scheduler, handle)]
    # The unit's own flat parameters (a frozen one beside a trainable one)
    # join first, all of them or none, as one member.
    joined = _joined(own, bucket_bytes)
    if joined is None:
        return
    (key, total), members = joined, list(own)
    for follower in followers:
        needing = [handle for handle in follower if _needs_all_gather(scheduler, handle)]
        if not needing:
            continue  # still gathered (the root, a unit kept): passed over
        joined = _joined(needing, bucket_bytes, key)
        if joined is None or total + joined[1] > bucket_bytes:
            break
        members += needing
        total += joined[1]
    if len(members) > 1:
        scheduler.unshard_together(members, functools.partial(_launch, members))


def _needs_all_gather(scheduler: Scheduler, handle: FlatParamHandle) -> bool:
    return not handle.is_unsharded and not scheduler.has_pending_unshard(handle)


def _joined(
    handles: list[FlatParamHandle], bucket_bytes: int, key: Hashable | None = None
) -> tuple[Hashable, int] | None:
    """The key of the bucket one unit's ``handles`` join together (with
    ``key``: that bucket's) and the bytes they add to it, or None where one
    of them cannot join it (or there are none)."""
    total = 0
    for handle in handles:
        found = _key_and_bytes(handle, bucket_bytes)
        if found is None or (key is not None and found[0] != key):
            return None
        key, total = found[0], total + found[1]
    return (key, total) if key is not None else None


def _key_and_bytes(handle: FlatParamHandle, bucket_bytes: int) -> tuple[Hashable, int] | None:
    """The key of the bucket ``handle``'s all-gather may join and its bytes
    there, or None where it is gathered alone."""
    if not handle.groups.is_sharded or handle.offload_params or not handle.needs_unshard_storage:
        return None
    nbytes = comm.gatherable_bytes(handle.unsharded_flat_param.numel(), handle.param_dtype, bucket_bytes)
    if not nbytes:
        return None
    return (handle.groups.shard_group, handle.param_dtype, handle.compute_device), nbytes


def _launch(members: list[FlatParamHandle], async_op: bool) -> PendingCollective:
    outputs = [handle.allocate_unsharded() for handle in members]
    shards = [handle.shard_on_compute_device() for handle in members]
    with collective_of(members[0]):  # [Note: tagged collectives] in comm/tags.py
        return comm.all_gather_together(outputs, shards, members[0].groups.shard_group, async_op=async_op)
