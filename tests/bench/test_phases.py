"""``scripts/bench.py phases``: its table holds, per mode, the medians over
the mode's steps of the step (slowest rank), forward, backward, optimizer
step and the main thread's CPU, their difference (the time that thread did
not compute), and the paired ratio to the first mode, the same numbers as
plain text and as Markdown. Synthetic records: no processes are started."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from bench.phases import parse_args, report  # noqa: E402
from bench.report import paired_ratio_of_rounds  # noqa: E402


def _records() -> dict[str, list[list[list[float]]]]:
    # Per mode, per round, per step: step, forward, backward, optimizer, CPU (seconds).
    def step(total_ms: float, cpu_ms: float) -> list[float]:
        return [total_ms / 1e3, 0.3 * total_ms / 1e3, 0.6 * total_ms / 1e3, 0.1 * total_ms / 1e3, cpu_ms / 1e3]

    ours = [[step(400, 380), step(410, 385), step(600, 390), step(620, 400)]]
    theirs = [[step(380, 350), step(390, 360), step(590, 355), step(600, 350)]]
    return {"composable_shard": ours, "ddp": theirs}


def _rows(text: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in text.splitlines()[2:]}


def test_phases_table_gives_medians_idle_time_and_the_paired_ratio() -> None:
    args = parse_args(["--modes", "composable_shard,ddp", "--rounds", "1", "--steps", "4"])
    assert args.config == "many-small" and args.modes == ["composable_shard", "ddp"] and args.round_steps == 2
    rows = _rows(report(args, _records()))
    # Medians of four steps: (410 + 600) / 2 ms; CPU (385 + 390) / 2; step - CPU: of 20, 25, 210, 220.
    assert rows["composable_shard"][0] == "505.0"
    assert rows["composable_shard"][1:4] == ["151.5", "303.0", "50.5"]
    assert rows["composable_shard"][4:6] == ["387.5", "117.5"]
    assert rows["composable_shard"][6] == "1.000"
    # DDP's turns of two steps: 385 / 405 and 595 / 610 of ours; the median of two is their mean.
    expected = ((385 / 405) + (595 / 610)) / 2
    assert rows["ddp"][6] == f"{expected:.3f}"
    ddp_steps = [[s[0] for s in steps] for steps in _records()["ddp"]]
    ours_steps = [[s[0] for s in steps] for steps in _records()["composable_shard"]]
    assert paired_ratio_of_rounds(ddp_steps, ours_steps, 2) == pytest.approx(expected)


def test_phases_markdown_holds_the_plain_tables_cells() -> None:
    plain = report(parse_args(["--modes", "composable_shard,ddp", "--rounds", "1", "--steps", "4"]), _records())
    markdown = report(parse_args(["--modes", "composable_shard,ddp", "--rounds", "1", "--steps", "4", "--markdown"]),
                      _records())
    table = [line for line in markdown.splitlines() if line.startswith("|")]
    assert table[1] == "|---|" + "|".join(["---:"] * 7) + "|"
    cells = {row.strip("| ").split(" | ")[0]: row.strip("| ").split(" | ")[1:] for row in table[2:]}
    assert cells == _rows(plain)


def test_phases_refuses_a_simulated_world() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--simulate-world-size", "8"])
