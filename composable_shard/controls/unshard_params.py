"""Owns: the user-facing utilities over a sharded tree — ``unshard_params``
(full parameters, and gradients, for a while), ``no_sync`` (local gradient
accumulation) and ``clip_grad_norm_`` (global norm over all shards).

Knows nothing of: hook internals (it reads unit states and calls handles).

Public names: ``unshard_params``, ``no_sync``, ``clip_grad_norm_``; for
torch's own clip functions over shards (interop/clip_grad.py), the one
global-norm computation: ``NormGroups``, ``unit_norm_groups``,
``unowned_norm_groups``, ``global_grad_norm`` ([Note: one gradient norm over shards]).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Iterator, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from ..handle import full_views
from .. import comm
from ..handle import FlatParamHandle, set_grad_of_other_dtype
from .per_unit import set_units_gradient_sync
from ..handle.dtensor_views import local_tensor, norm_group_of
from ..runtime import enter_between_steps
from ..runtime.state import UnitState, units_of

__all__ = ["unshard_params", "no_sync", "clip_grad_norm_", "NormGroups", "unit_norm_groups", "unowned_norm_groups", "global_grad_norm"]

# Handles shown unsharded by an enclosing unshard_params (nested use shows
# each handle once, and only the outermost context restores it). Weak: a
# model freed inside the context leaves no entry behind.
_ACTIVE_UNSHARDED: weakref.WeakSet[FlatParamHandle] = weakref.WeakSet()


def is_inside_unshard_params(handle: FlatParamHandle) -> bool:
    """Whether an enclosing ``unshard_params`` shows this handle's full
    parameters now."""
    return handle in _ACTIVE_UNSHARDED



@contextlib.contextmanager
def unshard_params(
    module: nn.Module,
    *,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Inside the context every parameter of the sharded units under
    ``module`` (only ``module``'s own unit with ``recurse=False``) has its
    full shape and value, in its own dtype (not the mixed-precision compute
    dtype); with ``with_grads``, ``.grad`` is the full mean gradient (zeros
    where no rank holds one; edits to it are not kept). A ``DTensor``
    (tensor-parallel) parameter shows a ``DTensor`` of its whole local
    tensor with its TP placements (``.full_tensor()`` gathers the global
    one over the tp mesh; in-place edits of ``.to_local()`` are kept), and
    its ``.grad`` likewise.

    With ``writeback`` (the default), changes made inside, in place or by
    assigning a same-shaped tensor to ``.data``, are kept after it; every
    rank must make the same change. Without it they are discarded.
    ``rank0_only``: only global rank 0 sees full parameters, the others keep
    their shards (needs ``writeback=False``); ``offload_to_cpu``: the full
    copies live on CPU.

    Nesting and re-entering are allowed: a parameter already shown by an
    enclosing context stays shown, and only that context restores it (so
    its ``writeback`` decides). Collective: every rank of the shard groups
    must enter it. Memory: one full copy of every unit it covers (gathered
    all at once), plus their gradients with ``with_grads``.
    """
    if rank0_only and writeback:
        raise ValueError(
            f"unshard_params({type(module).__name__}): rank0_only=True with writeback=True is not supported "
            "(other ranks would not see rank 0's edits). Pass writeback=False."
        )
    units = units_of(module, recurse=recurse, what="unshard_params")
    enter_between_steps(units, "unshard_params")
    handles = [h for unit in units for h in unit.handles if h not in _ACTIVE_UNSHARDED]
    for unit in units:  # the user's changes since the last step first (values, dtype, requires_grad)
        for handle in unit.handles:
            if handle not in _ACTIVE_UNSHARDED:
                handle.writeback_orig_params(name_prefix=unit.name_prefix)
    is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
    shown: list[tuple[FlatParamHandle, torch.Tensor, list[torch.Tensor | None]]] = []
    try:
        for handle in handles:
            full_flat = full_views.gather_full_flat_param(handle)
            # Also a flat parameter frozen after training: it may hold the
            # gradients the user left.
            full_grad = full_views.gather_full_flat_grad(handle) if with_grads and handle.ever_required_grad else None
            if rank0_only and not is_rank0:
                continue
            if offload_to_cpu:
                full_flat = full_flat.cpu()
                full_grad = full_grad.cpu() if full_grad is not None else None
            sharded_grads = [param.grad for param in handle.orig_params]
            full_views.show_full_params(handle, full_flat, full_grad)
            _ACTIVE_UNSHARDED.add(handle)
            shown.append((handle, full_flat, sharded_grads))
        yield
    finally:
        replaced_wrongly: list[str] = []
        for handle, full_flat, sharded_grads in shown:
            _ACTIVE_UNSHARDED.discard(handle)
            if writeback:
                replaced_wrongly += _absorb_replaced_data(handle, full_flat)
                full_views.load_shard_from_full(handle, full_flat)
            handle.use_sharded_views()
            for param, grad in zip(handle.orig_params, sharded_grads):
                _restore_grad(param, grad)
        if replaced_wrongly:
            raise ValueError(
                f"unshard_params({type(module).__name__}): inside the context, {replaced_wrongly[:4]} got data "
                "of another shape, which cannot be written back to the shards; their change was dropped. "
                "Change parameters in place, or assign tensors of the full shape."
            )


def _absorb_replaced_data(handle: FlatParamHandle, full_flat: torch.Tensor) -> list[str]:
    """Copy parameters whose ``.data`` the user replaced inside the context
    (same shape) into ``full_flat``, so writeback sees them. Returns the
    names of parameters that got another shape (their change is dropped)."""
    layout = handle.layout
    segments = torch.split(full_flat.detach(), list(layout.split_sizes))
    wrong: list[str] = []
    with torch.no_grad():
        for info, index, param in zip(layout.params, layout.param_segments, handle.orig_params):
            view = segments[index].view(info.shape)
            data = local_tensor(param)  # a DTensor's local tensor: the layout's shape
            if data.data_ptr() == view.data_ptr() and data.shape == info.shape:
                continue  # still the view: in-place edits are already there
            if data.shape != info.shape:
                wrong.append(info.fqn)
                continue
            view.copy_(data.detach())
    return wrong


def _restore_grad(param: nn.Parameter, grad: torch.Tensor | None) -> None:
    """Give ``param`` back the gradient it had before the context, also a
    low-precision one (``keep_low_precision_grads``), which autograd only
    accepts swapped in through ``.data`` (as the handle does)."""
    if grad is None or grad.dtype == param.dtype:
        param.grad = grad
    else:
        set_grad_of_other_dtype(param, grad)


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Backward passes inside accumulate gradients locally, without
    gradient communication; the next backward outside reduces the sum (and
    adds it to any gradient the parameters already hold).

    No reduce-scatter or all-reduce runs inside. Sharded strategies still
    all-gather parameters for each forward and backward (nothing is kept
    unsharded between them); under ``NO_SHARD`` nothing is communicated.

    Memory: each trainable flat parameter keeps its padded *unsharded*
    gradient, in the compute dtype (``param_dtype`` under mixed precision,
    so accumulation happens in that dtype), from the first backward inside
    until the next synchronised backward reduces it. That is the whole
    model's gradient on every rank — ``world_size`` times the sharded
    gradient (for a 7B-parameter model in bf16, 14 GB per rank) — on top of
    the sharded gradients the parameters may hold. Use it where that fits,
    or accumulate sharded gradients (plain backwards, one reduction each)
    where it does not.

    Applies to every unit under ``module``: ``set_requires_gradient_sync``
    with ``False`` for the context's duration, each unit's own setting
    restored at its exit (so nesting restores the outer setting).
    """
    units = units_of(module, recurse=True, what="no_sync")
    previous = [not unit.skip_grad_sync for unit in units]
    set_units_gradient_sync(units, False)
    try:
        yield
    finally:
        for unit, requires in zip(units, previous):
            set_units_gradient_sync([unit], requires)


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``module``'s parameters by their total
    ``norm_type``-norm over all ranks (the value a single process with the
    full model computes with ``torch.nn.utils.clip_grad_norm_``), scaling
    every rank's local gradients in place by the same coefficient, and
    return that norm (fp32, fp64 where some gradient is fp64; on the
    compute device, equal on every rank).

    Each unit's local gradients are reduced over its shard group only:
    replicas (``NO_SHARD``, the replicate group of hybrid sharding) hold the
    same values and are counted once. ``DTensor`` (tensor-parallel)
    parameters' local parts are also summed over their mesh when sharded
    there (``Shard``), and counted once when replicated (``Replicate``). Parameters no unit owns (ignored
    states) count with their local gradient, as if replicated (reduce them
    first). Frozen parameters and empty local parts add nothing.
    Collective over every shard group in the tree.
    """
    units = units_of(module, recurse=True, what="clip_grad_norm_")
    enter_between_steps(units, "clip_grad_norm_")
    owned: set[int] = set()
    local_grads: dict[NormGroups, list[torch.Tensor]] = {}
    for unit in units:
        for param, groups in unit_norm_groups(unit):
            owned.add(id(param))
            # Every parameter's key, with a gradient here or not: the keys
            # (and so the collectives' order) agree across ranks.
            grads = local_grads.setdefault(groups, [])
            if param.grad is not None:
                grads.append(local_tensor(param.grad))
    # ``module``'s parameters that a unit above it owns (a plain module
    # holding units and its ancestor's parameters) are that unit's local
    # parts; before, they counted as whole, and each rank clipped by its own
    # norm. Those no unit owns (ignored states) are whole on every rank (a
    # DTensor one: its local part, summed over its mesh when sharded).
    leftover = [param for param in module.parameters() if id(param) not in owned]
    tree = units[0].root_context.units if leftover and units[0].root_context is not None else []
    below = {id(unit) for unit in units} if tree else set()
    above = {id(param): groups for unit in tree if id(unit) not in below for param, groups in unit_norm_groups(unit)}
    for param in leftover:
        owner_groups = above.get(id(param))
        if owner_groups is not None:
            grads = local_grads.setdefault(owner_groups, [])  # with a gradient here or not, as above
            if param.grad is not None:
                grads.append(local_tensor(param.grad))
        elif param.grad is not None and param.grad.numel() > 0:
            local_grads.setdefault(unowned_norm_groups(param.grad), []).append(local_tensor(param.grad))
    total_norm = global_grad_norm(local_grads, norm_type, units[0].compute_device)
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grads in local_grads.values():
        for grad in grads:
            if grad.numel() > 0:
                by_device.setdefault(grad.device, []).append(grad)
    for grad_device, grads in by_device.items():
        # Offloaded gradients: a host-device sync (the host scales them, so
        # it needs the coefficient), one per call.
        torch._foreach_mul_(grads, clip_coef.to(grad_device))
    return total_norm


# [Note: one gradient norm over shards]
# ``clip_grad_norm_`` above and torch's own clip functions over a sharded
# model (interop/clip_grad.py, [Note: torch's clip_grad_norm_ over shards])
# compute the global norm with the functions below: ``unit_norm_groups`` (and
# ``unowned_norm_groups`` for a gradient no unit owns) says over which groups
# each local gradient adds up to the whole, ``global_grad_norm`` reduces the
# local gradients so grouped. The
# callers differ only in which gradients they are given (a module's
# parameters here, any list of tensors there).

# The groups over which a local gradient's contribution adds up to the
# whole tensor's: (the unit's shard group, the tensor-parallel group);
# None: nobody else holds another piece of it.
NormGroups = tuple[ProcessGroup | None, ProcessGroup | None]


def unit_norm_groups(unit: UnitState) -> Iterator[tuple[nn.Parameter, NormGroups]]:
    """Each original parameter of ``unit`` with its ``NormGroups``: the
    unit's shard group when it shards (replicas count once), and the
    parameter's tensor-parallel mesh group when it is a ``DTensor`` sharded
    there."""
    shard_group = unit.groups.shard_group if unit.groups.is_sharded else None
    for handle in unit.handles:
        for param, spec in zip(handle.orig_params, handle.tp_specs):
            tp_group = cast("ProcessGroup | None", spec.norm_group() if spec is not None else None)
            yield param, (shard_group, tp_group)


def unowned_norm_groups(grad: torch.Tensor) -> NormGroups:
    """The ``NormGroups`` of a gradient no unit owns: whole on every rank
    (replicated, counted once), a ``DTensor`` one summed over its mesh when
    sharded there."""
    return (None, cast("ProcessGroup | None", norm_group_of(grad)))


def global_grad_norm(
    local_grads: dict[NormGroups, list[torch.Tensor]], norm_type: float, device: torch.device
) -> torch.Tensor:
    """The ``norm_type``-norm of the whole gradients whose local parts (plain
    tensors; empty ones add nothing) are given per ``NormGroups``: each
    group's contribution is reduced over its groups, in the dict's order
    (every rank must pass the same keys in the same order). fp32 (fp64
    where some gradient is fp64, as torch's stack of per-tensor norms
    promotes), on ``device``, equal on every rank. Collective over those
    groups."""
    norm_type = float(norm_type)
    if not norm_type > 0:  # also NaN; -inf (min |g|) and 0 (a count) are no sums of shards' parts
        raise ValueError(
            f"clip_grad_norm_/get_total_norm over sharded gradients: norm_type={norm_type} is not supported; use "
            "a p-norm with p > 0 or inf. Nothing was clipped."
        )
    # fp64 where some gradient is (empty ones too: every rank holds the same
    # parameters, so every rank picks the same dtype for the collectives).
    dtype = torch.float64 if any(g.dtype == torch.float64 for grads in local_grads.values() for g in grads) else torch.float32
    parts: list[tuple[tuple[ProcessGroup | None, ...], torch.Tensor]] = [
        (groups, _norm_contribution(grads, norm_type, device, dtype)) for groups, grads in local_grads.items()
    ]
    return comm.total_norm_of_parts(parts, norm_type, device, dtype)


def _norm_contribution(
    grads: list[torch.Tensor], norm_type: float, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """max |g| for the inf-norm, else sum |g|^p (to be summed over ranks),
    in ``dtype`` (fp32, or fp64 where some gradient is fp64).

    One foreach kernel per device, accumulating in fp32 (no fp32 copies of
    low-precision gradients; fp64 ones in fp64, as torch computes each
    tensor's norm in its own dtype), then one scalar per device moved to
    ``device``: offloaded gradients (host) cost one upload, not one per
    gradient, and it does not block the host (a pinned scalar, copied with
    ``non_blocking=True`` on the current stream, ahead of every kernel that
    reads it; the pinned allocator keeps the block until the copy ran)."""
    # Per device, and whether fp32 can hold the dtype (fp64 gradients: their
    # own precision).
    by_device: dict[tuple[torch.device, bool], list[torch.Tensor]] = {}
    for grad in grads:
        if grad.numel() > 0:
            by_device.setdefault((grad.device, grad.dtype.itemsize <= 4), []).append(grad)
    if not by_device:
        return torch.zeros((), dtype=dtype, device=device)
    is_inf = math.isinf(norm_type)
    contributions = []
    for (grad_device, fits_fp32), device_grads in by_device.items():
        per_tensor = (
            torch._foreach_norm(device_grads, norm_type, dtype=torch.float32)
            if fits_fp32
            else torch._foreach_norm(device_grads, norm_type)
        )
        norms = torch.stack(per_tensor).to(dtype)
        local = norms.max() if is_inf else (norms**norm_type).sum()
        if grad_device != device:
            if grad_device.type == "cpu" and device.type == "cuda":
                local = local.pin_memory()
            local = local.to(device, non_blocking=True)
        contributions.append(local)
    stacked = torch.stack(contributions)
    return stacked.max() if is_inf else stacked.sum()
