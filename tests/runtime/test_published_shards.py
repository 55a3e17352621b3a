"""All-gathers from published shards ([Note: all-gathers from published
shards] in composable_shard/runtime/published_shards.py): a step's
all-gathers read the peers' published shards, which live in the area from
the first step on, with no round through the slots; training is bit for
bit that of gathering through rounds
under every strategy and with activation checkpointing, gradient
accumulation, per-unit gradient sync, hybrid partial sums and a unit some
ranks skip (mixed precision and NO_SHARD publish nothing); a shard changed
in place inside a step fails its next all-gather naming its unit, and the
model trains after; anything between steps sees the shards as they are;
a rank changes its shards only after every peer read them, and a step
that ends on one rank moves them out of the area first."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from composable_shard import comm, fully_shard, no_sync, unshard_params
from composable_shard.comm import shared_memory, transport
from composable_shard.comm.shared_memory import PublishedShards
from composable_shard.runtime.state import unit_states_under

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


def _small_gpt_on(group: dist.ProcessGroup, published_bytes: int | None = None) -> torch.nn.Module:
    """``small_gpt``, a unit per block and the root, over ``group``; built
    with the area's knob at ``published_bytes`` where given."""
    with _published_bytes(shared_memory.PUBLISHED_BYTES if published_bytes is None else published_bytes):
        model = small_gpt()
        for block in model.blocks:
            fully_shard(block, process_group=group)
        fully_shard(model, process_group=group)
    return model


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
        model = _small_gpt_on(group, nbytes)
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


# ---------------------------------------------------------------- the area
def _shards_live_in_the_area(rank: int, world_size: int) -> None:
    """After the first step every unit's shard (blocks of any size) lives in
    its group's area, the parameters views of it, with no copy of it left
    anywhere; the model still reads and trains after its group is gone."""
    group = dist.new_group(list(range(world_size)))
    model = _small_gpt_on(group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs, targets = batch(0)
    for _ in range(2):
        lm_loss(model(inputs[rank::world_size]), targets[rank::world_size]).backward()
        optimizer.step()
        optimizer.zero_grad()
    shared = transport.shared_memory_of(group)
    assert shared is not None and shared.published is not None
    area = shared.published.files.published_area(rank)
    low, high = area.data_ptr(), area.data_ptr() + area.numel()
    handles = [handle for _, state in unit_states_under(model) for handle in state.handles]
    assert len(handles) == len(model.blocks) + 1
    for handle in handles:
        shard = handle.sharded_flat_param
        assert low <= shard.data_ptr() and shard.data_ptr() + shard.numel() * shard.element_size() <= high
        for param in handle.orig_params:
            assert param.numel() == 0 or low <= param.data_ptr() < high
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    dist.destroy_process_group(group)  # the area stays mapped while the shards live in it
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    assert all(torch.equal(tensor, before[name] + 1.0) for name, tensor in model.state_dict().items())


def test_shards_live_in_the_published_area_and_outlive_their_group() -> None:
    run_distributed(_shards_live_in_the_area, 2)


def _slow_peer_then_a_change(rank: int, world_size: int, fence: bool) -> bool:
    """A gradient-accumulation micro-batch (no reduction, so nothing in
    backward waits for the peer) with rank 1 slowed down before its
    backward's all-gathers; rank 0 changes its parameters at once after its
    backward returns, as an optimizer would. Whether the accumulated
    gradients after one more micro-batch equal those of gathering through
    rounds: they do where rank 0's end of backward waits for rank 1 to
    finish reading its shards; without (``fence`` False: the closing
    rank does not wait) rank 1 reads rank 0's next values."""
    real_close = PublishedShards.close

    def close(self: PublishedShards, number: int, shards: list, *, wait: bool) -> None:
        real_close(self, number, shards, wait=wait and fence)

    grads = {}
    for nbytes in (shared_memory.PUBLISHED_BYTES, 0):
        group = dist.new_group(list(range(world_size)))
        model = _small_gpt_on(group, nbytes)
        inputs, targets = batch(0)
        local = inputs[rank::world_size], targets[rank::world_size]
        lm_loss(model(local[0]), local[1]).backward()  # sets the group up
        model.zero_grad()

        def slow(*_: object) -> None:
            if fence:
                time.sleep(0.5)  # rank 0 cannot run ahead: it waits for this rank
            else:
                dist.barrier()  # the default group: until rank 0 changed its parameters

        hook = model.blocks[-1].register_full_backward_pre_hook(slow) if rank == 1 and nbytes else None
        with mock.patch.object(PublishedShards, "close", close), no_sync(model):
            lm_loss(model(local[0]), local[1]).backward()
        if hook is not None:
            hook.remove()
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1.5)
        if rank == 0 and nbytes and not fence:
            dist.barrier()
        lm_loss(model(local[0]), local[1]).backward()
        grads[nbytes] = [param.grad.clone() for param in model.parameters()]
        dist.destroy_process_group(group)
    return all(torch.equal(a, b) for a, b in zip(grads[shared_memory.PUBLISHED_BYTES], grads[0]))


def test_a_rank_changes_its_shards_only_after_every_peer_read_them() -> None:
    assert run_distributed(_slow_peer_then_a_change, 2, True) == [True, True]
    assert run_distributed(_slow_peer_then_a_change, 2, False) == [False, False]


def _in_area(model: torch.nn.Module, group: dist.ProcessGroup, rank: int) -> list[bool]:
    shared = transport.shared_memory_of(group)
    assert shared is not None and shared.published is not None
    area = shared.published.files.published_area(rank)
    return [
        0 <= handle.sharded_flat_param.data_ptr() - area.data_ptr() < area.numel()
        for _, state in unit_states_under(model)
        for handle in state.handles
    ]


def _held_forward_and_two_models(rank: int, world_size: int) -> None:
    """A forward whose backward never comes (its held state ends at the
    optimizer step, on this rank alone as far as the runtime knows): the
    shards move out of the area and stay out until a step ended on every
    rank, then move back. Two models on one group with interleaved steps
    (A's forward, B's forward, B's backward, A's backward): B's shards, first
    published while A's step is open, are copied until they can move. Every
    parameter bit for bit as gathering through rounds."""
    results: dict[int, list[torch.Tensor]] = {}
    for nbytes in (shared_memory.PUBLISHED_BYTES, 0):
        group = dist.new_group(list(range(world_size)))
        models = [_small_gpt_on(group, nbytes), _small_gpt_on(group, nbytes)]
        optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in models]
        seen = []
        for step in range(4):
            inputs, targets = batch(step)
            local = inputs[rank::world_size], targets[rank::world_size]
            if step == 1:
                lm_loss(models[0](local[0]), local[1])  # held for a backward that never comes
                optimizers[0].step()  # ends the held state (no gradient: nothing changes)
            else:
                first = lm_loss(models[0](local[0]), local[1])
                lm_loss(models[1](local[0].flip(-1)), local[1]).backward()
                first.backward()
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad()
            if nbytes:
                seen.append((all(_in_area(models[0], group, rank)), all(_in_area(models[1], group, rank))))
        if nbytes:
            # A: in, out after its held state, still out (copied) for a step, back in.
            # B: in from its first publish (no peer reads its slices), also while A's step is open.
            assert seen == [(True, True), (False, True), (False, True), (True, True)], seen
        results[nbytes] = [tensor.clone() for model in models for tensor in model.state_dict().values()]
        dist.destroy_process_group(group)
    assert all(torch.equal(a, b) for a, b in zip(results[shared_memory.PUBLISHED_BYTES], results[0]))


def test_shards_move_out_of_the_area_where_a_step_ends_on_one_rank_and_models_share_a_group() -> None:
    run_distributed(_held_forward_and_two_models, 2)


# ---------------------------------------------------------------- changes
def _changed_inside_a_step(rank: int, world_size: int) -> None:
    """In place between forward and backward: the backward's all-gather
    refuses, naming the unit; the next step trains. Between steps a change
    through ``.data`` (which no version counter sees) reaches
    ``unshard_params`` after a forward without backward, and the next
    step's all-gathers, on every rank."""
    group = dist.new_group(list(range(world_size)))
    model = _small_gpt_on(group)
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
        model = _small_gpt_on(group)
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
