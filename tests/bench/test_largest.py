"""``scripts/bench.py --config largest``: the search finds the exact limit
of a monotone trial in few trials whatever the first guess and the slope
error; the watchdog stops a process group that passes its budget and takes
a rank killed by SIGKILL for the kernel's OOM killer; and one short real
search under a pretended budget finds a limit whose next size the watchdog
stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from bench.largest import search_limit  # noqa: E402
from bench.trials import _watch, process_usage  # noqa: E402

MB = 2**20
GiB = 2**30


@dataclass
class FakeOutcome:
    fits: bool
    usage_bytes: int


def _linear_trial(base: int, per_layer: int, budget: int, bump: int = 0):
    """usage = base + per_layer * n + bump * n² / 1000: linear, or slightly
    convex (bump > 0) or concave (bump < 0), as allocators make it."""
    calls: list[int] = []

    def trial(n: int) -> FakeOutcome:
        calls.append(n)
        usage = base + per_layer * n + bump * n * n // 1000
        return FakeOutcome(usage <= budget, usage)

    return trial, calls


@pytest.mark.parametrize("plan_error", [0.3, 0.6, 1.0, 1.2])
@pytest.mark.parametrize("bump", [0, 1, -1])
def test_search_finds_the_exact_limit_in_few_trials(plan_error: float, bump: int) -> None:
    base, per_layer, budget, probe = 400 * MB, 10 * MB, 3 * 1024 * MB, 2
    trial, calls = _linear_trial(base, per_layer, budget, bump * MB)
    truth = max(n for n in range(1, 1000) if trial(n).fits)
    calls.clear()
    slope = per_layer * plan_error  # the plan's slope, off by plan_error
    guess = probe + int((budget - trial(probe).usage_bytes) // slope)
    calls.clear()
    search = search_limit(
        trial, first=(probe + guess) // 2, slope_bytes=slope, budget_bytes=budget,
        known={probe: trial(probe)}, low=1,
    )
    assert search.limit == truth
    assert search.first_failed == truth + 1
    assert len(calls) - 1 <= 6, f"{len(calls) - 1} trials: {calls[1:]}"  # calls[0]: the probe


def test_search_ends_at_the_probe_when_nothing_larger_fits() -> None:
    trial, calls = _linear_trial(0, 100, 250)  # 2 fits, 3 does not
    search = search_limit(trial, first=10, slope_bytes=1, budget_bytes=250, known={2: trial(2)})
    assert search.limit == 2 and search.first_failed == 3


def test_search_gives_up_after_max_trials_without_an_answer() -> None:
    trial, calls = _linear_trial(0, 100, 10_000)  # 100 fits, 101 does not
    with pytest.raises(RuntimeError, match="no answer after 2 trials \\(between 28 and 10001 blocks\\)"):
        search_limit(trial, first=20, slope_bytes=1000, budget_bytes=10_000, known={2: trial(2)}, max_trials=2)
    assert calls == [2, 20, 28]  # the plan's slope (1000) is steeper than the secant (100): 8 blocks more


def _group(*scripts: str) -> list[subprocess.Popen]:
    procs: list[subprocess.Popen] = []
    for script in scripts:
        group = 0 if not procs else procs[0].pid
        procs.append(subprocess.Popen([sys.executable, "-c", script], process_group=group))
    return procs


def test_watchdog_stops_the_group_when_it_passes_its_budget() -> None:
    procs = _group("import time; x = bytearray(300 * 2**20); time.sleep(60)", "import time; time.sleep(60)")
    start = time.monotonic()
    status, detail, highest = _watch(procs, 100 * MB, 0, 7, 60.0, start)
    assert status == "out of memory"
    assert detail.startswith("stopped: out of memory at 7 blocks (trial used")
    assert highest > 100 * MB
    assert [p.returncode for p in procs] == [-9, -9]  # the whole group, reaped
    assert time.monotonic() - start < 30


def test_watchdog_takes_a_rank_killed_by_sigkill_for_the_oom_killer() -> None:
    procs = _group("import os, signal, time; time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)",
                   "import time; time.sleep(60)")
    status, detail, _ = _watch(procs, 2**40, 0, 5, 60.0, time.monotonic())
    assert (status, detail) == ("out of memory", "killed by the kernel (SIGKILL; OOM killer) at 5 blocks")
    assert procs[1].returncode == -9  # the waiting rank was stopped with it


def test_watchdog_reports_other_failures_as_errors() -> None:
    procs = _group("raise SystemExit(3)", "import time; time.sleep(60)")
    status, detail, _ = _watch(procs, 2**40, 0, 5, 60.0, time.monotonic())
    assert (status, detail) == ("error", "a rank exited with status 3")


def _idle_rank_bytes() -> int:
    """RssAnon of an interpreter that imported torch and composable_shard:
    what each trial rank holds before it builds its model. It depends on the
    torch build: 193 MB with the 2.13.0 CPU build, 271 MB with the 2.9.1 CUDA
    build (its CUDA libraries' relocations and tables), on this machine."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, torch, torch.distributed, composable_shard; print(flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        child.stdout.readline()
        return process_usage(child.pid)[0]
    finally:
        child.stdin.close()
        child.wait()


# The pretended budget: what two idle ranks hold plus this. A fixed 0.75 GiB
# (written with the 2.13.0 CPU build) stopped the 1-block probe with the CUDA
# builds of 2.9.1 and 2.11.0. Measured here (trial usage, MB: idle ranks;
# 1, 2, 3 blocks): 2.13.0 CPU 2 x 209; 678, 754, 785+ (stopped);
# 2.9.1 CUDA 2 x 287; 965, 1038, 1134. The blocks cost the same (~75 MB
# each) but a CUDA build's ranks also grow ~130 MB more while building and
# training, so the headroom covers 1 block plus that with room for a few
# more (by the numbers above, a limit of 4 blocks on 2.13.0 and 2 on 2.9.1).
_HEADROOM_BYTES = 560 * MB


def test_search_under_a_pretended_budget_finds_a_limit_the_watchdog_confirms(tmp_path: Path) -> None:
    results = tmp_path / "largest.json"
    budget_gib = (2 * _idle_rank_bytes() + _HEADROOM_BYTES) / GiB
    command = [
        sys.executable, str(ROOT / "scripts" / "bench.py"), "--config", "largest", "--modes", "composable_shard",
        "--n-embd", "512", "--n-head", "8", "--probe-layers", "1", "--memory-budget", f"{budget_gib:.4f}",
        "--memory-margin", "0.25", "--results", str(results),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(results.read_text())
    trials = {t["n_layer"]: t for t in record["trials"]}
    limits = [line for line in done.stdout.splitlines() if line.startswith("composable_shard ")]
    limit = int(limits[-1].split()[1])
    assert trials[limit]["status"] == "fits" and trials[limit]["usage_bytes"] <= record["budget_bytes"]
    assert trials[limit + 1]["status"] == "out of memory"
    assert "plan's prediction for composable_shard" in done.stdout
    assert len(trials[limit]["losses"]) == 3
