"""Training parity of every sharding strategy and unit-selection form against
a single-process reference on the global batch, step by step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import (
    CustomPolicy,
    ModuleWrapPolicy,
    ShardingStrategy,
    SizeBasedPolicy,
    fully_shard,
    is_fully_sharded,
)

from tests.support.harness_pool import run_distributed
from tests.support.models import Block, TinyGPT
from tests.support.parity import Parity, hybrid_groups, run_parity, shard_manually


def _strategies_match_reference(rank: int, world_size: int) -> None:
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        run_parity(Parity(build=TinyGPT, shard=shard_manually(strategy)))
    for strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2):
        shard_group, replicate_group = hybrid_groups(world_size)
        run_parity(Parity(build=TinyGPT, shard=shard_manually(strategy, process_group=(shard_group, replicate_group))))


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_strategy_matches_single_process_training(world_size: int) -> None:
    run_distributed(_strategies_match_reference, world_size)


def _hybrid_mesh_matches_reference(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    run_parity(Parity(build=TinyGPT, shard=shard_manually(ShardingStrategy.HYBRID_SHARD, device_mesh=mesh)))
    mesh_1d = init_device_mesh("cpu", (world_size,))
    run_parity(Parity(build=TinyGPT, shard=shard_manually(ShardingStrategy.FULL_SHARD, device_mesh=mesh_1d)))


def test_hybrid_shard_over_a_2d_device_mesh_matches_reference() -> None:
    run_distributed(_hybrid_mesh_matches_reference, 4)


def _hybrid_shard_is_sharded_within_and_replicated_across(rank: int, world_size: int) -> None:
    shard_group, replicate_group = hybrid_groups(world_size)
    torch.manual_seed(0)
    model = TinyGPT()
    numels = {name: p.numel() for name, p in model.named_parameters()}
    fully_shard(model, strategy=ShardingStrategy.HYBRID_SHARD, process_group=(shard_group, replicate_group))
    for name, param in model.named_parameters():
        local = torch.tensor([param.numel()])
        dist.all_reduce(local, group=shard_group)
        assert local.item() == numels[name], (name, local.item(), numels[name])
        gathered = [torch.empty_like(param.detach()) for _ in range(dist.get_world_size(replicate_group))]
        dist.all_gather(gathered, param.detach().contiguous(), group=replicate_group)
        assert all(torch.equal(g, gathered[0]) for g in gathered), name


def test_hybrid_shard_keeps_one_copy_per_replica() -> None:
    run_distributed(_hybrid_shard_is_sharded_within_and_replicated_across, 4)


def _policies_match_reference(rank: int, world_size: int) -> None:
    def by_wrap_policy(model: nn.Module) -> None:
        fully_shard(model, policy=ModuleWrapPolicy({Block}))
        assert all(is_fully_sharded(block) for block in model.blocks)

    def by_class_set(model: nn.Module) -> None:
        fully_shard(model, policy={Block})
        assert all(is_fully_sharded(block) for block in model.blocks)

    def by_size(model: nn.Module) -> None:
        fully_shard(model, policy=SizeBasedPolicy(min_num_params=1000))
        assert all(is_fully_sharded(block) for block in model.blocks)
        assert not is_fully_sharded(model.blocks[0].fc_in)  # 816 parameters: below the threshold

    def by_custom_with_overrides(model: nn.Module) -> None:
        def decide(module: nn.Module) -> bool | dict:
            if isinstance(module, nn.LayerNorm):
                return {"strategy": ShardingStrategy.NO_SHARD}
            return isinstance(module, Block)

        fully_shard(model, policy=CustomPolicy(decide))
        from composable_shard.runtime.state import get_state

        norm_state = get_state(model.blocks[0].norm)
        assert norm_state is not None and norm_state.config.strategy is ShardingStrategy.NO_SHARD
        assert model.blocks[0].norm.weight.numel() == model.blocks[0].norm.weight.shape[0] == 16

    def manual_blocks_then_root_policy(model: nn.Module) -> None:
        fully_shard(model.blocks[0])
        fully_shard(model, policy={Block})
        assert all(is_fully_sharded(block) for block in model.blocks)

    for shard in (by_wrap_policy, by_class_set, by_size, by_custom_with_overrides, manual_blocks_then_root_policy):
        run_parity(Parity(build=TinyGPT, shard=shard))


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_policy_form_matches_single_process_training(world_size: int) -> None:
    run_distributed(_policies_match_reference, world_size)


def _prefetch_options_match_reference(rank: int, world_size: int) -> None:
    from composable_shard import BackwardPrefetch

    for kwargs in (
        dict(forward_prefetch=True),
        dict(backward_prefetch=BackwardPrefetch.BACKWARD_POST),
        dict(backward_prefetch=None, limit_all_gathers=False),
        dict(forward_prefetch=True, limit_all_gathers=False),
    ):
        run_parity(Parity(build=TinyGPT, shard=shard_manually(ShardingStrategy.FULL_SHARD, **kwargs), steps=3))


@pytest.mark.parametrize("world_size", [2])
def test_prefetch_options_match_single_process_training(world_size: int) -> None:
    run_distributed(_prefetch_options_match_reference, world_size)


class _ReorderingGPT(TinyGPT):
    """Runs its blocks in reverse order on odd steps (forward order changes)."""

    reverse = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for block in reversed(self.blocks) if self.reverse else self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _changing_order_matches_reference(rank: int, world_size: int) -> None:
    from tests.support.parity import plain_step

    def step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        model.reverse = not model.reverse
        return plain_step(model, inputs, targets)

    run_parity(
        Parity(
            build=_ReorderingGPT,
            shard=shard_manually(ShardingStrategy.FULL_SHARD, forward_prefetch=True),
            step_fn=step,
            reference_step_fn=step,
            steps=4,
        )
    )


def test_forward_order_change_between_iterations_stays_correct() -> None:
    run_distributed(_changing_order_matches_reference, 2)


def _sharding_at_world_size_one_matches_reference(rank: int, world_size: int) -> None:
    run_parity(Parity(build=TinyGPT, shard=shard_manually(ShardingStrategy.FULL_SHARD)))


def test_world_size_one_matches_reference() -> None:
    run_distributed(_sharding_at_world_size_one_matches_reference, 1)
