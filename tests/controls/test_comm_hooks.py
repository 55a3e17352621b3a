"""``register_comm_hook`` (FSDP1's contract) and the shipped hooks: the
default-equivalent hooks give exactly the default result; the bf16 / fp16
compression hooks match a reference that rounds each rank's gradient the
same way; a hook that raises fails the step with its own error and the
next steps train in parity; combinations a hook cannot honour are refused
at the next backward, naming the unit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import (
    MixedPrecision,
    ShardingStrategy,
    comm_hooks,
    describe,
    fully_shard,
    register_comm_hook,
    set_gradient_divide_factor,
    unshard_params,
)
from composable_shard.runtime.state import unit_states_under

from tests.support.harness_pool import run_distributed
from tests.support.models import Block, TinyGPT, batch, lm_loss
from tests.support.parity import Parity, compare_full, hybrid_groups, shard_manually, step_and_compare

STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD)


def _default_hook(strategy: ShardingStrategy):
    return comm_hooks.allreduce_hook if strategy is ShardingStrategy.NO_SHARD else comm_hooks.reduce_scatter_hook


def _local(rank: int, world_size: int) -> slice:
    return slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)


def _default_hooks_give_the_default_result(rank: int, world_size: int) -> None:
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        plain = TinyGPT()
        hooked = copy.deepcopy(plain)
        shard_manually(strategy)(plain)
        shard_manually(strategy)(hooked)
        register_comm_hook(hooked, comm_hooks.DefaultState(), _default_hook(strategy))
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, hooked)]
        for step in range(2):
            inputs, targets = batch(step)
            for model in (plain, hooked):
                lm_loss(model(inputs[_local(rank, world_size)]), targets[_local(rank, world_size)]).backward()
            for (name, a), b in zip(plain.named_parameters(), hooked.parameters()):
                # Powers of two divide exactly: the same bits, split or not.
                assert torch.equal(a.grad, b.grad), (strategy.name, step, name, (a.grad - b.grad).abs().max())
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()


@pytest.mark.parametrize("world_size", [2, 4])
def test_default_equivalent_hook_gives_exactly_the_default_result(world_size: int) -> None:
    run_distributed(_default_hooks_give_the_default_result, world_size)


def _per_rank_grads(reference: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, world_size: int) -> list[dict]:
    grads = []
    for rank in range(world_size):
        reference.zero_grad()
        local = _local(rank, world_size)
        lm_loss(reference(inputs[local]), targets[local]).backward()
        grads.append({name: p.grad.clone() for name, p in reference.named_parameters()})
    reference.zero_grad()
    return grads


def _compressed_mean(grads: list[dict], name: str, dtype: torch.dtype, world_size: int) -> torch.Tensor:
    """What the compression hook computes: each rank's gradient rounded to
    ``dtype`` and pre-divided, summed in ``dtype``, post-divided there."""
    state_predivide = 2.0  # FSDP1's split for 2 ranks: 2 before, 1 after
    total = grads[0][name].to(dtype) / state_predivide
    for rank_grads in grads[1:]:
        total = total + rank_grads[name].to(dtype) / state_predivide
    return (total / (world_size / state_predivide)).to(torch.float32)


def _compression_matches_rounded_reference(rank: int, world_size: int) -> None:
    hooks = {torch.bfloat16: comm_hooks.bf16_compress_hook, torch.float16: comm_hooks.fp16_compress_hook}
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD):
        for dtype, hook in hooks.items():
            torch.manual_seed(0)
            model = TinyGPT()
            reference = copy.deepcopy(model)
            shard_manually(strategy)(model)
            register_comm_hook(model, comm_hooks.LowPrecisionState(), hook)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
            parity = Parity(build=TinyGPT, shard=lambda m: None, atol=0.0, rtol=0.0)
            for step in range(2):
                inputs, targets = batch(step)
                per_rank = _per_rank_grads(reference, inputs, targets, world_size)
                for name, param in reference.named_parameters():
                    param.grad = _compressed_mean(per_rank, name, dtype, world_size)
                    full_precision = sum(g[name] for g in per_rank) / world_size
                    if name == "blocks.0.fc_in.weight":  # the rounding is visible: the test can tell
                        assert not torch.equal(param.grad, full_precision), (dtype, step)
                local = _local(rank, world_size)
                lm_loss(model(inputs[local]), targets[local]).backward()
                compare_full(model, reference, parity, f"{strategy.name} {dtype} step {step}", grads=True)
                optimizer.step()
                reference_optimizer.step()
                optimizer.zero_grad()
                reference_optimizer.zero_grad()


def test_compression_hooks_match_a_reference_rounding_the_same_way() -> None:
    run_distributed(_compression_matches_rounded_reference, 2)


class _HookFailure(RuntimeError):
    pass


def _failing_hook_then_parity(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    shard_manually(ShardingStrategy.FULL_SHARD)(model)
    armed = [True]

    def hook(state: comm_hooks.DefaultState, grad: torch.Tensor, output: torch.Tensor) -> None:
        if armed[0]:
            armed[0] = False
            raise _HookFailure("the hook failed on purpose")
        comm_hooks.reduce_scatter_hook(state, grad, output)

    register_comm_hook(model, comm_hooks.DefaultState(), hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    parity = Parity(build=TinyGPT, shard=lambda m: None, atol=5e-6, rtol=1e-5, reference_optimizer=reference_optimizer)
    local = _local(rank, world_size)
    inputs, targets = batch(0)
    with pytest.raises(_HookFailure, match="the hook failed on purpose") as raised:
        lm_loss(model(inputs[local]), targets[local]).backward()
    assert any("issued its gradient reduction" in note for note in getattr(raised.value, "__notes__", [])), raised.value
    optimizer.zero_grad()
    # A combination the hook cannot honour: refused at the next backward, naming the unit.
    set_gradient_divide_factor(model.blocks[2], 1.0)
    with pytest.raises(ValueError, match=r"unit 'blocks.2' \(Block\): its communication hook \(hook\) does the whole gradient "
                                         r"reduction, which cannot combine with set_gradient_divide_factor\(1.0\)"):
        lm_loss(model(inputs[local]), targets[local]).backward()
    set_gradient_divide_factor(model.blocks[2], None)
    optimizer.zero_grad()
    for step in range(1, 3):  # the model is usable: the next steps train in parity
        inputs, targets = batch(step)
        lm_loss(reference(inputs), targets).backward()
        lm_loss(model(inputs[local]), targets[local]).backward()
        compare_full(model, reference, parity, f"step {step}", grads=True)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        compare_full(model, reference, parity, f"step {step} after step", grads=False)


def test_a_hook_that_raises_fails_the_step_and_leaves_the_model_usable() -> None:
    run_distributed(_failing_hook_then_parity, 2)


def _registration_refusals(rank: int, world_size: int) -> None:
    model = fully_shard(TinyGPT())
    with pytest.raises(TypeError, match=r"register_comm_hook\(TinyGPT\): hook must be callable"):
        register_comm_hook(model, None, "allreduce")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"register_comm_hook\(Linear\): no module in this tree"):
        register_comm_hook(nn.Linear(2, 2), None, comm_hooks.allreduce_hook)
    register_comm_hook(model, comm_hooks.DefaultState(), comm_hooks.reduce_scatter_hook)
    with pytest.raises(ValueError, match=r"unit 'TinyGPT' already has a communication hook \(reduce_scatter_hook\)"):
        register_comm_hook(model, comm_hooks.DefaultState(), comm_hooks.bf16_compress_hook)
    # Before the first forward a unit below the module is named by its path from it, not by its class.
    blocks_hooked = TinyGPT()
    fully_shard(blocks_hooked, policy={Block})
    register_comm_hook(blocks_hooked.blocks[1], comm_hooks.DefaultState(), comm_hooks.reduce_scatter_hook)
    with pytest.raises(ValueError, match=r"register_comm_hook\(TinyGPT\): unit 'blocks.1' already has a communication"):
        register_comm_hook(blocks_hooked, comm_hooks.DefaultState(), comm_hooks.bf16_compress_hook)
    shard_group, replicate_group = hybrid_groups(world_size)
    hybrid = fully_shard(TinyGPT(), strategy=ShardingStrategy.HYBRID_SHARD, process_group=(shard_group, replicate_group))
    with pytest.raises(ValueError, match=r"register_comm_hook\(TinyGPT\): unit 'TinyGPT' uses HYBRID_SHARD"):
        register_comm_hook(hybrid, comm_hooks.DefaultState(), comm_hooks.reduce_scatter_hook)
    # A state over a group of another size than the unit's shard group.
    solo = None
    for group_rank in range(world_size):  # every rank creates every group
        group = dist.new_group([group_rank])
        if group_rank == rank:
            solo = group
    sharded = fully_shard(nn.Linear(4, 4))
    register_comm_hook(sharded, comm_hooks.DefaultState(solo), comm_hooks.reduce_scatter_hook)
    with pytest.raises(ValueError, match="the state's process group has 1 ranks but the gradient is split for 2"):
        sharded(torch.ones(2, 4)).sum().backward()
    # A mixed-precision reduce dtype the hook would silently ignore: refused at backward.
    mixed = fully_shard(nn.Linear(4, 4), mixed_precision=MixedPrecision(reduce_dtype=torch.bfloat16))
    register_comm_hook(mixed, comm_hooks.DefaultState(), comm_hooks.reduce_scatter_hook)
    refused = r"unit '<root>' \(Linear\): .*cannot combine with a mixed-precision reduce_dtype of torch.bfloat16"
    with pytest.raises(ValueError, match=refused):
        mixed(torch.ones(2, 4)).sum().backward()
    assert comm_hooks.hook_reduce_dtype(comm_hooks.bf16_compress_hook) is torch.bfloat16
    assert comm_hooks.hook_reduce_dtype(comm_hooks.reduce_scatter_hook) is None
    # The plan counts the compression buffers as a bf16 reduction.
    compressed = fully_shard(nn.Linear(4, 4))
    assert describe(compressed).units[0].flat_params[0].reduce_dtype is torch.float32
    register_comm_hook(compressed, comm_hooks.LowPrecisionState(), comm_hooks.bf16_compress_hook)
    assert describe(compressed).units[0].flat_params[0].reduce_dtype is torch.bfloat16


def test_registration_refuses_bad_arguments_at_once() -> None:
    run_distributed(_registration_refusals, 2)


def _unshard_params_sees_hooked_grads(rank: int, world_size: int) -> None:
    # The hooked gradient is this rank's shard of the mean: unshard_params
    # gathers the same full gradient on every rank.
    model = fully_shard(nn.Linear(4, 3))
    register_comm_hook(model, comm_hooks.DefaultState(), comm_hooks.reduce_scatter_hook)
    model(torch.full((1, 4), float(rank + 1))).sum().backward()
    with unshard_params(model, with_grads=True, writeback=False):
        torch.testing.assert_close(model.weight.grad, torch.full((3, 4), 1.5))
    assert [state.reduction_overrides.comm_hook is not None for _, state in unit_states_under(model)] == [True]


def test_hooked_gradient_is_the_shard_of_the_mean() -> None:
    run_distributed(_unshard_params_sees_hooked_grads, 2)


def _none_state_means_each_units_own_group(rank: int, world_size: int) -> None:
    # Before the fix, state=None reached the hook and backward failed with
    # "'NoneType' object has no attribute 'world_size'".
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD):
        torch.manual_seed(0)
        plain = TinyGPT()
        hooked = copy.deepcopy(plain)
        shard_manually(strategy)(plain)
        shard_manually(strategy)(hooked)
        register_comm_hook(hooked, None, _default_hook(strategy))
        states = [state.reduction_overrides.comm_hook[0] for _, state in unit_states_under(hooked)]
        assert all(isinstance(state, comm_hooks.DefaultState) and state.world_size == world_size for state in states)
        optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, hooked)]
        for step in range(2):
            inputs, targets = batch(step)
            for model in (plain, hooked):
                lm_loss(model(inputs[_local(rank, world_size)]), targets[_local(rank, world_size)]).backward()
            for (name, a), b in zip(plain.named_parameters(), hooked.parameters()):
                assert torch.equal(a.grad, b.grad), (strategy.name, step, name)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    # A unit sharded over a subgroup: None means that group, not the world
    # (a state over the world would be refused inside backward: 4 ranks vs 2).
    pair = None
    for start in range(0, world_size, 2):
        group = dist.new_group([start, start + 1])
        if rank in (start, start + 1):
            pair = group
    sub = fully_shard(nn.Linear(4, 3), process_group=pair)
    register_comm_hook(sub, None, comm_hooks.bf16_compress_hook)
    sub(torch.full((1, 4), float(rank + 1))).sum().backward()
    pair_mean = float((rank - rank % 2) + 1.5)  # inputs rank+1 of the two ranks of the pair
    with unshard_params(sub, with_grads=True, writeback=False):
        torch.testing.assert_close(sub.weight.grad, torch.full((3, 4), pair_mean))
    # A user's own hook gets None as given.
    seen: list[object] = []

    def own_hook(state: object, grad: torch.Tensor, output: torch.Tensor) -> None:
        seen.append(state)
        comm_hooks.reduce_scatter_hook(comm_hooks.DefaultState(), grad, output)

    own = fully_shard(nn.Linear(4, 3))
    register_comm_hook(own, None, own_hook)
    own(torch.ones(1, 4)).sum().backward()
    assert seen == [None]


def test_comm_hook_with_none_state_reduces_over_each_units_own_group() -> None:
    run_distributed(_none_state_means_each_units_own_group, 4)


def _none_or_wrong_state_refused_then_trains(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    shard_manually(ShardingStrategy.FULL_SHARD)(model)
    with pytest.raises(TypeError, match=r"register_comm_hook\(TinyGPT\): reduce_scatter_hook reads a "
                                        r"composable_shard.comm_hooks.DefaultState .*got ProcessGroup.*or None for each unit's own group"):
        register_comm_hook(model, dist.group.WORLD, comm_hooks.reduce_scatter_hook)
    # NO_SHARD over one rank: no group for None to name.
    solo = None
    for group_rank in range(world_size):  # every rank creates every group
        group = dist.new_group([group_rank])
        if group_rank == rank:
            solo = group
    alone = fully_shard(nn.Linear(4, 4), strategy=ShardingStrategy.NO_SHARD, process_group=solo)
    with pytest.raises(ValueError, match=r"register_comm_hook\(Linear\): unit '.*' has no group to reduce its gradient "
                                         r"over .*Pass DefaultState\(process_group\)"):
        register_comm_hook(alone, None, comm_hooks.allreduce_hook)
    assert all(state.reduction_overrides.comm_hook is None for _, state in unit_states_under(model))
    # Nothing was registered: the model trains in parity, then with the hook.
    register_comm_hook(model, None, comm_hooks.reduce_scatter_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    parity = Parity(build=TinyGPT, shard=lambda m: None, reference_optimizer=reference_optimizer)
    local = _local(rank, world_size)
    for step in range(2):
        inputs, targets = batch(step)
        lm_loss(reference(inputs), targets).backward()
        lm_loss(model(inputs[local]), targets[local]).backward()
        step_and_compare(model, reference, (optimizer, reference_optimizer), parity, f"step {step}")


def test_comm_hook_wrong_state_refused_at_registration_and_model_trains() -> None:
    run_distributed(_none_or_wrong_state_refused_then_trains, 2)
