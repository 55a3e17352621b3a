"""no_sync with conditional compute: a unit that ran only in an early
micro-batch (or on some ranks only) has its accumulated gradient reduced at
the next synchronised backward, though it does not run in it, and nothing
leaks into a later step — parity with a single process on the global batch
that sums the micro-batches' gradients, step by step through the optimizer.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable

import torch
import torch.nn as nn

from composable_shard import CPUOffload, ShardingStrategy, no_sync
from composable_shard.runtime.state import unit_states_under

from tests.support.harness_pool import requires_cuda, run_distributed
from tests.support.models import TinyGPT, batch, lm_loss
from tests.support.parity import Parity, assert_resharded, hybrid_groups, shard_manually, step_and_compare

MICRO_BATCHES = 3

# Per step, per micro-batch: the blocks that run (the last micro-batch is
# the synchronised one). Step 0: block 1 only in the first micro-batch;
# step 1: block 1 in none (no gradient at all, so the optimizer must skip
# it); step 2: block 1 only in the second, block 2 only in the first.
SCHEDULE = (
    ({0, 1, 2}, {0, 2}, {0, 2}),
    ({0, 2}, {0, 2}, {0, 2}),
    ({0, 1}, {0, 1, 2}, {0}),
)


class RoutedGPT(TinyGPT):
    """TinyGPT whose blocks each see only the rows ``routes`` sends them (all
    by default); a block no row reaches is not called (an expert without
    tokens)."""

    def forward(self, idx: torch.Tensor, routes: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for index, block in enumerate(self.blocks):
            rows = None if routes is None else routes.get(index)
            if rows is None:
                x = block(x)
            elif rows.any():
                routed = x.clone()
                routed[rows] = block(x[rows])
                x = routed
        return self.head(self.norm(x))


def _routes(blocks_running: set[int], global_batch: int) -> dict[int, torch.Tensor]:
    return {index: torch.full((global_batch,), index in blocks_running) for index in range(3)}


def _train_with_schedule(
    shard: Callable[[nn.Module], None],
    label: str,
    routes_of: Callable[[int, int], dict[int, torch.Tensor]],
    dp_rank: int,
    dp_size: int,
    device: torch.device = torch.device("cpu"),
) -> nn.Module:
    """Three steps of MICRO_BATCHES micro-batches, the first ones under
    no_sync; ``routes_of(step, micro)`` gives the global batch's routes."""
    torch.manual_seed(0)
    model = RoutedGPT().to(device)
    reference = copy.deepcopy(model)
    shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    parity = Parity(build=RoutedGPT, shard=shard, atol=5e-6, rtol=1e-5)
    local = slice(dp_rank * 8 // dp_size, (dp_rank + 1) * 8 // dp_size)
    for step in range(len(SCHEDULE)):
        for micro in range(MICRO_BATCHES):
            inputs, targets = (t.to(device) for t in batch(step * MICRO_BATCHES + micro))
            routes = {index: rows.to(device) for index, rows in routes_of(step, micro).items()}
            lm_loss(reference(inputs, routes), targets).backward()
            synchronised = micro == MICRO_BATCHES - 1
            local_routes = {index: rows[local] for index, rows in routes.items()}
            with contextlib.nullcontext() if synchronised else no_sync(model):
                lm_loss(model(inputs[local], local_routes), targets[local]).backward()
        assert_resharded(model)
        for _, state in unit_states_under(model):
            for handle in state.handles:
                assert not handle.has_unsharded_grad(), f"{label} step {step}: {state.fqn} kept a local gradient"
        step_and_compare(model, reference, (optimizer, reference_optimizer), parity, f"{label} step {step}")
    return model


def _same_routes_on_every_rank(step: int, micro: int) -> dict[int, torch.Tensor]:
    return _routes(SCHEDULE[step][micro], 8)


def _units_absent_from_the_synchronised_backward(rank: int, world_size: int) -> None:
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        _train_with_schedule(shard_manually(strategy), strategy.name, _same_routes_on_every_rank, rank, world_size)
    # CPU offload: on a CPU-only machine a valid no-op (test_cpu_offload.py),
    # so this runs the path a CPU run takes; the offloading one is below.
    offload = shard_manually(ShardingStrategy.FULL_SHARD, cpu_offload=CPUOffload(offload_params=True))
    _train_with_schedule(offload, "FULL_SHARD with cpu_offload", _same_routes_on_every_rank, rank, world_size)
    # NO_SHARD gathers nothing in forward, so a block may run on one rank
    # only (an expert with tokens on rank 0 alone): the other ranks take
    # part in its reduction with zeros.
    def rank_zero_rows_only(step: int, micro: int) -> dict[int, torch.Tensor]:
        routes = _routes(SCHEDULE[step][micro], 8)
        routes[1] = routes[1] & (torch.arange(8) < 8 // world_size)
        return routes

    _train_with_schedule(
        shard_manually(ShardingStrategy.NO_SHARD), "NO_SHARD, block 1 on rank 0 only", rank_zero_rows_only, rank, world_size
    )


def test_no_sync_gradients_of_units_absent_from_the_synchronised_backward_are_reduced() -> None:
    run_distributed(_units_absent_from_the_synchronised_backward, 2)


def _hybrid_units_absent_from_the_synchronised_backward(rank: int, world_size: int) -> None:
    shard_group, replicate_group = hybrid_groups(world_size)
    for strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2):
        shard = shard_manually(strategy, process_group=(shard_group, replicate_group))
        _train_with_schedule(shard, strategy.name, _same_routes_on_every_rank, rank, world_size)


def test_no_sync_gradients_of_absent_units_are_reduced_under_hybrid_sharding() -> None:
    run_distributed(_hybrid_units_absent_from_the_synchronised_backward, 4)


def _offloaded_units_absent_from_the_synchronised_backward(rank: int, world_size: int) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    shard = shard_manually(ShardingStrategy.FULL_SHARD, cpu_offload=CPUOffload(offload_params=True))
    model = _train_with_schedule(shard, "FULL_SHARD offloaded", _same_routes_on_every_rank, rank, world_size, device=device)
    for _, state in unit_states_under(model):
        assert all(handle.offload_params for handle in state.handles), state.fqn


@requires_cuda
def test_no_sync_gradients_of_absent_offloaded_units_are_reduced_on_a_gpu() -> None:
    run_distributed(_offloaded_units_absent_from_the_synchronised_backward, 1, backend="nccl")
