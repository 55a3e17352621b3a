"""Units that some ranks skip (a mixture-of-experts layer whose ranks route
their rows to different experts): with ``set_may_be_skipped`` the training
matches one process on the global batch (the union of work), step by step
through the optimizer; without it every rank raises at the first collective
where the ranks differ, naming the units, and no rank is left waiting.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import os
import time
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from composable_shard import ShardingStrategy, fully_shard, no_sync, set_may_be_skipped
from composable_shard.comm.transport import ENV_SWITCH
from composable_shard.runtime.state import get_state, unit_states_under

from tests.support.harness_pool import run_distributed
from tests.support.parity import Parity, assert_resharded, step_and_compare

WIDTH = 8
EXPERTS = 4
GLOBAL_BATCH = 8

# Per step, the two experts (top-2) each row of the global batch is routed
# to; rows 0-3 are rank 0's, rows 4-7 rank 1's. Step 0: the ranks use
# disjoint experts; step 1: rank 1 uses expert 1 alone and rank 0 calls
# expert 0 twice (in both slots); step 2: no rank uses expert 2 (no
# gradient anywhere, as in one process), rank 0 none of experts 0 and 1.
ROUTES = (
    ((0, 1), (1, 0), (0, 1), (1, 1), (2, 3), (3, 2), (2, 2), (3, 3)),
    ((0, 0), (0, 2), (2, 0), (0, 0), (1, 1), (1, 1), (1, 1), (1, 1)),
    ((3, 3), (3, 3), (3, 3), (3, 3), (0, 1), (1, 0), (1, 1), (0, 0)),
    ((0, 1), (2, 3), (1, 2), (3, 0), (3, 3), (3, 3), (3, 3), (3, 3)),
)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class MixtureOfExperts(nn.Module):
    """Top-2 routing given from outside (a learned router would route the
    same way on every rank only by chance): slot by slot, each expert sees
    the rows routed to it in that slot; an expert no row reaches is not
    called."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, WIDTH)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        x = self.gate(x)
        out = x
        for slot in range(routes.shape[1]):
            for index, expert in enumerate(self.experts):
                rows = routes[:, slot] == index
                if rows.any():
                    update = torch.zeros_like(out)
                    update[rows] = expert(x[rows])
                    out = out + 0.5 * update
        return out


class LearnedRouting(MixtureOfExperts):
    """docs/parallelism.md's recipe: a learned router picks each row's top-2 experts
    and weighs them (``routes`` is ignored)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, EXPERTS)

    def forward(self, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        x = self.gate(x)
        weight, chosen = self.router(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for k in range(2):
            for index, expert in enumerate(self.experts):
                rows = chosen[:, k] == index
                if rows.any():
                    out[rows] += weight[rows, k, None] * expert(x[rows])
        return out


class MoEModel(nn.Module):
    def __init__(self, moe: type[MixtureOfExperts] = MixtureOfExperts) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.moe = moe()
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.embed(x), routes))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    inputs = torch.randn(GLOBAL_BATCH, WIDTH, generator=generator)
    targets = torch.randn(GLOBAL_BATCH, WIDTH, generator=generator)
    return inputs, targets, torch.tensor(ROUTES[step])


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
    return ((model(inputs, routes) - targets) ** 2).mean()


def _shard(model: MoEModel, *, moe_unit: bool, mark: bool, checkpointed: bool = False, **kwargs: object) -> None:
    for expert in model.moe.experts:
        if checkpointed:
            from torch.distributed._composable import checkpoint as composable_checkpoint

            composable_checkpoint(expert)
        fully_shard(expert, **kwargs)
    if moe_unit:  # units before and after the anchor: prefetch targets
        fully_shard(model.embed, **kwargs)
        fully_shard(model.moe, **kwargs)
        fully_shard(model.head, **kwargs)
    fully_shard(model, **kwargs)
    if mark:
        set_may_be_skipped(model.moe.experts)


GROUP_TIMEOUT_S = 20.0


@contextlib.contextmanager
def _group_of_its_own(transport: str) -> Iterator[dist.ProcessGroup]:
    """A group with a short timeout (the harness's default group stays in
    step whatever happens in it), through shared memory or gloo's messages
    (the switch is read when the group decides, at its first collective)."""
    group = dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    if transport == "gloo":
        os.environ[ENV_SWITCH] = "0"
    try:
        yield group
    finally:
        os.environ.pop(ENV_SWITCH, None)
        gc.collect()  # models over the group (module <-> state cycles) go before it
        dist.destroy_process_group(group)


def _train_in_parity(
    rank: int,
    world_size: int,
    label: str,
    *,
    moe_unit: bool,
    moe: type[MixtureOfExperts] = MixtureOfExperts,
    micro_batches: int = 1,
    checkpointed: bool = False,
    **kwargs: object,
) -> None:
    torch.manual_seed(0)
    model = MoEModel(moe)
    reference = copy.deepcopy(model)
    _shard(model, moe_unit=moe_unit, mark=True, checkpointed=checkpointed, **kwargs)
    expert_runs: list[nn.Module] = []
    for expert in model.moe.experts:
        expert.register_forward_pre_hook(lambda module, args: expert_runs.append(module))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    parity = Parity(build=MoEModel, shard=lambda m: None, atol=2e-6, rtol=1e-5)
    batch = GLOBAL_BATCH // micro_batches
    local = slice(rank * batch // world_size, (rank + 1) * batch // world_size)
    for step in range(len(ROUTES)):
        inputs, targets, routes = _batch(step)
        if micro_batches == 2:
            # The first half of every rank's rows under no_sync: marked
            # units accumulate locally, reduced with the second half.
            first = torch.tensor([r * 4 + i for r in range(world_size) for i in (0, 1)])
            _loss(reference, inputs[first], targets[first], routes[first]).backward()
            mine = slice(rank * 4, rank * 4 + 2)
            with no_sync(model):
                _loss(model, inputs[mine], targets[mine], routes[mine]).backward()
            second = first + 2
            inputs, targets, routes = inputs[second], targets[second], routes[second]
        _loss(reference, inputs, targets, routes).backward()
        expert_runs.clear()
        loss = _loss(model, inputs[local], targets[local], routes[local])
        forward_runs = len(expert_runs)
        if kwargs.get("strategy") is not ShardingStrategy.NO_SHARD:
            # Gathered by their anchor, resharded when its forward ends.
            for expert in model.moe.experts:
                state = get_state(expert)
                held = sum(handle.unsharded_storage_bytes() for handle in state.handles)
                assert held == 0, f"{label} step {step}: {state.fqn} holds {held} unsharded bytes after forward"
        loss.backward()
        # Checkpointed experts run again in backward (only where they ran).
        assert len(expert_runs) == (2 if checkpointed else 1) * forward_runs, (label, step, forward_runs)
        assert_resharded(model)
        for _, state in unit_states_under(model):
            for handle in state.handles:
                assert not handle.has_unsharded_grad(), f"{label} step {step}: {state.fqn} kept its unsharded gradient"
        step_and_compare(model, reference, (optimizer, reference_optimizer), parity, f"{label} step {step}")
    # An evaluation forward (no backward follows) routes as training does.
    inputs, targets, routes = _batch(0)
    with torch.no_grad():
        torch.testing.assert_close(model(inputs[local], routes[local]), reference(inputs, routes)[local], atol=2e-6, rtol=1e-5)
    assert_resharded(model)
    if moe is MixtureOfExperts:  # expert 2 ran on no rank in step 2: no gradient, as in one process
        assert "moe.experts.2.up.weight" in parity.compared and "moe.experts.0.up.weight" in parity.compared


def _skipped_experts_in_parity(rank: int, world_size: int) -> None:
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        _train_in_parity(rank, world_size, f"{strategy.name}, experts anchored at the root", moe_unit=False, strategy=strategy)
    _train_in_parity(
        rank, world_size, "FULL_SHARD, experts anchored at the MoE unit, forward prefetch", moe_unit=True, forward_prefetch=True
    )
    _train_in_parity(rank, world_size, "FULL_SHARD, learned top-2 router (the recipe)", moe_unit=True, moe=LearnedRouting)
    _train_in_parity(rank, world_size, "FULL_SHARD, a micro-batch under no_sync", moe_unit=False, micro_batches=2)
    _train_in_parity(rank, world_size, "FULL_SHARD, checkpointed experts", moe_unit=True, checkpointed=True)
    for shape in ((2, 1), (1, 2)):  # (replicate, shard): the replicas' all-reduce, then the shard group's
        mesh = init_device_mesh("cpu", shape)
        _train_in_parity(
            rank, world_size, f"HYBRID_SHARD on a {shape} mesh", moe_unit=True,
            strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh,
        )
    with _group_of_its_own("gloo") as group:  # tags checked beside each collective
        _train_in_parity(rank, world_size, "FULL_SHARD through gloo's messages", moe_unit=True, process_group=group)


def test_experts_some_ranks_skip_train_as_one_process_on_the_global_batch_with_set_may_be_skipped() -> None:
    run_distributed(_skipped_experts_in_parity, 2)


def _unmarked_experts_raise(rank: int, world_size: int) -> list[tuple[str, str, float]]:
    """Train without the mode; every rank must raise. Returns per case the
    message and the seconds from the first step's start."""
    results = []
    cases = (
        ("shared memory", ShardingStrategy.FULL_SHARD),
        ("gloo", ShardingStrategy.FULL_SHARD),
        ("shared memory", ShardingStrategy.NO_SHARD),
    )
    for transport, strategy in cases:
        with _group_of_its_own(transport) as group:
            torch.manual_seed(0)
            model = MoEModel()
            _shard(model, moe_unit=False, mark=False, process_group=group, strategy=strategy)
            local = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
            started, message = time.monotonic(), "no error"
            try:
                for step in range(len(ROUTES)):
                    inputs, targets, routes = _batch(step)
                    _loss(model, inputs[local], targets[local], routes[local]).backward()
            except RuntimeError as error:
                message = str(error)
            results.append((f"{transport}, {strategy.name}", message, time.monotonic() - started))
    return results


def test_experts_some_ranks_skip_raise_on_every_rank_naming_them_without_the_mode() -> None:
    results = run_distributed(_unmarked_experts_raise, 2, timeout=6 * GROUP_TIMEOUT_S)
    for rank, cases in enumerate(results):
        for case, message, seconds in cases:
            assert "unit 'moe.experts." in message, f"rank {rank}, {case}: {message}"
            assert "set_may_be_skipped" in message, f"rank {rank}, {case}: {message}"
            assert seconds < GROUP_TIMEOUT_S / 2, f"rank {rank}, {case}: raised after {seconds:.1f} s: {message}"


class _TwoSizes(nn.Module):
    """Rank 0 runs ``a`` (36 elements), the others ``b`` (42)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6, bias=False)
        self.b = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a if dist.get_rank() == 0 else self.b)(x)


def _unmarked_units_of_other_sizes_raise(rank: int, world_size: int) -> str:
    # Through gloo's messages the tags used to be checked at the wait, after
    # the mispaired collectives had started: gloo aborted the process whose
    # sizes did not match (std::terminate, no exception on that rank).
    with _group_of_its_own("gloo") as group:
        model = _TwoSizes()
        for module in (model.a, model.b, model):
            fully_shard(module, process_group=group)
        try:
            model(torch.randn(2, 6)).sum().backward()
        except RuntimeError as error:
            return str(error)
    return "no error"


def test_unmarked_units_of_other_sizes_raise_through_gloo_messages_too() -> None:
    messages = run_distributed(_unmarked_units_of_other_sizes_raise, 2, timeout=3 * GROUP_TIMEOUT_S)
    assert "for unit 'b' where this rank (rank 0) issued one for unit 'a'" in messages[0], messages
    assert "for unit 'a' where this rank (rank 1) issued one for unit 'b'" in messages[1], messages


def _marked_units_frozen_on_one_rank_raise(rank: int, world_size: int) -> tuple[str, float]:
    # Before: the end of backward's flag all-reduce got lists of different
    # lengths and hung until the group's timeout, then a bare gloo timeout.
    with _group_of_its_own("shared memory") as group:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        if rank == 1:
            model[0].requires_grad_(False)
        for module in (model[0], model[1], model):
            fully_shard(module, process_group=group)
        set_may_be_skipped(model[0])
        set_may_be_skipped(model[1])
        started = time.monotonic()
        with pytest.raises(ValueError) as raised:
            model(torch.randn(2, 4)).sum().backward()
        return str(raised.value), time.monotonic() - started


def test_marked_units_frozen_on_some_ranks_only_raise_on_every_rank_naming_them() -> None:
    for message, seconds in run_distributed(_marked_units_frozen_on_one_rank_raise, 2, timeout=3 * GROUP_TIMEOUT_S):
        assert "unit '0' (marked with set_may_be_skipped) has 0 trainable elements on one rank and 20" in message
        assert seconds < GROUP_TIMEOUT_S / 2, seconds


def _misuses_are_refused(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"set_may_be_skipped\(MoEModel\): no module in this tree was given to fully_shard"):
        set_may_be_skipped(MoEModel())
    # The root marked before its first forward: refused there, and usable after unmarking.
    model = MoEModel()
    _shard(model, moe_unit=False, mark=False)
    set_may_be_skipped(model)
    inputs, targets, routes = _batch(0)
    with pytest.raises(ValueError, match=r"unit '<root>' \(MoEModel\) is the root of its tree"):
        _loss(model, inputs, targets, routes)
    set_may_be_skipped(model, False)
    set_may_be_skipped(model.moe.experts)
    _loss(model, inputs, targets, routes).backward()
    assert_resharded(model)
    # After lazy init the root is known: refused at the call.
    with pytest.raises(ValueError, match="is the root of its tree"):
        set_may_be_skipped(model, recurse=False)
    # A marked unit called outside its anchor's forward would gather alone.
    outside = r"fully_shard\(moe.experts.1\): marked with set_may_be_skipped, it must run inside the forward of unit '<root>'"
    with pytest.raises(RuntimeError, match=outside):
        model.moe.experts[1](inputs)
    _loss(model, inputs, targets, routes).backward()
    assert_resharded(model)


def test_marking_without_units_the_root_or_calling_a_marked_unit_outside_its_anchor_is_refused() -> None:
    run_distributed(_misuses_are_refused, 2)
