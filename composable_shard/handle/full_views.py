"""Owns: a flat parameter's original parameters shown whole outside a step —
full copies gathered for ``unshard_params`` and state dicts (and written
back), and FSDP2's explicit ``unshard()`` show of the gathered buffer with
the write-back of what the user edited there.

Knows nothing of: hooks, training state, which unit or tree a handle is in.

Public names: ``gather_full``, ``gather_full_flat_param``,
``gather_full_flat_grad``, ``show_full_params``, ``load_shard_from_full``,
``show_unsharded_params``, ``write_back_shown_edits``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from .. import comm
from . import dtensor_views, forward_views
from .storage import FlatParamHandle

__all__ = [
    "gather_full",
    "gather_full_flat_param",
    "gather_full_flat_grad",
    "show_full_params",
    "load_shard_from_full",
    "show_unsharded_params",
    "write_back_shown_edits",
]


# ------------------------------------- explicit unshard (FSDP2's unshard())
def show_unsharded_params(handle: FlatParamHandle) -> tuple[nn.Parameter, ...]:
    """Register on the owners, for each original parameter, a new
    parameter of its full shape aliasing the gathered buffer (compute
    dtype; a ``DTensor`` with its tensor-parallel spec where it is one),
    as FSDP2's ``unshard()`` registers its unsharded parameters. The
    original parameters keep their shard views; any later registration
    of them (``reshard``, ``hide_unsharded_views``, a forward's views)
    ends the show. Returns the shown parameters, for
    ``write_back_shown_edits``."""
    handle.check_unsharded("show_unsharded_params")
    shown: list[nn.Parameter] = []
    for index, (info, view) in enumerate(zip(handle.layout.params, handle.views_of(handle.unsharded_flat_param))):
        spec = handle.tp_specs[index]
        param = nn.Parameter(
            dtensor_views.forward_view(view, spec) if spec is not None else view,
            requires_grad=handle.param_requires_grad[index],
        )
        setattr(param, forward_views.SHOWN_MARK, True)  # ours: [Note: a parameter replaced during a step]
        for owner in info.owners:
            owner.module._parameters[owner.attr] = param
        shown.append(param)
    return tuple(shown)


def write_back_shown_edits(handle: FlatParamHandle, shown: Sequence[nn.Parameter]) -> list[str]:
    """Take into this rank's shard what the user changed on the
    parameters ``show_unsharded_params`` showed: values written in place
    (through any alias of the buffer) or by assigning ``.data`` of the
    same shape, and ``requires_grad`` (handed to the original parameter,
    which the next write-back takes in). Only elements that differ from
    the shard in the compute dtype are written, so under mixed precision
    the others keep their full-precision values. The buffer is kept: it
    holds the edited values. Returns the names of parameters whose
    ``.data`` got another shape (their change is dropped)."""
    handle.check_unsharded("write_back_shown_edits")
    wrong: list[str] = []
    with torch.no_grad():
        for info, view, param, orig in zip(
            handle.layout.params, handle.views_of(handle.unsharded_flat_param), shown, handle.orig_params
        ):
            data = dtensor_views.local_tensor(param.data)
            if data.shape != info.shape:
                wrong.append(info.fqn)
            elif data.data_ptr() != view.data_ptr():
                view.copy_(data)  # .data replaced: into the buffer, then as an in-place edit
            if param.requires_grad != orig.requires_grad:
                orig.requires_grad_(param.requires_grad)
        start = handle.layout.shard_rank * handle.layout.shard_numel
        window = handle.unsharded_flat_param.detach()[start : start + handle.layout.shard_numel]
        shard = handle.sharded_flat_param
        if window.data_ptr() != shard.data_ptr():  # else the shown views are the shard's own
            current = handle.shard_on_compute_device().to(window.dtype)
            edited = _differs(window, current)
            if bool(edited.any()):  # a host-device sync, once per handle per explicit unshard
                shard.copy_(torch.where(edited.to(shard.device), window.to(shard.device, shard.dtype), shard))
    return wrong


# ---------------------------------------------- full copies (unshard_params)
def gather_full_flat_param(handle: FlatParamHandle) -> torch.Tensor:
    """A new padded unsharded copy of the flat parameter in its own dtype
    (not the compute dtype), gathered synchronously. Collective."""
    return gather_full(handle, handle.sharded_flat_param)


def gather_full_flat_grad(handle: FlatParamHandle) -> torch.Tensor:
    """A new padded unsharded copy of the gradients the parameters hold
    now (zeros where they hold none). Collective."""
    sharded_grad = handle.collect_user_grads()
    if sharded_grad is None:
        sharded_grad = torch.zeros_like(handle.sharded_flat_param)
    return gather_full(handle, sharded_grad)


def gather_full(handle: FlatParamHandle, shard: torch.Tensor) -> torch.Tensor:
    """A new padded unsharded tensor gathered from every rank's
    ``shard`` (shard_numel each, any dtype). Collective."""
    shard = shard.to(handle.compute_device)
    if not handle.groups.is_sharded:
        return shard.clone()
    full = torch.empty(handle.layout.padded_unsharded_numel, dtype=shard.dtype, device=shard.device)
    comm.all_gather_into(full, shard, handle.groups.shard_group, async_op=False)
    return full


def show_full_params(handle: FlatParamHandle, full_flat: torch.Tensor, full_grad: torch.Tensor | None) -> None:
    """Point each original parameter's ``.data`` (and ``.grad``, when
    ``full_grad`` is given) at its view of the full copies."""
    param_views = handle.views_of(full_flat)
    grad_views: Sequence[torch.Tensor | None] = (
        handle.views_of(full_grad) if full_grad is not None else [None] * len(param_views)
    )
    for index, (info, param, view, grad_view) in enumerate(
        zip(handle.layout.params, handle.orig_params, param_views, grad_views)
    ):
        handle.show_local_data(index, view, full=True)
        if grad_view is not None:  # None exactly when full_grad is None
            grad = grad_view if grad_view.dtype == param.dtype else grad_view.to(param.dtype)
            param.grad = dtensor_views.as_grad_of(param, grad)
        for owner in info.owners:
            owner.module._parameters[owner.attr] = param


def load_shard_from_full(handle: FlatParamHandle, full_flat: torch.Tensor) -> None:
    """Copy this rank's window of a full flat copy into the shard, only
    where it differs (NaN equal to NaN): an unchanged shard is not written,
    so its version counter stays. Under NO_SHARD a forward's views are the
    shard's own, saved by autograd, and an ``unshard_params`` between that
    forward and its backward that changed nothing must not fail the
    backward (an edit there fails it, as an in-place edit of a parameter
    between forward and backward does in one process). Pinned by
    tests/controls/test_unshard_params.py
    (test_unshard_params_between_forward_and_backward_keeps_the_backward)."""
    start = handle.layout.shard_rank * handle.layout.shard_numel
    shard = handle.sharded_flat_param
    with torch.no_grad():
        window = full_flat[start : start + handle.layout.shard_numel].to(shard.device, shard.dtype)
        if bool(_differs(window, shard).any()):  # a host-device sync, once per handle per unshard_params
            shard.copy_(window)


def _differs(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Where ``new`` holds another value than ``old`` (NaN equal to NaN)."""
    return (new != old) & ~(new.isnan() & old.isnan())
