"""Owns: the printed form of a ``ShardingPlan`` (``str(plan)``).

Knows nothing of: how the numbers are computed, nor ``sharding_plan.py``
itself (it reads the fields ``PlanFields`` names).

Public names: ``format_plan``, ``format_bytes``, ``PlanFields``.

[Note: the plan package's imports go one way]
``sharding_plan.py`` imports this module (``ShardingPlan.__str__`` is
``format_plan``), so this module must not import ``sharding_plan.py`` back,
not even for a type hint: ``format_plan`` takes anything with the fields of
``PlanFields``, a protocol ``ShardingPlan`` satisfies. The order is
``memory.py`` <- ``table.py`` <- ``sharding_plan.py`` (which also imports
``memory.py`` and ``activations.py``); tests/layout/test_import_graph.py checks it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .. import comm
from ..policy import SmallUnitGroups
from .memory import UnitPlan

__all__ = ["format_plan", "format_bytes", "PlanFields"]


class PlanFields(Protocol):
    """What the table reads of a plan (``ShardingPlan``'s fields of these names)."""

    world_size: int
    rank: int
    optimizer: str
    units: list[UnitPlan]  # as ShardingPlan declares it (a protocol's attributes are invariant)
    rank_bytes: dict[str, int]
    optimizer_by_kind: dict[str, int]
    peak_moment: str
    warnings: list[str]
    source: str


def format_bytes(count: int) -> str:
    """Bytes for people: exact below 1 KiB, else two decimals of KiB/MiB/GiB."""
    if count < 1024:
        return f"{count} B"
    value = float(count)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.2f} {unit}"
    return f"{count} B"  # unreachable


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def format_plan(plan: PlanFields) -> str:
    """The table ``str(plan)`` prints: one row per flat parameter, then what
    rank ``plan.rank`` holds after a step and at the step's worst moment."""
    header = ["unit", "type", "params", "flat param", "padded", "padding", "shard"]
    rows: list[list[str]] = []
    for unit in plan.units:
        for index, fp in enumerate(unit.flat_params):
            kind = "trainable" if fp.requires_grad else "frozen"
            first = index == 0
            rows.append(
                [
                    (unit.name or "<root>") if first else "",
                    unit.module_type if first else "",
                    f"{unit.numel:,}" if first else "",
                    f"{_dtype_name(fp.dtype)} {kind} ({fp.param_count})"
                    + (f" as {_dtype_name(fp.param_dtype)}" if fp.param_dtype != fp.dtype else ""),
                    f"{fp.padded_numel:,}",
                    f"{fp.padding:,}",
                    format_bytes(fp.shard_bytes),
                ]
            )
        if not unit.flat_params:
            rows.append([unit.name or "<root>", unit.module_type, "0", "-", "0", "0", "0 B"])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    left = {0, 1, 3}

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    flat_params = [fp for unit in plan.units for fp in unit.flat_params]
    total_numel = sum(unit.numel for unit in plan.units)
    strategies = sorted({unit.strategy.name for unit in plan.units})
    lines = [
        f"ShardingPlan ({plan.source}): {len(plan.units)} units, {total_numel:,} parameters, "
        f"world size {plan.world_size}, {'/'.join(strategies)}, rank {plan.rank}",
        line(header),
        line(["-" * w for w in widths]),
        *[line(r) for r in rows],
        "",
        f"per rank (rank {plan.rank}):",
    ]
    rb = plan.rank_bytes
    trainable = sum(fp.shard_bytes for fp in flat_params if fp.requires_grad)
    frozen = sum(fp.shard_bytes for fp in flat_params if not fp.requires_grad)
    kinds = ", ".join(f"{kind} {format_bytes(n)}" for kind, n in plan.optimizer_by_kind.items()) or "no state"
    in_backward = getattr(plan, "optimizer_in_backward", False)
    items = [
        ("sharded parameters", rb["params"], f"trainable {format_bytes(trainable)}, frozen {format_bytes(frozen)}"),
        (
            "sharded gradients",
            rb["grads"],
            "each freed by the optimizer step in its hooks" if in_backward else "trainable flat parameters only",
        ),
        (f"optimizer state ({plan.optimizer})", rb["optimizer"], kinds),
        ("model state", rb["model_state"], "after the steps in backward" if in_backward else "after optimizer.step()"),
        ("module buffers", rb["buffers"], "not sharded"),
        (
            "shared-memory transport",
            rb["transport"],
            "collective slots in /dev/shm, fixed size (RSS also maps the peers' slots)"
            if rb["transport"]
            else "none: collectives through the backend",
        ),
        (
            "runtime (not tensors)",
            rb.get("runtime", 0),
            _runtime_note(plan) if rb.get("runtime", 0) else "not measured on this device",
        ),
    ]
    peak_items = [
        ("sharded gradients", rb["grads_at_peak"], "reduced so far"),
        ("unsharded parameters", rb["unsharded_params"], "gathered units"),
        ("unsharded gradients", rb["unsharded_grads"], "before reduce-scatter"),
        ("communication buffers", rb["comm"], "reduction in flight, all-gather sources"),
        ("optimizer step temporaries", rb["optimizer_step"], ""),
    ]
    label_width = max(len(label) for label, _, _ in items + peak_items) + 4
    value_width = len("1023.99 MiB")  # fixed, so plan and describe tables line up

    def item(label: str, count: int, note: str, indent: int = 2) -> str:
        text = f"{' ' * indent}{label.ljust(label_width - indent)}{format_bytes(count).rjust(value_width)}"
        return f"{text}  {note}".rstrip()

    lines += [item(*entry) for entry in items]
    lines.append(f"  worst moment: {plan.peak_moment}")
    lines += [item(label, count, note, indent=4) for label, count, note in peak_items]
    if rb["activations_peak"]:
        lines.append(item("activations", rb["activations"], "measured under FakeTensorMode", indent=4))
    else:
        lines.append("    activations: not measured (pass input_shape= or example_inputs= to plan)")
    lines.append(item("peak total", rb["total"], "parameters + optimizer state + buffers + transport + runtime + the above"))
    if rb["cpu"]:
        lines.append(item("of which on CPU", rb["cpu"], "CPUOffload"))
    lines += _layout_lines(plan)
    if plan.warnings:
        lines.append("")
        lines.append("warnings:")
        lines += [f"  - {message}" for message in plan.warnings]
    return "\n".join(lines)


def _runtime_note(plan: PlanFields) -> str:
    """The parts of the runtime line ([Note: the memory that is not tensors]
    in runtime_memory.py), where the plan has them."""
    parts = getattr(plan, "runtime", None)
    if parts is None or not parts.total:
        return "libraries' code, glibc's kept heap, Python objects"
    arenas = f"{parts.arenas} arenas" if parts.arenas > 1 else "1 arena"
    return (f"code {format_bytes(parts.code)} + glibc's heap tops {format_bytes(parts.heap_tops)} ({arenas}, mmap "
            f"threshold {format_bytes(parts.threshold)}) + rest {format_bytes(parts.rest)}")


def _layout_lines(plan: PlanFields) -> list[str]:
    """A budgeted plan's chosen layouts ([Note: a layout chosen for a memory
    budget] in budget.py): per unit its layout, the bytes its collectives
    move per step (modelled) and why; nothing for other plans."""
    budget = getattr(plan, "memory_budget", None)
    layouts = getattr(plan, "layouts", [])
    if budget is None or not layouts:
        return []
    header = ["unit", "layout", "moved/step", "reason"]
    rows = [
        [layout.name or "<root>", layout.strategy.name, format_bytes(layout.bytes_moved), layout.reason]
        for layout in layouts
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i == 2 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    moved = sum(layout.bytes_moved for layout in layouts)
    peak = plan.rank_bytes["total"]
    buckets = _buckets_line(getattr(plan, "bucket_bytes", None))
    grouping = getattr(plan, "base_policy", None)
    if isinstance(grouping, SmallUnitGroups) and any(layout.chosen and "+" in layout.name for layout in layouts):
        buckets += (
            f"; runs of small units grouped, up to {_bucket_size(grouping.max_bytes)} of parameters each (one unit's "
            "runtime cost per group)"
        )
    return [
        "",
        f"layouts for a memory budget of {format_bytes(budget)} per rank: predicted peak {format_bytes(peak)} "
        f"({budget - peak:,} bytes to spare), {format_bytes(moved)} moved per step; {buckets}",
        "  " + line(header),
        "  " + line(["-" * w for w in widths]),
        *["  " + line(r) for r in rows],
    ]


def _buckets_line(bucket_bytes: int | None) -> str:
    """How a budgeted plan's small units' collectives are coalesced
    (``bucket_bytes``: None for the comm defaults, 0 for none)."""
    if bucket_bytes == 0:
        return "small units' collectives not coalesced: the budget holds the most sharded layouts only without buckets"
    gather, reduce = comm.GATHER_BUCKET_BYTES, comm.REDUCE_BUCKET_BYTES
    if bucket_bytes is not None and bucket_bytes > max(gather, reduce):
        return (
            f"small units' all-gathers and reductions in buckets of up to {_bucket_size(bucket_bytes)}: the budget "
            f"holds these layouts with buckets larger than composable_shard.comm's ({_bucket_size(max(gather, reduce))}), "
            "so fewer collectives"
        )
    if bucket_bytes is not None:
        return (
            f"small units' all-gathers and reductions in buckets of up to {_bucket_size(bucket_bytes)}: the budget "
            "holds the most sharded layouts only with buckets this small"
        )
    if gather == reduce == 0:
        return "small units' collectives not coalesced: composable_shard.comm's bucket sizes are 0"
    if gather == reduce:
        return f"small units' all-gathers and reductions in buckets of up to {_bucket_size(gather)}"
    return (
        f"small units' all-gathers in buckets of up to {_bucket_size(gather)}, their reductions in buckets of up "
        f"to {_bucket_size(reduce)}"
    )


def _bucket_size(nbytes: int) -> str:
    """A bucket size: whole KiB or MiB where it is one ("256 KiB")."""
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size} {unit}"
    return format_bytes(nbytes)
