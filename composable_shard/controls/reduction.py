"""Owns: the public per-unit controls of the gradient reduction —
``set_requires_all_reduce``, ``set_gradient_divide_factor``,
``register_comm_hook``, ``set_all_reduce_hook`` — and the checks of their
arguments (an immediate error naming the module).

Knows nothing of: how the reduction runs (``comm`` reads the overrides
these set: comm/overrides.py), the step's lifecycle, the other runtime
controls (controls/per_unit.py).

Public names: ``set_requires_all_reduce``, ``set_gradient_divide_factor``,
``register_comm_hook``, ``set_all_reduce_hook``.

Each writes the unit's ``ReductionOverrides``; the reductions issued after
the call use them (so a call between micro-batches affects the next
backward). Combinations that cannot work are refused at the next backward,
naming the unit (``comm.check_overrides``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm_hooks import DefaultState, is_shipped_hook
from ..runtime.state import UnitState, units_of

__all__ = ["set_requires_all_reduce", "set_gradient_divide_factor", "register_comm_hook", "set_all_reduce_hook"]



def set_requires_all_reduce(module: nn.Module, requires: bool, *, recurse: bool = True) -> None:
    """Whether the next backwards all-reduce gradients across replicas
    (FSDP2's ``set_requires_all_reduce``).

    With ``False``, units with replicas (``HYBRID_SHARD``,
    ``HYBRID_SHARD_ZERO2``, and ``NO_SHARD`` over several ranks) still
    reduce-scatter over their shard group every backward, but keep the
    partial sum instead of all-reducing it; ``.grad`` is not updated. The
    next backward with ``True`` adds the kept sum and all-reduces once (the
    one all-reduce of the accumulated micro-batches), then ``.grad`` gets the
    mean of all of them. ``FULL_SHARD`` and ``SHARD_GRAD_OP`` have no
    replica all-reduce: no effect there, as on FSDP2's 1-D meshes. Set it
    the same on every rank. Applies to every unit under ``module``
    (``recurse=False``: ``module``'s own unit). See [Note: partial sums
    without the replica all-reduce] in comm/overrides.py.
    """
    if not isinstance(requires, bool):
        raise TypeError(f"set_requires_all_reduce({type(module).__name__}): requires must be a bool, got {requires!r}.")
    for unit in units_of(module, recurse=recurse, what="set_requires_all_reduce"):
        unit.reduction_overrides.requires_all_reduce = requires


def set_gradient_divide_factor(module: nn.Module, factor: float | None) -> None:
    """Divide ``module``'s unit's summed gradients by ``factor`` instead of
    the data-parallel world size (FSDP2's ``set_gradient_divide_factor``:
    this unit only; call it on each unit, as torchtitan does). ``1.0``
    gives the plain sum, for a loss already scaled over the ranks. In low
    precision the division is split around the sum as for the world size
    ([Note: dividing around the reduction] in comm/reduction.py). ``None``
    restores the world size.
    """
    name = type(module).__name__
    if factor is not None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"set_gradient_divide_factor({name}): factor must be a number, got {factor!r}.")
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(
                f"set_gradient_divide_factor({name}): factor must be finite and positive, got {factor!r} "
                "(1.0 sums the gradients; None restores the world size)."
            )
        factor = float(factor)
    for unit in units_of(module, recurse=False, what="set_gradient_divide_factor"):
        unit.reduction_overrides.divide_factor = factor


def register_comm_hook(module: nn.Module, state: Any, hook: Callable[..., Any]) -> None:
    """Replace the gradient reduction of every unit under ``module`` with
    ``hook`` (FSDP1's ``register_comm_hook`` contract).

    For each flat parameter the hook receives ``state`` and the padded
    unsharded flat gradient (the dtype backward computed it in) and writes
    this rank's mean shard: ``hook(state, grad, output)`` for sharded
    strategies (``output``: an empty tensor of the shard's size and the
    gradient's dtype), ``hook(state, grad)`` in place for ``NO_SHARD``. The
    reduction's dtype, division and collectives are the hook's:
    ``composable_shard.comm_hooks`` ships ``allreduce_hook``,
    ``reduce_scatter_hook``, ``fp16_compress_hook`` and
    ``bf16_compress_hook`` with their states. Hybrid strategies are refused
    (two groups; FSDP1 refuses them too); a divide factor,
    ``set_requires_all_reduce(False)``, an all-reduce hook or a
    mixed-precision ``reduce_dtype`` on the same unit raise at the next
    backward. A unit takes one hook. See [Note: communication hooks] in
    comm/overrides.py.

    ``state=None`` with a shipped hook means each unit's own group: every
    unit gets a ``DefaultState`` over the group it reduces over (its shard
    group; the replicate group under ``NO_SHARD``). A user's own hook gets
    ``state`` as given, ``None`` included. A shipped hook with a state that
    is not a ``DefaultState``, or ``None`` on a unit with no group to reduce
    over, is refused here, before any unit is changed.
    """
    name = type(module).__name__
    if not callable(hook):
        raise TypeError(f"register_comm_hook({name}): hook must be callable, got {type(hook).__name__}.")
    units = units_of(module, recurse=True, what="register_comm_hook")
    if is_shipped_hook(hook) and state is not None and not isinstance(state, DefaultState):
        raise TypeError(
            f"register_comm_hook({name}): {hook.__name__} reads a composable_shard.comm_hooks.DefaultState (its group "
            f"and divisions), got {type(state).__name__}. Pass DefaultState(process_group), or None for each unit's "
            "own group."
        )
    for unit in units:
        if unit.config.strategy.is_hybrid:
            raise ValueError(
                f"register_comm_hook({name}): unit '{unit.fqn}' uses {unit.config.strategy.name}, whose reduction runs "
                "over two groups; communication hooks take one (as in FSDP1). Use set_all_reduce_hook for the replica "
                "all-reduce, or shard with FULL_SHARD over the group the hook reduces over."
            )
        if unit.reduction_overrides.comm_hook is not None:
            raise ValueError(
                f"register_comm_hook({name}): unit '{unit.fqn}' already has a communication hook "
                f"({getattr(unit.reduction_overrides.comm_hook[1], '__name__', '?')}); register one per unit, once."
            )
    states = [_own_group_state(name, unit) if state is None and is_shipped_hook(hook) else state for unit in units]
    for unit, unit_state in zip(units, states):
        unit.reduction_overrides.comm_hook = (unit_state, hook)


def _own_group_state(name: str, unit: UnitState) -> DefaultState:
    """A shipped hook's state over the group ``unit`` reduces its gradient
    over (``register_comm_hook`` with ``state=None``)."""
    groups = unit.groups
    group = groups.shard_group if groups.shard_group is not None else groups.replicate_group
    if group is None and dist.get_world_size() > 1:
        raise ValueError(
            f"register_comm_hook({name}): unit '{unit.fqn}' has no group to reduce its gradient over (NO_SHARD "
            "over a single rank), so state=None names no group. Pass DefaultState(process_group) with the group "
            "the hook should reduce over."
        )
    return DefaultState(group)


def set_all_reduce_hook(
    module: nn.Module, hook: Callable[[torch.Tensor], None] | None, *, stream: Any = None
) -> None:
    """Run ``hook(reduce_output)`` on ``module``'s unit's gradient shard
    after its reduction (FSDP2's ``set_all_reduce_hook``): after the
    replica all-reduce under hybrid sharding, after the reduce-scatter
    otherwise (where the hook typically all-reduces over replicas the unit
    does not know of). It must work in place; the shard is the sum (before
    the division by the world size or divide factor), in the reduce dtype.
    Backwards that skip the replica all-reduce (``set_requires_all_reduce``)
    skip the hook too. ``stream`` (CUDA only; ignored on CPU) runs the hook
    in that stream; refused under hybrid sharding, as FSDP2 does. ``None``
    removes the hook.
    """
    name = type(module).__name__
    if hook is not None and not callable(hook):
        raise TypeError(f"set_all_reduce_hook({name}): hook must be callable or None, got {type(hook).__name__}.")
    units = units_of(module, recurse=False, what="set_all_reduce_hook")
    for unit in units:
        if stream is not None and unit.config.strategy.is_hybrid:
            raise ValueError(
                f"set_all_reduce_hook({name}): stream cannot be set when using native HSDP "
                f"({unit.config.strategy.name}): the hook runs where the replica all-reduce ran."
            )
        unit.reduction_overrides.all_reduce_hook = hook
        unit.reduction_overrides.all_reduce_hook_stream = stream if unit.compute_device.type == "cuda" else None
