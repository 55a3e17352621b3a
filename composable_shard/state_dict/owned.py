"""Owns: the state of optimizers that step whole parameters on owner ranks
(composable_shard/optim/) in optimizer state dicts — each such parameter's
state as one process holds it: whole tensors, on its owner only.

Knows nothing of: files, the step's exchange (it asks ``optim`` who owns
what).

[Note: owned optimizer state]
An optimizer that is not elementwise keeps a parameter's state where it
stepped it: on the parameter's owner, shaped as its update rule made it
(Muon's momentum like the parameter, Adafactor's row and column factors,
a preconditioner's square matrices). A sharded state dict holds those as
plain tensors on the owner and nothing on the other ranks, so DCP saves each
once (replicas' owners hold equal copies, which DCP deduplicates) and any
rank that owns the parameter after a change of world size reads the whole
tensor. A full state dict gathers them to every rank (or rank 0). Loading
keeps a parameter's state on its current owner and drops it elsewhere.
Pinned by tests/optim/test_owned_state.py.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import comm
from ..optim.owner_step import owner_plans
from ..runtime.lifecycle import live_units
from ..runtime.optimizer_checks import flattens_parameters, is_elementwise

__all__ = ["owned_by", "gather_owned_state"]


def owned_by(optimizer: torch.optim.Optimizer) -> dict[int, bool]:
    """For each parameter of ``optimizer`` stepped by an owner: whether this
    rank is its owner (by ``id`` of the parameter). Empty for an elementwise
    optimizer."""
    if is_elementwise(optimizer) or flattens_parameters(optimizer):
        return {}
    return {
        id(owned.param): owned.owner == plan.rank
        for plan in owner_plans(optimizer, live_units())
        for owned in plan.params
    }


def gather_owned_state(
    state_of_mine: dict[str, dict[str, Any]], *, device: torch.device | None
) -> dict[str, dict[str, Any]]:
    """Every owner's ``{name: state}`` on every rank (one object all-gather;
    tensors on ``device``, or on the CPU where it is None); replicas' equal
    copies collapse to one."""
    local = {
        fqn: {key: value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
              for key, value in values.items()}
        for fqn, values in state_of_mine.items()
    }
    merged: dict[str, dict[str, Any]] = {}
    for rank_state in comm.all_gather_object(local):
        for fqn, values in rank_state.items():
            merged.setdefault(fqn, values)
    if device is None:
        return merged
    return {
        fqn: {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in values.items()}
        for fqn, values in merged.items()
    }
