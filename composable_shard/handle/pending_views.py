"""Owns: a ``no_sync`` gradient waiting for its reduction as the parameters'
``.grad`` show it, and what the user did to those ``.grad`` since: cleared
or replaced (its part of the waiting gradient is discarded), changed in
place (refused).

Knows nothing of: when a gradient waits or is reduced (the runtime calls
``show_waiting_grad`` after a ``no_sync`` backward and ``take_user_changes``
before the next accumulation), hooks, streams.

Public names: ``show_waiting_grad``, ``take_user_changes``, ``forget_shown``.

[Note: zero_grad while no_sync gradients wait]
Under ``no_sync`` the unsharded gradient accumulates on the flat parameter
until a synchronised backward reduces it. In one process or under DDP,
``zero_grad()`` between such backwards (a micro-batch whose loss came out
NaN, discarded) discards what they accumulated; it can do so only through
``.grad``, the one thing it touches. So once a ``no_sync`` backward ends,
every trainable parameter whose ``.grad`` is None shows this rank's part of
its waiting local gradient (a view, in the gradient's dtype; a stand-in of
zeros where the gradient lies on another device: CPU offload), and a
``.grad`` the user kept from an earlier step stays. Before the next
gradient accumulates into the flat parameter (the unit's pre-backward) or
it is reduced, each parameter's ``.grad`` is compared with what it showed:

- None, or another tensor (``zero_grad()``, an assignment): the
  parameter's whole segment of the waiting gradient is zeroed, as DDP's
  ``.grad``, which holds the whole local gradient, would be; a tensor the
  user assigned is then added at the reduction, as any ``.grad`` left
  there is;
- the same tensor zeroed in place (``zero_grad(set_to_none=False)``): the
  same; changed in place otherwise (``clip_grad_norm_``, ``mul_``): raises,
  since a rank's ``.grad`` holds only its part of the local gradient and the
  change cannot be made to the rest. Each shown ``.grad`` is given a version
  counter of its own (views of one buffer share theirs), so a change is
  seen on the parameter it was made to; whether it is all zero is agreed
  over the ranks (one small all-reduce, only after such a change: a rank's
  part alone may be empty or zero), so they all raise or none does;
- unchanged: the views are dropped (so that autograd accumulates in place)
  and shown again at the end of that backward if it leaves the gradient
  waiting.

Pinned by tests/controls/test_no_sync.py.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..comm.process_group import max_over_groups
from .dtensor_views import as_grad_of, local_tensor
from .grads import set_grad_of_other_dtype
from .layout import FlatParamLayout, ParamInfo

if TYPE_CHECKING:
    from .storage import FlatParamHandle

__all__ = ["show_waiting_grad", "take_user_changes", "forget_shown"]


class ShownPending(NamedTuple):
    """One parameter's ``.grad`` as it was once a ``no_sync`` backward ended."""

    param: nn.Parameter
    info: ParamInfo
    grad: torch.Tensor
    version: int
    # A view (or stand-in) of the waiting gradient, not the user's own.
    ours: bool


# Each flat parameter whose waiting gradient its parameters' .grad show
# (weak: the record dies with the handle).
_SHOWN: "weakref.WeakKeyDictionary[FlatParamHandle, list[ShownPending]]" = weakref.WeakKeyDictionary()


def show_waiting_grad(handle: FlatParamHandle) -> None:
    """Show ``handle``'s waiting gradient in its parameters' ``.grad``
    (no-op without one, or when shown already)."""
    grad = handle.unsharded_flat_param.grad
    if grad is not None and handle not in _SHOWN:
        _SHOWN[handle] = _show(handle.layout, handle.orig_params, handle.param_requires_grad, grad)


def take_user_changes(handle: FlatParamHandle, *, name_prefix: str, accumulated: bool) -> None:
    """Before ``handle``'s gradient accumulates (``accumulated``: after) or
    is reduced: apply what the user did to the ``.grad`` that showed its
    waiting gradient (the module note) and drop the views; no-op when none
    are shown. ``accumulated``: a backward already added to it (a change can
    no longer be told apart: it raises). ``name_prefix`` completes names."""
    if _SHOWN:
        shown = _SHOWN.pop(handle, None)
        if shown is not None:
            groups = (handle.groups.shard_group, handle.groups.replicate_group)
            agree = functools.partial(max_over_groups, groups=groups, device=handle.compute_device)
            _take(shown, handle.unsharded_flat_param.grad, agree, name_prefix=name_prefix, accumulated=accumulated)


def forget_shown(handle: FlatParamHandle) -> None:
    """Drop the views of ``handle``'s waiting gradient, applying nothing
    (it is discarded: a reset after an error)."""
    shown = _SHOWN.pop(handle, None)
    for entry in shown or ():
        if entry.ours and entry.param.grad is entry.grad:
            entry.param.grad = None


def _show(
    layout: FlatParamLayout, orig_params: Sequence[nn.Parameter], requires_grad: Sequence[bool], pending: torch.Tensor
) -> list[ShownPending]:
    """Show ``pending`` (the padded unsharded gradient) in the ``.grad`` of
    every trainable parameter that has none, and record every trainable
    parameter's ``.grad``, each made a tensor of its own version counter
    (the views of one buffer share theirs): an in-place change is seen on
    the parameter it was made to."""
    shown = []
    for info, param, needs_grad in zip(layout.params, orig_params, requires_grad):
        if not (needs_grad and param.requires_grad):
            continue
        grad = param.grad
        ours = grad is None
        if grad is None:
            start = info.offset + info.local_start
            grad = pending[start : start + info.local_numel]
            if grad.device != param.device:  # offloaded: the gradient stays on the device; zeros stand in
                grad = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
        if isinstance(param, DTensor):
            if ours:
                param.grad = as_grad_of(param, grad)
        else:
            # A .grad of its own version counter, of any dtype (a
            # low-precision gradient too), on the same memory.
            set_grad_of_other_dtype(param, grad)
        shown_grad = param.grad
        assert shown_grad is not None  # just set, or the user's
        shown.append(ShownPending(param, info, shown_grad, shown_grad._version, ours))
    return shown


def _take(
    shown: list[ShownPending],
    pending: torch.Tensor | None,
    agree: Callable[[list[int]], list[int]],
    *,
    name_prefix: str,
    accumulated: bool,
) -> None:
    cleared: list[ParamInfo] = []
    changed: list[ShownPending] = []
    for entry in shown:
        current = entry.param.grad
        if current is not entry.grad:  # None (zero_grad) or assigned
            cleared.append(entry.info)
            continue
        if current._version != entry.version:
            changed.append(entry)
        if entry.ours:
            entry.param.grad = None
    # Zeroed (zero_grad(set_to_none=False)) where every rank's part is zero
    # now; one rank's part alone may be zero (empty, or no gradient there),
    # so the ranks agree (one small collective, only after in-place
    # changes, which every rank's same code made) and raise alike.
    changed_in_place: list[str] = []
    if changed:
        nonzero = agree([int(local_tensor(entry.grad).count_nonzero() > 0) for entry in changed])
        for entry, still_nonzero in zip(changed, nonzero):
            if still_nonzero:
                changed_in_place.append(name_prefix + entry.info.fqn)
            else:
                cleared.append(entry.info)
    if changed_in_place:
        raise RuntimeError(
            f"fully_shard: the .grad of parameter '{changed_in_place[0]}' was changed in place while its no_sync "
            "gradient waited for a synchronised backward (clip_grad_norm_ or another in-place change between "
            "no_sync backwards). A rank's .grad holds only its part of the local gradient, so the change cannot "
            "be made to the whole of it as in one process. zero_grad() discards waiting gradients; change "
            "gradients after the synchronised backward."
        )
    if cleared and pending is not None:
        if accumulated:
            raise RuntimeError(
                f"fully_shard: the .grad of parameter '{name_prefix}{cleared[0].fqn}' was cleared while its no_sync "
                "gradient waited, but its unit's backward began without composable_shard seeing it first (a "
                "parameter used outside its unit's forward), so this backward's gradient is already added to the "
                "cleared one. Call zero_grad() before the forward of the backward that should start anew."
            )
        with torch.no_grad():
            for info in cleared:
                pending[info.offset : info.offset + info.numel].zero_()

