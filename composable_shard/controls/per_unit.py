"""Owns: the per-unit runtime controls — FSDP2's ``FSDPModule`` methods of
the same names as functions on a sharded module (we keep the user's classes,
so there is no class to add methods to): gradient sync, the last backward,
resharding after forward and after backward, explicit prefetch lists,
explicit ``unshard`` / ``reshard``. Each checks its arguments at once; what
a setting does in a step, and the check of settings that cannot combine
with a unit's configuration (at its next forward or backward), are
runtime/unit_controls.py's.

Knows nothing of: hooks, streams, flattening details.

Public names: ``set_requires_gradient_sync``, ``set_is_last_backward``,
``set_reshard_after_forward``, ``set_reshard_after_backward``,
``set_modules_to_forward_prefetch``, ``set_modules_to_backward_prefetch``,
``unshard``, ``reshard``, ``UnshardHandle``, ``set_units_gradient_sync``.

Where our flat layout makes a control differ from FSDP2's (docs/parallelism.md,
"Per-unit runtime controls"): a unit's flat parameters are gathered and
freed together, so every control acts on a whole unit; a buffer kept
gathered is dropped by the optimizer step and every other entry that may
change the shards, so it never goes stale. ``unshard`` shows the unit's
full parameters as FSDP2's does ([Note: explicit unshard shows full
parameters] in runtime/unit_controls.py).
"""

from __future__ import annotations

from typing import Sequence

import torch.nn as nn

from ..runtime import TreePhase, lazy_init, mark_local_accumulation, tree_phase
from ..runtime.state import TrainingState, UnitState, get_state, units_of
from ..runtime.unit_controls import end_explicit_unshard, show_unsharded_between_steps

__all__ = [
    "set_requires_gradient_sync",
    "set_is_last_backward",
    "set_reshard_after_forward",
    "set_reshard_after_backward",
    "set_modules_to_forward_prefetch",
    "set_modules_to_backward_prefetch",
    "unshard",
    "reshard",
    "UnshardHandle",
    "set_units_gradient_sync",
]


# ------------------------------------------------------------------ checks
def _unit_of(module: nn.Module, what: str) -> UnitState:
    state = get_state(module) if isinstance(module, nn.Module) else None
    if state is None:
        raise ValueError(
            f"{what}({type(module).__name__}): this module is not a unit. Call fully_shard on it (or choose it "
            "with a policy) first, or pass the module fully_shard was given."
        )
    return state


def _units(module: nn.Module, recurse: bool, what: str) -> list[UnitState]:
    """``module``'s unit, or with ``recurse`` every unit under it."""
    if not isinstance(recurse, bool):
        raise TypeError(f"{what}({type(module).__name__}): recurse must be a bool, got {type(recurse).__name__}.")
    if not recurse:
        return [_unit_of(module, what)]
    return units_of(module, recurse=True, what=what)


def _check_bool(module: nn.Module, what: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(
            f"{what}({type(module).__name__}, ...): {name} must be a bool (True or False), got "
            f"{type(value).__name__} {value!r}."
        )


# ------------------------------------------------------------ setters
def set_requires_gradient_sync(module: nn.Module, requires: bool, *, recurse: bool = True) -> None:
    """Whether the unit's backwards reduce gradients (every unit under
    ``module`` with ``recurse``). With ``False``, each flat parameter keeps
    its padded unsharded gradient and accumulates into it, with no
    communication (FSDP1's ``no_sync``, per unit; the memory cost is
    ``no_sync``'s); the first backward with ``True`` reduces the sum, also
    for a unit that does not run in it. Under HYBRID_SHARD it switches the
    reduce-scatter and the replica all-reduce together. Same on every rank.
    """
    _check_bool(module, "set_requires_gradient_sync", "requires", requires)
    set_units_gradient_sync(_units(module, recurse, "set_requires_gradient_sync"), requires)


def set_units_gradient_sync(units: list[UnitState], requires: bool) -> None:
    """``set_requires_gradient_sync`` on units already checked (``no_sync``
    restores each unit's own setting through it)."""
    for unit in units:
        resumes = unit.skip_grad_sync and requires
        unit.skip_grad_sync = not requires
        if resumes:
            # The next synchronised backward reduces the gradients of units
            # absent from it: [Note: no_sync gradients of units that did not
            # run] (runtime/pending_grads.py).
            mark_local_accumulation([unit])


def set_is_last_backward(module: nn.Module, is_last: bool) -> None:
    """Whether the tree's next backward is the last before the optimizer
    step (default ``True``). With ``False`` its end does not wait for the
    gradient reductions still in flight: they overlap what comes next and
    finish when the next backward starts or at the next optimizer step,
    state dict, ``unshard_params`` or ``clip_grad_norm_``, whichever is
    first ([Note: a backward that is not the last] in
    runtime/unit_controls.py). Applies to the whole tree ``module`` is in
    (before the first forward: to the units under ``module``), as FSDP2's
    applies to the root's. Not with CPU offload (refused at the next
    forward or backward)."""
    _check_bool(module, "set_is_last_backward", "is_last", is_last)
    units = _units(module, True, "set_is_last_backward")
    context = units[0].root_context
    for unit in context.units if context is not None else units:
        unit.is_last_backward = is_last


def set_reshard_after_forward(module: nn.Module, reshard: bool, *, recurse: bool = True) -> None:
    """Whether the unit frees its gathered parameters when its forward
    ends, replacing what its strategy decides (the root and the unit
    backward starts with otherwise stay gathered). ``False`` keeps them
    for the backward, and after a forward without autograd (evaluation)
    until the next forward, so that one gathers nothing; the optimizer
    step, state dicts, ``unshard_params`` and ``clip_grad_norm_`` free
    them. Takes effect at the unit's next forward."""
    _check_bool(module, "set_reshard_after_forward", "reshard", reshard)
    for unit in _units(module, recurse, "set_reshard_after_forward"):
        unit.reshard_after_forward = reshard


def set_reshard_after_backward(module: nn.Module, reshard: bool, *, recurse: bool = True) -> None:
    """Whether the unit frees its gathered parameters after its backward
    (default ``True``). ``False`` keeps them until its next forward and
    backward, which then gather nothing: for gradient accumulation over
    micro-batches, at the memory of the unit's unsharded parameters.
    Set it back to ``True`` before the last micro-batch's backward (the
    optimizer step, state dicts, ``unshard_params`` and ``clip_grad_norm_``
    also free what is kept). Not with CPU offload (refused at the next
    forward or backward)."""
    _check_bool(module, "set_reshard_after_backward", "reshard", reshard)
    for unit in _units(module, recurse, "set_reshard_after_backward"):
        unit.reshard_after_backward = reshard


def _prefetch_list(module: nn.Module, modules: Sequence[nn.Module], what: str) -> tuple[UnitState, list[UnitState]]:
    state = _unit_of(module, what)
    if isinstance(modules, nn.Module) or not isinstance(modules, (list, tuple)):
        raise TypeError(
            f"{what}({type(module).__name__}, ...): modules must be a list of units, got {type(modules).__name__}."
        )
    listed = []
    for index, other in enumerate(modules):
        unit = get_state(other) if isinstance(other, nn.Module) else None
        if unit is None:
            raise ValueError(
                f"{what}({type(module).__name__}, ...): modules[{index}] ({type(other).__name__}) is not a unit. "
                "List modules that fully_shard was given (or that its policy chose)."
            )
        if unit.root_context is not None and state.root_context is not None and unit.root_context is not state.root_context:
            raise ValueError(
                f"{what}({type(module).__name__}, ...): modules[{index}] ({type(other).__name__}, '{unit.fqn}') "
                f"belongs to another tree than '{state.fqn}'. List units under the same root."
            )
        listed.append(unit)
    return state, listed


def set_modules_to_forward_prefetch(module: nn.Module, modules: Sequence[nn.Module]) -> None:
    """When the unit's forward starts (after its own all-gather), issue the
    all-gathers of ``modules`` (units of the same tree), in that order,
    instead of the ``forward_prefetch`` option's one. Two or more overlap
    more and hold more gathered parameters at once (``limit_all_gathers``
    still bounds those in flight). Units of another tree are refused at
    once where both ran a forward, else at the unit's next forward."""
    state, listed = _prefetch_list(module, modules, "set_modules_to_forward_prefetch")
    state.forward_prefetch_units = listed


def set_modules_to_backward_prefetch(module: nn.Module, modules: Sequence[nn.Module]) -> None:
    """When the unit's backward starts (after its own all-gather), issue
    the all-gathers of ``modules``, in that order, instead of the
    ``backward_prefetch`` option's one (FSDP2 issues them at the same
    point). Checked as ``set_modules_to_forward_prefetch``."""
    state, listed = _prefetch_list(module, modules, "set_modules_to_backward_prefetch")
    state.backward_prefetch_units = listed


# --------------------------------------------------------- unshard / reshard
class UnshardHandle:
    """An explicit unshard in flight; ``wait()`` makes compute wait for it
    and, between steps, shows the unit's full parameters (as after a
    synchronous ``unshard``). The unit's forward also waits, so calling it
    is optional when nothing reads the parameters before."""

    def __init__(self, state: UnitState) -> None:
        self._state = state

    def wait(self) -> None:
        state = self._state
        if state.root_context is None:
            return
        context = state.context
        idle = tree_phase(context.units, backward_queued=context.post_backward_callback_queued) is TreePhase.IDLE
        if idle:  # [Note: explicit unshard shows full parameters]
            show_unsharded_between_steps(state)
            return
        for handle in state.handles:
            context.scheduler.wait_for_unshard(handle)


def unshard(module: nn.Module, *, async_op: bool = False) -> UnshardHandle | None:
    """Gather the unit's parameters now (not recursive), in the compute
    dtype of its mixed-precision policy; its next forward or backward finds
    them gathered. ``async_op=True`` returns an ``UnshardHandle`` at once;
    else waits and returns None.

    As in FSDP2, once it is waited for (here, or ``handle.wait()``) between
    steps, the unit's modules show parameters of their full shapes and
    values (in the compute dtype), usable in place of ``unshard_params``
    for reading, until the unit reshards: its next forward or backward (as
    configured), ``reshard``, or the optimizer step, state dicts,
    ``unshard_params`` and ``clip_grad_norm_`` (the shards may change
    there), which also free the gathered buffer. They are new parameter
    objects (the optimizer keeps the sharded originals). Edits to them, in
    place or by assigning ``.data`` of the full shape, the same on every
    rank, are written into the shards when the unit reshards (as
    ``unshard_params(writeback=True)``); ``.data`` of another shape is
    refused then with a ``ValueError``. Called inside a step or while the
    tree is held for a backward it only gathers. Collective over the unit's
    shard group. See [Note: explicit unshard shows full parameters] in
    runtime/unit_controls.py."""
    state = _unit_of(module, "unshard")
    _check_bool(module, "unshard", "async_op", async_op)
    if state.root_context is None:
        lazy_init(state)  # the root's lazy init takes the unit over later
    handle = UnshardHandle(state)
    if state.training_state not in (TrainingState.FORWARD, TrainingState.PRE_BACKWARD):
        state.context.scheduler.mark_shards_written()  # [Note: what a lane waits for] in runtime/scheduler.py
        state.prefetch()
    if async_op:
        return handle
    handle.wait()
    return None


def reshard(module: nn.Module) -> None:
    """Free the unit's gathered parameters now (not recursive), showing its
    shards again: what ``unshard``, ``set_reshard_after_forward(False)`` or
    ``set_reshard_after_backward(False)`` kept. A unit kept for its
    backward gathers again when the backward comes. Refused inside the
    unit's own forward or backward."""
    state = _unit_of(module, "reshard")
    if state.root_context is None:
        return
    if state.training_state in (TrainingState.FORWARD, TrainingState.PRE_BACKWARD):
        raise RuntimeError(
            f"reshard({type(module).__name__}): unit '{state.fqn}' is inside its "
            f"{'forward' if state.training_state is TrainingState.FORWARD else 'backward'}, which needs its "
            "parameters. Call reshard after it, e.g. between micro-batches."
        )
    try:
        end_explicit_unshard(state)  # edits to what unshard showed go into the shards
    finally:
        state.reshard()
    if state.training_state is TrainingState.HELD_FOR_BACKWARD:
        state.transition(TrainingState.IDLE, TrainingState.HELD_FOR_BACKWARD)
