"""Owns: torch's own gradient-norm entry points over sharded gradients —
``torch.nn.utils.clip_grad_norm_`` (also bound before this package was
imported, and the deprecated ``clip_grad_norm``) and
``torch.nn.utils.get_total_norm`` give the global norm, over every rank's
shard, when some of the tensors they get are sharded parameters' ``.grad``.

Knows nothing of: hooks, the lifecycle, flattening (it reads which unit owns
a parameter and that unit's shard group).

Public names: ``track_unit_grads`` (a unit extension), ``install``.

[Note: torch's clip_grad_norm_ over shards]
Between steps a sharded parameter's ``.grad`` is this rank's 1-D slice of
the reduced gradient, so torch's ``_get_total_norm`` would return the norm
of the local slice, a different value on each rank, and clip each rank by
its own coefficient: silently wrong. torch's ``clip_grad_norm_`` looks
``_get_total_norm`` up in its module's globals at every call, so replacing
that global (and the public alias ``torch.nn.utils.get_total_norm``) once at
import reaches every caller, including code that bound ``clip_grad_norm_``
before importing this package. The replacement finds the tensors that are
the current ``.grad`` of a sharded unit's parameters (by identity; a dict of
the live units' gradients per call, O(parameters)); with none it calls
torch's own function unchanged. Otherwise each rank sums its contributions
per shard group (and, for a ``DTensor`` gradient sharded on its
tensor-parallel mesh, per that mesh's group too), all-reduces them over
those groups (replicas hold the same values and count once), and every rank
gets the same total; torch's
``_clip_grads_with_norm_`` then scales each local slice by the same
coefficient, which is exactly the single-process clipping (the scaling is
elementwise). Collective when sharded gradients are present: every rank must
call it with the same parameters (empty local parts have an empty ``.grad``,
never None, so every rank sees the same set: [Note: empty gradients on empty
ranges] in handle/grads.py). ``clip_grad_value_`` needs nothing: clamping is
elementwise. Pinned by tests/training/test_torch_clip_grad.py.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Callable, Iterable

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as torch_clip_grad
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from .. import comm
from ..handle.dtensor_views import local_tensor, norm_group_of
from ..runtime.state import UnitState

__all__ = ["track_unit_grads", "install"]

# Every live unit (weak: a deleted model drops its units).
_UNITS: weakref.WeakSet[UnitState] = weakref.WeakSet()
# torch's own function, kept for tensors no unit owns.
_TORCH_GET_TOTAL_NORM: Callable[..., torch.Tensor] | None = None


def track_unit_grads(state: UnitState) -> list[RemovableHandle]:
    """Unit extension: let torch's norm functions recognise this unit's
    gradients. Registers no hook."""
    _UNITS.add(state)
    return []


def install() -> None:
    """Replace torch's ``_get_total_norm`` (and its public alias) with the
    shard-aware one; idempotent."""
    global _TORCH_GET_TOTAL_NORM
    if _TORCH_GET_TOTAL_NORM is not None:
        return
    _TORCH_GET_TOTAL_NORM = torch_clip_grad._get_total_norm
    wrapper = functools.wraps(_TORCH_GET_TOTAL_NORM)(_get_total_norm)
    torch_clip_grad._get_total_norm = wrapper
    torch.nn.utils.get_total_norm = wrapper


def _owners(tensors: list[torch.Tensor]) -> dict[int, UnitState]:
    """For each of ``tensors`` that is the current ``.grad`` of a sharded
    unit's parameter, that unit (by ``id`` of the tensor)."""
    wanted = {id(tensor) for tensor in tensors}
    owners: dict[int, UnitState] = {}
    for unit in list(_UNITS):
        if not unit.groups.is_sharded:
            continue  # whole gradients: torch's own norm is right
        for handle in unit.handles:
            for param in handle.orig_params:
                grad = param.grad
                if grad is not None and id(grad) in wanted:
                    owners[id(grad)] = unit
    return owners


def _get_total_norm(
    tensors: torch.Tensor | Iterable[torch.Tensor],
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    assert _TORCH_GET_TOTAL_NORM is not None  # installed before it is reachable
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    owners = _owners(tensors) if _UNITS else {}
    if not owners:
        return _TORCH_GET_TOTAL_NORM(tensors, norm_type, error_if_nonfinite, foreach)
    norm_type = float(norm_type)
    if not (norm_type > 0):  # also NaN; -inf and 0 are no norm of a sum of shards
        raise ValueError(
            f"clip_grad_norm_/get_total_norm over sharded gradients: norm_type={norm_type} is not supported; use "
            "a p-norm with p > 0 or inf."
        )
    with torch.no_grad():
        total = _global_norm(tensors, owners, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    # torch's own result type: on the first tensor's device, in its dtype.
    return total.to(device=tensors[0].device, dtype=tensors[0].dtype if tensors[0].is_floating_point() else None)


def _global_norm(tensors: list[torch.Tensor], owners: dict[int, UnitState], norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of all of ``tensors`` as full tensors: local
    contributions summed (max for inf) per shard group, then combined."""
    device = next(iter(owners.values())).compute_device  # where the group's collectives run
    # Per (shard group, tensor-parallel group): a DTensor gradient's local
    # part also adds up over its mesh when sharded there (see
    # ``norm_group_of``); a replicated one counts once.
    by_group: dict[tuple[ProcessGroup | None, ProcessGroup | None], list[torch.Tensor]] = {}
    for tensor in tensors:
        unit = owners.get(id(tensor))
        key = (unit.groups.shard_group if unit is not None else None, norm_group_of(tensor))
        by_group.setdefault(key, []).append(local_tensor(tensor))
    parts = [(groups, _contribution(group_tensors, norm_type, device)) for groups, group_tensors in by_group.items()]
    return comm.total_norm_of_parts(parts, norm_type, device)


def _contribution(tensors: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """max |t| for the inf-norm, else sum |t|^p, in fp32 on ``device``."""
    present = [tensor for tensor in tensors if tensor.numel() > 0]
    if not present:
        return torch.zeros((), dtype=torch.float32, device=device)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in present:
        by_device.setdefault(tensor.device, []).append(tensor if tensor.dtype == torch.float32 else tensor.float())
    # One foreach kernel per device (as torch's own), then one scalar each.
    norms = torch.cat([torch.stack(torch._foreach_norm(group, norm_type)).to(device) for group in by_device.values()])
    return norms.max() if math.isinf(norm_type) else (norms**norm_type).sum()

