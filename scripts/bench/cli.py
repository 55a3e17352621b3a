"""Owns: the command line (its checks, the configuration's sizes filled in)
and the order of the passes: timing, then memory per mode, then the table;
or, for a configuration whose ``run`` is ``"largest"``, the search of
``largest.py`` instead; and the subcommands (``SUBCOMMANDS``: a first
argument naming one hands the rest to that module's ``main``).

Knows nothing of: what the passes or the subcommands do inside.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch

from . import __doc__ as package_doc
from . import largest
from .configs import CONFIGS, SIZE_ARGS
from .memory import memory_worker
from .peers import LARGEST_MODES, MODES, SIMULATED_MODES
from .processes import fixed_malloc_thresholds, spawn
from .report import collect, report
from .timing import timing_worker

logger = logging.getLogger("bench")

# ``bench.py NAME ...``: the module of scripts/bench/ whose main(argv) runs it, and what it measures.
SUBCOMMANDS = {
    "comm": ("collectives", "the handle's all-gather / reduce-scatter against raw torch.distributed"),
    "checkpoint": ("checkpoints", "sharded checkpoint save / load against FSDP2's"),
    "tp": ("tensor_parallel", "composable_shard + TP against FSDP2 + TP on a 2 x 2 mesh"),
    "scale": ("scale", "a 7B Llama-style model sharded at 8-1,024 simulated ranks against the plan"),
    "runtime-memory": ("runtime_memory", "a rank's memory beyond the plan's tensors; the plan's runtime constants"),
    "skipped-units": ("skipped_units", "peak unsharded bytes with and without set_may_be_skipped"),
    "tag-check": ("tag_check", "the cost of the tag exchange beside a collective on gloo"),
    "overhead": ("overhead", "the runtime's cost per unit per step without communication (fake group of 8)"),
    "phases": ("phases", "where a step's time goes per mode: forward, backward, optimizer, the main thread's CPU"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=package_doc.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="subcommands (bench.py NAME --help for each):\n"
        + "\n".join(f"  {name:<15} {what}" for name, (_, what) in SUBCOMMANDS.items()),
    )
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
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                   help="muon: torch.optim.Muon on the blocks' matrices, AdamW on the rest (FSDP1 cannot: its "
                        "parameters are 1-D when Muon is built); composable_shard steps each matrix on one owner rank")
    p.add_argument("--optimizer-in-backward", action="store_true",
                   help="one AdamW per parameter, stepped in its post-accumulate-grad hook (FSDP1: after its "
                        "reduce-scatter); the sharded modes and single only")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="draw composable_shard's planned memory over one step with its measured memory (rank 0, "
                        "sampled at every hook of its last memory step; --config largest: at its largest size) "
                        "to PATH (a .png; needs matplotlib)")
    p.add_argument("--cpu-offload", action="store_true", help="CUDA only: sharded parameters live on CPU")
    p.add_argument("--strategy", choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"], default="FULL_SHARD",
                   help="composable_shard's sharding strategy for every unit")
    p.add_argument("--layout-budget", type=float, default=None, metavar="MIB",
                   help="composable_shard: fully_shard(model, policy={Block}, memory_budget=MIB MiB) chooses each "
                        "unit's layout (NO_SHARD / SHARD_GRAD_OP / FULL_SHARD, up to --strategy) for this budget "
                        "per rank, instead of sharding every block by hand")
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
    p.add_argument("--overlap-report", action="store_true",
                   help="CUDA only: after the timing pass, profile --overlap-steps steps of every mode on rank 0's "
                        "device and print, per step, how much of the lanes' (non-compute streams') device time "
                        "overlaps compute (see bench/overlap.py)")
    p.add_argument("--markdown", action="store_true",
                   help="print the result tables as Markdown (the same numbers; docs/benchmarks.md is made of them)")
    p.add_argument("--overlap-steps", type=int, default=3, help="profiled steps per mode for --overlap-report")
    search_group = p.add_argument_group("--config largest (the search for the largest n_layer that trains)")
    search_group.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                         help="pretend the machine has GIB GiB for a trial's processes (default: MemAvailable "
                              "at the start less --memory-margin)")
    search_group.add_argument("--memory-margin", type=float, default=1.0, metavar="GIB",
                         help="left free of the MemAvailable at the start (default 1.0)")
    search_group.add_argument("--memory-floor", type=float, default=0.5, metavar="GIB",
                         help="stop a trial whenever MemAvailable falls below this, whatever its budget (default 0.5)")
    search_group.add_argument("--probe-layers", type=int, default=2, help="blocks of the first, small trial per mode")
    search_group.add_argument("--trial-timeout", type=float, default=1800.0, help="seconds before a trial is an error")
    search_group.add_argument("--results", default=None, metavar="PATH", help="write every trial's raw record as JSON")
    args = p.parse_args(argv)
    batch_given = args.batch_size is not None
    preset = CONFIGS[args.config].sizes_for(args.mixed_precision, args.device)
    for name in SIZE_ARGS:
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    args.simulated = args.simulate_world_size > 0
    if args.simulated:
        args.world_size = args.simulate_world_size
    if not batch_given and args.batch_size % args.world_size != 0:
        # A preset's global batch is for a few ranks: on more, at least one sequence per rank.
        args.batch_size = -(-args.batch_size // args.world_size) * args.world_size
    args.nprocs = 1 if args.simulated else args.world_size
    available = SIMULATED_MODES if args.simulated else MODES
    if CONFIGS[args.config].run == "largest":
        available = LARGEST_MODES
        if args.simulated or args.device != "cpu":
            p.error("--config largest runs on CPU with real ranks (no --device cuda, no --simulate-world-size)")
        if args.probe_layers < 1 or args.memory_steps < 1:
            p.error("--config largest needs --probe-layers and --memory-steps of at least 1")
    default_modes = available[:3] if CONFIGS[args.config].run == "largest" else available
    # On request: before/after coalescing, the flat step, the heap trims, published shards.
    on_request = ("cs_unbucketed", "cs_per_param_step", "cs_no_trim", "cs_no_publish")
    default_modes = [m for m in default_modes if m not in on_request]
    if args.optimizer_in_backward:
        default_modes = [m for m in default_modes if m not in ("ddp", "local")]
    if args.optimizer == "muon":
        default_modes = [m for m in default_modes if m != "fsdp1"]
    args.modes = [m.strip() for m in (args.modes or ",".join(default_modes)).split(",") if m.strip()]
    unknown = sorted(set(args.modes) - set(available))
    if unknown or not args.modes:
        p.error(f"--modes: {unknown} not available here; choose from {','.join(available)}")
    if args.optimizer_in_backward and set(args.modes) & {"ddp", "local"}:
        p.error("--optimizer-in-backward: ddp and local step before their gradients are reduced; leave them out")
    if args.optimizer == "muon" and ("fsdp1" in args.modes or args.optimizer_in_backward):
        p.error("--optimizer muon: not with fsdp1 (its parameters are flat 1-D views) nor --optimizer-in-backward")
    if args.plot is not None and "composable_shard" not in args.modes:
        p.error("--plot draws composable_shard's memory: include it in --modes")
    if args.profile is not None and args.profile not in args.modes:
        p.error(f"--profile {args.profile}: not among --modes {','.join(args.modes)}")
    if args.batch_size % args.world_size != 0:
        p.error(f"--batch-size {args.batch_size} is not divisible by the world size {args.world_size}")
    if args.overlap_report and args.device != "cuda":
        p.error("--overlap-report needs --device cuda (it measures CUDA streams)")
    if args.overlap_report and args.overlap_steps < 1:
        p.error("--overlap-steps must be at least 1")
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS:
        import importlib

        module = importlib.import_module(f"{__package__}.{SUBCOMMANDS[argv[0]][0]}")
        return module.main(argv[1:])
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if CONFIGS[args.config].run == "largest":
        return largest.main(args)
    if "composable_shard" in args.modes:
        try:
            import composable_shard  # noqa: F401
        except ImportError as exc:
            sys.exit(f"bench: cannot import composable_shard ({exc}). Run without it: --modes fsdp1,fsdp2,ddp,single")
    with tempfile.TemporaryDirectory(prefix="bench-") as out_dir:
        logger.info("timing pass: %s interleaved on %d process(es)", ",".join(args.modes), args.nprocs)
        with fixed_malloc_thresholds(args.fixed_malloc):
            spawn(timing_worker, args, out_dir)
        for repeat in range(args.memory_repeats if args.memory_steps > 0 else 0):
            for mode in args.modes if repeat % 2 == 0 else list(reversed(args.modes)):
                logger.info("memory pass %d: %s in fresh processes", repeat + 1, mode)
                spawn(memory_worker, args, out_dir, mode, repeat)
        agree = report(args, collect(args, out_dir))
        samples = Path(out_dir, "plot_samples.json")
        if args.plot is not None:
            if not samples.exists():
                sys.exit("bench --plot: no memory samples (the memory pass did not run: --memory-steps 0?)")
            from .plot import draw

            draw(args, args.n_layer, json.loads(samples.read_text()), args.plot)
        profile = Path(out_dir, "profile.txt")
        if profile.exists():
            print(f"\nprofile of one {args.profile} step on rank 0:\n{profile.read_text()}")
        overlap = Path(out_dir, "overlap.txt")
        if overlap.exists():
            print(f"\noverlap of the lanes with compute on rank 0 (profiled steps; times include the profiler):\n{overlap.read_text()}")
    return 0 if agree else 1
