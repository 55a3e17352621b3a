"""Owns: ``bench.py comm``.

Bandwidth the flat-parameter handle reaches for its all-gather (unshard)
and reduce-scatter (reduce_grad), against raw torch.distributed calls on the
same bytes and (CPU) the raw shared-memory collectives, in one run; and the
owner step's all-to-all (an even split of the gradient's bytes) through
gloo and through shared memory.

Run: python scripts/bench.py comm [--world-size 2] [--numel 4194304] [--iters 20]
[--slot-bytes N] (gloo on CPU; --device cuda uses NCCL, one GPU per rank).
``--slot-bytes`` sets the shared-memory transport's slot size
(``shared_memory.SLOT_BYTES``) for the run, to compare sizes.
Prints, per operation, the median time, the median CPU time of rank 0's
process (all its threads: gloo's included; what competes with compute on a
busy CPU) and the bus bandwidth, and the ratios handle / raw (1.00 means no
overhead). On CPU the handle uses shared memory when the ranks share a host;
``COMPOSABLE_SHARD_SHARED_MEMORY=0`` makes it use gloo.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard.comm import ShardGroups
from composable_shard.comm import shared_memory, transport
from composable_shard.handle.layout import ParamOwner
from composable_shard.handle import FlatParamHandle, FlatParamSource

from .processes import spawn


def _seconds(fn: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """(wall, process CPU) seconds of one call."""
    dist.barrier()
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: timing only
    return time.perf_counter() - start, time.process_time() - start_cpu


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if args.slot_bytes:
        shared_memory.SLOT_BYTES = args.slot_bytes
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=args.world_size)
    world = args.world_size
    # Several parameters, like a transformer block's, flattened into one handle.
    module = nn.Module()
    per_param = args.numel // 4
    for index in range(4):
        module.register_parameter(f"p{index}", nn.Parameter(torch.randn(per_param, device=device)))
    sources = [FlatParamSource(p, (ParamOwner(module, name, name),)) for name, p in module.named_parameters()]
    handle = FlatParamHandle(sources, ShardGroups(dist.group.WORLD, None), compute_device=device)
    numel = handle.layout.padded_unsharded_numel
    shard = torch.randn(numel // world, device=device)
    full = torch.empty(numel, device=device)
    grad = torch.randn(numel, device=device)
    reduced = torch.empty(numel // world, device=device)
    async_op = device.type != "cuda"

    def handle_all_gather() -> None:
        pending = handle.unshard(async_op=async_op)
        if pending is not None and pending.work is not None:
            pending.work.wait()
        handle.use_unsharded_views()
        handle.reshard()

    def raw_all_gather() -> None:
        work = dist.all_gather_single(full, shard, async_op=async_op)
        if work is not None:
            work.wait()

    def handle_reduce_scatter() -> None:
        handle.unsharded_flat_param.grad = grad
        pending = handle.reduce_grad(async_op=async_op)
        if pending is not None and pending.work is not None:
            pending.work.wait()
        handle.finish_grad_reduction(pending)
        for param in handle.orig_params:
            param.grad = None

    def raw_reduce_scatter() -> None:
        work = dist.reduce_scatter_single(reduced, grad, async_op=async_op)
        if work is not None:
            work.wait()
        reduced.div_(world)

    scratch = torch.empty_like(grad)

    def raw_all_gather_by_all_reduce() -> None:
        # All-gather as a sum: zeros everywhere but this rank's chunk.
        full.zero_()
        full[rank * shard.numel() : (rank + 1) * shard.numel()].copy_(shard)
        work = dist.all_reduce(full, async_op=async_op)
        if work is not None:
            work.wait()

    def raw_all_reduce_keep_chunk() -> None:
        # The alternative to reduce-scatter: sum the whole padded gradient in
        # place, then copy this rank's chunk out (twice the bytes on the wire).
        scratch.copy_(grad)  # reduce-scatter leaves its input intact; pay the same here
        work = dist.all_reduce(scratch, async_op=async_op)
        if work is not None:
            work.wait()
        torch.div(scratch[rank * (numel // world) : (rank + 1) * (numel // world)], world, out=reduced)

    exchanged = torch.empty_like(grad)
    splits = [numel // world] * world

    def raw_all_to_all() -> None:
        dist.all_to_all_single(exchanged, grad, splits, splits)

    operations = {
        "all-gather handle": handle_all_gather,
        "all-gather raw": raw_all_gather,
        "all-gather by all-reduce": raw_all_gather_by_all_reduce,
        "reduce-scatter handle": handle_reduce_scatter,
        "reduce-scatter raw": raw_reduce_scatter,
        "all-reduce+chunk raw": raw_all_reduce_keep_chunk,
        "all-to-all raw": raw_all_to_all,
    }
    shared = transport.shared_memory_of(None) if device.type == "cpu" else None
    if shared is not None:

        def shared_all_gather() -> None:
            work = shared.all_gather(full, shard, async_op=True)
            work.wait()

        def shared_reduce_scatter() -> None:
            work = shared.reduce_scatter(reduced, grad, async_op=True)
            work.wait()
            reduced.div_(world)

        def shared_all_to_all() -> None:
            shared.all_to_all(exchanged, grad, splits, splits)

        operations["all-gather shm raw"] = shared_all_gather
        operations["reduce-scatter shm raw"] = shared_reduce_scatter
        operations["all-to-all shm raw"] = shared_all_to_all
    for fn in operations.values():
        for _ in range(3):
            fn()  # warm-up
    # Interleaved call by call, the order rotating every iteration, so that
    # machine noise (a shared machine) hits every operation alike.
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in operations}
    names = list(operations)
    for i in range(args.iters):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            times[name].append(_seconds(operations[name], device))
    results = {name: statistics.median(wall for wall, _ in pairs) for name, pairs in times.items()}
    cpu = {name: statistics.median(used for _, used in pairs) for name, pairs in times.items()}
    if rank == 0:
        nbytes = numel * 4
        bus = nbytes * (world - 1) / world
        print(f"world size {world}, {device.type}, {nbytes / 2**20:.1f} MiB unsharded per collective, median of {args.iters} interleaved calls each")
        if shared is not None:
            print(f"shared memory: {shared_memory.SLOTS} slots of {shared_memory.SLOT_BYTES / 2**20:g} MiB, "
                  f"{shared.shared_bytes / 2**20:.2f} MiB per rank")
        print(f"{'operation':<24}{'ms':>10}{'CPU ms':>10}{'bus GB/s':>12}")
        for name, seconds in results.items():
            print(f"{name:<24}{seconds * 1e3:>10.2f}{cpu[name] * 1e3:>10.2f}{bus / seconds / 1e9:>12.2f}")
        for op in ("all-gather", "reduce-scatter"):
            ratio = results[f"{op} handle"] / results[f"{op} raw"]
            print(f"{op}: handle / raw time = {ratio:.3f}")
        ratio = results["all-reduce+chunk raw"] / results["reduce-scatter raw"]
        print(f"gradient reduction: all-reduce+chunk / reduce-scatter time = {ratio:.3f}")
        if shared is not None:
            pairs = (("all-gather", "all-gather raw"), ("reduce-scatter", "all-reduce+chunk raw"), ("all-to-all", "all-to-all raw"))
            for op, gloo in pairs:
                name = f"{op} shm raw"
                print(
                    f"{op}: shared memory / fastest gloo method: time {results[name] / results[gloo]:.3f}, "
                    f"CPU {cpu[name] / cpu[gloo]:.3f}"
                )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.py comm", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--slot-bytes", type=int, default=0, help="shared-memory slot size (0: the default)")
    args = parser.parse_args(argv)
    args.nprocs = args.world_size
    spawn(_worker, args)
    return 0
