"""Owns: torch's own gradient-norm entry points over sharded gradients —
``torch.nn.utils.clip_grad_norm_`` (also bound before this package was
imported, and the deprecated ``clip_grad_norm``) and
``torch.nn.utils.get_total_norm`` give the global norm, over every rank's
shard, when some of the tensors they get are sharded parameters' ``.grad``;
and checking that the torch at hand still offers what this relies on.

Knows nothing of: hooks, the lifecycle, flattening (it reads which unit owns
a parameter; the norm itself is ``controls``' ``global_grad_norm``).

Public names: ``track_unit_grads`` (a unit extension), ``check_torch_clip``,
``wrap_get_total_norm`` (used by install.py, which installs the wrapper).

[Note: torch's clip_grad_norm_ over shards]
Between steps a sharded parameter's ``.grad`` is this rank's 1-D slice of
the reduced gradient, so torch's ``_get_total_norm`` would return the norm
of the local slice, a different value on each rank, and clip each rank by
its own coefficient: silently wrong. torch's ``clip_grad_norm_`` looks
``_get_total_norm`` up in its module's globals at every call, so replacing
that global (and the public alias ``torch.nn.utils.get_total_norm``) reaches
every caller, including code that bound ``clip_grad_norm_`` before
importing this package. That is a private name torch does not promise to
keep: ``check_torch_clip`` runs before it is replaced (at the first
``fully_shard``, [Note: wrapping torch's functions] in install.py) and
raises, naming the torch version, if the name is missing, computes another
norm than a hand-made one, or is no longer what ``clip_grad_norm_`` calls.
The replacement finds the tensors that are the current ``.grad`` of a
sharded unit's parameters (by identity; a dict of the live units' gradients
per call, O(parameters)); with none it calls torch's own function unchanged.
Otherwise the global norm is ``global_grad_norm`` (controls/unshard_params.py,
[Note: one gradient norm over shards]), the very computation of
``composable_shard.clip_grad_norm_``: each rank sums its contributions per
shard group (and, for a ``DTensor`` gradient sharded on its tensor-parallel
mesh, per that mesh's group too), all-reduces them over those groups
(replicas hold the same values and count once), and every rank gets the same
total; torch's ``_clip_grads_with_norm_`` then scales each local slice by the
same coefficient, which is exactly the single-process clipping (the scaling
is elementwise). Collective when sharded gradients are present: every rank
must call it with the same parameters (empty local parts have an empty
``.grad``, never None, so every rank sees the same set: [Note: empty
gradients on empty ranges] in handle/grads.py). ``clip_grad_value_`` needs
nothing: clamping is elementwise. Pinned by tests/interop/test_torch_clip_grad.py
and tests/interop/test_install.py.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Callable, Iterable, NoReturn

import torch
import torch.nn.utils.clip_grad as torch_clip_grad
from torch.utils.hooks import RemovableHandle

from ..controls.unshard_params import NormGroups, global_grad_norm, unit_norm_groups, unowned_norm_groups
from ..handle.dtensor_views import local_tensor
from ..runtime.state import UnitState

__all__ = ["track_unit_grads", "check_torch_clip", "wrap_get_total_norm"]

# The private name of torch.nn.utils.clip_grad this module replaces.
PRIVATE_NAME = "torch.nn.utils.clip_grad._get_total_norm"

# Every live unit (weak: a deleted model drops its units).
_UNITS: weakref.WeakSet[UnitState] = weakref.WeakSet()


def track_unit_grads(state: UnitState) -> list[RemovableHandle]:
    """Unit extension: let torch's norm functions recognise this unit's
    gradients. Registers no hook."""
    _UNITS.add(state)
    return []


def check_torch_clip(caller: str) -> Callable[..., torch.Tensor]:
    """Return torch's ``_get_total_norm`` after checking that it exists, gives
    the norm of a few small tensors (2-norm and inf-norm, against values
    computed by hand), and is what ``torch.nn.utils.clip_grad_norm_`` calls.
    Raises ``RuntimeError`` naming ``caller``, the torch version and what is
    wrong otherwise; changes nothing either way."""
    original = getattr(torch_clip_grad, "_get_total_norm", None)
    public = getattr(torch.nn.utils, "get_total_norm", None)
    clip = getattr(torch_clip_grad, "clip_grad_norm_", None)
    if not callable(original) or not callable(public) or not callable(clip):
        missing = [
            name
            for name, value in (
                (PRIVATE_NAME, original),
                ("torch.nn.utils.get_total_norm", public),
                ("torch.nn.utils.clip_grad.clip_grad_norm_", clip),
            )
            if not callable(value)
        ]
        _refuse(caller, f"has no {' / '.join(missing)}")
    # |(3, -4)|_2 = 5 with 12 in another tensor: sqrt(25 + 144) = 13; max |.| = 12.
    probe = [torch.tensor([3.0, -4.0]), torch.tensor([12.0])]
    for norm_type, expected in ((2.0, 13.0), (math.inf, 12.0)):
        try:
            value = original(probe, norm_type)
            matches = isinstance(value, torch.Tensor) and value.numel() == 1 and abs(value.item() - expected) < 1e-5
        except Exception as error:  # any failure means the function changed
            _refuse(caller, f"has a {PRIVATE_NAME} that fails on a list of two small tensors ({error!r})")
        if not matches:
            _refuse(
                caller,
                f"has a {PRIVATE_NAME} that gives {value!r} as the {norm_type}-norm of [3, -4] and [12] "
                f"(expected {expected})",
            )
    _check_clip_calls_it(caller, original, clip)
    return original


def _check_clip_calls_it(
    caller: str, original: Callable[..., torch.Tensor], clip: Callable[..., torch.Tensor]
) -> None:
    """``clip_grad_norm_`` must look ``_get_total_norm`` up in its module at
    each call (what replacing it relies on): swap in a recorder for one call
    on a throw-away tensor (max_norm is not reached: nothing is scaled)."""
    calls: list[bool] = []

    @functools.wraps(original)
    def recorder(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(True)
        return original(*args, **kwargs)

    probe = torch.zeros(2, requires_grad=True)
    probe.grad = torch.tensor([3.0, -4.0])
    torch_clip_grad._get_total_norm = recorder
    try:
        clip([probe], 100.0)
    finally:
        torch_clip_grad._get_total_norm = original
    if not calls:
        _refuse(caller, f"has a torch.nn.utils.clip_grad_norm_ that no longer calls {PRIVATE_NAME}")


def _refuse(caller: str, what: str) -> NoReturn:
    raise RuntimeError(
        f"{caller}: torch {torch.__version__} {what}; composable_shard replaces {PRIVATE_NAME} so that "
        "torch.nn.utils.clip_grad_norm_ gives the global norm over the shards ([Note: torch's clip_grad_norm_ "
        "over shards]). Call composable_shard.interop.set_torch_wrappers(False) before fully_shard and clip "
        "with composable_shard.clip_grad_norm_(model, max_norm) instead, or use a torch release this version "
        "of composable_shard supports. Nothing was changed."
    )


def wrap_get_total_norm(torch_get_total_norm: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The shard-aware replacement of ``torch_get_total_norm`` (torch's own,
    which it calls for tensors no sharded unit owns)."""

    @functools.wraps(torch_get_total_norm)
    def get_total_norm(
        tensors: torch.Tensor | Iterable[torch.Tensor],
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        owners = _owners(tensors) if _UNITS else {}
        if not owners:
            return torch_get_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
        return _sharded_total_norm(tensors, owners, float(norm_type), error_if_nonfinite)

    return get_total_norm


def _owners(tensors: list[torch.Tensor]) -> dict[int, tuple[NormGroups, torch.device]]:
    """For each of ``tensors`` that is the current ``.grad`` of a sharded
    unit's parameter (by ``id`` of the tensor): its groups and the unit's
    compute device."""
    wanted = {id(tensor) for tensor in tensors}
    owners: dict[int, tuple[NormGroups, torch.device]] = {}
    for unit in list(_UNITS):
        if not unit.groups.is_sharded:
            continue  # whole gradients: torch's own norm is right
        for param, groups in unit_norm_groups(unit):
            grad = param.grad
            if grad is not None and id(grad) in wanted:
                owners[id(grad)] = (groups, unit.compute_device)
    return owners


def _sharded_total_norm(
    tensors: list[torch.Tensor],
    owners: dict[int, tuple[NormGroups, torch.device]],
    norm_type: float,
    error_if_nonfinite: bool,
) -> torch.Tensor:
    device = next(iter(owners.values()))[1]  # where the groups' collectives run
    # In the order given (every rank passes the same tensors): the keys,
    # and so the collectives, agree across ranks. A tensor no unit owns
    # counts as replicated (a DTensor one: summed over its mesh if sharded).
    local_grads: dict[NormGroups, list[torch.Tensor]] = {}
    for tensor in tensors:
        owner = owners.get(id(tensor))
        groups = owner[0] if owner is not None else unowned_norm_groups(tensor)
        local_grads.setdefault(groups, []).append(local_tensor(tensor))
    with torch.no_grad():
        total = global_grad_norm(local_grads, norm_type, device)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    # torch's own result type: on the first tensor's device, in its dtype.
    return total.to(device=tensors[0].device, dtype=tensors[0].dtype if tensors[0].is_floating_point() else None)
