"""Owns: getting a unit's parameters ready to flatten — materialising a
module built on the meta device, moving a CPU-built unit to the compute
device, and making every rank start from rank 0's parameters and buffers.

Knows nothing of: flat parameters, hooks.

Public names: ``materialize_unit``, ``sync_unit_states``.

Each step works one unit at a time, so the whole unsharded model never has to
exist on one rank.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch
import torch.nn as nn

from . import comm
from .flat_param import FlatParamSource

__all__ = ["materialize_unit", "sync_unit_states"]


def _unit_modules(unit: nn.Module, skip: Callable[[nn.Module], bool]) -> Iterator[nn.Module]:
    """The unit's module and its descendants, not entering nested units."""
    yield unit
    for child in unit.children():
        if not skip(child):
            yield from _unit_modules(child, skip)


def _own_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from (p for p in module._parameters.values() if p is not None)
    yield from (b for b in module._buffers.values() if b is not None)


def materialize_unit(
    unit: nn.Module,
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None,
    skip: Callable[[nn.Module], bool],
) -> None:
    """Give meta tensors real storage on ``device`` and initialise them
    (``param_init_fn(module)``, else ``module.reset_parameters()``); move
    tensors on another device to ``device``. Parameter objects are kept."""
    for module in _unit_modules(unit, skip):
        tensors = list(_own_tensors(module))
        if any(t.is_meta for t in tensors):
            module.to_empty(device=device, recurse=False)
            if param_init_fn is not None:
                param_init_fn(module)
            elif callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
            elif module._parameters:
                raise ValueError(
                    f"fully_shard: module {type(module).__name__} was built on the meta device but has no "
                    "reset_parameters(); pass param_init_fn to initialise it."
                )
        elif any(t.device != device for t in tensors):
            module._apply(lambda t: t.to(device), recurse=False)


def sync_unit_states(
    unit: nn.Module,
    sources: Sequence[FlatParamSource],
    skip: Callable[[nn.Module], bool],
) -> None:
    """Overwrite the unit's parameters and buffers with global rank 0's
    (every rank of the default group)."""
    with torch.no_grad():
        for source in sources:
            comm.broadcast(source.param.data, 0, None)
        for module in _unit_modules(unit, skip):
            for buffer in module._buffers.values():
                if buffer is not None:
                    comm.broadcast(buffer, 0, None)
