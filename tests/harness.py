"""Owns: the import path of the multi-process harness. Tests write
``from tests.harness import run_distributed, world_sizes, ...`` (or ``from .harness
import ...``); the harness itself lives in two modules:

- tests/harness_pool.py — the pytest side: warm worker pools, ``run_distributed``,
  errors, skip markers (see its [Note: warm worker pools] and [Note: worker output]);
- tests/harness_worker.py — the worker side: the spawned process's serve loop, the
  messages, ``run_subtests`` and the group check after a failure.

Knows nothing of: composable_shard.

Public names: ``run_distributed``, ``run_subtests``, ``shutdown_pools``,
``DistributedTestError``, ``WORLD_SIZES``, ``world_sizes``, ``requires_cuda``,
``requires_gpus``, ``DEFAULT_TIMEOUT_S``.

Usage, from a test module (the function must live at module level so that workers can
import it by name)::

    from tests.harness import run_distributed, world_sizes

    def _all_reduce_sums_ranks(rank: int, world_size: int, scale: float) -> float:
        t = torch.tensor([float(rank) * scale])
        dist.all_reduce(t)
        return t.item()

    @world_sizes
    def test_all_reduce_sums_ranks(world_size: int) -> None:
        results = run_distributed(_all_reduce_sums_ranks, world_size, 2.0)
        ...
"""

from __future__ import annotations

from .harness_pool import (
    DEFAULT_TIMEOUT_S,
    WORLD_SIZES,
    DistributedTestError,
    requires_cuda,
    requires_gpus,
    run_distributed,
    shutdown_pools,
    world_sizes,
)
from .harness_worker import run_subtests

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistributedTestError",
    "WORLD_SIZES",
    "requires_cuda",
    "requires_gpus",
    "run_distributed",
    "run_subtests",
    "shutdown_pools",
    "world_sizes",
]
