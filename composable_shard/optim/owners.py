"""Owns: which rank of a shard group steps each whole parameter of a
per-parameter optimizer — its owner — chosen once, deterministically, and
balanced by the optimizer's work; and where each rank's piece of the
parameter lies.

Knows nothing of: collectives, hooks, the optimizer's update rule.

Public names: ``OwnedParam``, ``OwnerPlan``, ``param_cost``, ``plan_owners``.

[Note: choosing owners]
Parameters go, largest cost first, to the rank with the least work so far
(longest processing time first; ties to the rank holding the larger piece
of it, then the lower rank) — except that a parameter lying wholly inside
one rank's shard stays with that rank, where stepping it moves nothing, as
long as that rank's work stays within an even share (blocks laid out alike
would otherwise give one rank every attention matrix and another every MLP
matrix). Not beyond it: every rank waits for the busiest owner before the
values go back, so work over the even share lengthens every rank's step,
while moving a parameter costs far less than its matrix function (with 10%
of slack, the bench's Muon GPT on 2 CPU ranks stepped 62 ms of
Newton-Schulz on one rank and 49 on the other, and its owner step took 83
ms against 69 without it). The cost
is what the optimizers this is for spend: a matrix function of a
``(rows, cols)`` parameter (Newton-Schulz, a preconditioner's root) costs
about ``numel * min(rows, cols)``, anything else ``numel``. The inputs are
the flat layouts and the optimizer's parameter order, equal on every rank,
so every rank computes the same owners without a collective. Pinned by
tests/optim/test_owners.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup

from ..handle import FlatParamHandle
from ..handle.layout import FlatParamLayout, ParamInfo

__all__ = ["OwnedParam", "OwnerPlan", "param_cost", "plan_owners", "pieces_of"]


@dataclass(frozen=True, eq=False)
class OwnedParam:
    """One parameter of a unit stepped whole by its owner."""

    param: nn.Parameter
    handle: FlatParamHandle
    # Position of the parameter in ``handle.layout.params`` / ``orig_params``.
    index: int
    # Name under the unit's root, for messages and state dicts.
    name: str
    shape: torch.Size
    # Element range [start, stop) of the flattened parameter on each rank of
    # the shard group, in group rank order; (0, 0) where a rank holds none.
    pieces: tuple[tuple[int, int], ...]
    # Group rank that steps it.
    owner: int
    cost: float

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, eq=False)
class OwnerPlan:
    """The owners of one optimizer's parameters in one shard group."""

    group: ProcessGroup | None
    rank: int
    world_size: int
    # In the optimizer's parameter order.
    params: tuple[OwnedParam, ...]

    def work_per_rank(self) -> list[float]:
        """The cost each group rank steps ([Note: choosing owners])."""
        work = [0.0] * self.world_size
        for owned in self.params:
            work[owned.owner] += owned.cost
        return work


def param_cost(shape: torch.Size) -> float:
    """The optimizer work of stepping one parameter of ``shape``."""
    numel = math.prod(shape)
    if len(shape) < 2:
        return float(numel)
    rows, cols = shape[0], numel // max(shape[0], 1)
    return float(numel) * max(min(rows, cols), 1)


def pieces_of(layout: FlatParamLayout, info: ParamInfo) -> tuple[tuple[int, int], ...]:
    """Each group rank's range of the flattened parameter ([Note: flat layout]
    in handle/layout.py)."""
    pieces = []
    for rank in range(layout.shard_world_size):
        window_start, window_stop = rank * layout.shard_numel, (rank + 1) * layout.shard_numel
        start = max(info.offset, window_start) - info.offset
        stop = min(info.offset + info.numel, window_stop) - info.offset
        pieces.append((start, stop) if stop > start else (0, 0))
    return tuple(pieces)


def plan_owners(costs: list[float], pieces: list[tuple[tuple[int, int], ...]], world_size: int) -> list[int]:
    """The owner of each parameter ([Note: choosing owners])."""
    owners = [-1] * len(costs)
    work = [0.0] * world_size
    even_share = sum(costs) / world_size
    for position in sorted(range(len(costs)), key=lambda p: (-costs[p], p)):
        held = pieces[position]
        holders = [rank for rank, (start, stop) in enumerate(held) if stop > start]
        if not holders:  # an empty parameter: nothing to step or move
            owner = 0
        elif len(holders) == 1 and work[holders[0]] + costs[position] <= even_share:
            owner = holders[0]
        else:
            owner = min(range(world_size), key=lambda rank: (work[rank], -(held[rank][1] - held[rank][0]), rank))
        owners[position] = owner
        work[owner] += costs[position]
    return owners
