"""Owns: the switch that lets a memory recorder sample at every runtime hook
— off by default (one check of a module global per hook), on while
``composable_shard.MemoryRecorder.record()`` runs — and what the
runtime owns at that moment (its shards, gathered buffers and sharded
gradients, over the unit's whole tree).

Knows nothing of: what a sample is made of or where it goes (the sampler
given to ``set_sampler`` decides), the plan.

Public names: ``set_sampler``, ``after_hook``, ``runtime_tensor_bytes``.
"""

from __future__ import annotations

from typing import Callable

import torch

from .state import UnitState

__all__ = ["set_sampler", "after_hook", "runtime_tensor_bytes"]

Sampler = Callable[[UnitState, str], None]
_sampler: Sampler | None = None


def set_sampler(sampler: Sampler | None) -> Sampler | None:
    """Install ``sampler`` (None: switch sampling off); returns the one it replaces."""
    global _sampler
    previous, _sampler = _sampler, sampler
    return previous


def after_hook(state: UnitState, hook: str) -> None:
    """Called by every hook once it ran (``labels.hook_label``)."""
    sampler = _sampler
    if sampler is not None and not torch.compiler.is_compiling():
        sampler(state, hook)


def runtime_tensor_bytes(state: UnitState) -> int:
    """Storage bytes of the shards, the allocated unsharded buffers and the
    sharded gradients of every unit in ``state``'s tree (each storage once)."""
    seen: dict[tuple[int, int], int] = {}

    def add(tensor: torch.Tensor | None) -> None:
        if tensor is not None:
            # A DTensor's gradient (tensor parallelism) lives in its local tensor.
            tensor = getattr(tensor, "_local_tensor", tensor)
            storage = tensor.untyped_storage()
            if storage.nbytes():
                seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()

    units = state.context.units if state.root_context is not None else [state]
    for unit in units:
        for handle in unit.handles:
            add(handle.sharded_flat_param)
            if handle.unsharded_storage_bytes():
                add(handle.unsharded_flat_param)
            for param in handle.orig_params:
                add(param.grad)
    return sum(seen.values())
