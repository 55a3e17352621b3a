"""Owns: when torch's own functions are replaced by this package's wrappers
and when torch's are put back — installing at the first ``fully_shard``,
uninstalling on request or when the last sharded unit is freed, and the
switch that keeps them off.

Knows nothing of: what the wrappers do (autograd_grad.py, clip_grad.py),
hooks, the lifecycle.

Public names: ``set_torch_wrappers``, ``uninstall_torch_wrappers``,
``torch_wrappers_installed`` (re-exported by ``composable_shard.interop``);
``before_fully_shard`` and ``track_unit`` (what the package's ``__init__``
registers with ``fully_shard``).

[Note: wrapping torch's functions]
Three of torch's module attributes are replaced while a sharded model
exists, because the code that calls them is the user's and cannot be
reached otherwise:

- ``torch.autograd.grad`` and ``torch.autograd.backward`` (which
  ``Tensor.backward`` calls through the module attribute): refuse original
  parameters as ``inputs`` ([Note: autograd.grad over original
  parameters] in autograd_grad.py);
- ``torch.nn.utils.clip_grad._get_total_norm`` (a private name) and its
  public alias ``torch.nn.utils.get_total_norm``: the global norm over the
  shards, so ``torch.nn.utils.clip_grad_norm_`` clips as one process would
  ([Note: torch's clip_grad_norm_ over shards] in clip_grad.py).

When. Nothing is replaced at ``import composable_shard`` or by ``plan()``:
plain torch code in the same process runs torch's own functions, the very
objects, at torch's speed. Every ``fully_shard`` call installs them once its
arguments are checked and before it changes the module
(``fully_shard.register_before_change``), so a torch without the private
name refuses the first ``fully_shard`` with a ``RuntimeError`` that names
the torch version and the name, and the module is left as it was. Every
unit counts itself (``track_unit``, a unit extension, installing again if
they were taken away meanwhile); when the last unit of the process is freed
(a ``weakref.finalize`` on each unit's state, so when the garbage collector
frees the model) torch's functions are put back.

Ways out. ``uninstall_torch_wrappers()`` puts torch's own functions back
now (``torch.autograd.grad is`` the object that was there before); the next
``fully_shard`` (or ``set_torch_wrappers(True)`` with a sharded model
alive) installs them again. ``set_torch_wrappers(False)`` puts them back
and keeps every later ``fully_shard`` from installing them: the refusals
above and torch's global clipping are then gone (``torch.autograd.grad``
over original parameters silently gives None, ``torch.nn.utils.
clip_grad_norm_`` the norm of the local shards, different on each rank), so
clip with ``composable_shard.clip_grad_norm_``. While they are off the
package's own functions, hooks on original parameters (an attribute on
those parameters only) and everything else work as before.

Putting back restores an attribute only where it still holds our wrapper
(code that wrapped ours in turn keeps its own wrapper); a wrapper someone
bound while installed (``from torch.autograd import grad``) keeps working,
calling torch's function. Calls of the wrappers in flight finish as they
began.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.autograd
import torch.nn.utils
import torch.nn.utils.clip_grad as torch_clip_grad
from torch.utils.hooks import RemovableHandle

from ..runtime.state import UnitState
from . import autograd_grad, clip_grad

__all__ = [
    "set_torch_wrappers",
    "uninstall_torch_wrappers",
    "torch_wrappers_installed",
    "before_fully_shard",
    "track_unit",
]


@dataclass(frozen=True)
class _Replacement:
    """One attribute of torch's replaced by a wrapper."""

    owner: Any  # the module whose attribute it is
    attribute: str
    original: Callable[..., Any]  # what was there before (torch's own)
    wrapper: Callable[..., Any]


# The replacements in place; empty while torch's own functions are there.
_installed: list[_Replacement] = []
# Whether fully_shard may install them (set_torch_wrappers).
_enabled = True
# Units alive now: the wrappers go when it drops to zero.
_live_units = 0
# Install and uninstall run one at a time across threads; reentrant, for a
# unit freed by a garbage collection that runs inside one of them (whose
# callback then leaves the wrappers as they are: ``_changing``).
_lock = threading.RLock()
_changing = False


def torch_wrappers_installed() -> bool:
    """Whether torch's functions are replaced by this package's wrappers now."""
    return bool(_installed)


def uninstall_torch_wrappers() -> None:
    """Put torch's own ``torch.autograd.grad``, ``torch.autograd.backward``,
    ``torch.nn.utils.clip_grad._get_total_norm`` and
    ``torch.nn.utils.get_total_norm`` back (the same objects as before the
    first ``fully_shard``); nothing when they are not replaced. A later
    ``fully_shard`` installs the wrappers again; to keep them off, call
    ``set_torch_wrappers(False)``. With a sharded model alive, torch's own
    clip functions then give the norm of the local shards only (use
    ``composable_shard.clip_grad_norm_``) and ``torch.autograd.grad`` over
    its original parameters gives None silently."""
    global _changing
    with _lock:
        _changing = True
        try:
            while _installed:
                replacement = _installed.pop()
                if getattr(replacement.owner, replacement.attribute, None) is replacement.wrapper:
                    setattr(replacement.owner, replacement.attribute, replacement.original)
        finally:
            _changing = False


def set_torch_wrappers(enabled: bool) -> None:
    """Whether ``fully_shard`` replaces torch's functions ([Note: wrapping
    torch's functions]). ``False`` puts torch's own back now and keeps every
    later ``fully_shard`` from replacing them; ``True`` (the default)
    installs them now if a sharded unit is alive, else at the next
    ``fully_shard``. Raises ``TypeError`` for anything but a bool, and
    ``RuntimeError`` when this torch lacks what the wrappers need (nothing
    is changed then)."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_torch_wrappers: enabled must be True or False, got {enabled!r}.")
    with _lock:
        if not enabled:
            _enabled = False
            uninstall_torch_wrappers()
            return
        if _live_units > 0:
            _install("set_torch_wrappers(True)")
        _enabled = True


def before_fully_shard(name: str) -> None:
    """``fully_shard``'s step before it changes anything: install the
    wrappers (checking torch first) unless switched off."""
    with _lock:
        if _enabled:
            _install(f"fully_shard({name})")


def track_unit(state: UnitState) -> list[RemovableHandle]:
    """Unit extension: count the unit as alive until it is freed, and make
    sure the wrappers are in place for it (a garbage collection during
    ``fully_shard`` may have freed the last other unit). Registers no hook."""
    global _live_units
    with _lock:
        _live_units += 1
        finalizer = weakref.finalize(state, _unit_freed)
        finalizer.atexit = False  # nothing to restore in a process that ends
        if _enabled:
            _install(f"fully_shard({type(state.module).__name__})")
    return []


def _unit_freed() -> None:
    global _live_units
    with _lock:
        _live_units -= 1
        if _live_units == 0 and not _changing:
            uninstall_torch_wrappers()


def _install(caller: str) -> None:
    """Replace torch's functions with the wrappers, all or none; nothing if
    installed. Checks torch first (raises ``RuntimeError`` naming
    ``caller``, changing nothing)."""
    global _changing
    if _installed:
        return
    _changing = True
    try:
        torch_get_total_norm = clip_grad.check_torch_clip(caller)
        total_norm_wrapper = clip_grad.wrap_get_total_norm(torch_get_total_norm)
        torch_grad, torch_backward = torch.autograd.grad, torch.autograd.backward
        replacements = [
            _Replacement(torch.autograd, "grad", torch_grad, autograd_grad.wrap_grad(torch_grad)),
            _Replacement(torch.autograd, "backward", torch_backward, autograd_grad.wrap_backward(torch_backward)),
            _Replacement(torch_clip_grad, "_get_total_norm", torch_get_total_norm, total_norm_wrapper),
            _Replacement(torch.nn.utils, "get_total_norm", torch.nn.utils.get_total_norm, total_norm_wrapper),
        ]
        for replacement in replacements:
            setattr(replacement.owner, replacement.attribute, replacement.wrapper)
            _installed.append(replacement)
    finally:
        _changing = False
