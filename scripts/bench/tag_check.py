"""Owns: ``bench.py tag-check``.

Cost of the tag exchange beside a collective on gloo's message path
(comm/tag_check.py): ``comm.all_gather_into`` at 2 ranks with
COMPOSABLE_SHARD_SHARED_MEMORY=0, tagged and untagged, interleaved, median
of 50 after 10 warm-up.

Run: python scripts/bench.py tag-check
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from composable_shard import comm
from composable_shard.comm import tags

from .processes import spawn


class _Key:
    """Stands for a flat parameter: what a tag is registered under."""


def _run(rank: int, args: argparse.Namespace, port: int) -> None:
    world_size = args.nprocs
    os.environ["COMPOSABLE_SHARD_SHARED_MEMORY"] = "0"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    key, untagged = _Key(), _Key()
    tags.register(key, 5, "unit 'x'")
    for numel in (256, 786432):
        shard, output = torch.randn(numel), torch.empty(numel * world_size)
        seconds: dict[bool, list[float]] = {False: [], True: []}
        for iteration in range(60):
            for tagged in (False, True):
                dist.barrier()
                started = time.perf_counter()
                with tags.collective_of(key if tagged else untagged):
                    work = comm.all_gather_into(output, shard, None, async_op=True)
                work.wait()
                if iteration >= 10:
                    seconds[tagged].append(time.perf_counter() - started)
        if rank == 0:
            print(
                f"{numel * 4} bytes per rank: untagged median {statistics.median(seconds[False]) * 1e6:.0f} us, "
                f"tagged {statistics.median(seconds[True]) * 1e6:.0f} us"
            )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.py tag-check", description=__doc__.split("\n\n")[0])
    args = parser.parse_args(argv)
    args.nprocs = 2
    spawn(_run, args)
    return 0
