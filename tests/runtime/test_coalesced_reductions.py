"""Coalesced reductions ([Note: coalesced reductions] in
composable_shard/runtime/grad_buckets.py): the gradients of small flat
parameters are reduced in buckets, one collective each, exactly the buckets
the plan replays; the result is bit for bit what reducing each alone gives,
under every strategy and with activation checkpointing, gradient
accumulation, per-unit gradient sync, mixed precision and a unit some ranks
skip; and training stays in parity with one process."""

from __future__ import annotations

import math

import pytest
import torch

import composable_shard as cs
from composable_shard import ShardingStrategy, comm, fully_shard
from composable_shard.planning.step_replay import buckets_in_backward
from composable_shard.runtime.state import unit_states_under

from tests.support.coalescing import CASES, small_gpt, train_case
from tests.support.comm_spies import CollectiveSpy, reduce_bucket_bytes
from tests.support.harness_pool import run_distributed
from tests.support.models import Block, batch, lm_loss
from tests.support.parity import Parity, run_parity, shard_manually


# ---------------------------------------------------------------- counts
def _buckets_are_the_plans(rank: int, world_size: int) -> None:
    """Per backward, the reduce-scatters' outputs are the plan's buckets (in
    order and size) and their number is at most ceil(bytes / bucket) + 2;
    every trainable flat parameter is finished once; with buckets off, one
    reduce-scatter per flat parameter."""
    block_grad = small_gpt().blocks[0]
    block_bytes = 4 * sum(p.numel() for p in block_grad.parameters())
    for bucket in (comm.REDUCE_BUCKET_BYTES, 5 * block_bytes // 2, 0):
        with reduce_bucket_bytes(bucket):
            model = small_gpt()
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
                reduced = [numel for numel, _ in spy.reductions_issued("reduce_scatter")]
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
def _coalesced_equals_alone(rank: int, world_size: int, cases: list[str]) -> None:
    for case in cases:
        # All-gathers alone in both: this pins the reductions only.
        coalesced, spy = train_case(case, rank, world_size, reduce_bucket=comm.REDUCE_BUCKET_BYTES, gather_bucket=0)
        alone, none = train_case(case, rank, world_size, reduce_bucket=0, gather_bucket=0)
        buckets = spy.counts()["reduce_grads_together"]
        assert buckets >= 3 and none.counts()["reduce_grads_together"] == 0, (case, buckets)
        for name, tensor in alone.items():
            assert torch.equal(coalesced[name], tensor), f"{case}: {name} differs from reducing each flat parameter alone"


@pytest.mark.parametrize("world_size", [2, 4])
def test_coalesced_reductions_equal_reductions_alone_bit_for_bit(world_size: int) -> None:
    run_distributed(_coalesced_equals_alone, world_size, [case for case, (w, *_) in CASES.items() if w == world_size])


def _grad_storages(model: torch.nn.Module) -> dict[str, int]:
    """Each trainable flat parameter's sharded gradient storage (by address),
    checked to be its own: the parameters' ``.grad`` tile it at their
    layout offsets and it holds nothing else ([Note: sharded gradient
    ownership] in handle/grads.py)."""
    storages: dict[str, int] = {}
    for name, unit in unit_states_under(model):
        for index, handle in enumerate(unit.trainable_handles):
            tiles = [(info, p.grad) for info, p in zip(handle.layout.params, handle.orig_params) if info.local_numel]
            storage = tiles[0][1].untyped_storage()
            assert storage.nbytes() == handle.layout.shard_numel * tiles[0][1].element_size(), (name, index)
            for info, grad in tiles:
                assert grad.untyped_storage().data_ptr() == storage.data_ptr(), (name, info.fqn)
                assert grad.storage_offset() == info.shard_offset, (name, info.fqn)
            storages[f"{name}/{index}"] = storage.data_ptr()
    return storages


def _bucket_grads_own_their_storage(rank: int, world_size: int) -> None:
    """A flat parameter finished from a bucket's piece holds its gradient in
    a storage of its own, which the next backward accumulates into (no
    copy of the bucket left under ``.grad``), also with a divide factor of
    1 (nothing divides the piece); bit for bit what reducing alone gives."""
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD):
        for factor in (None, 1.0):
            grads: dict[int, dict[str, torch.Tensor]] = {}
            for bucket in (comm.REDUCE_BUCKET_BYTES, 0):
                with reduce_bucket_bytes(bucket):
                    model = small_gpt()
                    shard_manually(strategy)(model)
                    for _, unit in unit_states_under(model):
                        cs.set_gradient_divide_factor(unit.module, factor)
                    first: dict[str, int] = {}
                    for step in range(2):  # the second accumulates
                        inputs, targets = batch(step)
                        lm_loss(model(inputs[rank::world_size]), targets[rank::world_size]).backward()
                        storages = _grad_storages(model)
                        first = first or storages
                        assert storages == first, (strategy, factor, bucket, "accumulated into new storage")
                    grads[bucket] = {name: p.grad.clone() for name, p in model.named_parameters()}
            for name, grad in grads[0].items():
                assert torch.equal(grads[comm.REDUCE_BUCKET_BYTES][name], grad), (strategy, factor, name)


def test_gradients_from_a_bucket_own_their_storage_and_accumulate_in_place() -> None:
    run_distributed(_bucket_grads_own_their_storage, 2)


def _parity_with_buckets(rank: int, world_size: int) -> None:
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD):
        for bucket in (comm.REDUCE_BUCKET_BYTES, 3000):
            with reduce_bucket_bytes(bucket):
                run_parity(Parity(build=small_gpt, shard=shard_manually(strategy)))


def test_coalesced_reductions_train_like_one_process() -> None:
    run_distributed(_parity_with_buckets, 2)
