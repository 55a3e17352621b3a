"""Owns: the largest model size whose plan fits a memory budget per rank —
``largest_fitting(build, budget_bytes, ...)`` searches the size ``n`` that a
model builder takes (blocks, layers) for the largest whose plan's peak
(``rank_bytes["total"]``) is at most the budget.

Knows nothing of: process groups, what the memory outside the plan is (the
caller subtracts what its processes hold besides the model: interpreter,
libraries, process group); how the plan is computed (``sharding_plan.plan``).

Public names: ``largest_fitting``, ``Capacity``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn

from .sharding_plan import ShardingPlan, plan

__all__ = ["largest_fitting", "Capacity"]


@dataclass(frozen=True)
class Capacity:
    """The answer of ``largest_fitting``. ``n``: the largest size that fits
    (0: not even ``low``); ``plan``: its plan (``None`` when ``n`` is 0);
    ``next_total``: the peak of size ``n + 1`` (``None`` when ``n`` reached
    ``high``); ``planned``: every size planned, with its peak per rank."""

    n: int
    budget_bytes: int
    plan: ShardingPlan | None
    next_total: int | None
    planned: dict[int, int]

    @property
    def bytes_per_step(self) -> int | None:
        """Peak added by one more unit of size at the limit (``None`` without
        both neighbours planned)."""
        if self.plan is None or self.next_total is None:
            return None
        return self.next_total - self.plan.rank_bytes["total"]


def largest_fitting(
    build: Callable[[int], nn.Module],
    budget_bytes: int,
    *,
    world_size: int,
    low: int = 1,
    high: int = 100_000,
    **plan_kwargs: Any,
) -> Capacity:
    """The largest ``n`` in ``[low, high]`` for which ``plan(build(n),
    world_size=world_size, **plan_kwargs).rank_bytes["total"] <=
    budget_bytes``.

    ``build(n)`` returns a fresh model of size ``n`` (build it on the meta
    device: nothing is allocated). The peak must not shrink as ``n`` grows
    (true of stacked blocks); the search doubles ``n`` from ``low`` until the
    plan no longer fits, then bisects: about ``2 log2(n)`` plans.
    ``plan_kwargs`` go to ``plan`` (``policy``, ``optimizer``, ``device``,
    ``input_shape``, ...). ``budget_bytes`` is for the plan's tensors alone,
    per rank: subtract what each process holds before the model is built.
    """
    if not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"largest_fitting: budget_bytes must be a non-negative int, got {budget_bytes!r}.")
    if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
        raise ValueError(f"largest_fitting: need integers 1 <= low <= high, got low={low!r}, high={high!r}.")
    planned: dict[int, int] = {}
    plans: dict[int, ShardingPlan] = {}

    def total(n: int) -> int:
        if n not in planned:
            plans[n] = plan(build(n), world_size=world_size, **plan_kwargs)
            planned[n] = plans[n].rank_bytes["total"]
        return planned[n]

    if total(low) > budget_bytes:
        return Capacity(0, budget_bytes, None, planned[low], dict(planned))
    fits, step = low, 1  # fits: largest size known to fit
    while fits < high and total(min(fits + step, high)) <= budget_bytes:
        fits, step = min(fits + step, high), 2 * step
    too_big = min(fits + step, high) if fits < high else None  # smallest known not to fit
    while too_big is not None and too_big - fits > 1:
        middle = (fits + too_big) // 2
        if total(middle) <= budget_bytes:
            fits = middle
        else:
            too_big = middle
    next_total = total(fits + 1) if fits < high else None
    return Capacity(fits, budget_bytes, plans[fits], next_total, dict(planned))
