"""Owns: units that some ranks skip in a step (conditional compute: the
experts of a mixture-of-experts layer) — the opt-in mode
``set_may_be_skipped`` and what it changes in a step: gathering such units
where every rank passes, deferring their reductions to the end of backward,
agreeing there on which ran, and reducing them on every rank; and the tags
that make collectives of two different units fail instead of pairing.

Knows nothing of: streams (the scheduler issues), how a transport carries a
tag (comm/tags.py), flattening details.

Public names: ``set_may_be_skipped``, ``is_marked``, ``tag_collectives``,
``gather_anchored``, ``stays_gathered``, ``end_anchor_forward``,
``reduce_or_defer``, ``reduce_skippable``.

[Note: units that some ranks skip]
Ranks pair collectives by order, so a unit whose forward runs on one rank
and not on another shifts every later collective. Without the mode every
all-gather and gradient reduction carries its unit's tag ([Note: tagged
collectives] in comm/tags.py): the first one where ranks disagree raises on
each of them, naming both units, instead of hanging or mixing two units'
bytes. With the mode, a marked unit's collectives move to points every rank
reaches. Its *anchor* is its nearest enclosing unit that is not marked (at
worst the root, which runs on every rank by definition):

- the anchor's pre-forward and pre-backward issue the all-gathers of every
  unit anchored to it, in the tree's order, whether this rank will run them
  or not; a marked unit stays gathered until the anchor's forward ends
  (it may run twice), and is then resharded on every rank;
- a marked unit is never a prefetch target (it leaves the forward order);
- its post-backward keeps the unsharded gradient instead of reducing it
  (and reshards, unless ``set_reshard_after_backward(False)``: then every
  rank keeps every anchored unit, all gathered by the anchor's pre-backward);
- the end of backward agrees over each group on which marked flat
  parameters hold a gradient (one all-reduce of flags per step, after one
  that checks every rank trains the same elements of each), and every
  rank reduces every one that any rank holds, with zeros where this rank
  skipped the unit: the union of work, as one process on the global batch.

Memory: every unit anchored to a unit is gathered for the anchor's whole
forward and backward (not one at a time), and each one that ran keeps its
padded unsharded gradient until the end of backward. Measured in
docs/design/runtime.md; pinned by tests/controls/test_skipped_units.py.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from ..comm.process_group import max_over_groups
from ..comm import tags
from ..handle import FlatParamHandle
from .state import RootContext, TrainingState, UnitState, units_of
from .lifecycle import enter_between_steps, in_backward

__all__ = [
    "set_may_be_skipped",
    "is_marked",
    "tag_collectives",
    "gather_anchored",
    "stays_gathered",
    "end_anchor_forward",
    "reduce_or_defer",
    "reduce_skippable",
]

# Units marked with set_may_be_skipped (weak: a deleted model drops them).
_MARKED: weakref.WeakSet[UnitState] = weakref.WeakSet()
# Bumped by every set_may_be_skipped call: the anchors of a tree are
# recomputed when it changed.
_VERSION = [0]
# Per tree: (version, anchor of each marked unit, units anchored to each anchor).
_ANCHORS: weakref.WeakKeyDictionary[RootContext, tuple[int, dict[UnitState, UnitState], dict[UnitState, list[UnitState]]]] = (
    weakref.WeakKeyDictionary()
)


def set_may_be_skipped(module: nn.Module, may_be_skipped: bool = True, *, recurse: bool = True) -> None:
    """Mark the units at and under ``module`` (only ``module``'s own unit
    with ``recurse=False``) as units that some ranks may skip in a step:
    the experts of a mixture-of-experts layer, branches taken per sample.
    Gradients then equal one process's on the global batch, with zeros from
    the ranks that skipped a unit ([Note: units that some ranks skip]).
    Costs memory: each marked unit is gathered for the whole forward and
    backward of its nearest unmarked enclosing unit, and keeps its unsharded
    gradient until the end of backward. Without it, a unit that ranks run
    differently raises on every rank at its first collective, naming it.
    Call between steps; the root of a tree cannot be marked."""
    states = units_of(module, recurse=recurse, what="set_may_be_skipped")
    for state in states:
        if state.root_context is not None:
            enter_between_steps([state], "set_may_be_skipped")
            if may_be_skipped and state.is_root:
                raise ValueError(_root_refused(state))
    for state in states:
        if may_be_skipped:
            _MARKED.add(state)
        else:
            _MARKED.discard(state)
    _VERSION[0] += 1


def is_marked(unit: UnitState) -> bool:
    """Whether ``unit`` is marked with ``set_may_be_skipped``."""
    return unit in _MARKED


def _root_refused(root: UnitState) -> str:
    return (
        f"set_may_be_skipped: unit '{root.fqn}' ({type(root.module).__name__}) is the root of its tree, whose forward "
        "runs on every rank; mark the units under it that some ranks skip (each expert), not the root."
    )


# ------------------------------------------------------------------ tags
def tag_collectives(context: RootContext) -> None:
    """Lazy init: every flat parameter's collectives carry its unit's tag,
    its position in the tree (the same on every rank)."""
    for index, unit in enumerate(context.units):
        for number, handle in enumerate(unit.handles):
            name = f"unit '{unit.fqn}'" + (f" (flat parameter {number})" if len(unit.handles) > 1 else "")
            tags.register(handle, 1 + index * 16 + min(number, 15), name)


# --------------------------------------------------------------- anchors
def _anchors(context: RootContext) -> tuple[dict[UnitState, UnitState], dict[UnitState, list[UnitState]]]:
    known = _ANCHORS.get(context)
    if known is not None and known[0] == _VERSION[0]:
        return known[1], known[2]
    if context.root in _MARKED:
        raise ValueError(_root_refused(context.root))
    anchor_of: dict[UnitState, UnitState] = {}
    anchored: dict[UnitState, list[UnitState]] = {}
    for unit in context.units:  # pre-order: an enclosing unit comes first
        if unit not in _MARKED or unit.is_root:
            continue
        anchor = _parent(context, unit)
        while anchor in _MARKED and not anchor.is_root:
            anchor = _parent(context, anchor)
        anchor_of[unit] = anchor
        anchored.setdefault(anchor, []).append(unit)
    _ANCHORS[context] = (_VERSION[0], anchor_of, anchored)
    return anchor_of, anchored


def _parent(context: RootContext, unit: UnitState) -> UnitState:
    """The nearest unit enclosing ``unit`` (the root at worst)."""
    enclosing = [other for other in context.units if not other.is_root and unit.fqn.startswith(other.fqn + ".")]
    return max(enclosing, key=lambda other: len(other.fqn)) if enclosing else context.root


def _in_use(context: RootContext) -> bool:
    return len(_MARKED) > 0 and len(_anchors(context)[0]) > 0


# --------------------------------------------------------------- forward
def gather_anchored(unit: UnitState) -> None:
    """A unit's pre-forward or pre-backward, its own all-gather done: issue
    those of the units anchored to it, on every rank; a marked unit checks
    that it runs inside its anchor's forward (where it was gathered)."""
    if not _MARKED:
        return
    context = unit.context
    anchor_of, anchored = _anchors(context)
    anchor = anchor_of.get(unit)
    if anchor is not None and anchor.training_state is not TrainingState.FORWARD and not in_backward():
        raise RuntimeError(
            f"fully_shard({unit.fqn}): marked with set_may_be_skipped, it must run inside the forward of unit "
            f"'{anchor.fqn}', which gathers it on every rank; it ran outside it (its anchor is "
            f"{anchor.training_state.name}). Call it from that unit's forward, or unmark it."
        )
    for member in anchored.get(unit, ()):
        member.prefetch()


def stays_gathered(unit: UnitState) -> bool:
    """Whether a marked unit's post-forward keeps its parameters gathered
    (until its anchor's forward ends: it may run again in it)."""
    return len(_MARKED) > 0 and unit in _MARKED and unit in _anchors(unit.context)[0]


def end_anchor_forward(unit: UnitState) -> None:
    """An anchor's post-forward: the units anchored to it leave the forward
    order (never prefetch targets) and reshard on every rank, run or not."""
    if not _MARKED:
        return
    members = _anchors(unit.context)[1].get(unit, ())
    order = unit.context.forward_order
    for member in members:
        if member in order:
            order.remove(member)
        if member.training_state is TrainingState.HELD_FOR_BACKWARD:
            member.transition(TrainingState.IDLE, TrainingState.HELD_FOR_BACKWARD)
        member.reshard()


# -------------------------------------------------------------- backward
def reduce_or_defer(unit: UnitState, handle: FlatParamHandle) -> bool:
    """A flat parameter's gradient is accumulated: reduce it
    (``UnitState.reduce_grad``), or, for a marked unit outside ``no_sync``,
    keep it for the end of backward and reshard. Returns whether every
    trainable handle of the unit is done."""
    if unit.skip_grad_sync or not stays_gathered(unit):
        return unit.reduce_grad(handle)
    # set_reshard_after_backward(False) keeps it, as reduce_grad does: the
    # anchor's pre-backward gathered every anchored unit on every rank, so
    # each rank keeps all of them, run here or not, and the next forward
    # gathers none of them on any rank (tests/training/test_controls_compose.py).
    if not handle.has_frozen_params and unit.reshard_after_backward:
        unit.reshard_handle(handle)
    unit.reduced_handles.add(handle)
    return len(unit.reduced_handles) == len(unit.trainable_handles)


def reduce_skippable(context: RootContext) -> None:
    """End of backward: agree over each group on which marked flat
    parameters hold a gradient (one small all-reduce) and reduce each that
    any rank holds, zeros where this rank skipped its unit."""
    if not _MARKED or not _in_use(context):
        return
    # Under no_sync a unit's gradient stays local (runtime/pending_grads.py reduces it later).
    marked = [unit for unit in _anchors(context)[0] if not unit.skip_grad_sync]
    _refuse_trainability_that_differs(marked, context.root.compute_device)
    by_groups: dict[tuple, list[tuple[UnitState, FlatParamHandle]]] = {}
    for unit in marked:
        for handle in unit.handles:
            if handle.ever_required_grad:  # the same on every rank
                key = (handle.groups.shard_group, handle.groups.replicate_group)
                by_groups.setdefault(key, []).append((unit, handle))
    for (shard_group, replicate_group), members in by_groups.items():
        held = max_over_groups(
            [int(handle.has_unsharded_grad()) for _, handle in members],
            (shard_group, replicate_group),
            members[0][1].compute_device,
        )
        for (unit, handle), anyone_holds in zip(members, held):
            if not anyone_holds:
                continue  # no rank ran it: no gradient, as in one process
            if not handle.has_unsharded_grad():
                handle.unsharded_flat_param.grad = torch.zeros_like(handle.unsharded_flat_param)
            unit.reduce_grad(handle)


def _refuse_trainability_that_differs(marked: list[UnitState], device: torch.device) -> None:
    """The flags ``reduce_skippable`` agrees on are per flat parameter that
    ever required grad, taken to be the same on every rank: where a
    ``marked`` unit's trainable elements differ across ranks (frozen on
    some only) the ranks' flag lists would differ in length and the
    all-reduce hang until the group's timeout. Agree first (one all-reduce
    of two numbers per unit: the most and, negated, the fewest) and raise
    naming the unit on every rank."""
    by_groups: dict[tuple, list[tuple[UnitState, int]]] = {}
    for unit in marked:
        trainable = sum(h.layout.padded_unsharded_numel for h in unit.handles if h.ever_required_grad)
        by_groups.setdefault((unit.groups.shard_group, unit.groups.replicate_group), []).append((unit, trainable))
    for groups, members in by_groups.items():
        flags = [value for _, trainable in members for value in (trainable, -trainable)]
        agreed = max_over_groups(flags, groups, device)
        for index, (unit, _) in enumerate(members):
            most, fewest = agreed[2 * index], -agreed[2 * index + 1]
            if most != fewest:
                raise ValueError(
                    f"composable_shard: unit '{unit.fqn}' (marked with set_may_be_skipped) has {fewest} trainable "
                    f"elements on one rank and {most} on another: every rank must freeze the same parameters "
                    "(requires_grad_ the same on every rank) before training."
                )
