"""no_sync: gradient accumulation without gradient communication inside the
context, and the next synchronised backward reduces the sum — parity with a
single-process reference that sums the micro-batches' gradients, for every
strategy; a spy on ``composable_shard.comm`` counts the collectives."""

from __future__ import annotations

import contextlib
import copy
from typing import Callable

import pytest
import torch
import torch.nn as nn

from composable_shard import ShardingStrategy, fully_shard, no_sync
from composable_shard.runtime.state import unit_states_under

from tests.support.comm_spies import CollectiveSpy
from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT, batch, lm_loss
from tests.support.parity import Parity, assert_resharded, compare_full

def _shard(strategy: ShardingStrategy) -> Callable[[nn.Module], None]:
    def shard(model: nn.Module) -> None:
        for block in model.blocks:
            fully_shard(block, strategy=strategy)
        fully_shard(model, strategy=strategy)

    return shard


def _micro_batch_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    return loss.detach()


def _accumulation_matches_summed_reference(rank: int, world_size: int) -> None:
    micro_batches = 3
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        _shard(strategy)(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        parity = Parity(build=TinyGPT, shard=_shard(strategy), atol=5e-6, rtol=1e-5, reference_optimizer=reference_optimizer)
        local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
        for step in range(2):
            for micro in range(micro_batches):
                inputs, targets = batch(step * micro_batches + micro)
                _micro_batch_step(reference, inputs, targets)  # the reference sums micro-batch gradients
                last = micro == micro_batches - 1
                spy = CollectiveSpy()
                with spy.watching(), (contextlib.nullcontext() if last else no_sync(model)):
                    _micro_batch_step(model, inputs[local], targets[local])
                counts = spy.counts()
                if not last:
                    # No gradient communication at all inside no_sync; under
                    # NO_SHARD nothing else either. Sharded strategies must
                    # still all-gather parameters for forward and backward.
                    assert not spy.reductions_issued() and counts["all_reduce"] == 0, (strategy, counts)
                    if strategy is ShardingStrategy.NO_SHARD or world_size == 1:
                        assert sum(counts.values()) == 0, (strategy, counts)
                    assert all(p.grad is None for p in model.parameters()), "no_sync exposed a gradient"
                else:
                    assert spy.reductions_issued() or world_size == 1, counts
                assert_resharded(model)
            compare_full(model, reference, parity, f"{strategy.name} step {step}", grads=True)
            optimizer.step()
            reference_optimizer.step()
            optimizer.zero_grad()
            reference_optimizer.zero_grad()
            compare_full(model, reference, parity, f"{strategy.name} step {step} after optimizer step", grads=False)


@pytest.mark.parametrize("world_size", [2, 4])
def test_no_sync_accumulates_locally_and_next_backward_reduces_the_sum(world_size: int) -> None:
    run_distributed(_accumulation_matches_summed_reference, world_size)


def _no_sync_after_a_synchronised_step_adds_to_existing_grads(rank: int, world_size: int) -> None:
    """sync backward, then no_sync backward, then sync backward without
    zero_grad: the gradient is the sum of all three (like DDP)."""
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    _shard(ShardingStrategy.FULL_SHARD)(model)
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    for index, use_no_sync in enumerate((False, True, False)):
        inputs, targets = batch(index)
        _micro_batch_step(reference, inputs, targets)
        with no_sync(model) if use_no_sync else contextlib.nullcontext():
            _micro_batch_step(model, inputs[local], targets[local])
    compare_full(model, reference, Parity(build=TinyGPT, shard=lambda m: None, atol=5e-6), "after 3 backwards", grads=True)
    # Nested no_sync restores the outer setting.
    with no_sync(model):
        with no_sync(model):
            pass
        assert all(state.skip_grad_sync for _, state in unit_states_under(model))
    assert not any(state.skip_grad_sync for _, state in unit_states_under(model))


def test_no_sync_between_synchronised_backwards_and_nested_use() -> None:
    run_distributed(_no_sync_after_a_synchronised_step_adds_to_existing_grads, 2)


def _no_sync_on_an_unsharded_module_raises(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match=r"no_sync\(Linear\): no module in this tree was given to fully_shard"):
        with no_sync(nn.Linear(2, 2)):
            pass


def test_no_sync_on_a_module_without_units_raises() -> None:
    run_distributed(_no_sync_on_an_unsharded_module_raises, 2)
