"""Owns: ``bench.py phases``.

Where a training step's time goes, per mode, with the modes interleaved in
one set of processes (as the timing pass runs them: turns of
``--round-steps`` steps, the order rotating every turn): the step of the
slowest rank, rank 0's forward, backward and optimizer step (wall clock;
the device synchronised at each boundary on CUDA), and the CPU time of
rank 0's main thread over the step. ``step - CPU`` is what that thread did
not compute: waiting for peers, for the device, or for a core the machine
gave to something else (a mode without communication, ``local``, shows
the machine's own share). A backend's threads (gloo's all-reduce under
DDP) are not counted: the column says how much work the step puts on the
thread that runs the model and its hooks. ``paired``: the median over
turns of the mode's mean step divided by the first mode's in the same turn.

Every other setting is the main bench's (``--config``, sizes, optimizer,
mixed precision); by default the ``many-small`` GPT, ours against DDP and
the unwrapped model.

Run: python scripts/bench.py phases [--config many-small] [--modes composable_shard,ddp,local]
     [--rounds 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from data import ByteCorpus

from .markdown import titled_table
from .peers import runs_on
from .processes import init_worker, spawn_collecting
from .report import paired_ratio_of_rounds
from .training import ModeRun, barrier, build_run, next_batch, timed_schedule, train_step

# Per step: slowest rank's step, rank 0's forward, backward, optimizer step, main thread's CPU (seconds).
COLUMNS = ("step", "forward", "backward", "optimizer step", "main thread's CPU")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from .cli import parse_args as bench_args

    p = argparse.ArgumentParser(prog="bench.py phases", description=__doc__.split("\n\n")[1])
    p.add_argument("--config", default="many-small")
    p.add_argument("--modes", default="composable_shard,ddp,local", help="comma list of the main bench's modes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    p.add_argument("--markdown", action="store_true", help="the table as Markdown")
    own, rest = p.parse_known_args(argv)
    # Everything else (--device, --world-size, sizes, --mixed-precision, ...)
    # is the main bench's, checked by its parser.
    args = bench_args(["--config", own.config, "--modes", own.modes, "--rounds", str(own.rounds),
                       "--steps", str(own.steps), "--warmup", str(own.warmup), "--memory-steps", "0", *rest])
    if args.simulated:
        p.error("phases needs real ranks (no --simulate-world-size): it measures their waits")
    args.markdown = own.markdown
    return args


def phased_step(run: ModeRun, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace, device: torch.device) -> list[float]:
    """The timing pass's training step (``training.train_step``), timed per
    phase: [step, forward, backward, optimizer step, main thread's CPU] in
    seconds, this rank's."""
    marks: list[float] = []
    cpu_start, start = time.thread_time(), time.perf_counter()
    train_step(run, x, y, args, device, marks)
    end = time.perf_counter()
    cpu = time.thread_time() - cpu_start
    forward_end, backward_end = marks
    return [end - start, forward_end - start, backward_end - forward_end, end - backward_end, cpu]


def _worker(rank: int, args: argparse.Namespace, port: int, out: dict) -> None:
    device = init_worker(rank, args, port)
    corpus = ByteCorpus.from_stdlib(args.data_bytes)
    modes = [mode for mode in args.modes if runs_on(mode, rank)]
    if modes != args.modes:
        raise SystemExit(f"bench.py phases: modes {sorted(set(args.modes) - set(modes))} run on rank 0 only")
    runs = {mode: build_run(mode, args, device) for mode in modes}
    for mode in modes:
        for _ in range(args.warmup):
            phased_step(runs[mode], *next_batch(runs[mode], corpus, args, device), args, device)
    # Per mode, per round, per timed step (in the schedule's order): the columns of COLUMNS.
    records: dict[str, list[list[list[float]]]] = {mode: [[] for _ in range(args.rounds)] for mode in modes}
    for round_index, mode in timed_schedule(modes, args):
        x, y = next_batch(runs[mode], corpus, args, device)
        barrier(args, device)
        record = phased_step(runs[mode], x, y, args, device)
        slowest = torch.tensor([record[0]], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        record[0] = slowest.item()
        records[mode][round_index].append(record)
    if rank == 0:
        out.update(records)
    dist.destroy_process_group()


def report(args: argparse.Namespace, records: dict[str, list[list[list[float]]]]) -> str:
    """The table: per mode, the median over its steps of each column of
    COLUMNS and of step less CPU, and the paired ratio to the first mode
    (``records``: per mode, per round, per step, COLUMNS in seconds)."""
    first = next(iter(records))
    header = ["mode", *[f"{name} ms" for name in COLUMNS], "step - CPU ms", f"paired ÷ {first}"]
    rows = []
    for mode, rounds in records.items():
        steps = [step for steps in rounds for step in steps]
        medians = [statistics.median(step[index] for step in steps) * 1e3 for index in range(len(COLUMNS))]
        idle = statistics.median(step[0] - step[-1] for step in steps) * 1e3
        paired = paired_ratio_of_rounds(_steps_of(rounds), _steps_of(records[first]), args.round_steps)
        rows.append([mode, *[f"{value:,.1f}" for value in medians], f"{idle:,.1f}", f"{paired:.3f}"])
    title = (f"{args.config}: where a step's time goes | {args.device} world size {args.world_size}, "
             f"{args.threads} thread(s)/process | {args.rounds} rounds x {args.steps} steps/mode, interleaved | "
             f"medians over steps; step: the slowest rank's, phases and CPU: rank 0's | torch {torch.__version__}")
    return titled_table(title, header, rows, markdown=args.markdown)


def _steps_of(rounds: list[list[list[float]]]) -> list[list[float]]:
    """Per round, each step's time (the first column)."""
    return [[step[0] for step in steps] for steps in rounds]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(report(args, spawn_collecting(_worker, args)))
    return 0
