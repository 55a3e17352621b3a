"""Explicit ``unshard`` / ``reshard`` and ``set_reshard_after_forward`` at
run time, in parity with the single-process reference: ``unshard(async_op=
True)`` before the forward (the forward gathers nothing), FSDP2's 1F1B
micro-batching (explicit unshard, gradient sync and the last backward only
on the last micro-batch, parameters kept between micro-batches), a unit
resharded between its forward and its backward, and resharding after
forward switched on and off (training and evaluation). All-gathers are
counted with a spy on ``composable_shard.comm``."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn as nn

from composable_shard import (
    MixedPrecision,
    ShardingStrategy,
    UnshardHandle,
    fully_shard,
    reshard,
    set_is_last_backward,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    set_reshard_after_forward,
    unshard_params,
)
from composable_shard import unshard
from composable_shard.runtime.state import unit_states_under

from tests.support.comm_spies import CollectiveSpy, with_collectives_alone
from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT, batch, lm_loss
from tests.support.parity import Parity, assert_resharded, compare_full

UNITS = 4  # the root and three blocks
# One parity record per reference model, so the bound after AdamW steps
# adds up over its steps ([Note: parity after an adaptive step]).
_PARITIES: weakref.WeakKeyDictionary[nn.Module, Parity] = weakref.WeakKeyDictionary()


def _parity(reference: nn.Module, reference_optimizer: torch.optim.Optimizer) -> Parity:
    if reference not in _PARITIES:
        _PARITIES[reference] = Parity(build=TinyGPT, shard=lambda m: None, atol=5e-6, rtol=1e-5)
    parity = _PARITIES[reference]
    parity.reference_optimizer = reference_optimizer
    return parity


def _models(strategy: ShardingStrategy) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    for block in model.blocks:
        fully_shard(block, strategy=strategy)
    fully_shard(model, strategy=strategy)
    return model, reference, torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)


def _units(model: nn.Module) -> list[nn.Module]:
    return [state.module for _, state in unit_states_under(model)]


def _gathers(spy: CollectiveSpy) -> int:
    return spy.counts()["all_gather_into"]


def _micro_batch(model, reference, step: int, *, spies: tuple[CollectiveSpy, CollectiveSpy] | None = None) -> None:
    """Forward and backward of both models on ``batch(step)`` (the model on
    this rank's part), losses compared; ``spies`` watch forward and backward."""
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    inputs, targets = batch(step)
    reference_loss = lm_loss(reference(inputs), targets)
    reference_loss.backward()
    forward_spy, backward_spy = spies or (CollectiveSpy(), CollectiveSpy())
    with forward_spy.watching():
        loss = lm_loss(model(inputs[local]), targets[local])
    with backward_spy.watching():
        loss.backward()
    mean = loss.detach().clone()
    torch.distributed.all_reduce(mean)
    torch.testing.assert_close(mean / world_size, reference_loss.detach(), atol=5e-6, rtol=1e-5)


def _optimizer_steps(model, reference, optimizer, reference_optimizer, when: str) -> None:
    parity = _parity(reference, reference_optimizer)
    compare_full(model, reference, parity, when, grads=True)
    optimizer.step()
    reference_optimizer.step()
    optimizer.zero_grad()
    reference_optimizer.zero_grad()
    assert_resharded(model)
    compare_full(model, reference, parity, f"{when} after the optimizer step", grads=False)


def _unshard_before_forward(rank: int, world_size: int) -> None:
    model, reference, optimizer, reference_optimizer = _models(ShardingStrategy.FULL_SHARD)
    for step in range(2):
        # The first time blocks before the root: each starts a tree of its
        # own, which the root's lazy init takes over with its gathers.
        units = _units(model)[::-1] if step == 0 else _units(model)
        issue = CollectiveSpy()
        with issue.watching():
            handles = [unshard(unit, async_op=True) for unit in units]
        assert all(isinstance(handle, UnshardHandle) for handle in handles)
        assert _gathers(issue) == UNITS, issue.counts()
        handles[1].wait()  # optional: the forward waits for the rest
        forward, backward = CollectiveSpy(), CollectiveSpy()
        _micro_batch(model, reference, step, spies=(forward, backward))
        assert _gathers(forward) == 0, forward.counts()  # the forward found every unit gathered
        _optimizer_steps(model, reference, optimizer, reference_optimizer, f"explicit unshard, step {step}")
    # A synchronous unshard returns None; reshard frees; so does anything
    # that may change the shards (the optimizer step here).
    assert unshard(model.blocks[0]) is None
    reshard(model.blocks[0])
    assert_resharded(model)
    unshard(model.blocks[1])
    optimizer.step()
    assert_resharded(model)
    # A parameter the user assigns after unshard reaches the next forward.
    unshard(model.blocks[2], async_op=True)
    with torch.no_grad():
        for module in (model, reference):
            module.blocks[2].fc_in.bias.data = torch.full_like(module.blocks[2].fc_in.bias.data, 0.25)
    _micro_batch(model, reference, 5)
    compare_full(model, reference, _parity(reference, reference_optimizer), "after an assignment behind an unshard", grads=True)


def test_unshard_before_the_forward_gathers_ahead_and_matches_reference() -> None:
    run_distributed(_unshard_before_forward, 2)


@with_collectives_alone  # counts each unit's all-gathers
def _one_f_one_b(rank: int, world_size: int) -> dict:
    """FSDP2's test_1f1b_microbatching: units kept after forward
    (SHARD_GRAD_OP), optionally unsharded ahead, gradients reduced and the
    last backward declared on the last micro-batch only."""
    gathers: dict = {}
    for explicit_unshard in (False, True):
        for reshard_after_backward in (False, True):
            model, reference, optimizer, reference_optimizer = _models(ShardingStrategy.SHARD_GRAD_OP)
            if explicit_unshard:
                for unit in _units(model):
                    unshard(unit, async_op=True)
            spy = CollectiveSpy()
            for micro in range(3):
                last = micro == 2
                set_requires_gradient_sync(model, last)
                set_is_last_backward(model, last)
                if not reshard_after_backward:
                    set_reshard_after_backward(model, last)
                _micro_batch(model, reference, micro, spies=(spy, spy))
            gathered = _gathers(spy)
            gathers[(explicit_unshard, reshard_after_backward)] = gathered
            # Kept after backward: only the first forward gathers (or none,
            # after the explicit unshard); else every forward gathers.
            expected = (0 if explicit_unshard else UNITS) + (0 if not reshard_after_backward else 2 * UNITS)
            assert gathered == expected, (explicit_unshard, reshard_after_backward, gathered)
            _optimizer_steps(model, reference, optimizer, reference_optimizer, f"1F1B {explicit_unshard} {reshard_after_backward}")
    return gathers


def test_one_f_one_b_micro_batching_matches_reference() -> None:
    run_distributed(_one_f_one_b, 2)


@with_collectives_alone  # counts each unit's all-gathers
def _reshard_between_forward_and_backward(rank: int, world_size: int) -> None:
    """FSDP2's test_manual_reshard_with_reshard_after_forward_false: units
    held for backward are resharded by hand; the backward gathers them again."""
    model, reference, optimizer, reference_optimizer = _models(ShardingStrategy.SHARD_GRAD_OP)
    inputs, targets = batch(0)
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    loss = lm_loss(model(inputs[local]), targets[local])
    for unit in _units(model):
        reshard(unit)
    assert_resharded(model)
    spy = CollectiveSpy()
    with spy.watching():
        loss.backward()
    assert _gathers(spy) == UNITS, spy.counts()
    lm_loss(reference(inputs), targets).backward()
    _optimizer_steps(model, reference, optimizer, reference_optimizer, "resharded by hand before backward")


def test_reshard_between_forward_and_backward_matches_reference() -> None:
    run_distributed(_reshard_between_forward_and_backward, 2)


@with_collectives_alone  # counts each unit's all-gathers
def _reshard_after_forward_at_run_time(rank: int, world_size: int) -> None:
    # FULL_SHARD told to keep: the backward gathers nothing.
    model, reference, optimizer, reference_optimizer = _models(ShardingStrategy.FULL_SHARD)
    set_reshard_after_forward(model, False)
    forward, backward = CollectiveSpy(), CollectiveSpy()
    _micro_batch(model, reference, 0, spies=(forward, backward))
    assert (_gathers(forward), _gathers(backward)) == (UNITS, 0), (forward.counts(), backward.counts())
    _optimizer_steps(model, reference, optimizer, reference_optimizer, "FULL_SHARD kept after forward")
    # SHARD_GRAD_OP told to reshard, the root too: the backward gathers all.
    model, reference, optimizer, reference_optimizer = _models(ShardingStrategy.SHARD_GRAD_OP)
    set_reshard_after_forward(model, True)
    forward, backward = CollectiveSpy(), CollectiveSpy()
    _micro_batch(model, reference, 1, spies=(forward, backward))
    assert (_gathers(forward), _gathers(backward)) == (UNITS, UNITS), (forward.counts(), backward.counts())
    _optimizer_steps(model, reference, optimizer, reference_optimizer, "SHARD_GRAD_OP resharded after forward")
    # Evaluation kept gathered: the second no-grad forward gathers nothing;
    # the optimizer step frees what is kept.
    set_reshard_after_forward(model, False)
    inputs, _ = batch(2)
    with torch.no_grad():
        expected = reference(inputs)
        for round_ in range(2):
            spy = CollectiveSpy()
            with spy.watching():
                output = model(inputs)
            torch.testing.assert_close(output, expected, atol=5e-6, rtol=1e-5)
            assert _gathers(spy) == (UNITS if round_ == 0 else 0), spy.counts()
    optimizer.step()
    assert_resharded(model)
    set_reshard_after_forward(model, True)
    _micro_batch(model, reference, 3)
    _optimizer_steps(model, reference, optimizer, reference_optimizer, "after evaluation")


def test_reshard_after_forward_set_at_run_time_matches_reference() -> None:
    run_distributed(_reshard_after_forward_at_run_time, 2)


# ------------------------------------------- FSDP2's unshard(): full parameters
def _expect_full(module: nn.Module, reference_module: nn.Module, parity: Parity, prefix: str, when: str, *, own: bool = False) -> None:
    """``module``'s parameters (only its unit's own with ``own``) show the
    reference's full shapes and values."""
    expected = dict(reference_module.named_parameters())
    for name, param in module.named_parameters():
        if own and name.startswith("blocks."):
            continue
        assert isinstance(param, nn.Parameter) and param.requires_grad, (when, name)
        assert param.shape == expected[name].shape, (when, name, param.shape, expected[name].shape)
        parity.slack.assert_param_close(prefix + name, param, expected[name], atol=parity.atol, rtol=parity.rtol, when=when)


def _expect_shards(module: nn.Module, when: str) -> None:
    """Every parameter shows its 1-D part (the weights are 2-D when full)."""
    shapes = {name: tuple(param.shape) for name, param in module.named_parameters()}
    assert all(len(shape) == 1 for shape in shapes.values()), (when, shapes)


@with_collectives_alone  # counts each unit's all-gathers
def _unshard_shows_full_parameters(rank: int, world_size: int) -> None:
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        model, reference, optimizer, reference_optimizer = _models(strategy)
        parity = _parity(reference, reference_optimizer)
        _micro_batch(model, reference, 0)
        _optimizer_steps(model, reference, optimizer, reference_optimizer, f"{strategy.name} before unshard")
        block, reference_block = model.blocks[1], reference.blocks[1]
        # Before the fix: blocks.1.fc_in.weight showed shape (384,), not (48, 16).
        assert unshard(block) is None
        _expect_full(block, reference_block, parity, "blocks.1.", f"{strategy.name} after unshard")
        _expect_shards(model.blocks[0], "another unit")
        # A forward while unsharded uses the gathered parameters and ends the show.
        forward, backward = CollectiveSpy(), CollectiveSpy()
        _micro_batch(model, reference, 1, spies=(forward, backward))
        assert _gathers(forward) == UNITS - 1, forward.counts()
        _expect_shards(block, "after its forward")
        _optimizer_steps(model, reference, optimizer, reference_optimizer, f"{strategy.name} forward while unsharded")
        # The async handle: full parameters once waited for.
        handle = unshard(block, async_op=True)
        assert isinstance(handle, UnshardHandle)
        handle.wait()
        _expect_full(block, reference_block, parity, "blocks.1.", f"{strategy.name} after handle.wait()")
        unshard(model)  # the root's own parameters; its blocks keep theirs
        _expect_full(model, reference, parity, "", f"{strategy.name} root after unshard", own=True)
        assert model.tok_emb.weight is model.head.weight  # a tied parameter stays tied
        _expect_full(block, reference_block, parity, "blocks.1.", f"{strategy.name} block beside the root")
        reshard(model)
        reshard(block)
        _expect_shards(model, "after reshard")
        assert_resharded(model)
        # The optimizer step and unshard_params end it too.
        unshard(block)
        optimizer.step()
        _expect_shards(block, "after optimizer.step")
        assert_resharded(model)
        unshard(block)
        with unshard_params(block, writeback=False):
            assert block.fc_in.weight.shape == reference_block.fc_in.weight.shape
        _expect_shards(block, "after unshard_params")
        assert_resharded(model)
        unshard(block)
        state = model.state_dict()  # full float32 tensors, as always
        _expect_shards(block, "after state_dict")
        assert_resharded(model)
        assert state["blocks.1.fc_in.weight"].shape == reference_block.fc_in.weight.shape
        assert state["blocks.1.fc_in.weight"].dtype is torch.float32
        # Training after it all is exact.
        _micro_batch(model, reference, 2)
        _optimizer_steps(model, reference, optimizer, reference_optimizer, f"{strategy.name} after unshard/reshard")


def test_unshard_shows_full_parameters_until_the_unit_reshards() -> None:
    run_distributed(_unshard_shows_full_parameters, 2)


def _edits_after_unshard_are_written_back(rank: int, world_size: int) -> None:
    model, reference, optimizer, reference_optimizer = _models(ShardingStrategy.FULL_SHARD)
    parity = _parity(reference, reference_optimizer)
    _micro_batch(model, reference, 0)
    _optimizer_steps(model, reference, optimizer, reference_optimizer, "before the edits")
    # In place, .data of the full shape, in place through .data: kept by reshard.
    unshard(model.blocks[0])
    with torch.no_grad():
        for module in (model, reference):
            module.blocks[0].fc_in.weight.mul_(0.5)
            module.blocks[0].fc_out.bias.data = torch.full_like(module.blocks[0].fc_out.bias.data, 0.125)
            module.blocks[0].norm.weight.data.add_(1.0)
    reshard(model.blocks[0])
    compare_full(model, reference, parity, "edits kept by reshard", grads=False)
    # Kept by the unit's forward (which uses them) and by the optimizer step.
    unshard(model.blocks[2])
    unshard(model.blocks[1])
    with torch.no_grad():
        for module in (model, reference):
            module.blocks[2].fc_in.bias.add_(0.5)
            module.blocks[1].fc_out.weight.mul_(-1.0)
    optimizer.step()  # no gradients: it changes nothing, but the unit reshards
    _micro_batch(model, reference, 1)
    _optimizer_steps(model, reference, optimizer, reference_optimizer, "edits kept by forward and step")
    # .data of another shape cannot go into the shards: refused, dropped, the model trains.
    unshard(model.blocks[1])
    model.blocks[1].fc_in.bias.data = torch.zeros(3)
    with pytest.raises(ValueError, match=r"fully_shard\(blocks\.1\): after unshard\(\), \['blocks\.1\.fc_in\.bias'\] got \.data of "
                                         r"another shape .*Edit the shown parameters in place"):
        reshard(model.blocks[1])
    _expect_shards(model.blocks[1], "after the refusal")
    assert_resharded(model)
    _micro_batch(model, reference, 2)
    _optimizer_steps(model, reference, optimizer, reference_optimizer, "after the refused edit")


def test_edits_after_unshard_reach_the_shards_and_training_stays_exact() -> None:
    run_distributed(_edits_after_unshard_are_written_back, 2)


def _mixed_precision_unshard(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    reference = copy.deepcopy(model)
    policy = MixedPrecision(param_dtype=torch.bfloat16)
    fully_shard(model[0], mixed_precision=policy)
    fully_shard(model, mixed_precision=policy)
    unshard(model[0])
    # The compute dtype's values, as FSDP2 shows them.
    assert model[0].weight.dtype is torch.bfloat16 and model[0].weight.shape == (8, 8)
    torch.testing.assert_close(model[0].weight, reference[0].weight.to(torch.bfloat16), atol=0, rtol=0)
    with torch.no_grad():
        model[0].weight[2, 3] = 0.5
        reference[0].weight[2, 3] = 0.5
    reshard(model[0])
    # The edited element is written; the others keep their float32 values.
    with unshard_params(model, writeback=False):
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, dict(reference.named_parameters())[name], atol=0, rtol=0)


def test_unshard_under_mixed_precision_shows_the_compute_dtype_and_keeps_float32_values() -> None:
    run_distributed(_mixed_precision_unshard, 2)
