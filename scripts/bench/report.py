"""Owns: what the ranks' records say together — each mode's global-batch loss
per step, its timed steps (slowest rank's), its memory (largest over ranks,
median over repeats) — and the printed table with its notes.

Knows nothing of: how anything was measured (it reads the JSON files the
timing and memory passes wrote).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .configs import CONFIGS
from .markdown import markdown_table
from .peers import PEERS, bf16_enabled

LOSS_RTOL = 1e-4  # fp32 agreement required between modes (relative)


@dataclass
class ModeResult:
    mode: str
    losses: list[float]  # global-batch loss per step (mean over ranks)
    round_ms: list[list[float]]  # per round, per timed step, slowest rank
    after_build_mb: float | None  # largest over ranks, median over repeats; None if not measured
    peak_mb: float | None  # largest over ranks, median over repeats; None if not measured
    peak_repeats_mb: list[float] = field(default_factory=list)  # each repeat's peak
    optimizer_ms: float | None = None  # median optimizer.step(), slowest rank
    rank_records: list[dict] = field(default_factory=list)  # each rank's raw record (owner-step figures)

    @property
    def step_ms(self) -> list[float]:
        return [ms for round_ms in self.round_ms for ms in round_ms]


def _largest(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _median_present(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def collect(args: argparse.Namespace, out_dir: str) -> dict[str, ModeResult]:
    per_rank = [json.loads(Path(out_dir, f"timing_rank{r}.json").read_text()) for r in range(args.nprocs)]
    results = {}
    for mode in args.modes:
        records = [record[mode] for record in per_rank if mode in record]
        losses = [statistics.fmean(step) for step in zip(*(rec["losses"] for rec in records))]
        round_ms = [
            [1000 * max(step) for step in zip(*(rec["step_times_s"][r] for rec in records))]
            for r in range(args.rounds)
        ]
        builds: list[float | None] = []
        peaks: list[float | None] = []
        for repeat in range(args.memory_repeats if args.memory_steps > 0 else 0):
            memory = [
                json.loads(Path(out_dir, f"memory_{mode}_{repeat}_rank{r}.json").read_text())
                for r in range(args.nprocs)
            ]
            builds.append(_largest([m["after_build_mb"] for m in memory]))
            peaks.append(_largest([m["peak_increase_mb"] for m in memory]))
        optimizer_steps = [1000 * max(step) for step in zip(*(rec.get("optimizer_times_s", []) for rec in records))]
        results[mode] = ModeResult(
            mode,
            losses,
            round_ms,
            _median_present(builds),
            _median_present(peaks),
            [p for p in peaks if p is not None],
            statistics.median(optimizer_steps) if optimizer_steps else None,
            records,
        )
    return results


def _loss_compared(mode: str, args: argparse.Namespace) -> bool:
    return not args.simulated and PEERS[mode].loss_compared


def _plan_note(args: argparse.Namespace, results: dict[str, ModeResult]) -> str | None:
    """composable_shard's planned peak per rank beside the measured one,
    where the plan describes the run (the plain GPT in fp32 on CPU, every
    block one unit)."""
    ours = results.get("composable_shard")
    plain = CONFIGS[args.config].customize is None and not args.activation_checkpointing
    if ours is None or ours.peak_mb is None or args.device != "cpu" or bf16_enabled(args) or not plain:
        return None
    import composable_shard as cs

    from .largest import meta_gpt, plan_kwargs

    planned = cs.plan(meta_gpt(args, args.n_layer), **plan_kwargs(args, activations=True))
    plan_mb = planned.rank_bytes["total"] / 2**20
    runtime_mb = planned.rank_bytes["runtime"] / 2**20
    return (
        f"plan: composable_shard's peak per rank {plan_mb:.1f} MB: live tensors at '{planned.peak_moment}' "
        f"{plan_mb - runtime_mb:.1f} MB + memory that is not tensors {runtime_mb:.1f} MB (libraries' code, glibc's "
        f"kept heap: planning/runtime_memory.py); measured peak {ours.peak_mb:.1f} MB, plan "
        f"{100 * (plan_mb - ours.peak_mb) / ours.peak_mb:+.1f}%."
    )


def _owner_note(args: argparse.Namespace, results: dict[str, ModeResult]) -> str | None:
    """composable_shard's owner step (``--optimizer muon``): per rank, what it
    sent to owners and back in the last step against what its reduce-scatters
    send, and the share of Muon's work each rank owns."""
    if getattr(args, "optimizer", "adamw") != "muon" or "composable_shard" not in args.modes or args.simulated:
        return None
    per_rank = results["composable_shard"].rank_records
    if not per_rank or not all("owner_traffic" in record for record in per_rank):
        return None
    world = args.world_size
    parts = []
    for rank, record in enumerate(per_rank):
        traffic = record["owner_traffic"]
        # A reduce-scatter sends (W - 1) / W of each padded flat gradient.
        reduce_scatter = record["reduce_scatter_elements"] * (world - 1) // world
        parts.append(f"rank {rank}: {traffic['to_owners']} elements to owners + {traffic['from_owners']} back "
                     f"({traffic['bytes_sent'] / 2**20:.2f} MiB) vs {reduce_scatter} by its reduce-scatters")
    work = per_rank[0]["owner_work"]
    shares = ", ".join(f"{100 * w / sum(work):.0f}%" for w in work)
    return f"owner step (composable_shard, last step): {'; '.join(parts)}; Muon work per rank {shares} (ideal {100 / world:.0f}%)."


def paired_ratio(ours: ModeResult, theirs: ModeResult, round_steps: int) -> float:
    """The median over the schedule's turns of ``ours``' mean step divided
    by ``theirs``' in the same turn (their steps run back to back:
    ``timed_schedule``), so a machine that slows down or speeds up between
    turns moves both alike; the ratio of medians mixes turns of different
    speeds."""
    return paired_ratio_of_rounds(ours.round_ms, theirs.round_ms, round_steps)


def paired_ratio_of_rounds(ours: list[list[float]], theirs: list[list[float]], round_steps: int) -> float:
    """``paired_ratio`` of two modes' steps given per round, each round's in
    the schedule's order."""
    ratios = []
    for mine, other in zip(ours, theirs):
        for start in range(0, min(len(mine), len(other)), round_steps):
            ratios.append(statistics.mean(mine[start : start + round_steps]) / statistics.mean(other[start : start + round_steps]))
    return statistics.median(ratios)


def report(args: argparse.Namespace, results: dict[str, ModeResult]) -> bool:
    """Prints the tables (as Markdown with ``--markdown``: the same cells,
    notes as a list); returns whether the losses agree (always true in bf16
    or simulated)."""
    reference = "single" if "single" in results else args.modes[0]
    ref = results[reference]
    cs_ms = statistics.median(results["composable_shard"].step_ms) if "composable_shard" in results else None
    per_rank_batch = args.batch_size // args.world_size
    world = f"fake world size {args.world_size} (1 process)" if args.simulated else f"world size {args.world_size}"
    memory_unit = "allocated MB" if args.device == "cuda" else "RSS MB"
    print(
        f"\n{args.config}: GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head} "
        f"block={args.block_size} global batch={args.batch_size} | {args.device} {world}, "
        f"{args.threads} thread(s)/process | {args.optimizer} | {args.mixed_precision}"
        f"{' (reduce ' + args.reduce_dtype + ')' if bf16_enabled(args) else ''} | activation checkpointing "
        f"{'on' if args.activation_checkpointing else 'off'}{' | cpu offload' if args.cpu_offload else ''} "
        f"| {args.warmup} warm-up + {args.rounds} rounds x {args.steps} timed steps/mode | torch {torch.__version__}"
    )
    round_names = [f"r{r + 1}" for r in range(args.rounds)]
    header = ["mode", *round_names, "median ms", "opt ms", "tok/s", "cs/peer", "paired", f"build {memory_unit}",
              f"peak {memory_unit}", "final loss", f"max|Δloss| vs {reference}", "rel"]
    rows: list[list[str]] = []
    mismatched: list[bool] = []
    agree = True
    for mode in args.modes:
        res = results[mode]
        median_ms = statistics.median(res.step_ms)
        # Simulated: one rank's tokens; else the global batch, all ranks together.
        tokens = (per_rank_batch if args.simulated else args.batch_size) * args.block_size
        diff_txt, rel_txt, flagged = "-", "-", False
        if _loss_compared(mode, args) and _loss_compared(reference, args):
            diff = max(abs(a - b) for a, b in zip(res.losses, ref.losses))
            rel = max(abs(a - b) / abs(b) for a, b in zip(res.losses, ref.losses))
            diff_txt, rel_txt = f"{diff:.2e}", f"{rel:.1e}"
            # Muon's Newton-Schulz runs in bf16: round-off of another reduction
            # order flips bf16 roundings, so its losses are informational too.
            exact = args.mixed_precision == "none" and getattr(args, "optimizer", "adamw") != "muon"
            flagged = exact and rel > LOSS_RTOL
        agree = agree and not flagged
        mismatched.append(flagged)
        rows.append([
            mode,
            *(f"{statistics.median(ms):.1f}" for ms in res.round_ms),
            f"{median_ms:.1f}",
            f"{res.optimizer_ms:.1f}" if res.optimizer_ms is not None else "-",
            f"{tokens / median_ms * 1000:.0f}",
            f"{cs_ms / median_ms:.2f}" if cs_ms is not None else "-",
            f"{paired_ratio(results['composable_shard'], res, args.round_steps):.2f}" if cs_ms is not None else "-",
            f"{res.after_build_mb:.1f}" if res.after_build_mb is not None else "-",
            f"{res.peak_mb:.1f}" if res.peak_mb is not None else "-",
            f"{res.losses[-1]:.5f}",
            diff_txt,
            rel_txt,
        ])
    if args.markdown:
        marked = [[*row[:-1], row[-1] + (" MISMATCH" if flag else "")] for row, flag in zip(rows, mismatched)]
        print()
        print(markdown_table(header, marked, right_aligned=set(range(1, len(header)))))
        print()
    else:
        widths = [17, *(7 for _ in round_names), 9, 7, 8, 7, 6, 15, 14, 10, 24, 8]
        print(" ".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w) in enumerate(zip(header, widths))))
        for row, flag in zip(rows, mismatched):
            line = " ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(row, widths)))
            print(line + ("  MISMATCH" if flag else ""))
    notes = [
        "r1..rN: median step per round; median ms: over all rounds; opt ms: median optimizer.step() alone "
        "(every step, slowest rank); cs/peer: composable_shard's median divided by the mode's (<1: "
        "composable_shard faster); paired: the median over turns of composable_shard's mean step divided by "
        "the mode's in the same turn (steps run back to back: less moved by a machine whose speed drifts).",
        "memory: increase over the level before the mode was built, largest over ranks; build = after "
        "building model and optimizer (sharded), peak = during the memory pass's steps "
        "(composable_shard's on CPU counts its own /dev/shm slots, not its peers' that it maps).",
    ]
    plan_note = _plan_note(args, results) if getattr(args, "optimizer", "adamw") == "adamw" else None
    if plan_note:
        notes.append(plan_note)
    owner_note = _owner_note(args, results)
    if owner_note:
        notes.append(owner_note)
    if args.memory_repeats > 1 and args.memory_steps > 0:
        notes.append("peak per memory pass: " + "; ".join(
            f"{mode} " + " ".join(f"{p:.1f}" for p in results[mode].peak_repeats_mb) for mode in args.modes
        ))
    if args.simulated:
        notes.append("simulated: collectives do nothing (parameters never really gathered); tok/s is one "
                     "rank's; losses are not compared.")
    else:
        notes.append("tok/s: global batch tokens per step / median step.")
    if "single" in results and not args.simulated:
        notes.append("single: one process on the global batch with one rank's threads; its time is not a peer's.")
    if "local" in results:
        notes.append("local: every rank on its slice, no communication (compute floor); its loss is not compared.")
    if bf16_enabled(args):
        notes.append("bf16: loss differences are informational (ddp/local/single use autocast, see docstring).")
    elif getattr(args, "optimizer", "adamw") == "muon":
        notes.append("muon: Newton-Schulz in bf16 turns reduction-order round-off into bf16 steps, so loss "
                     "differences are informational (modes that reduce alike, e.g. ddp and composable_shard, agree "
                     "exactly); tests/optim/test_muon.py checks the step itself exactly.")
    elif not args.simulated:
        notes.append(f"fp32: relative loss difference above {LOSS_RTOL:g} is flagged MISMATCH.")
    for note in notes:
        print(f"- {note}" if args.markdown else note)
    return agree
