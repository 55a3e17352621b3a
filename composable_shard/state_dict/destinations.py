"""Owns: what a checkpoint directory's DCP metadata says it holds, checked
against a model and optimizer before anything is read, and the destination
state dicts ``torch.distributed.checkpoint.load`` reads into — the model's
shards and the optimizer's state tensors themselves (in place), or new
buffers.

Knows nothing of: files and checksums (files.py), how a checkpoint is
written (checkpoint.py), flat parameters.

Public names: ``SavedPaths``, ``saved_paths``, ``model_destination``,
``optim_destination``, ``template``, ``objects_tree``, ``fill_objects``,
``MODEL``, ``OPTIM``, ``EXTRA``.

A checkpoint of ``save_checkpoint`` is the nested state dict ``{"model":
..., "optim": ..., "extra": ...}``; DCP stores it flattened, and its metadata
maps every flat key back to its path (``planner_data``) with either the
tensor's size and dtype or "an object". Everything here is built from that
metadata alone, so a checkpoint of another model is refused before a byte
of tensor data is read, and a destination holds exactly the keys the
checkpoint has (DCP's load refuses keys it lacks).

Objects (optimizer hyperparameters, extra states, the extra dict) are small
and can be read first into a tree of their own (``objects_tree``), so that
the optimizer state dict is validated as a whole before any tensor is read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from .checks import StateDictError, key_mismatch_message, value_mismatch_message
from .entries import ModelEntries, ShardedParamEntry, sharding_of
from .model import empty_model_state_dict, model_state_dict_views
from .optim import is_param_shaped, optimizer_params
from .range_tensor import RangeShardedTensor
from .shards import LEGACY_SCALAR_SHAPE, is_legacy_scalar, sharded_tensor_of_range, stored_shape, with_shape

__all__ = [
    "SavedPaths",
    "saved_paths",
    "model_destination",
    "optim_destination",
    "template",
    "objects_tree",
    "fill_objects",
    "MODEL",
    "OPTIM",
    "EXTRA",
]

MODEL, OPTIM, EXTRA = "model", "optim", "extra"

# Flat DCP key -> (path in the nested state dict, storage metadata).
SavedPaths = dict[str, tuple[tuple[Any, ...], Any]]


def saved_paths(metadata: Metadata) -> SavedPaths:
    mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return {key: (tuple(mappings.get(key, (key,))), md) for key, md in metadata.state_dict_metadata.items()}


def model_destination(entries: ModelEntries, saved: SavedPaths, strict: bool, what: str, *, in_place: bool) -> dict[str, Any]:
    """The model part of a destination, holding only the keys the checkpoint
    has: views of the model's own shards and buffers with ``in_place``, else
    new buffers shaped like them. Raises ``StateDictError`` before anything
    is read if the checkpoint does not fit."""
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
            # Whatever structure was saved (DCP flattens nested objects).
            destination[key] = template(saved, MODEL, only={key})[key]  # type: ignore[index]  # key is stored
            continue
        entry = entries.sharded_by_key.get(key)
        expected = stored_shape(entry.info.shape) if entry is not None else value.shape
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
) -> dict[str, Any]:
    """The optimizer part of a destination, built from the checkpoint's
    metadata: per-element state as RangeShardedTensors over this rank's
    range — the optimizer's own state tensor where it has one of that size
    and dtype and ``in_place`` is set, else a new buffer (which becomes the
    optimizer's state when loaded: ``set_optimizer_state_dict`` keeps a
    buffer that is a whole storage). Other tensors (``step``) are new small
    CPU tensors; objects are None placeholders."""
    params = {op.fqn: op for op in optimizer_params(optimizer, entries, what)}
    shape_tree = _tree(saved, OPTIM)
    if shape_tree is None:
        raise StateDictError(f"{what}: the checkpoint holds no optimizer state. Load it without the optimizer.")
    state = shape_tree.get("state", {})
    unexpected = [fqn for fqn in state if fqn not in params]
    if unexpected and strict:
        raise StateDictError(key_mismatch_message(what, [], unexpected))
    for fqn in unexpected:
        del state[fqn]  # strict=False: state of parameters this optimizer does not hold
    problems = []
    for fqn, values in state.items():
        op = params[fqn]
        if op.entry is None or not isinstance(values, dict):
            continue
        info = op.entry.info
        for key, md in values.items():
            if not isinstance(md, TensorStorageMetadata):
                continue
            probe = torch.empty(md.size, dtype=md.properties.dtype, device="meta")
            if not is_param_shaped(key, probe, info.shape):
                continue  # not per-element: read it whole
            # A 0-dim parameter's state may be stored as () or (1,) (see [Note: sharded state dict representation]).
            shape = md.size if md.size in (info.shape, stored_shape(info.shape)) or is_legacy_scalar(info.shape, md.size) else None
            if shape is None:
                why = f"shape {tuple(md.size)} does not match the parameter's {tuple(info.shape)}"
                problems.append((f"{fqn}.{key}", why))
                continue
            existing = (optimizer.state.get(op.param) or {}).get(key)
            if in_place and _fits(existing, info.local_numel, md.properties.dtype, op.param.device):
                local = existing.detach()
            else:
                local = torch.empty(info.local_numel, dtype=md.properties.dtype, device=op.param.device)
            values[key] = sharded_tensor_of_range(local, with_shape(sharding_of(op.entry), shape))
    if problems:
        raise StateDictError(value_mismatch_message(what, problems))
    return _materialize(shape_tree)


def _reshaped(value: Any, entry: ShardedParamEntry, shape: torch.Size) -> Any:
    """A 0-dim parameter's destination ``value`` (sharded, or a new full
    tensor) stored with ``shape`` instead."""
    if isinstance(value, RangeShardedTensor):
        return sharded_tensor_of_range(value.local, with_shape(sharding_of(entry), shape))
    # A full tensor, or the ShardedTensor fallback (which cannot hold shape ()): read the one element whole.
    return torch.empty(shape, dtype=value.dtype, device=entry.param.device)


def _fits(value: Any, numel: int, dtype: torch.dtype, device: torch.device) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.shape == (numel,)
        and value.dtype == dtype
        and value.device == device
        and value.is_contiguous()
    )


def template(saved: SavedPaths, root: str, *, only: set[str] | None = None) -> Any:
    """The nested structure saved under ``root`` (only the keys ``only``
    below it, if given), as a destination: new full-size CPU tensors and None
    for objects. None if nothing was saved under it."""
    tree = _tree(saved, root, only=only)
    return None if tree is None else _materialize(tree)


def _tree(saved: SavedPaths, root: str, *, only: set[str] | None = None) -> Any:
    """The nested structure saved under ``root`` with the storage metadata at
    its leaves (dicts keyed 0..n-1 become lists); None if nothing is."""
    items = [
        (path[1:], md)
        for path, md in saved.values()
        if len(path) > 1 and path[0] == root and (only is None or path[1] in only)
    ]
    if not items:
        return None
    tree: dict[Any, Any] = {}
    for path, md in items:
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = md
    return _lists(tree)


def _materialize(node: Any) -> Any:
    """Replace metadata leaves: tensors by new CPU tensors, objects by None
    (already built values stay)."""
    if isinstance(node, dict):
        return {key: _materialize(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_materialize(value) for value in node]
    if isinstance(node, BytesStorageMetadata):
        return None
    if isinstance(node, TensorStorageMetadata):
        return torch.empty(node.size, dtype=node.properties.dtype)
    return node


def _lists(node: Any) -> Any:
    """Dicts keyed 0..n-1 (list indices in DCP paths) back into lists."""
    if not isinstance(node, dict):
        return node
    node = {key: _lists(value) for key, value in node.items()}
    if node and all(isinstance(key, int) for key in node) and sorted(node) == list(range(len(node))):
        return [node[index] for index in range(len(node))]
    return node


def objects_tree(saved: SavedPaths, root: str) -> Any:
    """Only the objects saved under ``root`` (None placeholders, in the
    saved structure), or None if there are none: a destination DCP fills
    without reading any tensor."""
    objects = {key: item for key, item in saved.items() if isinstance(item[1], BytesStorageMetadata)}
    tree = _tree(objects, root)
    return None if tree is None else _materialize(tree)


def fill_objects(node: Any, objects: Any) -> None:
    """Copy the objects read into ``objects_tree`` into the same places of
    ``node`` (a destination of the same checkpoint), in place."""
    if not isinstance(objects, (dict, list)):
        return
    keys = objects.keys() if isinstance(objects, dict) else range(len(objects))
    for key in keys:
        value = objects[key]
        if isinstance(node[key], (dict, list)):  # structure; a read object may itself be a list or tuple
            fill_objects(node[key], value)
        else:
            node[key] = value
