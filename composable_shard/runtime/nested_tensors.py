"""Owns: the tensors inside arbitrary nested structures — finding those
that require grad in whatever a unit's forward returns (pre-backward hooks go
on them), and mapping a function over a unit's inputs (mixed-precision
casts).

Knows nothing of: units, hooks, flat parameters.

Public names: ``OutputScan``, ``scan_output``, ``map_tensors``.

[Note: hooking arbitrary outputs]
A unit's pre-backward hook must sit on every output tensor through which
backward can reach the unit; if none is found, backward would run the unit's
ops on parameters resharded after forward (freed storage: a crash deep in
autograd). ``torch.utils._pytree`` sees tuples, lists, dicts, namedtuples and
registered types (Hugging Face's ``ModelOutput`` registers itself), but a
plain dataclass or any other object is one leaf to it. So the scan walks,
besides tensors and pytree nodes, ``Mapping`` values, dataclass fields, sets
and the ``__dict__`` and ``__slots__`` of plain objects, bounded in objects
visited and depth, each object once (cycles). What it cannot look into
(objects with neither ``__dict__`` nor a known structure, generators,
anything past the bounds) is reported as opaque by type name. The runtime
decides what to do when nothing was found. Pinned by
test_scan_finds_tensors_in_arbitrary_structures_and_reports_opaque_ones and
test_every_output_structure_trains_in_parity (test_output_structures.py).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import types
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["OutputScan", "scan_output", "map_tensors"]

# Values that never hold a tensor.
_ATOMS = (
    type(None), bool, int, float, complex, str, bytes, bytearray,
    torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format,
    enum.Enum, slice, range, type, types.FunctionType, types.BuiltinFunctionType,
    types.MethodType, types.ModuleType,
)
# Bounds of one scan: a forward's output is small; past these, stop looking.
MAX_OBJECTS = 10_000
MAX_DEPTH = 32


@dataclasses.dataclass
class OutputScan:
    """What ``scan_output`` found."""

    # Tensors that require grad, each once.
    tensors: list[torch.Tensor]
    # Type names of the values the scan could not look into.
    opaque: list[str]


def scan_output(output: Any) -> OutputScan:
    """Every tensor requiring grad reachable in ``output`` (see
    [Note: hooking arbitrary outputs])."""
    if isinstance(output, torch.Tensor):  # the common case, without a walk
        return OutputScan([output] if output.requires_grad else [], [])
    tensors: list[torch.Tensor] = []
    opaque: list[str] = []
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(output, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, _ATOMS) or id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                tensors.append(value)
            continue
        children = _children(value) if depth < MAX_DEPTH and len(seen) <= MAX_OBJECTS else None
        if children is None:
            opaque.append(type(value).__qualname__)
            continue
        stack.extend((child, depth + 1) for child in children)
    return OutputScan(tensors, opaque)


def _children(value: Any) -> list[Any] | None:
    """The values directly inside ``value``; None when it cannot be looked into."""
    if isinstance(value, nn.Module):
        return []  # a module is not data; its parameters are not outputs
    if isinstance(value, Mapping):
        return list(value.values())
    if isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        return list(value)
    if dataclasses.is_dataclass(value):
        return [getattr(value, field.name, None) for field in dataclasses.fields(value)]
    leaves = tree_flatten(value)[0]
    if not (len(leaves) == 1 and leaves[0] is value):  # a registered pytree node
        return leaves
    attributes = getattr(value, "__dict__", None)
    slots = [name for cls in type(value).__mro__ for name in _slot_names(cls)]
    if not isinstance(attributes, dict) and not slots:
        return None
    children = list(attributes.values()) if isinstance(attributes, dict) else []
    return children + [getattr(value, name) for name in slots if hasattr(value, name)]


def _slot_names(cls: type) -> tuple[str, ...]:
    slots = cls.__dict__.get("__slots__", ())
    names = (slots,) if isinstance(slots, str) else tuple(slots)
    return tuple(name for name in names if name not in ("__dict__", "__weakref__"))


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any, *, depth: int = 0) -> Any:
    """``value`` with every tensor ``t`` replaced by ``fn(t)``: through
    pytree nodes (tuples, lists, dicts, namedtuples, registered types) and
    dataclass fields (a changed dataclass is rebuilt with
    ``dataclasses.replace``). Other objects are passed as they are: copying
    an arbitrary object to change one attribute is not ours to do."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, _ATOMS) or depth >= MAX_DEPTH:
        return value
    # (not a class: classes are atoms, returned above; the check narrows for the type checker)
    if dataclasses.is_dataclass(value) and not isinstance(value, (Mapping, type)):
        changes = {}
        for field in dataclasses.fields(value):
            if field.init and hasattr(value, field.name):
                old = getattr(value, field.name)
                new = map_tensors(fn, old, depth=depth + 1)
                if new is not old:
                    changes[field.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    leaves, spec = tree_flatten(value)
    if len(leaves) == 1 and leaves[0] is value:
        return value  # not a container we can rebuild
    mapped = [map_tensors(fn, leaf, depth=depth + 1) for leaf in leaves]
    if all(new is old for new, old in zip(mapped, leaves)):
        return value
    return tree_unflatten(mapped, spec)
