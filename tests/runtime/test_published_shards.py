"""All-gathers from published shards ([Note: all-gathers from published
shards] in composable_shard/runtime/published_shards.py): a step's
all-gathers of small units read the peers' published shards, with no round
through the slots; training is bit for bit that of gathering through rounds
under every strategy and with activation checkpointing, gradient
accumulation, per-unit gradient sync, hybrid partial sums and a unit some
ranks skip (mixed precision and NO_SHARD publish nothing); a shard changed
in place inside a step fails its next all-gather naming its unit, and the
model trains after; anything between steps sees the shards as they are."""

from __future__ import annotations

import contextlib
from typing import Iterator
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from composable_shard import comm, fully_shard, unshard_params
from composable_shard.comm import shared_memory, transport
from composable_shard.comm.shared_memory import PublishedShards

from tests.support.coalescing import CASES, small_gpt, train_case
from tests.support.harness_pool import run_distributed
from tests.support.models import batch, lm_loss
from tests.support.parity import Parity, run_parity


@contextlib.contextmanager
def _published_bytes(nbytes: int) -> Iterator[None]:
    saved = shared_memory.PUBLISHED_BYTES
    shared_memory.PUBLISHED_BYTES = nbytes
    try:
        yield
    finally:
        shared_memory.PUBLISHED_BYTES = saved


@contextlib.contextmanager
def _counting_published_gathers() -> Iterator[list[int]]:
    """Counts the all-gathers read from published shards (calls through)."""
    count = [0]
    real = PublishedShards.all_gather

    def counted(self: PublishedShards, *args: object, **kwargs: object) -> object:
        count[0] += 1
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    with mock.patch.object(PublishedShards, "all_gather", counted):
        yield count


def _rounds(group: dist.ProcessGroup) -> int:
    """Rounds this rank has published through the group's slots so far."""
    shared = transport.shared_memory_of(group)
    assert shared is not None
    return shared.slots._next_seq


# ---------------------------------------------------------------- bits
def _published_equals_rounds(rank: int, world_size: int, cases: list[str]) -> None:
    for case in cases:
        with _counting_published_gathers() as published_gathers:
            published, _ = train_case(
                case, rank, world_size, reduce_bucket=comm.REDUCE_BUCKET_BYTES,
                gather_bucket=comm.GATHER_BUCKET_BYTES, fresh_group=True,
            )  # fmt: skip
        with _published_bytes(0), _counting_published_gathers() as rounds_gathers:
            rounds, _ = train_case(
                case, rank, world_size, reduce_bucket=comm.REDUCE_BUCKET_BYTES,
                gather_bucket=comm.GATHER_BUCKET_BYTES, fresh_group=True,
            )  # fmt: skip
        publishes = case not in ("no_shard", "bf16, fp32 reduce", "bf16 reduce")
        assert (published_gathers[0] > 0) == publishes, (case, published_gathers[0])
        assert rounds_gathers[0] == 0, case
        for name, tensor in rounds.items():
            assert torch.equal(published[name], tensor), f"{case}: {name} differs from gathering through rounds"


@pytest.mark.parametrize("world_size", [2, 4])
def test_published_all_gathers_equal_rounds_bit_for_bit_in_every_case(world_size: int) -> None:
    run_distributed(_published_equals_rounds, world_size, [case for case, (w, *_) in CASES.items() if w == world_size])


def _parity(rank: int, world_size: int) -> None:
    """A fresh group (published shards) trains like one process."""
    group = dist.new_group(list(range(world_size)))

    def shard(model: torch.nn.Module) -> None:
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, process_group=group)
        fully_shard(model, process_group=group)

    with _counting_published_gathers() as count:
        run_parity(Parity(build=small_gpt, shard=shard))
    assert count[0] > 0


def test_published_all_gathers_train_like_one_process() -> None:
    run_distributed(_parity, 2)


# ---------------------------------------------------------------- rounds
def _no_rounds_for_gathers(rank: int, world_size: int) -> None:
    """With published shards a forward issues no round at all, and a step
    only its reductions' (the same as with no all-gather); publishing off,
    every bucket's all-gather is a round again."""
    inputs, targets = batch(0)
    local = inputs[rank::world_size], targets[rank::world_size]
    counts = {}
    for nbytes in (shared_memory.PUBLISHED_BYTES, 0):
        group = dist.new_group(list(range(world_size)))
        with _published_bytes(nbytes):
            model = small_gpt()
            for block in model.blocks:
                fully_shard(block, process_group=group)
            fully_shard(model, process_group=group)
        loss = lm_loss(model(local[0]), local[1])  # sets the group up (its first collective)
        loss.backward()
        before = _rounds(group)
        with torch.no_grad():
            model(local[0])
        forward = _rounds(group) - before
        before = _rounds(group)
        lm_loss(model(local[0]), local[1]).backward()
        counts[nbytes] = (forward, _rounds(group) - before)
        shared = transport.shared_memory_of(group)
        assert shared is not None and (shared.published is not None) == (nbytes > 0)
        if nbytes:
            assert shared.published.number == 3  # one per root forward  # type: ignore[union-attr]
    published, rounds = counts[shared_memory.PUBLISHED_BYTES], counts[0]
    assert published[0] == 0 and rounds[0] >= 1, counts
    assert rounds[1] - published[1] >= 2, counts  # a forward's and a backward's all-gathers at least


def test_a_steps_all_gathers_of_small_units_take_no_round() -> None:
    run_distributed(_no_rounds_for_gathers, 2)


# ---------------------------------------------------------------- changes
def _changed_inside_a_step(rank: int, world_size: int) -> None:
    """In place between forward and backward: the backward's all-gather
    refuses, naming the unit; the next step trains. Between steps a change
    through ``.data`` (which no version counter sees) reaches
    ``unshard_params`` after a forward without backward, and the next
    step's all-gathers, on every rank."""
    group = dist.new_group(list(range(world_size)))
    model = small_gpt()
    for block in model.blocks:
        fully_shard(block, process_group=group)
    fully_shard(model, process_group=group)
    inputs, targets = batch(0)
    local = inputs[rank::world_size], targets[rank::world_size]
    loss = lm_loss(model(local[0]), local[1])
    with torch.no_grad():
        model.blocks[5].fc_in.weight.mul_(1.0)  # every rank: none is left waiting for the others
    with pytest.raises(RuntimeError, match=r"parameter 'blocks\.5\.fc_in\.weight' was changed in place after the step's forward began"):
        loss.backward()
    lm_loss(model(local[0]), local[1]).backward()  # usable: the forward resets the tree
    model.zero_grad()
    with unshard_params(model):
        before = model.blocks[2].fc_in.weight.detach().clone()
    with torch.no_grad():
        model(local[0])  # a step without backward: its shards close at its end
    model.blocks[2].fc_in.weight.data.add_(1.0)  # this rank's part of the sharded parameter
    with unshard_params(model):
        after = model.blocks[2].fc_in.weight.detach().clone()
    assert torch.equal(after, before + 1.0)
    seen = []
    hook = model.blocks[2].fc_in.register_forward_pre_hook(lambda module, args: seen.append(module.weight.detach().clone()))
    with torch.no_grad():
        model(local[0])  # the next step publishes the changed shard
    hook.remove()
    assert torch.equal(seen[0], after)


def test_a_shard_changed_in_place_inside_a_step_is_refused_and_the_model_trains_after() -> None:
    run_distributed(_changed_inside_a_step, 2)


# ---------------------------------------------------------------- compile
def _compiled_publishes(rank: int, world_size: int) -> None:
    """Compiled per block and as a whole model, the step still publishes
    (eagerly) and trains bit for bit as eager does."""
    import torch._dynamo as dynamo

    results = {}
    for how in ("eager", "per block", "whole model"):
        dynamo.reset()
        group = dist.new_group(list(range(world_size)))
        model = small_gpt()
        for block in model.blocks:
            fully_shard(block, process_group=group)
        fully_shard(model, process_group=group)
        if how == "per block":
            for block in model.blocks:
                block.compile(backend="aot_eager")
        elif how == "whole model":
            model.compile(backend="aot_eager")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with _counting_published_gathers() as count:
            for step in range(3):
                inputs, targets = batch(step)
                lm_loss(model(inputs[rank::world_size]), targets[rank::world_size]).backward()
                optimizer.step()
                optimizer.zero_grad()
        dynamo.reset()
        shared = transport.shared_memory_of(group)
        assert shared is not None and shared.published is not None and shared.published.number == 3, how
        assert count[0] > 0, how
        results[how] = [param.detach().clone() for param in model.parameters()]
    for how in ("per block", "whole model"):
        assert all(torch.equal(a, b) for a, b in zip(results["eager"], results[how])), how


def test_compiled_models_publish_and_train_as_eager() -> None:
    run_distributed(_compiled_publishes, 2, timeout=300)
