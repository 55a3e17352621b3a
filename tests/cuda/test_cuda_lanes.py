"""The CUDA lanes, checked on CPU: ``CudaStreamLane``, the scheduler and the
runtime run against a recording stand-in for ``torch.cuda``'s streams and
events (tests/support/fake_cuda.py), which applies CUDA's stream-ordering rules and
reports every unordered pair of conflicting accesses — what would be a data
race on a GPU. CI has no GPU; these tests are what guards
[Note: lane fences], [Note: what a lane waits for] and [Note: buffer
lifetimes across lanes] there: every issue race-free, waiting on nothing
later than it needs, and (issue 23's contract, a 4-unit model) the forward
all-gather of block k+1 never behind the end of block k's forward.

What the fake sees is only what the scheduler and the runtime do with
streams and events. The device work itself (all-gathers, casts, uploads,
reductions, the offloaded gradient downloads of [Note: CPU offload copies])
is described to it by wrappers around the handle's methods, at the point
where the real code enqueues it; the tensors stay on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, Iterator, NamedTuple

import torch

from composable_shard import BackwardPrefetch, MixedPrecision, ShardingStrategy, fully_shard
from composable_shard.comm import PendingCollective
from composable_shard.handle import FlatParamHandle
from composable_shard.runtime import gather_buckets, grad_buckets, lazy_init
from composable_shard.runtime.scheduler import CudaStreamLane, Scheduler
from composable_shard.runtime.state import get_state, unit_states_under

from tests.support.fake_cuda import FakeCuda, Op
from tests.support.comm_spies import collectives_alone
from tests.support.harness_pool import run_distributed
from tests.support.models import Block, TinyGPT, batch, lm_loss

_CUDA = torch.device("cuda", 0)  # only a label: nothing touches a device


# ------------------------------------------------------------- one lane
def _lane_run(cuda: FakeCuda, lane: CudaStreamLane, *, launches_collective: bool) -> None:
    """Compute writes a gradient; the lane casts it (and maybe reduces)
    after the mark of that write; compute waits and reads the result."""
    memory = cuda.memory
    memory.access("gradient", cuda.launch("backward writes gradient"), write=True)
    written = lane.mark_compute()
    cuda.launch("backward of the next unit")  # the lane need not wait for it

    def launch() -> PendingCollective | None:
        op = cuda.launch("cast gradient")
        memory.access("gradient", op, write=False)
        memory.access("cast", op, write=True)
        if not launches_collective:
            return None  # copies only: the case of the original race
        memory.access("cast", cuda.launch("all-reduce"), write=True)
        return PendingCollective(None, torch.zeros(1), ())

    in_flight = lane.issue(launch, after=[written] if written is not None else [])
    lane.wait(in_flight)
    memory.access("cast", cuda.launch("finish reduction reads cast"), write=False)


def test_cuda_lane_fences_its_work_with_or_without_a_collective() -> None:
    for launches_collective in (False, True):
        cuda = FakeCuda()
        with cuda.installed():
            lane = CudaStreamLane(_CUDA, priority=-1)
            _lane_run(cuda, lane, launches_collective=launches_collective)
        assert cuda.memory.races == [], cuda.memory.races
        name = lane.stream.name
        kinds = [(kind, stream) for kind, stream, _ in cuda.log]
        # The lane waits on the mark of the gradient's write before its
        # launch (and on nothing else: not the compute stream as a whole),
        # records after it, and compute waits on that record before reading.
        first_launch = kinds.index(("launch", name))
        assert kinds.index(("wait_event", name)) < first_launch
        assert ("wait_stream", name) not in kinds
        record = max(i for i, entry in enumerate(kinds) if entry == ("record", name))
        assert record > max(i for i, entry in enumerate(kinds) if entry == ("launch", name))
        assert kinds.index(("wait_event", "compute")) > record
        cast = next(op for op, _ in cuda.memory.accesses["gradient"] if op.what == "cast gradient")
        assert cast.clock["compute"] == 1, "the cast waits for the gradient's write only"


def test_fake_cuda_reports_an_unfenced_read_and_a_missing_host_wait() -> None:
    # The checker can fail: compute reading the lane's output without a
    # wait, and the host reading a download it did not wait for.
    cuda = FakeCuda()
    with cuda.installed():
        lane_stream = torch.cuda.Stream(device=_CUDA)
        with torch.cuda.stream(lane_stream):
            cuda.memory.access("buffer", cuda.launch("all-gather"), write=True)
        cuda.memory.access("buffer", cuda.launch("forward"), write=False)
        cuda.memory.access("host gradient", cuda.launch("download"), write=True)
        cuda.memory.access("host gradient", cuda.host_op("optimizer"), write=False)
    assert len(cuda.memory.races) == 2, cuda.memory.races
    assert "'forward' on compute" in cuda.memory.races[0]
    assert "'optimizer' on host" in cuda.memory.races[1]


def test_scheduler_host_wait_orders_downloads_before_host_reads() -> None:
    cuda = FakeCuda()
    with cuda.installed():
        scheduler = Scheduler(_CUDA, limit_all_gathers=True)
        reduce_stream = scheduler.reduce_scatter_lane.stream  # type: ignore[attr-defined]
        memory = cuda.memory
        memory.access("gradient", cuda.launch("backward"), write=True)

        def launch(async_op: bool) -> PendingCollective:
            op = cuda.launch("reduce-scatter")
            memory.access("gradient", op, write=False)
            memory.allocate("reduced", op)
            return PendingCollective(None, torch.zeros(1), ())

        def on_done(reduced: PendingCollective) -> None:
            # A finish on compute (no finish_on_lane): offloaded ones run on
            # the reduction lane, tests/scheduler/test_cuda_offload.py.
            op = cuda.launch("download")
            memory.access("reduced", op, write=False)
            memory.access("host gradient", op, write=True)

        scheduler.reduce(launch, on_done)
        scheduler.wait_for_all()
        scheduler.synchronize_host()
        memory.access("host gradient", cuda.host_op("optimizer reads gradient"), write=False)
    assert memory.races == [], memory.races
    assert reduce_stream.name != "compute" and ("synchronize", "compute", "") in cuda.log


def test_a_reductions_inputs_go_at_its_wait_before_its_finish_allocates() -> None:
    # [Note: buffer lifetimes across lanes]: the gradients compute allocated
    # and the lane read (a bucket's, on CUDA) stay referenced until compute
    # waited on the fence, and not a moment longer: the finish's copies may
    # reuse their blocks, ordered after the lane's reads. Before, they lived
    # through the finish (one bucket of gradients more at the CUDA peak, seen
    # on an H200 by tests/planning/test_plan.py's CUDA variant).
    cuda = FakeCuda()
    seen: list[tuple[bool, bool]] = []
    with cuda.installed():
        scheduler = Scheduler(_CUDA, limit_all_gathers=True)
        memory = cuda.memory
        alive: list[weakref.ref] = []

        def launch(async_op: bool) -> PendingCollective:
            gradient = torch.ones(4)  # compute's, held only by the pending collective
            memory.access("gradient", cuda.launch("backward writes gradient"), write=True)
            weakref.finalize(gradient, memory.free, "gradient", allocated_on="compute")
            alive.append(weakref.ref(gradient))
            with torch.cuda.stream(scheduler.reduce_scatter_lane.stream):  # type: ignore[attr-defined]
                op = cuda.launch("all-reduce of the bucket")
                memory.access("gradient", op, write=False)
                memory.allocate("summed", op)
            return PendingCollective(None, torch.zeros(4), (gradient,))

        def on_done(reduced: PendingCollective) -> None:
            seen.append((alive[-1]() is None, reduced.inputs == ()))
            memory.allocate("finished shard", cuda.launch("finish copies the shard"))

        scheduler.reduce(launch, on_done)
        scheduler.reduce(launch, on_done)  # pushes the first out
        scheduler.wait_for_reductions()
    assert seen == [(True, True), (True, True)]
    assert memory.races == [], memory.races


def test_scheduler_holds_a_freed_buffer_only_until_the_next_all_gather_allocated() -> None:
    # [Note: what a lane waits for]: a held buffer is freed right after the
    # next all-gather's launch, before its own unit is gathered again, and
    # by wait_for_all; nothing is held while an all-gather is in flight.
    cuda = FakeCuda()
    freed: list[str] = []
    launched: list[str] = []
    with cuda.installed():
        scheduler = Scheduler(_CUDA, limit_all_gathers=True)

        def launch(key: str) -> Callable[[bool], None]:
            return lambda async_op: launched.append(f"{key} after {freed}")

        scheduler.unshard("a", launch("a"))
        scheduler.wait_for_unshard("a")
        scheduler.free_unsharded("a", lambda: freed.append("a"), defer=True)
        assert freed == []  # held: the next all-gather must not get its block
        scheduler.unshard("b", launch("b"))
        assert launched[-1] == "b after []" and freed == ["a"]
        scheduler.wait_for_unshard("b")
        scheduler.free_unsharded("b", lambda: freed.append("b"), defer=True)
        scheduler.unshard("b", launch("b"))  # its own unit again: freed first
        assert launched[-1] == "b after ['a', 'b']"
        scheduler.wait_for_unshard("b")
        scheduler.free_unsharded("b", lambda: freed.append("b"), defer=True)
        scheduler.wait_for_all()
        assert freed == ["a", "b", "b"]
        scheduler.unshard("c", launch("c"))  # a prefetch in flight: no hold
        scheduler.free_unsharded("a", lambda: freed.append("a"), defer=True)
        assert freed[-1] == "a"
        scheduler.wait_for_all()
    waits = [label for kind, stream, label in cuda.log if kind == "wait_event" and stream != "compute"]
    # "b" waited on nothing (its block could not be a's), the second "b" on
    # the events of a's and b's frees, "c" on that of b's second free.
    assert len(waits) == 3, cuda.log


def test_a_flat_parameter_found_gathered_frees_the_held_buffer_as_an_issue_would() -> None:
    # A coalesced all-gather's follower issues nothing at its pre-forward
    # (use_gathered); the buffer the previous unit's post-forward held back
    # goes there, as when every follower issued an empty launch, and the
    # next all-gather waits for its free.
    cuda = FakeCuda()
    freed: list[str] = []
    with cuda.installed():
        scheduler = Scheduler(_CUDA, limit_all_gathers=True)
        scheduler.unshard_together(("a", "b", "c"), lambda async_op: None)
        scheduler.wait_for_unshard("a")
        scheduler.free_unsharded("a", lambda: freed.append("a"), defer=True)
        assert freed == []
        scheduler.use_gathered()  # "b", gathered with "a"
        assert freed == ["a"]
        scheduler.free_unsharded("b", lambda: freed.append("b"), defer=True)
        scheduler.use_gathered()  # "c"
        assert freed == ["a", "b"]
        waits_before = sum(1 for kind, stream, _ in cuda.log if kind == "wait_event" and stream != "compute")
        scheduler.unshard("d", lambda async_op: None)
        waits = sum(1 for kind, stream, _ in cuda.log if kind == "wait_event" and stream != "compute")
        assert waits - waits_before == 2, cuda.log  # the events of a's and b's frees
        scheduler.wait_for_all()


# ------------------------------------------------------- a whole model
class _Recorder:
    """Describes to the fake the device work of every handle of a sharded
    model (all-gathers and uploads on the all-gather lane, compute reading
    the unsharded buffers, reductions on the reduce lane, a download after
    each finish on compute (the handles are not offloaded, so the scheduler
    finishes them there; offloaded finishes run on the reduction lane:
    tests/scheduler/test_cuda_offload.py), and the real frees of the unsharded
    buffers, which the scheduler may hold back) and records the lanes'
    issues."""

    def __init__(self, cuda: FakeCuda, all_gather: str, reduce: str) -> None:
        self.cuda = cuda
        self.all_gather_stream = all_gather
        self.reduce_stream = reduce
        self.issues: list[_Issue] = []
        # The compute op that last wrote each handle's unsharded gradient.
        self.gradient_writes: dict[str, int] = {}
        self.names: dict[int, str] = {}
        # "forward" or "backward" (set by the training loop).
        self.phase = "forward"
        # The last compute op before this forward or backward started
        # (optimizer and user writes to the shards come before it).
        self.shards_written = 0
        # Compute seq of the last forward op of each block, per forward.
        self.forward_ends: dict[str, list[int]] = {}

    def _issue(self, lane: str, name: str, op: Op) -> None:
        pool = [previous.seq for previous, _ in self.cuda.memory.pools[lane] if previous.stream == "compute"]
        needed = max(pool, default=0)
        if lane == self.reduce_stream:
            needed = max(needed, self.gradient_writes[name])
        else:
            needed = max(needed, self.shards_written)
        self.issues.append(_Issue(lane, name, self.phase, op, needed))

    def instrument(self, handle: FlatParamHandle, name: str) -> None:
        cuda, memory = self.cuda, self.cuda.memory
        self.names[id(handle)] = name
        unshard, reduce_grad = handle.unshard, handle.reduce_grad
        use_views, reshard, finish = handle.use_unsharded_views, handle.reshard, handle.finish_grad_reduction
        free_storage = handle.free_unsharded_storage
        buffer, shard = f"unsharded {name}", f"shard {name}"

        def freeing(method: Callable[..., None]) -> Callable[..., None]:
            def run(*args: object, **kwargs: object) -> None:
                held = handle.unsharded_storage_bytes()
                method(*args, **kwargs)
                if held and not handle.unsharded_storage_bytes():  # the block goes back to the lane's pool
                    memory.free(buffer, allocated_on=self.all_gather_stream)

            return run

        def recorded_unshard(*, async_op: bool) -> PendingCollective | None:
            fills = handle.needs_unshard_storage and not handle.is_unsharded
            pending = unshard(async_op=async_op)
            if fills:
                op = cuda.launch(f"all-gather {name}")
                memory.access(shard, op, write=False)  # the upload or all-gather reads the shard
                memory.allocate(buffer, op)
                self._issue(self.all_gather_stream, name, op)
            return pending

        def recorded_use_views() -> None:
            use_views()
            if handle.needs_unshard_storage:
                memory.access(buffer, cuda.launch(f"compute reads {name}"), write=False)

        def recorded_reshard(*, free_storage: bool = True) -> None:
            if handle.needs_unshard_storage and handle.is_unsharded:  # the last compute use comes first
                memory.access(buffer, cuda.launch(f"last use of {name}"), write=False)
            freeing(reshard)(free_storage=free_storage)

        def recorded_reduce_grad(*, async_op: bool) -> PendingCollective | None:
            pending = reduce_grad(async_op=async_op)
            if pending is not None:
                op = cuda.launch(f"reduce {name}")
                memory.access(f"gradient {name}", op, write=False)
                memory.allocate(f"reduced {name}", op)
                self._issue(self.reduce_stream, name, op)
            return pending

        def recorded_finish(reduced: PendingCollective) -> None:
            finish(reduced)
            op = cuda.launch(f"download {name}")  # where the finish runs: compute here
            memory.access(f"reduced {name}", op, write=False)
            memory.access(f"host gradient {name}", op, write=True)
            memory.free(f"reduced {name}", allocated_on=self.reduce_stream)

        handle.unshard = recorded_unshard  # type: ignore[method-assign]
        handle.use_unsharded_views = recorded_use_views  # type: ignore[method-assign]
        handle.reshard = recorded_reshard  # type: ignore[method-assign]
        handle.free_unsharded_storage = freeing(free_storage)  # type: ignore[method-assign]
        handle.reduce_grad = recorded_reduce_grad  # type: ignore[method-assign]
        handle.finish_grad_reduction = recorded_finish  # type: ignore[method-assign]

    def _bucket_op(self, what: str, handles: list[FlatParamHandle], lane: str, reads: str, fills: str) -> tuple[list[str], Op, int]:
        """One lane op for a bucket: it reads each member's ``reads`` buffer
        and fills its ``fills`` one; returns the members' names, the op, and
        the last compute use of a block in the lane's pool."""
        names = [self.names[id(handle)] for handle in handles]
        op = self.cuda.launch(f"{what} of {', '.join(names)}")
        for name in names:
            self.cuda.memory.access(f"{reads} {name}", op, write=False)
            self.cuda.memory.allocate(f"{fills} {name}", op)
        pool = [previous.seq for previous, _ in self.cuda.memory.pools[lane] if previous.stream == "compute"]
        return names, op, max(pool, default=0)

    def bucket_issued(self, handles: list[FlatParamHandle]) -> None:
        """A bucket of held gradients was issued: one lane op reads them all
        and writes each one's reduced shard ([Note: coalesced reductions])."""
        names, op, pool = self._bucket_op("reduce bucket", handles, self.reduce_stream, "gradient", "reduced")
        # One issue for the bucket: it needs the latest of its gradients' writes.
        needed = max([pool, *(self.gradient_writes[name] for name in names)])
        self.issues.append(_Issue(self.reduce_stream, names[-1], self.phase, op, needed))

    def gather_bucket_issued(self, handles: list[FlatParamHandle]) -> None:
        """A coalesced all-gather was issued: one lane op reads every
        member's shard and fills every member's buffer ([Note: coalesced
        all-gathers]); an issue per member, all the same op."""
        names, op, pool = self._bucket_op("all-gather bucket", handles, self.all_gather_stream, "shard", "unsharded")
        self.issues += [_Issue(self.all_gather_stream, name, self.phase, op, max(pool, self.shards_written)) for name in names]

    def gradient_written(self, handle: FlatParamHandle) -> None:
        """Backward wrote the handle's unsharded gradient (on compute)."""
        name = self.names[id(handle)]
        op = self.cuda.launch(f"backward writes {name}")
        self.cuda.memory.access(f"gradient {name}", op, write=True)
        self.gradient_writes[name] = op.seq

    def forward_ended(self, fqn: str) -> None:
        self.forward_ends.setdefault(fqn, []).append(self.cuda.launch(f"forward of {fqn} ends").seq)


class _Issue(NamedTuple):
    """One lane issue that did device work, as the fake saw it."""

    lane: str
    name: str  # the handle's
    phase: str
    op: Op  # its first op on the lane
    # The latest compute op it must wait for: the last use of a block freed
    # into its pool, the write of the gradient it reduces, or the latest
    # write of the shards (the start of this forward or backward).
    needed: int


@contextlib.contextmanager
def _described(module: Any, name: str, describe: Callable[[list], None]) -> Iterator[None]:
    """Each launch of ``module.name`` (a bucket's: ``launch(items,
    async_op)``) described to the fake after it ran (``describe(items)``)."""
    launch = getattr(module, name)

    def recorded(items: list, async_op: bool) -> PendingCollective | None:
        pending = launch(items, async_op)
        describe(items)
        return pending

    setattr(module, name, recorded)
    try:
        yield
    finally:
        setattr(module, name, launch)


def _recorded_buckets(recorder: _Recorder) -> contextlib.AbstractContextManager[None]:
    """Bucket launches ([Note: coalesced reductions]) described to the fake."""
    return _described(grad_buckets, "_launch_bucket", lambda held: recorder.bucket_issued([item.handle for item in held]))


def _recorded_gather_buckets(recorder: _Recorder) -> contextlib.AbstractContextManager[None]:
    """Coalesced all-gather launches ([Note: coalesced all-gathers]) described to the fake."""
    return _described(gather_buckets, "_launch", recorder.gather_bucket_issued)


def _install(cuda: FakeCuda, model: torch.nn.Module) -> _Recorder:
    context = lazy_init(get_state(model))
    scheduler = context.scheduler
    scheduler.all_gather_lane = CudaStreamLane(_CUDA, priority=-1)
    scheduler.reduce_scatter_lane = CudaStreamLane(_CUDA, priority=0)
    scheduler.device = _CUDA  # synchronize_host waits on the (fake) compute stream
    context.offloads_params = True  # the host waits once per step, as with CPU offload
    recorder = _Recorder(
        cuda,
        scheduler.all_gather_lane.stream.name,  # type: ignore[attr-defined]
        scheduler.reduce_scatter_lane.stream.name,  # type: ignore[attr-defined]
    )
    reduce = scheduler.reduce

    def recorded_reduce(launch: Callable, on_done: Callable, **kwargs: bool) -> None:
        if isinstance(launch, functools.partial):  # functools.partial(_launch_reduce, handle)
            recorder.gradient_written(launch.args[0])
        reduce(launch, on_done, **kwargs)  # else a bucket's: its gradients were written when held

    def recorded_reduce_together(key: object, nbytes: int, item: Any, launch: Callable, on_done: Callable) -> None:
        recorder.gradient_written(item.handle)  # held at its post-backward ([Note: coalesced reductions])
        reduce_together(key, nbytes, item, launch, on_done)

    reduce_together = scheduler.reduce_together
    scheduler.reduce = recorded_reduce  # type: ignore[method-assign]
    scheduler.reduce_together = recorded_reduce_together  # type: ignore[method-assign]
    for fqn, state in unit_states_under(model):
        for index, handle in enumerate(state.handles):
            recorder.instrument(handle, f"{fqn or '<root>'}#{index}")
        if fqn:  # blocks: mark the end of their forward's compute
            forward = state.module.forward

            def marked(*args: object, _forward: Callable = forward, _fqn: str = fqn, **kwargs: object) -> object:
                output = _forward(*args, **kwargs)
                recorder.forward_ended(_fqn)
                return output

            state.module.forward = marked  # type: ignore[method-assign]
    return recorder


_BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# name -> fully_shard keywords. "optimizer on host" as with CPU offload
# (the host writes the shards the uploads read), else on compute.
_CASES: dict[str, dict] = {
    "full_shard bf16": dict(strategy=ShardingStrategy.FULL_SHARD, mixed_precision=_BF16),
    "full_shard fp32": dict(strategy=ShardingStrategy.FULL_SHARD),
    "full_shard bf16 prefetch": dict(
        strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=_BF16,
        forward_prefetch=True,
        backward_prefetch=BackwardPrefetch.BACKWARD_POST,
    ),
    "full_shard bf16 no backward prefetch": dict(
        strategy=ShardingStrategy.FULL_SHARD, mixed_precision=_BF16, backward_prefetch=None
    ),
}


def _train_under_fake_cuda(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict[str, list[str]]:
    """Three steps of a 4-unit model (3 blocks and the root) under the fake
    per (case, where the optimizer runs); returns, per case, the races and
    contract violations found (empty when none)."""
    found = {}
    for case, optimizer_on in cases:
        cuda = FakeCuda()
        # ", alone": every flat parameter gathered and reduced by itself.
        alone = case.endswith(", alone")
        with cuda.installed(), collectives_alone() if alone else contextlib.nullcontext():
            torch.manual_seed(0)
            model = TinyGPT(n_blocks=3)
            fully_shard(model, policy={Block}, **_CASES[case.removesuffix(", alone")])
            recorder = _install(cuda, model)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
            per_rank = 8 // world_size
            local = slice(rank * per_rank, (rank + 1) * per_rank)
            with _recorded_buckets(recorder), _recorded_gather_buckets(recorder):
                _train_three_steps(cuda, model, recorder, optimizer, local, optimizer_on)
        problems = list(cuda.memory.races)
        if not recorder.issues:
            problems.append("no lane issue was recorded")
        coalesced = any(issue.op.what.startswith("all-gather bucket") for issue in recorder.issues)
        if coalesced != (world_size > 1 and not alone):  # sharded small units: one bucket per phase
            problems.append(f"coalesced all-gathers {'issued' if coalesced else 'missing'}")
        problems += _contract_violations(recorder)
        found[f"{case}, optimizer on {optimizer_on}"] = problems
    return found


def _train_three_steps(
    cuda: FakeCuda, model: torch.nn.Module, recorder: _Recorder, optimizer: torch.optim.Optimizer, local: slice,
    optimizer_on: str,
) -> None:
    """Three steps, each forward, backward and an optimizer step (on
    compute or on the host) described to the fake."""
    for step in range(3):
        inputs, targets = batch(step)
        recorder.phase, recorder.shards_written = "forward", cuda.compute.count
        output = model(inputs[local])
        recorder.phase, recorder.shards_written = "backward", cuda.compute.count
        lm_loss(output.float(), targets[local]).backward()
        # The optimizer reads the downloaded gradients and writes
        # the shards the next step's all-gathers read.
        op = cuda.host_op(f"optimizer step {step}") if optimizer_on == "host" else cuda.launch(f"optimizer step {step}")
        for name in recorder.names.values():
            cuda.memory.access(f"host gradient {name}", op, write=False)
            cuda.memory.access(f"shard {name}", op, write=True)
        optimizer.step()
        optimizer.zero_grad()


def _contract_violations(recorder: _Recorder) -> list[str]:
    """The wait rule of [Note: what a lane waits for].

    Race-free — every issue ordered after the producer of its input and
    after every use of the blocks freed into its pool — is checked by the
    audit. Here: every issue waits on nothing later than it needs (a
    reduction on nothing after the write of its gradient and the last use
    of a block in its pool; an all-gather on nothing after the last use of
    a block in its pool and the start of its forward or backward). And the
    issue's contract (finding 1): in forward, the all-gather of block k+1
    is not ordered after the end of block k's forward, so it can run
    during it."""
    problems = []
    for issue in recorder.issues:
        waits_on = issue.op.clock.get("compute", 0)
        if waits_on > issue.needed:
            problems.append(
                f"{issue.lane} issue for {issue.name} ({issue.phase}) waits on compute op {waits_on}, "
                f"needs only {issue.needed}"
            )
    blocks = sorted(recorder.forward_ends)
    gathered = {issue.name for issue in recorder.issues if issue.lane == recorder.all_gather_stream}
    for previous, following in zip(blocks, blocks[1:]):
        if f"{following}#0" not in gathered:
            continue  # nothing to gather (one rank, no cast)
        gathers = [
            issue.op
            for issue in recorder.issues
            if issue.lane == recorder.all_gather_stream and issue.phase == "forward" and issue.name == f"{following}#0"
        ]
        ends = recorder.forward_ends[previous]
        if len(gathers) != len(ends):
            problems.append(f"{len(gathers)} forward all-gathers of {following} for {len(ends)} forwards")
        for step, (gather, end) in enumerate(zip(gathers, ends)):
            if gather.clock.get("compute", 0) >= end:
                problems.append(
                    f"step {step}: the all-gather of {following} waits for the end of {previous}'s forward "
                    f"(compute op {end}): it cannot overlap it"
                )
    return problems


def test_lanes_are_race_free_under_cuda_stream_rules() -> None:
    # World size 1: bf16 unshards are copies with no collective (the case
    # of the original race), fp32 has reductions only.
    cases = [("full_shard bf16", "compute"), ("full_shard bf16", "host"), ("full_shard fp32", "compute")]
    for rank, found in enumerate(run_distributed(_train_under_fake_cuda, 1, cases)):
        for case, problems in found.items():  # type: ignore[union-attr]
            assert problems == [], (case, rank, problems)


def test_next_all_gather_waits_only_for_the_reshard_of_the_memory_it_reuses() -> None:
    # Issue 23's contract, world size 2 (all-gathers and reduce-scatters), a
    # 4-unit model: in forward, block k+1's all-gather waits on nothing
    # later than the reshard of the block it may reuse (block k-1's: block
    # k's is held until it allocated), never on the end of block k's
    # forward; every reduction on nothing later than its gradient's write.
    # Also with prefetching, and with the optimizer on the host.
    # Small units' collectives are coalesced; ", alone" runs each by itself.
    cases = [
        ("full_shard bf16", "compute"),
        ("full_shard bf16, alone", "compute"),
        ("full_shard fp32", "host"),
        ("full_shard bf16 prefetch", "compute"),
        ("full_shard bf16 prefetch, alone", "compute"),
        ("full_shard bf16 no backward prefetch", "compute"),
    ]
    for rank, found in enumerate(run_distributed(_train_under_fake_cuda, 2, cases)):
        for case, problems in found.items():  # type: ignore[union-attr]
            assert problems == [], (case, rank, problems)
