"""Owns: the timing pass — every mode in one set of processes, warm-up, the
interleaved timed steps (slowest rank's time per step), every step's loss,
``--profile``'s table of one step and ``--overlap-report``'s profiled steps
(after the timed ones: they do not count in the times).

Knows nothing of: how the modes wrap the model, memory, the printed table
(it writes ``timing_rank{r}.json`` for ``report.py``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from data import ByteCorpus

from .overlap import format_overlap, profile_overlap
from .peers import runs_on
from .processes import init_worker
from .training import ModeRun, barrier, build_run, next_batch, synchronize, timed_schedule, train_step


def profile_step(run: ModeRun, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace, device: torch.device) -> str:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        train_step(run, x, y, args, device)
        synchronize(device)
    sort_by = "self_cpu_time_total"
    if device.type == "cuda":  # renamed in newer torch; the old name may go away
        averages = prof.key_averages()
        sort_by = "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=30)
    hooks = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    return f"{table}\n\nby total time (hooks are labelled composable_shard::...):\n{hooks}\n\n{_hooks_by_kind(prof)}"


def _hooks_by_kind(prof: torch.profiler.profile) -> str:
    """composable_shard's hook labels summed over units, per kind of hook
    (the label before the unit's name): calls and total CPU ms."""
    kinds: dict[str, list[float]] = {}
    for event in prof.key_averages():
        if event.key.startswith("composable_shard::"):
            kind = event.key.split(" ", 1)[0]
            calls_ms = kinds.setdefault(kind, [0, 0.0])
            calls_ms[0] += event.count
            calls_ms[1] += event.cpu_time_total / 1e3
    lines = ["composable_shard's hooks by kind (summed over units):", f"{'hook':<40} {'calls':>6} {'total ms':>9}"]
    for kind, (calls, ms) in sorted(kinds.items(), key=lambda item: -item[1][1]):
        lines.append(f"{kind:<40} {int(calls):>6} {ms:>9.1f}")
    return "\n".join(lines)


def owner_step_record(run: ModeRun) -> dict:
    """What composable_shard's owner step did in the last step (for
    ``--optimizer muon``): elements this rank sent to owners and back, the
    elements its reduce-scatters carry per step (its flat gradients' padded
    sizes), and the optimizer work each rank of the group owns."""
    from composable_shard.optim import last_step_traffic, owner_plans
    from composable_shard.runtime.lifecycle import live_units
    from composable_shard.runtime.state import unit_states_under

    from composable_shard.runtime.optimizer_checks import is_elementwise

    record: dict = {}
    for optimizer in getattr(run.optimizer, "optimizers", ()):
        if is_elementwise(optimizer):
            continue
        plans = [plan for plan in owner_plans(optimizer, live_units()) if plan.params]
        if not plans:
            continue
        traffic = last_step_traffic(optimizer)
        record["owner_traffic"] = {"to_owners": traffic.to_owners, "from_owners": traffic.from_owners,
                                   "bytes_sent": traffic.bytes_sent}
        record["owner_work"] = [sum(plan.work_per_rank()[r] for plan in plans) for r in range(plans[0].world_size)]
    record["reduce_scatter_elements"] = sum(
        handle.layout.padded_unsharded_numel
        for _, state in unit_states_under(run.model)
        for handle in state.handles
        if handle.requires_grad
    )
    return record


def timing_worker(rank: int, args: argparse.Namespace, port: int, out_dir: str) -> None:
    device = init_worker(rank, args, port)
    corpus = ByteCorpus.from_stdlib(args.data_bytes)
    runs: dict[str, ModeRun] = {}
    for mode in args.modes:  # the same order on every rank: builders may use collectives
        if runs_on(mode, rank):
            runs[mode] = build_run(mode, args, device)
            runs[mode].step_times_s = [[] for _ in range(args.rounds)]
    for mode in args.modes:
        for _ in range(args.warmup):
            barrier(args, device)
            if mode in runs:
                train_step(runs[mode], *next_batch(runs[mode], corpus, args, device), args, device)
    for round_index, mode in timed_schedule(args.modes, args):
        barrier(args, device)
        if mode not in runs:
            continue
        x, y = next_batch(runs[mode], corpus, args, device)  # not timed
        synchronize(device)
        start = time.perf_counter()
        train_step(runs[mode], x, y, args, device)
        synchronize(device)
        runs[mode].step_times_s[round_index].append(time.perf_counter() - start)
    if args.profile is not None:
        barrier(args, device)
        if args.profile in runs:
            run = runs[args.profile]
            table = profile_step(run, *next_batch(run, corpus, args, device), args, device)
            if rank == 0:
                Path(out_dir, "profile.txt").write_text(table)
    if args.overlap_report:
        reports = []
        for mode in args.modes:
            barrier(args, device)
            if mode in runs:
                reports.append(format_overlap(mode, profile_overlap(runs[mode], corpus, args, device, args.overlap_steps)))
        if rank == 0:
            Path(out_dir, "overlap.txt").write_text("\n".join(reports) + "\n")
    record = {
        mode: {
            "losses": torch.stack(run.losses).float().tolist(),
            "step_times_s": run.step_times_s,
            "optimizer_times_s": run.optimizer_times_s,
            **(owner_step_record(run) if mode == "composable_shard" else {}),
        }
        for mode, run in runs.items()
    }
    Path(out_dir, f"timing_rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
