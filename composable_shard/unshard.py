"""Owns: the user-facing utilities over a sharded tree — ``unshard_params``
(full parameters, and gradients, for a while), ``no_sync`` (local gradient
accumulation) and ``clip_grad_norm_`` (global norm over all shards).

Knows nothing of: hook internals (it reads unit states and calls handles).

Public names: ``unshard_params``, ``no_sync``, ``clip_grad_norm_``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from . import comm
from .flat_param import FlatParamHandle
from .runtime import in_backward
from .state import TrainingState, UnitState, get_state, unit_states_under

__all__ = ["unshard_params", "no_sync", "clip_grad_norm_"]

# Handles shown unsharded by an enclosing unshard_params (nested use shows
# each handle once, and only the outermost context restores it).
_ACTIVE_UNSHARDED: set[int] = set()


def _units(module: nn.Module, *, recurse: bool, what: str) -> list[UnitState]:
    if recurse:
        units = [state for _, state in unit_states_under(module)]
    else:
        state = get_state(module)
        units = [state] if state is not None else []
    if not units:
        raise ValueError(
            f"{what}({type(module).__name__}): no module in this tree was given to fully_shard. Call "
            "fully_shard(module) first."
        )
    return units


def _check_idle(units: list[UnitState], what: str) -> None:
    busy = [unit for unit in units if unit.training_state is not TrainingState.IDLE]
    if busy or in_backward():
        where = busy[0].fqn if busy else units[0].fqn
        raise RuntimeError(
            f"{what}: called inside forward or backward (unit '{where}'). Call it between training steps."
        )


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
    """Inside the context every parameter of the sharded units has its full
    shape and value (and, ``with_grads``, ``.grad`` is the full mean
    gradient). With ``writeback``, in-place changes are kept after it.

    Collective: every rank of the shard groups must enter it.
    """
    if rank0_only and writeback:
        raise ValueError(
            "unshard_params: rank0_only=True with writeback=True is not supported (other ranks would not "
            "see rank 0's edits). Pass writeback=False."
        )
    units = _units(module, recurse=recurse, what="unshard_params")
    _check_idle(units, "unshard_params")
    handles = [h for unit in units for h in unit.handles if id(h) not in _ACTIVE_UNSHARDED]
    is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
    shown = []
    try:
        for handle in handles:
            full_flat = handle.gather_full_flat_param()
            full_grad = handle.gather_full_flat_grad() if with_grads and handle.layout.requires_grad else None
            if rank0_only and not is_rank0:
                continue
            if offload_to_cpu:
                full_flat = full_flat.cpu()
                full_grad = full_grad.cpu() if full_grad is not None else None
            sharded_grads = [param.grad for param in handle.orig_params]
            handle.show_full_params(full_flat, full_grad)
            _ACTIVE_UNSHARDED.add(id(handle))
            shown.append((handle, full_flat, sharded_grads))
        yield
    finally:
        for handle, full_flat, sharded_grads in shown:
            _ACTIVE_UNSHARDED.discard(id(handle))
            if writeback:
                handle.load_shard_from_full(full_flat)
            handle.use_sharded_views()
            for param, grad in zip(handle.orig_params, sharded_grads):
                param.grad = grad


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Backward passes inside accumulate gradients locally, without
    communication; the next backward outside reduces the sum.

    Costs one unsharded gradient per flat parameter until that backward.
    """
    units = _units(module, recurse=True, what="no_sync")
    previous = [unit.skip_grad_sync for unit in units]
    for unit in units:
        unit.skip_grad_sync = True
    try:
        yield
    finally:
        for unit, skip in zip(units, previous):
            unit.skip_grad_sync = skip


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``module``'s parameters by their total norm over
    all ranks (what a single process with the full model computes) and
    return that norm. Collective over every shard group in the tree."""
    units = _units(module, recurse=True, what="clip_grad_norm_")
    _check_idle(units, "clip_grad_norm_")
    norm_type = float(norm_type)
    sharded_params: set[int] = set()
    # Per shard group (None: this rank alone), local norm contributions.
    group_grads: dict[ProcessGroup | None, list[torch.Tensor]] = {}
    for unit in units:
        shard_group = unit.groups.shard_group if unit.groups.is_sharded else None
        for handle in unit.handles:
            grads = _local_grads(handle)
            sharded_params.update(id(p) for p in handle.orig_params)
            group_grads.setdefault(shard_group, []).extend(grads)
    # Parameters no unit owns (ignored states) are whole on every rank.
    for param in module.parameters():
        if id(param) not in sharded_params and param.grad is not None:
            group_grads.setdefault(None, []).append(param.grad)
    device = units[0].compute_device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for shard_group, grads in group_grads.items():
        local = _norm_contribution(grads, norm_type, device)
        if shard_group is not None:
            if math.isinf(norm_type):
                comm.all_reduce_max(local, shard_group)
            else:
                comm.all_reduce(local, shard_group, async_op=False)
        total = torch.maximum(total, local) if math.isinf(norm_type) else total + local
    total_norm = total if math.isinf(norm_type) else total ** (1.0 / norm_type)
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    all_grads = [g for grads in group_grads.values() for g in grads]
    if all_grads:
        torch._foreach_mul_(all_grads, clip_coef.to(all_grads[0].device))
    return total_norm


def _local_grads(handle: FlatParamHandle) -> list[torch.Tensor]:
    return [p.grad for p in handle.orig_params if p.grad is not None and p.grad.numel() > 0]


def _norm_contribution(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """max |g| for the inf-norm, else sum |g|^p (to be summed over ranks)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g.float(), norm_type).to(device) for g in grads])
    if math.isinf(norm_type):
        return norms.max()
    return (norms**norm_type).sum()
