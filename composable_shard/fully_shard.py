"""Owns: the entry point ``fully_shard`` — argument checks, units from the
policy, who owns each parameter, building the flat-parameter handles, and
attaching state and hooks.

Knows nothing of: runtime details (it calls ``runtime.register_hooks``).

Public names: ``fully_shard``, ``is_fully_sharded``.

Everything is validated before anything is changed, so a call that raises
leaves the module as it was.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from .api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from .comm import ShardGroups
from .flat_layout import ParamOwner
from .flat_param import FlatParamHandle, FlatParamSource
from .init import cast_unit_buffers, check_materializable, materialize_unit, sync_unit_states
from .policy import Policy, UnitChoice, select_units
from .runtime import register_hooks
from .state_dict_hooks import register_state_dict_hooks
from .state import UnitConfig, UnitState, get_state, register_state, unit_states_under

__all__ = ["fully_shard", "is_fully_sharded"]

# Keyword arguments a CustomPolicy may override per unit.
_OVERRIDABLE = frozenset(
    {
        "strategy",
        "mixed_precision",
        "cpu_offload",
        "forward_prefetch",
        "backward_prefetch",
        "limit_all_gathers",
        "process_group",
        "device_mesh",
    }
)


def fully_shard(
    module: nn.Module,
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
) -> nn.Module:
    """Shard ``module``'s parameters over the data-parallel ranks in place.

    Returns the same module object: its class and its submodules' classes are
    unchanged, and its ``nn.Parameter`` objects are kept (they become views
    into this rank's flat shard). See API.md for the full contract.
    """
    name = type(module).__name__
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard: expected an nn.Module, got {type(module).__name__}.")
    if get_state(module) is not None:
        raise ValueError(
            f"fully_shard({name}): this module is already sharded (by an earlier fully_shard call or "
            "its policy). Call fully_shard once per module."
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
    ignored_modules, ignored_params = _split_ignored(name, ignored_states)
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

    def skip(candidate: nn.Module) -> bool:
        return get_state(candidate) is not None or candidate in ignored_modules

    choices = select_units(module, policy, skip) + [UnitChoice(module)]
    unit_kwargs = [_unit_kwargs(name, base_kwargs, choice) for choice in choices]
    sources = _plan_ownership(module, choices, ignored_modules, ignored_params)
    compute_device = _compute_device(name, module, sources, device_id)
    groups = [_resolve_groups(name, kwargs) for kwargs in unit_kwargs]
    check_materializable(module, param_init_fn, skip)

    # Validated: from here on the module is changed.
    for choice, kwargs, unit_groups in zip(choices, unit_kwargs, groups):
        unit_sources = sources[id(choice.module)]
        materialize_unit(choice.module, compute_device, param_init_fn, skip)
        if sync_module_states:
            sync_unit_states(choice.module, unit_sources, skip)
        orig_buffer_dtypes = cast_unit_buffers(choice.module, kwargs["mixed_precision"], skip)
        state = _build_unit(choice.module, unit_sources, unit_groups, kwargs, compute_device)
        state.orig_buffer_dtypes = orig_buffer_dtypes
    return module


def is_fully_sharded(module: nn.Module) -> bool:
    """True for every module that is the root of a unit."""
    return get_state(module) is not None


# ------------------------------------------------------------------ checks
def _split_ignored(
    name: str, ignored_states: Iterable[nn.Module | nn.Parameter] | None
) -> tuple[set[nn.Module], set[nn.Parameter]]:
    modules: set[nn.Module] = set()
    params: set[nn.Parameter] = set()
    for item in ignored_states or ():
        if isinstance(item, nn.Parameter):
            params.add(item)
        elif isinstance(item, nn.Module):
            modules.add(item)
        else:
            raise TypeError(
                f"fully_shard({name}): ignored_states holds a {type(item).__name__}; pass modules or "
                "nn.Parameters."
            )
    for ignored in modules:
        params.update(ignored.parameters())
    return modules, params


def _unit_kwargs(name: str, base: dict[str, Any], choice: UnitChoice) -> dict[str, Any]:
    unknown = set(choice.overrides) - _OVERRIDABLE
    if unknown:
        raise ValueError(
            f"fully_shard({name}): the policy's overrides for {type(choice.module).__name__} name "
            f"{sorted(unknown)}, which cannot differ per unit. Overridable: {sorted(_OVERRIDABLE)}."
        )
    kwargs = {**base, **choice.overrides}
    if not isinstance(kwargs["strategy"], ShardingStrategy):
        raise TypeError(f"fully_shard({name}): strategy must be a ShardingStrategy, got {kwargs['strategy']!r}.")
    return kwargs


def _plan_ownership(
    root: nn.Module,
    choices: list[UnitChoice],
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
) -> dict[int, list[FlatParamSource]]:
    """For each new unit (by module id), its parameters and their owners.

    A parameter belongs to the closest unit containing every module that
    registers it. A parameter already owned by an earlier unit that is also
    registered outside that unit cannot be owned by anyone: error.
    """
    new_units = {id(choice.module) for choice in choices}
    owned_before: dict[int, tuple[str, UnitState]] = {}
    for unit_name, state in unit_states_under(root):
        for handle in state.handles:
            for param in handle.orig_params:
                owned_before[id(param)] = (unit_name, state)

    # id(param) -> (param, [(owner, chain of enclosing unit module ids)])
    registrations: OrderedDict[int, tuple[nn.Parameter, list[tuple[ParamOwner, tuple[int, ...]]]]] = OrderedDict()

    def visit(module: nn.Module, prefix: str, chain: tuple[int, ...]) -> None:
        if module in ignored_modules:
            return
        if id(module) in new_units or get_state(module) is not None:
            chain = chain + (id(module),)
        for attr, param in module._parameters.items():
            if param is None or param in ignored_params:
                continue
            owner = ParamOwner(module, attr, f"{prefix}{attr}")
            registrations.setdefault(id(param), (param, []))[1].append((owner, chain))
        for child_name, child in module._modules.items():
            if child is not None:
                visit(child, f"{prefix}{child_name}.", chain)

    visit(root, "", ())
    sources: dict[int, list[FlatParamSource]] = {id(choice.module): [] for choice in choices}
    for param, regs in registrations.values():
        chains = [chain for _, chain in regs]
        if id(param) in owned_before:
            unit_name, state = owned_before[id(param)]
            outside = [owner.fqn for owner, chain in regs if id(state.module) not in chain]
            if outside:
                raise ValueError(
                    f"fully_shard({type(root).__name__}): parameter '{outside[0]}' is the same tensor as a "
                    f"parameter of the already sharded unit '{unit_name or type(state.module).__name__}', "
                    "so it would be split between two units. Shard the module that contains both uses "
                    "instead (for tied weights: leave both under one unit, e.g. the root)."
                )
            continue
        common = _common_prefix(chains)
        owner_unit = next((uid for uid in reversed(common) if uid in new_units), None)
        if owner_unit is None or any(uid not in new_units for uid in common[common.index(owner_unit) :]):
            raise ValueError(
                f"fully_shard({type(root).__name__}): parameter '{regs[0][0].fqn}' was registered inside an "
                "already sharded unit after that unit was sharded. Register parameters before calling "
                "fully_shard on their module."
            )
        sources[owner_unit].append(FlatParamSource(param, tuple(owner for owner, _ in regs)))
    return sources


def _common_prefix(chains: list[tuple[int, ...]]) -> list[int]:
    prefix: list[int] = []
    for ids in zip(*chains):
        if any(uid != ids[0] for uid in ids):
            break
        prefix.append(ids[0])
    return prefix


def _compute_device(
    name: str,
    module: nn.Module,
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
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if real:
        return next(iter(real))
    if devices:  # everything on meta: materialise where the backend computes
        backend = dist.get_backend()
        if "nccl" in str(backend) and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    return torch.device("cpu")


# ------------------------------------------------------------ process groups
_HYBRID_GROUPS_CACHE: dict[int, tuple[ProcessGroup, ProcessGroup]] = {}


def _resolve_groups(name: str, kwargs: dict[str, Any]) -> ShardGroups:
    strategy: ShardingStrategy = kwargs["strategy"]
    process_group = kwargs["process_group"]
    mesh = kwargs["device_mesh"]
    if process_group is not None and mesh is not None:
        raise ValueError(f"fully_shard({name}): pass process_group or device_mesh, not both.")
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
        shard_group, replicate_group = _intra_node_groups(group)
        return ShardGroups(shard_group, _drop_singleton(replicate_group))
    return ShardGroups(group, None)


def _drop_singleton(group: ProcessGroup | None) -> ProcessGroup | None:
    return None if group is None or dist.get_world_size(group) == 1 else group


def _intra_node_groups(group: ProcessGroup) -> tuple[ProcessGroup, ProcessGroup]:
    """(shard within a node, replicate across nodes) for hybrid sharding
    without explicit groups; nodes have LOCAL_WORLD_SIZE ranks."""
    key = id(group)
    if key in _HYBRID_GROUPS_CACHE:
        return _HYBRID_GROUPS_CACHE[key]
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
    _HYBRID_GROUPS_CACHE[key] = (shard_group, replicate_group)
    return shard_group, replicate_group


# ------------------------------------------------------------------- build
def _build_unit(
    module: nn.Module,
    sources: list[FlatParamSource],
    groups: ShardGroups,
    kwargs: dict[str, Any],
    compute_device: torch.device,
) -> UnitState:
    mixed_precision: MixedPrecision | None = kwargs["mixed_precision"]
    cpu_offload: CPUOffload | None = kwargs["cpu_offload"]
    offload = bool(cpu_offload and cpu_offload.offload_params) and compute_device.type != "cpu"
    by_group: OrderedDict[tuple[torch.dtype, bool], list[FlatParamSource]] = OrderedDict()
    for source in sources:
        by_group.setdefault((source.param.dtype, source.param.requires_grad), []).append(source)
    handles = []
    for (dtype, _), group_sources in by_group.items():
        low_precision = mixed_precision is not None and dtype.is_floating_point
        handles.append(
            FlatParamHandle(
                group_sources,
                groups,
                compute_device=compute_device,
                param_dtype=mixed_precision.param_dtype if low_precision else None,  # type: ignore[union-attr]
                reduce_dtype=mixed_precision.reduce_dtype if low_precision else None,  # type: ignore[union-attr]
                keep_low_precision_grads=bool(low_precision and mixed_precision.keep_low_precision_grads),  # type: ignore[union-attr]
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
    state = UnitState(module, handles, groups, config, compute_device)
    register_hooks(state)
    state.module_hooks.extend(register_state_dict_hooks(state))
    register_state(module, state)
    return state

