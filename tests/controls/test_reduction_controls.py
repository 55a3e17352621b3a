"""The per-unit reduction controls: ``set_requires_all_reduce`` (hybrid
accumulation with one replica all-reduce per unit per step, on every unit
or some only), ``set_gradient_divide_factor`` (1.0 with a loss scaled by
the world size, every strategy) and ``set_all_reduce_hook`` (FSDP2's
custom HSDP all-reduce hook test, ported) — parity with a single-process
reference, step by step; a spy on ``composable_shard.comm`` counts the
collectives."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from composable_shard import (
    ShardingStrategy,
    fully_shard,
    set_all_reduce_hook,
    set_gradient_divide_factor,
    set_requires_all_reduce,
    unshard_params,
)
from composable_shard.comm.reduction import predivide_factor
from composable_shard.runtime.state import unit_states_under

from tests.support.comm_spies import CollectiveSpy, with_reductions_alone
from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT, batch, lm_loss
from tests.support.parity import Parity, assert_resharded, compare_full, hybrid_groups, run_parity, shard_manually


def _trainable_handles(model: nn.Module, names: set[str] | None = None) -> int:
    return sum(
        len(state.trainable_handles) for name, state in unit_states_under(model) if names is None or name in names
    )


@with_reductions_alone  # counts reductions per flat parameter
def _hybrid_accumulation(rank: int, world_size: int) -> None:
    """k micro-batches per step, the replica all-reduce only on the last:
    on every unit, or (FSDP2's "some modules" case) skipped on blocks.0
    only. Every micro-batch reduce-scatters; the all-reduces of a step are
    one per unit; an all-reduce hook runs with them only."""
    shard_group, replicate_group = hybrid_groups(world_size)
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    micro_batches = 3
    cases = [(ShardingStrategy.HYBRID_SHARD, None), (ShardingStrategy.HYBRID_SHARD_ZERO2, None),
             (ShardingStrategy.HYBRID_SHARD, "blocks.0"), (ShardingStrategy.NO_SHARD, None)]
    for strategy, only in cases:
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        groups = {} if strategy is ShardingStrategy.NO_SHARD else {"process_group": (shard_group, replicate_group)}
        shard_manually(strategy, **groups)(model)
        hook_calls: list[int] = []
        for _, state in unit_states_under(model):
            set_all_reduce_hook(state.module, lambda shard: hook_calls.append(shard.numel()))
        grad_hook_calls: list[int] = []  # a user's hook sees a gradient only when .grad gets one
        model.blocks[0].fc_in.weight.register_post_accumulate_grad_hook(lambda p: grad_hook_calls.append(1))
        skipping = model if only is None else model.get_submodule(only)
        skipped_handles = _trainable_handles(model, None if only is None else {only})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        parity = Parity(build=TinyGPT, shard=lambda m: None, atol=5e-6, rtol=1e-5)
        for step in range(2):
            for micro in range(micro_batches):
                last = micro == micro_batches - 1
                inputs, targets = batch(step * micro_batches + micro)
                lm_loss(reference(inputs), targets).backward()
                set_requires_all_reduce(skipping, last, recurse=only is None)
                spy = CollectiveSpy()
                hook_calls.clear()
                with spy.watching():
                    lm_loss(model(inputs[local]), targets[local]).backward()
                counts = spy.counts()
                all_reduces = _trainable_handles(model) - (0 if last else skipped_handles)
                assert counts["all_reduce"] == all_reduces, (strategy.name, only, micro, counts)
                assert len(hook_calls) == all_reduces, (strategy.name, only, micro, len(hook_calls))
                if strategy is not ShardingStrategy.NO_SHARD:
                    assert counts["reduce_scatter"] == _trainable_handles(model), (strategy.name, micro, counts)
                if not last and only is None:
                    assert all(p.grad is None for p in model.parameters()), "a skipped all-reduce exposed a gradient"
                assert len(grad_hook_calls) == (1 if last else 0), (strategy.name, only, micro, grad_hook_calls)
                grad_hook_calls.clear()
                assert_resharded(model)
            compare_full(model, reference, parity, f"{strategy.name} ({only}) step {step}", grads=True)
            optimizer.step()
            reference_optimizer.step()
            optimizer.zero_grad()
            reference_optimizer.zero_grad()
            compare_full(model, reference, parity, f"{strategy.name} ({only}) step {step} after step", grads=False)
        # A forward that raised resets the tree: the kept partial sums are
        # dropped with the other local gradients ([Note: a backward that raised]).
        set_requires_all_reduce(model, False)
        lm_loss(model(inputs[local]), targets[local]).backward()
        assert all(h.partial_reduced_grad is not None for _, s in unit_states_under(model) for h in s.trainable_handles)
        with pytest.raises(IndexError):
            model(inputs[local] + 1000)  # out of the vocabulary
        assert all(h.partial_reduced_grad is None for _, s in unit_states_under(model) for h in s.handles)


def test_hybrid_all_reduces_once_per_unit_per_step() -> None:
    run_distributed(_hybrid_accumulation, 4)


def _scaled_loss_step(world_size: int):
    def step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model(inputs), targets)
        (loss / world_size).backward()  # the sum over ranks is then the mean
        return loss.detach()

    return step


def _every_unit_divides_by_one(strategy: ShardingStrategy, **kwargs: object):
    def shard(model: nn.Module) -> None:
        shard_manually(strategy, **kwargs)(model)
        for _, state in unit_states_under(model):
            set_gradient_divide_factor(state.module, 1.0)  # each unit, as torchtitan does

    return shard


def _divide_factor_one(rank: int, world_size: int) -> None:
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        run_parity(Parity(build=TinyGPT, shard=_every_unit_divides_by_one(strategy), steps=2,
                          step_fn=_scaled_loss_step(world_size)))
    shard_group, replicate_group = hybrid_groups(world_size)
    run_parity(Parity(build=TinyGPT, steps=2, step_fn=_scaled_loss_step(world_size),
                      shard=_every_unit_divides_by_one(ShardingStrategy.HYBRID_SHARD,
                                                       process_group=(shard_group, replicate_group))))


def test_divide_factor_one_with_a_loss_scaled_by_the_world_size() -> None:
    run_distributed(_divide_factor_one, 4)


def test_low_precision_divide_factor_splits_around_the_sum() -> None:
    # A factor of 1 divides by nothing; others split as the world size does.
    assert predivide_factor(torch.bfloat16, 1.0) == 1.0
    assert predivide_factor(torch.float16, 16.0) == 4.0
    assert predivide_factor(torch.float32, 16.0) == 1.0


class _MLP(nn.Module):
    """FSDP2's MLP(10, bias=False): in_proj 10 -> 40, out_proj 40 -> 10."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(10, 40, bias=False)
        self.out_proj = nn.Linear(40, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.out_proj(F.relu(self.in_proj(x))))


def _custom_hsdp_all_reduce_hook(rank: int, world_size: int) -> None:
    """Port of FSDP2's test_custom_hsdp_all_reduce_hook: FULL_SHARD within
    pairs of ranks, the hook averages across the pairs (what a hybrid
    all-reduce would do); replica 0's weights are 0, so its gradient is 0
    and the average halves replica 1's."""
    intra = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    inter = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    model = _MLP()
    nn.init.constant_(model.in_proj.weight, 1.0 * (rank // 2))
    nn.init.constant_(model.out_proj.weight, 2.0 * (rank // 2))
    fully_shard(model, process_group=intra)
    hook_called = []

    def custom_hook(output: torch.Tensor) -> None:
        dist.all_reduce(output, group=inter)
        output.div_(dist.get_world_size(inter))  # gloo has no ReduceOp.AVG
        hook_called.append(True)

    set_all_reduce_hook(model, custom_hook)
    model(torch.arange(10, dtype=torch.float32).view(1, 10)).sum().backward()
    assert hook_called == [True]
    with unshard_params(model, with_grads=True, writeback=False):
        torch.testing.assert_close(model.out_proj.weight.grad, torch.full((10, 40), 22.5))
        torch.testing.assert_close(model.in_proj.weight.grad, torch.arange(0, 100, 10, dtype=torch.float32).repeat(40, 1))
    # Under native HSDP the hook runs after the replica all-reduce, and a
    # stream for it is refused, as in FSDP2.
    shard_group, replicate_group = hybrid_groups(world_size)
    hybrid = fully_shard(_MLP(), strategy=ShardingStrategy.HYBRID_SHARD, process_group=(shard_group, replicate_group))
    with pytest.raises(ValueError, match=r"set_all_reduce_hook\(_MLP\): stream cannot be set when using native HSDP"):
        set_all_reduce_hook(hybrid, custom_hook, stream=object())
    with pytest.raises(ValueError, match=r"set_all_reduce_hook\(Linear\): no module itself was given to fully_shard"):
        set_all_reduce_hook(hybrid.in_proj, custom_hook)


def test_custom_hsdp_all_reduce_hook() -> None:
    run_distributed(_custom_hsdp_all_reduce_hook, 4)


def _bad_arguments_raise_at_once(rank: int, world_size: int) -> None:
    model = fully_shard(TinyGPT())
    with pytest.raises(ValueError, match=r"set_gradient_divide_factor\(TinyGPT\): factor must be finite and positive"):
        set_gradient_divide_factor(model, 0.0)
    with pytest.raises(TypeError, match=r"set_requires_all_reduce\(TinyGPT\): requires must be a bool"):
        set_requires_all_reduce(model, "no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"set_requires_all_reduce\(Linear\): no module in this tree"):
        set_requires_all_reduce(nn.Linear(2, 2), False)
    # The model still trains after the refused calls (FULL_SHARD: no effect).
    set_requires_all_reduce(model, False)
    inputs, targets = batch(0)
    lm_loss(model(inputs), targets).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_bad_arguments_raise_at_once_naming_the_module() -> None:
    run_distributed(_bad_arguments_raise_at_once, 2)
