"""Benchmark sharded checkpoint save and load: composable_shard against FSDP2.

Owns: ``bench.py checkpoint``: the comparison of time and peak memory of a sharded
``torch.distributed.checkpoint`` save and load of one GPT between
``composable_shard`` (its ``get/set_model_state_dict`` and
``get/set_optimizer_state_dict``, and its ``save_checkpoint`` /
``load_checkpoint`` helpers) and FSDP2 (``torch.distributed.fsdp.fully_shard``
with ``torch.distributed.checkpoint.state_dict``).
Knows nothing of: how either works inside.

Run::

    python scripts/bench.py checkpoint                         # 2 ranks, CPU, gloo
    python scripts/bench.py checkpoint --sizes 8x512,18x1536   # two sizes (n_layer x n_embd), one table each
    python scripts/bench.py checkpoint --n-layer 12 --n-embd 768 --repeats 5
    python scripts/bench.py checkpoint --device cuda --world-size 8

The script spawns its own processes; do not start it with torchrun.

Modes, each in a fresh set of processes (so RSS belongs to one mode):

- ``composable_shard``: ``fully_shard`` per block and the root; state dicts
  from ``composable_shard.get_model_state_dict`` / ``get_optimizer_state_dict``
  saved with ``dcp.save``; load = build the state dicts, ``dcp.load`` into
  them (in place, into the model's shards), ``set_*_state_dict``;
- ``composable_shard_direct``: the same save; the load passes
  ``dcp.load`` our storage reader, ``DirectFileSystemReader``
  (composable_shard/checkpoint/untrusted/reader.py), which reads each tensor straight
  into its destination instead of ``torch.load`` + ``copy_`` per item;
- ``composable_shard_safe``: ``composable_shard.save_checkpoint`` /
  ``load_checkpoint``: the same plus a checksum of every file (xxh3_64 with
  ``xxhash``, else CRC-32), a manifest, an atomic directory switch, and a
  load that checks checksums, keys, shapes and hyperparameters before
  reading in place (through ``DirectFileSystemReader``);
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` per block and the root;
  ``torch.distributed.checkpoint.state_dict.get/set_model_state_dict`` and
  ``get/set_optimizer_state_dict`` around ``dcp.save`` / ``dcp.load``.

Every mode trains one AdamW step first (so optimizer state exists), then
saves and loads ``--warmup`` times untimed and ``--repeats`` times timed; the
modes run ``--rounds`` times, every other round in reverse order (on a busy
machine the first mode run is slower). A time is the slowest rank's, between
barriers; the table shows the median over rounds and repeats. Peak memory is the largest increase of
the resident set (VmHWM after resetting it through ``/proc/self/clear_refs``;
on CUDA ``max_memory_allocated``) over the level before the operation, the
largest over ranks and repeats. The checkpoint goes to ``--dir`` (default: a
temporary directory), so file-system caching affects every mode alike.

Before each save the previous checkpoint is deleted (untimed), so every mode
writes into free space. ``save_checkpoint`` replacing an existing checkpoint
keeps the old one until the new one is complete (that is its point), so a
real overwrite also pays for holding two checkpoints at once and for
deleting the old one; this table leaves that cost out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))  # gpt.py
sys.path.insert(1, str(ROOT))  # composable_shard from a checkout

from gpt import GPT, GPTConfig, param_groups  # noqa: E402

from .processes import spawn  # noqa: E402

logger = logging.getLogger("bench_checkpoint")

MODES = ("composable_shard", "composable_shard_direct", "composable_shard_safe", "fsdp2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.py checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list from {','.join(MODES)}")
    p.add_argument("--repeats", type=int, default=3, help="timed save+load repeats per mode and round")
    p.add_argument("--warmup", type=int, default=1, help="untimed save+load repeats first, in each process set")
    p.add_argument("--rounds", type=int, default=2, help="run the modes this many times, every other round in reverse order")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--sizes", default="", help="comma list of LAYERSxEMBD model sizes (overrides --n-layer/--n-embd)")
    p.add_argument("--json", default="", help="also write the rows and the raw samples to this JSON file")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--dir", default="", help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per process (0: cores / world size)")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if sorted(set(args.modes) - set(MODES)):
        p.error(f"--modes: choose from {','.join(MODES)}")
    if args.threads <= 0:
        args.threads = max(1, (os.cpu_count() or 1) // args.world_size)
    try:
        args.sizes = [tuple(int(x) for x in size.lower().split("x")) for size in args.sizes.split(",") if size.strip()]
    except ValueError:
        p.error("--sizes: expected a comma list of LAYERSxEMBD, e.g. 8x512,18x1536")
    if not args.sizes:
        args.sizes = [(args.n_layer, args.n_embd)]
    if any(embd % args.n_head for _, embd in args.sizes):
        p.error(f"--sizes: every width must be divisible by --n-head={args.n_head}")
    args.nprocs = args.world_size  # for processes.spawn
    return args


def build(mode: str, args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(config, seed=0).to(device)
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from composable_shard import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    idx = torch.randint(0, config.vocab_size, (2, 32), device=device, generator=torch.Generator().manual_seed(dist.get_rank()))
    _, loss = model(idx, idx)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def state_dict_api(mode: str) -> tuple[Callable[..., Any], ...]:
    if mode == "fsdp2":
        from torch.distributed.checkpoint import state_dict as api
    else:
        import composable_shard as api  # type: ignore[no-redef]
    return api.get_model_state_dict, api.set_model_state_dict, api.get_optimizer_state_dict, api.set_optimizer_state_dict


def save(mode: str, model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    if mode == "composable_shard_safe":
        from composable_shard import save_checkpoint

        save_checkpoint(path, model, optimizer)
        return
    get_model, _, get_optim, _ = state_dict_api(mode)
    dcp.save({"model": get_model(model), "optim": get_optim(model, optimizer)}, checkpoint_id=path)


def load(mode: str, model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    if mode == "composable_shard_safe":
        from composable_shard import load_checkpoint

        load_checkpoint(path, model, optimizer)
        return
    get_model, set_model, get_optim, set_optim = state_dict_api(mode)
    state = {"model": get_model(model), "optim": get_optim(model, optimizer)}
    if mode == "composable_shard_direct":
        from composable_shard.checkpoint import DirectFileSystemReader

        dcp.load(state, storage_reader=DirectFileSystemReader(path))
    else:
        dcp.load(state, checkpoint_id=path)
    set_model(model, state["model"])
    set_optim(model, optimizer, state["optim"])


def memory_now(device: torch.device) -> tuple[float, float]:
    """(current, peak since the last reset) in MB."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20, torch.cuda.max_memory_allocated(device) / 2**20
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS


def measured(operation: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """(seconds, peak memory increase in MB) of one collective operation."""
    dist.barrier()
    reset_peak_memory(device)
    start_mb, _ = memory_now(device)
    start = time.perf_counter()
    operation()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    seconds = time.perf_counter() - start
    _, peak_mb = memory_now(device)
    return seconds, peak_mb - start_mb


def worker(rank: int, args: argparse.Namespace, port: int, mode: str, out_dir: str, ckpt_dir: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    model, optimizer = build(mode, args, device)
    path = f"{ckpt_dir}/{mode}"
    results: dict[str, list[float]] = {"save_s": [], "save_mb": [], "load_s": [], "load_mb": []}
    for repeat in range(-args.warmup, args.repeats):
        if rank == 0:  # every mode writes into an empty place (see the module docstring)
            shutil.rmtree(path, ignore_errors=True)
        save_seconds, save_mb = measured(lambda: save(mode, model, optimizer, path), device)
        load_seconds, load_mb = measured(lambda: load(mode, model, optimizer, path), device)
        if repeat >= 0:  # the warm-up repeats are not counted
            results["save_s"].append(save_seconds)
            results["save_mb"].append(save_mb)
            results["load_s"].append(load_seconds)
            results["load_mb"].append(load_mb)
    results["checkpoint_mb"] = [sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 2**20] if Path(path).exists() else []
    Path(out_dir, f"{mode}_rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def run_size(
    args: argparse.Namespace, ckpt_root: str
) -> tuple[list[tuple[str, float, float, float, float]], dict[str, dict[str, list[float]]]]:
    """Every mode at the model size in ``args``: one row per mode, and the
    raw samples behind them (per mode: every timed repeat's slowest-rank
    time, every round's largest peak)."""
    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    numel = sum(p.numel() for p in GPT(config).parameters())
    logger.info(
        "GPT n_layer=%d n_embd=%d: %.1fM parameters (%.0f MB fp32; with AdamW state %.0f MB), world size %d, %s, "
        "%d repeats",
        args.n_layer, args.n_embd, numel / 1e6, numel * 4 / 2**20, numel * 12 / 2**20, args.world_size, args.device, args.repeats,
    )
    samples: dict[str, dict[str, list[float]]] = {mode: {"save_s": [], "load_s": [], "save_mb": [], "load_mb": []} for mode in args.modes}
    with tempfile.TemporaryDirectory() as out_dir:
        for round_index in range(args.rounds):
            # Reversed every other round: whichever mode runs first on a busy machine pays for it.
            for mode in args.modes if round_index % 2 == 0 else list(reversed(args.modes)):
                spawn(worker, args, mode, out_dir, ckpt_root)
                shutil.rmtree(f"{ckpt_root}/{mode}", ignore_errors=True)  # keep at most one checkpoint on disk
                per_rank = [json.loads(Path(out_dir, f"{mode}_rank{r}.json").read_text()) for r in range(args.world_size)]
                for key in ("save_s", "load_s"):  # the slowest rank's time of each repeat
                    samples[mode][key] += [max(r[key][i] for r in per_rank) for i in range(args.repeats)]
                for key in ("save_mb", "load_mb"):
                    samples[mode][key].append(max(max(r[key]) for r in per_rank))
    rows = [
        (
            mode,
            statistics.median(samples[mode]["save_s"]),
            max(samples[mode]["save_mb"]),
            statistics.median(samples[mode]["load_s"]),
            max(samples[mode]["load_mb"]),
        )
        for mode in args.modes
    ]
    logger.info("%-22s %10s %14s %10s %14s", "mode", "save (s)", "save peak (MB)", "load (s)", "load peak (MB)")
    for mode, save_s, save_mb, load_s, load_mb in rows:
        logger.info("%-22s %10.3f %14.1f %10.3f %14.1f", mode, save_s, save_mb, load_s, load_mb)
    return rows, samples


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ckpt_root = args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_")
    results = []
    try:
        for n_layer, n_embd in args.sizes:
            args.n_layer, args.n_embd = n_layer, n_embd
            rows, samples = run_size(args, ckpt_root)
            results.append({"n_layer": n_layer, "n_embd": n_embd, "rows": rows, "samples": samples})
    finally:
        if not args.dir:
            shutil.rmtree(ckpt_root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0

