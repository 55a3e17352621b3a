"""Owns: checking a tagged collective's tag on the message path (gloo on
CPU), which has no header to carry it: a tiny all-gather of every rank's
tag, waited on before the collective starts, so ranks that issue
different units' collectives raise, naming both, before any bytes that do
not match move (gloo aborts the process on a mispaired collective whose
sizes differ).

Knows nothing of: units (``tags`` names them), the shared-memory transport
(its header carries the tag: [Note: tagged collectives] in tags.py), which
collectives are tagged.

Public names: ``checked``, ``TagCheckedWork``.

CPU tensors only: on CUDA reading the peers' tags would stall the host at
every collective. Not in PyTorch's fake process group either (one process
standing for every rank: no peer can disagree, and the exchange would be
half of a simulated step's collectives). Pinned by
tests/controls/test_skipped_units.py (the gloo case) and
tests/comm/test_tag_check_fake_group.py.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import process_group
from .tags import current_tag, name_of

__all__ = ["checked", "TagCheckedWork"]

_PREFIX = "composable_shard collective:"

# Group -> whether it has peers whose tags could differ (False for PyTorch's
# fake process group); asked once per group. Weak: a destroyed group goes.
_has_peers: "weakref.WeakKeyDictionary[ProcessGroup, bool]" = weakref.WeakKeyDictionary()


def checked(launch: Callable[[], Any], tensor: torch.Tensor, group: ProcessGroup | None, *, async_op: bool) -> Any:
    """Run ``launch`` (a message-path collective over ``group``), preceded
    by the exchange of the current tag where one is set (CPU tensors of a
    group of two or more ranks): its work, wrapped to check the tags first,
    or, synchronous, after checking them."""
    tag = current_tag()
    if tag == 0 or tensor.device.type != "cpu" or not _peers_can_differ(group):
        return launch()
    mine = torch.tensor([tag], dtype=torch.int64)
    gathered = torch.empty(dist.get_world_size(group), dtype=torch.int64)
    # Waited on before the collective starts, also for an asynchronous one:
    # gloo aborts the process (std::terminate in its thread, no exception)
    # when a mispaired collective's sizes differ.
    process_group.all_gather_into(gathered, mine, group=group, async_op=False)
    mismatch = _mismatch(gathered, tag, group)
    process_group.free_storage(mine, gathered)
    if mismatch is not None:
        raise mismatch
    work = launch()
    return TagCheckedWork(work, tag) if async_op and work is not None else work


def _peers_can_differ(group: ProcessGroup | None) -> bool:
    """Whether ``group`` (None: the default group) has other processes that
    issue their own collectives: two or more ranks, not the fake backend."""
    key = group if group is not None else dist.group.WORLD
    known = _has_peers.get(key) if key is not None else None
    if known is None:
        known = dist.get_world_size(group) >= 2 and str(dist.get_backend(group)) != "fake"
        if key is not None:
            _has_peers[key] = known
    return known


class TagCheckedWork:
    """A collective's work, its tags already checked, whose wait names the
    unit the collective is for when it fails (a peer dead or stuck past
    the timeout)."""

    def __init__(self, work: Any, tag: int) -> None:
        self._work = work
        self._tag = tag

    def wait(self, *timeout: Any) -> bool:
        """As ``Work.wait``."""
        try:
            return self._work.wait(*timeout)
        except RuntimeError as error:
            if str(error).startswith(_PREFIX):
                raise
            raise RuntimeError(f"{_PREFIX} communication failure in a collective for {name_of(self._tag)}: {error}") from error

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _mismatch(gathered: torch.Tensor, tag: int, group: ProcessGroup | None) -> RuntimeError | None:
    """The error naming both units where a peer's tag differs from ours."""
    others = [(peer, other) for peer, other in enumerate(gathered.tolist()) if other != tag]
    if not others:
        return None
    rank = dist.get_rank(group)
    peer, other = others[0]
    return RuntimeError(
        f"{_PREFIX} rank {peer} of the group issued a collective for {name_of(other)} where "
        f"this rank (rank {rank}) issued one for {name_of(tag)}. Every rank must run the same units in the same "
        "order; mark units that some ranks skip (conditional compute) with composable_shard.set_may_be_skipped."
    )
