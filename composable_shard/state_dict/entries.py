"""Owns: what a sharded model's state dict is made of, before any value —
the keys every parameter, persistent buffer and extra state goes by
(``ModelEntries``, ``ShardedParamEntry``, ``model_entries``; tied aliases and
shared-module paths included), each sharded parameter's ranges on every rank
(``sharding_of``), and the units made ready to be read or written
(``prepare_units``: idle, resharded, user edits written back).

Knows nothing of: state-dict values and their checks (``model``, ``optim``,
``checks``), optimizers, files.

[Note: checkpoint-wrapper prefixes]
torch's ``checkpoint_wrapper`` (activation checkpointing) puts the wrapped
module under ``_checkpoint_wrapped_module``; its own state-dict hooks take
that segment out of the keys and put it back on load, and torch's
``get_model_state_dict`` names parameters without it, so a checkpoint does
not depend on where activation checkpointing was applied. Keys here drop
it too (``state_dict_key``), and the module hooks (hooks.py) look for both
forms, since the wrapper's hooks run before or after theirs depending on
which module wraps which. Before: ``module.state_dict()`` gave the 1-D
shards of parameters under a wrapper and ``set_model_state_dict`` refused
a plain model's keys (FSDP1's test_fsdp_state_dict_with_activation_checkpoint).
Pinned by tests/state_dict/test_model.py
(test_state_dicts_under_checkpoint_wrappers_have_the_plain_models_keys).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from ..handle.layout import ParamInfo
from ..handle import FlatParamHandle
from ..handle.dtensor_views import full_dtensor
from ..runtime import enter_between_steps
from ..runtime.state import UnitState, unit_states_under
from ..controls.unshard_params import is_inside_unshard_params
from .shards import LocalBox, RangeSharding, range_sharding

__all__ = [
    "ModelEntries",
    "ShardedParamEntry",
    "model_entries",
    "prepare_units",
    "is_shown_unsharded",
    "sharding_of",
    "full_tensor_of_local",
    "state_dict_key",
]

# The segment torch's checkpoint_wrapper puts the wrapped module under.
_WRAPPER_SEGMENT = "_checkpoint_wrapped_module."


def state_dict_key(name: str) -> str:
    """``name`` (a module path and attribute) as state dicts give it, without
    checkpoint wrappers' segments ([Note: checkpoint-wrapper prefixes])."""
    return name.replace(_WRAPPER_SEGMENT, "") if _WRAPPER_SEGMENT in name else name


@dataclass(frozen=True, eq=False)
class ShardedParamEntry:
    """One parameter a unit owns, and every key it goes by."""

    handle: FlatParamHandle
    info: ParamInfo
    param: nn.Parameter
    # Every key naming it, in state-dict order; keys[0] is its canonical name
    # (the one ``named_parameters()`` yields).
    keys: tuple[str, ...]
    # A DTensor parameter: where its local tensor lies in the global one
    # ([Note: tensor-parallel boxes] in shards.py); None for a plain one.
    local_box: LocalBox | None = None


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
        prefix = state_dict_key(f"{module_name}.") if module_name else ""
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
        for member in unit.members:
            for prefix in prefixes_of.get(id(member), []):
                for name, dtype in unit.buffer_dtypes_of(member).items():
                    if prefix + name in entries.buffers:
                        entries.buffer_dtypes[prefix + name] = dtype
        for handle in unit.handles:
            for info, param, spec in zip(handle.layout.params, handle.orig_params, handle.tp_specs):
                keys = keys_of.get(id(param))
                if keys:  # a parameter registered outside ``module`` is not its to name
                    box = LocalBox(spec.global_shape, spec.local_offsets(), spec.local_shape) if spec else None
                    entry = ShardedParamEntry(handle, info, param, tuple(keys), box)
                    entries.sharded.append(entry)
                    entries.sharded_by_key.update((key, entry) for key in keys)
    return entries


def is_shown_unsharded(handle: FlatParamHandle) -> bool:
    """Whether the parameters show full tensors now (forward views, or inside
    ``unshard_params``, whose registry of shown handles lives in controls/unshard_params.py)."""
    return handle.shows_unsharded_views or is_inside_unshard_params(handle)


def prepare_units(module: nn.Module, what: str) -> list[UnitState]:
    """The units under ``module``, past the lifecycle's gate (between steps,
    no longer held for a backward: runtime/lifecycle.py), and with user
    edits of ``.data`` written back into the shards (so the shards are the
    truth)."""
    units = [state for _, state in unit_states_under(module)]
    name = type(module).__name__
    enter_between_steps(units, f"{what}({name})")
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


# Process group -> its global ranks. Keyed by the group itself, weakly: an
# id() key could name a new group after the old one is destroyed, and a
# strong key would keep destroyed groups alive.
_GROUP_RANKS: weakref.WeakKeyDictionary[dist.ProcessGroup, list[int]] = weakref.WeakKeyDictionary()


def sharding_of(entry: ShardedParamEntry) -> RangeSharding:
    """Every rank's range of one sharded parameter, from the layout alone."""
    groups = entry.handle.groups
    rank = dist.get_rank()
    if groups.shard_group is None:
        ranks = [rank]
    else:
        known = _GROUP_RANKS.get(groups.shard_group)
        if known is None:
            known = _GROUP_RANKS[groups.shard_group] = dist.get_process_group_ranks(groups.shard_group)
        ranks = known
    return range_sharding(entry.info, entry.handle.layout, ranks, rank, entry.local_box)


def full_tensor_of_local(entry: ShardedParamEntry, local: torch.Tensor) -> torch.Tensor:
    """The global tensor of a DTensor parameter (or of a per-element state
    of it) from this rank's whole local tensor ``local``: a collective over
    its tensor-parallel mesh."""
    handle = entry.handle
    spec = handle.tp_specs[handle.layout.params.index(entry.info)]
    if spec is None:
        return local
    return full_dtensor(local, spec).full_tensor()
