"""Owns: the ``nn.Module`` state-dict hooks on every unit root that make
``module.state_dict()`` and ``module.load_state_dict()`` give and take full
tensors with exactly the unsharded model's keys and shapes, while the user's
classes stay unchanged.

Knows nothing of: DCP, optimizers, the training step's hooks.

[Note: module state-dict hooks]
A unit root's state-dict post-hook all-gathers each flat parameter (every
rank calls ``state_dict``, in the same order) and puts full clones under
every name its parameters go by below the call's prefix. Its load pre-hook
runs before the module loads its tensors, so it replaces each full tensor
with this rank's 1-D slice, which ``_load_from_state_dict`` copies into the
shard view: identity kept, no collective; a wrong shape is reported in
``error_msgs`` with the unsharded shapes. A ``DTensor`` (tensor-parallel)
parameter gives a ``DTensor`` with its TP placements (as the model without
``fully_shard`` would) and takes one, or a full global tensor. After ``assign=True`` the post-hook
copies the assigned data into the shard and restores the original objects.
Pinned by tests/state_dict/test_model.py.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils.hooks import RemovableHandle

from ..handle import full_views
from ..handle.layout import ParamInfo
from ..handle import FlatParamHandle
from ..handle.dtensor_views import TensorParallelSpec, as_grad_of, full_dtensor, local_tensor
from ..runtime import enter_between_steps
from ..runtime.state import UnitState
from .entries import is_shown_unsharded, state_dict_key
from .shards import LocalBox, global_shape, local_part, param_view

__all__ = ["register_state_dict_hooks"]

logger = logging.getLogger(__name__)


def register_state_dict_hooks(state: UnitState) -> list[RemovableHandle]:
    """Attach the state-dict hooks to the unit's root module (each module
    of a group: each hook handles the keys under its own module)."""
    return [
        registered
        for module in state.members
        for registered in (
            module.register_state_dict_post_hook(functools.partial(_post_state_dict, state)),
            module.register_load_state_dict_pre_hook(functools.partial(_pre_load_state_dict, state)),
            module.register_load_state_dict_post_hook(functools.partial(_post_load_state_dict, state)),
        )
    ]


def _prepare(state: UnitState, handles: list[FlatParamHandle], what: str) -> None:
    """The unit must pass the lifecycle's gate (runtime/lifecycle.py); user
    edits of ``.data`` go into the shards first."""
    enter_between_steps([state], what)
    for handle in handles:
        handle.writeback_orig_params(name_prefix=state.name_prefix)


def _relative_prefixes(root: nn.Module) -> dict[int, list[str]]:
    """Every name prefix (relative to ``root``) each module is reachable by."""
    prefixes: dict[int, list[str]] = {}
    for name, submodule in root.named_modules(remove_duplicate=False):
        prefixes.setdefault(id(submodule), []).append(f"{name}." if name else "")
    return prefixes


def _keys(info: ParamInfo, prefixes: dict[int, list[str]], prefix: str) -> list[str]:
    """Every key the parameter may go by below ``prefix``: with checkpoint
    wrappers' segments and without ([Note: checkpoint-wrapper prefixes] in
    entries.py)."""
    keys = [prefix + rel + owner.attr for owner in info.owners for rel in prefixes.get(id(owner.module), [])]
    return list(dict.fromkeys(form for key in keys for form in (key, state_dict_key(key))))


def _post_state_dict(
    state: UnitState, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
) -> None:
    logger.debug("composable_shard::state_dict_post_hook (%s)", state.fqn)
    for name, dtype in state.buffer_dtypes_of(module).items():
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and value.dtype != dtype:
            state_dict[prefix + name] = value.to(dtype)  # the original dtype, as unsharded
    handles = [handle for handle in state.handles if not is_shown_unsharded(handle)]
    if not handles:
        return
    _prepare(state, handles, "state_dict")
    prefixes = _relative_prefixes(module)
    for handle in handles:
        keys_per_param = [
            [key for key in _keys(info, prefixes, prefix) if key in state_dict] for info in handle.layout.params
        ]
        if not any(keys_per_param):
            continue  # the same on every rank: the traversal is
        full_flat = full_views.gather_full_flat_param(handle)  # collective over the shard group
        for info, keys, spec in zip(handle.layout.params, keys_per_param, handle.tp_specs):
            if keys:
                value = param_view(full_flat, info).clone()
                if spec is not None:  # a DTensor parameter: as the unsharded TP model gives it
                    value = full_dtensor(value, spec)
                state_dict.update((key, value) for key in keys)
        del full_flat


def _pre_load_state_dict(
    state: UnitState,
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    logger.debug("composable_shard::load_state_dict_pre_hook (%s)", state.fqn)
    handles = [handle for handle in state.handles if not is_shown_unsharded(handle)]
    if not handles:
        return
    _prepare(state, handles, "load_state_dict")
    prefixes = _relative_prefixes(module)
    for handle in handles:
        for info, param, spec in zip(handle.layout.params, handle.orig_params, handle.tp_specs):
            for key in _keys(info, prefixes, prefix):
                if key in state_dict:
                    value = state_dict[key]
                    if spec is not None and isinstance(value, torch.Tensor):
                        value = _tensor_parallel_local(value, spec)
                    value = _local_slice(key, value, info, param, error_msgs)
                    # A DTensor parameter copies from a DTensor of its spec.
                    state_dict[key] = as_grad_of(param, value) if spec is not None and value is not param else value


def _tensor_parallel_local(value: torch.Tensor, spec: TensorParallelSpec) -> torch.Tensor:
    """A DTensor parameter's local tensor out of a state-dict value: a
    DTensor's own local tensor, or the local box of a full global tensor
    (anything else is left for the shape check to report)."""
    if isinstance(value, DTensor):
        return local_tensor(value)
    if value.shape == spec.global_shape:
        return LocalBox(spec.global_shape, spec.local_offsets(), spec.local_shape).of_full(value)
    return value


def _local_slice(key: str, value: Any, info: ParamInfo, param: nn.Parameter, error_msgs: list[str]) -> Any:
    """This rank's slice of a full tensor (what the 1-D parameter takes)."""
    if not isinstance(value, torch.Tensor):
        return value  # torch reports it
    if global_shape(value) != info.shape:
        error_msgs.append(
            f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from checkpoint, the shape "
            f"in current model is {tuple(info.shape)}."
        )
        return param.detach()  # copying a parameter onto itself changes nothing
    return local_part(value, info)


def _post_load_state_dict(state: UnitState, module: nn.Module, incompatible_keys: _IncompatibleKeys) -> None:
    """After ``load_state_dict(assign=True)``: copy the parameters torch
    assigned into the shard and register the original objects again."""
    for handle in state.handles:
        _restore_identity(handle)


def _restore_identity(handle: FlatParamHandle) -> None:
    with torch.no_grad():
        for info, param in zip(handle.layout.params, handle.orig_params):
            for owner in info.owners:
                current = owner.module._parameters.get(owner.attr)
                if current is None or current is param:
                    continue
                if current.numel() == param.numel():
                    param.copy_(current.detach().reshape(param.shape))
                owner.module._parameters[owner.attr] = param
