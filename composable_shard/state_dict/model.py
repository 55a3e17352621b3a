"""Owns: model state dicts of a sharded tree — ``get_model_state_dict`` /
``set_model_state_dict`` (full or sharded, in the form of
``torch.distributed.checkpoint.state_dict``), and the same state dict built
for an already named model as a destination to read into
(``empty_model_state_dict``, ``model_state_dict_views``).

Knows nothing of: hooks of the training step, streams, optimizers (see
``optim``), files (see ``checkpoint``); which keys a model's state dict has
and which units hold them (``entries``); how a bad argument or a state dict
that does not fit is worded (``checks``); ``module.state_dict()`` /
``load_state_dict()`` go through ``hooks``.

A full state dict holds plain tensors with the original names and shapes:
every parameter (tied aliases and shared-module paths included, as
``nn.Module.state_dict`` names them), every persistent buffer and every extra
state. A sharded state dict holds the same keys; each sharded parameter is a
``RangeShardedTensor`` over views of this rank's shard (see [Note: sharded
state dict representation]), everything else is a plain tensor (replicated: DCP
writes it once). Loading validates every key and shape first and copies only
then, so a state dict that does not fit leaves the model as it was.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.nn.modules.module import _IncompatibleKeys

from ..handle import full_views
from .. import comm
from ..runtime.state import UnitState
from .checks import StateDictError, checked_options, is_rank0, key_mismatch_message, value_mismatch_message
from .entries import ModelEntries, ShardedParamEntry, full_tensor_of_local, model_entries, prepare_units, sharding_of
from .shards import global_shape, local_part, param_view, range_source_error, read_range, sharded_tensor_of_range

__all__ = [
    "get_model_state_dict",
    "set_model_state_dict",
    "empty_model_state_dict",
    "model_state_dict_views",
]

logger = logging.getLogger(__name__)


# -------------------------------------------------------------------- get
def get_model_state_dict(module: nn.Module, *, options: StateDictOptions | None = None) -> dict[str, Any]:
    """The model state dict of ``module`` (see the module docstring).

    ``full_state_dict=True`` is a collective over every shard group (one
    all-gather per flat parameter, one at a time); with ``cpu_offload`` only
    rank 0 keeps the tensors (on CPU) and the other ranks return ``{}``.
    ``full_state_dict=False`` (default) runs no collective: every rank builds
    its RangeShardedTensors from the layout, as views of its shard (copies on CPU
    with ``cpu_offload``).
    """
    what = f"get_model_state_dict({type(module).__name__})"
    options = checked_options(options, "get_model_state_dict", type(module).__name__)
    units = prepare_units(module, "get_model_state_dict")
    entries = model_entries(module, units)
    if options.full_state_dict:
        values = _full_values(units, entries, options)
        if options.cpu_offload and not is_rank0():
            return {}
    else:
        values = _sharded_values(entries, options, make_local=_shard_view(options.cpu_offload))
    logger.debug("%s: %d keys", what, len(values))
    return OrderedDict((key, values[key]) for key in entries.key_order if key in values)


def _keep(param: nn.Parameter, options: StateDictOptions) -> bool:
    return not (options.ignore_frozen_params and not param.requires_grad)


def _plain(tensor: torch.Tensor, options: StateDictOptions, *, copy: bool, fresh: bool = False) -> torch.Tensor:
    tensor = tensor.detach()
    if fresh:
        return torch.empty_like(tensor)
    if options.cpu_offload:
        return tensor.to("cpu", copy=copy)
    return tensor.clone() if copy else tensor


def _full_values(units: list[UnitState], entries: ModelEntries, options: StateDictOptions) -> dict[str, Any]:
    keep = not options.cpu_offload or is_rank0()
    by_handle: dict[int, list[ShardedParamEntry]] = {}
    for entry in entries.sharded:
        if _keep(entry.param, options):
            by_handle.setdefault(id(entry.handle), []).append(entry)
    values: dict[str, Any] = {}
    for unit in units:
        for handle in unit.handles:
            handle_entries = by_handle.get(id(handle))
            if not handle_entries:
                continue
            full_flat = full_views.gather_full_flat_param(handle)  # collective over the shard group
            if not keep and not any(entry.local_box for entry in handle_entries):
                continue
            for entry in handle_entries:
                info = entry.info
                view = param_view(full_flat, info)
                if entry.local_box is not None:  # the global tensor: collective over the tp mesh
                    view = full_tensor_of_local(entry, view)
                value = view.to("cpu", copy=True) if options.cpu_offload else view.clone()
                values.update((key, value) for key in entry.keys)
            del full_flat  # one unit's gathered copy at a time
    if keep:
        _add_replicated(values, entries, options, copy=True)
    return values


def _shard_view(cpu_offload: bool) -> Callable[[ShardedParamEntry], torch.Tensor]:
    def make_local(entry: ShardedParamEntry) -> torch.Tensor:
        local = entry.handle.local_shard_view(entry.info).detach()
        return local.cpu() if cpu_offload else local

    return make_local


def _sharded_values(
    entries: ModelEntries,
    options: StateDictOptions,
    *,
    make_local: Callable[[ShardedParamEntry], torch.Tensor],
    fresh: bool = False,
) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for entry in entries.sharded:
        if _keep(entry.param, options):
            value = sharded_tensor_of_range(make_local(entry), sharding_of(entry))
            values.update((key, value) for key in entry.keys)
    _add_replicated(values, entries, options, copy=False, fresh=fresh)
    return values


def _add_replicated(
    values: dict[str, Any], entries: ModelEntries, options: StateDictOptions, *, copy: bool, fresh: bool = False
) -> None:
    for key, param in entries.plain_params.items():
        if _keep(param, options):
            values[key] = _plain(param, options, copy=copy, fresh=fresh)
    for key, buffer in entries.buffers.items():
        dtype = entries.buffer_dtypes.get(key)
        if dtype is not None and not fresh:
            buffer = buffer.to(dtype)  # a copy in the original dtype
        values[key] = _plain(buffer, options, copy=copy and dtype is None, fresh=fresh)
    for key, owner in entries.extra_states.items():
        values[key] = owner.get_extra_state()


def empty_model_state_dict(entries: ModelEntries) -> dict[str, Any]:
    """A sharded model state dict with the structure of
    ``get_model_state_dict(module)`` but new, uninitialised storage: a
    destination to load a checkpoint into without touching the model."""

    def make_local(entry: ShardedParamEntry) -> torch.Tensor:
        return torch.empty_like(entry.handle.local_shard_view(entry.info))

    values = _sharded_values(entries, StateDictOptions(), make_local=make_local, fresh=True)
    return OrderedDict((key, values[key]) for key in entries.key_order if key in values)


def model_state_dict_views(entries: ModelEntries) -> dict[str, Any]:
    """``get_model_state_dict(module)`` for already named ``entries``: views
    of the shards, buffers and plain parameters themselves (a destination
    that DCP reads into in place)."""
    values = _sharded_values(entries, StateDictOptions(), make_local=_shard_view(False))
    return OrderedDict((key, values[key]) for key in entries.key_order if key in values)


# -------------------------------------------------------------------- set
def set_model_state_dict(
    module: nn.Module, state_dict: Mapping[str, Any], *, options: StateDictOptions | None = None
) -> _IncompatibleKeys:
    """Load a full or sharded model state dict into ``module``'s shards (each
    rank copies its own range; parameter objects are kept). Validates every
    key and shape before copying anything. Returns the missing and unexpected
    keys (with ``strict=True`` any of them raises ``StateDictError``).

    With ``broadcast_from_rank0=True`` (and ``full_state_dict=True``) only
    rank 0's ``state_dict`` is read and its tensors are broadcast one at a
    time (a collective); otherwise no collective runs.
    """
    name = type(module).__name__
    what = f"set_model_state_dict({name})"
    options = checked_options(options, "set_model_state_dict", name)
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{what}: expected a dict-like state dict, got {type(state_dict).__name__}.")
    units = prepare_units(module, "set_model_state_dict")
    entries = model_entries(module, units)
    if options.broadcast_from_rank0:
        return _set_broadcast(units, entries, state_dict, options, what)
    missing, unexpected = _check_keys(entries, state_dict.keys(), options, what)
    problems = _value_problems(entries, state_dict)
    if problems:
        raise StateDictError(value_mismatch_message(what, problems))
    _copy_in(entries, state_dict)
    return _IncompatibleKeys(missing, unexpected)


def _check_keys(
    entries: ModelEntries, given: Any, options: StateDictOptions, what: str
) -> tuple[list[str], list[str]]:
    given = list(given)
    given_set = set(given)
    known = set(entries.key_order)
    missing = [
        key
        for key in entries.key_order
        if key not in given_set and not (options.ignore_frozen_params and entries.is_frozen(key))
    ]
    unexpected = [key for key in given if key not in known]
    if options.strict and (missing or unexpected):
        raise StateDictError(key_mismatch_message(what, missing, unexpected))
    return missing, unexpected


def _value_problems(entries: ModelEntries, state_dict: Mapping[str, Any]) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for key in entries.key_order:
        if key not in state_dict or key in entries.extra_states:
            continue
        value = state_dict[key]
        entry = entries.sharded_by_key.get(key)
        if entry is not None:
            info = entry.info
            why = range_source_error(value, info.shape, info.local_start, info.local_numel, entry.local_box)
        else:
            expected = (entries.plain_params[key] if key in entries.plain_params else entries.buffers[key]).shape
            found = global_shape(value)
            why = None
            if found is None:
                why = f"expected a tensor, got {type(value).__name__}"
            elif found != expected:
                why = f"shape {tuple(found)} does not match the model's {tuple(expected)}"
        if why is not None:
            problems.append((key, why))
    return problems


def _copy_in(entries: ModelEntries, state_dict: Mapping[str, Any]) -> None:
    """Copy validated values into the shards, buffers and plain parameters.
    Of several aliases the last one present wins (as in nn.Module)."""
    with torch.no_grad():
        for entry in entries.sharded:
            present = [key for key in entry.keys if key in state_dict]
            if not present:
                continue
            info = entry.info
            source = read_range(state_dict[present[-1]], info.local_start, info.local_numel, entry.local_box)
            target = entry.handle.local_shard_view(info)
            if info.local_numel and source.data_ptr() != target.data_ptr():
                target.copy_(source)
        for tensors in (entries.plain_params, entries.buffers):
            for key, tensor in tensors.items():
                if key in state_dict:
                    _copy_whole(tensor, state_dict[key])
        for key, owner in entries.extra_states.items():
            if key in state_dict:
                owner.set_extra_state(state_dict[key])


def _copy_whole(target: torch.Tensor, value: Any) -> None:
    source = read_range(value, 0, target.numel()).view(target.shape)
    if target.numel() and source.data_ptr() != target.data_ptr():
        target.detach().copy_(source)


def _set_broadcast(
    units: list[UnitState], entries: ModelEntries, state_dict: Mapping[str, Any], options: StateDictOptions, what: str
) -> _IncompatibleKeys:
    """Rank 0 validates and broadcasts its verdict, then every tensor (one at
    a time, so no rank holds more than one full tensor besides rank 0)."""
    # (error, missing, unexpected, keys rank 0 holds, extra states)
    verdict: tuple[str | None, list[str], list[str], list[str], dict[str, Any]] = (None, [], [], [], {})
    if is_rank0():
        try:
            missing, unexpected = _check_keys(entries, state_dict.keys(), options, what)
            problems = _value_problems(entries, state_dict)
            error = value_mismatch_message(what, problems) if problems else None
            held = [key for key in entries.key_order if key in state_dict]
            extras = {key: state_dict[key] for key in entries.extra_states if key in state_dict}
            verdict = (error, missing, unexpected, held, extras)
        except StateDictError as exc:
            verdict = (str(exc), [], [], [], {})
    error, missing, unexpected, held, extras = comm.broadcast_object(verdict)
    if error is not None:
        raise StateDictError(error)
    present = set(held)
    device = units[0].compute_device if units else torch.device("cpu")
    with torch.no_grad():
        for entry in entries.sharded:
            keys = [key for key in entry.keys if key in present]
            if keys:
                info = entry.info
                box = entry.local_box
                shape = box.global_shape if box is not None else info.shape
                full = _broadcast_tensor(state_dict, keys[-1], shape, entry.param.dtype, device)
                if box is not None:
                    full = box.of_full(full)
                entry.handle.local_shard_view(info).copy_(local_part(full, info))
        for tensors in (entries.plain_params, entries.buffers):
            for key, tensor in tensors.items():
                if key in present:
                    tensor.detach().copy_(_broadcast_tensor(state_dict, key, tensor.shape, tensor.dtype, device))
    for key, owner in entries.extra_states.items():
        if key in extras:
            owner.set_extra_state(extras[key])
    return _IncompatibleKeys(missing, unexpected)


def _broadcast_tensor(
    state_dict: Mapping[str, Any], key: str, shape: torch.Size, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if is_rank0():
        tensor = read_range(state_dict[key], 0, shape.numel()).to(device=device, dtype=dtype).contiguous()
    else:
        tensor = torch.empty(shape.numel(), dtype=dtype, device=device)
    comm.broadcast(tensor.view(-1), 0, None)
    return tensor.view(shape)
