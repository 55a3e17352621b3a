"""Owns: the entry point ``fully_shard`` — argument checks, process groups,
the compute device, building the flat-parameter handles, and attaching state
and hooks. Which modules are units, who owns each parameter and how they
group into flat parameters come from ``units/rules.py`` (shared with ``plan``).

Knows nothing of: runtime details (it calls ``runtime.register_hooks``),
state dicts and every other wing: a wing that attaches per-unit hooks
registers itself with ``register_unit_extension`` (the package's
``__init__`` does it for state dicts), and one that must act before the
first change (interop installing torch's wrappers) with
``register_before_change``, so the core imports no wing.

Public names: ``fully_shard``, ``is_fully_sharded``, ``register_forward_method``,
``register_unit_extension``, ``register_before_change``,
``register_layout_planner`` (how the planning wing chooses the layouts of
``fully_shard(..., memory_budget=...)`` without the core importing it).

Everything is validated before anything is changed, so a call that raises
leaves the module as it was.
"""

from __future__ import annotations

import functools
import os
import types
import weakref
from typing import Any, Callable, Iterable, TypeVar, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from .api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from .comm import ShardGroups
from .handle import FlatParamHandle, FlatParamSource
from .units.composable_registry import mark_fully_sharded
from .units.materialize import cast_unit_buffers, check_materializable, materialize_unit, sync_unit_states
from .policy import Policy
from .runtime import call_as_forward, register_hooks
from .runtime.lifecycle import track_unit
from .runtime.published_shards import claim_published_slices
from .units.tensor_parallel import check_dtensor_params, data_parallel_mesh
from .runtime.state import UnitConfig, UnitState, get_state, register_state, unit_states_under
from .units.rules import (
    check_group_members,
    choose_units,
    flat_param_dtypes,
    group_sources,
    assign_param_owners,
    offloads_params,
    split_ignored,
    unit_kwargs,
    unit_skipper,
)

__all__ = [
    "fully_shard",
    "is_fully_sharded",
    "register_forward_method",
    "register_unit_extension",
    "register_before_change",
    "register_layout_planner",
]

# What wings attach to every new unit, after the runtime's hooks, in
# registration order (each returns the handles of the hooks it registered).
_UNIT_EXTENSIONS: list[Callable[[UnitState], list[RemovableHandle]]] = []


def register_unit_extension(attach: Callable[[UnitState], list[RemovableHandle]]) -> None:
    """Have ``fully_shard`` call ``attach(state)`` for every unit it builds
    from now on and keep the hooks it returns with the unit (idempotent).
    How a wing (state dicts) adds per-unit hooks without the core importing
    it."""
    if attach not in _UNIT_EXTENSIONS:
        _UNIT_EXTENSIONS.append(attach)


# What wings run in every fully_shard call once its arguments are
# validated, before the module is changed, in registration order; each gets
# the call's name for its messages and may raise to refuse the call.
_BEFORE_CHANGE: list[Callable[[str], None]] = []


def register_before_change(prepare: Callable[[str], None]) -> None:
    """Have every ``fully_shard`` call run ``prepare(name)`` after its checks
    and before it changes anything (idempotent): an exception from it
    refuses the call and leaves the module untouched."""
    if prepare not in _BEFORE_CHANGE:
        _BEFORE_CHANGE.append(prepare)


# What chooses the per-unit layouts of fully_shard(..., memory_budget=...):
# the planning wing registers it (the package's __init__), the last wins.
_LAYOUT_PLANNERS: list[Callable[..., Policy]] = []


def register_layout_planner(planner: Callable[..., Policy]) -> None:
    """Have ``fully_shard(module, memory_budget=...)`` call
    ``planner(module, world_size=..., memory_budget=..., policy=...,
    strategy=..., <the other plan arguments>)`` for the policy (a
    ``LayoutPolicy``) that applies the chosen layouts (idempotent)."""
    if planner not in _LAYOUT_PLANNERS:
        _LAYOUT_PLANNERS.append(planner)


# fully_shard returns the object it was given: a module (of its own class) or a group's list.
_ModuleOrGroup = TypeVar("_ModuleOrGroup", bound="nn.Module | list[nn.Module]")


def fully_shard(
    module: _ModuleOrGroup,
    *,
    policy: Policy | set[type[nn.Module]] | None = None,
    process_group: ProcessGroup | tuple[ProcessGroup, ProcessGroup] | None = None,
    device_mesh: Any | None = None,
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    mixed_precision: MixedPrecision | None = None,
    cpu_offload: CPUOffload | None = None,
    ignored_states: Iterable[nn.Module | nn.Parameter] | None = None,
    device_id: int | torch.device | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    sync_module_states: bool = False,
    forward_prefetch: bool = False,
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
    limit_all_gathers: bool = True,
    use_orig_params: bool = True,
    memory_budget: int | None = None,
) -> _ModuleOrGroup:
    """Shard ``module``'s parameters over the data-parallel ranks in place.

    Returns the same module object: its class and its submodules' classes are
    unchanged, and its ``nn.Parameter`` objects are kept (they become views
    into this rank's flat shard). See docs/api.md for the full contract.

    Given a list of modules, makes them one unit (a group: one flat
    parameter per dtype and trainability for all of them) and returns the
    same list. [Note: grouped units] in runtime/groups.py says when a
    group gathers, reshards and reduces.

    ``memory_budget`` (bytes per rank): plan the module on the group's world
    size first (``composable_shard.plan`` with these arguments, rank 0's
    peak, AdamW state, no activations) and give every unit the policy
    picks, and the root, the layout that moves the fewest bytes within the
    budget ([Note: a layout chosen for a memory budget] in
    planning/budget.py); ``strategy`` is then the most sharded layout
    allowed. For another optimizer or activations, call ``plan(...,
    memory_budget=...)`` and pass its ``layout_policy()``.
    """
    if isinstance(module, (list, tuple)):
        members = check_group_members(module)
        name = "+".join(type(m).__name__ for m in members)
    elif not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard: expected an nn.Module or a list of them, got {type(module).__name__}.")
    else:
        members = [module]
        name = type(module).__name__
    if get_state(members[0]) is not None:
        raise ValueError(
            f"fully_shard({name}): this module is already sharded (by an earlier fully_shard call or "
            "its policy). Call fully_shard once per module."
        )
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(
            f"fully_shard({name}): param_init_fn must be a callable taking a module, got "
            f"{type(param_init_fn).__name__}. Pass a function, or None to use each module's reset_parameters()."
        )
    if not use_orig_params:
        raise ValueError(
            f"fully_shard({name}): use_orig_params=False is not supported; composable_shard always keeps "
            "the original parameters. Drop the argument."
        )
    if not dist.is_initialized():
        raise RuntimeError(
            f"fully_shard({name}): torch.distributed is not initialised. Call "
            "torch.distributed.init_process_group() first (torchrun sets up the environment)."
        )
    if memory_budget is not None:
        ignored_states = list(ignored_states) if ignored_states is not None else None
        layout_policy = _budgeted_policy(
            name, members, memory_budget, policy=policy, process_group=process_group, device_mesh=device_mesh,
            strategy=strategy, mixed_precision=mixed_precision, cpu_offload=cpu_offload, ignored_states=ignored_states,
            device_id=device_id, forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch,
            limit_all_gathers=limit_all_gathers,
        )
        policy, strategy = layout_policy, getattr(layout_policy, "root_strategy", strategy)
    ignored_modules, ignored_params = split_ignored(name, ignored_states, members)
    base_kwargs = dict(
        strategy=strategy,
        mixed_precision=mixed_precision,
        cpu_offload=cpu_offload,
        forward_prefetch=forward_prefetch,
        backward_prefetch=backward_prefetch,
        limit_all_gathers=limit_all_gathers,
        process_group=process_group,
        device_mesh=device_mesh,
    )

    # [Note: one copy of the unit rules] (units/rules.py): plan() calls the same.
    skip = unit_skipper(ignored_modules)
    given = members if len(members) > 1 else members[0]
    choices = choose_units(given, policy, ignored_modules)
    kwargs_per_unit = [unit_kwargs(name, base_kwargs, choice) for choice in choices]
    sources = assign_param_owners(given, choices, ignored_modules, ignored_params)
    compute_device = _compute_device(name, members, sources, device_id)
    groups = [_resolve_groups(name, kwargs) for kwargs in kwargs_per_unit]
    for choice, kwargs, unit_groups in zip(choices, kwargs_per_unit, groups):
        _check_groups_reach_device(name, unit_groups, compute_device)
        precision = kwargs["mixed_precision"]
        keep_low = precision is not None and precision.keep_low_precision_grads
        check_dtensor_params(name, sources[id(choice.module)], unit_groups, keep_low)
    for member in members:
        check_materializable(member, param_init_fn, skip)
    for prepare in _BEFORE_CHANGE:
        prepare(name)

    # Validated: from here on the module is changed.
    paths = {id(sub): path for member in members for path, sub in member.named_modules()}
    for choice, kwargs, unit_groups in zip(choices, kwargs_per_unit, groups):
        unit_sources = sources[id(choice.module)]
        unit_members = list(choice.modules)  # a group's modules: the list given, or its policy's
        for member in unit_members:
            materialize_unit(member, compute_device, param_init_fn, skip, paths.get(id(member), ""))
        if sync_module_states:  # parameters once, then each module's buffers
            for index, member in enumerate(unit_members):
                sync_unit_states(member, unit_sources if index == 0 else [], skip, unit_groups)
        orig_buffer_dtypes = {
            id(member): cast_unit_buffers(member, kwargs["mixed_precision"], skip) for member in unit_members
        }
        state = _build_unit(tuple(unit_members), unit_sources, unit_groups, kwargs, compute_device)
        state.orig_buffer_dtypes = orig_buffer_dtypes
        state.ignored_params = frozenset(ignored_params)
    # A budgeted layout's bucket size, larger where the budget has room,
    # smaller or 0 where it holds the layouts only so ([Note: a layout
    # chosen for a memory budget] in planning/budget.py): read by the root.
    state.bucket_bytes = getattr(policy, "bucket_bytes", None)
    if len(members) == 1:
        # Units below this module are named by their path from it until the
        # root's lazy init names them from the root (errors before the
        # first forward name 'blocks.0', not 'Block'); the module's own
        # unit keeps its class name until then.
        for unit_name, unit in unit_states_under(members[0]):
            if unit_name and unit.root_context is None:
                unit.fqn = unit_name
    return module


def is_fully_sharded(module: nn.Module) -> bool:
    """True for every module that is the root of a unit (each module of a
    group)."""
    return get_state(module) is not None


def _budgeted_policy(
    name: str,
    members: list[nn.Module],
    memory_budget: int,
    *,
    process_group: ProcessGroup | tuple[ProcessGroup, ProcessGroup] | None,
    device_mesh: Any | None,
    device_id: int | torch.device | None,
    **plan_kwargs: Any,
) -> Policy:
    """The registered planner's policy for ``memory_budget`` over the
    group's world size (nothing changed yet)."""
    if not _LAYOUT_PLANNERS:
        raise RuntimeError(
            f"fully_shard({name}): memory_budget needs the planning wing, which is registered when the package "
            "is imported. Import composable_shard (not only composable_shard.entry)."
        )
    if len(members) > 1:
        raise ValueError(
            f"fully_shard({name}): memory_budget plans one module and its policy's units, not a group of "
            f"{len(members)} modules. Shard the group without a budget, or pass its parent module."
        )
    if device_mesh is not None or isinstance(process_group, tuple):
        raise ValueError(
            f"fully_shard({name}): memory_budget chooses among NO_SHARD, SHARD_GRAD_OP and FULL_SHARD over one "
            "process group; a device mesh or a (shard, replicate) pair of groups is hybrid. Pass one "
            "process_group (or none: the world), or drop memory_budget."
        )
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget <= 0:
        raise (ValueError if isinstance(memory_budget, int) and not isinstance(memory_budget, bool) else TypeError)(
            f"fully_shard({name}): memory_budget must be a positive int number of bytes per rank, got "
            f"{type(memory_budget).__name__} {memory_budget!r}. Pass, for example, 8 * 2**30 for 8 GiB."
        )
    if device_id is not None:
        device = "cuda" if isinstance(device_id, int) else torch.device(device_id).type
    else:  # where _compute_device will put the units: the parameters' device, or for meta the backend's
        real = [p.device.type for p in members[0].parameters() if p.device.type != "meta"]
        on_cuda = "nccl" in str(dist.get_backend(process_group)) and torch.cuda.is_available()
        device = real[0] if real else ("cuda" if on_cuda else "cpu")
    world_size = dist.get_world_size(process_group)
    try:
        return _LAYOUT_PLANNERS[-1](members[0], world_size=world_size, memory_budget=memory_budget, device=device,
                                    **plan_kwargs)
    except (TypeError, ValueError) as exc:  # the plan's message names plan(); say which call it was
        raise type(exc)(f"fully_shard({name}): choosing the layouts for memory_budget failed: {exc}") from exc


# ------------------------------------------------------------------ checks
def register_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>()`` gather and free the unit's parameters
    as ``module(...)`` does, for a unit whose caller runs another method
    than ``forward`` (a vision encoder's ``forward_features``, a language
    model's ``generate`` step). Without it such a call would see the
    1-D shards. The method is wrapped on this instance only (an instance
    attribute, the one the user asked for); registering it again changes
    nothing."""
    state = get_state(module)
    name = type(module).__name__
    if state is None:
        raise ValueError(
            f"register_forward_method({name}, {method_name!r}): this module is not a unit. "
            "Call fully_shard on it (or choose it with a policy) first."
        )
    method = getattr(type(module), method_name, None)
    if method_name == "forward" or not callable(method):
        raise ValueError(
            f"register_forward_method({name}, {method_name!r}): {type(module).__qualname__} has no method "
            f"{method_name!r} other than forward. Name a method defined on the module's class."
        )
    if method_name in module.__dict__:
        return
    module.__dict__[method_name] = types.MethodType(functools.partial(call_as_forward, state, method), module)


def _compute_device(
    name: str,
    module: list[nn.Module],
    sources: dict[int, list[FlatParamSource]],
    device_id: int | torch.device | None,
) -> torch.device:
    devices: dict[torch.device, str] = {}
    for unit_sources in sources.values():
        for source in unit_sources:
            devices.setdefault(source.param.device, source.owners[0].fqn)
    real = {device: fqn for device, fqn in devices.items() if device.type != "meta"}
    if len(real) > 1:
        (dev_a, fqn_a), (dev_b, fqn_b) = list(real.items())[:2]
        raise ValueError(
            f"fully_shard({name}): parameters are on different devices: '{fqn_a}' on {dev_a} and "
            f"'{fqn_b}' on {dev_b}. Move the module to one device (or pass device_id) first."
        )
    if device_id is not None:
        device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
        _check_cuda_device(name, device, f"device_id={device_id!r}")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if real:
        device = next(iter(real))
        _check_cuda_device(name, device, f"its parameters are on {device}")
        return device
    if devices:  # everything on meta: materialise where the backend computes
        backend = dist.get_backend()
        if "nccl" in str(backend) and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    return torch.device("cpu")


def _check_cuda_device(name: str, device: torch.device, why: str) -> None:
    """A CUDA compute device must exist and be the current device.

    [Note: the current CUDA device]
    Some CUDA work takes no device argument and runs on the current device:
    ``pin_memory()`` (CPU offload) creates a context there, and NCCL's object
    collectives (``broadcast_object_list``, ``all_gather_object``, used by
    state dicts and checkpoints) put their tensors there. With a compute
    device other than the current one every rank would create a context on
    the current device (usually GPU 0) and object collectives could run on
    the wrong GPU or hang. So ``fully_shard`` asks for
    ``torch.cuda.set_device`` first rather than switching devices behind
    every call."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(
            f"fully_shard({name}): the compute device would be {device} ({why}), but CUDA is not available "
            "(torch.cuda.is_available() is False). Pass device_id=None or a CPU device."
        )
    current = torch.cuda.current_device()
    if device.index is not None and device.index != current:
        raise ValueError(
            f"fully_shard({name}): the compute device is {device} ({why}) but the current CUDA device is "
            f"cuda:{current}; pinned memory and NCCL object collectives would use cuda:{current}. "
            f"Call torch.cuda.set_device({device.index}) before fully_shard."
        )


def _check_groups_reach_device(name: str, groups: ShardGroups, device: torch.device) -> None:
    """Every group of a unit must have a backend for the compute device's
    tensors: a module left on CPU (no ``device_id``) under an NCCL group
    would otherwise fail or hang in its first collective
    (``sync_module_states``, an all-gather, a reduction)."""
    for group in (groups.shard_group, groups.replicate_group):
        # ``_device_types``: the device types the group has backends for
        # (gloo: CPU and CUDA; NCCL: CUDA). Older releases lack it: no check.
        device_types = getattr(group, "_device_types", None)
        if group is None or device_types is None:
            continue
        if not any(torch.device(kind).type == device.type for kind in device_types):
            raise ValueError(
                f"fully_shard({name}): the compute device is {device} but the process group's backend "
                f"({dist.get_backend(group)}) has no {device.type.upper()} support, so every collective would fail. "
                "Pass device_id=torch.cuda.current_device() (or move the module to its GPU) first, "
                "or use a group whose backend handles CPU tensors (gloo)."
            )


# ------------------------------------------------------------ process groups
# The hybrid groups made for each parent group, so that every fully_shard
# call over one parent shares them (every rank must create groups in the
# same order). Keyed weakly by the parent: ``destroy_process_group`` drops
# the parent, and with it the entry and the groups made for it. A group
# destroyed while its parent lives is detected on lookup and made again.
_HYBRID_GROUPS_CACHE: weakref.WeakKeyDictionary[ProcessGroup, tuple[ProcessGroup, ProcessGroup]] = (
    weakref.WeakKeyDictionary()
)


def _resolve_groups(name: str, kwargs: dict[str, Any]) -> ShardGroups:
    strategy: ShardingStrategy = kwargs["strategy"]
    process_group = kwargs["process_group"]
    mesh = kwargs["device_mesh"]
    if process_group is not None and mesh is not None:
        raise ValueError(f"fully_shard({name}): pass process_group or device_mesh, not both.")
    mesh = data_parallel_mesh(mesh)  # [Note: meshes with a tensor-parallel dimension]
    if mesh is not None:
        if mesh.ndim == 2:
            process_group = (mesh.get_group(1), mesh.get_group(0))
        elif mesh.ndim == 1:
            process_group = mesh.get_group()
        else:
            raise ValueError(f"fully_shard({name}): device_mesh must be 1-D or 2-D, got {mesh.ndim}-D.")
    if isinstance(process_group, tuple):
        if not strategy.is_hybrid:
            raise ValueError(
                f"fully_shard({name}): a (shard_group, replicate_group) tuple or a 2-D mesh needs "
                f"HYBRID_SHARD or HYBRID_SHARD_ZERO2, got {strategy.name}."
            )
        shard_group, replicate_group = process_group
        return ShardGroups(shard_group, _drop_singleton(replicate_group))
    group = process_group if process_group is not None else dist.group.WORLD
    if strategy is ShardingStrategy.NO_SHARD:
        return ShardGroups(None, _drop_singleton(group))
    if strategy.is_hybrid:
        # None only without a process group, where hybrid sharding cannot run anyway.
        shard_group, replicate_group = _intra_node_groups(cast(ProcessGroup, group))
        return ShardGroups(shard_group, _drop_singleton(replicate_group))
    return ShardGroups(group, None)


def _drop_singleton(group: ProcessGroup | None) -> ProcessGroup | None:
    return None if group is None or dist.get_world_size(group) == 1 else group


def _intra_node_groups(group: ProcessGroup) -> tuple[ProcessGroup, ProcessGroup]:
    """(shard within a node, replicate across nodes) for hybrid sharding
    without explicit groups; nodes have LOCAL_WORLD_SIZE ranks."""
    cached = _HYBRID_GROUPS_CACHE.get(group)
    if cached is not None and all(_is_registered(made) for made in (group, *cached)):
        return cached
    world = dist.get_world_size(group)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local:
        raise ValueError(
            f"fully_shard: hybrid sharding needs the world size ({world}) to be a multiple of the ranks "
            f"per node ({local}); pass process_group=(shard_group, replicate_group) instead."
        )
    ranks = dist.get_process_group_ranks(group)
    shard_group = replicate_group = None
    for start in range(0, world, local):  # every rank creates every group
        members = ranks[start : start + local]
        created = dist.new_group(members)
        if dist.get_rank() in members:
            shard_group = created
    for offset in range(local):
        members = ranks[offset::local]
        created = dist.new_group(members)
        if dist.get_rank() in members:
            replicate_group = created
    if shard_group is None or replicate_group is None:  # every rank is in one of each by construction
        raise RuntimeError(f"composable_shard internal error: rank {dist.get_rank()} is in no hybrid group of {ranks}")
    _HYBRID_GROUPS_CACHE[group] = (shard_group, replicate_group)
    return shard_group, replicate_group


def _is_registered(group: ProcessGroup) -> bool:
    """Whether ``group`` is still known to torch.distributed (not destroyed)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, RuntimeError, ValueError):
        return False
    return True


# ------------------------------------------------------------------- build
def _build_unit(
    members: tuple[nn.Module, ...],
    sources: list[FlatParamSource],
    groups: ShardGroups,
    kwargs: dict[str, Any],
    compute_device: torch.device,
) -> UnitState:
    mixed_precision: MixedPrecision | None = kwargs["mixed_precision"]
    cpu_offload: CPUOffload | None = kwargs["cpu_offload"]
    offload = offloads_params(cpu_offload, compute_device)
    handles = []
    for flat_sources in group_sources(sources):
        dtypes = flat_param_dtypes(flat_sources[0].param.dtype, mixed_precision)
        handles.append(
            FlatParamHandle(
                flat_sources,
                groups,
                compute_device=compute_device,
                param_dtype=dtypes.param_dtype,
                reduce_dtype=dtypes.reduce_dtype,
                keep_low_precision_grads=dtypes.keep_low_precision_grads,
                offload_params=offload,
            )
        )
    config = UnitConfig(
        strategy=kwargs["strategy"],
        mixed_precision=mixed_precision,
        offload_params=offload,
        forward_prefetch=kwargs["forward_prefetch"],
        backward_prefetch=kwargs["backward_prefetch"],
        limit_all_gathers=kwargs["limit_all_gathers"],
    )
    state = UnitState(members[0], handles, groups, config, compute_device, members=members)
    claim_published_slices(state)  # [Note: all-gathers from published shards] in runtime/published_shards.py
    register_hooks(state)
    track_unit(state)
    for attach in _UNIT_EXTENSIONS:
        state.module_hooks.extend(attach(state))
    for member in members:
        register_state(member, state)
        mark_fully_sharded(member)
    return state

