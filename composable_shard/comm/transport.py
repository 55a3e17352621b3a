"""Owns: which transport carries a collective: shared memory (CPU tensors of
a gloo group whose ranks share a host) or messages through the process
group's backend, decided once per group, collectively; and which method
reduces a gradient.

Knows nothing of: how either transport moves bytes (``shared_memory``,
``process_group``), modules, flat parameters, streams.

Public names: ``ENV_SWITCH``, ``host_transport``, ``shared_memory_of``,
``expect_collective_bytes``, ``published_slice``, ``published_slice_bytes``,
``published_shards_of``, ``uses_shared_memory``, ``backend_copies_gathered_output``, ``reduce_scatter_method``,
``inputs_in_use``, ``process_shared_bytes``, ``process_mapped_bytes``,
``shared_bytes_per_rank``.

[Note: one transport per group]
A group's transport is decided at its first collective on CPU tensors, by
every rank of the group together (``HostSharedMemory.connect``: one
exchange over the backend), and never again: not per call, so nothing that
differs between ranks at a call (``torch.compile`` tracing on one rank and
not on another, an environment variable changed later) can send ranks down
different transports, where they would wait for each other forever. The
decision takes shared memory when every rank has ``ENV_SWITCH`` unset or
not ``0``, all of them share one host's ``/dev/shm`` and process ids, and
``/dev/shm`` has room on every rank for every rank's slots, each reserving
the largest collective the group announced up to the slot's fixed size
(``expect_collective_bytes``, which every flat-parameter handle calls when
it is built, before any collective; larger ones stream through the slots,
see [Note: slots and waits] in comm/shared_memory/slots.py); else the whole
group uses the backend, with one warning on each rank where the ranks share
a host but the files could not be made (no room, not writable). Under
``torch.compile`` a shared-memory collective runs outside the graph
(``shared_memory.eagerly``: one graph break, where a gloo collective with
``async_op=True`` makes one too). Pinned by tests/comm/test_shared_memory.py
(test_compiled_and_eager_ranks_use_the_groups_one_transport,
test_group_with_one_rank_unable_falls_back_to_gloo_on_every_rank).
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import process_group, shared_memory
from .shared_memory import (
    PLATFORM_SUPPORTED,
    HostSharedMemory,
    PublishedShards,
    SharedMemoryUnavailable,
    SharedMemoryWork,
    bytes_per_rank,
    prepare_for_compile,
)

__all__ = [
    "ENV_SWITCH",
    "host_transport",
    "shared_memory_of",
    "process_shared_bytes",
    "process_mapped_bytes",
    "shared_bytes_per_rank",
    "expect_collective_bytes",
    "published_slice",
    "published_slice_bytes",
    "published_shards_of",
    "uses_shared_memory",
    "backend_copies_gathered_output",
    "reduce_scatter_method",
    "inputs_in_use",
]

ENV_SWITCH = "COMPOSABLE_SHARD_SHARED_MEMORY"

# Group -> its shared-memory transport, or None where it uses its backend;
# decided once (see the Note). Weak: a destroyed group's files close.
_decisions: "weakref.WeakKeyDictionary[ProcessGroup, HostSharedMemory | None]" = weakref.WeakKeyDictionary()
# Group -> the largest bytes one rank writes for one of its collectives, as
# announced before its first collective (what its slots reserve).
_announced: "weakref.WeakKeyDictionary[ProcessGroup, int]" = weakref.WeakKeyDictionary()
# Group -> the bytes of its published shards' area claimed so far, before
# its setup ([Note: published shards] in comm/shared_memory/published.py).
_published: "weakref.WeakKeyDictionary[ProcessGroup, int]" = weakref.WeakKeyDictionary()
# Slices start on a cache line.
_SLICE_ALIGN = 64


def switched_on() -> bool:
    """Whether this process offers shared memory to its groups (read when a
    group decides; every rank's answer counts)."""
    return PLATFORM_SUPPORTED and os.environ.get(ENV_SWITCH, "1") != "0"


def host_transport(tensor: torch.Tensor, group: ProcessGroup | None, nbytes: int = 0) -> HostSharedMemory | None:
    """The shared-memory transport that carries ``tensor``'s collectives over
    ``group`` (None: the default group), or None where they go through the
    backend. The first call for a group decides (collective: every rank of
    the group makes its first collective call then); ``nbytes``: what this
    collective writes per rank, reserved at least."""
    if tensor.device.type != "cpu":
        return None
    return shared_memory_of(group, nbytes)


def _or_world(group: ProcessGroup | None) -> ProcessGroup:
    """``group``, or the default group for None (every caller runs with a
    process group initialised, where ``dist.group.WORLD`` is not None)."""
    return group if group is not None else cast(ProcessGroup, dist.group.WORLD)


def shared_memory_of(group: ProcessGroup | None, nbytes: int = 0) -> HostSharedMemory | None:
    """``group``'s shared-memory transport (None: the default group), or
    None where it uses its backend; decided at the first call (collective)."""
    group = _or_world(group)
    try:
        return _decisions[group]
    except KeyError:
        return _decide(group, nbytes)


def _decide(group: ProcessGroup, nbytes: int) -> HostSharedMemory | None:
    transport = None
    if PLATFORM_SUPPORTED and _several_gloo_ranks(group):
        try:
            transport = HostSharedMemory.connect(
                group,
                max(nbytes, _announced.get(group, 0)),
                wanted=switched_on(),
                slot_bytes=shared_memory.SLOT_BYTES,  # read now: the knob may be set until a group sets up
                published_bytes=_published.get(group, 0),
            )
        except SharedMemoryUnavailable as unavailable:
            if unavailable.warn:
                warnings.warn(
                    f"composable_shard: collectives of the process group of global ranks "
                    f"{dist.get_process_group_ranks(group)} go through gloo, not shared memory: {unavailable}. "
                    f"Set {ENV_SWITCH}=0 to choose gloo without this warning.",
                    RuntimeWarning,
                    stacklevel=2,
                )
    _decisions[group] = transport
    return transport


def expect_collective_bytes(group: ProcessGroup | None, nbytes: int) -> None:
    """Announce that ``group`` (None: the default group) will carry
    collectives writing up to ``nbytes`` per rank, so that its shared memory
    is checked and reserved for them when it is set up (not collective)."""
    prepare_for_compile()  # handles are built before a model is compiled
    if not dist.is_initialized():
        return
    group = _or_world(group)
    if nbytes > _announced.get(group, 0):
        _announced[group] = nbytes


def published_slice(group: ProcessGroup | None, nbytes: int) -> int | None:
    """Where in ``group``'s published area (None: the default group) a flat
    parameter's shard of ``nbytes`` goes, or None where its all-gathers go
    through rounds: while the area stays within
    ``shared_memory.PUBLISHED_BYTES``, for a group of several ranks that has
    not set up yet (its area is sized then). Not collective: every rank
    builds the same flat parameters in the same order, so each gets the
    same slice on every rank. The caller claims only what may publish
    ([Note: all-gathers from published shards] in runtime/published_shards.py)."""
    if not dist.is_initialized() or not switched_on():
        return None
    group = _or_world(group)
    if group in _decisions or not _several_gloo_ranks(group):
        return None
    at = _published.get(group, 0)
    if at + nbytes > shared_memory.PUBLISHED_BYTES:
        return None
    _published[group] = at + published_slice_bytes(nbytes)
    return at


def published_slice_bytes(nbytes: int) -> int:
    """Bytes a shard of ``nbytes`` takes in a published area (slices start
    on a cache line)."""
    return -(-nbytes // _SLICE_ALIGN) * _SLICE_ALIGN


def published_shards_of(group: ProcessGroup | None) -> PublishedShards | None:
    """``group``'s published shards (None: the default group), or None
    where it has no area; sets the group up if it has not (collective)."""
    transport = shared_memory_of(group)
    return None if transport is None else transport.published


def uses_shared_memory(group: ProcessGroup | None, device_type: str) -> bool:
    """Whether collectives of ``group`` (None: the default group) on
    ``device_type`` go through shared memory, without a collective (for
    memory plans): the group's decision once made; before that, a gloo group
    of two or more ranks is assumed to share a host, and with no process
    group at all (a plan before the run), one host with gloo."""
    if device_type != "cpu" or not switched_on():
        return False
    if not dist.is_initialized():
        return True
    group = _or_world(group)
    if group in _decisions:
        return _decisions[group] is not None
    return _several_gloo_ranks(group)


def _several_gloo_ranks(group: ProcessGroup) -> bool:
    """Whether ``group`` is a gloo group of two or more ranks: one that may
    use shared memory (its setup decides whether it does)."""
    return dist.get_world_size(group) > 1 and "gloo" in str(dist.get_backend(group))


def backend_copies_gathered_output(group: ProcessGroup | None) -> bool:
    """Whether an all-gather through ``group``'s backend on CPU fills a flat
    copy of its own first (gloo's messages; for memory plans): not the
    fake process group of PyTorch's tests, which moves nothing. Before any
    process group, gloo is assumed."""
    if not dist.is_initialized():
        return True
    return "gloo" in str(dist.get_backend(_or_world(group)))


def inputs_in_use(work: Any) -> bool:
    """Whether the backend may still read a collective's inputs until its
    work is waited on (False for shared-memory work, which copied them out
    when it was issued, so their memory can be freed at once)."""
    return not isinstance(work, SharedMemoryWork)


def process_shared_bytes() -> int:
    """Shared memory held by this process's files, over all its groups."""
    return sum(transport.shared_bytes for transport in _live())


def process_mapped_bytes() -> int:
    """Shared memory of any rank's files in this process's RSS, over all its
    groups. ``RSS - process_mapped_bytes() + process_shared_bytes()`` counts
    every page of shared memory once, in the process that owns it."""
    return sum(transport.mapped_bytes for transport in _live())


def shared_bytes_per_rank(largest_bytes: int, published_bytes: int = 0) -> int:
    """Shared memory one rank of a group holds once its collectives wrote up
    to ``largest_bytes`` per rank (its slots and header; bounded whatever
    the size: larger collectives stream through the slots), with an area of
    ``published_bytes`` of published shards. For memory plans, which know
    the sizes but no group."""
    return bytes_per_rank(largest_bytes, shared_memory.SLOT_BYTES, published_bytes)


def _live() -> list[HostSharedMemory]:
    return [transport for transport in _decisions.values() if transport is not None]


def reduce_scatter_method(input: torch.Tensor, group: ProcessGroup | None) -> str:
    """How ``comm.reduce_scatter`` reduces ``input`` over ``group``.

    [Note: gradient collective per backend]
    NCCL (and any backend but gloo): a reduce-scatter, which moves each byte
    once. gloo on CPU with every rank on one host: shared memory ([Note:
    shared-memory collectives] in comm/shared_memory/collectives.py). Other
    gloo groups on CPU: an in-place all-reduce of the whole input, keeping
    this rank's chunk: gloo's reduce-scatter copies its whole input before
    reducing and reaches about half the bus bandwidth of its all-reduce, so
    the all-reduce is faster although it moves twice the bytes (measured:
    docs/design/comm.md). It costs no memory: the padded gradient exists
    anyway, and the chunk is copied out of it (``ChunkOfAllReduce``), never
    kept as a view that would hold the whole buffer alive. Pinned by
    tests/comm/test_reduce_scatter.py.
    """
    if host_transport(input, group) is not None:
        return "shared_memory"
    return process_group.message_method(input, group)
