"""Owns: the process groups of one unit (shard group and, for hybrid
sharding, replicate group) and this rank's place in them.

Knows nothing of: collectives and their transports, modules, flat
parameters, streams.

Public names: ``ShardGroups``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["ShardGroups"]


@dataclass(frozen=True)
class ShardGroups:
    """The process groups a unit communicates over.

    Parameters are sharded over ``shard_group`` and replicated over
    ``replicate_group`` (hybrid sharding). ``NO_SHARD`` is a shard group of one
    rank replicated over all ranks, so every strategy is a point in this one
    2-D space.
    """

    # Group the flat parameter is sharded over; None means "this rank alone".
    shard_group: ProcessGroup | None
    # Group the shards are replicated over; None means no replication.
    replicate_group: ProcessGroup | None
    shard_rank: int = field(init=False)
    shard_world_size: int = field(init=False)
    replicate_world_size: int = field(init=False)

    def __post_init__(self) -> None:
        shard_rank, shard_size = 0, 1
        if self.shard_group is not None:
            shard_rank = dist.get_rank(self.shard_group)
            shard_size = dist.get_world_size(self.shard_group)
        replicate_size = 1
        if self.replicate_group is not None:
            replicate_size = dist.get_world_size(self.replicate_group)
        object.__setattr__(self, "shard_rank", shard_rank)
        object.__setattr__(self, "shard_world_size", shard_size)
        object.__setattr__(self, "replicate_world_size", replicate_size)

    @property
    def data_parallel_world_size(self) -> int:
        """Number of ranks whose gradients are averaged."""
        return self.shard_world_size * self.replicate_world_size

    @property
    def is_sharded(self) -> bool:
        return self.shard_world_size > 1
