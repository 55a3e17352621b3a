"""Issue 33's pieces together, each against one process on the global
batch step by step: grouped units in explicit prefetch lists, given to
``unshard`` / ``reshard`` and ``set_reshard_after_forward`` (FSDP2's
``test_fully_shard_multi_module_backward_prefetch`` ported, launches
recorded); HYBRID_SHARD micro-batches under ``set_requires_gradient_sync``
then ``set_requires_all_reduce`` with a divide factor (collectives
counted); a communication hook on a grouped unit; units some ranks skip
next to units under ``set_requires_gradient_sync(False)``."""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import torch
import torch.nn as nn

from composable_shard import (
    ShardingStrategy,
    comm_hooks,
    fully_shard,
    register_comm_hook,
    reshard,
    set_gradient_divide_factor,
    set_may_be_skipped,
    set_modules_to_backward_prefetch,
    set_modules_to_forward_prefetch,
    set_requires_all_reduce,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    set_reshard_after_forward,
)
from composable_shard import unshard
from composable_shard.handle import FlatParamHandle
from composable_shard.runtime.state import get_state, unit_states_under

from tests.support.comm_spies import CollectiveSpy, with_collectives_alone, with_reductions_alone
from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT, batch, lm_loss
from tests.support.parity import Parity, assert_resharded, compare_full, hybrid_groups, run_parity, step_and_compare

BLOCKS = 5


def _untied_gpt() -> nn.Module:
    model = TinyGPT(n_blocks=BLOCKS)
    model.head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())
    return model


def _shard_groups(model: nn.Module) -> None:
    """FSDP2's multi-module prefetch layout: blocks.0 alone, blocks 1-2 and
    3-4 in groups, [norm, head] a group kept gathered after forward (run
    time control on a group), the embeddings in the root."""
    blocks = model.blocks
    fully_shard(blocks[0])
    fully_shard([blocks[1], blocks[2]])
    fully_shard([blocks[3], blocks[4]])
    fully_shard([model.norm, model.head])
    fully_shard(model)
    set_reshard_after_forward(model.norm, False)


def _shard_groups_with_lists(model: nn.Module) -> None:
    """The same with explicit lists naming groups (by any member)."""
    _shard_groups(model)
    blocks = model.blocks
    set_modules_to_forward_prefetch(blocks[0], [blocks[1], blocks[4]])
    set_modules_to_backward_prefetch(model.head, [blocks[3], blocks[2]])
    set_modules_to_backward_prefetch(blocks[1], [blocks[0]])


@contextlib.contextmanager
def _launches(model: nn.Module, events: list[str]) -> Iterator[None]:
    """Record "+unit" at each all-gather launch and "-unit" at each
    reshard (calls through)."""
    names = {id(h): name or "root" for name, state in unit_states_under(model) for h in state.handles}
    real_unshard, real_reshard = FlatParamHandle.unshard, FlatParamHandle.reshard

    def recording_unshard(self: FlatParamHandle, *, async_op: bool):
        if not self.is_unsharded:
            events.append("+" + names[id(self)])
        return real_unshard(self, async_op=async_op)

    def recording_reshard(self: FlatParamHandle, **kwargs: bool) -> None:
        if self.is_unsharded:
            events.append("-" + names[id(self)])
        real_reshard(self, **kwargs)

    FlatParamHandle.unshard, FlatParamHandle.reshard = recording_unshard, recording_reshard  # type: ignore[method-assign]
    try:
        yield
    finally:
        FlatParamHandle.unshard, FlatParamHandle.reshard = real_unshard, real_reshard  # type: ignore[method-assign]


def _launch_orders(shard) -> tuple[list[str], list[str]]:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = _untied_gpt()
    shard(model)
    inputs, targets = batch(0, 2)
    events: list[str] = []
    with _launches(model, events):
        loss = lm_loss(model(inputs), targets)
        forward = list(events)
        loss.backward()
    assert_resharded(model)
    return forward, events[len(forward) :]


@with_collectives_alone  # records each unit's all-gather
def _grouped_units_with_controls(rank: int, world_size: int) -> None:
    # FSDP2's test: one launch per group in forward, each freed before the
    # next is gathered; [norm, head] kept gathered (set_reshard_after_forward
    # on the group), so backward launches no gather of it.
    forward, backward = _launch_orders(_shard_groups)
    assert forward == [
        "+root", "+blocks.0", "-blocks.0", "+blocks.1+blocks.2", "-blocks.1+blocks.2", "+blocks.3+blocks.4",
        "-blocks.3+blocks.4", "+norm+head",
    ], forward
    assert backward == [
        "-norm+head", "+blocks.3+blocks.4", "-blocks.3+blocks.4", "+blocks.1+blocks.2", "-blocks.1+blocks.2", "+blocks.0",
        "-blocks.0", "-root",
    ], backward
    # Lists naming groups (by any member): blocks.0 launches both block
    # groups as its forward starts; [norm, head]'s backward launches both
    # before it frees itself, the blocks 1-2 group's launches blocks.0.
    forward, backward = _launch_orders(_shard_groups_with_lists)
    assert forward == [
        "+root", "+blocks.0", "+blocks.1+blocks.2", "+blocks.3+blocks.4", "-blocks.0", "-blocks.1+blocks.2",
        "-blocks.3+blocks.4", "+norm+head",
    ], forward
    assert backward == [
        "+blocks.3+blocks.4", "+blocks.1+blocks.2", "-norm+head", "-blocks.3+blocks.4", "+blocks.0", "-blocks.1+blocks.2",
        "-blocks.0", "-root",
    ], backward
    run_parity(Parity(build=_untied_gpt, shard=_shard_groups, steps=3))
    run_parity(Parity(build=_untied_gpt, shard=_shard_groups_with_lists, steps=3))
    run_parity(Parity(build=_untied_gpt, shard=_shard_groups_with_lists, steps=2, step_fn=_explicit_unshard_step))


def _explicit_unshard_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A group gathered before the forward (async) and another gathered
    then freed again: the forward gathers only what is not gathered."""
    handle = unshard(model.blocks[3], async_op=True)
    unshard(model.blocks[1])
    reshard(model.blocks[2])  # the group of blocks 1-2, by its other member
    events: list[str] = []
    with _launches(model, events):
        handle.wait()
        loss = lm_loss(model(inputs), targets)
        forward = list(events)
    assert "+blocks.3+blocks.4" not in forward and "+blocks.1+blocks.2" in forward, forward
    loss.backward()
    return loss.detach()


def test_grouped_units_in_prefetch_lists_unshard_and_reshard_match_one_process() -> None:
    run_distributed(_grouped_units_with_controls, 2)


def _trainable_handles(model: nn.Module) -> int:
    return sum(len(state.trainable_handles) for _, state in unit_states_under(model))


@with_reductions_alone  # counts reductions per flat parameter
def _hybrid_micro_batches(rank: int, world_size: int) -> None:
    """Three micro-batches per step on HYBRID_SHARD (2 x 2): the first
    without gradient sync (on every unit, or on blocks.0 only), the second
    reduce-scattered without the replica all-reduce, the third with it;
    with the world-size divide, or a divide factor of 1.0, a loss scaled by
    the world size and the parameters kept gathered between micro-batches.
    Reductions counted per micro-batch."""
    shard_group, replicate_group = hybrid_groups(world_size)
    local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    parity = Parity(build=TinyGPT, shard=lambda m: None, atol=5e-6, rtol=1e-5)
    for divide_by_one, only in ((False, None), (True, "blocks.0")):
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        for block in model.blocks:
            fully_shard(block, strategy=ShardingStrategy.HYBRID_SHARD, process_group=(shard_group, replicate_group))
        fully_shard(model, strategy=ShardingStrategy.HYBRID_SHARD, process_group=(shard_group, replicate_group))
        if divide_by_one:
            for _, state in unit_states_under(model):
                set_gradient_divide_factor(state.module, 1.0)
        handles = _trainable_handles(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        label = f"divide by one {divide_by_one}, sync off on {only or 'all'}"
        for step in range(2):
            for micro in range(3):
                inputs, targets = batch(step * 3 + micro)
                lm_loss(reference(inputs), targets).backward()
                if only is None:
                    set_requires_gradient_sync(model, micro != 0)
                else:
                    set_requires_gradient_sync(model.get_submodule(only), micro != 0, recurse=False)
                set_requires_all_reduce(model, micro == 2)
                if divide_by_one:  # and the parameters kept gathered between micro-batches
                    set_reshard_after_backward(model, micro == 2)
                spy = CollectiveSpy()
                with spy.watching():
                    loss = lm_loss(model(inputs[local]), targets[local])
                    (loss / world_size if divide_by_one else loss).backward()
                counts = spy.counts()
                unsynced = 0 if micro != 0 else (handles if only is None else 1)
                assert counts["reduce_scatter"] == handles - unsynced, (label, step, micro, counts)
                assert counts["all_reduce"] == (handles if micro == 2 else 0), (label, step, micro, counts)
                if micro == 2 or not divide_by_one:
                    assert_resharded(model)
            step_and_compare(model, reference, (optimizer, reference_optimizer), parity, f"{label} step {step}")


def test_hybrid_micro_batches_without_sync_then_without_all_reduce_match_one_process() -> None:
    run_distributed(_hybrid_micro_batches, 4)


def _two_micro_batches_group_unsynced_first(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each half of the local batch, the first with the [norm, head] group's
    gradient sync off (its hook then reduces the sum of both)."""
    half = inputs.shape[0] // 2
    losses = []
    for micro, rows in enumerate((slice(0, half), slice(half, None))):
        set_requires_gradient_sync(model.head, micro == 1, recurse=False)
        loss = lm_loss(model(inputs[rows]), targets[rows])
        (loss / 2).backward()
        losses.append(loss.detach())
    return sum(losses) / 2


def _comm_hook_on_a_group(rank: int, world_size: int) -> None:
    """A default-equivalent hook registered through one member of the
    [norm, head] group reduces the group's one flat gradient (called once
    per synchronised backward, with its padded size)."""
    calls: list[int] = []
    padded: list[int] = []

    def counting_hook(state: comm_hooks.DefaultState, grad: torch.Tensor, output: torch.Tensor) -> None:
        calls.append(grad.numel())
        comm_hooks.reduce_scatter_hook(state, grad, output)

    def shard(model: nn.Module) -> None:
        _shard_groups(model)
        register_comm_hook(model.head, comm_hooks.DefaultState(), counting_hook)
        group = get_state(model.norm)
        assert group is get_state(model.head) and len(group.trainable_handles) == 1
        padded.append(group.trainable_handles[0].layout.padded_unsharded_numel)

    for step_fn in ("plain", "micro"):
        calls.clear()
        padded.clear()
        parity = Parity(build=_untied_gpt, shard=shard, steps=2)
        if step_fn == "micro":
            parity.step_fn = _two_micro_batches_group_unsynced_first
        run_parity(parity)
        assert calls == [padded[0]] * parity.steps, (step_fn, calls, padded)


def test_a_comm_hook_on_a_grouped_unit_reduces_its_flat_gradient_in_parity() -> None:
    run_distributed(_comm_hook_on_a_group, 2)


WIDTH = 8
EXPERTS = 4
# Per step, per micro-batch, the expert of each row of the global batch
# (rows 0-3 rank 0's, 4-7 rank 1's). Step 0: expert 2 runs only on rank 0
# in micro-batch 0, expert 3 only on rank 1 in micro-batch 1; step 1:
# expert 3 only on rank 0 in micro-batch 0, expert 2 only on rank 1 there.
EXPERT_ROUTES = (
    ((0, 2, 0, 2, 1, 1, 1, 1), (1, 1, 1, 1, 0, 3, 0, 3)),
    ((3, 3, 3, 3, 2, 0, 2, 0), (0, 0, 0, 0, 1, 1, 1, 1)),
)


class _Experts(nn.Module):
    """Top-1 routing given from outside: an expert no row reaches does not run."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(EXPERTS))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.embed(x))
        out = x
        for index, expert in enumerate(self.experts):
            rows = routes == index
            if rows.any():
                update = torch.zeros_like(out)
                update[rows] = expert(x[rows])
                out = out + update
        return self.head(out)


def _expert_loss(model: nn.Module, step: int, micro: int, rows: slice) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10 * step + micro)
    inputs = torch.randn(8, WIDTH, generator=generator)
    targets = torch.randn(8, WIDTH, generator=generator)
    routes = torch.tensor(EXPERT_ROUTES[step][micro])
    return ((model(inputs[rows], routes[rows]) - targets[rows]) ** 2).mean()


@with_reductions_alone  # counts reductions per flat parameter
def _skipped_experts_next_to_unsynced_units(rank: int, world_size: int) -> None:
    """Two micro-batches per step, the first with gradient sync off on the
    experts (units some ranks skip, each rank keeping what it ran) or on
    the units around them, these also with every unit's parameters kept
    gathered (``set_reshard_after_backward(False)``: the experts, reduced,
    stay gathered on every rank); the second reduces everything."""
    local = slice(rank * 4, rank * 4 + 4)
    parity = Parity(build=_Experts, shard=lambda m: None)
    for unsynced in ("experts", "embed and head", "embed and head, kept gathered"):
        torch.manual_seed(0)
        model = _Experts()
        reference = copy.deepcopy(model)
        for expert in model.experts:
            fully_shard(expert)
        fully_shard(model.embed)
        fully_shard(model.head)
        fully_shard(model)
        set_may_be_skipped(model.experts)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        targets = [model.experts] if unsynced == "experts" else [model.embed, model.head]
        for step in range(len(EXPERT_ROUTES)):
            for micro in range(2):
                _expert_loss(reference, step, micro, slice(None)).backward()
                for target in targets:
                    set_requires_gradient_sync(target, micro == 1)
                if unsynced.endswith("kept gathered"):
                    set_reshard_after_backward(model, micro == 1)
                spy = CollectiveSpy()
                with spy.watching():
                    loss = _expert_loss(model, step, micro, local)
                    forward_gathers = spy.counts()["all_gather_into"]
                    loss.backward()
                if unsynced.endswith("kept gathered") and micro == 1:
                    # Every rank kept every unit, experts it skipped too:
                    # the forward gathers nothing (not some experts on some
                    # ranks, which paired different units' all-gathers).
                    assert forward_gathers == 0, (step, spy.counts())
                if micro == 1 or not unsynced.endswith("kept gathered"):
                    assert_resharded(model)
                # One reduction per synchronised unit that ran on any rank
                # (or accumulated without sync before): embed and head, and
                # the experts the global batch reached.
                reached = set(EXPERT_ROUTES[step][micro])
                if unsynced == "experts":
                    expected = 2 if micro == 0 else 2 + len(reached | set(EXPERT_ROUTES[step][0]))
                else:
                    expected = len(reached) + (0 if micro == 0 else 2)
                assert spy.counts()["reduce_scatter"] == expected, (unsynced, step, micro, spy.counts())
            compare_full(model, reference, parity, f"sync off on {unsynced}, step {step}", grads=True)
            optimizer.step()
            reference_optimizer.step()
            optimizer.zero_grad()
            reference_optimizer.zero_grad()
            compare_full(model, reference, parity, f"sync off on {unsynced}, step {step} after optimizer step", grads=False)


def test_skipped_experts_next_to_units_without_gradient_sync_match_one_process() -> None:
    run_distributed(_skipped_experts_next_to_unsynced_units, 2)
