"""The interval arithmetic of ``scripts/bench.py --overlap-report``
(scripts/bench/overlap.py), on synthetic ``(stream, start, end)`` events.
The profiler part needs a GPU and is not tested here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench.overlap import comm_overlap, format_overlap, union  # noqa: E402


def test_union_merges_overlapping_and_touching_intervals_and_drops_empty_ones() -> None:
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (6, 6.5), (9, 9)]) == [(0, 4), (5, 7)]
    assert union([]) == []


def test_lane_time_overlapped_by_compute_is_the_measure_of_the_intersection() -> None:
    events = [
        ("compute", 0.0, 4.0),
        ("compute", 6.0, 10.0),
        ("all-gather", 3.0, 7.0),  # 1 + 1 overlapped, 2 exposed (4..6)
        ("reduce", 9.0, 12.0),  # 1 overlapped, 2 exposed
        ("reduce", 12.0, 13.0),  # touching: exposed
    ]
    overlap = comm_overlap(events, "compute")
    assert overlap.compute == 8.0
    assert overlap.comm == 8.0
    assert overlap.overlapped == 3.0
    assert overlap.fraction == pytest.approx(3 / 8)
    assert overlap.per_stream == {"all-gather": (4.0, 2.0), "reduce": (4.0, 1.0)}


def test_two_lanes_busy_at_once_count_once() -> None:
    events = [("compute", 0.0, 1.0), ("a", 0.0, 2.0), ("b", 1.0, 3.0)]
    overlap = comm_overlap(events, "compute")
    assert (overlap.comm, overlap.overlapped) == (3.0, 1.0)
    assert overlap.per_stream == {"a": (2.0, 1.0), "b": (2.0, 0.0)}


def test_fully_hidden_exposed_and_no_lane_work() -> None:
    hidden = comm_overlap([("compute", 0, 10), ("lane", 2, 3), ("lane", 4, 5)], "compute")
    assert hidden.fraction == 1.0 and hidden.overlapped == 2
    exposed = comm_overlap([("compute", 0, 1), ("lane", 1, 2)], "compute")
    assert exposed.fraction == 0.0
    assert comm_overlap([("compute", 0, 1)], "compute").fraction == 1.0
    assert comm_overlap([("lane", 0, 1)], "compute").fraction == 0.0  # no compute at all


def test_an_interval_ending_before_it_starts_is_refused() -> None:
    with pytest.raises(ValueError, match="interval on lane ends"):
        comm_overlap([("lane", 2.0, 1.0)], "compute")


def test_report_has_one_line_per_step() -> None:
    steps = [comm_overlap([("compute", 0, 4), ("stream 13", 2, 6)], "compute")] * 2
    text = format_overlap("composable_shard", steps)
    assert text.splitlines()[1] == (
        "  step 0: lanes 4.00 ms, overlapped 2.00 ms (50%); compute 4.00 ms; per lane: stream 13 4.00 ms (50%)"
    )
    assert len(text.splitlines()) == 3
    alone = format_overlap("single", [comm_overlap([("compute", 0, 4)], "compute")])
    assert alone.splitlines()[1] == "  step 0: no lane work; compute 4.00 ms"
