"""Owns: ``full_shape`` — the original shape of a parameter of a unit,
whatever it shows now (a 1-D piece between steps).

Knows nothing of: collectives, hooks, optimizers.
"""

from __future__ import annotations

import torch

from ..runtime.lifecycle import live_units

__all__ = ["full_shape"]


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape ``param`` had before ``fully_shard`` (a parameter outside
    every unit: its own shape), so parameters can be chosen by shape after
    sharding: ``[p for p in model.parameters() if len(full_shape(p)) == 2]``.
    """
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"full_shape: expected a parameter (torch.Tensor), got {type(param).__name__}.")
    for unit in live_units():
        for handle in unit.handles:
            for info, spec, orig in zip(handle.layout.params, handle.tp_specs, handle.orig_params):
                if orig is param:
                    # A tensor-parallel parameter's shape is its DTensor's (global) shape.
                    return spec.global_shape if spec is not None else info.shape
    return param.shape
