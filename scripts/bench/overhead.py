"""Owns: ``bench.py overhead``.

The runtime's own cost per unit per training step, without communication:
one process in PyTorch's fake process group of ``--world-size`` ranks (8 by
default; collectives do nothing, every rank-dependent size is a rank's of
that group), the ``many-small`` GPT (64 blocks of width 64, each block one
unit; ``--n-layer`` / ``--n-embd`` change it), AdamW. Modes, each with its own
model and optimizer, interleaved step by step in one process (the order
rotating every turn, as the timing pass does): ``composable_shard``,
``fsdp2``, ``fsdp1``, and ``local``, the same unwrapped model on one rank's
slice of the batch (the compute floor). A mode's overhead per unit is its
step time less ``local``'s, over the number of blocks: µs per unit per
step, from each round's medians (the median over rounds), and from the
fastest step of each mode over the whole run (``min``: on a shared,
loaded machine noise only adds, so the fastest steps are the steadiest
estimate of the code's own cost). Parameters are never really gathered,
so losses are meaningless. ``--clock cpu`` times steps by the process's
CPU time instead of the wall clock: on a machine other processes load,
waiting for a core then does not count (the work itself still slows by
what they do to caches).

Run: python scripts/bench.py overhead [--rounds 5] [--steps 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch.distributed as dist
from data import ByteCorpus

from .markdown import titled_table
from .processes import init_worker, spawn_collecting
from .training import ModeRun, build_run, next_batch, timed_schedule, train_step

MODES = ("composable_shard", "fsdp2", "fsdp1", "local")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from .cli import parse_args as bench_args

    p = argparse.ArgumentParser(prog="bench.py overhead", description=__doc__.split("\n\n")[1])
    p.add_argument("--world-size", type=int, default=8, help="ranks of the fake process group")
    p.add_argument("--n-layer", type=int, default=64, help="blocks (units besides the root)")
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list from {','.join(MODES)}")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per mode first")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (1: steadier on a shared machine)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="time steps by the wall clock or by the process's CPU time (steadier on a loaded machine)")
    p.add_argument("--markdown", action="store_true", help="the table as Markdown")
    own = p.parse_args(argv)
    modes = [m.strip() for m in own.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        p.error(f"--modes: {unknown} unknown; choose from {','.join(MODES)}")
    if "local" not in modes:
        p.error("--modes must include local: the overhead is measured against it")
    if min(own.rounds, own.steps, own.world_size, own.n_layer, own.threads) < 1:
        p.error("--rounds, --steps, --world-size, --n-layer and --threads must be at least 1")
    # Every other setting (model sizes, optimizer, seed) as the main bench's
    # many-small configuration under --simulate-world-size.
    args = bench_args([
        "--config", "many-small", "--simulate-world-size", str(own.world_size), "--modes", "composable_shard",
        "--n-layer", str(own.n_layer), "--n-embd", str(own.n_embd), "--threads", str(own.threads),
        "--rounds", str(own.rounds), "--steps", str(own.steps), "--warmup", str(own.warmup), "--round-steps", "1",
    ])
    args.modes = modes
    args.markdown = own.markdown
    args.clock = own.clock
    return args


def _worker(rank: int, args: argparse.Namespace, port: int, out: dict) -> None:
    device = init_worker(rank, args, port)
    corpus = ByteCorpus.from_stdlib(args.data_bytes)
    runs: dict[str, ModeRun] = {mode: build_run(mode, args, device) for mode in args.modes}
    for run in runs.values():
        run.step_times_s = [[] for _ in range(args.rounds)]
    for mode in args.modes:
        for _ in range(args.warmup):
            train_step(runs[mode], *next_batch(runs[mode], corpus, args, device), args, device)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for round_index, mode in timed_schedule(args.modes, args):
        x, y = next_batch(runs[mode], corpus, args, device)
        start = clock()
        train_step(runs[mode], x, y, args, device)
        runs[mode].step_times_s[round_index].append(clock() - start)
    units = {mode: _units(run) for mode, run in runs.items()}
    out.update({mode: (run.step_times_s, units[mode]) for mode, run in runs.items()})
    dist.destroy_process_group()


def _units(run: ModeRun) -> int:
    """Units the mode built (composable_shard: every fully_shard'ed module,
    the root included); 0 for the unwrapped model."""
    if run.mode == "composable_shard":
        from composable_shard.runtime.state import unit_states_under

        return sum(1 for _ in unit_states_under(run.model))
    if run.mode == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        return sum(isinstance(m, FSDPModule) for m in run.model.modules())
    if run.mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return sum(isinstance(m, FullyShardedDataParallel) for m in run.model.modules())
    return 0


def report(args: argparse.Namespace, results: dict) -> str:
    local = [statistics.median(times) for times in results["local"][0]]
    local_min = min(min(times) for times in results["local"][0])
    header = ["mode", "units", *[f"round {r + 1} ms" for r in range(args.rounds)], "median ms", "min ms",
              "µs/unit/step (median)", "(min)", "÷ fsdp2 (median)", "(min)"]
    per_unit: dict[str, tuple[float, float]] = {}
    rows = []
    for mode in args.modes:
        rounds = [statistics.median(times) for times in results[mode][0]]
        median_s = statistics.median(rounds)
        fastest = min(min(times) for times in results[mode][0])
        cells = [mode, str(results[mode][1]), *[f"{s * 1e3:,.1f}" for s in rounds], f"{median_s * 1e3:,.1f}",
                 f"{fastest * 1e3:,.1f}"]
        if mode == "local":
            cells += ["(floor)", "", "", ""]
        else:
            # Per round, against that round's local step: noise hits both alike.
            overheads = [(s - floor) / args.n_layer for s, floor in zip(rounds, local)]
            per_unit[mode] = (statistics.median(overheads) * 1e6, (fastest - local_min) / args.n_layer * 1e6)
            cells += [f"{per_unit[mode][0]:,.0f}", f"{per_unit[mode][1]:,.0f}", "", ""]
        rows.append(cells)
    if "fsdp2" in per_unit:
        for cells in rows:
            if cells[0] in per_unit:
                mine, theirs = per_unit[cells[0]], per_unit["fsdp2"]
                cells[-2:] = [f"{mine[0] / theirs[0]:.2f}", f"{mine[1] / theirs[1]:.2f}"]
    title = (f"runtime overhead: fake process group of {args.world_size} ranks, {args.n_layer} blocks of width "
             f"{args.n_embd}, batch {args.batch_size // args.world_size} x {args.block_size} per rank, "
             f"{args.threads} thread(s), {args.rounds} rounds of {args.steps} steps (each round's median), "
             f"{args.clock} clock")
    return titled_table(title, header, rows, markdown=args.markdown)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(report(args, spawn_collecting(_worker, args)))
    return 0
