"""Shared-memory collectives between the processes of one host
(``comm/shared_memory/``): the same results as gloo's collectives, bit for
bit, whatever the dtype, size, number in flight or order of waiting; the
group-wide decision to use them; training parity through them and with
them switched off."""

from __future__ import annotations

import datetime
import mmap
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from composable_shard import ShardingStrategy, comm
from composable_shard.comm import transport
from composable_shard.comm import shared_memory
from composable_shard.comm.shared_memory import SLOTS, stale
from composable_shard.comm.transport import ENV_SWITCH

from tests.support.comm_spies import shared_memory_slot_bytes
from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT
from tests.support.parity import Parity, run_parity, shard_manually


def _inputs(rank: int, world_size: int, numel: int, dtype: torch.dtype, salt: int) -> list[torch.Tensor]:
    """Every rank's input, known to every rank (so each can check the result)."""
    generator = torch.Generator().manual_seed(1000 * salt + numel)
    return [torch.randn(numel, generator=generator).to(dtype) for _ in range(world_size)]


def _all_gather_is_gloos_all_gather(rank: int, world_size: int) -> None:
    shared = transport.shared_memory_of(None)
    assert shared is not None, "ranks of one host share memory"
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        for numel in (0, 1, 7, 4099):
            shards = _inputs(rank, world_size, numel, dtype, salt=1)
            for async_op in (False, True):
                output = torch.full((numel * world_size,), 3, dtype=dtype)
                work = comm.all_gather_into(output, shards[rank], None, async_op=async_op)
                if work is not None:
                    work.wait()
                    work.wait()  # idempotent
                    assert work.is_completed()
                expected = torch.empty_like(output)
                dist.all_gather_into_tensor(expected, shards[rank])
                assert torch.equal(output, expected), (dtype, numel, async_op)
                assert torch.equal(output, torch.cat(shards)), (dtype, numel, async_op)
    # Mismatched sizes or dtypes are refused before anything is issued.
    with pytest.raises(ValueError, match=r"all-gather: output has 3 torch.float32 elements, expected"):
        shared.all_gather(torch.empty(3), torch.zeros(2), async_op=False)
    with pytest.raises(ValueError, match=r"reduce-scatter: input has .* torch.bfloat16"):
        shared.reduce_scatter(torch.empty(2), torch.zeros(2 * world_size, dtype=torch.bfloat16), async_op=False)


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_gather_through_shared_memory_equals_gloo(world_size: int) -> None:
    run_distributed(_all_gather_is_gloos_all_gather, world_size)


def _reduce_scatter_sums_own_chunk_then_peers(rank: int, world_size: int) -> None:
    assert comm.reduce_scatter_method(torch.zeros(1), None) == "shared_memory"
    for dtype in (torch.float32, torch.bfloat16):
        for chunk in (0, 1, 5, 3001):
            inputs = _inputs(rank, world_size, chunk * world_size, dtype, salt=2)
            # This rank's chunk first, then the peers' in rank order.
            expected = inputs[rank][rank * chunk : (rank + 1) * chunk].clone()
            for peer, other in enumerate(inputs):
                if peer != rank:
                    expected += other[rank * chunk : (rank + 1) * chunk]
            for async_op in (False, True):
                grad = inputs[rank].clone()
                output = torch.full((chunk,), -1.0, dtype=dtype)
                work = comm.reduce_scatter(output, grad, None, async_op=async_op, method="shared_memory")
                if work is not None:
                    work.wait()
                assert torch.equal(output, expected), (dtype, chunk, async_op)
                assert torch.equal(grad, inputs[rank]), "the input is left as it was"
    # The input is copied out at issue: changing it before the wait changes nothing.
    inputs = _inputs(rank, world_size, 6 * world_size, torch.float32, salt=4)
    grad, output = inputs[rank].clone(), torch.empty(6)
    work = comm.reduce_scatter(output, grad, None, async_op=True, method="shared_memory")
    grad.fill_(1e6)
    work.wait()
    assert torch.allclose(output, sum(x[rank * 6 : (rank + 1) * 6] for x in inputs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("world_size", [2, 4])
def test_reduce_scatter_through_shared_memory_sums_own_chunk_then_peers(world_size: int) -> None:
    run_distributed(_reduce_scatter_sums_own_chunk_then_peers, world_size)


def _all_reduce_sums_in_rank_order_on_every_rank(rank: int, world_size: int) -> None:
    """Every rank gets the sum in rank order, bit for bit (replicas stay
    equal), whatever the size, dtype and rounds: one round with the default
    slots, many with slots of 1000 bytes."""
    with shared_memory_slot_bytes(1000):
        small = dist.new_group(list(range(world_size)))
    whole = dist.new_group(list(range(world_size)))
    for group in (small, whole):
        assert transport.shared_memory_of(group) is not None
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            for numel in (0, 1, 7, 251, 4099):
                inputs = _inputs(rank, world_size, numel, dtype, salt=50)
                expected = inputs[0].clone()
                for other in inputs[1:]:
                    expected += other
                for async_op in (False, True):
                    tensor = inputs[rank].clone()
                    work = comm.all_reduce(tensor, group, async_op=async_op)
                    assert async_op == (work is not None)
                    if work is not None:
                        assert not comm.inputs_in_use(work)
                        work.wait()
                    assert torch.equal(tensor, expected), (dtype, numel, async_op)
                    if world_size == 2 and dtype is torch.float32:
                        gloo = inputs[rank].clone()
                        dist.all_reduce(gloo, group=group)
                        assert torch.equal(tensor, gloo), numel
    # The same bits on every rank: each rank's result gathered and compared.
    tensor = _inputs(rank, world_size, 3001, torch.float32, salt=51)[rank].mul_(10.0 ** rank)
    comm.all_reduce(tensor, small, async_op=False)
    gathered = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(gathered, tensor)
    assert all(torch.equal(result, gathered[0]) for result in gathered)


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_through_shared_memory_sums_in_rank_order_on_every_rank(world_size: int) -> None:
    run_distributed(_all_reduce_sums_in_rank_order_on_every_rank, world_size)


def _many_in_flight_waited_in_any_order(rank: int, world_size: int) -> None:
    """More operations issued than slots, waited newest first, some dropped
    without a wait: slots are reused only once every rank read them, and
    every waited result is right."""
    count = 3 * SLOTS + 1
    issued = []
    for index in range(count):
        numel = 64 + 32 * index  # grows: later operations write more than earlier ones
        shards = _inputs(rank, world_size, numel, torch.float32, salt=10 + index)
        output = torch.empty(numel * world_size)
        if index % 2:
            grad = shards[rank].repeat(world_size)
            reduced = torch.empty(numel)
            work = comm.reduce_scatter(reduced, grad, None, async_op=True, method="shared_memory")
            expected = sum(s.repeat(world_size)[rank * numel : (rank + 1) * numel] for s in shards)
            issued.append((work, reduced, expected, grad))
        else:
            work = comm.all_gather_into(output, shards[rank], None, async_op=True)
            issued.append((work, output, torch.cat(shards), shards[rank]))
    dropped = count - 2  # among the last SLOTS: never waited, not yet forced by a reuse
    for index in reversed(range(count)):
        if index == dropped:
            issued[index] = None  # freeing the unwaited work releases its slot
            continue
        work, output, expected, _ = issued[index]
        work.wait()
        assert torch.allclose(output, expected, rtol=0, atol=1e-5), index
    del work
    # Every slot is reused again, the dropped one included, in step on every rank.
    for index in range(SLOTS + 1):
        shards = _inputs(rank, world_size, 10 + index, torch.float32, salt=99)
        output = torch.empty((10 + index) * world_size)
        comm.all_gather_into(output, shards[rank], None, async_op=False)
        assert torch.equal(output, torch.cat(shards))


@pytest.mark.parametrize("world_size", [2, 4])
def test_more_operations_in_flight_than_slots_stay_correct(world_size: int) -> None:
    run_distributed(_many_in_flight_waited_in_any_order, world_size)


def _streamed_collectives_equal_gloo(rank: int, world_size: int) -> None:
    """Collectives many times larger than a slot stream through it in
    rounds: sizes that are not multiples of the slot, every dtype, several
    operations in flight of one round and of many, waited in any order or
    dropped. All-gathers equal gloo's bit for bit; reduce-scatters equal
    gloo's at two ranks and, at any world size, the same transport with
    slots large enough for one round (own chunk, then peers in rank order)."""
    slot_bytes = 1000  # not a multiple of any element or size below
    with shared_memory_slot_bytes(slot_bytes):
        small = dist.new_group(list(range(world_size)))
        shared = transport.shared_memory_of(small)
    whole = dist.new_group(list(range(world_size)))  # default slots: every operation here in one round
    assert shared is not None and transport.shared_memory_of(whole) is not None
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64):
        for numel in (1, 59, 250, 251, 1000, 4099):
            shards = _inputs(rank, world_size, numel, dtype, salt=20)
            output = torch.full((numel * world_size,), 3, dtype=dtype)
            comm.all_gather_into(output, shards[rank], small, async_op=True).wait()
            expected = torch.empty_like(output)
            dist.all_gather_into_tensor(expected, shards[rank])
            assert torch.equal(output, expected), (dtype, numel)
            if not dtype.is_floating_point:
                continue
            inputs = _inputs(rank, world_size, numel * world_size, dtype, salt=21)
            reduced, one_round = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
            comm.reduce_scatter(reduced, inputs[rank].clone(), small, async_op=False)
            comm.reduce_scatter(one_round, inputs[rank].clone(), whole, async_op=False)
            assert torch.equal(reduced, one_round), (dtype, numel)
            if world_size == 2:
                gloo = torch.empty_like(reduced)
                dist.reduce_scatter_tensor(gloo, inputs[rank].clone())
                assert torch.equal(reduced, gloo), (dtype, numel)
    # Several in flight: long and one-round operations interleaved, waited
    # newest first, one long one dropped unwaited.
    issued: list[Any] = []
    for index in range(3 * SLOTS):
        numel = (7, 2001, 3, 777)[index % 4] + index
        shards = _inputs(rank, world_size, numel, torch.float32, salt=30 + index)
        if index % 3 == 1:
            inputs = _inputs(rank, world_size, numel * world_size, torch.float32, salt=40 + index)
            reduced = torch.empty(numel)
            work = comm.reduce_scatter(reduced, inputs[rank].clone(), small, async_op=True)
            expected = torch.empty(numel)
            comm.reduce_scatter(expected, inputs[rank].clone(), whole, async_op=False)
            issued.append((work, reduced, expected))
        else:
            output = torch.empty(numel * world_size)
            work = comm.all_gather_into(output, shards[rank], small, async_op=True)
            issued.append((work, output, torch.cat(shards)))
    issued[-3] = None  # 2001 elements, several rounds: dropped
    for entry in reversed(issued):
        if entry is not None:
            work, output, expected = entry
            work.wait()
            assert torch.equal(output, expected)
    del work, entry
    issued.clear()
    # The slots are free again on every rank, and their memory stayed bounded.
    output = torch.empty(5000 * world_size)
    comm.all_gather_into(output, torch.full((5000,), float(rank)), small, async_op=False)
    assert torch.equal(output, torch.arange(world_size, dtype=torch.float32).repeat_interleave(5000))
    assert shared.shared_bytes <= shared_memory.bytes_per_rank(1 << 30, slot_bytes) == mmap.PAGESIZE + SLOTS * 65536
    assert shared.mapped_bytes <= world_size * SLOTS * 65536


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_larger_than_a_slot_stream_through_it_and_equal_gloo(world_size: int) -> None:
    run_distributed(_streamed_collectives_equal_gloo, world_size)


def _late_peer_mid_stream_times_out(rank: int, world_size: int) -> None:
    """A collective larger than its slots streams at issue: a peer that
    comes late makes the issue itself fail at the group's timeout, naming
    the round, and the group then fails every later call at once (its
    ranks' rounds are out of step); the late peer times out in turn."""
    with shared_memory_slot_bytes(1000):
        group = dist.new_group(list(range(world_size)))  # its own transport: this one is left broken
        comm.all_gather_into(torch.empty(world_size), torch.zeros(1), group, async_op=False)  # the group set up
    group.set_timeout(datetime.timedelta(seconds=1))
    output = torch.empty(2000 * world_size)  # 8000 bytes per rank: 9 rounds through 4 slots
    if rank == 0:
        with pytest.raises(RuntimeError, match=r"communication timeout in a shared-memory all-gather \(round \d+, "):
            comm.all_gather_into(output, torch.zeros(2000), group, async_op=True)
        with pytest.raises(RuntimeError, match=r"an all-gather failed after part of it was sent .*cannot go on"):
            comm.all_gather_into(torch.empty(world_size), torch.zeros(1), group, async_op=True)
    else:
        time.sleep(2.5)  # rank 0 gave up meanwhile
        with pytest.raises(RuntimeError, match=r"communication timeout .*waiting for its slot to be read"):
            comm.all_gather_into(output, torch.zeros(2000), group, async_op=True)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2])
def test_late_peer_in_the_middle_of_a_streamed_collective_times_out_at_issue(world_size: int) -> None:
    run_distributed(_late_peer_mid_stream_times_out, world_size)


def _group_agrees_to_fall_back(rank: int, world_size: int) -> None:
    """One rank that cannot use shared memory makes the whole group use
    gloo; the files are gone from /dev/shm once the group decided."""
    everyone = dist.new_group(list(range(world_size)))
    assert transport.shared_memory_of(everyone) is not None
    dist.barrier(everyone)  # every rank has left the setup, which removed the files' names
    # Each rank looks for the file it made (its name ends with its maker):
    # other jobs on the host may be setting up groups meanwhile.
    mine = f"_{stale.owner_marker()}"
    assert mine != "_" and not [name for name in os.listdir("/dev/shm") if name.endswith(mine)]
    if rank == world_size - 1:
        os.environ[ENV_SWITCH] = "0"
    try:
        refused = dist.new_group(list(range(world_size)))
        assert transport.shared_memory_of(refused) is None
    finally:
        os.environ.pop(ENV_SWITCH, None)
    shards = _inputs(rank, world_size, 9, torch.float32, salt=3)
    output = torch.empty(9 * world_size)
    work = comm.all_gather_into(output, shards[rank], refused, async_op=True)
    assert not hasattr(work, "_slot"), "a group that refused uses gloo's work"
    work.wait()
    assert torch.equal(output, torch.cat(shards))
    assert comm.reduce_scatter_method(torch.zeros(1), refused) == "all_reduce"
    with pytest.raises(ValueError, match="shared_memory"):
        comm.reduce_scatter(torch.empty(1), torch.zeros(world_size), refused, async_op=False, method="shared_memory")


@pytest.mark.parametrize("world_size", [2, 4])
def test_group_with_one_rank_unable_falls_back_to_gloo_on_every_rank(world_size: int) -> None:
    run_distributed(_group_agrees_to_fall_back, world_size)


def _training_matches_with_and_without_shared_memory(rank: int, world_size: int) -> None:
    for switch in ("1", "0"):
        os.environ[ENV_SWITCH] = switch
        try:
            # A group decides its transport once (with the switch as it is then).
            group = dist.new_group(list(range(world_size)))
            for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
                shard = shard_manually(strategy, forward_prefetch=True, process_group=group)
                run_parity(Parity(build=TinyGPT, shard=shard, steps=3))
            assert transport.uses_shared_memory(group, "cpu") == (switch == "1")
        finally:
            os.environ.pop(ENV_SWITCH, None)
    # Slots far smaller than a unit: every collective streams in rounds.
    with shared_memory_slot_bytes(512):
        group = dist.new_group(list(range(world_size)))
        assert transport.shared_memory_of(group) is not None
    shard = shard_manually(ShardingStrategy.FULL_SHARD, forward_prefetch=True, process_group=group)
    run_parity(Parity(build=TinyGPT, shard=shard, steps=3))


@pytest.mark.parametrize("world_size", [2, 4])
def test_training_through_shared_memory_and_through_gloo_match_single_process(world_size: int) -> None:
    run_distributed(_training_matches_with_and_without_shared_memory, world_size)


def _mismatched_collectives_raise(rank: int, world_size: int) -> None:
    """Ranks that issue different collectives at the same point get an error
    naming both, instead of reading each other's bytes as their own."""
    group = dist.new_group(list(range(world_size)))  # its own transport: this one is left broken
    assert transport.shared_memory_of(group) is not None
    numel = 5 + 2 * (rank == 0)
    output = torch.empty(numel * world_size)
    work = comm.all_gather_into(output, torch.zeros(numel), group, async_op=True)
    with pytest.raises(RuntimeError, match=r"issued an all-gather writing \d+ bytes where this rank"):
        work.wait()
    dist.barrier()


@pytest.mark.parametrize("world_size", [2])
def test_ranks_issuing_different_collectives_get_an_error_not_wrong_data(world_size: int) -> None:
    run_distributed(_mismatched_collectives_raise, world_size)


def _files_close_with_their_group(rank: int, world_size: int) -> None:
    import gc

    group = dist.new_group(list(range(world_size)))
    shared = transport.shared_memory_of(group)
    assert shared is not None
    fds = list(shared.files.fds) + list(shared.files.pidfds.values())
    inodes = {str(os.fstat(fd).st_ino) for fd in fds}

    def mapped_files() -> list[str]:
        """This group's mappings (the worker's other groups have their own)."""
        maps = Path("/proc/self/maps").read_text().splitlines()
        return [line for line in maps if "composable_shard_" in line and line.split()[4] in inodes]

    output = torch.empty(2 * world_size)
    comm.all_gather_into(output, torch.ones(2), group, async_op=False)
    reduced = torch.empty(2)
    comm.reduce_scatter(reduced, torch.ones(2 * world_size), group, async_op=False)
    # Every rank's header page (for the waits' futexes) and its slots of
    # both operations are mapped here.
    assert len(mapped_files()) == 3 * world_size
    assert shared.mapped_bytes > 0 and shared.shared_bytes > 0
    dist.destroy_process_group(group)
    del group, shared
    gc.collect()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed: nothing keeps a destroyed group's files open
    assert mapped_files() == []  # nor a mapping


@pytest.mark.parametrize("world_size", [2])
def test_shared_memory_files_close_and_unmap_when_their_group_is_destroyed(world_size: int) -> None:
    run_distributed(_files_close_with_their_group, world_size)


def _fall_back_when_dev_shm_is_small(rank: int, world_size: int) -> None:
    """/dev/shm too small on one rank (its statvfs says so), or a
    reservation refused there (posix_fallocate fails): the whole group uses
    gloo, each rank says so in one warning, and training is in parity."""
    import warnings

    real_statvfs, real_fallocate = os.statvfs, os.posix_fallocate

    def small_statvfs(path: str) -> os.statvfs_result:
        values = list(real_statvfs(path))
        values[4] = 100  # f_bavail: 100 blocks free
        return os.statvfs_result(values)

    def full_fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    for fault, (name, replacement) in {
        "small": ("statvfs", small_statvfs),
        "full": ("posix_fallocate", full_fallocate),
    }.items():
        group = dist.new_group(list(range(world_size)))
        if rank == world_size - 1:
            setattr(os, name, replacement)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                shard = shard_manually(ShardingStrategy.FULL_SHARD, process_group=group)
                run_parity(Parity(build=TinyGPT, shard=shard, steps=2))
        finally:
            os.statvfs, os.posix_fallocate = real_statvfs, real_fallocate
        messages = [str(w.message) for w in caught if "not shared memory" in str(w.message)]
        assert len(messages) == 1, (fault, messages)
        expected = f"has .* MiB free on ranks \\[{world_size - 1}\\]" if fault == "small" else "No space left on device"
        assert re.search(expected, messages[0]), messages[0]
        assert not transport.uses_shared_memory(group, "cpu"), fault
        assert not [name for name in os.listdir("/dev/shm") if name.startswith("composable_shard_") and name in messages[0]]


@pytest.mark.parametrize("world_size", [2])
def test_group_falls_back_to_gloo_with_one_warning_when_dev_shm_lacks_space(world_size: int) -> None:
    run_distributed(_fall_back_when_dev_shm_is_small, world_size)


def _waits_honour_their_timeouts(rank: int, world_size: int) -> None:
    """``wait(timeout)`` and the group's timeout end a wait for a peer that
    is late, with an error naming the collective; the wait can be retried
    and completes once the peer comes."""
    group = dist.new_group(list(range(world_size)))
    comm.all_gather_into(torch.empty(world_size), torch.zeros(1), group, async_op=False)  # the group set up
    group.set_timeout(datetime.timedelta(seconds=1))
    for timeout, late_s, error in (
        ((datetime.timedelta(seconds=0.3),), 1.5, r"within 0.3 s \(the timeout given to wait\(\)\)"),
        ((), 2.5, r"within 1 s \(the group's timeout\)"),
    ):
        output = torch.empty(3 * world_size)
        if rank == 0:
            work = comm.all_gather_into(output, torch.full((3,), 1.0), group, async_op=True)
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=r"communication timeout in a shared-memory all-gather .*" + error):
                work.wait(*timeout)
            waited = time.monotonic() - start
            limit = timeout[0].total_seconds() if timeout else 1.0
            assert limit <= waited < late_s, waited
            work.wait(datetime.timedelta(seconds=30))  # the peer came meanwhile
        else:
            time.sleep(late_s)
            work = comm.all_gather_into(output, torch.full((3,), 2.0), group, async_op=True)
            work.wait()
        assert torch.equal(output, torch.tensor([1.0] * 3 + [2.0] * 3))
        dist.barrier()


@pytest.mark.parametrize("world_size", [2])
def test_wait_timeout_and_group_timeout_end_a_wait_for_a_late_peer(world_size: int) -> None:
    run_distributed(_waits_honour_their_timeouts, world_size)


def _second_thread_refused(rank: int, world_size: int) -> None:
    """A collective issued while another thread is inside one of the same
    group is refused with an error; the group goes on working."""
    import threading

    group = dist.new_group(list(range(world_size)))
    comm.all_gather_into(torch.empty(world_size), torch.zeros(1), group, async_op=False)  # the group set up
    output = torch.empty(2 * world_size)
    if rank == 0:
        work = comm.all_gather_into(output, torch.zeros(2), group, async_op=True)
        waiter = threading.Thread(target=work.wait)
        waiter.start()  # waits for rank 1, which comes in a second
        time.sleep(0.3)
        with pytest.raises(RuntimeError, match="while another thread was inside a collective of the same process group"):
            comm.all_gather_into(torch.empty(2 * world_size), torch.zeros(2), group, async_op=False)
        waiter.join()
    else:
        time.sleep(1.0)
        comm.all_gather_into(output, torch.ones(2), group, async_op=False)
    assert torch.equal(output, torch.tensor([0.0, 0.0, 1.0, 1.0]))
    # From another thread, one at a time, the group still works.
    result = []
    helper = threading.Thread(target=lambda: result.append(comm.all_gather_into(output, torch.full((2,), float(rank)), group, async_op=False)))
    helper.start()
    helper.join()
    assert result == [None] and torch.equal(output, torch.tensor([0.0, 0.0, 1.0, 1.0]))


@pytest.mark.parametrize("world_size", [2])
def test_collective_from_a_second_thread_at_the_same_time_is_refused(world_size: int) -> None:
    run_distributed(_second_thread_refused, world_size)


def _one_transport_whether_compiled_or_not(rank: int, world_size: int) -> None:
    """A group keeps the transport it chose: a rank running its collectives
    under torch.compile and one running them eagerly meet on the same one
    (before, the compiled rank took gloo and the other shared memory, and
    both waited forever), and a switch changed later changes nothing."""
    group = dist.new_group(list(range(world_size)))

    def gather(shard: torch.Tensor) -> torch.Tensor:
        output = torch.empty(shard.numel() * world_size)
        work = comm.all_gather_into(output, shard, group, async_op=True)
        work.wait()
        return output * 1

    run = torch.compile(gather, backend="eager") if rank == 0 else gather
    for step in range(3):
        result = run(torch.full((4,), float(rank + step)))
        assert torch.equal(result, torch.tensor([float(step)] * 4 + [float(step + 1)] * 4)), step
    assert transport.uses_shared_memory(group, "cpu")
    os.environ[ENV_SWITCH] = "0" if rank == 0 else "1"
    try:
        work = comm.all_gather_into(torch.empty(2 * world_size), torch.zeros(2), group, async_op=True)
        assert not comm.inputs_in_use(work), "still shared memory"
        work.wait()
    finally:
        os.environ.pop(ENV_SWITCH, None)
    torch.compiler.reset()


@pytest.mark.parametrize("world_size", [2])
def test_compiled_and_eager_ranks_use_the_groups_one_transport(world_size: int) -> None:
    run_distributed(_one_transport_whether_compiled_or_not, world_size, timeout=120)


def _group_with_small_slots(world_size: int) -> tuple[dist.ProcessGroup, Any]:
    """A new group whose shared memory has slots of 1,000 bytes (so larger
    collectives stream in rounds), and that transport."""
    with shared_memory_slot_bytes(1000):
        group = dist.new_group(list(range(world_size)))
    shared = transport.shared_memory_of(group)
    assert shared is not None, "ranks of one host share memory"
    return group, shared


def _random_sizes(generator: torch.Generator, trial: int, high: int) -> list[int]:
    """``1 + trial`` sizes below ``high``; the first one 0 in trial 2."""
    sizes = torch.randint(0, high, (1 + trial,), generator=generator).tolist()
    if trial == 2:
        sizes[0] = 0
    return sizes


def _all_gather_pieces_is_gloos_all_gather_of_each(rank: int, world_size: int) -> None:
    """A coalesced all-gather through shared memory writes each shard from,
    and reads each row into, where it lies: every output equals gloo's
    all-gather of its shard alone, for shards of random sizes (empty ones
    among them) in one slot and streamed through slots of 1,000 bytes, and
    a peer taking the side-by-side path (a cast) sees the same bytes."""
    generator = torch.Generator().manual_seed(7)
    group, shared = _group_with_small_slots(world_size)
    for trial in range(6):
        sizes = _random_sizes(generator, trial, 700)
        every_rank = [[torch.randn(size, generator=generator) for size in sizes] for _ in range(world_size)]
        outputs = [torch.full((size * world_size,), 7.0) for size in sizes]
        for async_op in (False, True):
            pending = comm.all_gather_together(outputs, every_rank[rank], group, async_op=async_op)
            assert pending.output is outputs[0] and pending.inputs == (), "no side-by-side buffer, no rows"
            if pending.work is not None:
                pending.work.wait()
            for index, (output, size) in enumerate(zip(outputs, sizes)):
                expected = torch.empty(size * world_size)
                dist.all_gather_into_tensor(expected, every_rank[rank][index], group=group)
                assert torch.equal(output, expected), (trial, index, sizes, async_op)
                assert torch.equal(output, torch.cat([shards[index] for shards in every_rank])), (trial, index)
    # One rank's shards need a cast (side by side), the others' none: the same bytes.
    sizes = [300, 11, 520]
    every_rank = [[torch.randn(size, generator=generator) for size in sizes] for _ in range(world_size)]
    shards = [s.double() if rank == 0 else s for s in every_rank[rank]]
    outputs = [torch.empty(size * world_size) for size in sizes]
    pending = comm.all_gather_together(outputs, shards, group, async_op=True)
    assert (pending.output is outputs[0]) == (rank != 0), "only the cast takes the side-by-side buffer"
    pending.work.wait()
    for index, output in enumerate(outputs):
        assert torch.equal(output, torch.cat([each[index] for each in every_rank])), index
    # Outputs that do not fit their shards are refused before anything is issued; the group goes on.
    with pytest.raises(ValueError, match=r"all-gather: output has 5 torch.float32 elements, expected"):
        shared.all_gather_pieces([torch.empty(world_size), torch.empty(5)], [torch.zeros(1), torch.zeros(2)], async_op=False)
    with pytest.raises(ValueError, match=r"2 outputs for 1 shards"):
        shared.all_gather_pieces([torch.empty(world_size)] * 2, [torch.zeros(1)], async_op=False)
    with pytest.raises(ValueError, match=r"need contiguous tensors"):
        shared.all_gather_pieces([torch.empty(2 * world_size)], [torch.zeros(4)[::2]], async_op=False)
    output = torch.empty(world_size)
    comm.all_gather_together([output], [torch.full((1,), float(rank))], group, async_op=False)
    assert torch.equal(output, torch.arange(world_size, dtype=torch.float32))
    dist.destroy_process_group(group)


@pytest.mark.parametrize("world_size", [2, 4])
def test_coalesced_all_gather_through_shared_memory_writes_and_reads_in_place(world_size: int) -> None:
    run_distributed(_all_gather_pieces_is_gloos_all_gather_of_each, world_size)


def _reduce_scatter_pieces_is_gloos_reduce_scatter_side_by_side(rank: int, world_size: int) -> None:
    """A coalesced reduce-scatter through shared memory reads each input
    and sums into each output where it lies: every output equals, bit for
    bit, its part of the shared-memory reduce-scatter of the inputs' chunks
    laid side by side (and gloo's: bit for bit at two ranks), for inputs of random sizes (empty ones among them) in one slot
    and streamed through slots of 1,000 bytes; a peer reducing the
    side-by-side tensor sees the same bytes (the sums equal gloo's); bad lists are refused before
    anything is issued, and the group goes on."""
    generator = torch.Generator().manual_seed(11)
    group, shared = _group_with_small_slots(world_size)

    def side_by_side(inputs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([each.view(world_size, -1) for each in inputs], dim=1).reshape(-1)

    for trial in range(6):
        chunks = _random_sizes(generator, trial, 300)
        every_rank = [[torch.randn(chunk * world_size, generator=generator) for chunk in chunks] for _ in range(world_size)]
        for async_op in (False, True):
            outputs = [torch.full((chunk,), 7.0) for chunk in chunks]
            work = shared.reduce_scatter_pieces(outputs, [each.clone() for each in every_rank[rank]], async_op=async_op)
            if work is not None:
                work.wait()
            # Bit for bit the shared-memory reduce-scatter of the side-by-side tensor.
            expected = torch.empty(sum(chunks))
            shared.reduce_scatter(expected, side_by_side(every_rank[rank]), async_op=False)
            assert torch.equal(torch.cat(outputs), expected), (trial, chunks, async_op)
            # And gloo's: bit for bit at two ranks (one addition), else to round-off.
            gloo = torch.empty(sum(chunks))
            dist.reduce_scatter_tensor(gloo, side_by_side(every_rank[rank]), group=group)
            if world_size == 2:
                assert torch.equal(torch.cat(outputs), gloo), (trial, chunks, async_op)
            torch.testing.assert_close(torch.cat(outputs), gloo, rtol=0, atol=1e-5)
    # Rank 0 reduces the side-by-side tensor, the others the pieces: the same bytes.
    chunks = [130, 7, 260]
    every_rank = [[torch.randn(chunk * world_size, generator=generator) for chunk in chunks] for _ in range(world_size)]
    if rank == 0:
        output = torch.empty(sum(chunks))
        shared.reduce_scatter(output, side_by_side(every_rank[rank]), async_op=False)
    else:
        outputs = [torch.empty(chunk) for chunk in chunks]
        shared.reduce_scatter_pieces(outputs, every_rank[rank], async_op=False)
        output = torch.cat(outputs)
    expected = torch.empty(sum(chunks))
    dist.reduce_scatter_tensor(expected, side_by_side(every_rank[rank]), group=group)
    torch.testing.assert_close(output, expected, rtol=0, atol=1e-5)
    # Refused before anything is issued; the group goes on.
    with pytest.raises(ValueError, match=r"reduce-scatter: input has 5 torch.float32 elements, expected"):
        shared.reduce_scatter_pieces([torch.empty(1), torch.empty(2)], [torch.zeros(world_size), torch.zeros(5)], async_op=False)
    with pytest.raises(ValueError, match=r"2 outputs for 1 inputs"):
        shared.reduce_scatter_pieces([torch.empty(1)] * 2, [torch.zeros(world_size)], async_op=False)
    with pytest.raises(ValueError, match=r"need contiguous tensors"):
        shared.reduce_scatter_pieces([torch.empty(2)], [torch.zeros(4 * world_size)[::2]], async_op=False)
    with pytest.raises(ValueError, match=r"of one dtype"):
        f64 = torch.float64
        shared.reduce_scatter_pieces(
            [torch.empty(1), torch.empty(1, dtype=f64)], [torch.zeros(world_size), torch.zeros(world_size, dtype=f64)], async_op=False
        )
    outputs = [torch.empty(1)]
    shared.reduce_scatter_pieces(outputs, [torch.full((world_size,), float(rank))], async_op=False)
    assert torch.equal(outputs[0], torch.tensor([float(sum(range(world_size)))]))
    dist.destroy_process_group(group)


@pytest.mark.parametrize("world_size", [2, 4])
def test_coalesced_reduce_scatter_through_shared_memory_reads_and_sums_in_place(world_size: int) -> None:
    run_distributed(_reduce_scatter_pieces_is_gloos_reduce_scatter_side_by_side, world_size)


def _all_reduce_pieces_is_the_all_reduce_of_the_tensors_back_to_back(rank: int, world_size: int) -> None:
    """A coalesced all-reduce through shared memory sums each tensor where
    it lies: bit for bit the shared-memory all-reduce of the tensors laid
    back to back (the same on every rank), and gloo's to round-off, for
    random sizes (empty ones among them) in one slot and streamed through
    slots of 1,000 bytes; a peer all-reducing the concatenation sees the
    same bytes; bad lists are refused before anything is issued."""
    generator = torch.Generator().manual_seed(13)
    group, shared = _group_with_small_slots(world_size)
    for trial in range(6):
        sizes = _random_sizes(generator, trial, 500)
        every_rank = [[torch.randn(size, generator=generator) for size in sizes] for _ in range(world_size)]
        for async_op in (False, True):
            tensors = [each.clone() for each in every_rank[rank]]
            work = shared.all_reduce_pieces(tensors, async_op=async_op)
            if work is not None:
                work.wait()
            expected = torch.cat(every_rank[rank])
            shared.all_reduce(expected, async_op=False)
            assert torch.equal(torch.cat(tensors), expected), (trial, sizes, async_op)
            gloo = torch.cat(every_rank[rank])
            dist.all_reduce(gloo, group=group)
            torch.testing.assert_close(torch.cat(tensors), gloo, rtol=0, atol=1e-5)
            torch.testing.assert_close(torch.cat(tensors), sum(torch.cat(each) for each in every_rank), rtol=0, atol=1e-5)
    # Rank 0 all-reduces the concatenation, the others the pieces: the same bits.
    sizes = [300, 7, 520]
    every_rank = [[torch.randn(size, generator=generator) for size in sizes] for _ in range(world_size)]
    if rank == 0:
        result = torch.cat(every_rank[rank])
        shared.all_reduce(result, async_op=False)
    else:
        tensors = [each.clone() for each in every_rank[rank]]
        shared.all_reduce_pieces(tensors, async_op=False)
        result = torch.cat(tensors)
    gathered = [torch.empty_like(result) for _ in range(world_size)]
    dist.all_gather(gathered, result, group=group)
    assert all(torch.equal(each, gathered[0]) for each in gathered), "every rank has the same bits"
    with pytest.raises(ValueError, match=r"no tensor"):
        shared.all_reduce_pieces([], async_op=False)
    with pytest.raises(ValueError, match=r"need contiguous tensors"):
        shared.all_reduce_pieces([torch.zeros(4)[::2]], async_op=False)
    with pytest.raises(ValueError, match=r"of one dtype"):
        shared.all_reduce_pieces([torch.zeros(2), torch.zeros(2, dtype=torch.float64)], async_op=False)
    tensors = [torch.full((1,), float(rank)), torch.ones(2)]
    shared.all_reduce_pieces(tensors, async_op=False)
    assert torch.equal(tensors[0], torch.tensor([float(sum(range(world_size)))])) and torch.equal(tensors[1], torch.full((2,), float(world_size)))
    dist.destroy_process_group(group)


@pytest.mark.parametrize("world_size", [2, 4])
def test_coalesced_all_reduce_through_shared_memory_sums_in_place(world_size: int) -> None:
    run_distributed(_all_reduce_pieces_is_the_all_reduce_of_the_tensors_back_to_back, world_size)
