"""The scheduler's contract: compute never consumes a lane's work without
its fence (see [Note: lane fences] in composable_shard/scheduler.py).

A recording lane (a real ``Lane`` that calls through to the CPU lane and
records every issue and every wait) is installed in a sharded model's
scheduler; the model's handles report which issue ran their work and check,
each time a buffer is used (forward views built, buffer freed, reduced
gradient finished, gradients read after backward), that every issue that
touched it was waited on. On CPU the lane's copies run synchronously, so a
missing fence does not corrupt results here; on CUDA it is a data race (see
tests/cuda/test_offload.py for the GPU reproductions).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Callable, Sequence

import pytest
import torch
import torch.nn as nn

from composable_shard import BackwardPrefetch, MixedPrecision, ShardingStrategy, fully_shard
from composable_shard.comm import PendingCollective
from composable_shard.handle import FlatParamHandle
from composable_shard.runtime import lazy_init
from composable_shard.runtime.scheduler import CpuLane, InFlight, Lane, Scheduler
from composable_shard.runtime.state import get_state, unit_states_under

from tests.support.harness_pool import run_distributed
from tests.support.models import Block, TinyGPT, batch, lm_loss


class RecordingLane:
    """A lane that runs every issue through the lane it wraps and records
    which issue is running and which issues compute waited on."""

    def __init__(self, inner: Lane, name: str) -> None:
        self.inner = inner
        self.name = name
        self.async_op = inner.async_op
        self.shares_host_memory = inner.shares_host_memory
        self.issues = 0
        self.waited: set[int] = set()
        # The issue whose launch is running now (None outside issue).
        self.running: int | None = None
        # Issued fences not waited yet, with their issue numbers.
        self._open: list[tuple[InFlight, int]] = []

    def mark_compute(self) -> torch.cuda.Event | None:
        return self.inner.mark_compute()

    def issue(
        self, launch: Callable[[], PendingCollective | None], *, after: Sequence[torch.cuda.Event] = ()
    ) -> InFlight:
        number = self.issues
        self.issues += 1
        self.running = number
        try:
            in_flight = self.inner.issue(launch, after=after)
        finally:
            self.running = None
        if in_flight is not None:  # the contract says never None; the check below reports it
            self._open.append((in_flight, number))
        return in_flight

    def wait(self, in_flight: InFlight) -> None:
        for index, (fence, number) in enumerate(self._open):
            if fence is in_flight:
                del self._open[index]
                self.waited.add(number)
                break
        else:
            raise AssertionError(f"{self.name}: wait on a fence it did not issue, or waited twice")
        self.inner.wait(in_flight)

    def unwaited(self, numbers: list[int]) -> list[int]:
        return [number for number in numbers if number not in self.waited]


class FenceAudit:
    """Which issues touched which handle, and the checks at every use."""

    def __init__(self, all_gather: RecordingLane, reduce: RecordingLane) -> None:
        self.all_gather = all_gather
        self.reduce = reduce
        self.gathers: dict[int, list[int]] = defaultdict(list)  # id(handle) -> issue numbers
        self.reductions: dict[int, list[int]] = defaultdict(list)
        self.copy_only_issues = 0  # unshards that copied without a collective
        self.checks = 0

    def instrument(self, handle: FlatParamHandle, name: str) -> None:
        """Shadow the handle's methods with ones that record and check, then
        call the real method."""
        key = id(handle)
        unshard, reduce_grad = handle.unshard, handle.reduce_grad
        use_views, reshard, finish = handle.use_unsharded_views, handle.reshard, handle.finish_grad_reduction

        def recorded_unshard(*, async_op: bool) -> PendingCollective | None:
            was_unsharded = handle.is_unsharded
            pending = unshard(async_op=async_op)
            if self.all_gather.running is None:
                raise AssertionError(f"{name}: unshard ran outside the all-gather lane")
            self.gathers[key].append(self.all_gather.running)
            if pending is None and not was_unsharded:
                self.copy_only_issues += 1
            return pending

        def recorded_reduce_grad(*, async_op: bool) -> PendingCollective | None:
            if self.reduce.running is None:
                raise AssertionError(f"{name}: reduce_grad ran outside the reduce lane")
            self.reductions[key].append(self.reduce.running)
            return reduce_grad(async_op=async_op)

        def checked(lane: RecordingLane, issued: dict[int, list[int]], what: str, method: Callable) -> Callable:
            @functools.wraps(method)
            def run(*args: object, **kwargs: object) -> object:
                self.checks += 1
                missing = lane.unwaited(issued[key])
                if missing:
                    raise AssertionError(
                        f"{name}: {what} while {lane.name} issue(s) {missing} of this handle were never waited on"
                    )
                return method(*args, **kwargs)

            return run

        handle.unshard = recorded_unshard  # type: ignore[method-assign]
        handle.reduce_grad = recorded_reduce_grad  # type: ignore[method-assign]
        handle.use_unsharded_views = checked(self.all_gather, self.gathers, "views built", use_views)  # type: ignore[method-assign]
        handle.reshard = checked(self.all_gather, self.gathers, "buffer freed", reshard)  # type: ignore[method-assign]
        handle.finish_grad_reduction = checked(self.reduce, self.reductions, "gradient finished", finish)  # type: ignore[method-assign]

    def check_all_waited(self, when: str) -> None:
        for lane in (self.all_gather, self.reduce):
            missing = [number for number in range(lane.issues) if number not in lane.waited]
            if missing:
                raise AssertionError(f"{when}: {lane.name} issue(s) {missing} were never waited on")


def _install(model: nn.Module) -> FenceAudit:
    root = get_state(model)
    assert root is not None
    scheduler = lazy_init(root).scheduler
    all_gather = RecordingLane(scheduler.all_gather_lane, "all-gather lane")
    reduce = RecordingLane(scheduler.reduce_scatter_lane, "reduce lane")
    scheduler.all_gather_lane, scheduler.reduce_scatter_lane = all_gather, reduce
    audit = FenceAudit(all_gather, reduce)
    for name, state in unit_states_under(model):
        for index, handle in enumerate(state.handles):
            audit.instrument(handle, f"unit '{name or '<root>'}' handle {index}")
    return audit


_BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

# name -> fully_shard keywords. bf16 at shard size 1 makes every unshard a
# copy into the unit's own buffer with no collective: the case of the race.
_CASES: dict[str, dict] = {
    "full_shard bf16": dict(strategy=ShardingStrategy.FULL_SHARD, mixed_precision=_BF16),
    "full_shard bf16 prefetch": dict(
        strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=_BF16,
        forward_prefetch=True,
        backward_prefetch=BackwardPrefetch.BACKWARD_POST,
    ),
    "no_shard bf16": dict(strategy=ShardingStrategy.NO_SHARD, mixed_precision=_BF16),
    "shard_grad_op bf16": dict(strategy=ShardingStrategy.SHARD_GRAD_OP, mixed_precision=_BF16),
    "full_shard fp32": dict(strategy=ShardingStrategy.FULL_SHARD),
}


def _every_lane_issue_is_waited_before_use(rank: int, world_size: int, case: str) -> tuple[int, int]:
    torch.manual_seed(0)
    model = TinyGPT()
    fully_shard(model, policy={Block}, **_CASES[case])
    audit = _install(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per_rank = 8 // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    for step in range(2):
        inputs, targets = batch(step)
        loss = lm_loss(model(inputs[local]).float(), targets[local])
        loss.backward()
        audit.check_all_waited(f"{case}, step {step}: gradients read after backward")
        for name, param in model.named_parameters():
            if param.grad is not None:
                assert torch.isfinite(param.grad).all(), f"{case}, step {step}: gradient of {name}"
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        model(batch(2)[0][local])
    audit.check_all_waited(f"{case}: after an eval forward")
    assert audit.checks > 0
    return audit.copy_only_issues, audit.all_gather.issues


@pytest.mark.parametrize("case", list(_CASES))
@pytest.mark.parametrize("world_size", [1, 2])
def test_compute_never_consumes_a_lane_issue_without_its_fence(world_size: int, case: str) -> None:
    results = run_distributed(_every_lane_issue_is_waited_before_use, world_size, case)
    copy_only, issues = results[0]
    assert issues > 0
    shard_size_one = world_size == 1 or "no_shard" in case
    if shard_size_one and "bf16" in case:
        # The cases that matter: unshards that ran copies and no collective.
        assert copy_only > 0, (case, results)


# ---------------------------------------------------------- scheduler alone
def test_scheduler_fences_issues_that_launch_no_collective() -> None:
    scheduler = Scheduler(torch.device("cpu"), limit_all_gathers=True)
    lane = RecordingLane(CpuLane(), "all-gather lane")
    reduce_lane = RecordingLane(CpuLane(), "reduce lane")
    scheduler.all_gather_lane, scheduler.reduce_scatter_lane = lane, reduce_lane
    buffer = torch.zeros(4)

    def copy_only(async_op: bool) -> None:
        buffer.copy_(torch.arange(4.0))  # work on the lane, no collective
        return None

    scheduler.unshard("unit", copy_only)
    assert scheduler.has_pending_unshard("unit")
    scheduler.wait_for_unshard("unit")
    assert lane.waited == {0} and not scheduler.has_pending_unshard("unit")

    finished: list[PendingCollective] = []
    scheduler.reduce(lambda async_op: None, finished.append)
    output = torch.ones(2)
    scheduler.reduce(lambda async_op: PendingCollective(None, output, ()), finished.append)
    # The first (nothing to finish) was fenced when the second pushed it out.
    assert reduce_lane.waited == {0} and finished == []
    scheduler.wait_for_all()
    assert reduce_lane.waited == {0, 1} and [p.output for p in finished] == [output]
