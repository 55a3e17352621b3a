"""CUDA: the fences and the host's wait around CPU offload, with negative
controls, and the offload and bf16 paths at two GPUs. Skipped where no GPU
is present (CI); tests/scheduler/test_cuda_offload.py and
tests/scheduler/test_cuda_lanes.py check the same rules on CPU.

The race tests train with ``backward(); optimizer.step()`` and nothing in
between — no loss printed, no ``unshard_params`` — and compare with the
reference only after several steps: every comparison synchronises the
device, and a comparison between ``backward`` and ``step`` would hide a
missing host wait (issue 23, finding 5). A ``torch.cuda._sleep`` enqueued on
the compute stream before each reduction is issued delays everything the
reduction lane does for it (the lane waits for compute before its launch),
so the gradient downloads land tens of milliseconds after ``backward()``
returns: without the host's wait the CPU optimizer reads gradients the
device has not written yet. The model is large enough (32 MiB per block in
fp32) that each upload takes milliseconds while compute on the tiny batch
takes microseconds: without the lane fence, compute reads a block's buffer
before its upload landed.

Each negative control runs the same training with one guard patched out —
the host's wait (``Scheduler.synchronize_host``), compute's wait on the
post-reduce fence of the downloads (``Scheduler._wait_for_post_reduce``),
or the lane fence of issues that launched no collective (the original race
in ``CudaStreamLane.issue``) — and asserts that it no longer matches the
reference: if a control passes, the test could not have caught the bug.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable, Iterator, Sequence
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import (
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    fully_shard,
    no_sync,
    unshard_params,
)
from composable_shard.comm import PendingCollective
from composable_shard.runtime.scheduler import CudaStreamLane, InFlight, Scheduler
from composable_shard.runtime import lazy_init
from composable_shard.runtime.state import get_state, unit_states_under

from tests.support.harness_pool import requires_cuda, requires_gpus, run_distributed
from tests.support.mixed_precision import cast_all
from tests.support.models import Block, batch, big_gpt, lm_loss
from tests.support.offload import cuda_device
from tests.support.parity import hybrid_groups

OFFLOAD = CPUOffload(offload_params=True)
BF16 = torch.bfloat16
FP32 = torch.float32
# About 30-60 ms on a current GPU (1.4-2 GHz): far longer than the CPU
# optimizer's step on this model, so an unwaited download is still pending.
_SLEEP_CYCLES = 100_000_000
_STEPS = 4


# ------------------------------------------------------------ mutations
def _issue_fencing_collectives_only(
    self: CudaStreamLane, launch: Callable[[], PendingCollective | None], *, after: Sequence[torch.cuda.Event] = ()
) -> InFlight:
    """``CudaStreamLane.issue`` before the fence fix: an event only when a
    collective was launched (copies alone went unfenced). It waits for all
    of compute, which covers the events ``after`` (recorded on compute)."""
    self.stream.wait_stream(torch.cuda.current_stream(self.device))
    with torch.cuda.stream(self.stream):
        pending = launch()
        event = None
        if pending is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
    return InFlight(pending, event)


def _drop_post_reduce(self: Scheduler) -> None:
    """Compute never waits on the downloads' post-reduce fence."""
    self._post_reduce = None


_MUTATIONS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "none": contextlib.nullcontext,
    "no host wait": lambda: mock.patch.object(Scheduler, "synchronize_host", lambda self: None),
    "no post-reduce fence": lambda: mock.patch.object(Scheduler, "_wait_for_post_reduce", _drop_post_reduce),
    "no lane fence": lambda: mock.patch.object(CudaStreamLane, "issue", _issue_fencing_collectives_only),
}


@contextlib.contextmanager
def _sleep_before_the_copies(model: nn.Module) -> Iterator[None]:
    """Enqueue a ``torch.cuda._sleep`` on the compute stream before every
    reduction the model's scheduler issues (the reduction lane waits for it,
    so everything it does for that reduction comes later), and one on the
    stream current at each gradient download, right before it (the
    reduction lane, where the scheduler finishes offloaded reductions)."""
    scheduler = lazy_init(get_state(model)).scheduler
    reduce = scheduler.reduce

    def sleepy_reduce(*args: object, **kwargs: object) -> None:
        torch.cuda._sleep(_SLEEP_CYCLES)
        reduce(*args, **kwargs)

    handles = [handle for _, state in unit_states_under(model) for handle in state.handles]
    for handle in handles:
        download = handle._download_grad

        def sleepy_download(shard_grad: torch.Tensor, existing: torch.Tensor | None, _download: Callable = download) -> torch.Tensor:
            torch.cuda._sleep(_SLEEP_CYCLES)
            return _download(shard_grad, existing)

        handle._download_grad = sleepy_download  # type: ignore[method-assign]
    scheduler.reduce = sleepy_reduce  # type: ignore[method-assign]
    try:
        yield
    finally:  # the bound methods show through again
        del scheduler.reduce
        for handle in handles:
            del handle._download_grad


def _max_difference(model: nn.Module, reference: nn.Module) -> float:
    """Largest absolute difference of the full parameters (inf when not
    finite). Synchronises the device: only after the last step."""
    worst = 0.0
    reference_params = dict(reference.named_parameters())
    with unshard_params(model, writeback=False):
        for name, param in model.named_parameters():
            difference = (param.detach().float() - reference_params[name].detach().float().to(param.device)).abs().max()
            worst = max(worst, difference.item() if torch.isfinite(difference) else float("inf"))
    return worst


# ---------------------------------------------- races at one GPU (offload)
def _offload_race(rank: int, world_size: int, mutation: str, user_stream: bool) -> float:
    """fp32 with CPU offload at one GPU (every unshard a fenced upload with
    no collective): ``_STEPS`` steps of ``backward(); step()`` with sleeps
    before the reductions, then the largest difference from a single-GPU
    reference trained the same way. With ``user_stream``, forward and
    backward run under a stream the user made current."""
    device = cuda_device(rank)
    torch.manual_seed(0)
    model = big_gpt().to(device)
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(_STEPS):
        inputs, targets = (t.to(device) for t in batch(step))
        lm_loss(reference(inputs), targets).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    torch.cuda.synchronize(device)
    fully_shard(model, policy={Block}, cpu_offload=OFFLOAD)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stream = torch.cuda.Stream(device) if user_stream else torch.cuda.current_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the model's initial values
    batches = [tuple(t.to(device) for t in batch(step)) for step in range(_STEPS)]
    torch.cuda.synchronize(device)
    with _MUTATIONS[mutation](), torch.cuda.stream(stream):
        with _sleep_before_the_copies(model):
            for inputs, targets in batches:
                lm_loss(model(inputs), targets).backward()
                optimizer.step()  # on CPU, on the offloaded shards: nothing in between
                optimizer.zero_grad()
    torch.cuda.synchronize(device)  # after the last step only
    return _max_difference(model, reference)


_TOLERANCE = 1e-4  # four SGD steps, CPU vs GPU elementwise update: ~1e-7


@requires_cuda
@pytest.mark.parametrize("user_stream", [False, True], ids=["default stream", "user stream"])
def test_offloaded_steps_with_nothing_between_backward_and_step_match_reference(user_stream: bool) -> None:
    (difference,) = run_distributed(_offload_race, 1, "none", user_stream, backend="nccl")
    assert difference < _TOLERANCE, difference


@requires_cuda
@pytest.mark.parametrize("mutation", ["no host wait", "no post-reduce fence", "no lane fence"])
def test_offload_race_test_fails_with_a_guard_patched_out(mutation: str) -> None:
    # The negative controls: the test above must be able to fail.
    (difference,) = run_distributed(_offload_race, 1, mutation, False, backend="nccl")
    assert difference > _TOLERANCE, f"with {mutation} the race test still passes (difference {difference})"


# ------------------------------------------- where the downloads run (finding 2)
def _download_streams(rank: int, world_size: int) -> list[bool]:
    """For every gradient download of one offloaded step: whether it ran on
    the reduction lane's stream (and not on compute)."""
    device = cuda_device(rank)
    torch.manual_seed(0)
    model = big_gpt().to(device)
    fully_shard(model, policy={Block}, cpu_offload=OFFLOAD)
    scheduler = lazy_init(get_state(model)).scheduler
    lane_stream = scheduler.reduce_scatter_lane.stream  # type: ignore[attr-defined]
    compute = torch.cuda.current_stream(device)
    on_lane: list[bool] = []
    for _, state in unit_states_under(model):
        for handle in state.handles:
            download = handle._download_grad

            def recorded(shard_grad: torch.Tensor, existing: torch.Tensor | None, _download: Callable = download) -> torch.Tensor:
                current = torch.cuda.current_stream(device)
                on_lane.append(current == lane_stream and current != compute)
                return _download(shard_grad, existing)

            handle._download_grad = recorded  # type: ignore[method-assign]
    inputs, targets = (t.to(device) for t in batch(0))
    lm_loss(model(inputs), targets).backward()
    return on_lane


@requires_cuda
def test_offloaded_gradient_downloads_run_on_the_reduction_lane() -> None:
    (on_lane,) = run_distributed(_download_streams, 1, backend="nccl")
    assert on_lane and all(on_lane), on_lane


# ------------------------------------------------ bf16 under a user stream
def _bf16_under_user_stream(rank: int, world_size: int) -> float:
    """bf16 compute (no offload) with forward and backward under a user
    stream; the optimizer steps on the device after the user's
    ``wait_stream`` (PyTorch's rule for using a tensor on another stream)."""
    device = cuda_device(rank)
    torch.manual_seed(0)
    model = big_gpt().to(device)
    master = copy.deepcopy(model)
    reference_optimizer = torch.optim.SGD(master.parameters(), lr=0.1)
    for step in range(_STEPS):
        compute = cast_all(master, BF16)
        inputs, targets = (t.to(device) for t in batch(step))
        lm_loss(compute(inputs).float(), targets).backward()
        for param, compute_param in zip(master.parameters(), compute.parameters()):
            param.grad = compute_param.grad.float()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    fully_shard(model, policy={Block}, mixed_precision=MixedPrecision(param_dtype=BF16, reduce_dtype=FP32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    for step in range(_STEPS):
        inputs, targets = (t.to(device) for t in batch(step))
        with torch.cuda.stream(stream):
            torch.cuda._sleep(_SLEEP_CYCLES)  # the lanes must order after it
            lm_loss(model(inputs).float(), targets).backward()
        torch.cuda.current_stream(device).wait_stream(stream)
        optimizer.step()
        optimizer.zero_grad()
        stream.wait_stream(torch.cuda.current_stream(device))
    return _max_difference(model, master)


@requires_cuda
def test_bf16_model_trained_under_a_user_stream_matches_reference() -> None:
    (difference,) = run_distributed(_bf16_under_user_stream, 1, backend="nccl")
    assert difference < _TOLERANCE, difference  # bf16 compute, fp32 master weights: both sides run the same kernels


# ------------------------------------- rebuilt offloaded gradients (finding 3)
def _rebuilt_offloaded_grads_are_pinned_and_accumulate(rank: int, world_size: int) -> None:
    """A ``.grad`` the user replaced (a pageable host tensor) breaks the
    tiling of the flat gradient: the next backward rebuilds it into pinned
    memory, uploads it, adds and downloads without blocking, and the result
    stays the ``.grad`` storage (pinned) for the steps after."""
    device = cuda_device(rank)
    torch.manual_seed(0)
    model = big_gpt().to(device)
    reference = copy.deepcopy(model)
    fully_shard(model, policy={Block}, cpu_offload=OFFLOAD)
    for step in range(3):
        inputs, targets = (t.to(device) for t in batch(step))
        for trained in (model, reference):
            lm_loss(trained(inputs), targets).backward()
        if step == 0:
            for trained in (model, reference):
                param = next(p for p in trained.parameters() if p.grad is not None and p.grad.numel() > 0)
                param.grad = param.grad * 2  # a new tensor, no longer a view of the flat gradient
    for name, param in model.named_parameters():
        assert param.grad is not None and (param.grad.numel() == 0 or param.grad.is_pinned()), f"{name}'s gradient is pageable"
    reference_params = dict(reference.named_parameters())
    with unshard_params(model, with_grads=True, writeback=False):
        for name, param in model.named_parameters():
            torch.testing.assert_close(
                param.grad.to(device), reference_params[name].grad, atol=2e-6, rtol=2e-5, msg=lambda m: f"grad of {name}: {m}"
            )


@requires_cuda
def test_rebuilt_offloaded_gradient_is_pinned_and_accumulates_like_the_reference() -> None:
    run_distributed(_rebuilt_offloaded_grads_are_pinned_and_accumulate, 1, backend="nccl")


# ------------------------------------------------------------ two GPUs
def _shard_two_gpus(model: nn.Module, strategy: ShardingStrategy, offload: bool, bf16: bool) -> None:
    kwargs: dict = dict(strategy=strategy, cpu_offload=OFFLOAD if offload else None)
    if bf16:
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=BF16, reduce_dtype=FP32)
    if strategy is ShardingStrategy.HYBRID_SHARD:
        kwargs["process_group"] = hybrid_groups(dist.get_world_size())
    fully_shard(model, policy={Block}, **kwargs)


def _two_gpu_parity(rank: int, world_size: int, strategy: ShardingStrategy, offload: bool, bf16: bool, use_no_sync: bool) -> None:
    """Against the data-parallel reference of tests/cuda/test_offload.py's
    ``_low_precision_parity`` (every rank's slice run on a copy of the
    master weights in the compute dtype, gradients averaged in fp32), on the
    same GPU, step by step. With ``use_no_sync`` each step is two
    micro-batches, the first under ``no_sync``: the sharded model sums them
    unsharded in the compute dtype, as the reference's compute copy does."""
    device = cuda_device(rank)
    dtype = BF16 if bf16 else FP32
    torch.manual_seed(0)
    model = big_gpt().to(device)
    master = copy.deepcopy(model)
    _shard_two_gpus(model, strategy, offload, bf16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference_optimizer = torch.optim.AdamW(master.parameters(), lr=1e-3)
    case = f"{strategy.name}, offload={offload}, bf16={bf16}, no_sync={use_no_sync}"
    per_rank = 8 // world_size
    micro_batches = 2 if use_no_sync else 1
    for step in range(3):
        when = f"{case}, step {step}"
        with unshard_params(model, writeback=False), torch.no_grad():
            for param, master_param in zip(model.parameters(), master.parameters()):
                master_param.copy_(param)
        inputs, targets = (t.to(device) for t in batch(step))
        reference_grads = {name: torch.zeros_like(p) for name, p in master.named_parameters()}
        for r in range(world_size):
            compute = cast_all(master, dtype)
            rank_inputs, rank_targets = (t[r * per_rank : (r + 1) * per_rank] for t in (inputs, targets))
            for micro in range(micro_batches):
                part = slice(micro * per_rank // micro_batches, (micro + 1) * per_rank // micro_batches)
                lm_loss(compute(rank_inputs[part]).float(), rank_targets[part]).backward()
            for name, param in compute.named_parameters():
                reference_grads[name] += param.grad.float()
        local_inputs, local_targets = (t[rank * per_rank : (rank + 1) * per_rank] for t in (inputs, targets))
        for micro in range(micro_batches):
            part = slice(micro * per_rank // micro_batches, (micro + 1) * per_rank // micro_batches)
            skip = use_no_sync and micro < micro_batches - 1
            with no_sync(model) if skip else contextlib.nullcontext():
                lm_loss(model(local_inputs[part]).float(), local_targets[part]).backward()
        for name, param in model.named_parameters():
            if offload:
                assert param.device.type == "cpu" and param.grad is not None and param.grad.device.type == "cpu", name
                assert param.grad.numel() == 0 or param.grad.is_pinned(), f"{when}: {name}'s gradient is pageable"
        with unshard_params(model, with_grads=True, writeback=False):
            for name, param in model.named_parameters():
                expected = reference_grads[name] / world_size
                torch.testing.assert_close(
                    param.grad.float().to(device), expected, atol=2e-6, rtol=2e-5, msg=lambda m: f"{when}, grad of {name}: {m}"
                )
        for name, master_param in master.named_parameters():
            master_param.grad = reference_grads[name] / world_size
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
    with unshard_params(model, writeback=False):
        for (name, param), master_param in zip(model.named_parameters(), master.parameters()):
            torch.testing.assert_close(
                param.detach().to(device), master_param.detach(), atol=2e-6, rtol=2e-5, msg=lambda m: f"{case}, {name}: {m}"
            )


_TWO_GPU_PATHS = [(True, False), (False, True), (True, True)]  # (offload, bf16): offload, bf16, both


@requires_gpus(2)
@pytest.mark.parametrize("use_no_sync", [False, True], ids=["", "no_sync"])
@pytest.mark.parametrize("offload, bf16", _TWO_GPU_PATHS, ids=["offload", "bf16", "offload+bf16"])
@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD])
def test_two_gpus_match_reference_every_step(strategy: ShardingStrategy, offload: bool, bf16: bool, use_no_sync: bool) -> None:
    """Upload + cast + all-gather, reduce-scatter + post-divide + download
    (FULL_SHARD), and the replicate all-reduce (HYBRID_SHARD at two ranks is
    one rank per shard group, two replicas) at world size 2."""
    run_distributed(_two_gpu_parity, 2, strategy, offload, bf16, use_no_sync, backend="nccl")


def _two_gpu_race(rank: int, world_size: int, mutation: str) -> float:
    """The offload race at two GPUs (FULL_SHARD: reduce-scatters, then
    downloads on the reduction lane), ``backward(); step()`` only."""
    device = cuda_device(rank)
    torch.manual_seed(0)
    model = big_gpt().to(device)
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    per_rank = 8 // world_size
    for step in range(_STEPS):
        inputs, targets = (t.to(device) for t in batch(step))
        lm_loss(reference(inputs), targets).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    fully_shard(model, policy={Block}, cpu_offload=OFFLOAD)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    batches = [tuple(t.to(device)[local] for t in batch(step)) for step in range(_STEPS)]
    torch.cuda.synchronize(device)
    with _MUTATIONS[mutation]():
        with _sleep_before_the_copies(model):
            for inputs, targets in batches:
                # Each rank's mean over its slice; the reduction averages
                # them: the mean over the global batch.
                lm_loss(model(inputs), targets).backward()
                optimizer.step()
                optimizer.zero_grad()
    torch.cuda.synchronize(device)  # after the last step only
    return _max_difference(model, reference)


@requires_gpus(2)
@pytest.mark.parametrize("mutation", ["none", "no host wait", "no post-reduce fence"])
def test_two_gpu_offload_race_and_its_negative_controls(mutation: str) -> None:
    differences = run_distributed(_two_gpu_race, 2, mutation, backend="nccl")
    if mutation == "none":
        assert max(differences) < _TOLERANCE, differences
    else:
        assert max(differences) > _TOLERANCE, f"with {mutation} the race test still passes ({differences})"

