"""Owns: what a checkpoint directory's DCP metadata says it holds, checked
against a model and optimizer before anything is read, and the parts of the
destination that must be the model's and optimizer's own memory — views of
the shards (in place) or new buffers shaped like them, and the optimizer's
per-element state as RangeShardedTensors.

Knows nothing of: files and checksums, how a checkpoint is written; the
rest of a destination (objects, small tensors) is filled from the metadata
by ``planners.DestinationLoadPlanner``.

A checkpoint of ``save_checkpoint`` is the nested state dict ``{"model":
..., "optim": ..., "extra": ...}``; DCP stores it flattened, and its metadata
maps every flat key back to its path with either the tensor's size and dtype
or "an object". So a checkpoint of another model is refused here, before a
byte of tensor data is read. Pinned by tests/checkpoint/test_resharding.py.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..state_dict.checks import StateDictError, key_mismatch_message, value_mismatch_message
from ..state_dict.entries import ModelEntries, ShardedParamEntry, sharding_of
from ..state_dict.model import empty_model_state_dict, model_state_dict_views
from ..state_dict.optim import is_param_shaped, optimizer_params
from ..state_dict.owned import owned_by
from ..state_dict.range_tensor import RangeShardedTensor
from ..state_dict.shards import LEGACY_SCALAR_SHAPE, is_legacy_scalar, sharded_tensor_of_range, with_shape
from .planners import saved_path_of

__all__ = ["SavedPaths", "saved_paths", "model_destination", "optim_destination", "optim_key", "MODEL", "OPTIM", "EXTRA"]

MODEL, OPTIM, EXTRA = "model", "optim", "extra"


def optim_key(index: int) -> str:
    """Where the ``index``-th optimizer of ``save_checkpoint(...,
    optimizer=[a, b])`` is saved: ``"optim"`` for the first (so one optimizer
    alone is saved as before), ``"optim1"``, ``"optim2"``... after it."""
    return OPTIM if index == 0 else f"{OPTIM}{index}"

# Flat DCP key -> (path in the nested state dict, storage metadata).
SavedPaths = dict[str, tuple[tuple[Any, ...], Any]]


def saved_paths(metadata: Metadata) -> SavedPaths:
    return {key: (saved_path_of(metadata, key), md) for key, md in metadata.state_dict_metadata.items()}


def model_destination(entries: ModelEntries, saved: SavedPaths, strict: bool, what: str, *, in_place: bool) -> dict[str, Any]:
    """The model part of a destination, holding only the keys the checkpoint
    has: views of the model's own shards and buffers with ``in_place``, else
    new buffers shaped like them; extra states are left to the load planner.
    Raises ``StateDictError`` before anything is read if the checkpoint does
    not fit."""
    # Key -> storage metadata (None for an object saved as a nested structure).
    stored = {
        path[1]: md if len(path) == 2 else None for path, md in saved.values() if len(path) >= 2 and path[0] == MODEL
    }
    if not stored:
        raise StateDictError(
            f"{what}: the checkpoint holds no model state (no '{MODEL}.*' keys). Save it with save_checkpoint, "
            "or load it with torch.distributed.checkpoint.load directly."
        )
    known = set(entries.key_order)
    missing = [key for key in entries.key_order if key not in stored]
    unexpected = [key for key in stored if key not in known]
    if strict and (missing or unexpected):
        raise StateDictError(key_mismatch_message(what, missing, unexpected))
    destination = model_state_dict_views(entries) if in_place else empty_model_state_dict(entries)
    problems = []
    for key in list(destination):
        if key not in stored:
            del destination[key]
            continue
        md, value = stored[key], destination[key]
        if key in entries.extra_states:
            del destination[key]  # whatever structure was saved: DestinationLoadPlanner fills it
            continue
        entry = entries.sharded_by_key.get(key)
        expected = entry.info.shape if entry is not None else value.shape
        if not isinstance(md, TensorStorageMetadata):
            problems.append((key, "the checkpoint holds an object, not a tensor"))
        elif entry is not None and md.size != expected and md.size in (entry.info.shape, LEGACY_SCALAR_SHAPE):
            # A 0-dim parameter in the other of its two stored shapes (see [Note:
            # sharded state dict representation]): the same elements, viewed so.
            destination[key] = _reshaped(value, entry, md.size)
        elif md.size != expected:
            problems.append((key, f"shape {tuple(md.size)} does not match the model's {tuple(expected)}"))
    if problems:
        raise StateDictError(value_mismatch_message(what, problems))
    return destination


def optim_destination(
    entries: ModelEntries,
    optimizer: torch.optim.Optimizer,
    saved: SavedPaths,
    strict: bool,
    what: str,
    *,
    in_place: bool,
    key: str = OPTIM,
) -> dict[str, Any]:
    """The optimizer part of a destination (saved under ``key``; see
    ``optim_key``): ``{"state": {name: {key:
    value}}}`` with per-element state as RangeShardedTensors over this
    rank's range — the optimizer's own state tensor where it has one of that
    size and dtype and ``in_place`` is set, else a new buffer (which becomes
    the optimizer's state when loaded). The rest (``step``, hyperparameters)
    is left to the load planner, for the parameters listed here."""
    params = {op.fqn: op for op in optimizer_params(optimizer, entries, what)}
    if not any(path[0] == key for path, _ in saved.values()):
        which = "optimizer state" if key == OPTIM else f"state for optimizer {key[len(OPTIM):]} of the list"
        raise StateDictError(f"{what}: the checkpoint holds no {which}. Load it without that optimizer.")
    saved_state: dict[str, dict[str, Any]] = {}
    for path, md in saved.values():
        if len(path) >= 3 and path[:2] == (key, "state"):
            values = saved_state.setdefault(path[2], {})
            if len(path) == 4:
                values[path[3]] = md
    unexpected = [fqn for fqn in saved_state if fqn not in params]
    if unexpected and strict:
        raise StateDictError(key_mismatch_message(what, [], unexpected))
    state: dict[str, dict[str, Any]] = {}  # strict=False: state of parameters this optimizer does not hold is left out
    problems = []
    owned = owned_by(optimizer)
    for fqn in [fqn for fqn in saved_state if fqn in params]:
        if owned.get(id(params[fqn].param)) is False:
            continue  # another rank owns it ([Note: owned optimizer state])
        op, state[fqn] = params[fqn], {}
        if op.entry is None or id(op.param) in owned:
            continue  # read whole
        info = op.entry.info
        for key, md in saved_state[fqn].items():
            if not isinstance(md, TensorStorageMetadata):
                continue
            probe = torch.empty(md.size, dtype=md.properties.dtype, device="meta")
            if not is_param_shaped(key, probe, info.shape):
                continue  # not per-element: read it whole
            # A 0-dim parameter's state may be stored as () or (1,) (see [Note: sharded state dict representation]).
            if md.size != info.shape and not is_legacy_scalar(info.shape, md.size):
                problems.append((f"{fqn}.{key}", f"shape {tuple(md.size)} does not match the parameter's {tuple(info.shape)}"))
                continue
            existing = (optimizer.state.get(op.param) or {}).get(key)
            if in_place and _fits(existing, info.local_numel, md.properties.dtype, op.param.device):
                local = existing.detach()
            else:
                local = torch.empty(info.local_numel, dtype=md.properties.dtype, device=op.param.device)
            state[fqn][key] = sharded_tensor_of_range(local, with_shape(sharding_of(op.entry), md.size))
    if problems:
        raise StateDictError(value_mismatch_message(what, problems))
    return {"state": state}


def _reshaped(value: Any, entry: ShardedParamEntry, shape: torch.Size) -> Any:
    """A 0-dim parameter's destination ``value`` (sharded, or a new full
    tensor) stored with ``shape`` instead."""
    if isinstance(value, RangeShardedTensor):
        return sharded_tensor_of_range(value.local, with_shape(sharding_of(entry), shape))
    # A full tensor: read the one element whole.
    return torch.empty(shape, dtype=value.dtype, device=entry.param.device)


def _fits(value: Any, numel: int, dtype: torch.dtype, device: torch.device) -> TypeGuard[torch.Tensor]:
    return (
        isinstance(value, torch.Tensor)
        and value.shape == (numel,)
        and value.dtype == dtype
        and value.device == device
        and value.is_contiguous()
    )
