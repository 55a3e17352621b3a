"""Per-unit runtime controls in training (composable_shard/controls.py):
the other controls together (prefetch lists, resharding after forward
switched per unit, ``unshard(async_op=True)`` before every forward) in
every strategy; gradient accumulation with ``set_requires_gradient_sync`` on every unit or
on some only, with ``set_reshard_after_backward(False)`` and
``set_is_last_backward(False)``, in every strategy at 4 ranks (hybrid:
2 x 2), in parity with a single-process reference that sums the
micro-batches' gradients, step by step; the collectives each micro-batch
runs are counted. Ports FSDP2's ``test_gradient_accumulation`` (its
``set_reshard_after_backward`` and ``root_only`` / ``some_mlps`` modes)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from composable_shard import (
    ShardingStrategy,
    fully_shard,
    set_is_last_backward,
    set_modules_to_backward_prefetch,
    set_modules_to_forward_prefetch,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    set_reshard_after_forward,
)
from composable_shard import unshard
from composable_shard.runtime.state import unit_states_under

from tests.support.comm_spies import CollectiveSpy, with_collectives_alone
from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT, batch, lm_loss
from tests.support.parity import Parity, assert_resharded, compare_full, hybrid_groups, plain_step, run_parity

MICRO_BATCHES = 3
UNITS = 4  # the root (embedding, norm, tied head) and three blocks


def _shard(model: nn.Module, strategy: ShardingStrategy, world_size: int) -> None:
    kwargs: dict = {"strategy": strategy}
    if strategy is ShardingStrategy.HYBRID_SHARD:
        kwargs["process_group"] = hybrid_groups(world_size)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def _set_flags(model: nn.Module, mode: str, last: bool) -> None:
    """What a training loop sets before each micro-batch (FSDP2's modes)."""
    if mode == "all":
        set_requires_gradient_sync(model, last)
        set_reshard_after_backward(model, last)
    elif mode == "some_units":  # FSDP2's "some_mlps"
        for block in model.blocks[:2]:
            set_requires_gradient_sync(block, last, recurse=False)
            set_reshard_after_backward(block, last, recurse=False)
    elif mode == "root_only":
        set_requires_gradient_sync(model, last, recurse=False)
        set_reshard_after_backward(model, last, recurse=False)
    elif mode == "not_last":  # reduce every micro-batch; no backward is told it is the last
        set_is_last_backward(model, False)


def _expected_reductions(mode: str, last: bool) -> int:
    """Flat gradients reduced in one micro-batch (one flat parameter per unit)."""
    if last or mode == "not_last":
        return UNITS
    return {"all": 0, "some_units": UNITS - 2, "root_only": UNITS - 1}[mode]


@with_collectives_alone  # counts each unit's collectives
def _accumulation(rank: int, world_size: int, strategy_name: str, modes: tuple[str, ...]) -> dict:
    strategy = ShardingStrategy[strategy_name]
    # The replica all-reduce of a hybrid unit comes on top of its reduce-scatter.
    collectives_per_reduction = 2 if strategy is ShardingStrategy.HYBRID_SHARD else 1
    gathers = strategy is not ShardingStrategy.NO_SHARD
    parity = Parity(build=TinyGPT, shard=lambda m: None, atol=5e-6, rtol=1e-5)
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    counts: dict = {}
    for mode in modes:
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        _shard(model, strategy, world_size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        for step in range(2):
            for micro in range(MICRO_BATCHES):
                last = micro == MICRO_BATCHES - 1
                _set_flags(model, mode, last)
                inputs, targets = batch(step * MICRO_BATCHES + micro)
                reference_loss = lm_loss(reference(inputs), targets)
                reference_loss.backward()
                forward_spy, backward_spy = CollectiveSpy(), CollectiveSpy()
                with forward_spy.watching():
                    loss = lm_loss(model(inputs[local]), targets[local])
                with backward_spy.watching():
                    loss.backward()
                mean_loss = loss.detach().clone()
                torch.distributed.all_reduce(mean_loss)
                torch.testing.assert_close(mean_loss / world_size, reference_loss.detach(), atol=5e-6, rtol=1e-5)
                forward, backward = forward_spy.counts(), backward_spy.counts()
                reductions = backward["reduce_scatter"] + backward["all_reduce"]
                expected = _expected_reductions(mode, last) * collectives_per_reduction
                if mode == "not_last" and micro == 0 and strategy is ShardingStrategy.HYBRID_SHARD:
                    # The replica all-reduce of the reduction left in flight
                    # runs when it finishes: in the next backward, or (the
                    # step's last) at the optimizer step, outside the spies.
                    expected -= 1
                assert reductions == expected, (mode, micro, backward)
                if mode == "not_last" and step == 0 and micro == 0:
                    # The root's reduction, the backward's last, is still in
                    # flight: its parameters have no gradient yet.
                    assert model.tok_emb.weight.grad is None and model.blocks[2].fc_in.weight.grad is not None
                if gathers and micro > 0 and mode == "all":
                    # Every unit stayed gathered after the previous backward.
                    assert forward["all_gather_into"] == 0, (strategy_name, micro, forward)
                    if strategy is ShardingStrategy.SHARD_GRAD_OP:
                        assert backward["all_gather_into"] == 0, (micro, backward)
                if gathers and micro > 0 and mode == "some_units":
                    assert forward["all_gather_into"] == UNITS - 2, (strategy_name, micro, forward)
                if not gathers:
                    assert forward["all_gather_into"] == backward["all_gather_into"] == 0
                counts.setdefault(mode, []).append(
                    (forward["all_gather_into"] + backward["all_gather_into"], reductions)
                )
                if last:
                    assert_resharded(model)
            if mode == "not_last":
                # Nothing told the tree its backward was the last: the
                # optimizer step itself finishes what is in flight.
                optimizer.step()
                reference_optimizer.step()
            else:
                compare_full(model, reference, parity, f"{strategy_name} {mode} step {step}", grads=True)
                optimizer.step()
                reference_optimizer.step()
            assert_resharded(model)
            compare_full(model, reference, parity, f"{strategy_name} {mode} step {step} after step", grads=False)
            optimizer.zero_grad(set_to_none=step % 2 == 0)
            reference_optimizer.zero_grad(set_to_none=step % 2 == 0)
    return counts


@pytest.mark.parametrize(
    "strategy, modes",
    [
        ("FULL_SHARD", ("all", "some_units", "root_only", "not_last")),
        ("SHARD_GRAD_OP", ("all", "some_units")),
        ("NO_SHARD", ("all", "some_units")),
        ("HYBRID_SHARD", ("all", "some_units", "not_last")),
    ],
)
def test_accumulation_with_per_unit_controls_matches_reference(strategy: str, modes: tuple[str, ...]) -> None:
    run_distributed(_accumulation, 4, strategy, modes)


def _shard_with_every_control(strategy: ShardingStrategy, world_size: int):
    def shard(model: nn.Module) -> None:
        _shard(model, strategy, world_size)
        blocks = list(model.blocks)
        set_modules_to_forward_prefetch(blocks[0], [blocks[1], blocks[2]])
        set_modules_to_backward_prefetch(blocks[2], [blocks[1], blocks[0]])
        set_reshard_after_forward(blocks[1], not strategy.reshards_after_forward, recurse=False)

    return shard


def _step_after_unshard(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    for _, state in unit_states_under(model):
        unshard(state.module, async_op=True)
    return plain_step(model, inputs, targets)


def _every_control(rank: int, world_size: int) -> None:
    for strategy in (
        ShardingStrategy.FULL_SHARD,
        ShardingStrategy.SHARD_GRAD_OP,
        ShardingStrategy.NO_SHARD,
        ShardingStrategy.HYBRID_SHARD,
    ):
        run_parity(
            Parity(build=TinyGPT, shard=_shard_with_every_control(strategy, world_size), steps=2, step_fn=_step_after_unshard)
        )


def test_prefetch_lists_reshard_after_forward_and_unshard_match_reference_in_every_strategy() -> None:
    run_distributed(_every_control, 4)
