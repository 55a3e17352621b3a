"""Coalesced all-gathers ([Note: coalesced all-gathers] in
composable_shard/runtime/gather_buckets.py): the all-gathers of small units
that follow each other in forward or backward share one collective, at
most ceil(bytes / bucket) + 2 per phase; the parameters each unit sees, and
so training, are bit for bit those of gathering each alone under every
strategy and with activation checkpointing, gradient accumulation,
per-unit gradient sync, mixed precision and a unit some ranks skip; what
the user ordered with prefetch lists is issued as listed; and training
stays in parity with one process."""

from __future__ import annotations

import math

import pytest
import torch

from composable_shard import (
    ShardingStrategy,
    comm,
    fully_shard,
    set_modules_to_backward_prefetch,
    set_modules_to_forward_prefetch,
)
from composable_shard.runtime.state import unit_states_under

from tests.support.coalescing import CASES, small_gpt, train_case
from tests.support.comm_spies import CollectiveSpy, gather_bucket_bytes
from tests.support.harness_pool import run_distributed
from tests.support.models import Block, LoRAGPT, batch, lm_loss
from tests.support.parity import Parity, run_parity, shard_manually


# ---------------------------------------------------------------- counts
def _phase_counts(model: torch.nn.Module, step: int, rank: int, world_size: int) -> tuple[CollectiveSpy, CollectiveSpy]:
    """The collectives of one forward and of its backward."""
    inputs, targets = batch(step)
    forward, backward = CollectiveSpy(), CollectiveSpy()
    with forward.watching():
        loss = lm_loss(model(inputs[rank::world_size]), targets[rank::world_size])
    with backward.watching():
        loss.backward()
    model.zero_grad()
    return forward, backward


def _gathers_per_phase(rank: int, world_size: int) -> None:
    """Forward (the first in the tree's order, later ones in the previous
    forward's) and backward each issue at most ceil(bytes / bucket) + 2 all-gathers; the whole
    small model is one bucket per phase at the default size; a bucket of
    4.5 blocks coalesces in several; with buckets off, one all-gather per
    unit that is not still gathered, as before."""
    block_bytes = 4 * sum(p.numel() for p in small_gpt().blocks[0].parameters())
    units = 1 + len(small_gpt().blocks)
    default = comm.GATHER_BUCKET_BYTES
    # The default holds every unit of the small model; 4.5 blocks hold 4
    # (a unit joins a bucket when it is at most a quarter of it).
    for bucket in (default, 9 * block_bytes // 2, 0):
        with gather_bucket_bytes(bucket):
            model = small_gpt()
            fully_shard(model, policy={Block})
            handles = [handle for _, state in unit_states_under(model) for handle in state.handles]
            total = sum(handle.unsharded_flat_param.numel() * 4 for handle in handles)
            for step in range(3):
                forward, backward = _phase_counts(model, step, rank, world_size)
                gathers = (forward.all_gathers_issued(), backward.all_gathers_issued())
                together = (forward.counts()["all_gather_together"], backward.counts()["all_gather_together"])
                if bucket == 0:
                    # The root stays gathered for backward, and from step 1 the last block too.
                    assert gathers == (units, units - 1 - (step > 0)) and together == (0, 0), (step, gathers)
                    continue
                bound = math.ceil(total / bucket) + 2
                assert all(count <= bound for count in gathers), (bucket, step, gathers, bound)
                assert min(together) >= 1, (bucket, step, together)
                if bucket == default:
                    assert gathers == (1, 1), ("the small model is one bucket per phase", gathers)
                else:
                    assert gathers[1] > 1, ("several buckets of 4.5 blocks", gathers)


def test_small_units_all_gathers_share_collectives_per_phase() -> None:
    run_distributed(_gathers_per_phase, 2)


def _unit_flat_params_join_together(rank: int, world_size: int) -> None:
    """A LoRA block has two flat parameters (frozen base, trainable
    adapters): both join the bucket its all-gather starts, in backward too
    (where a block's own all-gather begins the bucket), so the whole small
    model is one all-gather per phase."""
    torch.manual_seed(0)
    model = LoRAGPT(n_blocks=6)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    assert all(len(state.handles) == 2 for _, state in unit_states_under(model.blocks[0]))
    for step in range(3):
        forward, backward = _phase_counts(model, step, rank, world_size)
        gathers = (forward.all_gathers_issued(), backward.all_gathers_issued())
        assert gathers == (1, 1), (step, gathers)


def test_a_units_flat_parameters_join_its_bucket_together() -> None:
    run_distributed(_unit_flat_params_join_together, 2)


def _lone_unit_of_two_flat_params(rank: int, world_size: int) -> None:
    """A small unit of two flat parameters (frozen base, trainable adapter)
    whose neighbour is too large to join gathers both in one collective,
    with no follower; the same parameters and losses, bit for bit, as
    gathering each alone."""

    class Adapted(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = torch.nn.Linear(16, 16)
            self.adapter = torch.nn.Linear(16, 16, bias=False)
            self.base.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + self.adapter(x)

    runs = {}
    for bucket in (comm.GATHER_BUCKET_BYTES, 0):
        with gather_bucket_bytes(bucket):
            torch.manual_seed(0)
            # The root's 557 KB flat parameter is over a quarter of the bucket: gathered alone.
            model = torch.nn.Sequential(torch.nn.Linear(16, 8192), torch.nn.Linear(8192, 16), Adapted())
            fully_shard(model[2])
            fully_shard(model)
            assert [len(state.handles) for _, state in unit_states_under(model[2])] == [2]
            optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
            losses, spies = [], []
            for step in range(3):
                generator = torch.Generator().manual_seed(step)
                x = torch.randn(4 * world_size, 16, generator=generator)[rank::world_size]
                spy = CollectiveSpy()
                with spy.watching():
                    loss = model(x).square().mean()
                spies.append(spy)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.detach())
            runs[bucket] = (losses, [p.detach().clone() for p in model.parameters()], spies)
    (losses, params, spies), (losses_alone, params_alone, spies_alone) = runs.values()
    for spy, spy_alone in zip(spies, spies_alone):
        # Forward: the root's own, then the unit's two flat parameters in one.
        assert (spy.all_gathers_issued(), spy.counts()["all_gather_together"]) == (2, 1), spy.counts()
        assert (spy_alone.all_gathers_issued(), spy_alone.counts()["all_gather_together"]) == (3, 0)
    assert all(torch.equal(a, b) for a, b in zip(losses, losses_alone))
    assert all(torch.equal(a, b) for a, b in zip(params, params_alone))


def test_a_lone_unit_gathers_its_flat_parameters_in_one_collective() -> None:
    run_distributed(_lone_unit_of_two_flat_params, 2)


# ---------------------------------------------------------- bit for bit
def _coalesced_equals_alone(rank: int, world_size: int, cases: list[str]) -> None:
    """Both runs bucket their reductions (the default); only the
    all-gathers differ."""
    reduce_bucket = comm.REDUCE_BUCKET_BYTES
    block_bytes = 4 * sum(p.numel() for p in small_gpt().blocks[0].parameters())
    for case in cases:
        # Buckets of 4.5 blocks: several per phase, each of several units.
        bucket = 9 * block_bytes // 2
        coalesced, spy = train_case(case, rank, world_size, reduce_bucket=reduce_bucket, gather_bucket=bucket)
        alone, spy_alone = train_case(case, rank, world_size, reduce_bucket=reduce_bucket, gather_bucket=0)
        sharded = case != "no_shard"
        assert (spy.counts()["all_gather_together"] >= 3) == sharded, (case, spy.counts())
        assert spy_alone.counts()["all_gather_together"] == 0
        if sharded:
            assert spy.all_gathers_issued() < spy_alone.all_gathers_issued(), case
        for name, tensor in alone.items():
            assert torch.equal(coalesced[name], tensor), f"{case}: {name} differs from gathering each unit alone"


@pytest.mark.parametrize("world_size", [2, 4])
def test_coalesced_all_gathers_equal_all_gathers_alone_bit_for_bit(world_size: int) -> None:
    run_distributed(_coalesced_equals_alone, world_size, [case for case, (w, *_) in CASES.items() if w == world_size])


# ------------------------------------------------- what the user ordered
def _lists_are_not_coalesced(rank: int, world_size: int) -> None:
    """With prefetch lists on some blocks nothing is coalesced (the lists'
    order is issued as it is: tests/controls/test_explicit_prefetch.py),
    and training matches one process."""

    def shard(model: torch.nn.Module) -> None:
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(model)
        blocks = list(model.blocks)  # type: ignore[union-attr]
        set_modules_to_forward_prefetch(blocks[0], [blocks[2], blocks[1]])
        set_modules_to_backward_prefetch(blocks[-1], [blocks[-3]])

    model = small_gpt()
    shard(model)
    for step in range(2):
        forward, backward = _phase_counts(model, step, rank, world_size)
        assert forward.counts()["all_gather_together"] == backward.counts()["all_gather_together"] == 0
    run_parity(Parity(build=small_gpt, shard=shard))


def test_prefetch_lists_are_issued_as_listed_not_coalesced() -> None:
    run_distributed(_lists_are_not_coalesced, 2)


# ---------------------------------------------------------------- parity
def _parity_with_buckets(rank: int, world_size: int) -> None:
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        for bucket in (comm.GATHER_BUCKET_BYTES, 58000):  # the whole model, 4.5 blocks
            with gather_bucket_bytes(bucket):
                run_parity(Parity(build=small_gpt, shard=shard_manually(strategy)))


def test_coalesced_all_gathers_train_like_one_process() -> None:
    run_distributed(_parity_with_buckets, 2)
