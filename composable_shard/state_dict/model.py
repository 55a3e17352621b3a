"""Owns: model state dicts of a sharded tree — ``get_model_state_dict`` /
``set_model_state_dict`` (full or sharded, in the form of
``torch.distributed.checkpoint.state_dict``) and the names every parameter,
buffer and extra state goes by.

Knows nothing of: hooks of the training step, streams, optimizers (see
``optim``), files (see ``checkpoint``); ``module.state_dict()`` /
``load_state_dict()`` go through ``hooks``.

Public names: ``get_model_state_dict``, ``set_model_state_dict``,
``StateDictOptions`` (PyTorch's), ``StateDictError``, ``ModelEntries``,
``ShardedParamEntry``, ``model_entries``, ``prepare_units``, ``is_shown_unsharded``,
``sharding_of``, ``empty_model_state_dict``, ``model_state_dict_views``, ``key_mismatch_message``,
``value_mismatch_message``, ``checked_options``, ``is_rank0`` (the helpers
for the optimizer and checkpoint modules).

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
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.nn.modules.module import _IncompatibleKeys

from .. import comm
from ..flat_layout import ParamInfo
from ..flat_param import FlatParamHandle
from ..runtime import in_backward, reshard_held_units
from ..unshard import is_inside_unshard_params
from ..state import BETWEEN_STEPS, UnitState, unit_states_under
from .shards import (
    RangeSharding,
    global_shape,
    range_sharding,
    range_source_error,
    read_range,
    sharded_tensor_of_range,
)

__all__ = [
    "get_model_state_dict",
    "set_model_state_dict",
    "StateDictOptions",
    "StateDictError",
    "ModelEntries",
    "ShardedParamEntry",
    "model_entries",
    "prepare_units",
    "is_shown_unsharded",
    "sharding_of",
    "empty_model_state_dict",
    "model_state_dict_views",
    "checked_options",
    "is_rank0",
    "key_mismatch_message",
    "value_mismatch_message",
]

logger = logging.getLogger(__name__)

# How many offending names an error message lists before "and N more".
_NAMES_SHOWN = 5


class StateDictError(RuntimeError, ValueError):
    """A state dict (or checkpoint) does not fit the model or optimizer.

    Both a ``RuntimeError`` (what ``nn.Module.load_state_dict`` raises) and a
    ``ValueError`` (a bad argument). Raised before anything is changed."""


# ------------------------------------------------------------------ names
@dataclass(frozen=True, eq=False)
class ShardedParamEntry:
    """One parameter a unit owns, and every key it goes by."""

    handle: FlatParamHandle
    info: ParamInfo
    param: nn.Parameter
    # Every key naming it, in state-dict order; keys[0] is its canonical name
    # (the one ``named_parameters()`` yields).
    keys: tuple[str, ...]


@dataclass
class ModelEntries:
    """What a model's state dict holds, by key, in ``nn.Module.state_dict``
    order."""

    # Sharded parameters in unit, handle and layout order (collective order).
    sharded: list[ShardedParamEntry] = field(default_factory=list)
    # Parameters no unit owns (ignored states): whole on every rank.
    plain_params: dict[str, nn.Parameter] = field(default_factory=dict)
    # Persistent buffers (never sharded).
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    # Modules with their own get_extra_state, by their "_extra_state" key.
    extra_states: dict[str, nn.Module] = field(default_factory=dict)
    # Every key, in nn.Module.state_dict order.
    key_order: list[str] = field(default_factory=list)
    # Key -> sharded entry (every alias).
    sharded_by_key: dict[str, ShardedParamEntry] = field(default_factory=dict)
    # Buffers cast to a mixed-precision buffer_dtype -> their original dtype
    # (state dicts hold the original dtype).
    buffer_dtypes: dict[str, torch.dtype] = field(default_factory=dict)

    def is_frozen(self, key: str) -> bool:
        entry = self.sharded_by_key.get(key)
        param = entry.param if entry is not None else self.plain_params.get(key)
        return param is not None and not param.requires_grad


def model_entries(module: nn.Module, units: list[UnitState]) -> ModelEntries:
    """Name everything ``module``'s state dict holds. Parameters owned by the
    ``units`` are sharded entries; the rest are plain."""
    owned: dict[int, tuple[FlatParamHandle, ParamInfo, nn.Parameter]] = {}
    for unit in units:
        for handle in unit.handles:
            for info, param in zip(handle.layout.params, handle.orig_params):
                owned[id(param)] = (handle, info, param)
    entries = ModelEntries()
    keys_of: dict[int, list[str]] = {}
    prefixes_of: dict[int, list[str]] = {}
    for module_name, submodule in module.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        prefixes_of.setdefault(id(submodule), []).append(prefix)
        for attr, param in submodule._parameters.items():
            if param is None:
                continue
            key = prefix + attr
            entries.key_order.append(key)
            if id(param) in owned:
                keys_of.setdefault(id(param), []).append(key)
            else:
                entries.plain_params[key] = param
        for attr, buffer in submodule._buffers.items():
            if buffer is not None and attr not in submodule._non_persistent_buffers_set:
                entries.key_order.append(prefix + attr)
                entries.buffers[prefix + attr] = buffer
        if type(submodule).get_extra_state is not nn.Module.get_extra_state:
            entries.key_order.append(prefix + "_extra_state")
            entries.extra_states[prefix + "_extra_state"] = submodule
    for unit in units:
        for prefix in prefixes_of.get(id(unit.module), []):
            for name, dtype in unit.orig_buffer_dtypes.items():
                if prefix + name in entries.buffers:
                    entries.buffer_dtypes[prefix + name] = dtype
        for handle in unit.handles:
            for info, param in zip(handle.layout.params, handle.orig_params):
                keys = keys_of.get(id(param))
                if keys:  # a parameter registered outside ``module`` is not its to name
                    entry = ShardedParamEntry(handle, info, param, tuple(keys))
                    entries.sharded.append(entry)
                    entries.sharded_by_key.update((key, entry) for key in keys)
    return entries


def is_shown_unsharded(handle: FlatParamHandle) -> bool:
    """Whether the parameters show full tensors now (forward views, or inside
    ``unshard_params``, whose registry of shown handles lives in unshard.py)."""
    return handle.shows_unsharded_views or is_inside_unshard_params(handle)


def prepare_units(module: nn.Module, what: str) -> list[UnitState]:
    """The units under ``module``, checked idle, no longer held for a
    backward (see [Note: held for backward] in runtime.py), and with user
    edits of ``.data`` written back into the shards (so the shards are the
    truth)."""
    units = [state for _, state in unit_states_under(module)]
    name = type(module).__name__
    busy = [unit.fqn for unit in units if unit.training_state not in BETWEEN_STEPS]
    if busy or (units and in_backward()):
        raise RuntimeError(
            f"{what}({name}): called inside forward or backward (unit '{busy[0] if busy else units[0].fqn}'). "
            "Call it between training steps."
        )
    reshard_held_units(units)
    shown = [unit.fqn for unit in units for handle in unit.handles if is_shown_unsharded(handle)]
    if shown:
        raise RuntimeError(
            f"{what}({name}): called inside unshard_params (unit '{shown[0]}' shows full parameters). "
            "Call it outside the unshard_params context."
        )
    for unit in units:
        for handle in unit.handles:
            handle.writeback_orig_params(name_prefix=unit.name_prefix)
    return units


_GROUP_RANKS: dict[int, list[int]] = {}


def sharding_of(entry: ShardedParamEntry) -> RangeSharding:
    """Every rank's range of one sharded parameter, from the layout alone."""
    groups = entry.handle.groups
    rank = dist.get_rank()
    if groups.shard_group is None:
        ranks = [rank]
    else:
        key = id(groups.shard_group)
        if key not in _GROUP_RANKS:
            _GROUP_RANKS[key] = dist.get_process_group_ranks(groups.shard_group)
        ranks = _GROUP_RANKS[key]
    return range_sharding(entry.info, entry.handle.layout, ranks, rank)


def checked_options(options: StateDictOptions | None, what: str, name: str) -> StateDictOptions:
    options = options if options is not None else StateDictOptions()
    if not isinstance(options, StateDictOptions):
        raise TypeError(
            f"{what}({name}): options must be a torch.distributed.checkpoint.state_dict.StateDictOptions, "
            f"got {type(options).__name__}."
        )
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError(
            f"{what}({name}): broadcast_from_rank0=True needs full_state_dict=True (rank 0 holds a full state "
            "dict). Set both."
        )
    if options.flatten_optimizer_state_dict:
        raise ValueError(
            f"{what}({name}): flatten_optimizer_state_dict=True is not supported. Use the nested optimizer "
            "state dict format (the default)."
        )
    return options


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _names(keys: list[str]) -> str:
    shown = ", ".join(f"'{key}'" for key in keys[:_NAMES_SHOWN])
    return shown + (f" (and {len(keys) - _NAMES_SHOWN} more)" if len(keys) > _NAMES_SHOWN else "")


def key_mismatch_message(what: str, missing: list[str], unexpected: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"Missing key(s) in state_dict: {_names(missing)}.")
    if unexpected:
        parts.append(f"Unexpected key(s) in state_dict: {_names(unexpected)}.")
    hint = (
        " Load a state dict saved from this model, or pass StateDictOptions(strict=False) to load only the keys "
        "both have. Nothing was loaded."
    )
    return f"{what}: the state dict does not match the model. " + " ".join(parts) + hint


def value_mismatch_message(what: str, problems: list[tuple[str, str]]) -> str:
    listed = "; ".join(f"'{key}': {why}" for key, why in problems[:_NAMES_SHOWN])
    more = f" (and {len(problems) - _NAMES_SHOWN} more)" if len(problems) > _NAMES_SHOWN else ""
    return (
        f"{what}: the state dict does not fit the model: {listed}{more}. Load a state dict saved from a model "
        "of the same configuration. Nothing was loaded."
    )


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
            full_flat = handle.gather_full_flat_param()  # collective over the shard group
            if not keep:
                continue
            for entry in handle_entries:
                info = entry.info
                view = full_flat[info.offset : info.offset + info.numel].view(info.shape)
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
            why = range_source_error(value, info.shape, info.local_start, info.local_numel)
        else:
            expected = (entries.plain_params.get(key) if key in entries.plain_params else entries.buffers[key]).shape
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
            source = read_range(state_dict[present[-1]], info.local_start, info.local_numel)
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
                full = _broadcast_tensor(state_dict, keys[-1], info.shape, entry.param.dtype, device)
                local = full.reshape(-1)[info.local_start : info.local_start + info.local_numel]
                entry.handle.local_shard_view(info).copy_(local)
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
