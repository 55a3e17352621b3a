"""Owns: the per-unit descriptions a plan is assembled from — a
``UnitPlan`` for each unit, from the layouts ``plan`` computes or from the
handles ``fully_shard`` built — and the model facts they need (module order,
parameter positions, buffers).

Knows nothing of: hooks, collectives, storage, the step replay (``step_replay.py``),
how units are chosen (``units/rules.py``).

Public names: ``param_positions``, ``default_device_type``,
``flat_param_plan``, ``new_unit_plan``, ``unit_plan``,
``unit_plan_from_state``, ``replan_existing``, ``renamed``,
``module_order``, ``subtree_last``, ``preorder_index``,
``buffer_bytes``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from ..comm import transport
from ..handle.layout import FlatParamLayout, compute_layout
from ..runtime.state import UnitState
from ..units.rules import flat_param_dtypes, offloads_params
from .arguments import shard_group
from .memory import FlatParamPlan, UnitPlan

__all__ = [
    "param_positions",
    "default_device_type",
    "flat_param_plan",
    "new_unit_plan",
    "unit_plan",
    "unit_plan_from_state",
    "replan_existing",
    "renamed",
    "module_order",
    "subtree_last",
    "preorder_index",
    "buffer_bytes",
]


def param_positions(module: nn.Module) -> dict[int, int]:
    """Parameter id -> position in ``module.parameters()``: the order of an
    optimizer built from it, which decides owners."""
    return {id(param): index for index, param in enumerate(module.parameters())}


def default_device_type(module: nn.Module) -> str:
    for param in module.parameters():
        if param.device.type != "meta":
            return param.device.type
    return "cuda"


def flat_param_plan(
    layout: FlatParamLayout,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    keep_low_precision_grads: bool,
    offload: bool,
    module_index: dict[int, int],
    reduction_frees_grad: bool,
    device_type: str,
    param_positions: tuple[int, ...] = (),
) -> FlatParamPlan:
    """What ``FlatParamHandle`` allocates for ``layout`` (see its
    constructor, ``reduce_grad`` and ``finish_grad_reduction``).
    ``reduction_frees_grad``: the group's collectives go through shared
    memory; on CPU otherwise through gloo's messages."""
    compute = param_dtype or layout.dtype
    reduce = reduce_dtype or compute
    is_sharded = layout.shard_world_size > 1
    local = [info.local_numel for info in layout.params if info.local_numel]
    return FlatParamPlan(
        dtype=layout.dtype,
        requires_grad=layout.requires_grad,
        numel=layout.total_param_numel,
        padded_numel=layout.padded_unsharded_numel,
        shard_numel=layout.shard_numel,
        local_numel=sum(local),
        local_param_count=len(local),
        max_local_numel=max(local, default=0),
        param_dtype=compute,
        reduce_dtype=reduce,
        grad_dtype=reduce if keep_low_precision_grads else layout.dtype,
        needs_unshard_storage=is_sharded or compute != layout.dtype or offload,
        offload=offload,
        is_sharded=is_sharded,
        param_count=len(layout.params),
        tied_use_numel=sum(len(info.owners) * info.numel for info in layout.params if len(info.owners) > 1),
        reduction_frees_grad=reduction_frees_grad,
        all_gather_copies_output=(
            device_type == "cpu" and not reduction_frees_grad and transport.backend_copies_gathered_output(None)
        ),
        last_uses=tuple(
            (max(module_index.get(id(owner.module), 0) for owner in info.owners), info.numel) for info in layout.params
        ),
        layout=layout,
        param_positions=param_positions,
    )


def new_unit_plan(
    modules: tuple[nn.Module, ...],
    kwargs: dict[str, Any],
    layouts: list[FlatParamLayout],
    compute_device: torch.device,
    order: dict[int, int],
    positions: list[tuple[int, ...]],
) -> UnitPlan:
    """A unit of ``modules`` (a group's, or one) that ``fully_shard`` would
    build from these layouts (dtypes and offload as
    ``fully_shard._build_unit`` decides them); ``positions``: of each
    layout's parameters in the root's ``parameters()``."""
    offload = offloads_params(kwargs["cpu_offload"], compute_device)
    flat_params = []
    for layout, layout_positions in zip(layouts, positions):
        dtypes = flat_param_dtypes(layout.dtype, kwargs["mixed_precision"])
        flat_params.append(
            flat_param_plan(
                layout, dtypes.param_dtype, dtypes.reduce_dtype, dtypes.keep_low_precision_grads, offload, order,
                transport.uses_shared_memory(None, compute_device.type),
                compute_device.type, layout_positions,
            )
        )
    return unit_plan(modules, kwargs, flat_params)


def unit_plan(modules: tuple[nn.Module, ...], kwargs: dict[str, Any], flat_params: list[FlatParamPlan]) -> UnitPlan:
    return UnitPlan(
        name="",
        module_type="+".join(type(module).__name__ for module in modules),
        strategy=kwargs["strategy"],
        flat_params=tuple(flat_params),
        forward_prefetch=kwargs["forward_prefetch"],
        backward_prefetch=kwargs["backward_prefetch"],
    )


def unit_plan_from_state(name: str, state: UnitState, flat_params: list[FlatParamPlan]) -> UnitPlan:
    return UnitPlan(
        name=name,
        module_type="+".join(type(member).__name__ for member in state.members),
        strategy=state.config.strategy,
        flat_params=tuple(flat_params),
        forward_prefetch=state.config.forward_prefetch,
        backward_prefetch=state.config.backward_prefetch,
    )


def replan_existing(
    name: str, state: UnitState, world: int, rank: int, hybrid_size: int, order: dict[int, int],
    positions: dict[int, int],
) -> UnitPlan:
    shard_size, shard_rank = shard_group(name, state.config.strategy, world, rank, hybrid_size)
    flat_params = []
    for handle in state.handles:
        old = handle.layout
        layout = compute_layout(
            [(info.shape, info.owners) for info in old.params],
            dtype=old.dtype,
            requires_grad=old.requires_grad,
            shard_rank=shard_rank,
            shard_world_size=shard_size,
        )
        reduce = handle.reduce_dtype if handle.reduce_dtype != handle.param_dtype else None
        flat_params.append(
            flat_param_plan(
                layout, handle.param_dtype, reduce, handle.keep_low_precision_grads, handle.offload_params, order,
                transport.uses_shared_memory(None, state.compute_device.type),
                state.compute_device.type, tuple(positions.get(id(p), -1) for p in handle.orig_params),
            )
        )
    return unit_plan_from_state("", state, flat_params)


def renamed(unit: UnitPlan, name: str, subtree_last: int) -> UnitPlan:
    return dataclasses.replace(unit, name=name, subtree_last=subtree_last)


def module_order(module: nn.Module) -> dict[int, int]:
    """Module id -> pre-order index: the forward order the plan assumes when
    it decides which gradients exist before a unit's backward."""
    return {id(m): index for index, m in enumerate(module.modules())}


def subtree_last(members: tuple[nn.Module, ...], order: dict[int, int]) -> int:
    """The last module (in ``order``) under any of a unit's modules."""
    return max(order.get(id(m), 0) for member in members for m in member.modules())


def preorder_index(module: nn.Module, name: str) -> int:
    name = name.split("+")[0]  # a group: where its first module is
    for index, (candidate, _) in enumerate(module.named_modules()):
        if candidate == name:
            return index
    return -1



def buffer_bytes(module: nn.Module, buffer_dtype: torch.dtype | None) -> int:
    """Module buffers: never sharded, every rank holds them whole (floating
    ones in the mixed-precision ``buffer_dtype``)."""
    total = 0
    for buffer in module.buffers():
        dtype = buffer_dtype if buffer_dtype is not None and buffer.is_floating_point() else buffer.dtype
        total += buffer.numel() * dtype.itemsize
    return total
