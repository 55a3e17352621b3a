"""``scripts/bench.py --markdown``: the result table comes out as a Markdown
table (header, alignment row, one row per mode, the same cell count
everywhere) holding the same numbers as the plain-text table, so
``docs/benchmarks.md`` can be regenerated from a run. Synthetic results: no
processes are started."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from bench.cli import parse_args  # noqa: E402
from bench.markdown import markdown_table  # noqa: E402
from bench.report import ModeResult, paired_ratio, report  # noqa: E402


def _args(markdown: bool) -> argparse.Namespace:
    argv = ["--config", "gpt", "--modes", "composable_shard,fsdp1,fsdp2", "--rounds", "2"]
    return parse_args(argv + (["--markdown"] if markdown else []))


def _results() -> dict[str, ModeResult]:
    def mode(name: str, ms: float, peak: float) -> ModeResult:
        return ModeResult(name, [5.5, 5.25], [[ms, ms + 2.0], [ms + 1.0, ms + 3.0]], 20.0, peak, [peak])

    # composable_shard without a peak: the plan's note (which builds a meta model) is left out.
    return {"composable_shard": mode("composable_shard", 380.0, None), "fsdp1": mode("fsdp1", 500.0, 214.1),
            "fsdp2": mode("fsdp2", 590.0, 243.0)}


def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def _cells(line: str) -> list[str]:
    assert line.startswith("| ") and line.endswith(" |"), line
    return [c.strip() for c in line[2:-2].split(" | ")]


def test_markdown_table_parses_and_holds_the_plain_tables_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    assert report(_args(markdown=False), _results())
    plain = capsys.readouterr().out
    assert report(_args(markdown=True), _results())
    lines = _table_lines(capsys.readouterr().out)
    header, alignment, rows = _cells(lines[0]), lines[1], [_cells(line) for line in lines[2:]]
    assert header[:4] == ["mode", "r1", "r2", "median ms"]
    assert alignment.strip("|").split("|") == ["---"] + ["---:"] * (len(header) - 1)
    assert [row[0] for row in rows] == ["composable_shard", "fsdp1", "fsdp2"]
    assert all(len(row) == len(header) for row in rows)
    for row in rows:  # every cell of a mode's plain-text line, in the same order
        plain_line = next(line for line in plain.splitlines() if line.startswith(row[0] + " "))
        assert plain_line.split() == row
    fsdp1 = dict(zip(header, rows[1]))
    assert (fsdp1["median ms"], fsdp1["cs/peer"], fsdp1["peak RSS MB"]) == ("501.5", "0.76", "214.1")
    assert fsdp1["paired"] == f"{paired_ratio(_results()['composable_shard'], _results()['fsdp1'], 2):.2f}"


def test_paired_ratio_is_the_median_over_turns_of_the_ratio_of_turn_means() -> None:
    # Two rounds of two turns of two steps; the machine is three times slower
    # in each round's second turn, so the medians mix speeds.
    ours = ModeResult("composable_shard", [1.0], [[100.0, 110.0, 300.0, 310.0], [100.0, 100.0, 330.0, 330.0]], None, None, [])
    theirs = ModeResult("ddp", [1.0], [[90.0, 90.0, 310.0, 290.0], [100.0, 100.0, 300.0, 300.0]], None, None, [])
    # Turn ratios 105 / 90, 305 / 300, 100 / 100, 330 / 300: the median of four is the mean of the middle two.
    assert paired_ratio(ours, theirs, 2) == pytest.approx((305 / 300 + 330 / 300) / 2)
    # In turns of four steps (the whole round), one ratio per round.
    assert paired_ratio(ours, theirs, 4) == pytest.approx((205 / 195 + 215 / 200) / 2)


def test_a_cell_holding_a_pipe_is_escaped_and_rows_must_match_the_header() -> None:
    assert markdown_table(["a", "b"], [["x|y", "1"]], right_aligned={1}).splitlines() == [
        "| a | b |", "|---|---:|", "| x\\|y | 1 |"]
    with pytest.raises(ValueError, match="a row has 1 cells, the header 2"):
        markdown_table(["a", "b"], [["x"]])


def test_largest_table_in_markdown_holds_the_plain_tables_cells(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.largest import Prediction, Search, _print_table
    from bench.trials import TrialResult

    def trial(n: int, status: str, peak: float | None) -> tuple[int, TrialResult]:
        return n, TrialResult("composable_shard", n, status, 0, 12.0, peak_rise_mb=peak)

    search = Search(3, [trial(1, "fits", 300.0), trial(4, "out of memory", None), trial(3, "fits", 512.5)])
    prediction = Prediction(n_layer=4, plan_budget_bytes=2**30, slope_bytes=2**20)
    tables = []
    for markdown in (False, True):
        args = parse_args(["--config", "largest", "--modes", "composable_shard", "--n-embd", "64", "--n-head", "2"]
                          + (["--markdown"] if markdown else []))
        _print_table(args, {"composable_shard": search}, prediction, 3 * 2**30, "pretended")
        tables.append(capsys.readouterr().out)
    plain_row = next(line for line in tables[0].splitlines() if line.startswith("composable_shard "))
    lines = _table_lines(tables[1])
    assert _cells(lines[0])[:2] == ["mode", "largest"] and len(lines) == 3
    assert _cells(lines[2]) == plain_row.split()
    assert _cells(lines[2])[1:4:2] == ["3", "512.5"]
