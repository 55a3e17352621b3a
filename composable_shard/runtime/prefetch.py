"""Owns: the prefetch policy — which unit's all-gather a unit issues ahead
of its need in forward and in backward, and where in backward — and which
unit stays gathered after forward because backward starts with it.

Knows nothing of: streams (the scheduler issues), flattening details.

Public names: ``prefetch_in_forward``, ``prefetch_in_backward``,
``backward_prefetch_point``, ``backward_starts_with``, ``followers``.
"""

from __future__ import annotations

from typing import Iterator

import torch

from ..api import BackwardPrefetch
from ..handle import FlatParamHandle
from .state import UnitState

__all__ = ["prefetch_in_forward", "prefetch_in_backward", "backward_prefetch_point", "backward_starts_with", "followers"]


def prefetch_in_forward(state: UnitState) -> None:
    """Issue the all-gathers of the units ``set_modules_to_forward_prefetch``
    listed for ``state``, in their order; without a list, with
    ``forward_prefetch``, the one of the unit that ran after ``state`` in
    the previous forward."""
    if state.forward_prefetch_units is not None:
        for listed in state.forward_prefetch_units:
            listed.prefetch()
    elif state.config.forward_prefetch:
        context = state.context
        following = context.next_in(context.previous_forward_order, state, +1)
        if following is not None:
            following.prefetch(followers(following, forward=True))


def prefetch_in_backward(state: UnitState, point: BackwardPrefetch) -> None:
    """At ``point`` of ``state``'s backward, issue the all-gather of the
    unit backward reaches next, if the policy prefetches there; a list from
    ``set_modules_to_backward_prefetch`` replaces the policy: its units'
    all-gathers are issued in its order at the pre-backward."""
    if state.backward_prefetch_units is not None:
        if point is BackwardPrefetch.BACKWARD_PRE:
            for listed in state.backward_prefetch_units:
                listed.prefetch()
    elif backward_prefetch_point(state) is point:
        context = state.context
        following = context.next_in(context.forward_order, state, -1)
        if following is not None:
            following.prefetch(followers(following, forward=False))


def followers(state: UnitState, *, forward: bool) -> Iterator[list[FlatParamHandle]] | None:
    """The flat parameters of the units after ``state`` in the phase's order
    (forward: the previous forward's, the tree's module pre-order at the
    first; backward: this forward's, reversed),
    unit by unit, lazily: the all-gathers that may join ``state``'s
    ([Note: coalesced all-gathers] in runtime/gather_buckets.py). None
    where nothing is coalesced: under ``torch.compile``, where the user
    ordered the all-gathers, or where the tree's bucket is 0."""
    if torch.compiler.is_compiling():
        # Traced hooks gather unit by unit: dynamo would guard on the tree's
        # orders and handles, which change between steps (it failed building
        # such a guard after other tests in one process: tests/training/test_compile.py).
        return None
    context = state.context
    if context.user_orders_all_gathers or context.scheduler.gather_bucket_bytes <= 0:
        return None
    if not forward:
        order = context.forward_order
    elif context.previous_forward_order:
        order = context.previous_forward_order
    else:  # the first forward
        order = context.first_forward_order
    return _handles_after(order, state, +1 if forward else -1)


def _handles_after(order: list[UnitState], state: UnitState, step: int) -> Iterator[list[FlatParamHandle]]:
    """Each unit's flat parameters after ``state`` in ``order`` (``step``:
    its direction), found only once the first is asked for: most units'
    all-gathers take no follower (too large), and every unit's hooks make
    one of these per pass."""
    try:
        index = order.index(state)
    except ValueError:
        return
    for position in range(index + step, len(order) if step > 0 else -1, step):
        yield order[position].handles


def backward_prefetch_point(state: UnitState) -> BackwardPrefetch | None:
    """Where in backward the unit issues the next unit's all-gather: at its
    pre-backward (``BACKWARD_PRE``), after its reduction was issued and it
    resharded (``BACKWARD_POST``), or not at all.

    [Note: backward prefetch on CPU]
    Where compute shares host memory with the collectives (the CPU lane),
    ``BACKWARD_PRE`` prefetches at the ``BACKWARD_POST`` point, and a unit's
    pre-backward finishes the reduction in flight that still holds its padded
    gradient (``Scheduler.unit_backward_starts``). Prefetching at the
    pre-backward would keep the next unit's buffer, and gloo's copy of it,
    alive through this unit's gradient computation, the backward's peak,
    beside the previous unit's reduction; after the reduction they come past
    the peak. The measurements behind it are in docs/design/runtime.md;
    tests/runtime/test_order.py pins the order and tests/peer/test_memory.py
    the peak against FSDP1.
    """
    prefetch = state.config.backward_prefetch
    if prefetch is BackwardPrefetch.BACKWARD_PRE and state.context.scheduler.prefetches_backward_after_reduction:
        return BackwardPrefetch.BACKWARD_POST
    return prefetch


def backward_starts_with(state: UnitState) -> bool:
    """Whether ``state`` ran last in the previous forward (not the root).

    [Note: the last unit stays gathered]
    Backward starts with the unit that ran last in forward: resharding it
    after its forward only to gather it again at once costs an all-gather
    nothing can overlap. So from the second step on that unit keeps its
    parameters gathered, as the root does, for one unit's memory during the
    head and loss (below the peak at the start of backward); like the
    root's, they are held for a backward that may not come ([Note: held for
    backward] in lifecycle.py). Pinned by tests/runtime/test_order.py.
    """
    order = state.context.previous_forward_order
    return len(order) > 0 and order[-1] is state and not state.is_root
