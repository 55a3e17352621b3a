"""The plan's whole-step peak on a group whose collectives go through gloo's
messages (the shared memory switched off), against the CPU allocator, at 2
ranks: FULL_SHARD, SHARD_GRAD_OP, frozen LoRA and bf16 compute, each measured several
times, as tests/planning/test_plan.py measures them through shared memory.

On this path a collective's ``Work`` keeps references to the tensors it was
given, and gloo drops them on its worker thread after marking the work
complete, at a moment the OS scheduler picks (and where the profiler does
not see the free). A buffer the runtime lets go right after the wait (a
coalesced all-gather's side-by-side shards and gathered rows, a coalesced
reduction's concatenated gradients) then stays allocated past the moment
the plan frees it, in about one measured step of five on a busy two-core
machine: the measured peak came out up to 12% above the plan at the root's
backward. Each measurement here is a chance for that race; the plan holds
because the runtime frees those buffers itself, on its own thread, at the
wait (``comm.FreedAtWait``; the owner step's exchange likewise: [Note: the
exchange frees its buffers itself] in composable_shard/optim/owner_step.py)."""

from __future__ import annotations

from tests.support.comm_spies import gloo_only_group, shared_memory_switched_off
from tests.support.harness_pool import run_distributed
from tests.support.plan_measure import measure_case

CASES = ("full_shard", "shard_grad_op", "frozen_lora", "bf16_compute")
# Measurements of each case per rank: each is one chance for gloo's worker
# thread to hold a buffer past its free.
REPEATS = 3
# Tensors the plan leaves out, the most the measured peak may exceed it by:
# the tag check's exchange of one collective in flight (comm/tag_check.py:
# an int64 of this rank's and one per rank, and gloo's own copy of the
# gathered ones: 8 + 16 * world size, 40 B at 2 ranks). Measured: bf16
# compute's peak 40 B above the plan (its bucket's reduction issued at the
# end of backward), the others' equal to it; through shared memory, with no
# tag exchange, every case is exact (tests/planning/test_plan.py).
WORLD_SIZE = 2
UNPLANNED_BYTES = 8 + 16 * WORLD_SIZE


def _measure_through_messages(rank: int, world_size: int) -> list[dict]:
    """Every case REPEATS times on a new group that decided on gloo's
    messages, planned with the shared memory switched off likewise."""
    import torch.distributed as dist

    from composable_shard.comm import transport

    group = gloo_only_group(world_size)
    try:
        with shared_memory_switched_off():
            records = [
                measure_case(name, rank, world_size, process_group=group) for name in CASES for _ in range(REPEATS)
            ]
        for record in records:
            record["group_shares_memory"] = transport.shared_memory_of(group) is not None
        return records
    finally:
        dist.destroy_process_group(group)


def _check_message_path_record(record: dict) -> None:
    """Exact model state, plan == describe, no shared-memory line; the
    whole step's tensors (total less transport and runtime) never above the
    allocator's peak and below it by no more than UNPLANNED_BYTES."""
    where = f"{record['case']} rank {record['rank']}/{record['world_size']} through gloo's messages"
    allocated, planned, described = record["allocated"], record["planned"], record["described"]
    assert not record["group_shares_memory"], f"{where}: the group took shared memory"
    for key in ("params", "grads", "optimizer", "buffers"):
        assert planned[key] == allocated[key], f"{where}: planned {key} {planned[key]} != allocated {allocated[key]}"
        assert described[key] == allocated[key], f"{where}: described {key} {described[key]} != allocated {allocated[key]}"
    assert record["plan_table"] == record["describe_table"], f"{where}: plan and describe tables differ"
    assert planned["transport"] == described["transport"] == 0, f"{where}: a shared-memory transport was planned"
    tensors = planned["total"] - planned["transport"] - planned["runtime"]
    unplanned = allocated["peak"] - tensors
    assert 0 <= unplanned <= UNPLANNED_BYTES, (
        f"{where}: planned peak {tensors} vs measured {allocated['peak']} ({-unplanned:+d} B; allowed: 0 to "
        f"-{UNPLANNED_BYTES} B of tag exchange; worst moment {record['peak_moment']})"
    )


def test_plan_peak_equals_the_allocators_through_gloo_messages() -> None:
    results = run_distributed(_measure_through_messages, WORLD_SIZE, timeout=300)
    for records in results:
        assert len(records) == len(CASES) * REPEATS  # type: ignore[arg-type]
        for record in records:  # type: ignore[union-attr]
            _check_message_path_record(record)
