"""Owns: what the per-unit runtime controls (``controls/per_unit.py``)
change in a step — whether a unit keeps its parameters gathered after
forward or after backward, the check of a unit's controls at its forward
and backward, the reductions a backward that is not the last leaves in
flight, dropping gathered buffers a unit kept between steps once they
may go stale, and the full parameters an explicit ``unshard`` shows.

Knows nothing of: the hooks and the lifecycle (they call it), argument
checks (controls/per_unit.py), streams (the scheduler), flattening details.

Public names: ``check_unit_controls``, ``keeps_after_forward``,
``keep_gathered_between_steps``, ``end_backward_leaving_reductions``,
``finish_reductions_left_in_flight``, ``settle_gathered_and_reductions``,
``needs_settling``, ``drop_gathered_written_back``,
``show_unsharded_between_steps``, ``end_explicit_unshard``,
``end_explicit_unshards``.

[Note: units kept gathered between steps]
A unit may hold its gathered buffer while no forward or backward of it
runs, outside the held-for-backward state: after a backward with
``set_reshard_after_backward(False)``, after a no-grad forward with
``set_reshard_after_forward(False)``, and after an explicit ``unshard``.
It is ``IDLE``, its owners show the shards (as held units do: outside a
step everyone sees shards, but for [Note: explicit unshard shows full
parameters]), and its next forward or backward finds it gathered, with no
all-gather. The buffer is a copy of the shards, so it is
kept only while they cannot change: the root's forward drops the buffers
of flat parameters the user wrote since (``drop_gathered_written_back``),
and every other entry through the lifecycle's gate (optimizer step, state
dicts, ``unshard_params``, ``clip_grad_norm_``) drops them all. An
in-place edit of a shard's values between steps is not seen: call
``reshard`` on such a unit first. Pinned by
tests/controls/test_explicit_unshard.py and tests/controls/test_controls.py
(all-gathers counted).

[Note: explicit unshard shows full parameters]
As FSDP2's ``unshard()``: once an explicit unshard made between steps is
waited for, the unit's modules show new parameters of the full shapes,
aliasing its gathered buffer (the compute dtype), until the unit reshards
— its next forward or backward (which use the buffer, gathering nothing),
``reshard``, or any entry through the gate (optimizer step, state dicts,
``unshard_params``, ``clip_grad_norm_``), which also frees the buffer. An
unshard issued inside a step (a prefetch from a hook) or while the tree is
held for a backward only gathers. The original parameters keep their
shards for the optimizer. What the user writes into the shown parameters
(in place, or ``.data`` of the same shape; the same on every rank) is
written into the shards when the show ends, as ``unshard_params`` does with
``writeback=True``; the buffer holds it already. ``.data`` of another shape
is dropped and raises (``ValueError``) once the unit is back to its shards.
Every way the show ends passes ``end_explicit_unshard``: the unit's own
forward (hooks.py), a backward of the tree starting (hooks.py), the root's
forward (``drop_gathered_written_back``), the gate
(``settle_gathered_and_reductions``, which ``needs_settling`` reports) and
``reshard`` (controls/per_unit.py). Pinned by
tests/controls/test_explicit_unshard.py.

[Note: a backward that is not the last]
With ``set_is_last_backward(False)`` the end of backward reshards and
returns the tree to idle but does not wait for the reductions still in
flight: they overlap the next forward, and finish when the next backward
starts, when a later reduction pushes them out, or at the next entry
through the gate (the optimizer step included), so no ``.grad`` is read
before it is complete. CPU offload needs the host's one wait per backward
for the gradient downloads, so the two do not combine. Pinned by
tests/training/test_controls.py ("not_last").
"""

from __future__ import annotations

import weakref

import torch.nn as nn

from ..handle import full_views
from ..handle import FlatParamHandle
from ..handle.writeback import find_user_edits
from .state import RootContext, TrainingState, UnitState
from .prefetch import backward_starts_with

__all__ = [
    "check_unit_controls",
    "keeps_after_forward",
    "keep_gathered_between_steps",
    "end_backward_leaving_reductions",
    "finish_reductions_left_in_flight",
    "settle_gathered_and_reductions",
    "needs_settling",
    "drop_gathered_written_back",
    "show_unsharded_between_steps",
    "end_explicit_unshard",
    "end_explicit_unshards",
]

# Trees whose last backward left reductions in flight ([Note: a backward
# that is not the last]). Weak: a deleted model drops its entry.
_REDUCTIONS_LEFT: weakref.WeakSet[RootContext] = weakref.WeakSet()
# Handles an explicit unshard shows, with the parameters shown ([Note:
# explicit unshard shows full parameters]). Weak: a deleted model drops its entry.
_SHOWN: weakref.WeakKeyDictionary[FlatParamHandle, tuple[nn.Parameter, ...]] = weakref.WeakKeyDictionary()


def check_unit_controls(state: UnitState, when: str) -> None:
    """At the unit's forward or backward (``when``): refuse the controls
    that cannot combine with its configuration or tree, naming the unit."""
    if state.config.offload_params:
        if not state.reshard_after_backward:
            raise RuntimeError(
                f"fully_shard({state.fqn}): set_reshard_after_backward(False) with CPU offload, seen at its "
                f"{when}. CPU offload keeps parameters off the device between uses; keeping them gathered "
                "after backward is not supported with it. Call set_reshard_after_backward(module, True) or shard without cpu_offload."
            )
        if not state.is_last_backward:
            raise RuntimeError(
                f"fully_shard({state.fqn}): set_is_last_backward(False) with CPU offload, seen at its {when}. "
                "The offloaded gradients reach host memory at the end of every backward. Call "
                "set_is_last_backward(module, True) or shard without cpu_offload."
            )
    for kind, listed in (("forward", state.forward_prefetch_units), ("backward", state.backward_prefetch_units)):
        for unit in listed or ():
            if unit.root_context is not state.root_context:  # None: a tree that never ran
                raise RuntimeError(
                    f"fully_shard({state.fqn}): its {kind} prefetch list names {type(unit.module).__name__} "
                    f"('{unit.fqn}'), a unit of another tree, seen at its {when}. List units under the same "
                    f"root: set_modules_to_{kind}_prefetch(module, [...])."
                )


def keeps_after_forward(state: UnitState, grad_enabled: bool) -> bool:
    """Whether the unit keeps its parameters gathered when its forward
    ends: the explicit ``set_reshard_after_forward`` value, else, with
    autograd on, the root, strategies that do not reshard after forward,
    and the unit backward starts with ([Note: the last unit stays
    gathered] in prefetch.py)."""
    if state.reshard_after_forward is not None:
        return not state.reshard_after_forward
    return grad_enabled and (
        state.is_root or not state.config.strategy.reshards_after_forward or backward_starts_with(state)
    )


def keep_gathered_between_steps(state: UnitState) -> None:
    """The unit stays gathered while idle: its owners show the shards
    ([Note: units kept gathered between steps])."""
    state.training_state = TrainingState.IDLE
    for handle in state.handles:
        handle.hide_unsharded_views()


def end_backward_leaving_reductions(context: RootContext) -> bool:
    """Whether this backward's end leaves its reductions in flight (the
    tree is told it is not the last); remembers the tree if so."""
    if all(unit.is_last_backward for unit in context.units):
        return False
    _REDUCTIONS_LEFT.add(context)
    return True


def finish_reductions_left_in_flight(context: RootContext) -> None:
    """Finish what a backward that was not the last left in flight (a
    no-op otherwise): its gradients reach ``.grad``."""
    if context in _REDUCTIONS_LEFT:
        _REDUCTIONS_LEFT.discard(context)
        context.scheduler.wait_for_reductions()


def _gathered_handles(unit: UnitState) -> list:
    scheduler = unit.context.scheduler
    return [
        handle
        for handle in unit.handles
        if (handle.is_unsharded and handle.needs_unshard_storage) or scheduler.has_pending_unshard(handle)
    ]


def needs_settling(context: RootContext) -> bool:
    """Whether ``settle_gathered_and_reductions`` has anything to do (cheap:
    the optimizer step asks every step)."""
    if context in _REDUCTIONS_LEFT:
        return True
    if _SHOWN and any(handle in _SHOWN for unit in context.units for handle in unit.handles):
        return True
    return any(unit.training_state is TrainingState.IDLE and _gathered_handles(unit) for unit in context.units)


def settle_gathered_and_reductions(context: RootContext) -> None:
    """Between steps, before anything reads or writes the shards or the
    gradients: finish reductions left in flight and free what idle units
    kept gathered ([Note: units kept gathered between steps]), ending what
    an explicit unshard shows first ([Note: explicit unshard shows full
    parameters])."""
    finish_reductions_left_in_flight(context)
    end_explicit_unshards(context)
    for unit in context.units:
        if unit.training_state is TrainingState.IDLE:
            for handle in _gathered_handles(unit):
                unit.reshard_handle(handle)


def drop_gathered_written_back(context: RootContext) -> None:
    """The root's forward starts: write the user's changes back into the
    shards, first dropping what a unit kept gathered of a flat parameter
    the user changed (its pending all-gather, which still reads the shard,
    is waited for by the reshard): [Note: units kept gathered between
    steps]; what an explicit unshard shows is taken in first ([Note:
    explicit unshard shows full parameters])."""
    end_explicit_unshards(context)
    scheduler = context.scheduler
    for unit in context.units:
        for handle in unit.handles:
            kept = (handle.is_unsharded and handle.needs_unshard_storage) or scheduler.has_pending_unshard(handle)
            if kept and not handle.shows_unsharded_views:
                edits, requires_grad = find_user_edits(handle, name_prefix=unit.name_prefix)
                if not edits and requires_grad == handle.param_requires_grad:
                    continue  # the kept buffer is the shards' copy
                unit.reshard_handle(handle)
            handle.writeback_orig_params(name_prefix=unit.name_prefix)


def show_unsharded_between_steps(unit: UnitState) -> None:
    """After an explicit unshard between steps: wait for its all-gathers and
    show the unit's full parameters ([Note: explicit unshard shows full
    parameters]); a show already there ends first (its edits taken in)."""
    end_explicit_unshard(unit)
    scheduler = unit.context.scheduler
    for handle in unit.handles:
        scheduler.wait_for_unshard(handle)
        if handle.is_unsharded:  # else dropped since (the gate came between)
            _SHOWN[handle] = full_views.show_unsharded_params(handle)


def end_explicit_unshard(unit: UnitState) -> None:
    """The unit's shown full parameters ([Note: explicit unshard shows full
    parameters]) go: their edits into the shards, the owners back to the
    original parameters; the gathered buffer stays (callers reshard it or
    use it). A no-op without a show."""
    if not _SHOWN:
        return
    dropped: list[str] = []
    for handle in unit.handles:
        shown = _SHOWN.pop(handle, None)
        if shown is None or not handle.is_unsharded:
            continue
        dropped += [f"{unit.name_prefix}{name}" for name in full_views.write_back_shown_edits(handle, shown)]
        handle.hide_unsharded_views()
    if dropped:
        raise ValueError(
            f"fully_shard({unit.fqn}): after unshard(), {dropped[:4]} got .data of another shape than the "
            "parameter's, which cannot be written into its shards; that change was dropped (the rest were "
            "kept). Edit the shown parameters in place, or assign tensors of their full shape."
        )


def end_explicit_unshards(context: RootContext) -> None:
    """``end_explicit_unshard`` for every unit of the tree."""
    if _SHOWN:
        for unit in context.units:
            end_explicit_unshard(unit)
