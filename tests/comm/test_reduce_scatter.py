"""comm.reduce_scatter's implementations (a real reduce-scatter; an in-place
all-reduce keeping this rank's chunk, gloo's choice across hosts; shared
memory, gloo's choice on one host): the same sum, sync and async, fp32 and
bf16, an output that never aliases the input, and the per-backend choice."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from composable_shard import comm

from tests.support.harness_pool import run_distributed, world_sizes


def _both_methods_give_the_reduce_scatter(rank: int, world_size: int) -> None:
    chunk = 5
    for dtype in (torch.float32, torch.bfloat16):
        inputs = [torch.arange(chunk * world_size, dtype=torch.float32) * (r + 1) + r for r in range(world_size)]
        total = torch.stack(inputs).sum(0)
        expected = total[rank * chunk : (rank + 1) * chunk].to(dtype)
        # One rank has nothing to share: shared memory needs a group of two or more.
        methods = ("reduce_scatter", "all_reduce") + (("shared_memory",) if world_size > 1 else ())
        for method in methods:
            for async_op in (False, True):
                grad = inputs[rank].to(dtype, copy=True)  # the all-reduce overwrites it
                output = torch.full((chunk,), -1.0, dtype=dtype)
                work = comm.reduce_scatter(output, grad, None, async_op=async_op, method=method)
                if work is not None:
                    work.wait()
                    if method == "all_reduce":
                        work.wait()  # idempotent: the chunk is copied once
                        assert work.is_completed()
                assert torch.equal(output, expected), (method, async_op, dtype, output, expected)
                assert output.untyped_storage().data_ptr() != grad.untyped_storage().data_ptr()
    expected_method = "shared_memory" if world_size > 1 else "all_reduce"
    assert comm.reduce_scatter_method(torch.zeros(1), None) == expected_method, "gloo on one host shares memory"
    with pytest.raises(ValueError, match="method must be"):
        comm.reduce_scatter(torch.empty(1), torch.zeros(world_size), None, async_op=False, method="ring")
    dist.barrier()


@world_sizes
def test_reduce_scatter_by_all_reduce_matches_reduce_scatter(world_size: int) -> None:
    run_distributed(_both_methods_give_the_reduce_scatter, world_size)


def _chunk_is_copied_out_after_the_wait(rank: int, world_size: int) -> None:
    """The kept chunk is a copy: overwriting the input after the wait does not
    change the output, and the work drops its reference to the input."""
    grad = torch.full((4 * world_size,), float(rank + 1))
    output = torch.empty(4)
    work = comm.reduce_scatter(output, grad, None, async_op=True, method="all_reduce")
    work.wait()
    grad.fill_(123.0)
    assert torch.all(output == sum(r + 1 for r in range(world_size)))
    assert isinstance(work, comm.ChunkOfAllReduce) and work._chunk is None


@world_sizes
def test_all_reduce_path_copies_the_chunk_and_releases_the_input(world_size: int) -> None:
    run_distributed(_chunk_is_copied_out_after_the_wait, world_size)
