"""Owns: which flat parameters publish their shards for a step's all-gathers
(each claims a slice of its group's area when its unit is built), publishing
a tree's shards when its root's forward starts, and closing them when the
step ends.

Knows nothing of: how shards are published and read
(``comm.shared_memory.published``), hooks, prefetch, buckets.

Public names: ``claim_published_slices``, ``publish_step_shards``,
``close_step_shards``.

[Note: all-gathers from published shards]
Which: a flat parameter publishes where its all-gathers would coalesce
(``comm.gatherable_bytes``: padded unsharded bytes at most a quarter of
``comm.GATHER_BUCKET_BYTES``, the small units, whose all-gathers cost more
in waiting for the peer than in bytes: [Note: published shards] in
comm/shared_memory/published.py), its compute runs on CPU in the shard's own
dtype (no cast, no CPU offload: what is published is what is gathered), it
is sharded over a group of several ranks on one host (shared memory) that
had not set up when it was built, and its group's area stays within
``shared_memory.PUBLISHED_BYTES``: slices are claimed in build order, alike
on every rank. A dtype change since (``model.double()``) that no longer
fits its slice, or adds a cast, leaves it out of every publish.

When: the root's pre-forward publishes the tree's shards, group by group in
the tree's order (``start_root_forward``, after the write-back of the
user's changes into the shards); every all-gather of them in that step
(forward, backward, prefetch, activation-checkpoint re-runs, an explicit
``unshard()``) reads the peers' areas. The step closes them (their
all-gathers go through rounds again) when its backward returns the tree to
idle, a forward without autograd ends, the held state ends, or a reset:
``unshard_params``, state dicts and anything between steps gather the
shards as they are then.

Changes: a shard changed in place inside the step (its version counter
moved: an in-place op on a parameter or a view of it) fails its next
all-gather naming its unit, since its peers read what it held at the
forward. One changed through ``.data``, which autograd does not see either,
is not seen: that step's later all-gathers use what the shard held at the
forward, where rounds re-read it in backward.

Under ``torch.compile`` both run eagerly (``shared_memory.eagerly``): the
publish is one graph break where dynamo traces the root's pre-forward; the
all-gathers already ran outside the graph. Memory: the area, once the
published shards' bytes per rank in ``/dev/shm`` (``plan`` counts it in its
``transport`` line), and the peers' areas this rank reads (RSS counts their
pages). Pinned by tests/runtime/test_published_shards.py.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable

import torch

from .. import comm
from ..comm import transport
from ..comm.shared_memory import PublishedShards, eagerly, outside_graph
from ..handle import FlatParamHandle
from .state import RootContext, UnitState

__all__ = ["claim_published_slices", "publish_step_shards", "close_step_shards"]

# Handle -> its slice of its group's area: (first byte, bytes).
_SLICES: "weakref.WeakKeyDictionary[FlatParamHandle, tuple[int, int]]" = weakref.WeakKeyDictionary()
# Root context -> what its step under way published: per group, its shards.
_OPEN: "weakref.WeakKeyDictionary[RootContext, list[tuple[PublishedShards, list[torch.Tensor]]]]" = (
    weakref.WeakKeyDictionary()
)


def claim_published_slices(state: UnitState) -> None:
    """Claim a slice of its group's area for each of the unit's flat
    parameters that may publish (see the Note); called once, as it is built."""
    for handle in state.handles:
        if _may_publish(handle):
            shard = handle.sharded_flat_param
            nbytes = shard.numel() * shard.element_size()
            at = transport.published_slice(handle.groups.shard_group, nbytes)
            if at is not None:
                _SLICES[handle] = (at, nbytes)


def _may_publish(handle: FlatParamHandle) -> bool:
    shard = handle.sharded_flat_param
    return (
        handle.groups.is_sharded
        and handle.compute_device.type == "cpu"
        and shard.device.type == "cpu"
        and not handle.offload_params
        and handle.param_dtype == shard.dtype
        and comm.gatherable_bytes(handle.layout.padded_unsharded_numel, shard.dtype, comm.GATHER_BUCKET_BYTES) > 0
    )


def publish_step_shards(context: RootContext) -> None:
    """Publish the tree's claimed shards for the step its root's forward
    starts (collective over each of their groups)."""
    _outside_any_graph(_publish, context)


@outside_graph
def _publish(context: RootContext) -> None:
    _close(context)
    by_group: dict[PublishedShards, list[tuple[int, torch.Tensor, Callable[[], None]]]] = {}
    for unit in context.units:
        for handle in unit.handles:
            claimed = _SLICES.get(handle)
            shard = handle.sharded_flat_param
            if claimed is None or shard.numel() * shard.element_size() > claimed[1] or handle.param_dtype != shard.dtype:
                continue
            published = transport.published_shards_of(handle.groups.shard_group)  # sets the group up (collective)
            if published is not None:
                # Weakly: an entry left open (a model dropped mid-step) keeps nothing alive.
                check = functools.partial(_refuse_changes, weakref.ref(unit), weakref.ref(handle), _versions(handle))
                by_group.setdefault(published, []).append((claimed[0], shard, check))
    for published, shards in by_group.items():
        published.publish(shards)
    if by_group:
        _OPEN[context] = [(published, [shard for _, shard, _ in shards]) for published, shards in by_group.items()]


def _versions(handle: FlatParamHandle) -> tuple[int, ...]:
    """The version counters of the handle's shard and of its parameters
    (each parameter's ``.data`` is a view of the shard with a counter of its
    own): a change in place moves one."""
    return (handle.sharded_flat_param._version, *(param._version for param in handle.orig_params))


def _refuse_changes(
    unit_ref: "weakref.ref[UnitState]", handle_ref: "weakref.ref[FlatParamHandle]", published: tuple[int, ...]
) -> None:
    """Raise, naming the parameter, where the handle's shard or one of its
    parameters changed in place since it was published."""
    unit, handle = unit_ref(), handle_ref()
    if unit is None or handle is None:
        return  # gone: its shard is not gathered any more
    now = _versions(handle)
    if now == published:
        return
    changed = [info.fqn for info, old, new in zip(handle.layout.params, published[1:], now[1:]) if old != new]
    what = f"parameter '{unit.name_prefix}{changed[0]}'" if changed else f"the shard of unit '{unit.fqn}'"
    raise RuntimeError(
        f"composable_shard: {what} was changed in place after the step's forward began, while its peers read "
        "what it held then (in one process, autograd refuses a change to a tensor it saved for backward). "
        "Change parameters between steps (after backward, before the next forward), not inside one."
    )


def close_step_shards(context: RootContext) -> None:
    """The tree's step ended: its shards' all-gathers go through rounds again."""
    if context in _OPEN:
        _outside_any_graph(_close, context)


def _outside_any_graph(fn: Callable[[RootContext], None], context: RootContext) -> None:
    """``fn(context)``, eagerly where dynamo traces the caller (file I/O)."""
    (eagerly(fn) if torch.compiler.is_compiling() else fn)(context)


@outside_graph
def _close(context: RootContext) -> None:
    for published, shards in _OPEN.pop(context, ()):
        published.close(shards)
