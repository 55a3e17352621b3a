"""Owns: ``bench.py skipped-units``.

Memory cost of ``set_may_be_skipped``: the peak bytes of unsharded
parameters and of unsharded gradients one rank holds in a step of a
mixture-of-experts layer (4 experts, each its own unit, anchored at the
root), with and without the mode, every rank routing to every expert (so
that both modes run). Counted exactly from the handles at every all-gather
and reduction the scheduler issues, and at the end of backward.

Run: python scripts/bench.py skipped-units [--width 256]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import fully_shard, set_may_be_skipped
from composable_shard.runtime.scheduler import Scheduler
from composable_shard.runtime.state import unit_states_under

from .processes import spawn

EXPERTS = 4


class Expert(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class MoE(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.experts = nn.ModuleList(Expert(width) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        rows = x.shape[0] // EXPERTS
        return torch.cat([expert(x[i * rows : (i + 1) * rows]) for i, expert in enumerate(self.experts)])


def _measure(model: nn.Module, width: int) -> tuple[int, int]:
    peaks = [0, 0]

    def sample() -> None:
        params = grads = 0
        for _, state in unit_states_under(model):
            for handle in state.handles:
                params += handle.unsharded_storage_bytes()
                grad = handle.unsharded_flat_param.grad
                grads += 0 if grad is None else grad.numel() * grad.element_size()
        peaks[0], peaks[1] = max(peaks[0], params), max(peaks[1], grads)

    unshard, reduce, wait = Scheduler.unshard, Scheduler.reduce, Scheduler.wait_for_all
    Scheduler.unshard = lambda self, *a, **k: (unshard(self, *a, **k), sample())[0]  # type: ignore[method-assign]
    Scheduler.reduce = lambda self, *a, **k: (sample(), reduce(self, *a, **k))[1]  # type: ignore[method-assign]
    Scheduler.wait_for_all = lambda self: (sample(), wait(self))[1]  # type: ignore[method-assign]
    try:
        for _ in range(2):
            model(torch.randn(8 * EXPERTS, width)).square().mean().backward()
    finally:
        Scheduler.unshard, Scheduler.reduce, Scheduler.wait_for_all = unshard, reduce, wait  # type: ignore[method-assign]
    return peaks[0], peaks[1]


def _run(rank: int, args: argparse.Namespace, port: int) -> None:
    width, world_size = args.width, args.nprocs
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = {}
    for mode in (False, True):
        torch.manual_seed(0)
        model = MoE(width)
        for expert in model.experts:
            fully_shard(expert)
        fully_shard(model)
        if mode:
            set_may_be_skipped(model.experts)
        results[mode] = _measure(model, width)
    if rank == 0:
        expert = sum(p.numel() * p.element_size() for p in Expert(width).parameters())
        print(f"width {width}: one expert {expert / 2**20:.2f} MiB unsharded, {EXPERTS} experts, {world_size} ranks")
        for mode, (params, grads) in results.items():
            print(f"  set_may_be_skipped={mode!s:5}: peak unsharded params {params / 2**20:6.2f} MiB, peak unsharded grads {grads / 2**20:6.2f} MiB")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.py skipped-units", description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=256, help="the experts' width")
    args = parser.parse_args(argv)
    args.nprocs = 2
    spawn(_run, args)
    return 0
