"""Owns: ``bench.py tp``.

CPU step time of composable_shard + TP against FSDP2 + the same TP plan on
one 2 x 2 (dp, tp) mesh of 4 gloo processes, interleaved in one run.

Run::

    python scripts/bench.py tp [--rounds 5 --steps 5 --dim 256 --layers 4 --seq 64 --batch 8]

The model is examples/tensor_parallel_gpt.py's GPT (attention and MLP of each
block on "tp", ``fully_shard`` per block on "dp"); both libraries train a
copy built from the same seed in the same processes, round by round in
alternating order (so drift in the machine's load hits both), with AdamW over
the example's ``param_groups``. Prints each mode's median step (ms, rank 0's
clock after a barrier per step) and the ratio ours / FSDP2. Do not start it
with torchrun: it spawns its own processes.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .processes import free_port

ROOT = Path(__file__).resolve().parents[2]


def _example():
    spec = importlib.util.spec_from_file_location("tensor_parallel_gpt", ROOT / "examples" / "tensor_parallel_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _build(mode: str, example, args, mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = example.GPT(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq)
    if mode == "composable_shard":
        example.parallelize_and_shard(model, mesh)
    else:
        from torch.distributed.fsdp import fully_shard as fsdp2

        for block in model.blocks:
            parallelize_module(block, mesh["tp"], example.TP_PLAN)
            fsdp2(block, mesh=mesh["dp"])
        fsdp2(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(example.param_groups(model), lr=1e-3)


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(ROOT))
    example = _example()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    modes = ["composable_shard", "fsdp2"]
    built = {mode: _build(mode, example, args, mesh) for mode in modes}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_index in range(args.rounds):
        for mode in modes if round_index % 2 == 0 else modes[::-1]:
            model, optimizer = built[mode]
            for step in range(args.warmup + args.steps):
                tokens = example.local_rows(example.batch(step, args.batch, args.seq, args.vocab), mesh)
                dist.barrier()
                start = time.perf_counter()
                example.train_step(model, optimizer, tokens)
                dist.barrier()
                if step >= args.warmup:
                    times[mode].append(time.perf_counter() - start)
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.py tp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch (rows), split over dp")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--port", type=int, default=0, help="the process group's port (0: a free one)")
    args = parser.parse_args(argv)
    if not args.port:
        args.port = free_port()
    world = 4
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_worker, args=(rank, world, args.port, args, queue)) for rank in range(world)]
    for process in processes:
        process.start()
    times = None
    while times is None:  # a rank that dies never puts: stop then instead of waiting forever
        try:
            times = queue.get(timeout=1.0)
        except Empty:
            failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if failed:
                for process in processes:
                    process.kill()
                sys.exit(f"bench.py tp: a rank exited with status {failed[0]} (its traceback is above)")
    for process in processes:
        process.join()
    medians = {mode: statistics.median(values) * 1e3 for mode, values in times.items()}
    for mode, median in medians.items():
        print(f"{mode:>18}: median step {median:8.1f} ms over {len(times[mode])} steps")
    print(f"ratio composable_shard / fsdp2: {medians['composable_shard'] / medians['fsdp2']:.2f}")
    return 0
