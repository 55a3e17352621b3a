"""no_sync: gradient accumulation without gradient communication inside the
context, and the next synchronised backward reduces the sum — parity with a
single-process reference that sums the micro-batches' gradients, for every
strategy; a spy on ``composable_shard.comm`` counts the collectives.
``zero_grad()`` between no_sync backwards discards what they accumulated,
as in one process; an in-place change there is refused."""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import MixedPrecision, ShardingStrategy, fully_shard, no_sync
from composable_shard.runtime.state import unit_states_under

from tests.support.comm_spies import CollectiveSpy
from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT, batch, lm_loss
from tests.support.parity import Parity, assert_resharded, compare_full, hybrid_groups, step_and_compare

def _shard(strategy: ShardingStrategy) -> Callable[[nn.Module], None]:
    # The hybrid strategies: 2 x 2 at 4 ranks (tests.support.parity.hybrid_groups).
    groups = {"process_group": hybrid_groups(dist.get_world_size())} if strategy.name.startswith("HYBRID") else {}

    def shard(model: nn.Module) -> None:
        for block in model.blocks:
            fully_shard(block, strategy=strategy, **groups)
        fully_shard(model, strategy=strategy, **groups)

    return shard


def _micro_batch_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    return loss.detach()


def _sharded_and_reference(
    strategy: ShardingStrategy, make_optimizer: Callable[..., torch.optim.Optimizer]
) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer, Parity]:
    """A TinyGPT sharded with ``strategy``, its single-process reference,
    an optimizer of each and the parity settings."""
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    _shard(strategy)(model)
    optimizer, reference_optimizer = make_optimizer(model.parameters()), make_optimizer(reference.parameters())
    parity = Parity(build=TinyGPT, shard=_shard(strategy), atol=5e-6, rtol=1e-5, reference_optimizer=reference_optimizer)
    return model, reference, optimizer, reference_optimizer, parity


def _accumulation_matches_summed_reference(rank: int, world_size: int) -> None:
    micro_batches = 3
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        adamw = functools.partial(torch.optim.AdamW, lr=1e-2)
        model, reference, optimizer, reference_optimizer, parity = _sharded_and_reference(strategy, adamw)
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
                    # Each .grad shows this rank's part of its local sum, as
                    # DDP's shows the local sum ([Note: zero_grad while no_sync
                    # gradients wait] in composable_shard/handle/pending_views.py).
                    assert all(p.grad is not None for p in model.parameters()), "no_sync hid its gradient"
                else:
                    assert spy.reductions_issued() or world_size == 1, counts
                assert_resharded(model)
            step_and_compare(model, reference, (optimizer, reference_optimizer), parity, f"{strategy.name} step {step}")


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


# (synchronised?, zero_grad after it?) per micro-batch: a kept gradient of a
# synchronised backward, two no_sync backwards, the clear, one more, then
# the synchronised backward that reduces what is left.
_CLEARED_ACCUMULATION = ((True, False), (False, False), (False, True), (False, False), (True, False))


def _clear(where: str, set_to_none: bool, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if where == "optimizer":
        optimizer.zero_grad(set_to_none=set_to_none)
    elif where == "model":
        model.zero_grad(set_to_none=set_to_none)
    else:  # one block's parameters only
        model.blocks[0].zero_grad(set_to_none=set_to_none)


def _zero_grad_between_no_sync_backwards_matches_reference(rank: int, world_size: int) -> None:
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    strategies = [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD]
    if world_size == 4:
        strategies.append(ShardingStrategy.HYBRID_SHARD)
    for strategy in strategies:
        for set_to_none in (True, False):
            for where in ("optimizer", "model", "block"):
                sgd = functools.partial(torch.optim.SGD, lr=0.1)
                model, reference, optimizer, reference_optimizer, parity = _sharded_and_reference(strategy, sgd)
                for index, (synchronised, clear_after) in enumerate(_CLEARED_ACCUMULATION):
                    inputs, targets = batch(index)
                    _micro_batch_step(reference, inputs, targets)
                    with contextlib.nullcontext() if synchronised else no_sync(model):
                        _micro_batch_step(model, inputs[local], targets[local])
                    if clear_after:
                        _clear(where, set_to_none, model, optimizer)
                        _clear(where, set_to_none, reference, reference_optimizer)
                when = f"{strategy.name} zero_grad({where}, set_to_none={set_to_none})"
                step_and_compare(model, reference, (optimizer, reference_optimizer), parity, when)


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_grad_between_no_sync_backwards_discards_them_as_in_one_process(world_size: int) -> None:
    run_distributed(_zero_grad_between_no_sync_backwards_matches_reference, world_size)


def _cleared_low_precision_accumulation_equals_a_fresh_one(rank: int, world_size: int) -> None:
    """Under bf16 mixed precision the waiting gradient is bf16 and each
    fp32 parameter's .grad shows it through a stand-in: a clear of the whole
    model leaves exactly what a run of only the later micro-batches gives."""
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    mixed_precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    grads = []
    for micro_batches in (_CLEARED_ACCUMULATION, _CLEARED_ACCUMULATION[3:]):
        torch.manual_seed(0)
        model = TinyGPT()
        for block in model.blocks:
            fully_shard(block, mixed_precision=mixed_precision)
        fully_shard(model, mixed_precision=mixed_precision)
        for index, (synchronised, clear_after) in enumerate(micro_batches, start=5 - len(micro_batches)):
            inputs, targets = batch(index)
            with contextlib.nullcontext() if synchronised else no_sync(model):
                _micro_batch_step(model, inputs[local], targets[local])
            if not synchronised and index == 3:  # no gradient kept from before: each .grad shows the waiting one
                dtypes = {p.grad.dtype for p in model.parameters() if p.grad is not None}
                assert dtypes == {torch.bfloat16}, f"the bf16 waiting gradient is not shown: {dtypes}"
            if clear_after:
                model.zero_grad()
        grads.append([p.grad.clone() for p in model.parameters()])
    for cleared, fresh in zip(*grads):
        assert torch.equal(cleared, fresh)


def test_zero_grad_discards_a_low_precision_waiting_gradient() -> None:
    run_distributed(_cleared_low_precision_accumulation_equals_a_fresh_one, 2)


def _in_place_change_of_a_waiting_gradient_raises(rank: int, world_size: int) -> None:
    """Scaling .grad between no_sync backwards cannot be applied to the
    whole local gradient: the next backward raises, naming the parameter;
    the tree resets (the waiting gradients are dropped) and the next step
    matches a reference that starts from the same parameters."""
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    _shard(ShardingStrategy.FULL_SHARD)(model)
    inputs, targets = batch(0)
    with no_sync(model):
        _micro_batch_step(model, inputs[local], targets[local])
    next(model.blocks[1].parameters()).grad.mul_(0.5)
    with pytest.raises(RuntimeError, match=r"the \.grad of parameter 'blocks\.1\.[^']*' was changed in place while its no_sync"):
        _micro_batch_step(model, inputs[local], targets[local])
    model.zero_grad()
    inputs, targets = batch(1)
    _micro_batch_step(model, inputs[local], targets[local])
    _micro_batch_step(reference, inputs, targets)
    compare_full(model, reference, Parity(build=TinyGPT, shard=lambda m: None, atol=5e-6), "after the refused change", grads=True)


def test_in_place_change_of_a_waiting_gradient_raises_and_the_model_stays_usable() -> None:
    run_distributed(_in_place_change_of_a_waiting_gradient_raises, 2)
