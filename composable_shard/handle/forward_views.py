"""Owns: the views of a flat parameter's unsharded buffer that its owners show
during forward and backward — how they are cut (one split), where they are
registered, and keeping a forward's views for the pre-backward that follows
(see [Note: forward views reused in backward]).

Knows nothing of: allocating or filling the buffer, collectives, hooks,
training state (the handle passes the buffer; the runtime says when views
may be reused).

Public names: ``ViewPlan``, ``view_plan_of``, ``ShownViews``,
``show_new_views``, ``storage_key``, ``take_back_owners``, ``SHOWN_MARK``.

[Note: a parameter replaced during a step]
Between steps, a parameter object the user replaced on its module is
refused by the next write-back (handle/writeback.py). Inside a step (a
forward and its backward) the owners hold views, or the original
parameters again between a unit's forward and its backward, and every
showing and every reshard registered ours over whatever was there: a
``module.weight = nn.Parameter(...)`` between a forward and its backward
was silently thrown away, and the next steps trained the old values
(FSDP1 raises there). So each showing and each return of the originals
first checks that every owner holds what was registered (its original
parameter, the views last shown, or an explicit ``unshard()``'s shown
parameter, marked ``SHOWN_MARK``); otherwise every owner gets its original
back and it raises naming the parameter. Pinned by
tests/runtime/test_param_changes.py
(test_a_parameter_replaced_between_forward_and_backward_is_refused).

[Note: forward views reused in backward]
A unit's forward cuts its views from the unsharded buffer anew (a fresh
autograd split, so its backward runs as soon as its gradients are ready:
``FlatParamHandle.use_unsharded_views``). Its pre-backward shows views
again, and those can be the forward's own: they alias the buffer's storage
object, which resharding frees and unsharding refills in place (the same
object: ``resize_``, never a new one), and the forward's split is the one
the step's autograd graph already goes through, so the same values reach
the same nodes. They are reused only while nothing they depend on changed:
the layout (a dtype change replaces it, and the buffer), which parameters
require grad (frozen ones are detached views), and the buffer's storage
object itself; the views are kept alive by the record, so a storage object
compared by address cannot have been freed and replaced. Views built under
inference mode, or while dynamo traces, are not kept. Every other showing — a forward, an
activation-checkpoint re-run, whose re-run graph is backpropagated — cuts
them anew. Pinned by tests/handle/test_flat_param.py
(test_backward_reuses_the_forward_views_only_while_they_are_the_same).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn as nn

from . import dtensor_views
from .dtensor_views import TensorParallelSpec
from .grad_usage import GradUsage
from .layout import FlatParamLayout

__all__ = ["ViewPlan", "view_plan_of", "ShownViews", "show_new_views", "storage_key", "take_back_owners", "SHOWN_MARK"]

# The attribute marking a parameter an explicit ``unshard()`` registered
# (handle/full_views.py): ours, not a user's replacement.
SHOWN_MARK = "_composable_shard_shown"

# One registration: (the owner module's ``_parameters``, attribute, what it holds).
Registration = tuple[dict, str, torch.Tensor]


class ViewPlan(NamedTuple):
    """The layout as the views read it: built once per layout object (a
    dtype change replaces the layout), read several times per unit per step."""

    layout: FlatParamLayout
    split_sizes: list[int]
    # Per parameter: (segment index, shape to view it as or None: its 1-D
    # segment as it is, its owners' (``_parameters``, attribute) pairs).
    params: tuple[tuple[int, tuple[int, ...] | None, tuple[tuple[dict, str], ...]], ...]
    # Every registration of the original parameters on their owners, in
    # layout order (what a reshard puts back).
    orig_registrations: tuple[Registration, ...]


def view_plan_of(layout: FlatParamLayout, orig_params: Sequence[nn.Parameter]) -> ViewPlan:
    """``layout`` read for the views of ``orig_params`` (in layout order)."""
    params = tuple(
        (
            index,
            None if tuple(info.shape) == (info.numel,) else tuple(info.shape),
            tuple((owner.module._parameters, owner.attr) for owner in info.owners),
        )
        for info, index in zip(layout.params, layout.param_segments)
    )
    orig_registrations = tuple(
        (parameters, attr, param) for (_, _, owners), param in zip(params, orig_params) for parameters, attr in owners
    )
    return ViewPlan(layout, list(layout.split_sizes), params, orig_registrations)


class ShownViews(NamedTuple):
    """Views a forward showed, with what they were cut under (see [Note:
    forward views reused in backward])."""

    plan: ViewPlan
    requires_grad: tuple[bool, ...]
    # ``storage_key`` of the buffer they alias (held alive by the views).
    storage: int
    registrations: tuple[Registration, ...]

    def still_valid(self, plan: ViewPlan, requires_grad: tuple[bool, ...], flat: torch.Tensor) -> bool:
        return self.plan is plan and self.requires_grad == requires_grad and self.storage == storage_key(flat)

    def show(self) -> None:
        for parameters, attr, view in self.registrations:
            parameters[attr] = view


def storage_key(flat: torch.Tensor) -> int:
    """The identity of ``flat``'s storage object (the same across resizes)."""
    return flat.untyped_storage()._cdata


def show_new_views(
    plan: ViewPlan,
    flat: torch.Tensor,
    requires_grad: tuple[bool, ...],
    tp_specs: tuple[TensorParallelSpec | None, ...],
    usage: GradUsage | None = None,
) -> tuple[Registration, ...]:
    """Cut each parameter's autograd view of ``flat`` (the unsharded flat
    parameter), register it on the parameter's owners and return the
    registrations; frozen parameters' views are detached, ``DTensor`` ones
    wrapped with their spec; ``usage`` records which a backward reaches
    ([Note: parameters a backward leaves without a gradient])."""
    # What torch.split does with a list of sizes, without its Python layer.
    segments = flat.split_with_sizes(plan.split_sizes)
    if usage is not None:
        usage.watch(segments, plan.layout.param_segments)
    registrations: list[Registration] = []
    for (index, shape, owners), param_requires_grad, spec in zip(plan.params, requires_grad, tp_specs):
        view = segments[index]
        if shape is not None:  # 1-D parameters use their segment as it is
            view = view.view(shape)
        if not param_requires_grad and view.requires_grad:
            view = view.detach()  # frozen: see [Note: changes to original parameters] in handle/writeback.py
        if spec is not None:
            view = dtensor_views.forward_view(view, spec)
        for parameters, attr in owners:
            # A forward view, not a Parameter: autograd must reach the flat parameter through it.
            parameters[attr] = view
            registrations.append((parameters, attr, view))
    return tuple(registrations)


def take_back_owners(plan: ViewPlan, shown: tuple[Registration, ...] | None, *, give_back: bool) -> None:
    """Raise if an owner holds something else than its original parameter
    or what ``shown`` registered there (the last views shown, aligned with
    ``plan.orig_registrations``), after registering every original back;
    with ``give_back``, register them back anyway ([Note: a parameter
    replaced during a step])."""
    registrations = plan.orig_registrations
    # One plain loop (it runs at every showing and reshard): dynamo traces
    # it in a compiled root's hooks, and a comprehension binding a name
    # breaks its graph ("uninitialized cell").
    replaced = []
    for index, (parameters, attr, param) in enumerate(registrations):
        current = parameters.get(attr)
        if current is not param and not (shown and current is shown[index][2]) and not getattr(current, SHOWN_MARK, False):
            replaced.append(index)
        if give_back:
            parameters[attr] = param
    if replaced:
        if not give_back:
            for parameters, attr, param in registrations:
                parameters[attr] = param
        names = [owner.fqn for info in plan.layout.params for owner in info.owners]
        raise RuntimeError(
            f"fully_shard: parameter {[names[index] for index in replaced][:4]} was replaced by another object "
            "during a step (between a unit's forward and its backward); the original was registered back and "
            "the new object dropped. Change a parameter between steps, by assigning its .data or copy_() "
            "into it."
        )
