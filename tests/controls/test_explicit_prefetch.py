"""Explicit prefetch lists (``set_modules_to_forward_prefetch`` /
``set_modules_to_backward_prefetch``): the listed units' all-gathers are
launched, in list order, when the listing unit's forward / backward starts
(recorded launch by launch), and training with the lists matches the
single-process reference. Ports FSDP2's ``test_explicit_prefetching``,
``test_set_modules_to_forward_prefetch`` / ``..._backward_prefetch`` and
``test_backward_misprefetch``."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

from composable_shard import fully_shard, set_modules_to_backward_prefetch, set_modules_to_forward_prefetch
from composable_shard.handle import FlatParamHandle
from composable_shard.runtime.state import unit_states_under

from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT
from tests.support.parity import Parity, run_parity

BLOCKS = 4


@contextlib.contextmanager
def _launches(model: nn.Module, events: list[str]) -> Iterator[None]:
    """Record "+unit" at each all-gather launch and "-unit" at each reshard
    (calls through)."""
    names = {id(h): name or "root" for name, state in unit_states_under(model) for h in state.handles}
    real_unshard, real_reshard = FlatParamHandle.unshard, FlatParamHandle.reshard

    def unshard(self: FlatParamHandle, *, async_op: bool):
        if not self.is_unsharded:
            events.append("+" + names[id(self)])
        return real_unshard(self, async_op=async_op)

    def reshard(self: FlatParamHandle, **kwargs: bool) -> None:
        if self.is_unsharded:
            events.append("-" + names[id(self)])
        real_reshard(self, **kwargs)

    FlatParamHandle.unshard, FlatParamHandle.reshard = unshard, reshard  # type: ignore[method-assign]
    try:
        yield
    finally:
        FlatParamHandle.unshard, FlatParamHandle.reshard = real_unshard, real_reshard  # type: ignore[method-assign]


def _shard_with_lists(model: nn.Module) -> None:
    """FSDP2's test: each block prefetches the next two in forward and the
    previous two in backward; blocks near the ends have no list."""
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks[:-2]):
        set_modules_to_forward_prefetch(block, [blocks[i + 1], blocks[i + 2]])
    for i, block in enumerate(blocks[2:], start=2):
        set_modules_to_backward_prefetch(block, [blocks[i - 1], blocks[i - 2]])


def _launch_order(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT(n_blocks=BLOCKS)
    _shard_with_lists(model)
    inputs = torch.randint(0, 32, (2, 6))
    events: list[str] = []
    with _launches(model, events):
        loss = model(inputs).sum()
        forward = list(events)
        loss.backward()
    backward = events[len(forward) :]
    # blocks.0 launches blocks.1 and blocks.2 as its forward starts, before
    # it reshards; blocks.1 then adds blocks.3.
    assert forward == [
        "+root", "+blocks.0", "+blocks.1", "+blocks.2", "-blocks.0", "+blocks.3", "-blocks.1", "-blocks.2", "-blocks.3"
    ], forward
    # blocks.3's backward launches blocks.2 and blocks.1 at once, blocks.2's
    # adds blocks.0; without lists each waits for the previous reshard.
    assert backward == [
        "+blocks.3", "+blocks.2", "+blocks.1", "-blocks.3", "+blocks.0", "-blocks.2", "-blocks.1", "-blocks.0", "-root"
    ], backward


def test_listed_units_are_gathered_when_the_listing_unit_starts() -> None:
    run_distributed(_launch_order, 2)


def _misprefetch(model: nn.Module) -> None:
    """A backward list naming a unit whose backward already ran (FSDP2's
    misprefetch): it is gathered for nothing and freed by the end of backward."""
    _shard_with_lists(model)
    set_modules_to_backward_prefetch(model.blocks[0], [model.blocks[3]])


def _parity_with_lists(rank: int, world_size: int) -> None:
    run_parity(Parity(build=lambda: TinyGPT(n_blocks=BLOCKS), shard=_shard_with_lists, steps=3))
    run_parity(Parity(build=lambda: TinyGPT(n_blocks=BLOCKS), shard=_misprefetch, steps=2))


def test_training_with_prefetch_lists_matches_reference() -> None:
    run_distributed(_parity_with_lists, 2)
