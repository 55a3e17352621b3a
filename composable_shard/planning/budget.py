"""Owns: choosing each unit's layout (NO_SHARD, SHARD_GRAD_OP, FULL_SHARD)
for a memory budget per rank, and the bytes each layout moves per step.

Knows nothing of: modules, policies, how a plan is assembled (``plan``
hands it a function from per-unit layouts to a finished plan).

Public names: ``UnitLayout``, ``Traffic``, ``unit_traffic``, ``choose_layouts``,
``SMALLER_BUCKETS``, ``LARGER_BUCKETS``, ``choose_bucket_size``.

[Note: a layout chosen for a memory budget]
Every layout is priced twice: the bytes it moves per step per rank (the
ring model below: an all-gather or reduce-scatter of n bytes over s ranks
moves n (s - 1) / s, an all-reduce twice that), and the peak the plan
predicts with it (``rank_bytes["total"]``, the same step replay as any
plan, so the chosen plan is exactly ``plan(model, policy=<its
layout_policy()>, strategy=<its root_strategy>)``). Each chosen unit starts
at its cheapest layout by bytes moved (ties: fewer collectives, then less
sharded): NO_SHARD for a frozen unit (replicated, kept gathered, moves
nothing) and for a trainable one in one dtype (an all-reduce moves what
SHARD_GRAD_OP's all-gather and reduce-scatter move together, in fewer
collectives). While the peak is over the budget, the move to a more sharded
layout of one unit that saves the most peak bytes per extra byte moved is
taken (a move that moves nothing more first; ties: the earlier unit). When
no single move lowers the peak, the move adding the fewest bytes is taken,
so the search ends at the most sharded layouts, which are checked to fit
first (when neither they nor the cheapest layouts fit, ``ValueError`` names
both peaks). The buckets of small units' collectives ([Note: coalesced
all-gathers] in runtime/gather_buckets.py, [Note: coalesced reductions])
are the last thing given up, and given up by degrees: a bucket saves a
collective per unit it holds, and costs up to its own bytes of memory
beside what is gathered or reduced anyway. ``plan`` chooses the layouts
with the comm defaults (1 MiB); where the most sharded layouts do not fit
with them, with buckets of 256 KiB, then 64 KiB (a unit joins an
all-gather's bucket when it is at most a quarter of it), then none; the
first size with which they fit wins, so the layouts are searched as
above at the largest buckets the budget holds. A size below the defaults
with which no unit, under any layout it may get, joins a bucket plans
exactly as none does and is skipped. The other way, where the layouts
chosen with the defaults leave room, the budget buys fewer collectives:
the same layouts with buckets of ``LARGER_BUCKETS`` (16 MiB, then 4 MiB)
are planned, and the first whose peak fits wins. The layouts are not
searched again at those sizes (a unit sharded to make room for a bucket
would move more bytes to save a collective), and a size is tried only
where it coalesces the chosen units into fewer collectives than the
defaults and every smaller size do (counted in the units' order,
``_collectives``), so a plan never names a size larger than what
changes something. On the 64 blocks of width 64 at 2 ranks
(docs/benchmarks.md), 4 MiB buckets ran 0.97-0.99 of 1 MiB's step and
16 MiB 0.96-0.98, FULL_SHARD and NO_SHARD alike; the plan's peak rose by
0.8 and 9.0 MiB with every unit FULL_SHARD and not at all with every unit
NO_SHARD (all-reduced in place). The comm defaults stay 1 MiB: without a
budget nobody said the memory is there. The plan (``bucket_bytes``), its
table and its ``layout_policy()`` say which size (``bucket_bytes=0``:
the tree gathers and reduces each unit alone); when no size fits, the
error is that of the defaults. Deterministic, and rank-independent when
every rank plans the same rank (``fully_shard`` plans rank 0). Pinned by
tests/planning/test_budget_layout.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, TypeVar

from .. import comm
from ..api import ShardingStrategy
from .memory import UnitPlan
from .step_replay import buckets_in_backward
from .table import format_bytes

__all__ = [
    "UnitLayout",
    "Traffic",
    "unit_traffic",
    "choose_layouts",
    "SMALLER_BUCKETS",
    "LARGER_BUCKETS",
    "choose_bucket_size",
]

# The bucket sizes a budget tries below the comm defaults, largest first.
SMALLER_BUCKETS = (256 << 10, 64 << 10)
# The bucket sizes a budget with room to spare tries above them, largest first.
LARGER_BUCKETS = (16 << 20, 4 << 20)


@dataclass(frozen=True)
class Traffic:
    """What one unit's collectives move per step on one rank (modelled)."""

    bytes_moved: int
    collectives: int


@dataclass(frozen=True)
class UnitLayout:
    """One unit's layout in a budgeted plan and why it was chosen."""

    name: str  # "" for the root
    strategy: ShardingStrategy
    # Modelled bytes this rank's collectives move for the unit per step.
    bytes_moved: int
    collectives: int
    # Whether the budget chose it (False: the policy or an earlier
    # fully_shard call fixed it).
    chosen: bool
    reason: str


class _HasPeak(Protocol):
    rank_bytes: dict[str, int]
    units: list[UnitPlan]


_Plan = TypeVar("_Plan", bound=_HasPeak)


def unit_traffic(unit: UnitPlan, world_size: int, *, kept_gathered: bool) -> Traffic:
    """Bytes ``unit``'s collectives move per step on one rank, by the ring
    model: per flat parameter sharded over s ranks, one all-gather (two
    where it reshards after forward and is not ``kept_gathered``: the root
    and the unit that runs last stay gathered for backward), a trainable
    one's reduce-scatter, and an all-reduce over the r = world / s replicas
    (of the shard; of the whole gradient under NO_SHARD)."""
    moved = count = 0
    for fp in unit.flat_params:
        shard_size = fp.padded_numel // fp.shard_numel if fp.shard_numel else 1
        replicas = max(world_size // shard_size, 1)
        param_size, reduce_size = fp.param_dtype.itemsize, fp.reduce_dtype.itemsize
        if shard_size > 1:
            gathers = 2 if unit.strategy.reshards_after_forward and not kept_gathered else 1
            moved += gathers * fp.padded_numel * param_size * (shard_size - 1) // shard_size
            count += gathers
        if not fp.requires_grad:
            continue
        if shard_size > 1:
            moved += fp.padded_numel * reduce_size * (shard_size - 1) // shard_size
            count += 1
        if replicas > 1:
            reduced = fp.shard_numel if shard_size > 1 else fp.padded_numel
            moved += 2 * reduced * reduce_size * (replicas - 1) // replicas
            count += 1
    return Traffic(moved, count)


def choose_layouts(
    units: Sequence[UnitPlan],
    *,
    chosen: Sequence[str],
    allowed: tuple[ShardingStrategy, ...],
    unit_for: Callable[[str, ShardingStrategy], UnitPlan],
    assemble: Callable[[list[UnitPlan]], _Plan],
    world_size: int,
    budget: int,
    caller: str,
) -> tuple[_Plan, list[UnitLayout]]:
    """The plan whose chosen units' layouts fit ``budget`` while moving the
    fewest bytes ([Note: a layout chosen for a memory budget]) and every
    unit's ``UnitLayout``. ``units``: the planned units in order (those not
    in ``chosen`` keep theirs); ``allowed``: least sharded first;
    ``unit_for(name, strategy)``: a chosen unit under a layout;
    ``assemble``: the plan of a list of units."""
    kept = {units[0].name, units[-1].name} if units else set()
    rank_of = {strategy: index for index, strategy in enumerate(allowed)}

    def traffic(name: str, strategy: ShardingStrategy) -> Traffic:
        return unit_traffic(unit_for(name, strategy), world_size, kept_gathered=name in kept)

    def build(layouts: dict[str, ShardingStrategy]) -> _Plan:
        return assemble([unit_for(u.name, layouts[u.name]) if u.name in layouts else u for u in units])

    def cheapest(name: str) -> ShardingStrategy:
        return min(allowed, key=lambda s: (traffic(name, s).bytes_moved, traffic(name, s).collectives, rank_of[s]))

    current = {name: cheapest(name) for name in chosen}
    reasons = {name: _cheapest_reason(unit_for(name, current[name]), current[name]) for name in chosen}
    result = build(current)
    if result.rank_bytes["total"] > budget:
        most = build(dict.fromkeys(chosen, allowed[-1]))
        if most.rank_bytes["total"] > budget:
            fitting = min(most.rank_bytes["total"], result.rank_bytes["total"])
            raise ValueError(
                f"{caller}: memory_budget {format_bytes(budget)} ({budget} bytes) per rank is below this model's "
                f"peak on {world_size} ranks with every unit {allowed[-1].name}, {format_bytes(most.rank_bytes['total'])}, "
                f"and with every unit at its cheapest layout, {format_bytes(result.rank_bytes['total'])}. Raise the "
                f"budget to at least {fitting} bytes, or lower the peak: more ranks, smaller units (a policy over "
                "their submodules), mixed precision, CPU offload."
            )
    while result.rank_bytes["total"] > budget:
        best: tuple[tuple[float, float, float], str, ShardingStrategy, _Plan, int, int] | None = None
        for name in chosen:
            for strategy in allowed[rank_of[current[name]] + 1:]:
                trial = build({**current, name: strategy})
                saved = result.rank_bytes["total"] - trial.rank_bytes["total"]
                extra = traffic(name, strategy).bytes_moved - traffic(name, current[name]).bytes_moved
                if saved > 0:
                    key = (1.0, saved / extra if extra > 0 else math.inf, float(saved))
                else:
                    key = (0.0, float(-extra), 0.0)
                if best is None or key > best[0]:
                    best = (key, name, strategy, trial, saved, extra)
        if best is None:  # every chosen unit at the most sharded layout, which fits (checked above)
            break
        _, name, strategy, result, saved, extra = best
        current[name] = strategy
        reasons[name] = (
            f"sharded for the budget: {format_bytes(saved)} less peak for {format_bytes(extra)} more moved"
            if saved > 0
            else f"sharded on the way to the budget (alone it lowers no peak), {format_bytes(extra)} more moved"
        )
    layouts = []
    for unit in units:
        is_chosen = unit.name in current
        strategy = current.get(unit.name, unit.strategy)
        moved = unit_traffic(unit_for(unit.name, strategy) if is_chosen else unit, world_size,
                             kept_gathered=unit.name in kept)
        reason = reasons.get(unit.name, "fixed by the policy or an earlier fully_shard call")
        layouts.append(UnitLayout(unit.name, strategy, moved.bytes_moved, moved.collectives, is_chosen, reason))
    return result, layouts


def choose_bucket_size(
    choose: Callable[[int | None], tuple[_Plan, list[UnitLayout]]],
    units: Sequence[UnitPlan],
    world_size: int,
    *,
    at_size: Callable[[list[UnitLayout], int], _Plan],
    budget: int,
) -> tuple[_Plan, list[UnitLayout]]:
    """``choose(bucket_bytes)`` (``choose_layouts`` with buckets of that size:
    None for the comm defaults, 0 for none) at the largest size that fits
    ([Note: a layout chosen for a memory budget]): the defaults, then each
    of ``SMALLER_BUCKETS`` below them with which a unit of ``units`` (every
    unit under every layout it may get) joins a bucket, then none. Raises
    the defaults' ``ValueError`` when none fits. Where the defaults fit,
    the first of ``LARGER_BUCKETS`` whose plan of the same layouts
    (``at_size(layouts, bucket_bytes)``) is within ``budget``, among those
    that make the chosen units fewer collectives, instead."""
    if world_size == 1:  # no buckets on one rank
        return choose(None)
    largest = min(comm.REDUCE_BUCKET_BYTES, comm.GATHER_BUCKET_BYTES)
    smaller = [
        size
        for size in SMALLER_BUCKETS
        if size < largest and any(u.bucket_key(size) is not None or u.gather_key(size) is not None for u in units)
    ]
    try:
        result, layouts = choose(None)
    except ValueError as with_defaults:
        for size in [*smaller, 0]:
            try:
                return choose(size)
            except ValueError:
                continue
        raise with_defaults from None
    if largest <= 0:  # the comm defaults switched buckets off: no larger ones either
        return result, layouts
    # Each larger size that makes fewer collectives than every smaller one
    # (the defaults included), largest first.
    fewest = _collectives(result.units, None)
    worth: list[int] = []
    for size in sorted(LARGER_BUCKETS):
        count = _collectives(result.units, size)
        if size > max(comm.REDUCE_BUCKET_BYTES, comm.GATHER_BUCKET_BYTES) and count < fewest:
            fewest = count
            worth.insert(0, size)
    for size in worth:
        larger = at_size(layouts, size)
        if larger.rank_bytes["total"] <= budget:
            return larger, layouts
    return result, layouts


def _collectives(units: Sequence[UnitPlan], bucket_bytes: int | None) -> int:
    """All-gathers and reductions of one pass over ``units`` with buckets of
    ``bucket_bytes`` (None: the comm defaults): the reductions by the
    replay's own rule (``buckets_in_backward``, plus each trainable unit
    reduced alone); the all-gathers in the units' order, a unit joining the
    open bucket while its key matches and the bucket holds it ([Note:
    coalesced all-gathers]). A count to compare bucket sizes by."""
    gather = comm.GATHER_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    reduce = comm.REDUCE_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    buckets = buckets_in_backward(units, reduce)
    in_buckets = sum(len(bucket) for bucket in buckets)
    trainable = sum(1 for unit in units if any(fp.requires_grad for fp in unit.flat_params))
    count = len(buckets) + trainable - in_buckets
    open_key: tuple | None = None
    held = 0
    for unit in units:
        gathered = [fp for fp in unit.flat_params if fp.needs_unshard_storage and fp.is_sharded]
        if not gathered:
            continue  # replicated, or nothing to gather
        key = unit.gather_key(gather)
        nbytes = sum(comm.gatherable_bytes(fp.padded_numel, fp.param_dtype, gather) for fp in gathered)
        if key is not None and key == open_key and held + nbytes <= gather:
            held += nbytes
            continue
        count += 1
        open_key, held = key, nbytes
    return count


def _cheapest_reason(unit: UnitPlan, strategy: ShardingStrategy) -> str:
    trainable = any(fp.requires_grad for fp in unit.flat_params)
    if strategy is ShardingStrategy.NO_SHARD:
        if not unit.flat_params:
            return "no parameters: nothing to move"
        if not trainable:
            return "fits replicated: frozen, kept gathered, moves nothing"
        return "fits replicated: no all-gather, gradients all-reduced"
    return f"fits {strategy.name}: the fewest bytes moved of the allowed layouts"
