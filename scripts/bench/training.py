"""Owns: one mode's run inside one rank — its batches (the same global batch
at step i for every mode), its training step, the barrier and device
synchronize around timed steps, and the order of the timed steps.

Knows nothing of: how the modes wrap the model (``peers.py``), processes,
what is measured around a step.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from data import ByteCorpus, rank_slice

from .peers import PEERS, autocast_for


@dataclass
class ModeRun:
    """One mode's model, optimizer and record, inside one rank."""

    mode: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    steps_done: int = 0  # also picks the batch: every mode sees batch i at its step i
    losses: list[torch.Tensor] = field(default_factory=list)  # 0-d, this rank's slice, every step
    step_times_s: list[list[float]] = field(default_factory=list)  # per round, timed steps only
    optimizer_times_s: list[float] = field(default_factory=list)  # optimizer.step() of every step


def build_run(mode: str, args: argparse.Namespace, device: torch.device) -> ModeRun:
    return ModeRun(mode, *PEERS[mode].build(args, device))


def next_batch(
    run: ModeRun, corpus: ByteCorpus, args: argparse.Namespace, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's next batch: the global batch of its step, sliced for this rank
    unless the mode trains on rank 0 alone (``single``; simulated: it gets one
    rank's slice, the work of one simulated rank)."""
    generator = torch.Generator().manual_seed(args.seed + run.steps_done)
    x, y = corpus.get_batch("train", args.batch_size, args.block_size, generator)  # (B, T) global
    if not PEERS[run.mode].rank0_only or args.simulated:
        x = rank_slice(x, dist.get_rank(), args.world_size)  # (B / world_size, T)
        y = rank_slice(y, dist.get_rank(), args.world_size)
    return x.to(device), y.to(device)


def train_step(
    run: ModeRun,
    x: torch.Tensor,
    y: torch.Tensor,
    args: argparse.Namespace,
    device: torch.device,
    marks: list[float] | None = None,
) -> None:
    """One training step; with ``marks``, the clock (``time.perf_counter``)
    is appended there as the forward ends (the device synchronised first)
    and as the backward ends."""
    with autocast_for(run.mode, args, device):
        _, loss = run.model(x, y)
    if marks is not None:
        synchronize(device)
        marks.append(time.perf_counter())
    loss.backward()
    synchronize(device)
    start = time.perf_counter()
    if marks is not None:
        marks.append(start)
    run.optimizer.step()
    synchronize(device)
    run.optimizer_times_s.append(time.perf_counter() - start)
    run.optimizer.zero_grad(set_to_none=True)
    run.losses.append(loss.detach())
    run.steps_done += 1


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a host-device sync point: the step's kernels are done


def barrier(args: argparse.Namespace, device: torch.device) -> None:
    if args.simulated:
        return  # one process: nothing to line up
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def timed_schedule(modes: list[str], args: argparse.Namespace) -> Iterator[tuple[int, str]]:
    """(round, mode) of each timed step: per round, every mode runs
    ``steps`` steps in turns of ``round_steps``, the order rotated each turn."""
    turns = math.ceil(args.steps / args.round_steps)
    turn_index = 0
    for r in range(args.rounds):
        for t in range(turns):
            shift = turn_index % len(modes)
            turn_index += 1
            for mode in modes[shift:] + modes[:shift]:
                for i in range(args.round_steps):
                    if t * args.round_steps + i < args.steps:
                        yield r, mode
