"""Owns: building the planned-vs-allocated cases of the plan tests and
measuring what ``fully_shard`` and ``torch.optim`` really allocate (storages
of the parameters, gradients and optimizer state; the step's peak from the
CPU allocator's profile, or the CUDA allocator).

Knows nothing of: how the plan computes its numbers (it only calls
``composable_shard.plan`` and ``describe``).

Runs in a harness worker (real gloo groups) or, as ``python -m
tests.support.plan_measure W [W ...]``, in a process of its own with PyTorch's fake
process group (every collective a no-op, so memory is real but values are
not), printing one JSON line per (world size, rank, case).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

import composable_shard as cs
from composable_shard import BackwardPrefetch, LayoutPolicy, MixedPrecision, ShardingStrategy, SmallUnitGroups

from .models import Block, LoRABlock, TinyGPT, lm_loss

# Wide enough that parameters, not Python objects, dominate the profile.
DIM, VOCAB, BATCH, SEQ = 128, 512, 2, 6


def _wide_gpt() -> nn.Module:
    return TinyGPT(n_blocks=4, dim=DIM, vocab=VOCAB)


def _many_small_gpt() -> nn.Module:
    """Eight blocks of 210 KB: their all-gathers go in buckets of four
    ([Note: coalesced all-gathers, planned])."""
    return TinyGPT(n_blocks=8, dim=320, vocab=VOCAB)


def _sixteen_block_gpt() -> nn.Module:
    return TinyGPT(n_blocks=16, dim=DIM, vocab=VOCAB)


def _lora_gpt() -> nn.Module:
    """LoRAGPT's layout (frozen base weights beside trainable low-rank
    factors), at the wide width."""
    model = TinyGPT(n_blocks=0, dim=DIM, vocab=VOCAB)
    model.blocks = nn.ModuleList([LoRABlock(DIM) for _ in range(3)])
    model.register_buffer("causal_mask", torch.ones(SEQ, SEQ).tril())  # unsharded: every rank holds it
    return model


def _lone_lora_gpt() -> nn.Module:
    """One LoRA block after a root too large to join a bucket: the block's
    two flat parameters share a collective of their own, with no follower
    ([Note: coalesced all-gathers, planned])."""
    model = _lora_gpt()
    model.blocks = model.blocks[:1]
    return model


def planned_loss(logits: torch.Tensor) -> torch.Tensor:
    """The loss the measured step computes (``lm_loss``), as the plan's
    ``loss_fn``: targets of the step's shape (their values do not matter to
    memory)."""
    return lm_loss(logits, torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device))


def _manual(model: nn.Module, **kwargs: Any) -> None:
    for block in model.blocks:  # type: ignore[union-attr]
        cs.fully_shard(block, **kwargs)


# name -> (model builder, plan/fully_shard kwargs, optimizer kind, manual pre-sharding)
CASES: dict[str, tuple[Callable[[], nn.Module], dict[str, Any], str, bool]] = {
    "full_shard": (_wide_gpt, {"policy": {Block}}, "adamw", False),
    "shard_grad_op": (_wide_gpt, {"policy": {Block}, "strategy": ShardingStrategy.SHARD_GRAD_OP}, "adamw", False),
    "no_shard": (_wide_gpt, {"policy": {Block}, "strategy": ShardingStrategy.NO_SHARD}, "adam", False),
    "prefetch": (
        _wide_gpt,
        {"policy": {Block}, "forward_prefetch": True, "backward_prefetch": BackwardPrefetch.BACKWARD_POST},
        "adamw",
        False,
    ),
    "manual_units": (_wide_gpt, {}, "adamw", True),
    "many_small": (_many_small_gpt, {"policy": {Block}}, "adamw", False),
    # The same blocks in one bucket of 4 MiB, as a roomy memory_budget chooses
    # ([Note: a layout chosen for a memory budget] in planning/budget.py).
    "large_buckets": (
        _many_small_gpt,
        {"policy": LayoutPolicy({Block}, {f"blocks.{i}": ShardingStrategy.FULL_SHARD for i in range(8)}, bucket_bytes=4 << 20)},
        "adamw",
        False,
    ),
    # Sixteen blocks of 197 KB in buckets of 4 MiB: backward's first bucket
    # is a prefetch, issued as the last block's backward ends, and it is
    # the step's peak. Off the shared-memory path (the fake group, CUDA)
    # the side-by-side shards live until its wait; before, the plan left
    # them out and fell 95 KB short at 8 ranks.
    "prefetched_bucket": (
        _sixteen_block_gpt,
        {"policy": LayoutPolicy({Block}, {f"blocks.{i}": ShardingStrategy.FULL_SHARD for i in range(16)}, bucket_bytes=4 << 20)},
        "adamw",
        False,
    ),
    # The same blocks in two groups of four ([Note: groups of small units] in policy.py).
    "small_unit_groups": (_many_small_gpt, {"policy": SmallUnitGroups({Block}, max_bytes=1 << 19)}, "adamw", False),
    "frozen_lora": (_lora_gpt, {"policy": {LoRABlock}}, "adamw", False),
    "lone_lora": (_lone_lora_gpt, {"policy": {LoRABlock}}, "adamw", False),
    "sgd_momentum": (_wide_gpt, {"policy": {Block}}, "sgd", False),
    "bf16_compute": (
        _wide_gpt,
        {"policy": {Block}, "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
        "adamw",
        False,
    ),
    # A per-parameter optimizer stepped in each post-accumulate-grad hook.
    "full_shard_in_backward": (_wide_gpt, {"policy": {Block}, "optimizer_in_backward": True}, "adamw", False),
    "bf16_in_backward": (
        _wide_gpt,
        {
            "policy": {Block},
            "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            "optimizer_in_backward": True,
        },
        "adamw",
        False,
    ),
}

_PLAN_ONLY = {"forward_prefetch", "backward_prefetch"}


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3)


class _StepsInBackward:
    """One optimizer per parameter, stepped and zeroed in the parameter's
    post-accumulate-grad hook ("optimizer in backward"); ``step`` and
    ``zero_grad`` of the usual loop have nothing left to do."""

    def __init__(self, kind: str, model: nn.Module) -> None:
        self.optimizers = {param: _optimizer(kind, [param]) for param in model.parameters()}
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(self._step)

    def _step(self, param: torch.Tensor) -> None:
        self.optimizers[param].step()
        self.optimizers[param].zero_grad(set_to_none=True)

    @property
    def state(self) -> dict:
        return {p: s for optimizer in self.optimizers.values() for p, s in optimizer.state.items()}

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def unique_storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped)."""
    seen: dict[tuple[int, int], int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    return sum(seen.values())


def state_bytes(model: nn.Module, optimizer: Any) -> dict[str, int]:
    """What a model and its optimizer hold after a step, as the plan counts
    it: distinct storages behind the parameters, their ``.grad``s, the
    optimizer's tensor state and the buffers."""
    return {
        "params": unique_storage_bytes(model.parameters()),
        "grads": unique_storage_bytes(p.grad for p in model.parameters()),
        "optimizer": unique_storage_bytes(
            t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)
        ),
        "buffers": unique_storage_bytes(model.buffers()),
    }


def kept_between_steps(allocated: dict[str, int]) -> int:
    """Of ``state_bytes``, what a step starts with after
    ``zero_grad(set_to_none=True)``: parameters, optimizer state, buffers
    (a step's peak is this plus its peak above the start)."""
    return allocated["params"] + allocated["optimizer"] + allocated["buffers"]


def rank_tokens(rank: int, *, vocab: int = VOCAB, device: str = "cpu") -> torch.Tensor:
    """This rank's batch of token ids (inputs and shifted targets)."""
    generator = torch.Generator().manual_seed(rank)
    return torch.randint(0, vocab, (BATCH, SEQ + 1), generator=generator).to(device)


def cpu_peak_above_start(fn: Callable[[], None]) -> int:
    """Peak of the CPU allocator's running total above its value when ``fn``
    starts, from the profiler's allocation and free events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (event.start_ns(), event.nbytes())
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]"
    )
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def measure_case(
    name: str, rank: int, world_size: int, *, device: str = "cpu", process_group: Any = None
) -> dict[str, Any]:
    """Plan ``name`` for this rank, shard it, train two steps and return
    the plan's numbers beside the allocated ones. ``process_group``: the
    units' group (the default one where None)."""
    build, kwargs, kind, manual = CASES[name]
    torch.manual_seed(0)
    with torch.device(device):
        model = build()
    in_backward = kwargs.get("optimizer_in_backward", False)
    shard_kwargs = {k: v for k, v in kwargs.items() if k not in _PLAN_ONLY and k != "optimizer_in_backward"}
    prefetch = {k: v for k, v in kwargs.items() if k in _PLAN_ONLY}
    if manual:
        _manual(model, process_group=process_group)
    # Activations are measured on an unsharded model only: with manual units
    # already sharded the plan has none, and the peak is not compared.
    inputs = {} if manual else {"input_shape": (BATCH, SEQ), "loss_fn": planned_loss}
    planned = cs.plan(model, world_size=world_size, rank=rank, optimizer=kind, device=device, **inputs, **kwargs)
    # What describe knows: no activations (the runtime line's rest follows them).
    planned_without_input = cs.plan(model, world_size=world_size, rank=rank, optimizer=kind, device=device, **kwargs)
    cs.fully_shard(model, **shard_kwargs, **prefetch, process_group=process_group)
    described = cs.describe(model, optimizer=kind, optimizer_in_backward=in_backward)
    optimizer: Any = _StepsInBackward(kind, model) if in_backward else _optimizer(kind, model.parameters())
    tokens = rank_tokens(rank, device=device)

    def step() -> None:
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()

    optimizer.zero_grad(set_to_none=True)
    step()
    allocated = state_bytes(model, optimizer)
    optimizer.zero_grad(set_to_none=True)
    # Earlier cases' models are garbage cycles (module <-> unit state) until
    # the collector runs: were it to free one during the measured step, those
    # frees would lower the measured peak. Collect now, and not during the step.
    gc.collect()
    gc.disable()
    try:
        if device == "cuda":
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - start
        else:
            peak = cpu_peak_above_start(step)
    finally:
        gc.enable()
    allocated["peak"] = kept_between_steps(allocated) + peak
    return {
        "case": name,
        "rank": rank,
        "world_size": world_size,
        "allocated": allocated,
        "planned": dict(planned.rank_bytes),
        "described": dict(described.rank_bytes),
        "plan_table": _without_source(str(planned_without_input)),
        "describe_table": _without_source(str(described)),
        "peak_moment": planned.peak_moment,
        "peak_comparable": not manual,
    }


def _without_source(table: str) -> str:
    """The table down to the step's worst moment (only a plan given an input
    measures activations, which can move that moment, and which the runtime
    line's rest follows: the tables compared are of a plan without one),
    source label blanked."""
    kept = table.split("\n  worst moment")[0]
    return kept.replace("(plan)", "(...)").replace("(fully_shard)", "(...)")


# Cases measured on every (world size, rank); all of CASES run on rank 0 of
# the smallest and largest world size (two cores: keep the test short).
FAKE_PG_SUBSET = ("full_shard", "frozen_lora", "lone_lora", "bf16_compute", "full_shard_in_backward")


def fake_pg_plan(world_sizes: list[int]) -> list[tuple[int, int, tuple[str, ...]]]:
    """(world size, rank, cases) that ``main`` measures."""
    runs = []
    for world_size in world_sizes:
        for rank in sorted({0, world_size - 1}):
            every = rank == 0 and world_size in (min(world_sizes), max(world_sizes))
            runs.append((world_size, rank, tuple(CASES) if every else FAKE_PG_SUBSET))
    return runs


def main(world_sizes: list[int]) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    device = os.environ.get("PLAN_MEASURE_DEVICE", "cpu")
    for world_size, rank, cases in fake_pg_plan(world_sizes):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            for name in cases:
                print(json.dumps(measure_case(name, rank, world_size, device=device)), flush=True)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main([int(arg) for arg in sys.argv[1:]])


# ------------------------------------------------- owner-stepped optimizers
# Optimizers stepped whole on owner ranks ([Note: owner-stepped optimizers,
# planned] in composable_shard/planning/owner_memory.py), by the plan's name.
OWNER_CASES: dict[str, Any] = {"muon": "muon", "adafactor": "adafactor", "owner": ("owner", 1)}


class TensorNormalizedMomentum(torch.optim.Optimizer):
    """A user's own optimizer that reads whole tensors: momentum, then a step
    of length ``lr`` along it (its norm over the whole parameter). One state
    tensor per parameter, everything in place: what ``("owner", 1)`` plans."""

    def __init__(self, params: Any, lr: float = 1e-2, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad)
                buffer = state["momentum_buffer"]
                buffer.mul_(group["momentum"]).add_(param.grad)
                param.add_(buffer, alpha=-group["lr"] / (float(buffer.norm()) + 1e-12))


class _Optimizers:
    """Several optimizers stepped one after the other, as one."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    @property
    def state(self) -> dict:
        return {p: s for optimizer in self.optimizers for p, s in optimizer.state.items()}

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def owner_optimizer(name: str, model: nn.Module) -> Any:
    """The optimizer ``plan(optimizer=OWNER_CASES[name])`` plans, over the
    unsharded ``model`` (Muon's constructor needs 2-D parameters): Muon over
    the 2-D parameters and AdamW over the rest, Adafactor, or a user's own."""
    if name == "muon":
        matrices = [p for p in model.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if p.ndim != 2]
        return _Optimizers(torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-3))
    if name == "adafactor":
        return torch.optim.Adafactor(model.parameters(), lr=1e-2)
    return TensorNormalizedMomentum(model.parameters())


def newton_schulz_scratch(shapes: list[tuple[int, ...]]) -> int:
    """The most bytes torch.optim.Muon's step of one whole fp32 parameter of
    each shape allocates beyond the tensors its code names — the matrix
    products' own workspace (oneDNN packs bf16 operands on CPU) — measured
    in this process, without composable_shard."""
    from composable_shard.planning.owner_memory import muon_tensor_bytes

    worst = 0
    for shape in shapes:
        param = nn.Parameter(torch.randn(shape))
        param.grad = torch.randn(shape)
        optimizer = torch.optim.Muon([param], lr=0.02)
        optimizer.step()  # its momentum buffer exists, as in a later step
        worst = max(worst, cpu_peak_above_start(optimizer.step) - muon_tensor_bytes(torch.Size(shape)))
    return worst


@contextlib.contextmanager
def holding_collective_tensors() -> Iterator[list[torch.Tensor]]:
    """Keep a reference to every tensor given to ``composable_shard.comm``'s
    ``all_to_all`` and ``all_reduce_max`` (the owner step's collectives)
    until the block ends, as a collective's work object may on gloo's worker
    thread after ``wait()`` returns; the real collectives run."""
    from composable_shard import comm

    held: list[torch.Tensor] = []
    originals = {name: getattr(comm, name) for name in ("all_to_all", "all_reduce_max")}

    def holding(function: Callable[..., None]) -> Callable[..., None]:
        def call(*args: Any) -> None:
            held.extend(arg for arg in args if isinstance(arg, torch.Tensor))
            function(*args)

        return call

    for name, function in originals.items():
        setattr(comm, name, holding(function))
    try:
        yield held
    finally:
        for name, function in originals.items():
            setattr(comm, name, function)
        held.clear()


def measure_owner_case(
    name: str, rank: int, world_size: int, *, hold_collective_tensors: bool = False, process_group: Any = None
) -> dict[str, Any]:
    """Plan ``OWNER_CASES[name]`` under FULL_SHARD for this rank, shard, train
    and return the plan's numbers beside the allocated ones: the state after
    a step, the whole step's peak, and ``optimizer.step()``'s own transient
    bytes (its peak above what was alive when it started).
    ``hold_collective_tensors``: measured while every tensor the step gives
    its collectives stays referenced (``holding_collective_tensors``).
    ``process_group``: the units' group (the default one where None)."""
    from composable_shard.optim import last_step_traffic, owner_plans
    from composable_shard.planning.owner_memory import owner_optimizer as owner_optimizer_spec
    from composable_shard.planning.owner_memory import planned_owners
    from composable_shard.runtime.lifecycle import live_units

    spec = OWNER_CASES[name]
    gc.collect()  # earlier cases' models are garbage cycles
    torch.manual_seed(0)
    model = _wide_gpt()
    inputs = {"input_shape": (BATCH, SEQ), "loss_fn": planned_loss}
    planned = cs.plan(model, world_size=world_size, rank=rank, optimizer=spec, device="cpu", policy={Block}, **inputs)
    planned_without_input = cs.plan(model, world_size=world_size, rank=rank, optimizer=spec, device="cpu", policy={Block})
    optimizer = owner_optimizer(name, model)
    positions = {id(p): index for index, p in enumerate(model.parameters())}
    cs.fully_shard(model, policy={Block}, process_group=process_group)
    described = cs.describe(model, optimizer=spec)
    tokens = rank_tokens(rank)

    def backward() -> None:
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()

    def step() -> None:
        backward()
        optimizer.step()

    optimizer.zero_grad(set_to_none=True)
    step()
    allocated = state_bytes(model, optimizer)
    stepped = optimizer.optimizers[0] if isinstance(optimizer, _Optimizers) else optimizer
    runtime_owners = {
        positions[id(owned.param)]: owned.owner for plan in owner_plans(stepped, live_units()) for owned in plan.params
    }
    owned_shapes = [
        tuple(owned.shape)
        for plan in owner_plans(stepped, live_units())
        for owned in plan.params
        if owned.owner == plan.rank and owned.param.requires_grad
    ]
    gc.collect()
    gc.disable()
    holding = holding_collective_tensors() if hold_collective_tensors else contextlib.nullcontext()
    try:
        with holding:
            optimizer.zero_grad(set_to_none=True)
            allocated["peak"] = kept_between_steps(allocated) + cpu_peak_above_start(step)
            optimizer.zero_grad(set_to_none=True)
            backward()
            step_transient = cpu_peak_above_start(optimizer.step)
    finally:
        gc.enable()
    step_moment = next(m for m in planned.moments if m.moment == "optimizer.step()")
    return {
        "case": f"owner:{name}",
        "rank": rank,
        "world_size": world_size,
        "allocated": allocated,
        "planned": dict(planned.rank_bytes),
        "described": dict(described.rank_bytes),
        "plan_table": _without_source(str(planned_without_input)),
        "describe_table": _without_source(str(described)),
        "peak_moment": planned.peak_moment,
        "peak_comparable": True,
        "optimizer_by_kind": planned.optimizer_by_kind,
        "allocated_by_kind": _state_by_kind(optimizer),
        "sent_to_owners": last_step_traffic(stepped).to_owners,
        "runtime_owners": sorted(runtime_owners.items()),
        "planned_owners": sorted(planned_owners(planned.units, owner_optimizer_spec(spec)).items()),
        "step_planned": step_moment.optimizer_step,
        "step_measured": step_transient,
        "owned_shapes": owned_shapes,
        "scratch": newton_schulz_scratch([s for s in owned_shapes if len(s) == 2]) if name == "muon" else 0,
    }


def _state_by_kind(optimizer: Any) -> dict[str, int]:
    """Bytes of the distinct storages behind each kind of state (the
    parameters of a run of the flat step hold views of one tensor per kind)."""
    kinds: dict[str, list[torch.Tensor]] = {}
    for state in optimizer.state.values():
        for kind, value in state.items():
            if torch.is_tensor(value):
                kinds.setdefault(kind, []).append(value)
    return {kind: unique_storage_bytes(values) for kind, values in kinds.items()}

