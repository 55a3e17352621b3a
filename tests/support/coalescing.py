"""Owns: the training cases the coalesced-collective tests run (every
strategy, activation checkpointing, gradient accumulation, per-unit sync,
hybrid partial sums, mixed precision, a unit some ranks skip) and training
one of them with chosen bucket sizes.

Knows nothing of: what the tests assert.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import checkpoint

from composable_shard import (
    MixedPrecision,
    ShardingStrategy,
    fully_shard,
    no_sync,
    set_may_be_skipped,
    set_requires_all_reduce,
    set_requires_gradient_sync,
)

from tests.support.comm_spies import CollectiveSpy, gather_bucket_bytes, reduce_bucket_bytes
from tests.support.models import LoRAGPT, TinyGPT, batch, lm_loss
from tests.support.parity import hybrid_groups

N_BLOCKS, DIM = 8, 32


def small_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(n_blocks=N_BLOCKS, dim=DIM)

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


# The group ``_shard`` passes where a case names none (``train_case``'s fresh_group).
_GROUP: list[dist.ProcessGroup | None] = [None]


@contextlib.contextmanager
def _default_group(group: dist.ProcessGroup) -> Iterator[None]:
    _GROUP[0] = group
    try:
        yield
    finally:
        _GROUP[0] = None


def _shard(strategy: ShardingStrategy, *, ac: bool = False, skippable: bool = False, **kwargs: Any) -> Callable:
    def shard(model: nn.Module) -> None:
        if _GROUP[0] is not None and "process_group" not in kwargs:
            kwargs["process_group"] = _GROUP[0]
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
    "full_shard": (2, lambda w: _shard(ShardingStrategy.FULL_SHARD), _plain, small_gpt),
    "shard_grad_op": (2, lambda w: _shard(ShardingStrategy.SHARD_GRAD_OP), _plain, small_gpt),
    "no_shard": (2, lambda w: _shard(ShardingStrategy.NO_SHARD), _plain, small_gpt),
    "hybrid 2x2": (4, lambda w: _shard(ShardingStrategy.HYBRID_SHARD, process_group=hybrid_groups(w)), _plain, small_gpt),
    "hybrid 2x2, replica sum kept": (
        4,
        lambda w: _shard(ShardingStrategy.HYBRID_SHARD, process_group=hybrid_groups(w)),
        _replica_sum_kept,
        small_gpt,
    ),
    "activation checkpointing": (2, lambda w: _shard(ShardingStrategy.FULL_SHARD, ac=True), _plain, small_gpt),
    "no_sync accumulation": (2, lambda w: _shard(ShardingStrategy.FULL_SHARD), _accumulating, small_gpt),
    "part of the model unsynced": (2, lambda w: _shard(ShardingStrategy.SHARD_GRAD_OP), _part_unsynced, small_gpt),
    "bf16, fp32 reduce": (
        2,
        lambda w: _shard(
            ShardingStrategy.FULL_SHARD,
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        ),
        _plain,
        small_gpt,
    ),
    "bf16 reduce": (
        2,
        lambda w: _shard(ShardingStrategy.FULL_SHARD, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)),
        _plain,
        small_gpt,
    ),
    # Two flat parameters per block (frozen base, trainable adapters).
    "lora, frozen base": (
        2,
        lambda w: _shard(ShardingStrategy.FULL_SHARD),
        _plain,
        lambda: (torch.manual_seed(0), LoRAGPT(n_blocks=6))[1],
    ),
    "a unit some ranks skip": (
        2,
        lambda w: _shard(ShardingStrategy.FULL_SHARD, skippable=True),
        _plain,
        lambda: (torch.manual_seed(0), _SkippableGPT(n_blocks=N_BLOCKS, dim=DIM))[1],
    ),
}


def train_case(
    case: str, rank: int, world_size: int, *, reduce_bucket: int, gather_bucket: int, fresh_group: bool = False
) -> tuple[dict[str, torch.Tensor], CollectiveSpy]:
    """Three AdamW steps of ``case`` with these buckets (bytes; 0: each
    flat parameter alone); the full parameters after, and the collectives
    the steps called. ``fresh_group``: a case on the default group shards
    over a new group of every rank instead (one whose transport is set up
    for this model, as the default group is in a fresh process)."""
    _, shard, step_fn, build = CASES[case]
    with reduce_bucket_bytes(reduce_bucket), gather_bucket_bytes(gather_bucket):
        model = build()
        if fresh_group and "hybrid" not in case:
            group = dist.new_group(list(range(world_size)))
            with _default_group(group):
                shard(world_size)(model)
        else:
            shard(world_size)(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        spy = CollectiveSpy()
        with spy.watching():
            for step in range(3):
                step_fn(model, step, rank, world_size)
                optimizer.step()
                optimizer.zero_grad()
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}, spy
