"""Owns: the plan's warnings — a unit large enough to set the peak alone,
padding worth avoiding, a parameter used by several units, many small
units worth grouping — and finding those shared parameters (before
sharding, from the unit choices; after, from the real layouts).

Knows nothing of: the memory arithmetic, the table.

Public names: ``plan_warnings``, ``shared_params``, ``shared_params_from_states``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch.nn as nn

from ..policy import SMALL_UNIT_GROUP_BYTES, is_small_unit
from ..runtime.state import UnitState
from .memory import UnitPlan

__all__ = ["plan_warnings", "shared_params", "shared_params_from_states"]

# A unit this many times the median unit sets the peak on its own.
_LARGE_UNIT_RATIO = 4.0
# Padding above this fraction of a unit's unsharded buffer is worth a warning.
_PADDING_WARN_FRACTION = 0.03
# This many small units (SmallUnitGroups' size of one) are worth grouping:
# 64 blocks of 200 KB ran 1.05-1.17x DDP's step alone, 0.93-1.04x grouped.
_SMALL_UNITS_ADVISED = 8


def _innermost_unit(module: nn.Module, unit_ids: set[int] | dict[int, str]) -> dict[int, str]:
    """Module id -> name of the innermost unit containing it. ``unit_ids``
    may map each unit's module to its unit's name (a group's modules share
    one name)."""
    result: dict[int, str] = {}

    def visit(current: nn.Module, prefix: str, unit_name: str) -> None:
        if id(current) in unit_ids:
            unit_name = unit_ids[id(current)] if isinstance(unit_ids, dict) else prefix.rstrip(".")
        result.setdefault(id(current), unit_name)
        for child_name, child in current._modules.items():
            if child is not None:
                visit(child, f"{prefix}{child_name}.", unit_name)

    visit(module, "", "")
    return result


def shared_params(
    module: nn.Module, unit_ids: set[int] | dict[int, str], sources: dict[int, list[Any]]
) -> list[tuple[str, list[str]]]:
    unit_of = _innermost_unit(module, unit_ids)
    found = []
    for unit_sources in sources.values():
        for source in unit_sources:
            users = sorted({unit_of[id(owner.module)] for owner in source.owners})
            if len(users) > 1:
                found.append((source.owners[0].fqn, users))
    return found


def shared_params_from_states(
    module: nn.Module, unit_ids: set[int] | dict[int, str], named: Sequence[tuple[str, UnitState]]
) -> list[tuple[str, list[str]]]:
    unit_of = _innermost_unit(module, unit_ids)
    found = []
    for _, state in named:
        for handle in state.handles:
            for info in handle.layout.params:
                users = sorted({unit_of.get(id(owner.module), "") for owner in info.owners})
                if len(users) > 1:
                    found.append((info.fqn, users))
    return found


def plan_warnings(units: list[UnitPlan], shared: list[tuple[str, list[str]]]) -> list[str]:
    messages = []
    sizes = sorted(unit.padded_numel for unit in units)
    if len(units) >= 3:
        median = sizes[len(sizes) // 2]
        for unit in units:
            if median and unit.padded_numel > _LARGE_UNIT_RATIO * median:
                messages.append(
                    f"unit '{unit.name or '<root>'}' has {unit.numel:,} parameters, "
                    f"{unit.padded_numel / median:.1f}x the median unit: gathered whole, it sets the peak. "
                    "Split it into more units (a policy on its submodules)."
                )
    for unit in units:
        if unit.padded_numel and unit.padding / unit.padded_numel > _PADDING_WARN_FRACTION:
            messages.append(
                f"unit '{unit.name or '<root>'}': {unit.padding:,} of {unit.padded_numel:,} unsharded elements "
                f"({100 * unit.padding / unit.padded_numel:.1f}%) are padding; fewer ranks or larger units waste less."
            )
    small = [
        unit for unit in units
        if unit.name and unit.flat_params and is_small_unit(sum(fp.numel * fp.dtype.itemsize for fp in unit.flat_params))
    ]
    if len(small) >= _SMALL_UNITS_ADVISED:
        messages.append(
            f"{len(small)} units hold at most {SMALL_UNIT_GROUP_BYTES // 4 // 1024} KiB of parameters each "
            f"('{small[0].name}', ...): each pays the runtime's per-unit cost every step (hooks, views, its "
            "gradient's reduction and optimizer step). policy=SmallUnitGroups(<the policy>) makes each run of "
            "adjacent small units one unit (docs/api.md, Policies)."
        )
    for fqn, users in shared:
        messages.append(
            f"parameter '{fqn}' is used by units {users}; it is owned by their common unit, gathered for "
            "that unit's whole forward and backward."
        )
    return messages
