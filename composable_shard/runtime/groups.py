"""Owns: the forward hooks of a group — one unit made of several modules by
``fully_shard([a, b, ...])`` — which turn the modules' separate forwards
into one forward of the unit: it begins at the first of its modules to run
and ends after the last.

Knows nothing of: what a unit does when its forward begins or ends (the
caller passes those steps in ``GroupSteps``: runtime/hooks.py's), streams,
flattening details.

Public names: ``GroupSteps``, ``register_group_forward_hooks``,
``end_open_groups``, ``group_method_hooks``.

[Note: grouped units]
A group has one state, shared by its modules (``get_state`` of each gives
it), and one flat parameter per dtype and trainability for all of them.
Its forward begins at the pre-forward of whichever of its modules runs
first in this forward: the all-gather, the forward-order record and the
forward prefetch happen there once. The other modules' pre-forwards only
cast their inputs (mixed precision) and route them for the frozen
reshard. Every module's post-forward hooks its outputs for the unit's
pre-backward (backward may reach any of them first); the forward ends
(reshard, or hold for backward, as a single unit's does) after the last
of its modules ran. A module that does not run in a forward leaves the
group open: the root's post-forward ends it (and a module called on its
own, outside the root's forward, ends it at once). Backward needs nothing
of its own: a flat parameter's gradient is accumulated once every module's
use of it has its gradient, so the reduction follows the last. FSDP2
groups its modules the same way (``_register_group_forward_hooks``);
unlike it, a forward that skips one of the modules still reshards at the
root's end. Pinned by tests/training/test_grouped_units.py.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from .state import RootContext, TrainingState, UnitState
from .forward_inputs import cast_inputs, hook_inputs_for_frozen_reshard
from .lifecycle import in_backward

__all__ = ["GroupSteps", "register_group_forward_hooks", "end_open_groups", "group_method_hooks"]


@dataclass(frozen=True)
class GroupSteps:
    """What a unit does at its forward's edges (runtime/hooks.py's)."""

    # The unit's forward pre-hook (begins the unit's forward).
    pre_forward: Callable[[UnitState, nn.Module, tuple, dict], tuple[tuple, dict]]
    # Hooks the output's tensors for the unit's pre-backward; whether any.
    hook_outputs: Callable[[UnitState, Any], bool]
    # Ends the unit's forward: (state, grad_enabled, outputs_hooked).
    end_forward: Callable[[UnitState, bool, bool], None]
    # The always-called forward hook that resets a unit whose forward raised.
    after_raised: Callable[[UnitState, nn.Module, tuple, Any], None]


@dataclass(eq=False)
class _GroupForward:
    """One forward of a group, from its first module's pre-forward on."""

    # Whether the group's forward has begun and not ended.
    open: bool = False
    # Modules of the group that have not run in this forward yet (by id).
    left_to_run: set[int] = field(default_factory=set)
    # Modules whose forward began and has not returned (by id): one still
    # here when the always-called hook runs raised.
    running: set[int] = field(default_factory=set)
    # Whether any module ran with autograd on, and hooked an output.
    grad_enabled: bool = False
    outputs_hooked: bool = False


# Each group's forward record and steps (weak: the record holds no state).
_FORWARDS: weakref.WeakKeyDictionary[UnitState, tuple[_GroupForward, GroupSteps]] = weakref.WeakKeyDictionary()


def register_group_forward_hooks(state: UnitState, steps: GroupSteps) -> list[RemovableHandle]:
    """Attach the group's forward hooks to each of its modules."""
    record = _GroupForward()
    _FORWARDS[state] = (record, steps)
    handles = []
    for module in state.members:
        handles.append(
            module.register_forward_pre_hook(
                functools.partial(_pre_forward, state, record, steps), with_kwargs=True, prepend=True
            )
        )
        handles.append(module.register_forward_hook(functools.partial(_post_forward, state, record, steps)))
        handles.append(
            module.register_forward_hook(functools.partial(_after_raised, state, record, steps), always_call=True)
        )
    return handles


def end_open_groups(context: RootContext) -> None:
    """The root's forward ends: end the forward of every group some of
    whose modules did not run ([Note: grouped units])."""
    for unit in context.units:
        found = _FORWARDS.get(unit) if unit.is_group else None
        if found is not None and found[0].open and unit.training_state is TrainingState.FORWARD:
            _end(unit, *found)


def _pre_forward(
    state: UnitState, record: _GroupForward, steps: GroupSteps, module: nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    if state.root_context is None:
        raise ValueError(
            f"fully_shard({'+'.join(type(m).__name__ for m in state.members)}): a group of modules ran before "
            "any unit containing it: a group cannot be the root. Call fully_shard(model) on the module that "
            "contains every module of the group (after the group's call), and run that model."
        )
    if in_backward():  # an activation-checkpoint re-run: the unit's own rules
        return steps.pre_forward(state, module, args, kwargs)
    if record.open and state.training_state is TrainingState.FORWARD:
        # Another module of the group began the group's forward.
        record.running.add(id(module))
        args, kwargs = cast_inputs(state, args, kwargs)
        return hook_inputs_for_frozen_reshard(state, args, kwargs)
    args, kwargs = steps.pre_forward(state, module, args, kwargs)
    record.open = True
    record.left_to_run = {id(member) for member in state.members}
    record.running = {id(module)}
    record.grad_enabled = record.outputs_hooked = False
    return args, kwargs


def _post_forward(state: UnitState, record: _GroupForward, steps: GroupSteps, module: nn.Module, args: tuple, output: Any) -> Any:
    if in_backward() or not record.open:
        return output
    record.running.discard(id(module))
    record.left_to_run.discard(id(module))
    if state.forward_method_depth:  # [Note: forward methods] in runtime/hooks.py
        return output
    if torch.is_grad_enabled():
        record.grad_enabled = True
        # Evaluated for every module (no short circuit): each one's outputs.
        record.outputs_hooked = steps.hook_outputs(state, output) or record.outputs_hooked
    called_alone = state.context.root.training_state is not TrainingState.FORWARD
    if not record.left_to_run or called_alone:
        _end(state, record, steps)
    return output


def _after_raised(state: UnitState, record: _GroupForward, steps: GroupSteps, module: nn.Module, args: tuple, output: Any) -> None:
    """Its post-forward did not run: this module's forward raised."""
    if id(module) in record.running and not in_backward():
        record.open = False
        record.running.clear()
        steps.after_raised(state, module, args, output)
    return None


def group_method_hooks(state: UnitState) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """The (pre-forward, post-forward, raised) steps with which a registered
    forward method of one of the group's modules runs as that module's
    forward in the group's ([Note: forward methods] in runtime/hooks.py)."""
    record, steps = _FORWARDS[state]
    return (
        functools.partial(_pre_forward, state, record, steps),
        functools.partial(_post_forward, state, record, steps),
        functools.partial(_method_raised, state, record, steps),
    )


def _method_raised(state: UnitState, record: _GroupForward, steps: GroupSteps, module: nn.Module, args: tuple, output: Any) -> None:
    record.open = False
    record.running.clear()
    steps.after_raised(state, module, args, output)


def _end(state: UnitState, record: _GroupForward, steps: GroupSteps) -> None:
    record.open = False
    record.running.clear()
    steps.end_forward(state, record.grad_enabled, record.outputs_hooked)
