"""Owns: a unit's overrides of its gradient reduction — the divide factor,
whether the replica all-reduce runs, a communication hook that replaces the
reduction, an all-reduce hook after it — their snapshot into the settings
of one reduction, and the check of combinations that cannot work.

Knows nothing of: modules and units (callers name the unit in messages),
flat parameters, streams, the public functions that set the overrides
(``composable_shard.reduce_controls``).

Public names: ``ReductionOverrides``, ``settings_with``, ``check_overrides``.

[Note: communication hooks]
``register_comm_hook`` follows FSDP1's contract: the hook receives the
padded unsharded flat gradient of one flat parameter, in the dtype backward
computed it, and writes this rank's mean shard: ``hook(state, grad,
output)`` for a sharded unit (``output`` is an empty tensor of the shard's
size and the gradient's dtype), ``hook(state, grad)`` in place for an
unsharded one. It runs when the reduction is issued, synchronously (on CUDA
on the reduction lane's stream); the result is only cast to the gradient
dtype and accumulated. So the reduction's dtype, divide factor and
collectives are the hook's, and a unit with a hook refuses what would change
them behind its back: a divide factor, ``set_requires_all_reduce(False)``,
an all-reduce hook, a mixed-precision ``reduce_dtype`` other than the
compute dtype, hybrid sharding (two groups; FSDP1 refuses it too). A hook
that raises fails the backward with its own exception (a note names the
unit); the tree recovers at its next entry ([Note: a backward that raised]
in runtime/lifecycle.py). Pinned by tests/comm/test_comm_hooks.py.

[Note: partial sums without the replica all-reduce]
``set_requires_all_reduce(False)`` (FSDP2's meaning) keeps reducing over the
shard group every backward but skips the replica all-reduce: the shard's
pre-divided sum (reduce dtype) is added to a per-flat-parameter carry, and
nothing reaches ``.grad`` (so users' post-accumulate-grad hooks do not run). The next backward that all-reduces adds the carry
before its all-reduce (the one collective of the accumulated steps), then
post-divides and accumulates into ``.grad`` as usual. Only units with
replicas have an all-reduce to skip: HYBRID_SHARD, HYBRID_SHARD_ZERO2 and
NO_SHARD over several ranks (FSDP2's ``replicate``); FULL_SHARD and
SHARD_GRAD_OP ignore it, as FSDP2's 1-D meshes do. A backward that raised
drops the carry with the other local gradients. Pinned by
test_hybrid_all_reduces_once_per_unit_per_step
(tests/training/test_reduction_controls.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .reduction import GradReduceSettings

__all__ = ["ReductionOverrides", "settings_with", "check_overrides"]


@dataclass
class ReductionOverrides:
    """What the user set on one unit (shared by its flat parameters)."""

    requires_all_reduce: bool = True
    divide_factor: float | None = None
    comm_hook: tuple[Any, Callable[..., Any]] | None = None
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    all_reduce_hook_stream: Any = None


def settings_with(settings: GradReduceSettings, overrides: ReductionOverrides | None) -> GradReduceSettings:
    """``settings`` of one reduction with the unit's overrides applied (a
    snapshot: the reduction finishes with what it was issued with)."""
    if overrides is None or (
        # Nothing to change (the usual case, twice per reduction): the same
        # frozen settings, without building a copy.
        settings.all_reduce is overrides.requires_all_reduce
        and settings.divide_factor == overrides.divide_factor
        and settings.comm_hook is overrides.comm_hook
        and settings.all_reduce_hook is overrides.all_reduce_hook
        and settings.all_reduce_hook_stream is overrides.all_reduce_hook_stream
    ):
        return settings
    return dataclasses.replace(
        settings,
        divide_factor=overrides.divide_factor,
        all_reduce=overrides.requires_all_reduce,
        comm_hook=overrides.comm_hook,
        all_reduce_hook=overrides.all_reduce_hook,
        all_reduce_hook_stream=overrides.all_reduce_hook_stream,
    )


def check_overrides(settings: GradReduceSettings, compute_dtype: torch.dtype, unit: str) -> None:
    """Refuse a combination that cannot work, naming the unit (called
    before each reduction is issued, so every rank raises at the same
    point: the overrides are set on every rank)."""
    if settings.comm_hook is None:
        return
    clashes = []
    if settings.divide_factor is not None:
        clashes.append(f"set_gradient_divide_factor({settings.divide_factor})")
    if not settings.all_reduce:
        clashes.append("set_requires_all_reduce(False)")
    if settings.all_reduce_hook is not None:
        clashes.append("set_all_reduce_hook")
    if settings.reduce_dtype != compute_dtype:
        clashes.append(f"a mixed-precision reduce_dtype of {settings.reduce_dtype} (the compute dtype is {compute_dtype})")
    if settings.groups.is_sharded and settings.groups.replicate_world_size > 1:
        clashes.append("hybrid sharding")
    if clashes:
        raise ValueError(
            f"unit {unit}: its communication hook ({getattr(settings.comm_hook[1], '__name__', settings.comm_hook[1])}) "
            f"does the whole gradient reduction, which cannot combine with {', '.join(clashes)}. Remove the hook "
            "(there is no unregister: shard the model again) or undo the other setting; the hook owns the reduction's "
            "dtype, division and communication."
        )
