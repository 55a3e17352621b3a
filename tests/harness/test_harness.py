"""Owns: tests of the multi-process harness itself (tests/support/harness_pool.py): ranks, collectives,
return values, remote tracebacks, hangs, timeouts, pool reuse and state reset.

Knows nothing of: composable_shard.

The functions run on the workers are module-level (workers import them by name) and
start with an underscore so that pytest does not collect them.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
import torch.distributed as dist

from tests.support import harness_pool
from tests.support.harness_pool import DistributedTestError, requires_cuda, requires_gpus, run_distributed, world_sizes
from tests.support.harness_worker import run_subtests

# ---------------------------------------------------------------------------------------
# Functions run on the workers.


def _describe_rank(rank: int, world_size: int) -> dict[str, object]:
    return {
        "rank": rank,
        "world_size": world_size,
        "dist_rank": dist.get_rank(),
        "dist_world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "pid": os.getpid(),
    }


def _all_reduce_ranks(rank: int, world_size: int, scale: float) -> float:
    summed = torch.tensor([float(rank) * scale])
    dist.all_reduce(summed)
    return summed.item()


def _rank_tensor(rank: int, world_size: int, *, width: int) -> torch.Tensor:
    return torch.full((rank + 1, width), float(rank))


def _raise_on_last_rank(rank: int, world_size: int) -> int:
    if rank == world_size - 1:
        raise ValueError(f"deliberate failure on rank {rank}")
    return rank


def _raise_on_rank_0_while_others_all_reduce(rank: int, world_size: int) -> None:
    if rank == 0:
        raise RuntimeError("rank 0 gives up before the collective")
    dist.all_reduce(torch.ones(1))  # waits for rank 0 forever


def _sleep_on_last_rank(rank: int, world_size: int, seconds: float) -> int:
    if rank == world_size - 1:
        time.sleep(seconds)
    return rank


def _getpid(rank: int, world_size: int) -> int:
    return os.getpid()


def _leak_global_state(rank: int, world_size: int) -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    torch.rand(100)
    random.random()


def _read_global_state(rank: int, world_size: int) -> dict[str, object]:
    return {
        "dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
        "num_threads": torch.get_num_threads(),
        "torch_rand": torch.rand(1).item(),
        "random": random.random(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def _print_greeting(rank: int, world_size: int) -> None:
    print(f"hello from {rank}/{world_size}")


def _destroy_group(rank: int, world_size: int) -> int:
    dist.destroy_process_group()
    return os.getpid()


def _exit_abruptly(rank: int, world_size: int) -> None:
    os._exit(3)


def _check_sub_case(*, scale: int, negate: bool, seen: list[tuple[int, bool]]) -> None:
    seen.append((scale, negate))
    value = torch.tensor([float(scale)])
    dist.all_reduce(value)
    if scale == 2 and not negate:
        raise ArithmeticError(f"sub-case failed with value {value.item()}")


def _run_sub_cases(rank: int, world_size: int, scales: list[int]) -> list[tuple[int, bool]]:
    seen: list[tuple[int, bool]] = []
    run_subtests({"scale": scales, "negate": [True, False]}, _check_sub_case, seen=seen)
    return seen


def _nccl_all_reduce(rank: int, world_size: int) -> float:
    summed = torch.ones(1, device="cuda") * (rank + 1)
    dist.all_reduce(summed)
    return summed.item()


# ---------------------------------------------------------------------------------------
# Tests.


@world_sizes
def test_each_rank_sees_its_rank_and_world_size(world_size: int) -> None:
    results = run_distributed(_describe_rank, world_size)
    assert [r["rank"] for r in results] == list(range(world_size))
    assert [r["dist_rank"] for r in results] == list(range(world_size))
    assert {r["world_size"] for r in results} == {world_size}
    assert {r["dist_world_size"] for r in results} == {world_size}
    assert {r["backend"] for r in results} == {"gloo"}
    assert len({r["pid"] for r in results}) == world_size  # one process per rank


@world_sizes
def test_all_reduce_sums_over_ranks(world_size: int) -> None:
    results = run_distributed(_all_reduce_ranks, world_size, 2.0)
    assert results == [2.0 * sum(range(world_size))] * world_size


@world_sizes
def test_return_values_come_back_in_rank_order(world_size: int) -> None:
    results = run_distributed(_rank_tensor, world_size, width=3)
    for rank, tensor in enumerate(results):
        assert isinstance(tensor, torch.Tensor)
        torch.testing.assert_close(tensor, torch.full((rank + 1, 3), float(rank)))


@world_sizes
def test_workers_are_reused_across_calls(world_size: int) -> None:
    first = run_distributed(_getpid, world_size)
    second = run_distributed(_getpid, world_size)
    assert first == second
    assert os.getpid() not in first


@world_sizes
def test_rank_raising_reports_its_traceback_and_keeps_pool(world_size: int) -> None:
    pids_before = run_distributed(_getpid, world_size)
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_last_rank, world_size)
    last = world_size - 1
    message = str(info.value)
    assert f"failed on rank(s) [{last}] of world_size={world_size}" in message
    assert f"---- rank {last} traceback ----" in message
    assert "in _raise_on_last_rank" in message  # the remote frame
    assert f"ValueError: deliberate failure on rank {last}" in message
    assert list(info.value.failed_ranks) == [last]
    assert info.value.unfinished_ranks == ()
    # Every rank answered and the group passed its check: same workers, still working.
    assert run_distributed(_getpid, world_size) == pids_before
    assert run_distributed(_all_reduce_ranks, world_size, 1.0) == [float(sum(range(world_size)))] * world_size


def test_rank_hung_in_collective_after_another_raises_does_not_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(harness_pool, "_FAILURE_GRACE_S", 1.0)
    world_size = 2
    pids_before = run_distributed(_getpid, world_size)
    began = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank_0_while_others_all_reduce, world_size, timeout=60.0)
    assert time.monotonic() - began < 20.0  # grace period + stack dump, not the timeout
    message = str(info.value)
    assert "RuntimeError: rank 0 gives up before the collective" in message
    assert "rank(s) [1] of world_size=2 were still running" in message
    assert "---- rank 1 stack when killed ----" in message
    assert "in all_reduce" in message  # faulthandler shows where it waited
    assert info.value.unfinished_ranks == (1,)
    # The pool was killed; the next call gets fresh, working workers.
    pids_after = run_distributed(_getpid, world_size)
    assert set(pids_after).isdisjoint(pids_before)
    assert run_distributed(_all_reduce_ranks, world_size, 1.0) == [1.0, 1.0]


def test_timeout_names_unfinished_ranks_and_next_call_works() -> None:
    world_size = 2
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_sleep_on_last_rank, world_size, 60.0, timeout=1.0)
    message = str(info.value)
    assert "rank(s) [1] of world_size=2 did not finish within the 1 s timeout" in message
    assert "in _sleep_on_last_rank" in message  # from the stack dump
    assert info.value.failed_ranks == {}
    assert run_distributed(_sleep_on_last_rank, world_size, 0.0) == [0, 1]


@world_sizes
def test_global_state_is_reset_before_each_call(world_size: int) -> None:
    run_distributed(_leak_global_state, world_size)
    results = run_distributed(_read_global_state, world_size)
    generator = torch.Generator().manual_seed(0)
    expected = {
        "dtype": torch.float32,
        "grad_enabled": True,
        "num_threads": 1,
        "torch_rand": torch.rand(1, generator=generator).item(),
        "random": random.Random(0).random(),
        "omp_num_threads": "1",
    }
    assert results == [expected] * world_size


def test_worker_output_reaches_the_test_with_rank_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    run_distributed(_print_greeting, 2)
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0/2\n" in out
    assert "[rank 1] hello from 1/2\n" in out


def test_function_that_cannot_be_pickled_is_rejected_before_launch() -> None:
    with pytest.raises(TypeError, match="defined at module level"):
        run_distributed(lambda rank, world_size: rank, 1)


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_world_size_is_rejected(bad: int) -> None:
    with pytest.raises(ValueError, match=f"world_size must be a positive int, got {bad}"):
        run_distributed(_getpid, bad)


def test_destroyed_process_group_restarts_pool() -> None:
    (old_pid,) = run_distributed(_destroy_group, 1)
    (new_pid,) = run_distributed(_getpid, 1)
    assert new_pid != old_pid
    assert run_distributed(_all_reduce_ranks, 1, 1.0) == [0.0]


def test_worker_dying_is_reported_and_pool_restarts() -> None:
    with pytest.raises(DistributedTestError, match="died with exit code 3"):
        run_distributed(_exit_abruptly, 1)
    assert run_distributed(_all_reduce_ranks, 1, 1.0) == [0.0]


def test_run_subtests_runs_every_case_and_names_the_failing_one() -> None:
    results = run_distributed(_run_sub_cases, 2, [1, 3])
    assert results == [[(1, True), (1, False), (3, True), (3, False)]] * 2
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_run_sub_cases, 2, [1, 2])
    message = str(info.value)
    assert "ArithmeticError: sub-case failed with value 4.0" in message
    assert "run_subtests: in sub-case {'scale': 2, 'negate': False}" in message
    assert sorted(info.value.failed_ranks) == [0, 1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_nccl_without_gpu_raises_clearly() -> None:
    with pytest.raises(RuntimeError, match="needs CUDA"):
        run_distributed(_getpid, 1, backend="nccl")


@requires_cuda
def test_nccl_all_reduce_on_one_gpu() -> None:
    assert run_distributed(_nccl_all_reduce, 1, backend="nccl") == [1.0]


@requires_gpus(2)
def test_nccl_all_reduce_on_two_gpus() -> None:
    assert run_distributed(_nccl_all_reduce, 2, backend="nccl") == [3.0, 3.0]


@requires_cuda
def test_failure_on_an_nccl_pool_keeps_the_pool() -> None:
    """The group check after a failure communicates on the rank's GPU: NCCL has
    no CPU tensors, and a check on one killed every NCCL pool after any failure."""
    pids_before = run_distributed(_getpid, 1, backend="nccl")
    with pytest.raises(DistributedTestError, match="deliberate failure on rank 0"):
        run_distributed(_raise_on_last_rank, 1, backend="nccl")
    assert run_distributed(_getpid, 1, backend="nccl") == pids_before
    assert run_distributed(_nccl_all_reduce, 1, backend="nccl") == [1.0]
