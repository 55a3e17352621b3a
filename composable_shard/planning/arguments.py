"""Owns: checking ``plan``'s and ``describe``'s arguments before anything is
computed — the extra keywords, world size and rank, the optimizer choice —
and what the choices mean (an optimizer's planned kind and label, the shard
group a strategy gives a rank).

Knows nothing of: layouts, memory arithmetic, the table.

Public names: ``checked_rank``, ``check_optimizer``, ``optimizer_kind``,
``optimizer_label``, ``shard_group``, ``budget_layouts`` (a memory budget
checked, and the layouts it may choose among).
"""

from __future__ import annotations

from typing import Any

from ..api import ShardingStrategy
from .memory import OPTIMIZERS
from .owner_memory import OwnerOptimizer, owner_optimizer

__all__ = ["checked_rank", "check_optimizer", "optimizer_kind", "optimizer_label", "shard_group", "budget_layouts"]

_MORE = {
    "rank",
    "forward_prefetch",
    "backward_prefetch",
    "limit_all_gathers",
    "device",
    "hybrid_shard_size",
    "example_inputs",
    "input_shape",
    "input_dtype",
    "loss_fn",
    "warn",
    "momentum",
    "optimizer_in_backward",
}


def checked_rank(name: str, world_size: int, optimizer: str | tuple[str, int], more: dict[str, Any]) -> int:
    """Validate ``plan``'s arguments before anything is computed; the rank."""
    unknown = set(more) - _MORE
    if unknown:
        raise TypeError(f"plan({name}): unknown keyword arguments {sorted(unknown)}; known extras: {sorted(_MORE)}.")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"plan({name}): world_size must be a positive int, got {world_size!r}.")
    rank = more.get("rank", 0)
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"plan({name}): rank must be in [0, {world_size}), got {rank!r}.")
    check_optimizer(name, optimizer, bool(more.get("optimizer_in_backward", False)), "plan")
    return rank


def check_optimizer(name: str, optimizer: Any, in_backward: bool, caller: str) -> None:
    spec = owner_optimizer(optimizer)
    if spec is None and not (isinstance(optimizer, str) and optimizer in OPTIMIZERS):
        known = sorted(set(OPTIMIZERS) - {"none"} | {"muon", "adafactor"})
        raise ValueError(
            f"{caller}({name}): optimizer {optimizer!r} is unknown; pick one of {known}, or ('owner', k) for an "
            "optimizer of your own stepped on whole parameters that keeps k tensors shaped like each parameter."
        )
    if spec is not None and in_backward:
        raise ValueError(
            f"{caller}({name}): optimizer {spec.label!r} with optimizer_in_backward=True: the plan does not model "
            "owner-stepped optimizers stepped in backward hooks yet (an exchange of whole parameters in each "
            "hook). Plan it stepped by optimizer.step() (without optimizer_in_backward), or plan an elementwise "
            "optimizer ('adamw', 'adam', 'sgd') in backward."
        )


def optimizer_kind(optimizer: Any, momentum: float) -> str | OwnerOptimizer:
    """SGD without momentum keeps no state; an owner-stepped optimizer is
    planned from its spec."""
    spec = owner_optimizer(optimizer)
    if spec is not None:
        return spec
    return "none" if optimizer == "sgd" and not momentum else optimizer


def optimizer_label(optimizer: Any) -> str:
    spec = owner_optimizer(optimizer)
    return spec.label if spec is not None else optimizer


def shard_group(name: str, strategy: ShardingStrategy, world: int, rank: int, hybrid_size: int) -> tuple[int, int]:
    """(shard world size, shard rank) as ``fully_shard._resolve_groups``
    builds the groups from the world group."""
    if strategy is ShardingStrategy.NO_SHARD:
        return 1, 0
    if strategy.is_hybrid:
        if hybrid_size < 1 or world % hybrid_size:
            raise ValueError(
                f"plan({name}): hybrid sharding needs world_size ({world}) to be a multiple of "
                f"hybrid_shard_size ({hybrid_size})."
            )
        return hybrid_size, rank % hybrid_size
    return world, rank


# The layouts a budget chooses among, least sharded first, by the most
# sharded one ``strategy=`` allows.
_BUDGET_LAYOUTS = {
    ShardingStrategy.NO_SHARD: (ShardingStrategy.NO_SHARD,),
    ShardingStrategy.SHARD_GRAD_OP: (ShardingStrategy.NO_SHARD, ShardingStrategy.SHARD_GRAD_OP),
    ShardingStrategy.FULL_SHARD: (
        ShardingStrategy.NO_SHARD,
        ShardingStrategy.SHARD_GRAD_OP,
        ShardingStrategy.FULL_SHARD,
    ),
}


def budget_layouts(name: str, memory_budget: Any, strategy: ShardingStrategy, caller: str = "plan") -> tuple[
    ShardingStrategy, ...
]:
    """Check ``memory_budget`` (bytes per rank) and return the layouts it
    may choose among, least sharded first: up to ``strategy`` (FULL_SHARD:
    all three)."""
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int):
        raise TypeError(
            f"{caller}({name}): memory_budget must be an int number of bytes per rank, got "
            f"{type(memory_budget).__name__} {memory_budget!r}. Pass, for example, 8 * 2**30 for 8 GiB."
        )
    if memory_budget <= 0:
        raise ValueError(
            f"{caller}({name}): memory_budget must be a positive number of bytes per rank, got {memory_budget}."
        )
    allowed = _BUDGET_LAYOUTS.get(strategy)
    if allowed is None:
        raise ValueError(
            f"{caller}({name}): memory_budget chooses each unit's layout among NO_SHARD, SHARD_GRAD_OP and "
            f"FULL_SHARD, up to the one strategy= names; strategy={strategy.name} is not one of them. Pass "
            "strategy=FULL_SHARD (any of the three), or give hybrid units their strategy in a CustomPolicy."
        )
    return allowed
