"""Benchmark composable_shard against its peers on one GPT, in one run.

Owns: the comparison of step time, memory and loss between
``composable_shard``, FSDP1, FSDP2, DDP and unsharded references, on CPU
(gloo) or CUDA (NCCL, or PyTorch's fake process group).
Knows nothing of: how any of them works inside.

Run::

    python scripts/bench.py                                  # 2 ranks, CPU, gloo, GPT, all modes
    python scripts/bench.py --activation-checkpointing
    python scripts/bench.py --mixed-precision bf16           # sized down: see CONFIGS
    python scripts/bench.py --config lora                    # frozen base, LoRA adapters per block
    python scripts/bench.py --config many-small              # 64 narrow blocks
    python scripts/bench.py --rounds 5 --steps 6             # 5 rounds of 6 timed steps per mode
    python scripts/bench.py --device cuda --world-size 8 --mixed-precision bf16
    python scripts/bench.py --device cuda --simulate-world-size 64 --cpu-offload --mixed-precision bf16

The script spawns its own processes (``torch.multiprocessing``); do not start
it with torchrun.

Modes, each with its own model copy (same seed, so the same initial weights)
and its own AdamW (same ``param_groups``); every mode sees the same batches:

- ``composable_shard``: ``fully_shard(block)`` for each block, then ``fully_shard(model)``;
- ``fsdp1``: ``FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
  use_orig_params=True)``;
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` for each block, then the root;
- ``ddp``: ``DistributedDataParallel(model)``;
- ``local``: every rank trains an unwrapped model on its own slice, with no
  communication at all: the compute-only floor of a data-parallel step on
  this machine (ranks compete for cores as in the other modes). Its loss
  diverges from the others after the first step and is not compared.
- ``single``: rank 0 alone trains an unwrapped model on the whole global batch
  (the other ranks wait); it is the loss reference. Under bf16 it runs under
  ``torch.autocast`` (on CUDA: the single-GPU autocast model).

Distributed modes train on their rank's slice of the global batch, so their
loss (the mean over ranks) must match ``single`` up to float round-off.

Configurations (``--config``; ``--n-layer`` and friends override a preset):

- ``gpt``: the example GPT (8 blocks, width 256), every block one unit;
- ``lora``: the same GPT with its base frozen and trainable rank-8 LoRA
  adapters on the four Linear layers of every block (the fine-tuning case:
  most parameters need no gradient);
- ``many-small``: 64 narrow blocks (width 64): many small units, where
  per-unit and per-parameter overhead dominates.

With ``--mixed-precision bf16`` on CPU the presets shrink (bf16 matrix
products are 20-60x slower than fp32 on CPUs without bf16 instructions).

How it measures:

- Step time (timing pass): all modes live in one set of processes. After
  ``--warmup`` untimed steps per mode, ``--rounds`` rounds follow; in each,
  every mode runs ``--steps`` steps in turns of ``--round-steps`` steps, the
  order rotating every turn, so machine noise hits all modes alike. Every
  step starts after a barrier and ends after the optimizer step (plus a
  device synchronize on CUDA); its time is the slowest rank's. Because the
  modes share processes, they also share the C allocator's state: glibc
  moves its mmap threshold after large frees, so one mode's allocations
  decided whether the next mode's buffers came from the heap or from fresh,
  page-faulting mmaps. That made FSDP1 and DDP 10-20% slower in runs where
  composable_shard used shared memory than where it used gloo (ratio to
  FSDP1 0.73-0.83 against 0.87-0.89, three pairs of runs), and with fixed
  thresholds both gave 0.87-0.88. So the timing processes start with
  ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` fixed at 256 MiB
  (``--no-fixed-malloc`` leaves glibc's defaults; the memory pass always
  runs with the defaults, as a user would). The table
  shows each round's median per mode (a reader sees the noise) and the
  median over all rounds.
- Memory (memory pass): interleaving makes a process's RSS meaningless per
  mode (every mode's model lives in it, and freed memory stays in the
  allocator). So each mode gets a fresh set of processes: after the process
  group and the data are set up, the peak is reset (CPU: ``/proc/self/clear_refs``
  resets the RSS high-water mark; CUDA: ``torch.cuda.reset_peak_memory_stats``),
  (after importing every mode's library: code is not the mode's memory),
  then the mode builds its model and optimizer ("after build": the level
  then, i.e. memory after sharding on CUDA) and trains ``--memory-steps``
  steps ("peak"). Both are relative to the level at the reset (CPU: RSS;
  CUDA: ``memory_allocated``), the largest over ranks (with
  ``--memory-repeats R``: the median of R passes, modes alternating). They include building
  the full model before sharding, the same for every mode. RSS is coarse
  (pages, allocator caching): compare differences of several MB, not single MBs.
- Loss: every step of every mode (warm-up included) is kept; the table shows
  the final loss and the largest difference, over all steps, from ``single``
  (or, without it, from the first mode listed). In fp32 a relative difference
  above 1e-4 is flagged and the script exits with status 1.

``--simulate-world-size W`` runs one process in PyTorch's fake process group
of W ranks (collectives do nothing): memory per rank and the runtime's own
overhead (hooks, copies, stream waits) as if on W ranks, without the
communication. Parameters are then never really gathered, so losses are
meaningless and not compared. ``ddp`` and ``local`` are not offered there.

Mixed precision (``--mixed-precision bf16``): composable_shard and FSDP1
``MixedPrecision(param_dtype=bf16, reduce_dtype=R)``, FSDP2
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=R)`` with R from
``--reduce-dtype`` (bf16 by default). DDP, local and single have no such
setting; they run their forward under ``torch.autocast(dtype=torch.bfloat16)``
with fp32 weights and gradients, which rounds differently, so in bf16 the
loss differences are shown but not flagged. The loss itself is always
computed in fp32.

``--cpu-offload`` (CUDA only): composable_shard and FSDP1
``CPUOffload(offload_params=True)``, FSDP2 ``CPUOffloadPolicy()``; the
unsharded modes keep everything on the GPU.
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
from unittest import mock

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

MODES = ("composable_shard", "fsdp1", "fsdp2", "ddp", "local", "single")
SIMULATED_MODES = ("composable_shard", "fsdp1", "fsdp2", "single")
LOSS_RTOL = 1e-4  # fp32 agreement required between modes (relative)

# Presets per configuration: (fp32 sizes, bf16-on-CPU sizes).
_GPT = dict(n_layer=8, n_embd=256, n_head=8, block_size=128, batch_size=8)
_GPT_BF16_CPU = dict(n_layer=4, n_embd=128, n_head=4, block_size=64, batch_size=4)
CONFIGS: dict[str, tuple[dict, dict]] = {
    "gpt": (_GPT, _GPT_BF16_CPU),
    "lora": (_GPT, _GPT_BF16_CPU),
    "many-small": (
        dict(n_layer=64, n_embd=64, n_head=4, block_size=128, batch_size=8),
        dict(n_layer=32, n_embd=64, n_head=4, block_size=64, batch_size=4),
    ),
}
SIZE_ARGS = ("n_layer", "n_embd", "n_head", "block_size", "batch_size")
LORA_RANK = 8
LORA_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="gpt")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--simulate-world-size", type=int, default=0, metavar="W",
                   help="one process in a fake process group of W ranks (no real communication)")
    p.add_argument("--modes", default=None, help=f"comma list from {','.join(MODES)} (default: all that apply)")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds; each round's medians are shown")
    p.add_argument("--steps", type=int, default=6, help="timed steps per mode per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    p.add_argument("--round-steps", type=int, default=2, help="steps per mode per turn inside a round")
    p.add_argument("--memory-steps", type=int, default=3, help="steps in each mode's memory pass; 0 skips it")
    p.add_argument("--memory-repeats", type=int, default=1,
                   help="memory passes per mode (fresh processes each, modes alternating); the median is shown")
    p.add_argument("--mixed-precision", choices=["none", "bf16"], default="none")
    p.add_argument("--reduce-dtype", choices=["bf16", "fp32"], default="bf16", help="with --mixed-precision bf16")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--cpu-offload", action="store_true", help="CUDA only: sharded parameters live on CPU")
    p.add_argument("--batch-size", type=int, default=None, help="GLOBAL batch, split over ranks")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--n-layer", type=int, default=None)
    p.add_argument("--n-head", type=int, default=None)
    p.add_argument("--n-embd", type=int, default=None)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--data-bytes", type=int, default=2_000_000)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per process (0: cores / processes)")
    p.add_argument(
        "--no-fixed-malloc",
        dest="fixed_malloc",
        action="store_false",
        help="timing pass with glibc's moving mmap threshold (see the docstring: modes then affect each other)",
    )
    p.add_argument("--profile", default=None, metavar="MODE",
                   help="profile one timed step of MODE on rank 0 and print its table (times include the profiler)")
    args = p.parse_args(argv)
    fp32_sizes, bf16_sizes = CONFIGS[args.config]
    preset = bf16_sizes if args.mixed_precision == "bf16" and args.device == "cpu" else fp32_sizes
    for name in SIZE_ARGS:
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    args.simulated = args.simulate_world_size > 0
    if args.simulated:
        args.world_size = args.simulate_world_size
    args.nprocs = 1 if args.simulated else args.world_size
    available = SIMULATED_MODES if args.simulated else MODES
    args.modes = [m.strip() for m in (args.modes or ",".join(available)).split(",") if m.strip()]
    unknown = sorted(set(args.modes) - set(available))
    if unknown or not args.modes:
        p.error(f"--modes: {unknown} not available here; choose from {','.join(available)}")
    if args.profile is not None and args.profile not in args.modes:
        p.error(f"--profile {args.profile}: not among --modes {','.join(args.modes)}")
    if args.batch_size % args.world_size != 0:
        p.error(f"--batch-size {args.batch_size} is not divisible by the world size {args.world_size}")
    if args.cpu_offload and args.device != "cuda":
        p.error("--cpu-offload needs --device cuda (on CPU the parameters already live on the CPU)")
    if args.device == "cuda":
        needed = args.nprocs
        if torch.cuda.device_count() < needed:
            p.error(f"--device cuda with {needed} process(es) needs that many GPUs; found {torch.cuda.device_count()}")
    if min(args.rounds, args.steps, args.round_steps, args.memory_repeats) < 1:
        p.error("--rounds, --steps, --round-steps and --memory-repeats must be at least 1")
    if args.threads <= 0:
        args.threads = max(1, (os.cpu_count() or 1) // args.nprocs)
    return args


# -- models --------------------------------------------------------------------


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``B @ A``
    (``B`` starts at zero, so the model starts as the base model)."""

    def __init__(self, base: nn.Linear, rank: int, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features).normal_(0.0, 0.02, generator=generator))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t().to(x.dtype)) @ self.lora_b.t().to(x.dtype)


def add_lora(model: GPT, seed: int) -> None:
    """Freeze every parameter, then put LoRA adapters on each block's Linears."""
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed + 1)
    for block in model.blocks:
        for path in LORA_TARGETS:
            parent_name, attr = path.split(".")
            parent = getattr(block, parent_name)
            setattr(parent, attr, LoRALinear(getattr(parent, attr), LORA_RANK, generator))


def base_model(args: argparse.Namespace, device: torch.device) -> GPT:
    """The same full model on every rank and in every mode (same seed)."""
    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(config, seed=args.seed)
    if args.config == "lora":
        add_lora(model, args.seed)
    model = model.to(device)
    if args.activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for block in model.blocks:
            checkpoint(block)  # before any wrapping, the same for every mode
    return model


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    # Built after wrapping: param_groups classifies by module type (trainable
    # parameters only), so wrappers and 1-D shards give the same groups.
    return torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))


def bf16_enabled(args: argparse.Namespace) -> bool:
    return args.mixed_precision == "bf16"


def reduce_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.reduce_dtype == "bf16" else torch.float32


def build_composable_shard(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    from composable_shard import CPUOffload, MixedPrecision, fully_shard

    kwargs: dict = {"device_id": device if device.type == "cuda" else None}
    if bf16_enabled(args):
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype(args))
    if args.cpu_offload:
        kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    model = base_model(args, device)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model, make_optimizer(model, args)


def build_fsdp1(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    mp_config = (
        MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype(args)) if bf16_enabled(args) else None
    )
    model = FullyShardedDataParallel(
        base_model(args, device),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=True,
        mixed_precision=mp_config,
        cpu_offload=CPUOffload(offload_params=True) if args.cpu_offload else None,
        device_id=device,  # explicit on CPU too: FSDP1 otherwise insists on an accelerator
    )
    return model, make_optimizer(model, args)


def build_fsdp2(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs: dict = {"mesh": mesh}
    if bf16_enabled(args):
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype(args))
    if args.cpu_offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy()
    model = base_model(args, device)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model, make_optimizer(model, args)


def build_ddp(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(base_model(args, device), device_ids=[device] if device.type == "cuda" else None)
    return model, make_optimizer(model, args)


def build_unwrapped(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = base_model(args, device)
    return model, make_optimizer(model, args)


BUILDERS: dict[str, Callable[[argparse.Namespace, torch.device], tuple[nn.Module, torch.optim.Optimizer]]] = {
    "composable_shard": build_composable_shard,
    "fsdp1": build_fsdp1,
    "fsdp2": build_fsdp2,
    "ddp": build_ddp,
    "local": build_unwrapped,
    "single": build_unwrapped,
}


def autocast_for(mode: str, args: argparse.Namespace, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 for the modes without a mixed-precision setting of their own."""
    if bf16_enabled(args) and mode in ("ddp", "local", "single"):
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
    step_times_s: list[list[float]] = field(default_factory=list)  # per round, timed steps only


def runs_on(mode: str, rank: int) -> bool:
    return mode != "single" or rank == 0


def next_batch(
    run: ModeRun, corpus: ByteCorpus, args: argparse.Namespace, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's next batch: the global batch of its step, sliced for this rank
    unless the mode is ``single`` (simulated: ``single`` gets one rank's slice,
    the work of one simulated rank)."""
    generator = torch.Generator().manual_seed(args.seed + run.steps_done)
    x, y = corpus.get_batch("train", args.batch_size, args.block_size, generator)  # (B, T) global
    if run.mode != "single" or args.simulated:
        x = rank_slice(x, dist.get_rank(), args.world_size)  # (B / world_size, T)
        y = rank_slice(y, dist.get_rank(), args.world_size)
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


# -- workers (one process per rank) ---------------------------------------------


def init_worker(rank: int, args: argparse.Namespace, port: int) -> torch.device:
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.simulated:
        # Collectives do nothing, but every rank-dependent size is that of a
        # rank in a group of W (test-only API of PyTorch; stable since 2.1).
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
        # Never-gathered parameters hold whatever memory held: on CPU that
        # can mean denormals, whose slow arithmetic would swamp the overhead.
        torch.set_flush_denormal(True)
        return device
    init_method = f"tcp://127.0.0.1:{port}"
    if device.type == "cuda":
        dist.init_process_group(
            "nccl", init_method=init_method, rank=rank, world_size=args.world_size, device_id=device
        )
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=args.world_size)
    return device


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
    return f"{table}\n\nby total time (hooks are labelled composable_shard::...):\n{hooks}"


def timing_worker(rank: int, args: argparse.Namespace, port: int, out_dir: str) -> None:
    device = init_worker(rank, args, port)
    corpus = ByteCorpus.from_stdlib(args.data_bytes)
    runs: dict[str, ModeRun] = {}
    for mode in args.modes:  # the same order on every rank: builders may use collectives
        if runs_on(mode, rank):
            runs[mode] = ModeRun(mode, *BUILDERS[mode](args, device))
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


def import_every_mode() -> None:
    """Import every mode's library, so that no mode's memory counts code.

    Importing ``composable_shard`` after the reset added 5.7 MB of RSS (its
    state-dict and checkpoint modules) while FSDP's modules were already
    loaded by ``torch.distributed``: that was the whole 5-6 MB "bf16 memory
    gap" against FSDP1/FSDP2 in earlier runs, in fp32 as much as in bf16.
    """
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.fsdp.wrap  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import composable_shard  # noqa: F401


def memory_worker(rank: int, args: argparse.Namespace, port: int, out_dir: str, mode: str, repeat: int) -> None:
    device = init_worker(rank, args, port)
    corpus = ByteCorpus.from_stdlib(args.data_bytes)
    import_every_mode()
    barrier(args, device)
    synchronize(device)
    reset_peak_memory(device)
    start_mb, _ = memory_now(device)
    result: dict[str, float | None] = {"after_build_mb": None, "peak_increase_mb": None}
    if runs_on(mode, rank):
        run = ModeRun(mode, *BUILDERS[mode](args, device))
        synchronize(device)
        result["after_build_mb"] = memory_now(device)[0] - start_mb
        for _ in range(args.memory_steps):
            train_step(run, *next_batch(run, corpus, args, device), args, device)
        synchronize(device)
        result["peak_increase_mb"] = memory_now(device)[1] - start_mb
        if mode == "composable_shard" and device.type == "cpu":
            # Shared-memory collectives keep their slots in /dev/shm. RSS
            # counts the pages this rank touched through its mappings, its
            # peers' included: those are replaced by this rank's own slots,
            # so every page is counted once, for the rank that owns it.
            from composable_shard.comm import transport

            shared = transport.process_shared_bytes() - transport.process_mapped_bytes()
            result["peak_increase_mb"] += shared / 2**20
    Path(out_dir, f"memory_{mode}_{repeat}_rank{rank}.json").write_text(json.dumps(result))
    barrier(args, device)
    dist.destroy_process_group()


def spawn(worker: Callable[..., None], args: argparse.Namespace, *extra: object) -> None:
    with socket.socket() as s:  # a free port for this set of processes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port, *extra), nprocs=args.nprocs, join=True)


# -- report --------------------------------------------------------------------


@dataclass
class ModeResult:
    mode: str
    losses: list[float]  # global-batch loss per step (mean over ranks)
    round_ms: list[list[float]]  # per round, per timed step, slowest rank
    after_build_mb: float | None  # largest over ranks, median over repeats; None if not measured
    peak_mb: float | None  # largest over ranks, median over repeats; None if not measured
    peak_repeats_mb: list[float] = field(default_factory=list)  # each repeat's peak

    @property
    def step_ms(self) -> list[float]:
        return [ms for round_ms in self.round_ms for ms in round_ms]


def _largest(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _median_present(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def collect(args: argparse.Namespace, out_dir: str) -> dict[str, ModeResult]:
    per_rank = [json.loads(Path(out_dir, f"timing_rank{r}.json").read_text()) for r in range(args.nprocs)]
    results = {}
    for mode in args.modes:
        records = [record[mode] for record in per_rank if mode in record]
        losses = [statistics.fmean(step) for step in zip(*(rec["losses"] for rec in records))]
        round_ms = [
            [1000 * max(step) for step in zip(*(rec["step_times_s"][r] for rec in records))]
            for r in range(args.rounds)
        ]
        builds: list[float | None] = []
        peaks: list[float | None] = []
        for repeat in range(args.memory_repeats if args.memory_steps > 0 else 0):
            memory = [
                json.loads(Path(out_dir, f"memory_{mode}_{repeat}_rank{r}.json").read_text())
                for r in range(args.nprocs)
            ]
            builds.append(_largest([m["after_build_mb"] for m in memory]))
            peaks.append(_largest([m["peak_increase_mb"] for m in memory]))
        results[mode] = ModeResult(
            mode,
            losses,
            round_ms,
            _median_present(builds),
            _median_present(peaks),
            [p for p in peaks if p is not None],
        )
    return results


def _loss_compared(mode: str, args: argparse.Namespace) -> bool:
    return not args.simulated and mode != "local"


def report(args: argparse.Namespace, results: dict[str, ModeResult]) -> bool:
    """Prints the tables; returns whether the losses agree (always true in
    bf16 or simulated)."""
    reference = "single" if "single" in results else args.modes[0]
    ref = results[reference]
    cs_ms = statistics.median(results["composable_shard"].step_ms) if "composable_shard" in results else None
    per_rank_batch = args.batch_size // args.world_size
    world = f"fake world size {args.world_size} (1 process)" if args.simulated else f"world size {args.world_size}"
    memory_unit = "allocated MB" if args.device == "cuda" else "RSS MB"
    print(
        f"\n{args.config}: GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head} "
        f"block={args.block_size} global batch={args.batch_size} | {args.device} {world}, "
        f"{args.threads} thread(s)/process | {args.mixed_precision}"
        f"{' (reduce ' + args.reduce_dtype + ')' if bf16_enabled(args) else ''} | activation checkpointing "
        f"{'on' if args.activation_checkpointing else 'off'}{' | cpu offload' if args.cpu_offload else ''} "
        f"| {args.warmup} warm-up + {args.rounds} rounds x {args.steps} timed steps/mode | torch {torch.__version__}"
    )
    rounds_header = " ".join(f"{'r' + str(r + 1):>7}" for r in range(args.rounds))
    print(
        f"{'mode':<17} {rounds_header} {'median ms':>9} {'tok/s':>8} {'cs/peer':>7} "
        f"{'build ' + memory_unit:>15} {'peak ' + memory_unit:>14} {'final loss':>10} "
        f"{'max|Δloss| vs ' + reference:>24} {'rel':>8}"
    )
    agree = True
    for mode in args.modes:
        res = results[mode]
        median_ms = statistics.median(res.step_ms)
        rounds = " ".join(f"{statistics.median(ms):>7.1f}" for ms in res.round_ms)
        # Simulated: one rank's tokens; else the global batch, all ranks together.
        tokens = (per_rank_batch if args.simulated else args.batch_size) * args.block_size
        diff_txt, rel_txt, flagged = "-", "-", False
        if _loss_compared(mode, args) and _loss_compared(reference, args):
            diff = max(abs(a - b) for a, b in zip(res.losses, ref.losses))
            rel = max(abs(a - b) / abs(b) for a, b in zip(res.losses, ref.losses))
            diff_txt, rel_txt = f"{diff:.2e}", f"{rel:.1e}"
            flagged = args.mixed_precision == "none" and rel > LOSS_RTOL
        agree = agree and not flagged
        ratio = f"{cs_ms / median_ms:.2f}" if cs_ms is not None else "-"
        build = f"{res.after_build_mb:.1f}" if res.after_build_mb is not None else "-"
        peak = f"{res.peak_mb:.1f}" if res.peak_mb is not None else "-"
        print(
            f"{mode:<17} {rounds} {median_ms:>9.1f} {tokens / median_ms * 1000:>8.0f} {ratio:>7} "
            f"{build:>15} {peak:>14} {res.losses[-1]:>10.5f} {diff_txt:>24} {rel_txt:>8}"
            f"{'  MISMATCH' if flagged else ''}"
        )
    notes = [
        "r1..rN: median step per round; median ms: over all rounds; cs/peer: composable_shard's median "
        "divided by the mode's (<1: composable_shard faster).",
        "memory: increase over the level before the mode was built, largest over ranks; build = after "
        "building model and optimizer (sharded), peak = during the memory pass's steps "
        "(composable_shard's on CPU counts its own /dev/shm slots, not its peers' that it maps).",
    ]
    if args.memory_repeats > 1 and args.memory_steps > 0:
        notes.append("peak per memory pass: " + "; ".join(
            f"{mode} " + " ".join(f"{p:.1f}" for p in results[mode].peak_repeats_mb) for mode in args.modes
        ))
    if args.simulated:
        notes.append("simulated: collectives do nothing (parameters never really gathered); tok/s is one "
                     "rank's; losses are not compared.")
    else:
        notes.append("tok/s: global batch tokens per step / median step.")
    if "single" in results and not args.simulated:
        notes.append("single: one process on the global batch with one rank's threads; its time is not a peer's.")
    if "local" in results:
        notes.append("local: every rank on its slice, no communication (compute floor); its loss is not compared.")
    if bf16_enabled(args):
        notes.append("bf16: loss differences are informational (ddp/local/single use autocast, see docstring).")
    elif not args.simulated:
        notes.append(f"fp32: relative loss difference above {LOSS_RTOL:g} is flagged MISMATCH.")
    for note in notes:
        print(note)
    return agree


def _fixed_malloc_thresholds(enabled: bool) -> contextlib.AbstractContextManager:
    """Processes spawned inside start with glibc's mmap and trim thresholds
    fixed (read from the environment at process start), so no mode changes
    where the next mode's buffers come from (see the module docstring)."""
    if not enabled:
        return contextlib.nullcontext()
    names = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    return mock.patch.dict(os.environ, {name: os.environ.get(name, str(256 * 2**20)) for name in names})


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if "composable_shard" in args.modes:
        try:
            import composable_shard  # noqa: F401
        except ImportError as exc:
            sys.exit(f"bench: cannot import composable_shard ({exc}). Run without it: --modes fsdp1,fsdp2,ddp,single")
    with tempfile.TemporaryDirectory(prefix="bench-") as out_dir:
        logger.info("timing pass: %s interleaved on %d process(es)", ",".join(args.modes), args.nprocs)
        with _fixed_malloc_thresholds(args.fixed_malloc):
            spawn(timing_worker, args, out_dir)
        for repeat in range(args.memory_repeats if args.memory_steps > 0 else 0):
            for mode in args.modes if repeat % 2 == 0 else list(reversed(args.modes)):
                logger.info("memory pass %d: %s in fresh processes", repeat + 1, mode)
                spawn(memory_worker, args, out_dir, mode, repeat)
        agree = report(args, collect(args, out_dir))
        profile = Path(out_dir, "profile.txt")
        if profile.exists():
            print(f"\nprofile of one {args.profile} step on rank 0:\n{profile.read_text()}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
