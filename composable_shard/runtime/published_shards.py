"""Owns: which flat parameters publish their shards for a step's all-gathers
(each claims a slice of its group's area when its unit is built), moving
them into the area, publishing a tree's shards when its root's forward
starts, and closing them when the step ends.

Knows nothing of: how shards are published and read
(``comm.shared_memory.published``), hooks, prefetch, buckets.

Public names: ``claim_published_slices``, ``publish_step_shards``,
``close_step_shards``.

[Note: all-gathers from published shards]
Which: every sharded flat parameter whose compute runs on CPU in the
shard's own dtype (no cast, no CPU offload: what is published is what is
gathered), sharded over a group of several ranks on one host (shared
memory) that had not set up when it was built, while its group's area
stays within ``shared_memory.PUBLISHED_BYTES``: slices are claimed in
build order, alike on every rank. First the small units, whose
all-gathers cost more in waiting for the peer than in bytes; then every
size: GPT 8 x 256's blocks waited 27-37 ms a step at their all-gathers
([Note: published shards] in comm/shared_memory/published.py). A dtype
change since (``model.double()``) that no longer fits its slice, or adds a
cast, leaves it out of every publish.

Where: at its first publish (where no peer may read its slice), a shard
whose parameters all show it (``handle.shard_place``) moves into its slice
of the area for good and publishes with no copy; the heap pages it leaves
are given back (``malloc_trim``) ([Note: shards that live in the area]).
One that cannot move (its parameters show the unsharded buffer between
steps; a ``DTensor`` parameter) is copied there at each publish, and
``plan``, which counts every published shard as living in the area, is
short by its bytes.

When: the root's pre-forward publishes the tree's shards, group by group in
the tree's order (``start_root_forward``, after the write-back of the
user's changes into the shards); every all-gather of them in that step
(forward, backward, prefetch, activation-checkpoint re-runs, an explicit
``unshard()``) reads the peers' areas. The step closes them (their
all-gathers go through rounds again) when its backward returns the tree to
idle or a forward without autograd ends, every rank alike, waiting there
for its peers; or when the held state ends or a reset after an error,
where a rank may be alone, moving its shards out of the area first
without waiting (they move back at a later publish, once a step ended on
every rank).
``unshard_params``, state dicts and anything between steps gather the
shards as they are then.

Changes: a shard changed in place inside the step (its version counter
moved: an in-place op on a parameter or a view of it) fails its next
all-gather naming its unit, since its peers may have read what it held
before. One changed through ``.data``, which autograd does not see either,
is not seen: the step's later all-gathers read the shard as it is then on
its owner, and as it was at the forward where it is a copy.

Under ``torch.compile`` both run eagerly (``shared_memory.eagerly``): the
publish is one graph break where dynamo traces the root's pre-forward; the
all-gathers already ran outside the graph. Memory: the area, in
``/dev/shm``, holds the shards that live there in place of their own
memory (``plan`` counts them as parameters and the area's alignment gaps
in its ``transport`` line); the peers' areas this rank reads count in its
RSS. Pinned by tests/runtime/test_published_shards.py.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable

import torch

from ..comm import transport
from ..comm.shared_memory import PublishedShards, eagerly, outside_graph
from ..handle import FlatParamHandle
from ..handle.shard_place import move_shard
from .host_memory import trim_heap
from .state import RootContext, UnitState

__all__ = ["claim_published_slices", "publish_step_shards", "close_step_shards"]

# Handle -> its slice of its group's area: (first byte, bytes).
_SLICES: "weakref.WeakKeyDictionary[FlatParamHandle, tuple[int, int]]" = weakref.WeakKeyDictionary()
# Root context -> what its step under way published: per group, the publish's number and its shards.
_OPEN: "weakref.WeakKeyDictionary[RootContext, list[tuple[PublishedShards, int, list[torch.Tensor]]]]" = (
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
    )


def publish_step_shards(context: RootContext) -> None:
    """Publish the tree's claimed shards for the step its root's forward
    starts (collective over each of their groups)."""
    _outside_any_graph(_publish, context)


@outside_graph
def _publish(context: RootContext) -> None:
    _close(context, wait=True)
    by_group: dict[PublishedShards, list[tuple[int, torch.Tensor, Callable[[], None]]]] = {}
    moved_any = False
    for unit in context.units:
        for handle in unit.handles:
            claimed = _SLICES.get(handle)
            shard = handle.sharded_flat_param
            if claimed is None or shard.numel() * shard.element_size() > claimed[1] or handle.param_dtype != shard.dtype:
                continue
            published = transport.published_shards_of(handle.groups.shard_group)  # sets the group up (collective)
            if published is None or published.open_publishes >= published.MOST_OPEN:
                continue  # alike on every rank: the same steps are open
            if not published.lives_in_area(claimed[0], shard) and published.can_home(claimed[0]):
                # No peer reads this rank's area now: the shard moves into it for good.
                if move_shard(handle, functools.partial(published.home, claimed[0], shard)):
                    shard = handle.sharded_flat_param
                    moved_any = True
            # Weakly: an entry left open (a model dropped mid-step) keeps nothing alive.
            check = functools.partial(_refuse_changes, weakref.ref(unit), weakref.ref(handle), _versions(handle))
            by_group.setdefault(published, []).append((claimed[0], shard, check))
    if moved_any:
        # The shards' old memory is free now: give its pages back (the
        # heap keeps them otherwise, and the area holds the same bytes).
        trim_heap()
    opened = []
    for published, shards in by_group.items():
        number = published.publish(shards)
        opened.append((published, number, [shard for _, shard, _ in shards]))
    if opened:
        _OPEN[context] = opened


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


def close_step_shards(context: RootContext, *, every_rank: bool = True) -> None:
    """The tree's step ended: its shards' all-gathers go through rounds
    again. ``every_rank``: every rank ends it here alike (a backward's or a
    no-grad forward's end), so this rank waits until its peers read nothing
    more of its area; otherwise (a reset after an
    error, the held state's end) such shards move out of the area instead,
    so that this rank's changes cannot reach a peer still in the step."""
    if context in _OPEN:
        _outside_any_graph(functools.partial(_close, wait=every_rank), context)


def _outside_any_graph(fn: Callable[[RootContext], None], context: RootContext) -> None:
    """``fn(context)``, eagerly where dynamo traces the caller (file I/O)."""
    (eagerly(fn) if torch.compiler.is_compiling() else fn)(context)


@outside_graph
def _close(context: RootContext, *, wait: bool) -> None:
    opened = _OPEN.pop(context, ())
    for published, number, shards in opened:
        published.close(number, shards, wait=wait or not _moved_out_of_area(context, published))


def _moved_out_of_area(context: RootContext, published: PublishedShards) -> bool:
    """Move each of the tree's shards living in ``published``'s area into
    memory of its own (it moves back at the next publish); False where one
    could not move (its parameters show the unsharded buffer)."""
    moved = True
    for unit in context.units:
        for handle in unit.handles:
            claimed = _SLICES.get(handle)
            shard = handle.sharded_flat_param
            if claimed is not None and published.lives_in_area(claimed[0], shard):
                moved = move_shard(handle, shard.clone) and moved
    return moved
