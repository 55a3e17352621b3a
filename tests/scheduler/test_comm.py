"""The collectives (comm/) and the scheduler's lanes on their own: results,
asynchrony, the limit on all-gathers in flight, reduction order; CUDA lanes
on GPUs."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from composable_shard import comm
from composable_shard.comm import PendingCollective, ShardGroups
from composable_shard.runtime.scheduler import Scheduler

from tests.support.harness_pool import requires_cuda, run_distributed, world_sizes


def _collectives_are_right_and_warning_free(rank: int, world_size: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warnings on this torch
        shard = torch.arange(3.0) + 10 * rank
        output = torch.empty(3 * world_size)
        for async_op in (False, True):
            work = comm.all_gather_into(output, shard, None, async_op=async_op)
            if work is not None:
                work.wait()
            assert torch.equal(output, torch.cat([torch.arange(3.0) + 10 * r for r in range(world_size)]))
            full = torch.arange(2.0 * world_size) * (rank + 1)
            reduced = torch.empty(2)
            work = comm.reduce_scatter(reduced, full, None, async_op=async_op)
            if work is not None:
                work.wait()
            total = sum(r + 1 for r in range(world_size))
            assert torch.equal(reduced, torch.arange(2.0 * rank, 2.0 * rank + 2) * total)
            value = torch.tensor([float(rank)])
            work = comm.all_reduce(value, None, async_op=async_op)
            if work is not None:
                work.wait()
            assert value.item() == sum(range(world_size))


@world_sizes
def test_collectives_sync_and_async_give_the_right_result(world_size: int) -> None:
    run_distributed(_collectives_are_right_and_warning_free, world_size)


def _groups_describe_hybrid_layouts(rank: int, world_size: int) -> None:
    groups = ShardGroups(dist.group.WORLD, None)
    assert (groups.shard_rank, groups.shard_world_size, groups.replicate_world_size) == (rank, world_size, 1)
    no_shard = ShardGroups(None, dist.group.WORLD)
    assert (no_shard.shard_world_size, no_shard.data_parallel_world_size, no_shard.is_sharded) == (1, world_size, False)


@world_sizes
def test_shard_groups_describe_sharded_and_replicated_layouts(world_size: int) -> None:
    run_distributed(_groups_describe_hybrid_layouts, world_size)


def _limit_keeps_two_all_gathers_in_flight(rank: int, world_size: int) -> None:
    events: list[tuple[str, int, tuple[int, ...]]] = []

    def launcher(key: int):
        def launch(async_op: bool) -> PendingCollective:
            in_flight = [k for k in range(key) if scheduler.has_pending_unshard(k)]
            events.append(("launch", key, tuple(in_flight)))
            output = torch.empty(world_size)
            work = comm.all_gather_into(output, torch.tensor([float(key)]), None, async_op=async_op)
            return PendingCollective(work, output, ())

        return launch

    for limit in (True, False):
        events.clear()
        scheduler = Scheduler(torch.device("cpu"), limit_all_gathers=limit)
        assert scheduler.async_op
        for key in range(5):
            scheduler.unshard(key, launcher(key))
            scheduler.unshard(key, launcher(key))  # already in flight: not issued again
        launches = [event for event in events if event[0] == "launch"]
        assert [event[1] for event in launches] == [0, 1, 2, 3, 4]
        if limit:
            assert all(len(in_flight) <= 1 for _, _, in_flight in launches), launches
        else:
            assert launches[-1][2] == (0, 1, 2, 3)
        scheduler.wait_for_all()
        assert not any(scheduler.has_pending_unshard(key) for key in range(5))


def test_limit_all_gathers_keeps_at_most_two_in_flight() -> None:
    run_distributed(_limit_keeps_two_all_gathers_in_flight, 2)


def _reductions_finish_in_issue_order(rank: int, world_size: int) -> None:
    scheduler = Scheduler(torch.device("cpu"), limit_all_gathers=True)
    finished: list[int] = []
    for key in range(4):
        def launch(async_op: bool, key: int = key) -> PendingCollective:
            value = torch.full((world_size * 2,), float(key + rank))
            output = torch.empty(2)
            return PendingCollective(comm.reduce_scatter(output, value, None, async_op=async_op), output, (value,))

        def done(pending: PendingCollective, key: int = key) -> None:
            expected = sum(key + r for r in range(world_size))
            assert torch.all(pending.output == expected)
            finished.append(key)

        scheduler.reduce(launch, done)
    # Each new reduction finishes the one before it (bounded gradient memory).
    assert finished == [0, 1, 2]
    scheduler.wait_for_reductions()
    assert finished == [0, 1, 2, 3]


@world_sizes
def test_reductions_are_finished_in_issue_order_when_waited(world_size: int) -> None:
    run_distributed(_reductions_finish_in_issue_order, world_size)


def _cuda_lanes_overlap_and_order(rank: int, world_size: int) -> None:
    device = torch.device("cuda", rank)
    scheduler = Scheduler(device, limit_all_gathers=True)
    assert not scheduler.async_op
    shard = torch.full((1 << 20,), float(rank), device=device)
    output = torch.empty(shard.numel() * world_size, device=device)

    def launch(async_op: bool) -> PendingCollective:
        return PendingCollective(comm.all_gather_into(output, shard, None, async_op=async_op), output, (shard,))

    scheduler.unshard("unit", launch)
    scheduler.wait_for_unshard("unit")
    result = output.view(world_size, -1)[:, 0].cpu()  # host sync: test only
    assert torch.equal(result, torch.arange(world_size, dtype=result.dtype))


@requires_cuda
@pytest.mark.parametrize("world_size", [1])
def test_cuda_all_gather_lane_is_ordered_before_compute(world_size: int) -> None:
    if torch.cuda.device_count() < world_size:
        pytest.skip("needs one GPU per rank")
    run_distributed(_cuda_lanes_overlap_and_order, world_size, backend="nccl")


def _copies_without_a_collective_are_fenced(rank: int, world_size: int) -> None:
    """A launch that only copies (a 256 MiB upload from pinned memory, ~10 ms)
    and returns no collective: compute reads the destination right after
    the wait and must see the copy (see [Note: lane fences])."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    scheduler = Scheduler(device, limit_all_gathers=True)
    source = torch.arange(1 << 26, dtype=torch.float32).pin_memory()
    for lane in ("all-gather", "reduce"):
        destination = torch.full_like(source, -1.0, device=device)
        torch.cuda.synchronize(device)

        def copy_only(async_op: bool, destination: torch.Tensor = destination) -> None:
            destination.copy_(source, non_blocking=True)
            return None

        if lane == "all-gather":
            scheduler.unshard("unit", copy_only)
            scheduler.wait_for_unshard("unit")
        else:
            scheduler.reduce(copy_only, lambda pending: None)
            scheduler.wait_for_reductions()
        # Enqueued on the compute stream at once: without the fence it runs
        # while the upload is still under way and reads the -1 fill.
        tail = destination[-4096:].clone()
        head = destination[:4096].clone()
        torch.cuda.synchronize(device)
        assert torch.equal(tail.cpu(), source[-4096:]), f"{lane} lane: compute read the tail before the copy"
        assert torch.equal(head.cpu(), source[:4096]), f"{lane} lane: compute read the head before the copy"


@requires_cuda
def test_cuda_lane_copies_without_a_collective_are_fenced_before_compute() -> None:
    run_distributed(_copies_without_a_collective_are_fenced, 1, backend="nccl")
