"""Owns: the sharding plan — per unit layout and per rank memory, computed
before a run (``plan``, no process group, meta-device models welcome) or read
from a sharded model (``describe``), and its printed table.

Knows nothing of: hooks, collectives, storage (it reads layouts, and the
memory arithmetic lives in ``memory.py``).

Public names: ``plan``, ``describe``, ``ShardingPlan``, ``layout_for_budget``
(what ``fully_shard(..., memory_budget=...)`` calls).

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
import functools
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from .. import comm
from ..comm import transport
from ..comm_hooks import reduce_dtype_of_unit
from ..api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from ..handle.layout import compute_layout
from ..handle.dtensor_views import local_tensor
from .activations import ActivationProfile, measure_activations
from .budget import UnitLayout, choose_bucket_size, choose_layouts
from .memory import (
    UnitPlan,
    freed_allocation_sizes,
    gloo_buffer_sizes,
    in_backward_step_bytes,
    optimizer_bytes,
    optimizer_step_bytes,
)
from .step_replay import StepPeak, step_moments, worst_moment
from .owner_memory import OwnerOptimizer, owner_state_bytes, owner_step_bytes
from .arguments import (
    budget_layouts,
    check_optimizer,
    checked_rank,
    optimizer_kind,
    optimizer_label,
    shard_group,
)
from .table import format_plan
from .advice import plan_warnings, shared_params, shared_params_from_states
from .runtime_memory import RuntimeMemory, runtime_memory
from .transport_memory import transport_bytes
from .unit_plans import (
    buffer_bytes,
    default_device_type,
    flat_param_plan,
    module_order,
    new_unit_plan,
    param_positions,
    preorder_index,
    renamed,
    replan_existing,
    subtree_last,
    unit_plan_from_state,
)
from ..policy import LayoutPolicy, Policy, SmallUnitGroups, unit_name as name_of_choice
from ..runtime.state import get_state, unit_states_under
from ..units.rules import (
    UnitChoice,
    choose_units,
    group_sources,
    assign_param_owners,
    split_ignored,
    unit_kwargs,
)

__all__ = ["plan", "describe", "ShardingPlan", "layout_for_budget"]

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
    ``memory_budget``, ``layouts``: the budget a plan was asked to fit and,
    per unit, the layout chosen with its bytes moved and reason ([Note: a
    layout chosen for a memory budget] in planning/budget.py); ``None``
    and empty otherwise. ``layout_policy()`` applies them.
    ``bucket_bytes``: the size of the buckets of small units' all-gathers
    and reductions the plan counts (None: ``comm.GATHER_BUCKET_BYTES`` and
    ``comm.REDUCE_BUCKET_BYTES``; 0: none, and ``coalesced`` is False), a
    ``LayoutPolicy``'s or what a budget chose.
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
    memory_budget: int | None = None
    layouts: list[UnitLayout] = field(default_factory=list)
    # The policy the budgeted plan was given (what layout_policy() wraps).
    base_policy: Policy | set[type[nn.Module]] | None = field(default=None, repr=False, compare=False)
    # The size of the buckets of small units' all-gathers and reductions
    # (None: comm.GATHER_BUCKET_BYTES and comm.REDUCE_BUCKET_BYTES; 0: none).
    # [Note: a layout chosen for a memory budget]: a budget that holds the
    # most sharded layouts only with smaller buckets, or none, chooses them.
    bucket_bytes: int | None = None

    @property
    def coalesced(self) -> bool:
        """Whether small units' all-gathers and reductions are coalesced in
        this plan (``bucket_bytes`` is not 0)."""
        return self.bucket_bytes != 0

    def layout_policy(self) -> LayoutPolicy:
        """The policy that applies this plan's chosen layouts:
        ``fully_shard(model, policy=p, strategy=p.root_strategy)`` with
        ``p = plan.layout_policy()`` builds the planned units, each with its
        layout (the policy's own per-unit overrides kept). Only for a plan
        made with ``memory_budget=``."""
        if self.memory_budget is None:
            raise RuntimeError(
                "ShardingPlan.layout_policy(): this plan chose no layouts. Call "
                "plan(model, world_size=..., memory_budget=<bytes per rank>) first."
            )
        chosen = {layout.name: layout.strategy for layout in self.layouts if layout.chosen and layout.name}
        root = next(layout.strategy for layout in self.layouts if layout.name == "")
        return LayoutPolicy(self.base_policy, chosen, root_strategy=root, bucket_bytes=self.bucket_bytes)

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
    memory_budget: int | None = None,
    **more: Any,
) -> ShardingPlan:
    """Plan ``fully_shard(module, policy=..., ...)`` on ``world_size`` ranks
    without a process group and without allocating parameters.

    ``memory_budget`` (bytes per rank): choose each unit's layout among
    NO_SHARD, SHARD_GRAD_OP and FULL_SHARD (up to ``strategy``), the root's
    too, to move the fewest bytes with a peak (``rank_bytes["total"]``)
    within the budget; units whose strategy the policy sets, and units of
    earlier ``fully_shard`` calls, keep theirs. The plan's ``layouts`` say
    what was chosen and why; ``layout_policy()`` applies it. Where the most
    sharded layouts do not fit with the default buckets of small units'
    collectives, smaller buckets, then none (``bucket_bytes``). A
    ``SmallUnitGroups`` policy's groups are kept where the budget holds
    them, else its base policy's units are laid out. ``ValueError``
    when even the most sharded layouts do not fit ([Note: a layout chosen
    for a memory budget] in planning/budget.py).

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
    groups_only = more.pop("_groups_only", False)  # plan's own: SmallUnitGroups planned without its fallback
    rank = checked_rank(name, world_size, optimizer, more)
    allowed = budget_layouts(name, memory_budget, strategy) if memory_budget is not None else ()
    device_type = more.get("device") or default_device_type(module)
    ignored_states = list(ignored_states) if ignored_states is not None else None  # read twice when grouping
    ignored_modules, ignored_params = split_ignored(name, ignored_states, [module])
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
    if memory_budget is not None and isinstance(policy, SmallUnitGroups) and not groups_only:
        # [Note: groups of small units] in policy.py: the groups where the budget holds them.
        try:
            return plan(
                module, world_size=world_size, policy=policy, strategy=strategy, mixed_precision=mixed_precision,
                cpu_offload=cpu_offload, ignored_states=ignored_states, optimizer=optimizer,
                memory_budget=memory_budget, _groups_only=True, **more,
            )
        except ValueError:
            policy = policy.base  # the groups do not fit: the units of the policy it groups
    # [Note: plan and fully_shard share one copy of the rules]
    positions = param_positions(module)
    choices = choose_units(module, policy, ignored_modules)
    sources = assign_param_owners(module, choices, ignored_modules, ignored_params)
    hybrid_size = more.get("hybrid_shard_size") or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    compute_device = torch.device(device_type)
    order = module_order(module)

    def unit_spec(choice: UnitChoice, layout: ShardingStrategy | None = None) -> UnitPlan:
        kwargs = unit_kwargs(name, base, choice)
        if layout is not None:
            kwargs = {**kwargs, "strategy": layout}
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
        return new_unit_plan(choice.modules, kwargs, layouts, compute_device, order, unit_positions)

    specs = {id(choice.module): unit_spec(choice) for choice in choices}
    # Units marked by earlier manual fully_shard calls keep their own layout
    # rules: recompute them at this world size.
    members_of: dict[int, tuple[nn.Module, ...]] = {id(choice.module): choice.modules for choice in choices}
    names = {id(m): n for n, m in module.named_modules()}
    # A group its policy made is named as unit_states_under names it ("blocks.0+blocks.1").
    names.update({id(choice.module): name_of_choice(choice, names) for choice in choices if choice.group})
    for unit_name, state in unit_states_under(module):
        specs[id(state.module)] = replan_existing(name, state, world_size, rank, hybrid_size, order, positions)
        members_of[id(state.module)] = state.members
        names[id(state.module)] = unit_name  # a group: "norm+output"
    units = sorted(
        (renamed(spec, names[key], subtree_last(members_of[key], order)) for key, spec in specs.items()),
        key=lambda u: preorder_index(module, u.name),
    )
    unit_names = {key: names[key] for key in specs}
    activations = _activations(name, module, unit_names, mixed_precision, more, device_type)
    # Every module of a unit by its unit's name (a group's modules share it).
    shared = shared_params(module, {id(m): names[key] for key, members in members_of.items() for m in members}, sources)
    kind = optimizer_kind(optimizer, more.get("momentum", 0.9))
    buffer_dtype = mixed_precision.buffer_dtype if mixed_precision is not None else None
    buffers = buffer_bytes(module, buffer_dtype)
    shared_memory = transport.uses_shared_memory(None, device_type)

    def assemble(planned: list[UnitPlan], *, bucket_bytes: int | None = None) -> ShardingPlan:
        return _assemble(
            planned, world_size, rank, kind, device_type, activations, shared, buffers, shared_memory, source="plan",
            in_backward=bool(more.get("optimizer_in_backward", False)), bucket_bytes=bucket_bytes,
        )

    if memory_budget is None:
        # A budgeted plan's policy may have chosen smaller buckets, or none.
        result = assemble(units, bucket_bytes=getattr(policy, "bucket_bytes", None))
    else:
        # The root and the units the policy gave no strategy are chosen.
        choice_of = {names[id(c.module)]: c for c in choices if "strategy" not in c.overrides or c is choices[-1]}
        chosen = [u.name for u in units if u.name in choice_of]
        if not any(u.flat_params for u in units if u.name in choice_of):
            raise ValueError(
                f"plan({name}): memory_budget has no unit to lay out: the units it may choose for hold no "
                "parameter. Drop memory_budget, or plan a module with parameters."
            )
        by_layout: dict[tuple[str, ShardingStrategy], UnitPlan] = {}

        def unit_for(name_of_unit: str, layout: ShardingStrategy) -> UnitPlan:
            if (name_of_unit, layout) not in by_layout:
                choice = choice_of[name_of_unit]
                spec = unit_spec(choice, layout)
                by_layout[(name_of_unit, layout)] = renamed(spec, name_of_unit, subtree_last(choice.modules, order))
            return by_layout[(name_of_unit, layout)]

        def choose(bucket_bytes: int | None) -> tuple[ShardingPlan, list[UnitLayout]]:
            return choose_layouts(
                units, chosen=chosen, allowed=allowed, unit_for=unit_for,
                assemble=functools.partial(assemble, bucket_bytes=bucket_bytes), world_size=world_size,
                budget=memory_budget, caller=f"plan({name})",
            )

        # Every unit under every layout the budget may give it: whether any
        # joins a bucket of a size.
        def at_size(layouts: list[UnitLayout], bucket_bytes: int) -> ShardingPlan:
            # The chosen layouts again, with buckets of another size.
            strategy_of = {layout.name: layout.strategy for layout in layouts if layout.chosen}
            planned = [unit_for(u.name, strategy_of[u.name]) if u.name in strategy_of else u for u in units]
            return assemble(planned, bucket_bytes=bucket_bytes)

        layouts_tried = [u for u in units if u.name not in choice_of]
        layouts_tried += [unit_for(unit_name, layout) for unit_name in chosen for layout in allowed]
        result, chosen_layouts = choose_bucket_size(
            choose, layouts_tried, world_size, at_size=at_size, budget=memory_budget
        )
        result.memory_budget, result.layouts, result.base_policy = memory_budget, chosen_layouts, policy
    result.optimizer = optimizer_label(optimizer)
    if more.get("warn", False):
        for message in result.warnings:
            warnings.warn(message, stacklevel=2)
    return result


def layout_for_budget(
    module: nn.Module,
    *,
    world_size: int,
    memory_budget: int,
    policy: Policy | set[type[nn.Module]] | None,
    strategy: ShardingStrategy,
    device: str | None,
    **plan_kwargs: Any,
) -> LayoutPolicy:
    """The ``LayoutPolicy`` of ``plan(module, ..., memory_budget=...)`` for
    rank 0 (every rank chooses the same), with ``fully_shard``'s
    arguments; ``fully_shard(..., memory_budget=...)`` applies it."""
    if device is not None:
        plan_kwargs["device"] = device
    budgeted = plan(module, world_size=world_size, policy=policy, strategy=strategy, memory_budget=memory_budget,
                    **plan_kwargs)
    return budgeted.layout_policy()


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
    positions = param_positions(module)
    named = list(unit_states_under(module))
    if not named:
        raise ValueError(f"describe({name}): no fully_shard unit in this module. Call fully_shard first, or use plan().")
    units = []
    device_type = "cpu"
    shared_memory = False
    order = module_order(module)
    for unit_name, state in named:
        shared_memory |= any(
            h.groups.is_sharded and transport.uses_shared_memory(h.groups.shard_group, state.compute_device.type)
            for h in state.handles
        )
        flat_params = [
            flat_param_plan(
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
        unit = unit_plan_from_state(unit_name, state, flat_params)
        units.append(dataclasses.replace(unit, subtree_last=subtree_last(state.members, order)))
        device_type = state.compute_device.type
    world = named[0][1].groups.data_parallel_world_size
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    unit_of_member = {id(member): unit_name for unit_name, state in named for member in state.members}
    shared = shared_params_from_states(module, unit_of_member, named)
    kind = optimizer_kind(optimizer, momentum)
    buffers = buffer_bytes(module, None)  # already cast by fully_shard
    # The buckets of the tree's root (a budgeted layout may have chosen them).
    root = next((state for unit_name, state in named if unit_name == ""), None)
    result = _assemble(
        units, world, rank, kind, device_type, None, shared, buffers, shared_memory, source="fully_shard",
        in_backward=optimizer_in_backward, bucket_bytes=root.bucket_bytes if root is not None else None,
    )
    result.optimizer = optimizer_label(optimizer)
    return result


# ---------------------------------------------------------------- helpers
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
    bucket_bytes: int | None = None,
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
    reduce_bucket, gather_bucket = _bucket_sizes(bucket_bytes) if world_size > 1 else (0, 0)
    moments = step_moments(
        units,
        optimizer_step=step_bytes,
        all_grads=all_grads,
        activations=activations.by_window if activations is not None else {},
        activations_at_open=activations.at_open if activations is not None else {},
        activation_pieces=activations.pieces_at_peak if activations is not None else {},
        activations_at_end=activations.at_end if activations is not None else None,
        activations_after_backward=activations.after_backward if activations is not None else 0,
        # [Note: what a lane waits for] (runtime/scheduler.py): CUDA lanes hold a
        # freed buffer until the next all-gather allocated its own.
        holds_freed_buffer=device_type == "cuda",
        # [Note: backward prefetch on CPU] in runtime/prefetch.py
        prefetch_after_reduction=device_type == "cpu",
        in_backward_steps=[in_backward_step_bytes(u.flat_params, label, device_type) for u in units]
        if in_backward
        else None,
        hooks_after_backward=any(fp.offload for fp in flat_params),
        # [Note: coalesced reductions] in runtime/grad_buckets.py: none on one rank.
        bucket_bytes=reduce_bucket,
        # [Note: coalesced all-gathers] in runtime/gather_buckets.py
        gather_bucket_bytes=gather_bucket,
    )
    peak: StepPeak = worst_moment(moments)
    offloaded_grads = 0 if in_backward else sum(fp.grad_bytes for fp in offloaded)
    cpu = sum(fp.shard_bytes for fp in offloaded) + offloaded_grads + offloaded_state
    moved = transport_bytes(units) if shared_memory else 0
    largest_activation = [activations.largest] if activations is not None else []
    runtime = runtime_memory(device_type, freed=freed_allocation_sizes(flat_params) + largest_activation,
                             gloo_buffers=gloo_buffer_sizes(flat_params),
                             activations=activations.peak if activations is not None else 0)
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
        bucket_bytes=bucket_bytes,
    )


def _bucket_sizes(bucket_bytes: int | None) -> tuple[int, int]:
    """The reduce and gather bucket sizes of a plan's ``bucket_bytes`` (the
    rule ``runtime/root.py`` applies to a root's: None for the comm
    defaults)."""
    if bucket_bytes is None:
        return comm.REDUCE_BUCKET_BYTES, comm.GATHER_BUCKET_BYTES
    return bucket_bytes, bucket_bytes
