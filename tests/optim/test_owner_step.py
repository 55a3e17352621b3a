"""Per-parameter optimizers that are not elementwise (torch's Muon and
Adafactor, an fp32 Newton-Schulz optimizer, row- and tensor-normalised SGD)
step each whole parameter once per shard group, on its owner, and training
equals one process on the global batch step by step, under every strategy
([Note: owner computes] in composable_shard/optim/owner_step.py)."""

from __future__ import annotations

from collections import Counter
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import ShardingStrategy, full_shape
from composable_shard.optim import owner_plans
from composable_shard.runtime.lifecycle import live_units

from tests.support.comm_spies import CollectiveSpy, gloo_only_group
from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT
from tests.support.optimizers import NewtonSchulzSGD, RowNormalizedSGD, StepRecorder, TensorNormalizedSGD
from tests.support.parity import Parity, hybrid_groups, run_parity, shard_manually


OPTIMIZERS: dict[str, tuple[Callable[[nn.Module], torch.optim.Optimizer], float]] = {
    # name: (factory, atol); rtol 1e-5 throughout. torch's Muon runs
    # Newton-Schulz in bf16: its tolerance is derived in test_muon.py.
    "newton_schulz_fp32": (lambda m: NewtonSchulzSGD(m.parameters()), 2e-6),
    "row_normalized_sgd": (lambda m: RowNormalizedSGD(m.parameters()), 2e-6),
    "tensor_normalized_sgd": (lambda m: TensorNormalizedSGD(m.parameters()), 2e-6),
    "adafactor": (lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2), 2e-6),
}


def _strategies(world_size: int) -> list[tuple[str, Callable[[nn.Module], None]]]:
    cases = [
        ("FULL_SHARD", shard_manually(ShardingStrategy.FULL_SHARD)),
        ("SHARD_GRAD_OP", shard_manually(ShardingStrategy.SHARD_GRAD_OP)),
        ("NO_SHARD", shard_manually(ShardingStrategy.NO_SHARD)),
    ]
    if world_size == 4:
        shard_group, replicate_group = hybrid_groups(world_size)
        cases.append(("HYBRID_SHARD 2x2", shard_manually(ShardingStrategy.HYBRID_SHARD, process_group=(shard_group, replicate_group))))
    return cases


def _every_optimizer_matches_one_process(rank: int, world_size: int) -> None:
    for strategy, shard in _strategies(world_size):
        for name, (make, atol) in OPTIMIZERS.items():
            try:
                run_parity(Parity(build=TinyGPT, shard=shard, make_optimizer=make, atol=atol, steps=3))
            except AssertionError as error:
                raise AssertionError(f"{name} under {strategy}: {error}") from error


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_whole_parameter_optimizers_match_one_process(world_size: int) -> None:
    run_distributed(_every_optimizer_matches_one_process, world_size)


def _each_parameter_stepped_once_whole(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    shard_manually(ShardingStrategy.FULL_SHARD)(model)
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer = NewtonSchulzSGD(model.parameters())
    recorder = StepRecorder(optimizer, names)
    from tests.support.models import batch, lm_loss

    inputs, targets = batch(0)
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    lm_loss(model(inputs[local]), targets[local]).backward()
    optimizer.step()
    everything: list[list[tuple[str, tuple[int, ...]]]] = [None] * world_size  # type: ignore[list-item]
    dist.all_gather_object(everything, recorder.seen)
    counts = Counter(name for seen in everything for name, _ in seen)
    shapes = {name: shape for seen in everything for name, shape in seen}
    expected = {n: tuple(full_shape(p)) for n, p in model.named_parameters()}
    assert counts == Counter(list(expected)), f"stepped once across ranks, differences: {counts - Counter(list(expected))}, {Counter(list(expected)) - counts}"
    assert shapes == expected, f"the optimizer saw {shapes}, expected whole shapes {expected}"
    # Work balance: the busiest rank within 2x the ideal plus the largest parameter.
    (plan,) = owner_plans(optimizer, live_units())
    work = plan.work_per_rank()
    largest = max(owned.cost for owned in plan.params)
    assert max(work) <= 2 * sum(work) / world_size + largest, work


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_whole_parameter_is_stepped_once_by_a_balanced_owner(world_size: int) -> None:
    run_distributed(_each_parameter_stepped_once_whole, world_size)


def _both_exchanges_match_one_process(rank: int, world_size: int) -> None:
    """The exchange in place (shared memory, the default group here) and
    the one through send and receive buffers (a group made with the shared
    memory switched off: gloo's messages) give the same training."""
    from composable_shard import comm

    gloo_only = gloo_only_group(world_size)
    assert not comm.all_to_all_in_place(torch.device("cpu"), gloo_only)
    assert comm.all_to_all_in_place(torch.device("cpu"), None)
    try:
        for group, path, collective in ((None, "in place", "all_to_all_pieces"), (gloo_only, "through buffers", "all_to_all")):
            for name, (make, atol) in OPTIMIZERS.items():
                shard = shard_manually(ShardingStrategy.FULL_SHARD, process_group=group)
                spy = CollectiveSpy()
                try:
                    with spy.watching():
                        run_parity(Parity(build=TinyGPT, shard=shard, make_optimizer=make, atol=atol, steps=3))
                except AssertionError as error:
                    raise AssertionError(f"{name}, the exchange {path}: {error}") from error
                exchanges = {key: count for key, count in spy.counts().items() if key in ("all_to_all", "all_to_all_pieces")}
                assert exchanges == {collective: 6}, (name, path, exchanges)  # to owners and back, 3 steps
    finally:
        dist.destroy_process_group(gloo_only)


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_exchange_in_place_and_through_buffers_match_one_process(world_size: int) -> None:
    run_distributed(_both_exchanges_match_one_process, world_size)
