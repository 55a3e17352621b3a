"""Owns: the shared memory a rank's collectives keep in ``/dev/shm`` for
the whole run, counted by the plan as ``rank_bytes["transport"]``.

Knows nothing of: the step's replay (memory.py), units.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..comm import transport
from .memory import FlatParamPlan

__all__ = ["transport_bytes"]


def transport_bytes(flat_params: Sequence[FlatParamPlan]) -> int:
    """Shared memory one rank's collectives hold for the whole run (CPU, a
    gloo group on one host): its slots, each reserving the largest
    collective of any flat parameter up to the slot's fixed size, plus a
    header page (``shared_memory.bytes_per_rank``). The largest collective is
    what ``FlatParamHandle`` announces: the shard in the widest of its
    dtypes, times the peers a reduce-scatter writes for. Counted once, for
    this rank: RSS also shows the pages of the peers' slots this rank read
    (``scripts/bench.py`` counts each page for its owner only)."""
    largest = 0
    for fp in flat_params:
        if not fp.is_sharded or not fp.shard_numel:
            continue
        world = fp.padded_numel // fp.shard_numel
        itemsize = max(torch.empty((), dtype=d, device="meta").element_size() for d in (fp.dtype, fp.param_dtype, fp.reduce_dtype))
        largest = max(largest, fp.shard_numel * itemsize * max(1, world - 1))
    return transport.shared_bytes_per_rank(largest) if largest else 0
