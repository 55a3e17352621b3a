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
    set_reshard_after_forward,
    unshard,
)
from composable_shard.handle import FlatParamHandle
from composable_shard.state import get_state, unit_states_under

from tests.support.comm_spies import CollectiveSpy
from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT, batch, lm_loss
from tests.support.parity import Parity, assert_resharded, compare_full, hybrid_groups, run_parity

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
