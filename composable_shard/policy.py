"""Owns: which modules of a tree become sharded units.

Knows nothing of: hooks, tensors' storage, process groups.

Public names: ``Policy``, ``ModuleWrapPolicy``, ``SizeBasedPolicy``,
``CustomPolicy``, ``LayoutPolicy``, ``SmallUnitGroups``, ``UnitChoice``,
``select_units``, ``unit_name``, ``is_small_unit``,
``is_container_without_forward``, ``SMALL_UNIT_GROUP_BYTES``.

A policy is asked about each module of the tree below the root (the root is
always a unit). Modules already made units by an earlier ``fully_shard`` call,
and ignored modules, are skipped with their subtrees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch.nn as nn

from .api import ShardingStrategy

__all__ = [
    "Policy",
    "ModuleWrapPolicy",
    "SizeBasedPolicy",
    "CustomPolicy",
    "LayoutPolicy",
    "SmallUnitGroups",
    "UnitChoice",
    "select_units",
    "unit_name",
    "is_small_unit",
    "is_container_without_forward",
    "reads_children_parameters",
    "SMALL_UNIT_GROUP_BYTES",
]

# [Note: containers without a forward]
# A unit gathers in its module's forward pre-hook. ``nn.ModuleList`` and
# its kin have no forward: their parent calls the children directly, so a
# unit made of one never gathered, and the children ran on their 1-D shards
# (torch's "mat2 must be a matrix" at the first forward). FSDP2 refuses
# ModuleList and ModuleDict the same way, and FSDP1's size-based policy never
# picks them. So ``fully_shard`` refuses such a module, given or chosen by
# a policy, by name (units/rules.py: ``choose_units``), and
# ``SizeBasedPolicy`` passes over it (its parameters go to the unit above,
# or to its children's units). A subclass that defines ``forward`` is an
# ordinary module. Pinned by tests/runtime/test_errors.py
# (test_containers_without_a_forward_are_refused_and_passed_over).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def is_container_without_forward(module: nn.Module) -> bool:
    """Whether ``module`` is a container whose class defines no forward
    ([Note: containers without a forward])."""
    return isinstance(module, _CONTAINERS) and type(module).forward is nn.Module.forward


# [Note: modules that read their children's parameters]
# ``nn.MultiheadAttention`` hands ``out_proj.weight`` and ``out_proj.bias``
# to ``F.multi_head_attention_forward`` and never calls ``out_proj``: a unit
# there would never gather, and the attention ran on its 1-D shards (torch's
# "mat2 must be a matrix"). Policies never look inside such a module (its
# children's parameters go to the unit that holds it; FSDP1's size-based
# policy does the same), and a child made a unit by hand is refused by name
# when a ``fully_shard`` call covers the parent (units/rules.py). Pinned by
# tests/runtime/test_errors.py
# (test_children_of_multihead_attention_are_never_units).
def reads_children_parameters(module: nn.Module) -> bool:
    """Whether ``module``'s forward reads its children's parameters without
    calling them ([Note: modules that read their children's parameters])."""
    return isinstance(module, nn.MultiheadAttention)

# ``SmallUnitGroups``' default group size: the default size of a bucket of
# small units' all-gathers (``comm.GATHER_BUCKET_BYTES``), which a unit
# joins when it holds at most a quarter of it.
SMALL_UNIT_GROUP_BYTES = 1 << 20


def is_small_unit(nbytes: int, group_bytes: int = SMALL_UNIT_GROUP_BYTES) -> bool:
    """Whether a unit of ``nbytes`` of parameters may join a group of
    ``group_bytes`` (``SmallUnitGroups``): at most a quarter of it."""
    return 4 * nbytes <= group_bytes


@dataclass(frozen=True, eq=False)
class UnitChoice:
    """A module chosen as a unit, with keyword overrides for its
    ``fully_shard`` arguments (from ``CustomPolicy``); with ``group``, the
    unit is a group of ``module`` and those modules, as
    ``fully_shard([module, *group])`` makes it."""

    module: nn.Module
    overrides: dict[str, Any] = field(default_factory=dict)
    group: tuple[nn.Module, ...] = ()

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """The unit's modules: ``module``, then the rest of its group."""
        return (self.module, *self.group)


class Policy:
    """Base class: decides units over a tree, children before parents."""

    def select(self, root: nn.Module, skip: Callable[[nn.Module], bool]) -> list[UnitChoice]:
        """Units strictly below ``root`` (post-order), never inside a skipped
        module."""
        raise NotImplementedError


class _PerModulePolicy(Policy):
    """A policy that judges each module on its own."""

    def decide(self, module: nn.Module) -> bool | dict[str, Any]:
        raise NotImplementedError

    def select(self, root: nn.Module, skip: Callable[[nn.Module], bool]) -> list[UnitChoice]:
        chosen: list[UnitChoice] = []

        def visit(module: nn.Module) -> None:
            for child in module.children():
                if skip(child):
                    continue
                if not reads_children_parameters(child):
                    visit(child)
                decision = self.decide(child)
                if decision is True or isinstance(decision, dict):
                    chosen.append(UnitChoice(child, dict(decision) if isinstance(decision, dict) else {}))
                elif decision is not False:
                    raise TypeError(
                        f"{type(self).__name__}: the policy returned {decision!r} for "
                        f"{type(child).__name__}; return a bool or a dict of fully_shard overrides."
                    )

        visit(root)
        return chosen


class ModuleWrapPolicy(_PerModulePolicy):
    """Every instance of one of ``module_classes`` is a unit."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        self.module_classes = tuple(module_classes)
        for cls in self.module_classes:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise TypeError(f"ModuleWrapPolicy: {cls!r} is not an nn.Module subclass.")

    def decide(self, module: nn.Module) -> bool:
        return isinstance(module, self.module_classes)


class CustomPolicy(_PerModulePolicy):
    """``fn(module) -> bool | dict``: a dict makes the module a unit and
    overrides ``fully_shard`` keyword arguments for it."""

    def __init__(self, fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        if not callable(fn):
            raise TypeError(f"CustomPolicy: expected a callable, got {type(fn).__name__}.")
        self.fn = fn

    def decide(self, module: nn.Module) -> bool | dict[str, Any]:
        return self.fn(module)


class SizeBasedPolicy(Policy):
    """Bottom-up: a subtree with at least ``min_num_params`` parameters not yet
    claimed by a unit below it becomes a unit. Parameters of units made
    earlier and of ignored modules are not counted (they are claimed: an
    earlier unit's are its local shard, of another size on every rank)."""

    def __init__(self, min_num_params: int) -> None:
        if min_num_params < 1:
            raise ValueError(f"SizeBasedPolicy: min_num_params must be >= 1, got {min_num_params}.")
        self.min_num_params = min_num_params

    def select(self, root: nn.Module, skip: Callable[[nn.Module], bool]) -> list[UnitChoice]:
        chosen: list[UnitChoice] = []
        claimed: set[int] = set()

        def unclaimed_numel(module: nn.Module) -> int:
            return sum(p.numel() for p in module.parameters() if id(p) not in claimed)

        def visit(module: nn.Module) -> None:
            for child in module.children():
                if skip(child):
                    claimed.update(id(p) for p in child.parameters())
                    continue
                if not reads_children_parameters(child):
                    visit(child)
                if is_container_without_forward(child):
                    continue  # [Note: containers without a forward]
                if unclaimed_numel(child) >= self.min_num_params:
                    chosen.append(UnitChoice(child))
                    claimed.update(id(p) for p in child.parameters())

        visit(root)
        return chosen


class SmallUnitGroups(Policy):
    """The units ``base`` picks, each run of consecutive small ones made one
    group (as ``fully_shard([a, b, ...])`` makes it): siblings, adjacent
    among their parent's children, none holding another unit, each with at
    most a quarter of ``max_bytes`` of parameters, the group at most
    ``max_bytes`` and of one set of ``fully_shard`` overrides.

    [Note: groups of small units]
    A unit costs the runtime about the same per step whatever its size: four
    hooks, its views, its flat parameters' gradients and optimizer steps. A
    block of a few hundred KB pays that per block, where DDP pays nothing
    (docs/benchmarks.md, "Small units"). A group of such blocks pays it once:
    one flat parameter per dtype and trainability for all of them, gathered
    before the first runs, resharded after the last, its gradient reduced
    once the last one's backward is done ([Note: grouped units] in
    runtime/groups.py). What it costs: while the group computes, all its
    blocks are gathered (at most ``max_bytes``, what a bucket of coalesced
    all-gathers holds anyway), and in backward its blocks' gradients wait
    for the last one (at most ``max_bytes`` more); ``plan`` counts both. A
    parameter's local part follows its group's flat layout (the parameters
    of the group's modules back to back, in order). Adjacent siblings are
    taken to run one after another, as the plan takes registration order
    for forward order; a group whose modules run apart is still correct
    (gathered from the first to the last). With ``memory_budget`` the
    groups are kept where the budget holds them, else ``base``'s units are
    laid out (``plan``; [Note: a layout chosen for a memory budget] in
    planning/budget.py), and ``plan`` advises grouping where eight or more
    units are this small (planning/advice.py). Pinned by
    tests/training/test_small_unit_groups.py.
    """

    def __init__(
        self,
        base: Policy | set[type[nn.Module]] | frozenset[type[nn.Module]],
        max_bytes: int = SMALL_UNIT_GROUP_BYTES,
    ) -> None:
        if base is None or isinstance(base, SmallUnitGroups):
            raise TypeError(
                f"SmallUnitGroups: base must be the policy whose units are grouped (a Policy or a set of module "
                f"classes), got {type(base).__name__}."
            )
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(
                f"SmallUnitGroups: max_bytes must be a positive int number of bytes, got {max_bytes!r}. Pass, for "
                "example, 2**20 for groups of up to 1 MiB of parameters."
            )
        # The policy whose units are grouped (a frozenset of classes as a set).
        self.base: Policy | set[type[nn.Module]] = set(base) if isinstance(base, frozenset) else base
        self.max_bytes = max_bytes

    def select(self, root: nn.Module, skip: Callable[[nn.Module], bool]) -> list[UnitChoice]:
        choices = select_units(root, self.base, skip)
        chosen = {id(choice.module) for choice in choices}
        small: dict[int, tuple[UnitChoice, int]] = {}  # leaf units of at most a quarter of max_bytes
        for choice in choices:
            if choice.group or any(
                m is not choice.module and (skip(m) or id(m) in chosen) for m in choice.module.modules()
            ):
                continue  # a group already, or a unit holding units
            nbytes = sum(p.numel() * p.element_size() for p in choice.module.parameters())
            if is_small_unit(nbytes, self.max_bytes):
                small[id(choice.module)] = (choice, nbytes)
        group_of: dict[int, list[UnitChoice]] = {}  # every member's module id -> its group
        for parent in root.modules():
            run: list[UnitChoice] = []
            run_bytes = 0
            for child in [*parent.children(), None]:  # None ends the last run
                entry = small.get(id(child)) if child is not None and id(child) not in group_of else None
                if entry is not None and run and entry[0].overrides == run[0].overrides:
                    if run_bytes + entry[1] <= self.max_bytes:
                        run.append(entry[0])
                        run_bytes += entry[1]
                        continue
                if len(run) > 1:
                    group_of.update((id(member.module), run) for member in run)
                run, run_bytes = ([entry[0]], entry[1]) if entry is not None else ([], 0)
        grouped: list[UnitChoice] = []
        for choice in choices:
            members = group_of.get(id(choice.module))
            if members is None:
                grouped.append(choice)
            elif choice is members[-1]:  # post-order: the group where its last module was
                first = members[0]
                grouped.append(UnitChoice(first.module, first.overrides, tuple(m.module for m in members[1:])))
        return grouped


class LayoutPolicy(Policy):
    """The units ``base`` picks, each given the sharding strategy
    ``layouts`` names for it (by its name under the root, as
    ``ShardingPlan.layouts`` has it); a strategy ``base`` itself overrides is
    kept. ``root_strategy``: the layout planned for the root, which a policy
    cannot set: pass it as ``fully_shard``'s ``strategy``. ``bucket_bytes``:
    the size of the tree's buckets of small units' all-gathers and of its
    buckets of reductions ([Note: coalesced all-gathers] in
    runtime/gather_buckets.py, [Note: coalesced reductions] in
    runtime/grad_buckets.py): None for ``comm.GATHER_BUCKET_BYTES`` and
    ``comm.REDUCE_BUCKET_BYTES``, 0 for none (every unit gathered and
    reduced alone), where a budget holds the layouts only with smaller
    buckets or none. ``coalesce=False`` means ``bucket_bytes=0``;
    ``policy.coalesce`` reads whether there are buckets. Made by
    ``ShardingPlan.layout_policy()`` ([Note: a layout chosen for a memory
    budget] in planning/budget.py)."""

    def __init__(
        self,
        base: Policy | set[type[nn.Module]] | frozenset[type[nn.Module]] | None,
        layouts: dict[str, ShardingStrategy],
        *,
        root_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
        coalesce: bool = True,
        bucket_bytes: int | None = None,
    ) -> None:
        for unit_name, strategy in [*layouts.items(), ("<root>", root_strategy)]:
            if not isinstance(strategy, ShardingStrategy):
                raise TypeError(
                    f"LayoutPolicy: the layout of {unit_name!r} is {strategy!r}; give a ShardingStrategy per unit name."
                )
        self.base = base
        self.layouts = dict(layouts)
        self.root_strategy = root_strategy
        # The tree's bucket size (None: the comm defaults; 0: no buckets).
        self.bucket_bytes: int | None = _checked_bucket_bytes(coalesce, bucket_bytes)

    @property
    def coalesce(self) -> bool:
        """Whether the tree coalesces small units' collectives (``bucket_bytes`` is not 0)."""
        return self.bucket_bytes != 0

    def select(self, root: nn.Module, skip: Callable[[nn.Module], bool]) -> list[UnitChoice]:
        names = {id(module): name for name, module in root.named_modules()}
        chosen: list[UnitChoice] = []
        for choice in select_units(root, self.base, skip):
            name = unit_name(choice, names)
            if "strategy" in choice.overrides:
                chosen.append(choice)
                continue
            if name not in self.layouts:
                raise ValueError(
                    f"LayoutPolicy: unit {name!r} ({type(choice.module).__name__}) has no planned layout. Plan this "
                    "model with the same policy and ignored_states, and use that plan's layout_policy()."
                )
            chosen.append(UnitChoice(choice.module, {**choice.overrides, "strategy": self.layouts[name]}, choice.group))
        missing = sorted(set(self.layouts) - {unit_name(c, names) for c in chosen})
        if missing:
            raise ValueError(
                f"LayoutPolicy: planned units {missing} are not units of this model under the policy. Plan this "
                "model with the same policy and ignored_states, and use that plan's layout_policy()."
            )
        return chosen


def unit_name(choice: UnitChoice, names: dict[int, str]) -> str:
    """A chosen unit's name under the root (``names``: module id to name),
    a group's its modules' names joined with "+", as ``plan`` names units."""
    return "+".join(names.get(id(module), "") for module in choice.modules)


def _checked_bucket_bytes(coalesce: bool, bucket_bytes: int | None) -> int | None:
    """``LayoutPolicy``'s ``bucket_bytes`` (0 where ``coalesce`` is False)."""
    if not isinstance(coalesce, bool):
        raise TypeError(
            f"LayoutPolicy: coalesce must be a bool, got {type(coalesce).__name__} {coalesce!r}. Pass "
            "coalesce=False for no buckets, or give their size as bucket_bytes."
        )
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)):
        raise TypeError(
            f"LayoutPolicy: bucket_bytes must be None or an int number of bytes, got {type(bucket_bytes).__name__} "
            f"{bucket_bytes!r}. Pass, for example, 256 * 2**10 for 256 KiB, 0 for no buckets, or None for "
            "composable_shard.comm's defaults."
        )
    if bucket_bytes is not None and bucket_bytes < 0:
        raise ValueError(
            f"LayoutPolicy: bucket_bytes must be at least 0, got {bucket_bytes}. Pass a bucket size in bytes, "
            "0 for no buckets, or None for composable_shard.comm's defaults."
        )
    if coalesce:
        return bucket_bytes
    if bucket_bytes:
        raise ValueError(
            f"LayoutPolicy: coalesce=False means no buckets, but bucket_bytes={bucket_bytes}. Pass one of the two."
        )
    return 0


def select_units(
    root: nn.Module,
    policy: Policy | set[type[nn.Module]] | frozenset[type[nn.Module]] | None,
    skip: Callable[[nn.Module], bool],
) -> list[UnitChoice]:
    """The units ``policy`` picks below ``root`` (post-order), root excluded."""
    if policy is None:
        return []
    if isinstance(policy, (set, frozenset)):
        policy = ModuleWrapPolicy(policy)
    if not isinstance(policy, Policy):
        raise TypeError(
            f"fully_shard: policy must be a Policy or a set of module classes, got {type(policy).__name__}."
        )
    return policy.select(root, skip)
