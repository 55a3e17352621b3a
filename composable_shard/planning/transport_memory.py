"""Owns: the shared memory a rank's collectives keep in ``/dev/shm`` for
the whole run, counted by the plan as ``rank_bytes["transport"]``.

Knows nothing of: the step's replay (step_replay.py), units.
"""

from __future__ import annotations

from typing import Sequence

from .. import comm
from ..comm import transport
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
    Counted once, for this rank: RSS also shows the pages of the peers'
    slots this rank read (``scripts/bench.py`` counts each page for its
    owner only)."""
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
    return sum(transport.shared_bytes_per_rank(nbytes) for nbytes in largest.values() if nbytes)
