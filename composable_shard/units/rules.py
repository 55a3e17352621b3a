"""Owns: the unit rules shared by ``fully_shard`` and ``plan`` — which modules
become units (policy plus modules already sharded), each unit's keyword
arguments, which unit owns each parameter, how a unit's parameters group
into flat parameters, and the dtypes and placement of each flat parameter.

Knows nothing of: process groups, storage, hooks (it returns descriptions;
``fully_shard`` builds handles from them and ``plan`` sizes them).

Public names: ``OVERRIDABLE``, ``split_ignored``, ``unit_skipper``,
``choose_units``, ``check_group_members``, ``check_group_inside``, ``unit_kwargs``, ``assign_param_owners``, ``group_sources``,
``FlatParamDtypes``, ``flat_param_dtypes``, ``offloads_params``.

[Note: one copy of the unit rules]
``fully_shard`` and ``plan`` both call these functions, and both lay out
flat parameters with ``flat_layout.compute_layout``, so a plan describes
exactly what ``fully_shard`` would build. Change a rule here, never in a
caller. Pinned by tests/plan/test_plan.py (units, ignored states and overrides as
``fully_shard`` makes them).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, cast

import torch
import torch.nn as nn

from ..api import CPUOffload, MixedPrecision, ShardingStrategy
from ..handle.layout import ParamOwner
from ..handle import FlatParamSource
from .composable_registry import replicated_modules
from .param_kinds import check_flattenable
from ..policy import Policy, UnitChoice, is_container_without_forward, reads_children_parameters, select_units
from ..runtime.state import UnitState, get_state, unit_states_under

__all__ = [
    "OVERRIDABLE",
    "split_ignored",
    "unit_skipper",
    "choose_units",
    "check_group_members",
    "check_group_inside",
    "unit_kwargs",
    "assign_param_owners",
    "group_sources",
    "FlatParamDtypes",
    "flat_param_dtypes",
    "offloads_params",
]

# Keyword arguments a CustomPolicy may override per unit.
OVERRIDABLE = frozenset(
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


def split_ignored(
    name: str, ignored_states: Iterable[nn.Module | nn.Parameter] | None, roots: Sequence[nn.Module]
) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """Ignored modules and every ignored parameter (those of ignored modules
    included): those given, the modules torch's ``replicate`` manages under
    ``roots`` ([Note: composing with torch's replicate] in
    units/composable_registry.py), and the parameters units sharded earlier
    under ``roots`` left out (they stay out above them, as in FSDP1; before,
    the parent's call refused them as "registered after that unit was
    sharded")."""
    modules: set[nn.Module] = replicated_modules(name, roots)
    params: set[nn.Parameter] = set()
    for item in ignored_states or ():
        if isinstance(item, nn.Parameter):
            params.add(item)
        elif isinstance(item, nn.Module):
            if get_state(item) is not None:
                raise ValueError(
                    f"fully_shard({name}): ignored_states holds {type(item).__name__}, which an earlier "
                    "fully_shard call made a unit; a unit cannot be left out of the tree above it. Drop it from "
                    "ignored_states, or pass its own ignored_states when sharding it."
                )
            modules.add(item)
        else:
            raise TypeError(
                f"fully_shard({name}): ignored_states holds a {type(item).__name__}; pass modules or "
                "nn.Parameters."
            )
    for ignored in modules:
        params.update(ignored.parameters())
    for root in roots:
        for _, state in unit_states_under(root):
            params.update(state.ignored_params)
    return modules, params


def unit_skipper(ignored_modules: set[nn.Module]) -> Callable[[nn.Module], bool]:
    """The predicate policies and initialisation use: modules already sharded
    and ignored modules are skipped with their subtrees."""

    def skip(candidate: nn.Module) -> bool:
        return get_state(candidate) is not None or candidate in ignored_modules

    return skip


def _group_modules(module: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The modules of ``fully_shard``'s argument: a group's (a list or
    tuple of modules), else ``[module]``."""
    if isinstance(module, (list, tuple)):
        return list(module)
    return [cast(nn.Module, module)]  # not a list or tuple: one module (fully_shard checked it)


def choose_units(
    module: nn.Module | Sequence[nn.Module],
    policy: Policy | set[type[nn.Module]] | None,
    ignored_modules: set[nn.Module],
) -> list[UnitChoice]:
    """The new units of a ``fully_shard(module, policy=...)`` call: the
    policy's choices (post-order; some may be groups, ``SmallUnitGroups``),
    then ``module`` itself. For a group (a list of modules) the policy's
    choices under each module, then one choice for the group, keyed by its
    first module."""
    members = _group_modules(module)
    choices = [choice for member in members for choice in select_units(member, policy, unit_skipper(ignored_modules))]
    choices.append(UnitChoice(members[0], group=tuple(members[1:])))
    for choice in choices:
        for unit_module in choice.modules:
            if is_container_without_forward(unit_module):
                _refuse_container(unit_module, members, by_policy=choice is not choices[-1])
    _refuse_units_read_by_their_parent(members, {id(m) for choice in choices for m in choice.modules})
    return choices


def _refuse_units_read_by_their_parent(members: list[nn.Module], new_units: set[int]) -> None:
    """[Note: modules that read their children's parameters] in policy.py:
    a child of such a module, made a unit earlier or in this call, is
    refused by name."""
    for member in members:
        for name, module in member.named_modules():
            if not reads_children_parameters(module):
                continue
            for child_name, child in module.named_children():
                if id(child) in new_units or get_state(child) is not None:
                    where = f"{name}.{child_name}" if name else child_name
                    raise ValueError(
                        f"fully_shard({type(member).__name__}): '{where}' ({type(child).__name__}) is a unit, but "
                        f"its parent {type(module).__name__} reads its parameters without calling it, so the unit "
                        f"would never gather. Make '{name or type(member).__name__}' (or a module above it) the "
                        "unit instead; policies never pick such a child."
                    )


def _refuse_container(container: nn.Module, members: list[nn.Module], *, by_policy: bool) -> None:
    """[Note: containers without a forward] in policy.py."""
    kind = type(container).__name__
    if by_policy:
        where = next(name for member in members for name, sub in member.named_modules() if sub is container)
        chosen = f"the policy chose '{where}' ({kind}) as a unit, but a {kind}"
    else:
        chosen = f"a {kind}"
    raise ValueError(
        f"fully_shard({'+'.join(type(m).__name__ for m in members)}): {chosen} has no forward of its own: "
        "its parent calls its children directly, so the unit would never gather. Shard its elements "
        "(e.g. each block: policy=ModuleWrapPolicy({Block})) or the module that calls them."
    )


def check_group_members(given: Any) -> list[nn.Module]:
    """The modules of ``fully_shard([a, b, ...])``, checked: a non-empty
    list of distinct modules, none sharded already, none inside another."""
    label = f"fully_shard([{', '.join(type(m).__name__ for m in given)}])" if given else "fully_shard([])"
    if not given:
        raise ValueError(f"{label}: the list of modules is empty. Pass the modules that form one unit.")
    for item in given:
        if not isinstance(item, nn.Module):
            raise TypeError(f"{label}: expected nn.Modules in the list, got a {type(item).__name__}.")
    if len({id(m) for m in given}) != len(given):
        raise ValueError(f"{label}: a module appears twice in the list. Name each module of the group once.")
    for index, member in enumerate(given):
        if get_state(member) is not None:
            raise ValueError(
                f"{label}: module {index} ({type(member).__name__}) is already sharded (by an earlier "
                "fully_shard call or its policy). A module can belong to one unit only."
            )
        for other_index, other in enumerate(given):
            if other is not member and any(sub is other for sub in member.modules()):
                raise ValueError(
                    f"{label}: module {other_index} ({type(other).__name__}) is inside module {index} "
                    f"({type(member).__name__}). A group's modules must be disjoint: drop the inner one (its "
                    "parameters already belong to the outer one's unit) or shard it separately first."
                )
    return list(given)


def unit_kwargs(name: str, base: dict[str, Any], choice: UnitChoice) -> dict[str, Any]:
    """``base`` with the policy's overrides for ``choice`` applied."""
    unknown = set(choice.overrides) - OVERRIDABLE
    if unknown:
        raise ValueError(
            f"fully_shard({name}): the policy's overrides for {type(choice.module).__name__} name "
            f"{sorted(unknown)}, which cannot differ per unit. Overridable: {sorted(OVERRIDABLE)}."
        )
    kwargs = {**base, **choice.overrides}
    if not isinstance(kwargs["strategy"], ShardingStrategy):
        raise TypeError(f"fully_shard({name}): strategy must be a ShardingStrategy, got {kwargs['strategy']!r}.")
    return kwargs


def assign_param_owners(
    root: nn.Module | Sequence[nn.Module],
    choices: list[UnitChoice],
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
) -> dict[int, list[FlatParamSource]]:
    """For each new unit (by module id; a group by its first module's), its
    parameters and their owners. ``root`` is the module given to
    ``fully_shard``, or a group's list of modules (the last choice).

    A parameter belongs to the closest unit containing every module that
    registers it. A parameter already owned by an earlier unit that is also
    registered outside that unit cannot be owned by anyone: error.

    [Note: unit keys]
    A unit is known in the chains below by one key: a new unit by its
    module's id (a new group by its first module's, for every module of
    the group), a unit sharded earlier by its state's id (a group's
    modules share one state). So tied weights used by two modules of one
    group find the group as their closest common unit. Pinned by
    tests/training/test_grouped_units.py.
    """
    roots = _group_modules(root)
    name = "+".join(type(r).__name__ for r in roots)
    new_units = {id(choice.module) for choice in choices}
    # A group (the list given, or one its policy made): every module is known by the group's key.
    key_of = {id(member): id(choice.module) for choice in choices for member in choice.modules}
    owned_before: dict[int, tuple[str, UnitState]] = {}
    for top in roots:
        for unit_name, state in unit_states_under(top):
            check_group_inside(name, top, state)
            for handle in state.handles:
                for param in handle.orig_params:
                    owned_before[id(param)] = (unit_name, state)

    # id(param) -> (param, [(owner, chain of enclosing unit module ids)])
    registrations: OrderedDict[int, tuple[nn.Parameter, list[tuple[ParamOwner, tuple[int, ...]]]]] = OrderedDict()

    def visit(module: nn.Module, prefix: str, chain: tuple[int, ...]) -> None:
        if module in ignored_modules:
            return
        state = get_state(module)
        if id(module) in key_of:
            chain = chain + (key_of[id(module)],)
        elif state is not None:
            chain = chain + (id(state),)
        for attr, param in module._parameters.items():
            if param is None or param in ignored_params:
                continue
            owner = ParamOwner(module, attr, f"{prefix}{attr}")
            registrations.setdefault(id(param), (param, []))[1].append((owner, chain))
        for child_name, child in module._modules.items():
            if child is not None:
                visit(child, f"{prefix}{child_name}.", chain)

    for index, top in enumerate(roots):
        # A group's parameters are named by the module's index in the list
        # until the root names the group ("norm+output.1.weight").
        visit(top, f"{index}." if len(roots) > 1 else "", ())
    sources: dict[int, list[FlatParamSource]] = {id(choice.module): [] for choice in choices}
    for param, regs in registrations.values():
        chains = [chain for _, chain in regs]
        if id(param) in owned_before:
            unit_name, state = owned_before[id(param)]
            outside = [owner.fqn for owner, chain in regs if id(state) not in chain]
            if outside:
                raise ValueError(
                    f"fully_shard({name}): parameter '{outside[0]}' is the same tensor as a "
                    f"parameter of the already sharded unit '{unit_name or type(state.module).__name__}', "
                    "so it would be split between two units. Shard the module that contains both uses "
                    "instead (for tied weights: leave both under one unit, e.g. the root)."
                )
            continue
        common = _common_prefix(chains)
        owner_unit = next((uid for uid in reversed(common) if uid in new_units), None)
        if owner_unit is None or any(uid not in new_units for uid in common[common.index(owner_unit) :]):
            raise ValueError(
                f"fully_shard({name}): parameter '{regs[0][0].fqn}' was registered inside an "
                "already sharded unit after that unit was sharded. Register parameters before calling "
                "fully_shard on their module."
            )
        check_flattenable(name, regs[0][0].fqn, param)  # [Note: parameters a flat parameter cannot hold]
        sources[owner_unit].append(FlatParamSource(param, tuple(owner for owner, _ in regs)))
    return sources


def check_group_inside(name: str, root: nn.Module, state: UnitState) -> None:
    """A group found under ``root`` must have every module there: a tree
    whose root runs only some of a group's modules cannot tell when the
    group's forward ends (modules of different trees)."""
    if not state.is_group:
        return
    inside = {id(m) for m in root.modules()}
    missing = [m for m in state.members if id(m) not in inside]
    if missing:
        raise ValueError(
            f"fully_shard({name}): the group of {[type(m).__name__ for m in state.members]} has "
            f"{[type(m).__name__ for m in missing]} outside {type(root).__name__}'s tree. A group's modules "
            "must all sit under one root: shard the module that contains every one of them."
        )


def _common_prefix(chains: list[tuple[int, ...]]) -> list[int]:
    prefix: list[int] = []
    for ids in zip(*chains):
        if any(uid != ids[0] for uid in ids):
            break
        prefix.append(ids[0])
    return prefix


def group_sources(sources: list[FlatParamSource]) -> list[list[FlatParamSource]]:
    """A unit's parameters split into flat parameters: one per (dtype,
    requires_grad), in order of first appearance, so frozen parameters cost
    no gradient memory and no reduction."""
    by_group: OrderedDict[tuple[torch.dtype, bool], list[FlatParamSource]] = OrderedDict()
    for source in sources:
        by_group.setdefault((source.param.dtype, source.param.requires_grad), []).append(source)
    return list(by_group.values())


@dataclass(frozen=True)
class FlatParamDtypes:
    """The dtypes one flat parameter uses under a mixed-precision policy."""

    # Unsharded buffer (all-gather and compute); None: the parameters' dtype.
    param_dtype: torch.dtype | None
    # Gradient reduction; None: the compute dtype.
    reduce_dtype: torch.dtype | None
    # Sharded gradients stay in ``reduce_dtype`` after the reduction.
    keep_low_precision_grads: bool


def flat_param_dtypes(dtype: torch.dtype, mixed_precision: MixedPrecision | None) -> FlatParamDtypes:
    """Mixed precision applies to floating-point flat parameters only."""
    if mixed_precision is None or not dtype.is_floating_point:
        return FlatParamDtypes(None, None, False)
    return FlatParamDtypes(
        mixed_precision.param_dtype, mixed_precision.reduce_dtype, mixed_precision.keep_low_precision_grads
    )


def offloads_params(cpu_offload: CPUOffload | None, compute_device: torch.device) -> bool:
    """Offloading only means something when compute is not on the CPU."""
    return bool(cpu_offload and cpu_offload.offload_params) and compute_device.type != "cpu"
