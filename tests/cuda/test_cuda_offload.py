"""CPU offload's gradient downloads under CUDA's stream rules, checked on
CPU with the recording stand-in of tests/support/fake_cuda.py (CI has no GPU).

What these guard (issue 23, finding 2; "The host is a third party" in
[Note: lane fences], composable_shard/scheduler.py): an offloaded
reduction is finished on the reduction lane — the download of each reduced
gradient into pinned host memory, and when accumulating the upload, add and
download — so those copies never sit on the compute stream in front of the
next unit's backward kernels; compute waits on the post-reduce fence only
before the next finish on the lane and at the end of backward; and the
host's one wait (``Scheduler.synchronize_host``) orders every download
before the optimizer reads the gradients. Moving the downloads back onto
compute, dropping the host's wait, or dropping compute's wait on the
post-reduce fence each fails a test here.

The device work is described to the fake by wrappers at the point where the
real code enqueues it (``reduce_grad`` inside the lane's issue,
``finish_grad_reduction`` and ``_download_grad`` wherever the scheduler runs
the finish); the stream they land on is whatever the scheduler made
current. The tensors stay on CPU; ``_download_grad``'s pinned host copy,
which a CPU-only build cannot allocate, is replaced by a plain host copy.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from composable_shard import MixedPrecision, ShardingStrategy, fully_shard, no_sync
from composable_shard.comm import PendingCollective
from composable_shard.handle import FlatParamHandle
from composable_shard.runtime import lazy_init
from composable_shard.runtime.scheduler import CudaStreamLane, Scheduler
from composable_shard.runtime.state import get_state, unit_states_under

from tests.support.fake_cuda import FakeCuda, Op, happens_before
from tests.support.harness_pool import run_distributed
from tests.support.models import Block, TinyGPT, batch, lm_loss

_CUDA = torch.device("cuda", 0)  # only a label: nothing touches a device


# ------------------------------------------------------ the scheduler alone
def _issue_offloaded_reduction(
    cuda: FakeCuda, scheduler: Scheduler, index: int, downloads: list[Op], backward_ops: list[Op]
) -> None:
    """Backward writes gradient ``index`` (a block of compute's pool); the
    lane all-reduces it in place (``NO_SHARD``: the gradient is the output,
    as without a cast); the finish downloads it into host memory."""
    memory = cuda.memory
    op = cuda.launch(f"backward {index}")
    backward_ops.append(op)
    gradient = torch.zeros(4)
    memory.allocate(f"gradient {index}", op)
    # The host frees the gradient when the last reference goes: from then on
    # compute's next allocation may reuse its block.
    weakref.finalize(gradient, memory.free, f"gradient {index}", allocated_on="compute")

    def launch(async_op: bool) -> PendingCollective:
        memory.access(f"gradient {index}", cuda.launch(f"all-reduce {index}"), write=True)
        return PendingCollective(None, gradient, ())

    def on_done(reduced: PendingCollective) -> None:
        download = cuda.launch(f"download {index}")
        memory.access(f"gradient {index}", download, write=False)
        memory.access(f"host gradient {index}", download, write=True)
        downloads.append(download)

    scheduler.reduce(launch, on_done, finish_on_lane=True)


def test_offloaded_downloads_run_on_the_reduction_lane_and_the_host_wait_covers_them() -> None:
    cuda = FakeCuda()
    downloads: list[Op] = []
    backward_ops: list[Op] = []
    count = 4
    with cuda.installed():
        scheduler = Scheduler(_CUDA, limit_all_gathers=True)
        reduce_stream = scheduler.reduce_scatter_lane.stream.name  # type: ignore[attr-defined]
        for index in range(count):
            _issue_offloaded_reduction(cuda, scheduler, index, downloads, backward_ops)
        scheduler.wait_for_all()
        scheduler.synchronize_host()
        optimizer = cuda.host_op("optimizer reads the gradients")
        for index in range(count):
            cuda.memory.access(f"host gradient {index}", optimizer, write=False)
        after = cuda.launch("next forward")
        cuda.memory.allocate("next step's gradient", after)
    assert cuda.memory.races == [], cuda.memory.races
    assert [op.stream for op in downloads] == [reduce_stream] * count
    # Off compute: the download of reduction i is enqueued when reduction
    # i + 1 is issued, and the backward kernels compute runs next (those of
    # gradient i + 2) do not wait for it.
    for index in range(count - 2):
        assert not happens_before(downloads[index], backward_ops[index + 2]), index
    # The host's one wait is on the compute stream, which waited on the
    # post-reduce fence at the end of backward.
    assert [entry for entry in cuda.log if entry[0] == "synchronize"] == [("synchronize", "compute", "")]


def test_finishes_that_stay_on_the_device_run_on_compute() -> None:
    cuda = FakeCuda()
    streams: list[str] = []
    with cuda.installed():
        scheduler = Scheduler(_CUDA, limit_all_gathers=True)
        for _ in range(2):
            scheduler.reduce(
                lambda async_op: PendingCollective(None, torch.zeros(1), ()),
                lambda reduced: streams.append(cuda.launch("finish").stream),
            )
        scheduler.wait_for_all()
    assert streams == ["compute", "compute"]


# ------------------------------------------------------- a whole model
class _OffloadRecorder:
    """Marks every handle of a sharded model as offloaded and describes its
    gradient work to the fake: backward writing the unsharded gradient on
    compute, the reduction on the lane, the finish and the download (or
    upload, add and download) wherever the scheduler runs them."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.names: list[str] = []
        # Device memory name of each live gradient or reduced output, by id.
        self.memory_names: dict[int, str] = {}
        self.allocations = 0
        # (handle name, op) of every download and upload of a gradient.
        self.copies: list[tuple[str, Op]] = []

    def _allocate(self, tensor: torch.Tensor, what: str, op: Op) -> None:
        self.allocations += 1
        name = f"{what} #{self.allocations}"
        self.memory_names[id(tensor)] = name
        self.cuda.memory.allocate(name, op)
        weakref.finalize(tensor, self.cuda.memory.free, name, allocated_on=op.stream)

    def instrument(self, handle: FlatParamHandle, name: str) -> None:
        cuda, memory = self.cuda, self.cuda.memory
        self.names.append(name)
        handle.offload_params = True  # only the flag: the shard stays a CPU tensor
        reduce_grad, finish = handle.reduce_grad, handle.finish_grad_reduction

        def recorded_reduce_grad(*, async_op: bool) -> PendingCollective | None:
            gradient = handle.unsharded_flat_param.grad
            pending = reduce_grad(async_op=async_op)
            if pending is not None:
                op = cuda.launch(f"reduce {name}")
                memory.access(self.memory_names[id(gradient)], op, write=False)
                if pending.output is not gradient:
                    self._allocate(pending.output, f"reduced {name}", op)
            return pending

        def recorded_finish(reduced: PendingCollective) -> None:
            op = cuda.launch(f"finish {name}")  # post-divide and cast read the output
            memory.access(self.memory_names[id(reduced.output)], op, write=False)
            finish(reduced)

        def recorded_download(shard_grad: torch.Tensor, existing: torch.Tensor | None) -> torch.Tensor:
            if existing is None:
                host = shard_grad.clone()
            else:
                upload = cuda.launch(f"upload {name}")
                memory.access(f"host gradient {name}", upload, write=False)
                self.copies.append((name, upload))
                host = existing.add_(shard_grad.to(existing.dtype))
            download = cuda.launch(f"download {name}")
            memory.access(f"host gradient {name}", download, write=True)
            self.copies.append((name, download))
            return host

        handle.reduce_grad = recorded_reduce_grad  # type: ignore[method-assign]
        handle.finish_grad_reduction = recorded_finish  # type: ignore[method-assign]
        handle._download_grad = recorded_download  # type: ignore[method-assign]

    def install(self, scheduler: Scheduler) -> None:
        """Backward writes each gradient on compute before its reduction is
        issued (the post-backward hook runs right after)."""
        reduce = scheduler.reduce

        def recorded_reduce(launch: Callable, on_done: Callable, **kwargs: bool) -> None:
            handle = launch.args[0]  # functools.partial(_launch_reduce, handle)
            gradient = handle.unsharded_flat_param.grad
            if gradient is not None:
                self._allocate(gradient, "gradient", self.cuda.launch("backward writes a gradient"))
            reduce(launch, on_done, **kwargs)

        scheduler.reduce = recorded_reduce  # type: ignore[method-assign]

    def optimizer_reads_gradients(self, what: str) -> None:
        op = self.cuda.host_op(what)
        for name in self.names:
            self.cuda.memory.access(f"host gradient {name}", op, write=False)


_BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
_CASES: dict[str, dict] = {
    "full_shard fp32": dict(strategy=ShardingStrategy.FULL_SHARD),
    "full_shard bf16": dict(strategy=ShardingStrategy.FULL_SHARD, mixed_precision=_BF16),
    "no_shard fp32": dict(strategy=ShardingStrategy.NO_SHARD),
}


def _train_offloaded_under_fake_cuda(rank: int, world_size: int, case: str, accumulate: str) -> list[str]:
    """Four backwards of a 4-unit model with offloaded handles under the
    fake: ``accumulate`` "none" (step and zero every backward), "backwards"
    (zero every second step: the upload, add, download path) or "no_sync"
    (every second backward inside ``no_sync``). Returns the problems found."""
    cuda = FakeCuda()
    with cuda.installed():
        torch.manual_seed(0)
        model = TinyGPT(n_blocks=3)
        fully_shard(model, policy={Block}, **_CASES[case])
        recorder = _OffloadRecorder(cuda)
        for fqn, state in unit_states_under(model):
            for index, handle in enumerate(state.handles):
                if handle.requires_grad:
                    recorder.instrument(handle, f"{fqn or '<root>'}#{index}")
        context = lazy_init(get_state(model))
        scheduler = context.scheduler
        scheduler.all_gather_lane = CudaStreamLane(_CUDA, priority=-1)
        scheduler.reduce_scatter_lane = CudaStreamLane(_CUDA, priority=0)
        scheduler.device = _CUDA  # synchronize_host waits on the (fake) compute stream
        recorder.install(scheduler)
        reduce_stream = scheduler.reduce_scatter_lane.stream.name
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        per_rank = 8 // world_size
        local = slice(rank * per_rank, (rank + 1) * per_rank)
        for step in range(4):
            inputs, targets = batch(step)
            skips_sync = accumulate == "no_sync" and step % 2 == 0
            if skips_sync:
                with no_sync(model):
                    lm_loss(model(inputs[local]).float(), targets[local]).backward()
                continue
            lm_loss(model(inputs[local]).float(), targets[local]).backward()
            recorder.optimizer_reads_gradients(f"optimizer step {step}")
            optimizer.step()
            if accumulate != "backwards" or step % 2 == 1:
                optimizer.zero_grad()
    problems = list(cuda.memory.races)
    if not recorder.copies:
        problems.append("no gradient download was recorded")
    problems += [f"{op.what} ran on {op.stream}, not on the reduction lane" for _, op in recorder.copies if op.stream != reduce_stream]
    uploads = [op for _, op in recorder.copies if op.what.startswith("upload")]
    if (accumulate == "backwards") != bool(uploads):
        problems.append(f"accumulate={accumulate} gave {len(uploads)} uploads of host gradients")
    return problems


def test_offloaded_training_downloads_off_compute_without_races() -> None:
    # World size 1: every handle's reduction output is the gradient itself
    # (fp32) or a cast of it (bf16); 2: reduce-scatters.
    runs = [(1, "full_shard fp32", "backwards"), (1, "full_shard bf16", "no_sync"), (2, "full_shard bf16", "backwards")]
    runs += [(2, "no_shard fp32", "none"), (2, "full_shard fp32", "no_sync")]
    for world_size, case, accumulate in runs:
        results = run_distributed(_train_offloaded_under_fake_cuda, world_size, case, accumulate)
        for rank, problems in enumerate(results):
            assert problems == [], (world_size, case, accumulate, rank, problems)
