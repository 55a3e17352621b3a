"""Owns: the sharding plan — per unit layout and per rank memory, computed
before a run (``plan``, no process group, meta-device models welcome) or read
from a sharded model (``describe``), and its printed table.

Knows nothing of: hooks, collectives, storage (it reads layouts, and the
memory arithmetic lives in ``memory.py``).

Public names: ``plan``, ``describe``, ``ShardingPlan``.

[Note: plan and fully_shard share one copy of the rules]
``plan`` chooses units, owners and flat-parameter groups with ``units/rules.py``
and lays each flat parameter out with ``flat_layout.compute_layout``: the
functions ``fully_shard`` calls (see [Note: one copy of the unit rules]).
``describe`` reads the layouts ``fully_shard`` built. Both feed the same
``_assemble``, so ``plan(model, ...) == describe(sharded model)`` whenever the
arguments match. An optimizer stepped whole on owner ranks gets its owners
from ``optim/owners.py``'s functions on those same layouts ([Note:
owner-stepped optimizers, planned] in owner_memory.py). Pinned by
tests/plan/test_plan.py, which compares both with what the allocator holds.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from ..comm import transport
from ..comm_hooks import reduce_dtype_of_unit
from ..api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from ..handle.layout import FlatParamLayout, compute_layout
from ..handle.dtensor_views import local_tensor
from .activations import ActivationProfile, measure_activations
from .memory import (
    FlatParamPlan,
    StepPeak,
    UnitPlan,
    freed_allocation_sizes,
    gloo_buffer_sizes,
    in_backward_step_bytes,
    optimizer_bytes,
    optimizer_step_bytes,
    step_moments,
    worst_moment,
)
from .owner_memory import OwnerOptimizer, owner_state_bytes, owner_step_bytes
from .arguments import check_optimizer, checked_rank, optimizer_kind, optimizer_label, shard_group
from .table import format_plan
from .advice import plan_warnings, shared_params, shared_params_from_states
from .runtime_memory import RuntimeMemory, runtime_memory
from .transport_memory import transport_bytes
from ..policy import Policy
from ..runtime.state import UnitState, get_state, unit_states_under
from ..units.rules import (
    choose_units,
    flat_param_dtypes,
    group_sources,
    offloads_params,
    assign_param_owners,
    split_ignored,
    unit_kwargs,
)

__all__ = ["plan", "describe", "ShardingPlan"]

@dataclass
class ShardingPlan:
    """What each unit and each rank holds. ``units`` in module pre-order
    (root first); ``rank_bytes`` for rank ``rank``:

    - ``params``, ``grads``, ``optimizer``: the sharded model state after an
      optimizer step (exactly what ``fully_shard`` and ``torch.optim``
      allocate); ``model_state`` their sum; ``optimizer_by_kind`` splits the
      optimizer state; ``buffers``: module buffers (not sharded);
    - ``unsharded_params``, ``unsharded_grads``, ``comm``,
      ``optimizer_step``: alive at the step's worst moment (``peak_moment``),
      when ``grads_at_peak`` of the sharded gradients exist;
    - ``activations``: measured under fake tensors, alive at that moment;
      ``activations_peak`` their own peak over the step (0 without an input);
    - ``transport``: the shared memory this rank's collectives keep in
      ``/dev/shm`` for the whole run (0 where they go through the backend;
      see ``transport_memory.py``);
    - ``runtime``: what the rank holds beyond tensors (libraries' code,
      the pages glibc keeps, Python objects): a model of the allocator
      given the step's allocation sizes, 0 on CUDA (runtime_memory.py;
      its parts in ``runtime``);
    - ``total``: the peak — params + optimizer + buffers + transport +
      runtime + grads_at_peak + the moment's transients and activations;
    - ``cpu``: the part of ``total`` kept on the CPU by ``CPUOffload``.

    ``optimizer_in_backward``: planned for an optimizer stepped in the
    parameters' post-accumulate-grad hooks (no sharded gradient after a
    step). ``moments``: every moment of the replayed step in order (the
    peak is the worst); ``timeline()`` and ``plot(path)`` show them.
    ``runtime``: the parts of ``rank_bytes["runtime"]``.
    """

    world_size: int
    rank: int
    optimizer: str
    units: list[UnitPlan]
    rank_bytes: dict[str, int]
    optimizer_by_kind: dict[str, int]
    peak_moment: str
    warnings: list[str] = field(default_factory=list)
    # "plan" (computed before sharding) or "fully_shard" (read from a model).
    source: str = "plan"
    optimizer_in_backward: bool = False
    moments: list[StepPeak] = field(default_factory=list, repr=False)
    runtime: RuntimeMemory = field(default_factory=RuntimeMemory, repr=False)

    def __str__(self) -> str:
        return format_plan(self)

    def timeline(self) -> Any:
        """This rank's memory over one step, moment by moment and by
        category (a ``MemoryTimeline``; see ``planning/timeline.py``)."""
        from .timeline import plan_timeline

        return plan_timeline(self)

    def plot(self, path: str, *, measured: Any = None, title: str | None = None) -> None:
        """Draw ``timeline()`` as a stacked area per category, unit names
        along the time axis, the peak marked, and ``measured`` (a
        ``MemoryRecord`` of a real step) over it; needs matplotlib
        (``pip install composable_shard[plot]``)."""
        from .plot import plot_timeline

        plot_timeline(self.timeline(), path, measured=measured, title=title)


def plan(
    module: nn.Module,
    *,
    world_size: int,
    policy: Policy | set[type[nn.Module]] | None = None,
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    mixed_precision: MixedPrecision | None = None,
    cpu_offload: CPUOffload | None = None,
    ignored_states: Iterable[nn.Module | nn.Parameter] | None = None,
    optimizer: str | tuple[str, int] = "adamw",
    **more: Any,
) -> ShardingPlan:
    """Plan ``fully_shard(module, policy=..., ...)`` on ``world_size`` ranks
    without a process group and without allocating parameters.

    ``more``: ``rank`` (0: the rank with the most parameter elements),
    ``forward_prefetch``, ``backward_prefetch``, ``limit_all_gathers`` as for
    ``fully_shard``; ``device`` the compute device type (default: where the
    parameters are, ``"cuda"`` for a meta model); ``hybrid_shard_size`` ranks
    per shard group under hybrid strategies (default ``LOCAL_WORLD_SIZE`` or
    ``world_size``); ``example_inputs`` (tuple) or ``input_shape`` (+
    ``input_dtype``, default ``torch.long``) and ``loss_fn`` to measure
    activations; ``momentum`` (0.9; 0 means SGD keeps no state);
    ``optimizer_in_backward=True`` for a per-parameter ``optimizer`` stepped
    (and its ``.grad`` set to None) in each parameter's post-accumulate-grad
    hook; ``warn=True`` to also emit the plan's warnings.

    ``optimizer``: ``"adamw"``, ``"adam"``, ``"sgd"`` step each rank's
    shards; ``"muon"``, ``"adafactor"`` and ``("owner", k)`` are stepped on
    whole parameters by owner ranks ([Note: owner computes] in
    optim/owner_step.py), with the runtime's owners: ``"muon"`` is
    ``torch.optim.Muon`` over the 2-D parameters (one momentum buffer each)
    and AdamW over the rest, ``"adafactor"`` is ``torch.optim.Adafactor``
    over all (row and column factors for a matrix, a variance for a vector,
    a step), ``("owner", k)`` a user's own optimizer keeping ``k`` tensors
    shaped like each parameter (its step temporaries are not planned). Their
    state is whole on the owner, and the step's transients include the
    whole values and gradients the owner assembles and the exchange's
    buffers ([Note: owner-stepped optimizers, planned] in
    planning/owner_memory.py).
    """
    name = type(module).__name__
    rank = checked_rank(name, world_size, optimizer, more)
    device_type = more.get("device") or _device_type(module)
    ignored_modules, ignored_params = split_ignored(name, ignored_states)
    base = dict(
        strategy=strategy,
        mixed_precision=mixed_precision,
        cpu_offload=cpu_offload,
        forward_prefetch=more.get("forward_prefetch", False),
        backward_prefetch=more.get("backward_prefetch", BackwardPrefetch.BACKWARD_PRE),
        limit_all_gathers=more.get("limit_all_gathers", True),
        process_group=None,
        device_mesh=None,
    )
    if get_state(module) is not None:
        raise ValueError(f"plan({name}): this module is already sharded; use composable_shard.describe(module).")
    # [Note: plan and fully_shard share one copy of the rules]
    positions = _param_positions(module)
    choices = choose_units(module, policy, ignored_modules)
    sources = assign_param_owners(module, choices, ignored_modules, ignored_params)
    hybrid_size = more.get("hybrid_shard_size") or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    compute_device = torch.device(device_type)
    order = _module_order(module)
    module_of = {id(m): m for m in module.modules()}
    specs: dict[int, UnitPlan] = {}
    for choice in choices:
        kwargs = unit_kwargs(name, base, choice)
        shard_size, shard_rank = shard_group(name, kwargs["strategy"], world_size, rank, hybrid_size)
        layouts = [
            compute_layout(
                [(local_tensor(src.param).shape, src.owners) for src in flat_sources],  # DTensor: its local tensor
                dtype=flat_sources[0].param.dtype,
                requires_grad=flat_sources[0].param.requires_grad,
                shard_rank=shard_rank,
                shard_world_size=shard_size,
            )
            for flat_sources in group_sources(sources[id(choice.module)])
        ]
        unit_positions = [
            tuple(positions.get(id(src.param), -1) for src in flat_sources)
            for flat_sources in group_sources(sources[id(choice.module)])
        ]
        specs[id(choice.module)] = _new_unit_plan(choice.module, kwargs, layouts, compute_device, order, unit_positions)
    # Units marked by earlier manual fully_shard calls keep their own layout
    # rules: recompute them at this world size.
    members_of: dict[int, tuple[nn.Module, ...]] = {key: (module_of[key],) for key in specs}
    names = {id(m): n for n, m in module.named_modules()}
    for unit_name, state in unit_states_under(module):
        specs[id(state.module)] = _replan_existing(name, state, world_size, rank, hybrid_size, order, positions)
        members_of[id(state.module)] = state.members
        names[id(state.module)] = unit_name  # a group: "norm+output"
    units = sorted(
        (_renamed(spec, names[key], _subtree_last(members_of[key], order)) for key, spec in specs.items()),
        key=lambda u: _preorder_index(module, u.name),
    )
    unit_names = {key: names[key] for key in specs}
    activations = _activations(name, module, unit_names, mixed_precision, more, device_type)
    shared = shared_params(module, {id(m) for m in _unit_modules(module, specs)}, sources)
    kind = optimizer_kind(optimizer, more.get("momentum", 0.9))
    buffer_dtype = mixed_precision.buffer_dtype if mixed_precision is not None else None
    buffers = _buffer_bytes(module, buffer_dtype)
    shared_memory = transport.uses_shared_memory(None, device_type)
    result = _assemble(
        units, world_size, rank, kind, device_type, activations, shared, buffers, shared_memory, source="plan",
        in_backward=bool(more.get("optimizer_in_backward", False)),
    )
    result.optimizer = optimizer_label(optimizer)
    if more.get("warn", False):
        for message in result.warnings:
            warnings.warn(message, stacklevel=2)
    return result


def describe(
    module: nn.Module,
    *,
    optimizer: str | tuple[str, int] = "adamw",
    momentum: float = 0.9,
    optimizer_in_backward: bool = False,
) -> ShardingPlan:
    """The plan of a model ``fully_shard`` already sharded, read from its
    real layouts, on this rank (same table and numbers as ``plan``; no
    activations). ``optimizer`` as for ``plan``; ``momentum`` matters for
    ``optimizer="sgd"`` only; ``optimizer_in_backward`` as for ``plan``."""
    name = type(module).__name__
    check_optimizer(name, optimizer, optimizer_in_backward, "describe")
    positions = _param_positions(module)
    named = list(unit_states_under(module))
    if not named:
        raise ValueError(f"describe({name}): no fully_shard unit in this module. Call fully_shard first, or use plan().")
    units = []
    device_type = "cpu"
    shared_memory = False
    order = _module_order(module)
    for unit_name, state in named:
        shared_memory |= any(
            h.groups.is_sharded and transport.uses_shared_memory(h.groups.shard_group, state.compute_device.type)
            for h in state.handles
        )
        flat_params = [
            _flat_param_plan(
                # requires_grad as the flat parameter has it now, not as
                # fully_shard grouped it ([Note: changes to original
                # parameters] in handle/writeback.py).
                dataclasses.replace(h.layout, requires_grad=h.requires_grad),
                h.param_dtype, reduce_dtype_of_unit(state) or h.reduce_dtype, h.keep_low_precision_grads,
                h.offload_params, order, transport.uses_shared_memory(h.groups.shard_group, state.compute_device.type),
                state.compute_device.type, tuple(positions.get(id(p), -1) for p in h.orig_params),
            )
            for h in state.handles
        ]
        unit = _unit_plan_from_state(unit_name, state, flat_params)
        units.append(dataclasses.replace(unit, subtree_last=_subtree_last(state.members, order)))
        device_type = state.compute_device.type
    world = named[0][1].groups.data_parallel_world_size
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    unit_of_member = {id(member): unit_name for unit_name, state in named for member in state.members}
    shared = shared_params_from_states(module, unit_of_member, named)
    kind = optimizer_kind(optimizer, momentum)
    buffers = _buffer_bytes(module, None)  # already cast by fully_shard
    result = _assemble(
        units, world, rank, kind, device_type, None, shared, buffers, shared_memory, source="fully_shard",
        in_backward=optimizer_in_backward,
    )
    result.optimizer = optimizer_label(optimizer)
    return result


# ---------------------------------------------------------------- helpers
def _param_positions(module: nn.Module) -> dict[int, int]:
    """Parameter id -> position in ``module.parameters()``: the order of an
    optimizer built from it, which decides owners."""
    return {id(param): index for index, param in enumerate(module.parameters())}


def _device_type(module: nn.Module) -> str:
    for param in module.parameters():
        if param.device.type != "meta":
            return param.device.type
    return "cuda"


def _flat_param_plan(
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
        all_gather_copies_output=device_type == "cpu" and not reduction_frees_grad,
        last_uses=tuple(
            (max(module_index.get(id(owner.module), 0) for owner in info.owners), info.numel) for info in layout.params
        ),
        layout=layout,
        param_positions=param_positions,
    )


def _new_unit_plan(
    module: nn.Module,
    kwargs: dict[str, Any],
    layouts: list[FlatParamLayout],
    compute_device: torch.device,
    order: dict[int, int],
    positions: list[tuple[int, ...]],
) -> UnitPlan:
    """A unit ``fully_shard`` would build from these layouts (dtypes and
    offload as ``fully_shard._build_unit`` decides them); ``positions``: of
    each layout's parameters in ``module.parameters()``."""
    offload = offloads_params(kwargs["cpu_offload"], compute_device)
    flat_params = []
    for layout, layout_positions in zip(layouts, positions):
        dtypes = flat_param_dtypes(layout.dtype, kwargs["mixed_precision"])
        flat_params.append(
            _flat_param_plan(
                layout, dtypes.param_dtype, dtypes.reduce_dtype, dtypes.keep_low_precision_grads, offload, order,
                transport.uses_shared_memory(None, compute_device.type),
                compute_device.type, layout_positions,
            )
        )
    return _unit_plan(module, kwargs, flat_params)


def _unit_plan(module: nn.Module, kwargs: dict[str, Any], flat_params: list[FlatParamPlan]) -> UnitPlan:
    return UnitPlan(
        name="",
        module_type=type(module).__name__,
        strategy=kwargs["strategy"],
        flat_params=tuple(flat_params),
        forward_prefetch=kwargs["forward_prefetch"],
        backward_prefetch=kwargs["backward_prefetch"],
    )


def _unit_plan_from_state(name: str, state: UnitState, flat_params: list[FlatParamPlan]) -> UnitPlan:
    return UnitPlan(
        name=name,
        module_type="+".join(type(member).__name__ for member in state.members),
        strategy=state.config.strategy,
        flat_params=tuple(flat_params),
        forward_prefetch=state.config.forward_prefetch,
        backward_prefetch=state.config.backward_prefetch,
    )


def _replan_existing(
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
            _flat_param_plan(
                layout, handle.param_dtype, reduce, handle.keep_low_precision_grads, handle.offload_params, order,
                transport.uses_shared_memory(None, state.compute_device.type),
                state.compute_device.type, tuple(positions.get(id(p), -1) for p in handle.orig_params),
            )
        )
    return _unit_plan_from_state("", state, flat_params)


def _renamed(unit: UnitPlan, name: str, subtree_last: int) -> UnitPlan:
    return dataclasses.replace(unit, name=name, subtree_last=subtree_last)


def _module_order(module: nn.Module) -> dict[int, int]:
    """Module id -> pre-order index: the forward order the plan assumes when
    it decides which gradients exist before a unit's backward."""
    return {id(m): index for index, m in enumerate(module.modules())}


def _subtree_last(members: tuple[nn.Module, ...], order: dict[int, int]) -> int:
    """The last module (in ``order``) under any of a unit's modules."""
    return max(order.get(id(m), 0) for member in members for m in member.modules())


def _preorder_index(module: nn.Module, name: str) -> int:
    name = name.split("+")[0]  # a group: where its first module is
    for index, (candidate, _) in enumerate(module.named_modules()):
        if candidate == name:
            return index
    return -1


def _unit_modules(module: nn.Module, specs: dict[int, UnitPlan]) -> list[nn.Module]:
    return [m for m in module.modules() if id(m) in specs]


def _activations(
    name: str,
    module: nn.Module,
    unit_names: dict[int, str],
    mixed_precision: MixedPrecision | None,
    more: dict[str, Any],
    device_type: str,
) -> ActivationProfile | None:
    args = more.get("example_inputs")
    shape = more.get("input_shape")
    if args is None:
        if shape is None:
            return None
        dtype = more.get("input_dtype", torch.long)
        device = next((p.device for p in module.parameters()), torch.device("meta"))
        args = (torch.zeros(tuple(shape), dtype=dtype, device=device),)
    elif not isinstance(args, tuple):
        args = (args,)
    if any(get_state(m) is not None for m in module.modules()):
        raise ValueError(f"plan({name}): activations can only be measured on a model without fully_shard units.")
    compute = mixed_precision.param_dtype if mixed_precision is not None else None
    loss_fn: Callable[[Any], torch.Tensor] | None = more.get("loss_fn")
    # Fake CPU tensors for a model on meta planned for the CPU, whose
    # kernels (attention) keep less than meta's; other devices as given.
    fake_device = torch.device("cpu") if device_type == "cpu" else None
    return measure_activations(module, args, unit_names, compute_dtype=compute, loss_fn=loss_fn, device=fake_device)


def _buffer_bytes(module: nn.Module, buffer_dtype: torch.dtype | None) -> int:
    """Module buffers: never sharded, every rank holds them whole (floating
    ones in the mixed-precision ``buffer_dtype``)."""
    total = 0
    for buffer in module.buffers():
        dtype = buffer_dtype if buffer_dtype is not None and buffer.is_floating_point() else buffer.dtype
        total += buffer.numel() * torch.empty((), dtype=dtype, device="meta").element_size()
    return total


def _assemble(
    units: list[UnitPlan],
    world_size: int,
    rank: int,
    optimizer: str | OwnerOptimizer,
    device_type: str,
    activations: ActivationProfile | None,
    shared: list[tuple[str, list[str]]],
    buffers: int,
    shared_memory: bool,
    *,
    source: str,
    in_backward: bool = False,
) -> ShardingPlan:
    flat_params = [fp for unit in units for fp in unit.flat_params]
    offloaded = [fp for fp in flat_params if fp.offload]
    if isinstance(optimizer, OwnerOptimizer):  # [Note: owner-stepped optimizers, planned]
        by_kind = owner_state_bytes(units, optimizer)
        step_bytes = owner_step_bytes(units, optimizer, device_type)
        offloaded_state = sum(owner_state_bytes(units, optimizer, offloaded_only=True).values())
        label = optimizer.label
    else:
        by_kind = optimizer_bytes(flat_params, optimizer)
        step_bytes = optimizer_step_bytes(flat_params, optimizer, device_type)
        offloaded_state = sum(optimizer_bytes(offloaded, optimizer).values())
        label = optimizer
    params = sum(fp.shard_bytes for fp in flat_params)
    all_grads = sum(fp.grad_bytes for fp in flat_params)
    # [Note: optimizer in backward, planned]: the hooks free every gradient.
    grads = 0 if in_backward else all_grads
    optim = sum(by_kind.values())
    moments = step_moments(
        units,
        optimizer_step=step_bytes,
        all_grads=all_grads,
        activations=activations.by_window if activations is not None else {},
        activations_at_open=activations.at_open if activations is not None else {},
        # [Note: what a lane waits for] (runtime/scheduler.py): CUDA lanes hold a
        # freed buffer until the next all-gather allocated its own.
        holds_freed_buffer=device_type == "cuda",
        # [Note: backward prefetch on CPU] in runtime/prefetch.py
        prefetch_after_reduction=device_type == "cpu",
        in_backward_steps=[in_backward_step_bytes(u.flat_params, label, device_type) for u in units]
        if in_backward
        else None,
        hooks_after_backward=any(fp.offload for fp in flat_params),
    )
    peak: StepPeak = worst_moment(moments)
    offloaded_grads = 0 if in_backward else sum(fp.grad_bytes for fp in offloaded)
    cpu = sum(fp.shard_bytes for fp in offloaded) + offloaded_grads + offloaded_state
    moved = transport_bytes(flat_params) if shared_memory else 0
    largest_activation = [activations.largest] if activations is not None else []
    runtime = runtime_memory(device_type, freed=freed_allocation_sizes(flat_params) + largest_activation,
                             gloo_buffers=gloo_buffer_sizes(flat_params), units=len(units))
    rank_bytes = {
        "params": params,
        "grads": grads,
        "optimizer": optim,
        "model_state": params + grads + optim,
        "grads_at_peak": peak.sharded_grads,
        "unsharded_params": peak.unsharded_params,
        "unsharded_grads": peak.unsharded_grads,
        "comm": peak.comm,
        "optimizer_step": peak.optimizer_step,
        "activations": peak.activations,
        "activations_peak": activations.peak if activations is not None else 0,
        "buffers": buffers,
        "transport": moved,
        "runtime": runtime.total,
        "total": params + optim + buffers + moved + runtime.total + peak.transient,
        "cpu": cpu,
    }
    return ShardingPlan(
        world_size=world_size,
        rank=rank,
        optimizer=label,
        units=units,
        rank_bytes=rank_bytes,
        optimizer_by_kind=by_kind,
        peak_moment=peak.moment,
        warnings=plan_warnings(units, shared),
        source=source,
        optimizer_in_backward=in_backward,
        moments=moments,
        runtime=runtime,
    )
