"""Published shards ([Note: published shards] in
composable_shard/comm/shared_memory/published.py): what a rank publishes its
peers all-gather from its area, bit for bit what gloo gathers, beside
rounds of other collectives, publish after publish; closed, the same
shards go through rounds again; a peer that never arrives at a publish
fails it at the group's timeout naming it; a refused check leaves the group
usable; the area is granted alike on every rank, or to none."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from composable_shard import comm
from composable_shard.comm import transport
from composable_shard.comm.shared_memory.files import RankFacts, _published_grant, bytes_per_rank

from tests.support.harness_pool import run_distributed

SIZES = (5, 64, 1000, 3)  # elements per rank: odd sizes, slices aligned apart


def _shards(rank: int, salt: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * salt + rank)
    return [torch.randn(numel, generator=generator) for numel in SIZES]


def _published_group(world_size: int, timeout_s: float | None = None) -> tuple[dist.ProcessGroup, list[int]]:
    """A new group whose area holds ``SIZES`` (claimed before its setup)."""
    kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    group = dist.new_group(list(range(world_size)), **kwargs)
    offsets = [transport.published_slice(group, numel * 4) for numel in SIZES]
    assert all(at is not None for at in offsets)
    return group, offsets  # type: ignore[return-value]


def _no_check() -> None:
    return None


def _gathers_equal_gloo(rank: int, world_size: int) -> None:
    group, offsets = _published_group(world_size)
    published = transport.published_shards_of(group)
    assert published is not None and published.nbytes >= sum(numel * 4 for numel in SIZES)
    for salt in (1, 2):  # publish after publish, new values each time
        shards = _shards(rank, salt)
        assert published.publish([(at, shard, _no_check) for at, shard in zip(offsets, shards)]) == salt
        assert published.number == salt and published.open_publishes == salt
        # A round of another collective in between changes nothing.
        grad = torch.arange(8.0 * world_size) * (rank + 1)
        reduced = torch.empty(8)
        comm.reduce_scatter(reduced, grad, group, async_op=False, method="shared_memory")
        outputs = [torch.empty(numel * world_size) for numel in SIZES]
        pending = comm.all_gather_together(outputs, shards, group, async_op=True)
        assert pending.work is None  # complete at once: nothing to wait for
        single = torch.empty(SIZES[1] * world_size)
        assert comm.all_gather_into(single, shards[1], group, async_op=True) is None
        for output, shard in zip(outputs + [single], shards + [shards[1]]):
            expected = torch.empty_like(output)
            dist.all_gather_into_tensor(expected, shard, group=group)
            assert torch.equal(output, expected)
    rounds = published.slots._next_seq
    published.close(1, [], wait=True)  # its shards were published again by publish 2
    published.close(2, shards, wait=True)
    assert not published.holds(shards) and published.open_publishes == 0
    outputs = [torch.empty(numel * world_size) for numel in SIZES]
    comm.all_gather_together(outputs, shards, group, async_op=False)
    assert published.slots._next_seq > rounds  # through rounds again
    for output, shard in zip(outputs, shards):
        expected = torch.empty_like(output)
        dist.all_gather_into_tensor(expected, shard, group=group)
        assert torch.equal(output, expected)
    dist.destroy_process_group(group)


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_gathers_of_published_shards_equal_gloo(world_size: int) -> None:
    run_distributed(_gathers_equal_gloo, world_size)


def _shards_living_in_the_area(rank: int, world_size: int, wait: bool) -> list[bool]:
    """Shards kept in the area (``home``), published without a copy; rank 0
    closes the step and writes new values into its shards at once, while
    rank 1 still has to gather them. Returns, per shard, whether rank 1 read
    the values of the step."""
    group, offsets = _published_group(world_size)
    published = transport.published_shards_of(group)
    assert published is not None
    shards = [published.home(at, shard) for at, shard in zip(offsets, _shards(rank, 5))]
    assert all(published.lives_in_area(at, shard) for at, shard in zip(offsets, shards))
    assert not published.lives_in_area(offsets[0], shards[0].clone())
    number = published.publish([(at, shard, _no_check) for at, shard in zip(offsets, shards)])
    stepped = [shard.clone() for shard in shards]
    read = [True] * len(SIZES)
    if rank == 0:
        published.close(number, shards, wait=wait)  # waits for rank 1's close where ``wait``
        with torch.no_grad():
            for shard in shards:
                shard.add_(1.0)  # an optimizer step
        if not wait:
            dist.barrier()  # the default group: rank 1 gathers after the step
    else:
        if wait:
            time.sleep(0.5)  # gives rank 0 time to run ahead (it cannot: it waits for this rank)
        else:
            dist.barrier()
        outputs = [torch.empty(numel * world_size) for numel in SIZES]
        comm.all_gather_together(outputs, shards, group, async_op=False)
        read = [torch.equal(output[:numel], _shards(0, 5)[i]) for i, (output, numel) in enumerate(zip(outputs, SIZES))]
        published.close(number, shards, wait=wait)
    dist.barrier(group)
    assert [torch.equal(shard, s + (rank == 0)) for shard, s in zip(shards, stepped)] == [True] * len(SIZES)
    # Closed without waiting, a peer may still read this rank's area: nothing moves into it.
    assert [published.can_home(at) for at in offsets] == [wait] * len(SIZES)
    dist.destroy_process_group(group)
    return read


def test_shards_living_in_the_area_are_read_as_published_until_every_rank_closed() -> None:
    """With ``wait`` rank 0's close waits until rank 1 read the step's
    values; without it (what the runtime does only after moving such
    shards out of the area) rank 1 reads rank 0's next values: the test
    tells the two apart."""
    assert run_distributed(_shards_living_in_the_area, 2, True)[1] == [True] * len(SIZES)
    assert run_distributed(_shards_living_in_the_area, 2, False)[1] == [False] * len(SIZES)


def _refused_check_leaves_group_usable(rank: int, world_size: int) -> None:
    group, offsets = _published_group(world_size)
    published = transport.published_shards_of(group)
    assert published is not None
    shards = _shards(rank, 3)

    def refuse() -> None:
        raise RuntimeError("changed")

    published.publish([(at, shard, refuse) for at, shard in zip(offsets, shards)])
    outputs = [torch.empty(numel * world_size) for numel in SIZES]
    with pytest.raises(RuntimeError, match="changed"):
        comm.all_gather_together(outputs, shards, group, async_op=False)
    published.publish([(at, shard, _no_check) for at, shard in zip(offsets, shards)])
    comm.all_gather_together(outputs, shards, group, async_op=False)
    expected = torch.empty_like(outputs[0])
    dist.all_gather_into_tensor(expected, shards[0], group=group)
    assert torch.equal(outputs[0], expected)
    dist.destroy_process_group(group)


def test_a_refused_check_leaves_the_group_usable() -> None:
    run_distributed(_refused_check_leaves_group_usable, 2)


def _peer_never_arrives(rank: int, world_size: int) -> None:
    group, offsets = _published_group(world_size, timeout_s=2.0)
    published = transport.published_shards_of(group)
    assert published is not None
    if rank == 0:
        shards = _shards(rank, 4)
        with pytest.raises(RuntimeError, match=r"publish 1 of shards.*ranks \[1\] of the group did not arrive at it within 2 s"):
            published.publish([(at, shard, _no_check) for at, shard in zip(offsets, shards)])
        with pytest.raises(RuntimeError, match="publish 1 of shards failed on rank 0"):
            comm.all_gather_into(torch.empty(8 * world_size), torch.zeros(8), group, async_op=False)
    dist.barrier()  # the default group: rank 1 waits here for rank 0's verdict


def test_a_peer_that_never_arrives_at_a_publish_fails_it_at_the_group_timeout() -> None:
    run_distributed(_peer_never_arrives, 2)


def _facts(published: list[int], free: list[int]) -> list[RankFacts]:
    place = ("boot", "/dev/shm", 1, 1)
    return [
        RankFacts(place, 100 + rank, "owner", rank, free[rank], "token", 1 << 20, True, published[rank])
        for rank in range(len(published))
    ]


def test_the_area_is_granted_alike_on_every_rank_or_to_none() -> None:
    largest = 1 << 16
    slots_only = bytes_per_rank(largest, 1 << 20) * 2
    with_area = bytes_per_rank(largest, 1 << 20, 300_000) * 2
    granted = _published_grant(_facts([300_000, 300_000], [with_area, with_area]), largest)
    assert granted == 327_680  # rounded up to the 64 KiB granule
    assert _published_grant(_facts([300_000, 200_000], [with_area, with_area]), largest) == 0  # models differ
    assert _published_grant(_facts([300_000, 300_000], [with_area, slots_only]), largest) == 0  # no room on rank 1
    assert _published_grant(_facts([0, 0], [with_area, with_area]), largest) == 0
