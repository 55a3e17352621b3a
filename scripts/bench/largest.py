"""Owns: ``--config largest`` — for each mode, the largest number of blocks
(``n_layer``) of the configuration's width that trains ``--memory-steps``
AdamW steps without running out of memory, found with few trials: the
memory budget, the plan's prediction of composable_shard's limit, the search
and its printed table.

Knows nothing of: how a trial runs or is stopped (``trials.py``), how the
modes wrap the model (``peers.py``).

How it searches (``search_limit``; every trial in fresh processes):

1. The budget: ``MemAvailable`` at the start less ``--memory-margin``, or
   ``--memory-budget`` GiB (pretend the machine is that small; capped by
   what is available). It bounds the trial's processes' memory ([Note: what
   a trial's memory is] in ``trials.py``).
2. A probe per mode at ``--probe-layers`` blocks: each process's memory
   before building (the baseline) and the mode's usage at a small size.
3. The plan's prediction for composable_shard: ``largest_fitting`` with the
   budget per rank less the baseline, activations at the bench's batch
   included. One more block adds ``slope`` bytes to every rank (the plan's).
4. For every mode alike (the plan's slope only places the first trial): the
   first trial is half-way between the probe and the limit that the probe's
   usage and the plan's slope give; from then on the next size is where the
   secant through the smallest and largest sizes that fitted (or the plan's
   slope, if steeper) reaches the budget (at least one block more), kept below the smallest size that did not fit:
   after failures that means 1, 2, 4, ... blocks down (the midpoint before
   two sizes fitted). It ends when the largest size that fitted and the smallest that
   did not are one block apart: usually four or five trials per mode, the
   probe included.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch
from gpt import GPT, Block, GPTConfig

from .markdown import markdown_table
from .trials import MB, TrialResult, mem_available_bytes, run_trial

logger = logging.getLogger("bench")
GiB = 2**30


class Outcome(Protocol):
    @property
    def fits(self) -> bool: ...

    usage_bytes: int


@dataclass
class Search:
    """One mode's search: its trials in order and the limit (0: not even
    ``low`` blocks fit)."""

    limit: int
    trials: list[tuple[int, Outcome]] = field(default_factory=list)

    @property
    def first_failed(self) -> int | None:
        failed = [n for n, outcome in self.trials if not outcome.fits]
        return min(failed) if failed else None


def _estimate(points: dict[int, int], slope_bytes: float, budget_bytes: int) -> int:
    """The largest size whose usage, extrapolated from the largest fitting
    size, stays in the budget (at least one more). The slope is the secant
    through the smallest and the largest fitting sizes (measured; the widest
    base, since a step's worst moment can move between neighbouring sizes),
    but never below ``slope_bytes`` (the plan's: memory the plan counts per
    block is there whatever the allocator does)."""
    sizes = sorted(points)
    n_lo, n_hi = sizes[0], sizes[-1]
    if n_hi > n_lo:
        slope_bytes = max(slope_bytes, (points[n_hi] - points[n_lo]) / (n_hi - n_lo))
    if slope_bytes <= 0:
        return n_hi + 1
    return n_hi + max(1, int((budget_bytes - points[n_hi]) // slope_bytes))


def search_limit(
    trial: Callable[[int], Outcome],
    *,
    first: int,
    slope_bytes: float,
    budget_bytes: int,
    known: dict[int, Outcome] | None = None,
    low: int = 1,
    high: int = 10_000,
    max_trials: int = 12,
) -> Search:
    """The largest ``n`` in ``[low, high]`` for which ``trial(n).fits``,
    assuming fitting is monotone in ``n`` and usage nearly linear.

    ``known``: outcomes measured before (the probe). The first trial is at
    ``first``; then each next size is the estimate of ``_estimate`` from the
    fitting trials (``slope_bytes`` until two sizes fitted), kept strictly
    between the largest size that fitted and the smallest that did not: after
    ``k`` failures in a row, ``2**(k-1)`` blocks below the last, or the
    midpoint (when that is not above the largest fit, or before two sizes
    fitted: the estimate did not come from measured sizes). Stops when they are one apart; raises ``RuntimeError`` after
    ``max_trials`` new trials without that."""
    known = dict(known or {})
    fit = max([n for n, o in known.items() if o.fits], default=low - 1)  # largest n known to fit
    fail = min([n for n, o in known.items() if not o.fits], default=high + 1)  # smallest n known not to
    search = Search(0, sorted(known.items()))
    n, failures_in_a_row, new_trials = min(max(first, fit + 1), fail - 1), 0, 0
    while fail - fit > 1:
        if new_trials == max_trials:
            raise RuntimeError(
                f"bench --config largest: no answer after {max_trials} trials (between {fit} and {fail} blocks); "
                "the trials' memory is not monotone in the size, or the machine's load changed. Rerun on a quiet machine."
            )
        outcome = trial(n)
        new_trials += 1
        search.trials.append((n, outcome))
        if outcome.fits:
            fit, failures_in_a_row = n, 0
        else:
            fail, failures_in_a_row = n, failures_in_a_row + 1
        points = {m: o.usage_bytes for m, o in search.trials if o.fits}
        estimate = _estimate(points, slope_bytes, budget_bytes) if points else fit + 1
        if failures_in_a_row and len(points) < 2:
            estimate = (fit + fail) // 2  # the estimate was not from measured sizes
        elif failures_in_a_row:
            estimate = min(estimate, fail - 2 ** (failures_in_a_row - 1))  # 1, 2, 4, ... below
            estimate = estimate if estimate > fit else (fit + fail) // 2
        n = min(max(estimate, fit + 1), fail - 1)
    search.limit = max(fit, 0)
    return search


# ---------------------------------------------------------------- the plan
def meta_gpt(args: argparse.Namespace, n_layer: int) -> GPT:
    config = GPTConfig(block_size=args.block_size, n_layer=n_layer, n_head=args.n_head, n_embd=args.n_embd)
    with torch.device("meta"):
        return GPT(config, seed=args.seed)


def plan_kwargs(args: argparse.Namespace, *, activations: bool) -> dict:
    kwargs = dict(world_size=args.world_size, policy={Block}, device="cpu", optimizer="adamw",
                  optimizer_in_backward=bool(getattr(args, "optimizer_in_backward", False)))
    if activations:
        kwargs["input_shape"] = (args.batch_size // args.world_size, args.block_size)
    return kwargs


class PlanPeaks:
    """The plan's peak per rank of composable_shard at ``n`` blocks, with
    activations at the bench's batch (cached: measuring them takes a few
    seconds at large sizes)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.totals: dict[int, int] = {}  # n_layer -> plan's rank_bytes["total"]

    def __call__(self, n_layer: int) -> int:
        import composable_shard as cs

        if n_layer not in self.totals:
            found = cs.plan(meta_gpt(self.args, n_layer), **plan_kwargs(self.args, activations=True))
            self.totals[n_layer] = found.rank_bytes["total"]
        return self.totals[n_layer]


@dataclass
class Prediction:
    n_layer: int  # composable_shard's largest size by the plan
    plan_budget_bytes: int  # per rank, for the plan's tensors
    slope_bytes: int  # one more block, per rank


def predict(args: argparse.Namespace, budget: int, baseline: list[int], peaks: PlanPeaks) -> Prediction:
    """The plan's largest size: per rank, the budget less each process's
    memory before the model (the probe's) must hold the plan's peak. Planned
    without activations first (fast), then again with the budget less the
    activations at that size."""
    import composable_shard as cs

    per_rank = (budget - sum(baseline)) // args.world_size
    build = lambda n: meta_gpt(args, n)  # noqa: E731
    first = cs.largest_fitting(build, max(per_rank, 0), **plan_kwargs(args, activations=False))
    if first.plan is None:
        return Prediction(0, per_rank, first.next_total or 0)
    activations = peaks(first.n) - first.plan.rank_bytes["total"]
    final = cs.largest_fitting(build, max(per_rank - activations, 0), **plan_kwargs(args, activations=False))
    return Prediction(final.n, per_rank, final.bytes_per_step or first.bytes_per_step or 0)


# ---------------------------------------------------------------- the run
def decide_budget(args: argparse.Namespace) -> tuple[int, int, str]:
    """(budget bytes for a trial's processes, MemAvailable at the start, how
    the budget was chosen)."""
    available = mem_available_bytes()
    margin = int(args.memory_margin * GiB)
    if args.memory_budget is None:
        return available - margin, available, f"MemAvailable {available / GiB:.2f} GiB - margin {args.memory_margin} GiB"
    pretend = int(args.memory_budget * GiB)
    if pretend > available - margin:
        logger.warning("--memory-budget %.2f GiB is more than is available (%.2f GiB - margin); using that",
                       args.memory_budget, (available - margin) / GiB)
        return available - margin, available, f"MemAvailable {available / GiB:.2f} GiB - margin (capped)"
    return pretend, available, f"--memory-budget {args.memory_budget} GiB (pretended)"


def _params(args: argparse.Namespace, n_layer: int) -> float:
    return sum(p.numel() for p in meta_gpt(args, n_layer).parameters()) / 1e6


def _trial_line(args: argparse.Namespace, result: TrialResult, peaks: PlanPeaks) -> str:
    head = f"[{result.mode}] {result.n_layer} blocks ({_params(args, result.n_layer):,.1f}M params): "
    if not result.fits:
        return head + f"{result.detail.splitlines()[0] if result.detail else result.status} | reached {result.reached} | {result.seconds:.0f} s"
    text = head + f"fits | peak/rank {result.peak_rise_mb:,.1f} MB"
    if result.mode == "composable_shard":
        planned = peaks(result.n_layer) / MB
        text += f" (plan {planned:,.1f} MB, {100 * (planned - result.peak_rise_mb) / result.peak_rise_mb:+.1f}%)"
    loss = f"{result.losses[-1]:.4f}" if result.losses else "-"
    return text + (f" | trial {result.usage_bytes / MB:,.0f} MB | final loss {loss} | {result.seconds:.0f} s "
                   f"(build {result.build_s:.0f} s, steps {sum(result.step_s):.0f} s)")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(f"bench: signal {signum}")  # unwinds through run_trial, which stops the trial's ranks


def main(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    budget, available, how = decide_budget(args)
    floor = int(args.memory_floor * GiB)
    peaks = PlanPeaks(args)
    print(f"largest: GPT blocks of width {args.n_embd} ({args.n_head} heads), seq {args.block_size}, global batch "
          f"{args.batch_size} | {args.world_size} ranks, gloo, fp32, AdamW"
          f"{' stepped in backward (one per parameter)' if getattr(args, 'optimizer_in_backward', False) else ''}, "
          f"{args.memory_steps} steps per trial | "
          f"budget {budget / GiB:.2f} GiB for a trial's processes ({how}); watchdog floor MemAvailable "
          f"{args.memory_floor} GiB | torch {torch.__version__}", flush=True)
    all_trials: list[TrialResult] = []
    with tempfile.TemporaryDirectory(prefix="bench-largest-") as work_dir:

        def trial(mode: str, n_layer: int) -> TrialResult:
            result = run_trial(args, mode, n_layer, budget_bytes=budget, floor_bytes=floor, work_dir=work_dir)
            all_trials.append(result)
            print(_trial_line(args, result, peaks), flush=True)
            if result.status == "error":
                raise SystemExit(f"bench --config largest: trial {mode} at {n_layer} blocks failed: {result.detail}")
            return result

        probes = {mode: trial(mode, args.probe_layers) for mode in args.modes}
        if not all(p.fits for p in probes.values()):
            print(f"a probe at {args.probe_layers} blocks does not fit the budget: lower --probe-layers")
            return 1
        baseline = max((p.start_usage_bytes for p in probes.values()), key=sum)
        prediction = predict(args, budget, baseline, peaks)
        print(f"plan: composable_shard's largest size {prediction.n_layer} blocks (per rank {prediction.plan_budget_bytes / MB:,.0f} MB "
              f"for the plan's tensors: budget less the processes' baseline {sum(baseline) / MB:,.0f} MB; "
              f"one more block adds {prediction.slope_bytes / MB:,.1f} MB per rank)", flush=True)
        slope_total = prediction.slope_bytes * args.world_size
        searches = {}
        for mode in args.modes:
            probe = probes[mode]
            # Half-way to the limit the plan's slope gives from the probe: a
            # second measured size, then the measured slope decides.
            guess = _estimate({args.probe_layers: probe.usage_bytes}, slope_total, budget)
            searches[mode] = search_limit(
                lambda n, mode=mode: trial(mode, n),
                first=(args.probe_layers + guess) // 2, slope_bytes=slope_total, budget_bytes=budget,
                known={args.probe_layers: probe}, low=1,
            )
    _print_table(args, searches, prediction, budget, how)
    if args.plot is not None and "composable_shard" in searches:
        _draw_at_limit(args, searches["composable_shard"])
    if args.results:
        with open(args.results, "w") as f:
            json.dump({"budget_bytes": budget, "mem_available_bytes": available, "budget_source": how,
                       "prediction": asdict(prediction), "plan_peaks_bytes": peaks.totals,
                       "trials": [asdict(t) for t in all_trials]}, f, indent=1)
        print(f"raw trials written to {args.results}")
    return 0


def _draw_at_limit(args: argparse.Namespace, search: Search) -> None:
    """--plot: composable_shard at its largest size, planned and measured."""
    from .plot import draw

    at_limit = [o for n, o in search.trials if n == search.limit and isinstance(o, TrialResult) and o.samples]
    if not at_limit:
        print(f"--plot: no samples of composable_shard at {search.limit} blocks (its trial did not record)")
        return
    draw(args, search.limit, at_limit[-1].samples, args.plot)


def _print_table(args: argparse.Namespace, searches: dict[str, Search], prediction: Prediction, budget: int,
                 how: str) -> None:
    print(f"\nlargest n_layer that trains (width {args.n_embd}; budget {budget / GiB:.2f} GiB: {how})")
    header = ["mode", "largest", "params", "peak/rank MB", "first not fitting", "trials", "trial s (median)"]
    rows = []
    for mode, search in searches.items():
        at_limit = [o for n, o in search.trials if n == search.limit and o.fits]
        peak = f"{at_limit[0].peak_rise_mb:,.1f}" if at_limit else "-"
        times = [o.seconds for _, o in search.trials if isinstance(o, TrialResult)]
        rows.append([mode, f"{search.limit}", f"{_params(args, search.limit):,.1f}M", peak,
                     f"{search.first_failed or '-'}", f"{len(search.trials)}",
                     f"{statistics.median(times) if times else 0:.0f}"])
    if args.markdown:
        print()
        print(markdown_table(header, rows, right_aligned=set(range(1, len(header)))))
        print()
    else:
        widths = [17, 7, 9, 12, 17, 6, 16]
        for row in [header, *rows]:
            print(" ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(row, widths))))
    print(f"plan's prediction for composable_shard: {prediction.n_layer} blocks "
          f"(measured {searches['composable_shard'].limit if 'composable_shard' in searches else '-'})")
    print("peak/rank: RSS high-water rise per rank after the processes' setup, largest over ranks (ours counts its "
          "/dev/shm slots once); trials count the processes' whole private memory against the budget.")
