"""The per-unit controls refuse bad arguments at once, naming the module
(not a unit, not a bool, a prefetch list with a non-unit or a unit of
another tree), and combinations that cannot work at the unit's next
forward or backward, naming the unit; the model stays usable."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from composable_shard import (
    fully_shard,
    reshard,
    set_is_last_backward,
    set_modules_to_backward_prefetch,
    set_modules_to_forward_prefetch,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    set_reshard_after_forward,
)
from composable_shard import unshard
from composable_shard.runtime.state import get_state

from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT
from tests.support.parity import assert_resharded


def _sharded() -> nn.Module:
    torch.manual_seed(0)
    model = TinyGPT()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _train_step(model: nn.Module) -> None:
    model(torch.randint(0, 32, (2, 6))).sum().backward()
    model.zero_grad()
    assert_resharded(model)


def _bad_arguments(rank: int, world_size: int) -> None:
    model, other = _sharded(), _sharded()
    with pytest.raises(ValueError, match=r"set_requires_gradient_sync\(Linear\): no module in this tree"):
        set_requires_gradient_sync(nn.Linear(2, 2), False)
    with pytest.raises(ValueError, match=r"set_reshard_after_backward\(LayerNorm\): this module is not a unit"):
        set_reshard_after_backward(model.blocks[0].norm, False, recurse=False)
    with pytest.raises(ValueError, match=r"unshard\(Linear\): this module is not a unit"):
        unshard(model.blocks[0].fc_in)
    with pytest.raises(TypeError, match=r"set_reshard_after_forward\(Block, \.\.\.\): reshard must be a bool.*int 0"):
        set_reshard_after_forward(model.blocks[0], 0)
    with pytest.raises(TypeError, match=r"set_is_last_backward\(TinyGPT, \.\.\.\): is_last must be a bool"):
        set_is_last_backward(model, "no")
    with pytest.raises(TypeError, match=r"unshard\(Block, \.\.\.\): async_op must be a bool"):
        unshard(model.blocks[0], async_op=None)
    with pytest.raises(TypeError, match=r"modules must be a list of units, got Block"):
        set_modules_to_forward_prefetch(model.blocks[0], model.blocks[1])
    with pytest.raises(ValueError, match=r"modules\[1\] \(Linear\) is not a unit"):
        set_modules_to_backward_prefetch(model.blocks[1], [model.blocks[0], model.blocks[0].fc_in])
    # Another tree: refused at once once both trees ran a forward.
    _train_step(model)
    _train_step(other)
    with pytest.raises(ValueError, match=r"modules\[0\] \(Block, 'blocks.1'\) belongs to another tree than 'blocks.0'"):
        set_modules_to_forward_prefetch(model.blocks[0], [other.blocks[1]])
    # Nothing was set by the refused calls.
    assert get_state(model.blocks[0]).forward_prefetch_units is None
    assert get_state(model.blocks[0]).reshard_after_forward is None
    _train_step(model)


def test_bad_arguments_raise_at_once_naming_the_module() -> None:
    run_distributed(_bad_arguments, 2)


def _combinations_refused_at_the_next_forward(rank: int, world_size: int) -> None:
    # A unit of a tree that has not run yet, listed: refused at the forward.
    model, other = _sharded(), _sharded()
    set_modules_to_forward_prefetch(model.blocks[0], [other.blocks[1]])
    with pytest.raises(RuntimeError, match=r"fully_shard\(blocks.0\): its forward prefetch list names Block.*another tree"):
        model(torch.randint(0, 32, (2, 6)))
    set_modules_to_forward_prefetch(model.blocks[0], [])
    _train_step(model)
    # CPU offload (configured here by hand: offload needs a GPU) keeps no
    # unsharded parameters after backward and waits for its gradient
    # downloads at the end of every backward.
    state = get_state(model.blocks[1])
    state.config = dataclasses.replace(state.config, offload_params=True)
    for setter, message in (
        (set_reshard_after_backward, r"set_reshard_after_backward\(False\) with CPU offload, seen at its forward"),
        (set_is_last_backward, r"set_is_last_backward\(False\) with CPU offload, seen at its forward"),
    ):
        setter(model, False)
        with pytest.raises(RuntimeError, match=rf"fully_shard\(blocks.1\): {message}"):
            model(torch.randint(0, 32, (2, 6)))
        setter(model, True)
    state.config = dataclasses.replace(state.config, offload_params=False)
    _train_step(model)
    # reshard inside the unit's own forward is refused; the model recovers.
    model.blocks[0].fc_in.register_forward_pre_hook(lambda module, args: reshard(model.blocks[0]))
    with pytest.raises(RuntimeError, match=r"reshard\(Block\): unit 'blocks.0' is inside its forward"):
        model(torch.randint(0, 32, (2, 6)))
    assert_resharded(model)


def test_combinations_that_cannot_work_raise_at_the_next_forward_naming_the_unit() -> None:
    run_distributed(_combinations_refused_at_the_next_forward, 2)
