"""The tree's lifecycle has one gate: every entry point from outside a step
(``unshard_params``, ``clip_grad_norm_``, the state-dict functions,
``module.state_dict()``) refuses a call made inside a forward or a backward
with the same message naming the busy unit, and ends what a forward held for
a backward that has not come; the optimizer step passes it too but is left
alone inside a step; the tree's phase reads idle, held or in step."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from composable_shard import clip_grad_norm_, fully_shard, get_model_state_dict, unshard_params
from composable_shard.runtime import TreePhase, tree_phase
from composable_shard.runtime.state import get_state, unit_states_under

from tests.support.harness_pool import run_distributed
from tests.support.models import Block, TinyGPT, batch, lm_loss


def _phase(model: torch.nn.Module) -> TreePhase:
    return tree_phase(state for _, state in unit_states_under(model))


def _unshard(model: torch.nn.Module) -> None:
    with unshard_params(model):
        pass


_ENTRIES: dict[str, Callable[[torch.nn.Module], object]] = {
    "unshard_params": _unshard,
    "clip_grad_norm_": lambda model: clip_grad_norm_(model, 1.0),
    "get_model_state_dict": get_model_state_dict,
    "state_dict": lambda model: model.state_dict(),
}


def _every_entry_passes_one_gate(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    fully_shard(model, policy={Block})
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    per_rank = 8 // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    inputs, targets = batch(0)
    assert _phase(model) is TreePhase.IDLE
    for name, entry in _ENTRIES.items():
        # Inside a forward: refused, naming the unit that runs.
        hook = model.blocks[1].register_forward_pre_hook(lambda *args, entry=entry: entry(model))
        with pytest.raises(RuntimeError, match=r"called inside forward or backward \(unit '.*' is FORWARD\)"):
            model(inputs[local])
        hook.remove()
        # Between a forward and its backward: the held state ends.
        loss = lm_loss(model(inputs[local]), targets[local])
        assert _phase(model) is TreePhase.HELD_FOR_BACKWARD, name
        entry(model)
        assert _phase(model) is TreePhase.IDLE, name
        # Inside backward: refused.
        errors: list[Exception] = []

        def in_backward(grad: torch.Tensor, entry: Callable = entry) -> None:
            assert _phase(model) is TreePhase.IN_STEP
            try:
                entry(model)
            except RuntimeError as error:
                errors.append(error)

        loss.register_hook(in_backward)
        loss.backward()
        assert len(errors) == 1 and "called inside forward or backward" in str(errors[0]), (name, errors)
        optimizer.zero_grad()
    # The optimizer step ends the held state between steps, and is let
    # through inside a step (an optimizer in backward).
    lm_loss(model(inputs[local]), targets[local])
    assert _phase(model) is TreePhase.HELD_FOR_BACKWARD
    optimizer.step()
    assert _phase(model) is TreePhase.IDLE
    hook = model.blocks[1].register_forward_pre_hook(lambda *args: optimizer.step())
    lm_loss(model(inputs[local]), targets[local]).backward()
    hook.remove()
    assert get_state(model).training_state.name == "IDLE"
    assert _phase(model) is TreePhase.IDLE


def test_every_outside_entry_passes_one_gate() -> None:
    run_distributed(_every_entry_passes_one_gate, 2)
