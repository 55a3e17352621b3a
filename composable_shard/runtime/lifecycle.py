"""Owns: the lifecycle of a tree of units — idle, in a step, or held for a
backward — and the one gate every entry point from outside a step passes
(state dicts, ``unshard_params``, ``clip_grad_norm_``, the optimizer step,
a forward starting): it refuses a call made inside a step and ends the held
state; and bringing a tree back to idle at the end of backward or after a
misuse.

Knows nothing of: the hooks (they call it), flattening details.

Public names: ``TreePhase``, ``tree_phase``, ``in_backward``,
``enter_between_steps``, ``start_root_forward``,
``end_forward_without_backward``, ``return_tree_to_idle``,
``reset_after_error``, ``backward_was_abandoned``,
``recover_from_abandoned_backward``, ``track_root``.

[Note: held for backward]
A forward with autograd on ends with some units still gathered for the
backward it expects: the root, the unit that ran last ([Note: the last unit
stays gathered] in prefetch.py) and, under strategies that do not reshard
after forward, every unit. Such a unit is ``HELD_FOR_BACKWARD``: its buffer
is kept, but its owners show the shards, so outside a step everyone sees
shards only. The state ends in one of three ways: the backward comes (its
pre-backward finds the buffer gathered); anything else comes first and
passes ``enter_between_steps``, which frees every gathered buffer of the
tree, waits for the lanes (and, with CPU offload, the host copies) and moves
the units to ``IDLE`` (a dropped forward's graph may be freed without any
hook running, so nothing waits for autograd); or a backward of that output
comes after all, and pre-backward unshards again into the storage the
saved views alias. Resharding is local, so ending the state on one rank and
not another cannot hang. Pinned by tests/runtime/test_forward_without_backward.py.

[Note: a backward that raised]
The autograd engine runs the callbacks queued in a backward only when that
backward completes: one that raised (a user's backward hook or custom
Function, an error of ours in a hook) leaves the end-of-backward callback
queued and units in PRE_BACKWARD or POST_BACKWARD. Outside any backward on
this thread nothing else leaves them so, so the next entry through the gate
(a forward, the optimizer step, state dicts, ``clip_grad_norm_``) takes it
as such a backward's leftovers and resets the tree: reductions in flight
complete without reaching ``.grad`` (the user clears gradients after a
failed step; a result landing later would leak into the next one), local
gradients are dropped, every unit reshards. The gradients of the failed
step are partial, as in one process: call ``zero_grad()`` before the next.
Pinned by tests/training/test_loop_recovery.py.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Literal

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from ..handle import pending_views
from .state import BETWEEN_STEPS, RootContext, TrainingState, UnitState
from .labels import hook_label
from .partial_backward import warn_step_after_partial_backwards
from .published_shards import close_step_shards, publish_step_shards
from .optimizer_checks import (
    is_elementwise,
    refuse_coupling_optimizer,
    refuse_local_loss_scaler,
    remember_step_after_pending_forward,
    remember_step_while_held,
)
from .unit_controls import (
    drop_gathered_written_back,
    end_backward_leaving_reductions,
    needs_settling,
    settle_gathered_and_reductions,
)

__all__ = [
    "TreePhase",
    "tree_phase",
    "in_backward",
    "enter_between_steps",
    "start_root_forward",
    "end_forward_without_backward",
    "return_tree_to_idle",
    "reset_after_error",
    "backward_was_abandoned",
    "recover_from_abandoned_backward",
    "track_root",
    "track_unit",
    "live_units",
    "OptimizerStepExtension",
    "register_optimizer_step_extension",
]

# Every root's context, for the optimizer step pre-hook (weak: a deleted
# model drops its context).
_ROOT_CONTEXTS: weakref.WeakSet[RootContext] = weakref.WeakSet()
# Every unit fully_shard built (weak), for the optimizer step: it may come
# before the first forward, when no root context exists yet.
_UNITS: weakref.WeakSet[UnitState] = weakref.WeakSet()
# The process-wide optimizer step hooks, registered by the first fully_shard.
_OPTIMIZER_STEP_HOOKS: list[RemovableHandle] = []


@dataclass(frozen=True)
class OptimizerStepExtension:
    """What a wing adds to every optimizer step over units (the owner step
    of composable_shard/optim/), registered without the core importing it."""

    # After the refusals and the gate, before the optimizer's own step:
    # the optimizer, every live unit, and the step's arguments.
    before_step: Callable[[torch.optim.Optimizer, list[UnitState], tuple, dict], None]
    # After the optimizer's own step returned.
    after_step: Callable[[torch.optim.Optimizer], None]
    # At every entry from outside a step: undo what a step that raised
    # left half done, before anything reads the parameters.
    settle: Callable[[], None]


_STEP_EXTENSIONS: list[OptimizerStepExtension] = []


def register_optimizer_step_extension(extension: OptimizerStepExtension) -> None:
    """Run ``extension`` around every optimizer step (idempotent)."""
    if extension not in _STEP_EXTENSIONS:
        _STEP_EXTENSIONS.append(extension)


class TreePhase(enum.Enum):
    """Where a tree of units is, as seen from outside a step."""

    # No forward or backward runs; every unit shows and holds shards only.
    IDLE = enum.auto()
    # A forward or backward runs (or a backward was started and not ended).
    IN_STEP = enum.auto()
    # No forward or backward runs, but some units keep gathered buffers for
    # a backward that may not come ([Note: held for backward]).
    HELD_FOR_BACKWARD = enum.auto()


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


def tree_phase(units: Iterable[UnitState], *, backward_queued: bool = False) -> TreePhase:
    """The one definition of "between steps": no backward on this thread,
    none started and unfinished, and every unit idle or held."""
    units = list(units)
    if backward_queued or in_backward() or any(unit.training_state not in BETWEEN_STEPS for unit in units):
        return TreePhase.IN_STEP
    if any(unit.training_state is TrainingState.HELD_FOR_BACKWARD for unit in units):
        return TreePhase.HELD_FOR_BACKWARD
    return TreePhase.IDLE


def _trees(units: Iterable[UnitState]) -> list[tuple[RootContext | None, list[UnitState]]]:
    """The trees ``units`` belong to: each root's context with all its
    units; a unit before lazy init is a tree of its own."""
    contexts: dict[RootContext, None] = {}
    trees: list[tuple[RootContext | None, list[UnitState]]] = []
    for unit in units:
        if unit.root_context is None:
            trees.append((None, [unit]))
        elif unit.root_context not in contexts:
            contexts[unit.root_context] = None
            trees.append((unit.root_context, unit.root_context.units))
    return trees


def enter_between_steps(
    units: Iterable[UnitState],
    what: str,
    *,
    inside_a_step: Literal["raise", "skip"] = "raise",
    keep_gathered: bool = False,
) -> None:
    """The gate: every entry point that reads or changes the parameters
    outside a step calls it first. For each tree ``units`` belong to: inside
    a step, raise a ``RuntimeError`` naming ``what`` (``inside_a_step="skip"``:
    leave that tree alone, for callers that may legally run inside a step,
    such as an optimizer stepping from a gradient hook); held for backward,
    end the held state ([Note: held for backward]); then, unless
    ``keep_gathered`` (a forward), finish reductions left in flight and free
    what idle units kept gathered ([Note: units kept gathered between
    steps] in unit_controls.py)."""
    for extension in _STEP_EXTENSIONS:
        extension.settle()
    for context, tree in _trees(units):
        if context is not None and backward_was_abandoned(context):
            recover_from_abandoned_backward(context)
        queued = context is not None and context.post_backward_callback_queued
        phase = tree_phase(tree, backward_queued=queued)
        if phase is TreePhase.IN_STEP and inside_a_step == "raise":
            busy = next((unit for unit in tree if unit.training_state not in BETWEEN_STEPS), tree[0])
            raise RuntimeError(
                f"{what}: called inside forward or backward (unit '{busy.fqn}' is {busy.training_state.name}"
                f"{', a backward is running' if in_backward() or queued else ''}). Call it between training "
                "steps, not from a module's forward, a forward hook or a backward hook."
            )
        if phase is TreePhase.HELD_FOR_BACKWARD and context is not None:
            _end_held_state(context)
        if phase is not TreePhase.IN_STEP and context is not None and not keep_gathered:
            settle_gathered_and_reductions(context)


def start_root_forward(context: RootContext) -> None:
    """The root's forward starts a step: a tree a raised forward or backward
    left mid-step is reset ([Note: a forward that raised] in hooks.py,
    [Note: a backward that raised]); any other unfinished state is reset
    and refused; the held state ends; the user's changes since the last step
    go into the shards, and the step's first all-gather comes after them."""
    if backward_was_abandoned(context):
        recover_from_abandoned_backward(context)
    busy = [unit for unit in context.units if unit.training_state not in BETWEEN_STEPS]
    if busy and not context.post_backward_callback_queued and all(
        unit.training_state is TrainingState.FORWARD for unit in busy
    ):
        # The previous forward raised (user code, or a misuse reported from a
        # hook) and left its units in FORWARD; no backward can follow it.
        reset_after_error(context)
        busy = []
    if busy or context.post_backward_callback_queued:
        reset_after_error(context)
        raise RuntimeError(
            f"fully_shard({context.root.fqn}): forward called while the previous backward has not finished "
            f"(units still in backward: {[unit.fqn for unit in busy[:4]]}). Finish backward (or call it on every "
            "output) before the next forward; the model has been reset to its sharded state and is usable."
        )
    enter_between_steps(context.units, "forward", keep_gathered=True)
    drop_gathered_written_back(context)
    # The optimizer, the user and this write-back wrote shards on compute:
    # the step's first all-gather comes after ([Note: what a lane waits for]).
    context.scheduler.mark_shards_written()
    publish_step_shards(context)  # [Note: all-gathers from published shards]


def end_forward_without_backward(context: RootContext) -> None:
    """The root's forward ran without autograd: no backward will come, so
    free what forward prefetch left gathered, but what a unit keeps with
    ``set_reshard_after_forward(False)``."""
    for unit in context.units:
        if unit.reshard_after_forward is not False:
            unit.reshard()
    synchronize_host_copies(context)
    close_step_shards(context)


def _end_held_state(context: RootContext) -> None:
    with hook_label(context.root, "end_held_for_backward"):
        context.scheduler.wait_for_all()
        for unit in context.units:
            for handle in unit.handles:
                unit.reshard_handle(handle)  # also what forward prefetch left gathered
            if unit.training_state is TrainingState.HELD_FOR_BACKWARD:
                unit.transition(TrainingState.IDLE, TrainingState.HELD_FOR_BACKWARD)
        synchronize_host_copies(context)
        close_step_shards(context, every_rank=False)


def synchronize_host_copies(context: RootContext) -> None:
    """With CPU offload, the host's one wait per step: gradient downloads
    are complete and no upload still reads the shards. Called after the
    scheduler's ``wait_for_all`` ([Note: lane fences] in runtime/scheduler.py)."""
    if context.offloads_params:
        context.scheduler.synchronize_host()


def return_tree_to_idle(context: RootContext, *, discard_grads: bool) -> None:
    """Finish every lane's work, reshard every unit, reset the per-step
    counters, and (with CPU offload) wait for the host's copies: the end of
    a backward, or, with ``discard_grads``, the reset after a misuse, which
    also drops unreduced gradients and re-registers every handle's
    parameters whatever it shows. A backward that is not the last leaves
    its reductions in flight, and units with
    ``set_reshard_after_backward(False)`` stay gathered ([Note: a backward
    that is not the last], [Note: units kept gathered between steps] in
    unit_controls.py)."""
    leave_reductions = not discard_grads and end_backward_leaving_reductions(context)
    if not leave_reductions:
        context.scheduler.wait_for_all()
    for unit in context.units:
        keep = not discard_grads and not unit.reshard_after_backward
        for handle in unit.handles:
            if discard_grads:
                handle.clear_unsharded_grad()
                pending_views.forget_shown(handle)
                unit.reshard_handle(handle)
            elif keep:
                handle.hide_unsharded_views()
            elif handle.is_unsharded or handle.shows_unsharded_views:  # else post-backward resharded it
                unit.reshard_handle(handle)
        unit.reset_step_counters()
    context.post_backward_callback_queued = False
    close_step_shards(context, every_rank=not discard_grads)
    if not leave_reductions:
        synchronize_host_copies(context)


def reset_after_error(context: RootContext) -> None:
    """Bring every unit back to IDLE and sharded (after a misuse)."""
    return_tree_to_idle(context, discard_grads=True)
    context.handles_with_deferred_grad_hooks = []


def backward_was_abandoned(context: RootContext) -> bool:
    """Whether a backward of the tree raised and left it mid-step
    ([Note: a backward that raised])."""
    if in_backward():
        return False
    return context.post_backward_callback_queued or any(
        unit.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD) for unit in context.units
    )


def recover_from_abandoned_backward(context: RootContext) -> None:
    """Reset a tree a raised backward left mid-step ([Note: a backward
    that raised]): its reductions complete unapplied, then the reset."""
    with hook_label(context.root, "recover_from_raised_backward"):
        context.scheduler.abandon_reductions()
        reset_after_error(context)


# ------------------------------------------------------------ optimizer step
def track_root(context: RootContext) -> None:
    """Let the optimizer step pass the gate for this tree (lazy init)."""
    _ROOT_CONTEXTS.add(context)
    _register_step_hooks()


def track_unit(unit: UnitState) -> None:
    """Let the optimizer step see this unit from the moment ``fully_shard``
    built it: a step before the first forward is refused or stepped by
    owners like any other."""
    _UNITS.add(unit)
    _register_step_hooks()


def _register_step_hooks() -> None:
    if not _OPTIMIZER_STEP_HOOKS:
        _OPTIMIZER_STEP_HOOKS.append(register_optimizer_step_pre_hook(_pre_optimizer_step))
        _OPTIMIZER_STEP_HOOKS.append(register_optimizer_step_post_hook(_post_optimizer_step))


def _pre_optimizer_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """Before any ``Optimizer.step``: the trees whose parameters it updates
    pass the gate (the step writes the shards; with CPU offload an upload
    may still read them). Inside a step (an optimizer in backward) nothing
    is held to end."""
    # Only an optimizer that is not elementwise is refused or stepped by
    # owners: the usual AdamW step does not list (and sort) every unit.
    units = [] if is_elementwise(optimizer) else live_units()
    refuse_coupling_optimizer(optimizer, units)  # [Note: optimizers over shards]
    refuse_local_loss_scaler(optimizer, live_units)  # [Note: loss scaling over shards]
    for context in list(_ROOT_CONTEXTS):
        if context.root.root_context is not context:
            continue  # a tree that became part of a larger one
        if backward_was_abandoned(context) and _updates_tree(optimizer, context):
            recover_from_abandoned_backward(context)  # [Note: a backward that raised]
        # [Note: a step after backwards that accumulated nothing] in partial_backward.py
        warn_step_after_partial_backwards(context, lambda: _updates_tree(optimizer, context))
        held = any(unit.training_state is TrainingState.HELD_FOR_BACKWARD for unit in context.units)
        if (held or needs_settling(context)) and _updates_tree(optimizer, context):
            if held and tree_phase(context.units, backward_queued=context.post_backward_callback_queued) is TreePhase.HELD_FOR_BACKWARD:
                remember_step_while_held(context, optimizer)  # [Note: optimizer step between forward and backward]
            elif not held and not context.post_backward_callback_queued:  # idle, something kept gathered
                remember_step_after_pending_forward(context, optimizer)
            enter_between_steps(context.units, "optimizer.step", inside_a_step="skip")
        elif not held and not context.post_backward_callback_queued and _updates_tree(optimizer, context):
            remember_step_after_pending_forward(context, optimizer)
    for extension in _STEP_EXTENSIONS:
        extension.before_step(optimizer, units, args, kwargs)


def _post_optimizer_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    for extension in _STEP_EXTENSIONS:
        extension.after_step(optimizer)


def live_units() -> list[UnitState]:
    """Every live unit, in the order fully_shard built them on this rank."""
    return sorted(_UNITS, key=lambda unit: unit.build_index)


def _updates_tree(optimizer: torch.optim.Optimizer, context: RootContext) -> bool:
    # By identity (tensors compare by value): the tree holds its parameters.
    params = context.param_ids
    return any(id(param) in params for group in optimizer.param_groups for param in group["params"])
