"""Owns: the gradients ``no_sync`` left on flat parameters: reducing those
whose unit did not run in the next synchronised backward at that
backward's end, as if their unit had run in it; showing them in ``.grad``
while they wait, at the end of each backward under ``no_sync``.

Knows nothing of: streams (the unit's ``reduce_grad`` issues through the
scheduler), the hooks that call it, what ``no_sync`` is for.

Public names: ``mark_local_accumulation``, ``reduce_left_behind``,
``show_waiting_grads``.

[Note: no_sync gradients of units that did not run]
Under ``no_sync`` each flat parameter keeps its unsharded gradient until
the post-backward of a synchronised backward reduces it. A unit that ran
only in an early micro-batch (a branch taken once, an expert with no
tokens later) has no post-backward in the synchronised one, so its
gradient was never reduced and leaked into a later step. At the end of
every synchronised backward after a ``no_sync`` exit, every flat parameter
still holding an unsharded gradient is reduced. Which ones must agree over
each reduction's groups (a rank may hold none where a peer holds one):
one small all-reduce of flags per group pair, only after ``no_sync`` was
used; a rank without a gradient takes part with zeros. A flat parameter no
rank holds a gradient for gets none (an optimizer skips it, as it would in
one process). Pinned by tests/training/test_no_sync_conditional.py.
"""

from __future__ import annotations

import weakref

import torch

from ..comm.process_group import max_over_groups
from ..handle import FlatParamHandle, pending_views
from .state import RootContext, UnitState

__all__ = ["mark_local_accumulation", "reduce_left_behind", "show_waiting_grads"]

# Trees some of whose units left ``no_sync`` since their last synchronised
# backward (marked the same on every rank: no_sync is called on every rank).
_ACCUMULATED: weakref.WeakSet[RootContext] = weakref.WeakSet()


def mark_local_accumulation(units: list[UnitState]) -> None:
    """``no_sync`` over ``units`` ends: the next synchronised backward of
    their trees looks for gradients left behind."""
    for unit in units:
        if unit.root_context is not None:
            _ACCUMULATED.add(unit.root_context)


def reduce_left_behind(context: RootContext) -> None:
    """End of a backward: issue the reduction of every gradient ``no_sync``
    left on a flat parameter of a synchronised unit (see the module note).
    Collective over the units' groups after a ``no_sync``; else nothing."""
    if context not in _ACCUMULATED:
        return
    synchronised = [unit for unit in context.units if not unit.skip_grad_sync]
    if len(synchronised) == len(context.units):
        _ACCUMULATED.discard(context)
    by_groups: dict[tuple, list[tuple[UnitState, FlatParamHandle]]] = {}
    for unit in synchronised:
        for handle in unit.handles:
            if handle.ever_required_grad:  # the same on every rank
                key = (handle.groups.shard_group, handle.groups.replicate_group)
                by_groups.setdefault(key, []).append((unit, handle))
    for (shard_group, replicate_group), members in by_groups.items():
        # Over the shard group, then the replicate group: every rank of
        # both (hybrid: the whole product) learns of any gradient.
        held = max_over_groups(
            [int(handle.has_unsharded_grad()) for _, handle in members],
            (shard_group, replicate_group),
            members[0][1].compute_device,
        )
        for (unit, handle), anyone_holds in zip(members, held):
            if not anyone_holds:
                continue
            if not handle.has_unsharded_grad():
                handle.unsharded_flat_param.grad = torch.zeros_like(handle.unsharded_flat_param)
            unit.reduce_grad(handle)


def show_waiting_grads(context: RootContext) -> None:
    """End of a backward: the ``.grad`` of the parameters of every unit
    under ``no_sync`` show its waiting gradient ([Note: zero_grad while
    no_sync gradients wait] in handle/pending_views.py)."""
    for unit in context.units:
        if unit.skip_grad_sync:
            for handle in unit.handles:
                pending_views.show_waiting_grad(handle)
