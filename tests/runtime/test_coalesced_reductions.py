"""Coalesced reductions ([Note: coalesced reductions] in
composable_shard/runtime/grad_buckets.py): the gradients of small flat
parameters are reduced in buckets, one collective each, exactly the buckets
the plan replays; the result is bit for bit what reducing each alone gives,
under every strategy and with activation checkpointing, gradient
accumulation, per-unit gradient sync, mixed precision and a unit some ranks
skip; and training stays in parity with one process."""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import checkpoint

import composable_shard as cs
from composable_shard import (
    MixedPrecision,
    ShardingStrategy,
    comm,
    fully_shard,
    no_sync,
    set_may_be_skipped,
    set_requires_all_reduce,
    set_requires_gradient_sync,
)
from composable_shard.planning.step_replay import buckets_in_backward

from tests.support.comm_spies import CollectiveSpy, reduce_bucket_bytes
from tests.support.harness_pool import run_distributed
from tests.support.models import Block, TinyGPT, batch, lm_loss
from tests.support.parity import Parity, hybrid_groups, run_parity, shard_manually

N_BLOCKS, DIM = 8, 32


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(n_blocks=N_BLOCKS, dim=DIM)


# ---------------------------------------------------------------- counts
def _buckets_are_the_plans(rank: int, world_size: int) -> None:
    """Per backward, the reduce-scatters' outputs are the plan's buckets (in
    order and size) and their number is at most ceil(bytes / bucket) + 2;
    every trainable flat parameter is finished once; with buckets off, one
    reduce-scatter per flat parameter."""
    block_grad = _model().blocks[0]
    block_bytes = 4 * sum(p.numel() for p in block_grad.parameters())
    for bucket in (comm.REDUCE_BUCKET_BYTES, 5 * block_bytes // 2, 0):
        with reduce_bucket_bytes(bucket):
            model = _model()
            planned = cs.plan(model, world_size=world_size, rank=rank, policy={Block}, device="cpu")
            fully_shard(model, policy={Block})
            expected = [
                sum(fp.shard_numel for i in members for fp in planned.units[i].flat_params if fp.requires_grad)
                for members in buckets_in_backward(planned.units, bucket)
            ]
            trainable = sum(fp.requires_grad for unit in planned.units for fp in unit.flat_params)
            total = sum(fp.padded_numel * 4 for unit in planned.units for fp in unit.flat_params if fp.requires_grad)
            for step in range(2):
                inputs, targets = batch(step)
                spy = CollectiveSpy()
                with spy.watching():
                    lm_loss(model(inputs[rank::world_size]), targets[rank::world_size]).backward()
                reduced = [numel for name, numel in spy.sizes if name == "reduce_scatter"]
                assert spy.counts()["finish_grad_reduction"] == trainable, (bucket, spy.counts())
                if bucket:
                    assert reduced == expected, (bucket, step, reduced, expected)
                    assert len(reduced) <= math.ceil(total / bucket) + 2
                    assert spy.counts()["reduce_grads_together"] == len(expected)
                else:
                    assert len(reduced) == trainable and "reduce_grads_together" not in spy.counts()
                model.zero_grad()
        if bucket == comm.REDUCE_BUCKET_BYTES:
            assert len(expected) == 1, "the whole small model is one bucket"
        elif bucket:
            assert 3 <= len(expected) < trainable, expected


def test_reductions_go_in_the_plans_buckets_one_collective_each() -> None:
    run_distributed(_buckets_are_the_plans, 2)


# ---------------------------------------------------------- bit for bit
def _plain(model: nn.Module, step: int, rank: int, world_size: int) -> None:
    inputs, targets = batch(step)
    lm_loss(model(inputs[rank::world_size]), targets[rank::world_size]).backward()


def _accumulating(model: nn.Module, step: int, rank: int, world_size: int) -> None:
    """Two micro-batches, the first without gradient sync."""
    inputs, targets = batch(step, global_batch=16)
    local_inputs, local_targets = inputs[rank::world_size], targets[rank::world_size]
    half = local_inputs.shape[0] // 2
    with no_sync(model):
        lm_loss(model(local_inputs[:half]), local_targets[:half]).backward()
    lm_loss(model(local_inputs[half:]), local_targets[half:]).backward()


def _part_unsynced(model: nn.Module, step: int, rank: int, world_size: int) -> None:
    """Two micro-batches; the first syncs only the blocks of odd index."""
    inputs, targets = batch(step, global_batch=16)
    local_inputs, local_targets = inputs[rank::world_size], targets[rank::world_size]
    half = local_inputs.shape[0] // 2
    for index, block in enumerate(model.blocks):  # type: ignore[union-attr]
        set_requires_gradient_sync(block, index % 2 == 1, recurse=False)
    set_requires_gradient_sync(model, False, recurse=False)
    lm_loss(model(local_inputs[:half]), local_targets[:half]).backward()
    set_requires_gradient_sync(model, True)
    lm_loss(model(local_inputs[half:]), local_targets[half:]).backward()


def _replica_sum_kept(model: nn.Module, step: int, rank: int, world_size: int) -> None:
    """Hybrid: two micro-batches, the first keeping its partial sum instead
    of the replica all-reduce (set_requires_all_reduce(False))."""
    inputs, targets = batch(step, global_batch=16)
    local_inputs, local_targets = inputs[rank::world_size], targets[rank::world_size]
    half = local_inputs.shape[0] // 2
    set_requires_all_reduce(model, False)
    lm_loss(model(local_inputs[:half]), local_targets[:half]).backward()
    set_requires_all_reduce(model, True)
    lm_loss(model(local_inputs[half:]), local_targets[half:]).backward()


class _SkippableGPT(TinyGPT):
    """Block 3 runs only on rank 0 (as an expert some ranks skip)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for index, block in enumerate(self.blocks):
            if index != 3 or dist.get_rank() == 0:
                x = block(x)
        return self.head(self.norm(x))


def _shard(strategy: ShardingStrategy, *, ac: bool = False, skippable: bool = False, **kwargs: Any) -> Callable:
    def shard(model: nn.Module) -> None:
        for block in model.blocks:  # type: ignore[union-attr]
            if ac:
                checkpoint(block)
            fully_shard(block, strategy=strategy, **kwargs)
        fully_shard(model, strategy=strategy, **kwargs)
        if skippable:
            set_may_be_skipped(model.blocks[3])  # type: ignore[index]

    return shard


CASES: dict[str, tuple[int, Callable[[int], Callable], Callable, Callable[[], nn.Module]]] = {
    # name: (world size, shard(world_size), step, build)
    "full_shard": (2, lambda w: _shard(ShardingStrategy.FULL_SHARD), _plain, _model),
    "shard_grad_op": (2, lambda w: _shard(ShardingStrategy.SHARD_GRAD_OP), _plain, _model),
    "no_shard": (2, lambda w: _shard(ShardingStrategy.NO_SHARD), _plain, _model),
    "hybrid 2x2": (4, lambda w: _shard(ShardingStrategy.HYBRID_SHARD, process_group=hybrid_groups(w)), _plain, _model),
    "hybrid 2x2, replica sum kept": (
        4,
        lambda w: _shard(ShardingStrategy.HYBRID_SHARD, process_group=hybrid_groups(w)),
        _replica_sum_kept,
        _model,
    ),
    "activation checkpointing": (2, lambda w: _shard(ShardingStrategy.FULL_SHARD, ac=True), _plain, _model),
    "no_sync accumulation": (2, lambda w: _shard(ShardingStrategy.FULL_SHARD), _accumulating, _model),
    "part of the model unsynced": (2, lambda w: _shard(ShardingStrategy.SHARD_GRAD_OP), _part_unsynced, _model),
    "bf16, fp32 reduce": (
        2,
        lambda w: _shard(
            ShardingStrategy.FULL_SHARD,
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        ),
        _plain,
        _model,
    ),
    "bf16 reduce": (
        2,
        lambda w: _shard(ShardingStrategy.FULL_SHARD, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)),
        _plain,
        _model,
    ),
    "a unit some ranks skip": (
        2,
        lambda w: _shard(ShardingStrategy.FULL_SHARD, skippable=True),
        _plain,
        lambda: (torch.manual_seed(0), _SkippableGPT(n_blocks=N_BLOCKS, dim=DIM))[1],
    ),
}


def _train(case: str, rank: int, world_size: int, bucket: int) -> tuple[dict[str, torch.Tensor], int]:
    """Three AdamW steps of ``case`` with ``bucket``; the full parameters
    after, and how many bucketed collectives were issued."""
    _, shard, step_fn, build = CASES[case]
    with reduce_bucket_bytes(bucket):
        model = build()
        shard(world_size)(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        spy = CollectiveSpy()
        with spy.watching():
            for step in range(3):
                step_fn(model, step, rank, world_size)
                optimizer.step()
                optimizer.zero_grad()
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}, spy.counts()["reduce_grads_together"]


def _coalesced_equals_alone(rank: int, world_size: int, cases: list[str]) -> None:
    for case in cases:
        coalesced, buckets = _train(case, rank, world_size, comm.REDUCE_BUCKET_BYTES)
        alone, none = _train(case, rank, world_size, 0)
        assert buckets >= 3 and none == 0, (case, buckets, none)
        for name, tensor in alone.items():
            assert torch.equal(coalesced[name], tensor), f"{case}: {name} differs from reducing each flat parameter alone"


@pytest.mark.parametrize("world_size", [2, 4])
def test_coalesced_reductions_equal_reductions_alone_bit_for_bit(world_size: int) -> None:
    run_distributed(_coalesced_equals_alone, world_size, [case for case, (w, *_) in CASES.items() if w == world_size])


def _parity_with_buckets(rank: int, world_size: int) -> None:
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD):
        for bucket in (comm.REDUCE_BUCKET_BYTES, 3000):
            with reduce_bucket_bytes(bucket):
                run_parity(Parity(build=_model, shard=shard_manually(strategy)))


def test_coalesced_reductions_train_like_one_process() -> None:
    run_distributed(_parity_with_buckets, 2)
