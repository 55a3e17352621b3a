"""Owns: the shared memory a rank's collectives keep in ``/dev/shm`` for
the whole run (slots and published shards), counted by the plan as
``rank_bytes["transport"]``.

Knows nothing of: the step's replay (step_replay.py), units.
"""

from __future__ import annotations

from typing import Sequence

from .. import comm
from ..comm import shared_memory, transport
from ..api import ShardingStrategy
from .memory import UnitPlan

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)

__all__ = ["transport_bytes"]


def transport_bytes(units: Sequence[UnitPlan]) -> int:
    """Shared memory one rank's collectives hold for the whole run (CPU, a
    gloo group on one host): per group its slots, each reserving the
    largest collective this rank writes in it up to the slot's fixed size,
    plus a header page (``shared_memory.bytes_per_rank``). What each flat
    parameter reserves is ``comm.collective_bytes_per_group``, as
    ``FlatParamHandle`` announces it; a NO_SHARD unit's replica group is the
    data-parallel group the others shard over, a hybrid unit's its own.
    The data-parallel group's file also holds the area of the shards this
    rank publishes (``published_bytes``); the shards live there from the
    first step on ([Note: shards that live in the area] in
    comm/shared_memory/published.py) and are counted as parameters, so this
    line has the area's alignment gaps only. Counted once, for this rank:
    RSS also shows the pages of the peers' slots and areas this rank read
    (``scripts/bench.py`` counts each page for its owner only)."""
    largest = {"data_parallel": 0, "replicate": 0}
    for unit in units:
        hybrid = unit.strategy in _HYBRID
        for fp in unit.flat_params:
            if not fp.shard_numel:
                continue
            world = fp.padded_numel // fp.shard_numel
            most = comm.collective_bytes_per_group(
                shard_world_size=world if fp.is_sharded else 1,
                has_replicas=hybrid or not fp.is_sharded,
                shard_numel=fp.shard_numel,
                dtypes=(fp.dtype, fp.param_dtype),
                reduce_dtype=fp.reduce_dtype,
                requires_grad=fp.requires_grad,
                offload=fp.offload,
            )
            for kind, nbytes in most.items():
                group = "replicate" if kind == "replicate" and hybrid else "data_parallel"
                largest[group] = max(largest[group], nbytes)
    area, shards = published_bytes(units)
    published = {"data_parallel": area, "replicate": 0}
    held = sum(transport.shared_bytes_per_rank(nbytes, published[group]) for group, nbytes in largest.items() if nbytes)
    return held - shards  # a published shard is sharded: its group's file exists


def published_bytes(units: Sequence[UnitPlan]) -> tuple[int, int]:
    """Bytes of the area of shards one rank publishes for a step's
    all-gathers, as the units' flat parameters claim it when built
    ([Note: all-gathers from published shards] in
    runtime/published_shards.py), and the shards' own bytes in it: the
    sharded ones, in their own dtype and not offloaded, each aligned, in
    unit order while the area stays within ``shared_memory.PUBLISHED_BYTES``
    (the runtime claims in build order: the same total unless the area
    fills up)."""
    area = shards = 0
    for unit in units:
        for fp in unit.flat_params:
            if not (fp.is_sharded and fp.shard_numel and not fp.offload and fp.param_dtype == fp.dtype):
                continue
            nbytes = fp.shard_numel * fp.dtype.itemsize
            if area + nbytes <= shared_memory.PUBLISHED_BYTES:
                area += transport.published_slice_bytes(nbytes)
                shards += nbytes
    return area, shards
