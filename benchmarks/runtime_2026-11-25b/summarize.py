"""The plan's runtime line against the measured peaks (issue 34, item 3).

Reads the grid's JSON files beside this script (``run_grid.sh``; each is
``measure_runtime.py``'s record: the measured peak per rank and the plan's
tensors) and the largest-model searches' raw trials, replans every point
with the current ``composable_shard`` and prints measured vs plan. Usage
(repository root)::

    PYTHONPATH=$PWD python benchmarks/runtime_2026-11-25b/summarize.py [--largest JSON[:oib] ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "examples"), str(ROOT)]

import composable_shard as cs  # noqa: E402
from bench.cli import parse_args  # noqa: E402
from bench.largest import PlanPeaks, meta_gpt, plan_kwargs, predict  # noqa: E402
from composable_shard.comm import transport  # noqa: E402

MIB = 2**20
HERE = Path(__file__).resolve().parent
# The points whose measured non-tensor part fixed REST_BYTES and
# REST_PER_UNIT_BYTES (runtime_memory.py).
FITTED = {("w256_d2", "shm"), ("w256_d16", "shm")}


def grid_rows() -> list[str]:
    rows = []
    for path in sorted(HERE.glob("*.json")):
        record = json.loads(path.read_text())
        name, kind = path.stem.rsplit("_", 1)
        os.environ[transport.ENV_SWITCH] = record["shared_memory"]
        args = parse_args(record["argv"] + ["--modes", "composable_shard"])
        planned = cs.plan(meta_gpt(args, args.n_layer), **plan_kwargs(args, activations=True))
        rb, parts = planned.rank_bytes, planned.runtime
        tensors = (rb["total"] - rb["runtime"]) / MIB
        peaks = [rank["peak_increase_mb"] for rank in record["ranks"]]
        measured_rest = " / ".join(f"{p - tensors:.1f}" for p in peaks)
        errors = " / ".join(f"{100 * (rb['total'] / MIB - p) / p:+.1f}%" for p in peaks)
        role = "fitted" if (name, kind) in FITTED else "validation"
        rows.append(
            f"| {name} | {kind} | {' / '.join(f'{p:,.1f}' for p in peaks)} | {tensors:,.1f} | {measured_rest} | "
            f"{parts.threshold / MIB:.2f} | {parts.heap_tops / MIB:.1f} ({parts.arenas}) | {rb['runtime'] / MIB:.1f} | "
            f"{rb['total'] / MIB:,.1f} | {errors} | {role} |"
        )
    return rows


def largest_rows(path: Path, optimizer_in_backward: bool) -> list[str]:
    """Each composable_shard trial that fitted, replanned; and the plan's
    predicted limit with the search's budget and baseline."""
    os.environ[transport.ENV_SWITCH] = "1"  # the searches ran through shared memory (the CPU default)
    record = json.loads(path.read_text())
    argv = ["--config", "largest"] + (["--optimizer-in-backward"] if optimizer_in_backward else [])
    args = parse_args(argv)
    peaks = PlanPeaks(args)
    rows = []
    for trial in record["trials"]:
        if trial["mode"] != "composable_shard" or trial["status"] != "fits":
            continue
        planned = peaks(trial["n_layer"]) / MIB
        measured = trial["peak_rise_mb"]
        old = record["plan_peaks_bytes"].get(str(trial["n_layer"]))
        old_text = f"{old / MIB:,.1f}" if old else "-"
        rows.append(f"| {path.name} | {trial['n_layer']} | {measured:,.1f} | {old_text} | {planned:,.1f} | "
                    f"{100 * (planned - measured) / measured:+.1f}% |")
    probes = [t for t in record["trials"] if t["n_layer"] == args.probe_layers and t.get("start_usage_bytes")]
    baseline = max((t["start_usage_bytes"] for t in probes), key=sum)
    prediction = predict(args, record["budget_bytes"], baseline, peaks)
    limit = max(t["n_layer"] for t in record["trials"] if t["mode"] == "composable_shard" and t["status"] == "fits")
    rows.append(f"| {path.name}: plan's largest | {prediction.n_layer} (before: {record['prediction']['n_layer']}) | "
                f"measured largest {limit} | | | |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--largest", action="append", default=[], help="a search's raw trials JSON; ':oib' if in backward")
    options = parser.parse_args()
    print("| point | transport | measured peak r0 / r1 | plan tensors | measured rest | threshold | heap tops (arenas) "
          "| plan runtime | plan total | plan vs measured | |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in grid_rows():
        print(row)
    for spec in options.largest:
        path, _, flag = spec.partition(":")
        print()
        print("| search | blocks | measured peak | plan then | plan now | plan now vs measured |")
        print("|---|---:|---:|---:|---:|---:|")
        for row in largest_rows(Path(path), flag == "oib"):
            print(row)


if __name__ == "__main__":
    main()
