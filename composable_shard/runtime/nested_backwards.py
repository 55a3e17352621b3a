"""Owns: the reductions of a unit whose gradients arrive in backwards nested
inside the one that reached it (``torch.utils.checkpoint`` with
``use_reentrant=True`` on parts of its forward): held until the outer
backward ends.

Knows nothing of: how a reduction runs (``UnitState.reduce_grad`` via the
caller's ``reduce``), process groups, checkpoints' internals.

Public names: ``note_backward_task``, ``defer_nested_reduction``,
``reduce_nested_deferred``.

[Note: reentrant checkpoints inside a unit]
A reentrant checkpoint recomputes its region and runs that region's
backward as a backward of its own, nested in the one running: the unit's
flat parameter accumulates (and its post-accumulate-grad hook fires) once
per region, each time in another graph task than the one whose
pre-backward gathered the unit. Reduced and resharded at the first, the
unit left the next region to recompute on its 1-D shards (torch's "mat2
must be a matrix"; FSDP1 crashes the same way, FSDP2 hangs). Which region
is the last is not known, so from the first such accumulation on, the
unit's handles stay gathered and their gradients accumulate, and they are
reduced as the outer backward ends (every rank defers the same ones: the
same program nests the same backwards), in the units' and handles' order.
The cost: that unit's parameters and gradient stay unsharded until then. A
region around whole units (``checkpoint(block)``) runs their pre-backward
in its own backward and is not deferred. Pinned by
tests/training/test_composition.py
(test_every_activation_checkpointing_form_matches_reference).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..handle import FlatParamHandle
from .state import RootContext, TrainingState, UnitState

__all__ = ["note_backward_task", "defer_nested_reduction", "reduce_nested_deferred"]


def note_backward_task(unit: UnitState) -> None:
    """At ``unit``'s pre-backward: the backward (graph task) that gathered it."""
    unit.backward_task = torch._C._current_graph_task_id()


def defer_nested_reduction(unit: UnitState, handle: FlatParamHandle) -> bool:
    """At a post-accumulate-grad hook: whether ``handle``'s reduction waits
    for the end of the outer backward (it accumulated in a nested one, or
    an earlier handle of the unit did); then it is held."""
    if unit.training_state is not TrainingState.PRE_BACKWARD:
        return False
    if not unit.nested_deferred and torch._C._current_graph_task_id() == unit.backward_task:
        return False
    if handle not in unit.nested_deferred:
        unit.nested_deferred.append(handle)
    return True


def reduce_nested_deferred(context: RootContext, finish: Callable[[UnitState, FlatParamHandle], None]) -> None:
    """End of the outer backward: ``finish`` (the post-backward's
    reduction) every held handle, in the units' and handles' order."""
    for unit in context.units:
        if not unit.nested_deferred:
            continue
        held, unit.nested_deferred = unit.nested_deferred, []
        for handle in unit.handles:
            if handle in held:
                finish(unit, handle)
