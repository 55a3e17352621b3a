"""Benchmark composable_shard against its peers on one GPT, in one run.

Owns: the comparison of step time, peak memory and loss between
``composable_shard``, FSDP1, FSDP2, DDP and a single process.
Knows nothing of: how any of them works inside.

Run::

    python scripts/bench.py                                  # 2 ranks, CPU, gloo, all modes
    python scripts/bench.py --device cuda --world-size 8     # GPUs, nccl
    python scripts/bench.py --modes fsdp1,fsdp2,ddp,single --steps 10
    python scripts/bench.py --mixed-precision bf16 --activation-checkpointing

The script spawns its own ``--world-size`` processes (``torch.multiprocessing``);
do not start it with torchrun.

Modes, each with its own model copy (same seed, so the same initial weights)
and its own AdamW (same ``param_groups``); every mode sees the same batches:

- ``composable_shard``: ``fully_shard(block)`` for each block, then ``fully_shard(model)``;
- ``fsdp1``: ``FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
  use_orig_params=True)``;
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` for each block, then the root;
- ``ddp``: ``DistributedDataParallel(model)``;
- ``single``: rank 0 alone trains an unwrapped model on the whole global batch
  (the other ranks wait); it is the loss reference.

Distributed modes train on their rank's slice of the global batch, so their
loss (the mean over ranks) must match ``single`` up to float round-off.

How it measures:

- Step time (timing pass): all modes live in one set of processes. After
  ``--warmup`` untimed steps per mode, they take turns: each round every mode
  runs ``--round-steps`` steps, and the order rotates each round, so machine
  noise hits all modes alike. Every step starts after a barrier and ends after
  the optimizer step (plus a device synchronize on CUDA); its time is the
  slowest rank's. The table shows the median. ``single`` runs on one process
  with the same number of threads as one rank.
- Peak memory (memory pass): interleaving makes a process's RSS meaningless
  per mode (every mode's model lives in it, and freed memory stays in the
  allocator). So each mode gets a fresh set of processes: after the process
  group and the data are set up, the peak is reset (CPU: ``/proc/self/clear_refs``
  resets the RSS high-water mark; CUDA: ``torch.cuda.reset_peak_memory_stats``),
  then the mode builds its model and optimizer and trains ``--memory-steps``
  steps; the reported number is peak minus the level at the reset (CPU: VmHWM
  minus RSS; CUDA: ``max_memory_allocated`` minus ``memory_allocated``), the
  largest over ranks. It includes building the full model before sharding,
  the same for every mode. RSS is coarse (pages, allocator caching): compare
  differences of tens of MB, not single MBs.
- Loss: every step of every mode (warm-up included) is kept; the table shows
  the final loss and the largest difference, over all steps, from ``single``
  (or, without it, from the first mode listed). In fp32 a relative difference
  above 1e-4 is flagged and the script exits with status 1.

Mixed precision (``--mixed-precision bf16``): composable_shard
``MixedPrecision(param_dtype=bf16, reduce_dtype=bf16)``, FSDP1
``MixedPrecision(param_dtype=bf16, reduce_dtype=bf16)``, FSDP2
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``. DDP and single
have no such setting; they run their forward under
``torch.autocast(dtype=torch.bfloat16)`` with fp32 weights and gradients, which
rounds differently, so in bf16 the loss differences are shown but not flagged.
The loss itself is always computed in fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # gpt.py, data.py
sys.path.insert(1, str(ROOT))  # composable_shard from a checkout

from data import ByteCorpus, rank_slice  # noqa: E402
from gpt import GPT, Block, GPTConfig, param_groups  # noqa: E402

logger = logging.getLogger("bench")

MODES = ("composable_shard", "fsdp1", "fsdp2", "ddp", "single")
LOSS_RTOL = 1e-4  # fp32 agreement required between modes (relative)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list from {','.join(MODES)}")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    p.add_argument("--round-steps", type=int, default=2, help="steps per mode per interleaving round")
    p.add_argument("--memory-steps", type=int, default=3, help="steps in each mode's memory pass; 0 skips it")
    p.add_argument("--mixed-precision", choices=["none", "bf16"], default="none")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--batch-size", type=int, default=16, help="GLOBAL batch, split over ranks")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--data-bytes", type=int, default=2_000_000)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per process (0: cores / world size)")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown or not args.modes:
        p.error(f"--modes: unknown {unknown}; choose from {','.join(MODES)}")
    if args.batch_size % args.world_size != 0:
        p.error(f"--batch-size {args.batch_size} is not divisible by --world-size {args.world_size}")
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        p.error(f"--world-size {args.world_size} needs that many GPUs; found {torch.cuda.device_count()}")
    if args.threads <= 0:
        args.threads = max(1, (os.cpu_count() or 1) // args.world_size)
    return args


# -- one builder per mode: (args, device) -> (model, optimizer) ----------------


def base_model(args: argparse.Namespace, device: torch.device) -> GPT:
    """The same full model on every rank and in every mode (same seed)."""
    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(config, seed=args.seed).to(device)
    if args.activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for block in model.blocks:
            checkpoint(block)  # before any wrapping, the same for every mode
    return model


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    # Built after wrapping: param_groups classifies by module type, so wrappers
    # and 1-D shards give the same groups as the plain model.
    return torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))


def bf16_enabled(args: argparse.Namespace) -> bool:
    return args.mixed_precision == "bf16"


def build_composable_shard(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    from composable_shard import MixedPrecision, fully_shard

    mp_config = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16_enabled(args) else None
    model = base_model(args, device)
    for block in model.blocks:
        fully_shard(block, mixed_precision=mp_config)
    fully_shard(model, mixed_precision=mp_config)
    return model, make_optimizer(model, args)


def build_fsdp1(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    mp_config = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16_enabled(args) else None
    model = FullyShardedDataParallel(
        base_model(args, device),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=True,
        mixed_precision=mp_config,
        device_id=device,  # explicit on CPU too: FSDP1 otherwise insists on an accelerator
    )
    return model, make_optimizer(model, args)


def build_fsdp2(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        if bf16_enabled(args)
        else MixedPrecisionPolicy()
    )
    model = base_model(args, device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model, make_optimizer(model, args)


def build_ddp(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(base_model(args, device), device_ids=[device] if device.type == "cuda" else None)
    return model, make_optimizer(model, args)


def build_single(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = base_model(args, device)
    return model, make_optimizer(model, args)


BUILDERS: dict[str, Callable[[argparse.Namespace, torch.device], tuple[nn.Module, torch.optim.Optimizer]]] = {
    "composable_shard": build_composable_shard,
    "fsdp1": build_fsdp1,
    "fsdp2": build_fsdp2,
    "ddp": build_ddp,
    "single": build_single,
}


def autocast_for(mode: str, args: argparse.Namespace, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 for the modes without a mixed-precision setting of their own."""
    if bf16_enabled(args) and mode in ("ddp", "single"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# -- training ------------------------------------------------------------------


@dataclass
class ModeRun:
    """One mode's model, optimizer and record, inside one rank."""

    mode: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    steps_done: int = 0  # also picks the batch: every mode sees batch i at its step i
    losses: list[torch.Tensor] = field(default_factory=list)  # 0-d, this rank's slice, every step
    step_times_s: list[float] = field(default_factory=list)  # timed steps only


def runs_on(mode: str, rank: int) -> bool:
    return mode != "single" or rank == 0


def next_batch(
    run: ModeRun, corpus: ByteCorpus, args: argparse.Namespace, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's next batch: the global batch of its step, sliced for this rank
    unless the mode is ``single``."""
    generator = torch.Generator().manual_seed(args.seed + run.steps_done)
    x, y = corpus.get_batch("train", args.batch_size, args.block_size, generator)  # (B, T) global
    if run.mode != "single":
        x = rank_slice(x, dist.get_rank(), dist.get_world_size())  # (B / world_size, T)
        y = rank_slice(y, dist.get_rank(), dist.get_world_size())
    return x.to(device), y.to(device)


def train_step(run: ModeRun, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace, device: torch.device) -> None:
    with autocast_for(run.mode, args, device):
        _, loss = run.model(x, y)
    loss.backward()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.losses.append(loss.detach())
    run.steps_done += 1


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a host-device sync point: the step's kernels are done


def barrier(device: torch.device) -> None:
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def interleaved_rounds(modes: list[str], args: argparse.Namespace) -> Iterator[str]:
    """The mode of each timed step: rounds of ``round_steps`` steps per mode,
    the order rotated by one each round."""
    n_rounds = math.ceil(args.steps / args.round_steps)
    for r in range(n_rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        for mode in order:
            for i in range(args.round_steps):
                if r * args.round_steps + i < args.steps:
                    yield mode


# -- workers (one process per rank) ---------------------------------------------


def init_worker(rank: int, args: argparse.Namespace, port: int) -> torch.device:
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.set_num_threads(args.threads)
    init_method = f"tcp://127.0.0.1:{port}"
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl", init_method=init_method, rank=rank, world_size=args.world_size, device_id=device
        )
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=args.world_size)
    return device


def timing_worker(rank: int, args: argparse.Namespace, port: int, out_dir: str) -> None:
    device = init_worker(rank, args, port)
    corpus = ByteCorpus.from_stdlib(args.data_bytes)
    runs: dict[str, ModeRun] = {}
    for mode in args.modes:  # the same order on every rank: builders may use collectives
        if runs_on(mode, rank):
            runs[mode] = ModeRun(mode, *BUILDERS[mode](args, device))
    for mode in args.modes:
        for _ in range(args.warmup):
            barrier(device)
            if mode in runs:
                train_step(runs[mode], *next_batch(runs[mode], corpus, args, device), args, device)
    for mode in interleaved_rounds(args.modes, args):
        barrier(device)
        if mode not in runs:
            continue
        x, y = next_batch(runs[mode], corpus, args, device)  # not timed
        synchronize(device)
        start = time.perf_counter()
        train_step(runs[mode], x, y, args, device)
        synchronize(device)
        runs[mode].step_times_s.append(time.perf_counter() - start)
    record = {
        mode: {"losses": torch.stack(run.losses).float().tolist(), "step_times_s": run.step_times_s}
        for mode, run in runs.items()
    }
    Path(out_dir, f"timing_rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def memory_now(device: torch.device) -> tuple[float, float]:
    """(current, peak since the last reset) in MB: RSS and its high-water mark
    on CPU, allocated tensor memory on CUDA."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20, torch.cuda.max_memory_allocated(device) / 2**20
    status = Path("/proc/self/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines())
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024  # kB → MB


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS


def memory_worker(rank: int, args: argparse.Namespace, port: int, out_dir: str, mode: str) -> None:
    device = init_worker(rank, args, port)
    corpus = ByteCorpus.from_stdlib(args.data_bytes)
    barrier(device)
    reset_peak_memory(device)
    start_mb, _ = memory_now(device)
    if runs_on(mode, rank):
        run = ModeRun(mode, *BUILDERS[mode](args, device))
        for _ in range(args.memory_steps):
            train_step(run, *next_batch(run, corpus, args, device), args, device)
        synchronize(device)
    _, peak_mb = memory_now(device)
    result = {"peak_increase_mb": peak_mb - start_mb if runs_on(mode, rank) else None}
    Path(out_dir, f"memory_{mode}_rank{rank}.json").write_text(json.dumps(result))
    barrier(device)
    dist.destroy_process_group()


def spawn(worker: Callable[..., None], args: argparse.Namespace, *extra: object) -> None:
    with socket.socket() as s:  # a free port for this set of processes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port, *extra), nprocs=args.world_size, join=True)


# -- report --------------------------------------------------------------------


@dataclass
class ModeResult:
    mode: str
    losses: list[float]  # global-batch loss per step (mean over ranks)
    step_ms: list[float]  # per timed step, slowest rank
    peak_mb: float | None  # largest over ranks, None if not measured


def collect(args: argparse.Namespace, out_dir: str) -> dict[str, ModeResult]:
    per_rank = [json.loads(Path(out_dir, f"timing_rank{r}.json").read_text()) for r in range(args.world_size)]
    results = {}
    for mode in args.modes:
        records = [record[mode] for record in per_rank if mode in record]
        losses = [statistics.fmean(step) for step in zip(*(rec["losses"] for rec in records))]
        step_ms = [1000 * max(step) for step in zip(*(rec["step_times_s"] for rec in records))]
        peaks = []
        if args.memory_steps > 0:
            for r in range(args.world_size):
                peak = json.loads(Path(out_dir, f"memory_{mode}_rank{r}.json").read_text())["peak_increase_mb"]
                if peak is not None:
                    peaks.append(peak)
        results[mode] = ModeResult(mode, losses, step_ms, max(peaks) if peaks else None)
    return results


def report(args: argparse.Namespace, results: dict[str, ModeResult]) -> bool:
    """Prints the table; returns whether the losses agree (always true in bf16)."""
    reference = "single" if "single" in results else args.modes[0]
    ref = results[reference]
    cs_ms = statistics.median(results["composable_shard"].step_ms) if "composable_shard" in results else None
    tokens = args.batch_size * args.block_size
    print(
        f"\nGPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head} block={args.block_size} "
        f"global batch={args.batch_size} | {args.device} world size {args.world_size}, {args.threads} thread(s)/rank "
        f"| {args.mixed_precision} | activation checkpointing {'on' if args.activation_checkpointing else 'off'} "
        f"| {args.warmup} warm-up + {args.steps} timed steps/mode | torch {torch.__version__}"
    )
    print(
        f"{'mode':<17} {'median ms':>9} {'min ms':>8} {'tok/s':>8} {'cs/peer':>7} {'peak MB/rank':>12} "
        f"{'final loss':>10} {'max|Δloss| vs ' + reference:>24} {'rel':>8}"
    )
    agree = True
    for mode in args.modes:
        res = results[mode]
        median_ms = statistics.median(res.step_ms)
        diff = max(abs(a - b) for a, b in zip(res.losses, ref.losses))
        rel = max(abs(a - b) / abs(b) for a, b in zip(res.losses, ref.losses))
        flagged = args.mixed_precision == "none" and rel > LOSS_RTOL
        agree = agree and not flagged
        ratio = f"{cs_ms / median_ms:.2f}" if cs_ms is not None else "-"
        peak = f"{res.peak_mb:.1f}" if res.peak_mb is not None else "-"
        print(
            f"{mode:<17} {median_ms:>9.1f} {min(res.step_ms):>8.1f} {tokens / median_ms * 1000:>8.0f} {ratio:>7} "
            f"{peak:>12} {res.losses[-1]:>10.5f} {diff:>24.2e} {rel:>8.1e}{'  MISMATCH' if flagged else ''}"
        )
    notes = ["cs/peer: composable_shard's median step time divided by the mode's (<1: composable_shard faster)."]
    if "single" in results:
        notes.append("single: one process on the global batch with one rank's threads; its time is not a peer's.")
    if args.mixed_precision == "bf16":
        notes.append("bf16: loss differences are informational (ddp/single use autocast, see docstring).")
    else:
        notes.append(f"fp32: relative loss difference above {LOSS_RTOL:g} is flagged MISMATCH.")
    for note in notes:
        print(note)
    return agree


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if "composable_shard" in args.modes:
        try:
            import composable_shard  # noqa: F401
        except ImportError as exc:
            sys.exit(f"bench: cannot import composable_shard ({exc}). Run without it: --modes fsdp1,fsdp2,ddp,single")
    with tempfile.TemporaryDirectory(prefix="bench-") as out_dir:
        logger.info("timing pass: %s interleaved on %d processes", ",".join(args.modes), args.world_size)
        spawn(timing_worker, args, out_dir)
        if args.memory_steps > 0:
            for mode in args.modes:
                logger.info("memory pass: %s in fresh processes", mode)
                spawn(memory_worker, args, out_dir, mode)
        agree = report(args, collect(args, out_dir))
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
