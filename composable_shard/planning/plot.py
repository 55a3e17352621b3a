"""Owns: drawing a ``MemoryTimeline`` as a PNG (or any format matplotlib
writes) — one stacked area per category over the step's moments, the unit
names along the time axis, the worst moment marked, and, when given, the
memory measured at each hook of a real step drawn over it.

Knows nothing of: how the timeline is computed. matplotlib is an optional
dependency (``pip install composable_shard[plot]``), imported only when
``plot_timeline`` runs, never by the rest of the package.

Public names: ``plot_timeline``.
"""

from __future__ import annotations

from typing import Any

from .measured import MemoryRecord
from .timeline import MemoryTimeline, moment_positions

__all__ = ["plot_timeline"]

_MIB = 2**20
# One colour per category of timeline.CATEGORIES, steady state in greys.
_COLOURS = (
    "#262626", "#4d4d4d", "#7f7f7f", "#a6a6a6", "#c7c7c7",
    "#1f77b4", "#ff7f0e", "#d62728", "#9467bd", "#8c564b", "#2ca02c",
)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "ShardingPlan.plot needs matplotlib: pip install 'composable_shard[plot]' (or pip install matplotlib)."
        ) from error
    return plt


def _phase(moment: str) -> str:
    if moment.startswith(("forward", "all-gather")):
        return "F"
    if moment.startswith("optimizer"):
        return "O"
    return "B"


def _tick_labels(timeline: MemoryTimeline) -> tuple[list[int], list[str]]:
    """One tick per unit and phase (where its first moment is), at most ~40."""
    ticks, labels, last = [], [], None
    for index, moment in enumerate(timeline.moments):
        key = (timeline.unit_of(moment), _phase(moment))
        if key != last and key[0]:
            ticks.append(index)
            labels.append(f"{key[1]} {key[0]}")
        last = key
    stride = max(1, len(ticks) // 40)
    return ticks[::stride], labels[::stride]


def plot_timeline(
    timeline: MemoryTimeline, path: str, *, measured: MemoryRecord | None = None, title: str | None = None
) -> None:
    """Write the picture of ``timeline`` to ``path`` (format from its suffix)."""
    plt = _pyplot()
    series = timeline.series()
    x = list(range(len(timeline.moments)))
    figure, axes = plt.subplots(figsize=(11, 4.8), dpi=100)
    # Steps, not slopes: a moment's bytes hold until the next moment.
    edges = x + [len(x)]
    bottom = [0.0] * (len(x) + 1)
    for category, colour in zip(timeline.categories, _COLOURS):
        values = [count / _MIB for count in series[category]]
        if not any(values):
            continue
        top = [b + v for b, v in zip(bottom, values + values[-1:])]
        axes.fill_between(edges, bottom, top, step="post", color=colour, alpha=0.9, linewidth=0, label=category)
        bottom = top
    peak_x, peak_mib = timeline.peak_index, timeline.peak_bytes / _MIB
    axes.axvline(peak_x + 0.5, color="black", linestyle=":", linewidth=1)
    axes.annotate(
        f"peak {peak_mib:,.1f} MiB\n{timeline.peak_moment}",
        xy=(peak_x + 0.5, peak_mib),
        xytext=(0.02, 0.97),
        textcoords="axes fraction",
        va="top",
        fontsize=8,
        arrowprops={"arrowstyle": "->", "linewidth": 0.8},
    )
    if measured is not None and measured.samples:
        where = moment_positions(timeline.moments, [s.label for s in measured.samples])
        where = [w + 0.5 for w in where]  # the middle of the moment's step
        axes.plot(where, [s.bytes / _MIB for s in measured.samples], color="black", marker=".", markersize=3,
                  linewidth=1.2, label=f"measured ({measured.kind}, at each hook)")
        owned = [(w, s.runtime_bytes) for w, s in zip(where, measured.samples) if s.runtime_bytes is not None]
        if owned:
            axes.plot([w for w, _ in owned], [b / _MIB for _, b in owned], color="black", linestyle="--",
                      linewidth=1, label="measured (runtime's tensors)")
    ticks, labels = _tick_labels(timeline)
    axes.set_xticks([t + 0.5 for t in ticks], labels, rotation=60, ha="right", fontsize=7)
    axes.set_xlim(0, len(x))
    axes.set_ylim(bottom=0)
    axes.set_ylabel("MiB on this rank")
    axes.set_title(title or f"Memory over one training step ({timeline.title})", fontsize=10)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    axes.grid(axis="y", linewidth=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
