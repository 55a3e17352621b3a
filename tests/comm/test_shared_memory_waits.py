"""Shared-memory collectives when a peer is late or a round fails before it
is published (``comm/shared_memory/slots.py``, [Note: slots and waits]): a
waiting rank costs little CPU, ``wait(timeout=...)`` is torch's keyword, and
a call that failed before publishing (a claim that timed out, a reservation
refused) can be retried and stays in step with its peers."""

from __future__ import annotations

import contextlib
import datetime
import errno
import gc
import os
import time
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from composable_shard import comm
from composable_shard.comm import transport
from composable_shard.comm.shared_memory import SLOTS

from tests.support.harness_pool import run_distributed

# What a rank waiting for a peer seconds late may cost, as CPU time over
# wall time: the target is under 1% of a core (measured on a busy 2-core VM:
# the waiting thread 0.4-0.6%, the whole process 0.7-1.1%, of which its
# idle gloo and harness threads cost 0.35-0.45% asleep; the old back-off,
# capped at 0.2 ms, 4-7% here, 7-9% in the issue); the bounds leave room
# for a loaded machine. The process is bounded by what it costs above its
# own cost asleep just before: its other threads' share is not the wait's,
# and in a warm worker late in a suite it once measured 2.64% asleep (the
# process 3.44% while waiting, the waiting thread 0.80%). The waiting
# thread's bound: in another such worker it measured 1.56% (the process
# asleep 2.42%), 0.37-0.46% alone seven times the same day; with futexes off
# and the old back-off capped at 0.2 ms it measured 12.0% and fails. No garbage collection runs in the measured
# wait (one is run on both ranks before the peer's lateness starts): a collection the worker's earlier tests left due
# would be the thread's CPU without being the wait's.
_WAIT_CPU_BOUND = {"process above asleep": 0.03, "waiting thread": 0.025}
_LATE_S = 1.5


def _set_up_group(world_size: int, timeout_s: float) -> dist.ProcessGroup:
    group = dist.new_group(list(range(world_size)))
    comm.all_gather_into(torch.empty(world_size), torch.zeros(1), group, async_op=False)  # the group set up
    assert transport.shared_memory_of(group) is not None
    group.set_timeout(datetime.timedelta(seconds=timeout_s))
    return group


def _late_peer_wait_cost(rank: int, world_size: int) -> dict[str, float] | None:
    group = _set_up_group(world_size, timeout_s=60)
    gc.collect()  # before the peer's lateness starts: it took 0.3 s once in a warm worker
    dist.barrier()
    output = torch.empty(4 * world_size)
    fraction = None
    if rank == 0:
        # What this process costs asleep (its gloo and harness threads): for the report.
        start, process_start = time.monotonic(), time.process_time()
        time.sleep(1.0)
        asleep = (time.process_time() - process_start) / (time.monotonic() - start)
        work = comm.all_gather_into(output, torch.full((4,), 1.0), group, async_op=True)
        gc.disable()
        try:
            start, process_start, thread_start = time.monotonic(), time.process_time(), time.thread_time()
            work.wait()
            wall = time.monotonic() - start
        finally:
            gc.enable()
        assert wall > _LATE_S - 0.2, f"the peer was not late: {wall:.2f} s"
        fraction = {
            "process": (time.process_time() - process_start) / wall,
            "waiting thread": (time.thread_time() - thread_start) / wall,
            "process asleep": asleep,
        }
        fraction["process above asleep"] = fraction["process"] - asleep
    else:
        time.sleep(1.0 + _LATE_S)
        comm.all_gather_into(output, torch.full((4,), 2.0), group, async_op=True).wait()
    assert torch.equal(output, torch.tensor([1.0] * 4 + [2.0] * 4))
    dist.barrier()
    return fraction


def test_waiting_for_a_late_peer_costs_under_one_percent_of_a_core() -> None:
    fraction = run_distributed(_late_peer_wait_cost, 2)[0]
    measured = ", ".join(f"{what} {100 * share:.2f}%" for what, share in fraction.items())
    print(f"\nCPU of a rank waiting {_LATE_S:g} s for a late peer, of a core: {measured}")  # pytest -s
    for what, bound in _WAIT_CPU_BOUND.items():
        assert fraction[what] < bound, measured


def _late_peer_wakes_the_waiting_rank(rank: int, world_size: int) -> dict[str, int]:
    """A rank waiting for a late peer sleeps on the peer's header entry and is
    woken by its write, without a single poll's pause ([Note: waking a
    waiting peer]); with futexes off it polls with back-off. Both give the
    peer's bytes."""
    import types

    from composable_shard.comm.shared_memory import slots as slots_module

    group = _set_up_group(world_size, timeout_s=60)
    ring = transport.shared_memory_of(group).slots
    pauses = {"futexes": 0, "polling": 0, "futex waits": 0}
    for way in ("futexes", "polling"):
        ring._futexes = way == "futexes"  # on every rank: the waker needs them too
        dist.barrier()
        output = torch.empty(4 * world_size)
        if rank == 0:
            work = comm.all_gather_into(output, torch.full((4,), 1.0), group, async_op=True)

            def pause(seconds: float, way: str = way) -> None:
                pauses[way] += 1
                time.sleep(seconds)

            def futex_wait(address: int, expected: int, timeout_s: float, way: str = way) -> bool:
                pauses["futex waits"] += way == "futexes"
                return waited(address, expected, timeout_s)

            saved, waited, period = slots_module.time, slots_module.wait_while_equal, slots_module._LIVENESS_PERIOD_S
            slots_module.time = types.SimpleNamespace(monotonic=time.monotonic, sleep=pause)  # type: ignore[assignment]
            slots_module.wait_while_equal = futex_wait
            # A futex wait lasts at most until the next liveness check: 30 s
            # here, so only the peer's wake-up can end this one in time.
            slots_module._LIVENESS_PERIOD_S = 30.0
            try:
                start = time.monotonic()
                work.wait()
                assert time.monotonic() - start < 10.0, way
            finally:
                slots_module.time, slots_module.wait_while_equal = saved, waited
                slots_module._LIVENESS_PERIOD_S = period
        else:
            time.sleep(0.3)
            comm.all_gather_into(output, torch.full((4,), 2.0), group, async_op=True).wait()
        assert torch.equal(output, torch.tensor([1.0] * 4 + [2.0] * 4)), way
    ring._futexes = True
    dist.barrier()
    return pauses


def test_a_late_peer_wakes_the_waiting_rank_without_polling() -> None:
    from composable_shard.comm.shared_memory.futex import FUTEX_SUPPORTED

    assert FUTEX_SUPPORTED  # the shared-memory path runs on x86-64 Linux only
    pauses = run_distributed(_late_peer_wakes_the_waiting_rank, 2)[0]
    assert pauses["futexes"] == 0, pauses
    # Woken by the peer's write (a spurious wake-up or a signal may add one).
    assert 1 <= pauses["futex waits"] <= 2, pauses
    assert pauses["polling"] > 0, pauses  # the fallback polls: the count sees pauses


def _wait_takes_a_timeout_keyword(rank: int, world_size: int) -> None:
    group = _set_up_group(world_size, timeout_s=60)
    output = torch.empty(3 * world_size)
    if rank == 0:
        work = comm.all_gather_into(output, torch.full((3,), 1.0), group, async_op=True)
        with pytest.raises(TypeError, match=r"wait\(timeout=...\) takes a datetime.timedelta .* got str"):
            work.wait(timeout="1s")
        start = time.monotonic()
        timed_out = r"communication timeout .*within 0.2 s \(the timeout given to wait\(\)\)"
        with pytest.raises(RuntimeError, match=timed_out):
            work.wait(timeout=datetime.timedelta(seconds=0.2))
        assert 0.2 <= time.monotonic() - start < 1.0
        work.wait(timeout=datetime.timedelta(seconds=30))  # retried: the peer came meanwhile
        assert work.is_completed()
    else:
        time.sleep(1.0)
        comm.all_gather_into(output, torch.full((3,), 2.0), group, async_op=True).wait(timeout=None)
    assert torch.equal(output, torch.tensor([1.0] * 3 + [2.0] * 3))
    dist.barrier()


def test_wait_takes_torchs_timeout_keyword_and_raises_a_timeout_error() -> None:
    run_distributed(_wait_takes_a_timeout_keyword, 2)


def _check_in_step(rank: int, world_size: int, group: dist.ProcessGroup, salt: int) -> None:
    """More collectives than slots, alternating kinds: every result right
    on every rank (ranks out of step would time out or mismatch)."""
    for index in range(2 * SLOTS + 1):
        numel = 5 + index
        shards = [torch.full((numel,), float(salt + 10 * peer + index)) for peer in range(world_size)]
        output = torch.empty(numel * world_size)
        comm.all_gather_into(output, shards[rank], group, async_op=True).wait(timeout=datetime.timedelta(seconds=20))
        assert torch.equal(output, torch.cat(shards)), index
        grads = torch.arange(numel * world_size, dtype=torch.float32) * (rank + 1)
        reduced = torch.empty(numel)
        comm.reduce_scatter(reduced, grads, group, async_op=False, method="shared_memory")
        total = torch.arange(numel * world_size, dtype=torch.float32) * sum(range(1, world_size + 1))
        assert torch.equal(reduced, total[rank * numel : (rank + 1) * numel]), index


def _failed_round_retried(rank: int, world_size: int) -> list[str]:
    """Two failures before rank 0 publishes its round, each retried by rank
    0 alone (its peer issues the call once): a claim that times out (rank 0
    has ``SLOTS`` rounds in flight and its peer is late to read them) and a
    reservation refused with ENOSPC (injected: ``posix_fallocate`` on rank
    0 raises it, as a full ``/dev/shm`` makes it)."""
    seen = []
    group = _set_up_group(world_size, timeout_s=1.0)
    # A claim times out: rank 0 issues SLOTS + 1 collectives while its peer
    # sleeps; the last one's slot is still unread.
    in_flight, outputs = [], []
    for index in range(SLOTS + 1):
        output = torch.empty(2 * world_size)
        outputs.append(output)
        shard = torch.full((2,), float(10 * rank + index))
        if rank == 0 and index == SLOTS:
            for attempt in range(10):
                try:
                    in_flight.append(comm.all_gather_into(output, shard, group, async_op=True))
                    break
                except RuntimeError as error:  # the peer is still asleep: retry the same call
                    assert "communication timeout" in str(error), error
                    seen.append(f"claim attempt {attempt}: {str(error)[:60]}")
            else:
                raise AssertionError("the retried call never went through")
        else:
            if rank != 0 and index == 0:
                time.sleep(2.5)
            in_flight.append(comm.all_gather_into(output, shard, group, async_op=True))
    for work in in_flight:
        work.wait(timeout=datetime.timedelta(seconds=20))
    for index, output in enumerate(outputs):
        expected = torch.cat([torch.full((2,), float(10 * peer + index)) for peer in range(world_size)])
        assert torch.equal(output, expected), index
    assert seen if rank == 0 else not seen, "rank 0's claim timed out at least once"
    group.set_timeout(datetime.timedelta(seconds=60))  # no more late peers: no timeouts on a busy machine
    _check_in_step(rank, world_size, group, salt=100)
    # A reservation refused: a collective larger than the slots reserved at
    # setup (64 KiB) must reserve more first; on rank 0 that fails once.
    numel = 50_000
    shard = torch.full((numel,), float(rank + 1))
    output = torch.empty(numel * world_size)
    if rank == 0:
        with _reservation_refused():
            comm.all_gather_into(output, shard, group, async_op=True)
        seen.append("reserve refused")
    comm.all_gather_into(output, shard, group, async_op=True).wait(timeout=datetime.timedelta(seconds=20))
    expected = torch.cat([torch.full((numel,), float(peer + 1)) for peer in range(world_size)])
    assert torch.equal(output, expected)
    _check_in_step(rank, world_size, group, salt=200)
    dist.barrier()
    return seen


def test_failed_round_before_publishing_leaves_the_group_usable() -> None:
    seen = run_distributed(_failed_round_retried, 2)
    assert seen[0][-1] == "reserve refused" and len(seen[0]) >= 2, seen


@contextlib.contextmanager
def _reservation_refused() -> Iterator[None]:
    """``/dev/shm`` full for what runs inside (``posix_fallocate`` raises
    ENOSPC, as a full tmpfs makes it), which must raise naming the
    reservation."""
    real_fallocate = os.posix_fallocate

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    os.posix_fallocate = full
    try:
        with pytest.raises(RuntimeError, match=r"cannot reserve \d+ bytes in /dev/shm \(No space left on device\)"):
            yield
    finally:
        os.posix_fallocate = real_fallocate


def _all_reduce_refused_then_retried(rank: int, world_size: int) -> None:
    """An all-reduce larger than the slots reserved at setup must reserve
    more first; on rank 0 that fails once with ENOSPC (injected, as a full
    ``/dev/shm`` makes it): the call raises naming the reservation, nothing
    is published, and the same call issued again sums right on every rank."""
    group = _set_up_group(world_size, timeout_s=60.0)
    numel = 100_000  # 400 KB, beyond the 64 KiB reserved at setup
    tensor = torch.full((numel,), float(rank + 1))
    if rank == 0:
        with _reservation_refused():
            comm.all_reduce(tensor, group, async_op=False)
        assert torch.equal(tensor, torch.full((numel,), 1.0)), "a refused all-reduce leaves its tensor as it was"
    comm.all_reduce(tensor, group, async_op=False)
    assert torch.equal(tensor, torch.full((numel,), float(sum(range(1, world_size + 1)))))
    _check_in_step(rank, world_size, group, salt=300)
    dist.barrier()


def test_all_reduce_refused_by_a_full_dev_shm_leaves_the_group_usable() -> None:
    run_distributed(_all_reduce_refused_then_retried, 2)
