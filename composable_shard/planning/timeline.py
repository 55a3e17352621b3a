"""Owns: a rank's memory over one step as data — every moment the plan
replays (``ShardingPlan.moments``), in step order, split by category, with
the unit each moment belongs to and the worst moment marked; what
``ShardingPlan.timeline()`` returns and ``plot.py`` draws.

Knows nothing of: how the moments are computed (``memory.py``), drawing.

Public names: ``MemoryTimeline``, ``CATEGORIES``, ``plan_timeline``,
``moment_positions`` (where a measured sample falls on the plan's axis).

[Note: the timeline adds up to the plan]
Each moment is the always-alive part (the runtime's non-tensor memory,
sharded parameters, optimizer state, module buffers, the transport's
shared memory) plus that moment's
transients, so the worst moment's sum is ``rank_bytes["total"]`` and each
of its categories is the ``rank_bytes`` entry of the same meaning. Pinned
by tests/plan/test_timeline.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, Sequence

from .step_replay import StepPeak, worst_moment

__all__ = ["MemoryTimeline", "CATEGORIES", "plan_timeline", "moment_positions"]

# (category, its rank_bytes key at the peak), bottom of the stack first: the
# always-alive state, then the transients.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("runtime (not tensors)", "runtime"),
    ("sharded parameters", "params"),
    ("optimizer state", "optimizer"),
    ("module buffers", "buffers"),
    ("shared-memory transport", "transport"),
    ("sharded gradients", "grads_at_peak"),
    ("unsharded parameters", "unsharded_params"),
    ("unsharded gradients", "unsharded_grads"),
    ("communication buffers", "comm"),
    ("optimizer step temporaries", "optimizer_step"),
    ("activations", "activations"),
)
_STEADY = {"runtime", "params", "optimizer", "buffers", "transport"}
# StepPeak's field for each transient category.
_FIELD = {
    "grads_at_peak": "sharded_grads",
    "unsharded_params": "unsharded_params",
    "unsharded_grads": "unsharded_grads",
    "comm": "comm",
    "optimizer_step": "optimizer_step",
    "activations": "activations",
}
_UNIT = re.compile(r"'([^']*)'")


class _PlanLike(Protocol):
    rank_bytes: dict[str, int]
    moments: list[StepPeak]
    rank: int
    world_size: int
    optimizer: str


@dataclass(frozen=True)
class MemoryTimeline:
    """``entries``: (moment, category, bytes) for every moment in step order
    and every category of ``CATEGORIES``; ``peak_moment`` the worst moment
    (``ShardingPlan.peak_moment``), ``peak_bytes`` its total."""

    moments: tuple[str, ...]
    entries: tuple[tuple[str, str, int], ...]
    peak_moment: str
    peak_bytes: int
    title: str = ""

    @property
    def categories(self) -> tuple[str, ...]:
        return tuple(name for name, _ in CATEGORIES)

    @property
    def peak_index(self) -> int:
        return self.moments.index(self.peak_moment)

    def bytes_at(self, moment: str) -> dict[str, int]:
        """Category -> bytes at ``moment``."""
        return {category: count for label, category, count in self.entries if label == moment}

    def series(self) -> dict[str, list[int]]:
        """Category -> bytes at each moment, in step order."""
        index = {moment: i for i, moment in enumerate(self.moments)}
        result = {category: [0] * len(self.moments) for category in self.categories}
        for moment, category, count in self.entries:
            result[category][index[moment]] = count
        return result

    def totals(self) -> list[int]:
        """The sum over categories at each moment."""
        return [sum(column) for column in zip(*self.series().values())] if self.moments else []

    @staticmethod
    def unit_of(moment: str) -> str:
        """The unit a moment belongs to (``"<root>"``, ``"blocks.0"``), or
        ``""`` for the step's own moments (``"start of backward"``)."""
        found = _UNIT.search(moment)
        return found.group(1) if found else ""


def plan_timeline(plan: _PlanLike) -> MemoryTimeline:
    """The timeline of ``plan``'s replayed step; see [Note: the timeline
    adds up to the plan]."""
    if not plan.moments:
        raise ValueError("timeline: this plan holds no replayed moments (built by an older version?); plan again.")
    rb = plan.rank_bytes
    entries: list[tuple[str, str, int]] = []
    for moment in plan.moments:
        for category, key in CATEGORIES:
            count = rb.get(key, 0) if key in _STEADY else getattr(moment, _FIELD[key])
            entries.append((moment.moment, category, count))
    peak = worst_moment(plan.moments)
    title = f"rank {plan.rank} of {plan.world_size}, {plan.optimizer}"
    return MemoryTimeline(
        moments=tuple(m.moment for m in plan.moments),
        entries=tuple(entries),
        peak_moment=peak.moment,
        peak_bytes=sum(rb.get(key, 0) for key in _STEADY) + peak.transient,
        title=title + (", optimizer in backward" if getattr(plan, "optimizer_in_backward", False) else ""),
    )


def moment_positions(moments: Sequence[str], labels: Sequence[str]) -> list[float]:
    """Where each measured sample's ``labels`` (``"pre_forward (blocks.0)"``
    as the runtime's hooks name them) falls on the plan's moment axis: at
    the moment the hook opens (forward, start of backward, reduce-scatter,
    a gradient held for a bucket),
    half a moment after the one it closes, else just after the previous
    sample."""
    index: dict[str, int] = {}
    # The moment a unit's post-forward opens, by the unit: its parent's code after it.
    after: dict[str, str] = {}
    for i, moment in enumerate(moments):
        index.setdefault(moment, i)
        if moment.startswith("forward of '") and " after '" in moment:
            after.setdefault(moment.rpartition(" after '")[2][:-1], moment)
    positions: list[float] = []
    last = -0.5
    for label in labels:
        hook, _, unit = label.partition(" (")
        unit = unit[:-1] if unit.endswith(")") else unit
        # The root's post-forward ends the forward; another unit's opens its
        # parent's code after it (else half a moment after its own forward).
        if unit == "<root>":
            post_forward = [("start of backward", -0.2)]
        elif unit in after:
            post_forward = [(after[unit], 0.0)]
        else:
            post_forward = [(f"forward of '{unit}'", 0.5)]
        candidates: list[tuple[str, float]] = {
            # The root's pre-backward runs first in backward (its own
            # gradients come last).
            "post_forward": post_forward,
            "pre_forward": [(f"forward of '{unit}'", 0.0)],
            "pre_backward": [("start of backward", 0.2)] if unit == "<root>" else [(f"start of backward of '{unit}'", 0.0)],
            "post_backward": [
                (f"reduce-scatter of '{unit}'", 0.0),
                (f"gradient of '{unit}' held for a bucket", 0.0),
                (f"reduction of the bucket of {unit!r}", 0.0),
            ],
            "finalize_backward": [(moments[-1], -0.3)] if moments else [],
            "end of step": [(moments[-1], 0.5)] if moments else [],
        }.get(hook, [])
        where = next((index[m] + shift for m, shift in candidates if m in index), None)
        last = where if where is not None and where >= last else last + 0.1
        positions.append(last)
    return positions
