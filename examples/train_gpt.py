"""Train a small byte-level GPT with ``composable_shard.fully_shard``.

Owns: the end-to-end example: process group, model, sharding, optimizer,
training loop, logging, sharded checkpoints.
Knows nothing of: how ``fully_shard`` works inside.

Run::

    torchrun --nproc_per_node 2 examples/train_gpt.py                 # CPU, gloo
    torchrun --nproc_per_node 8 examples/train_gpt.py --device cuda   # GPUs, nccl
    python examples/train_gpt.py                                      # one process

    # save every 20 steps; after a crash, continue from the newest checkpoint
    # (same --steps: the learning-rate schedule is computed from it)
    torchrun --nproc_per_node 2 examples/train_gpt.py --steps 60 --save-dir runs/gpt --save-every 20
    torchrun --nproc_per_node 2 examples/train_gpt.py --steps 60 --save-dir runs/gpt --resume latest

    # survive dead workers: torchrun's elastic agent starts the group again
    # (up to 3 times) and every worker resumes from the newest complete
    # checkpoint ("latest" starts fresh when there is none yet)
    torchrun --nnodes 1:2 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \
        --nproc_per_node 2 examples/train_gpt.py --save-dir runs/gpt --save-every 10 --resume latest

What it shows:
- sharding: ``fully_shard(block)`` for every transformer block, then
  ``fully_shard(model)``; the root unit owns the embeddings, the final norm and
  the output head (tied to the token embedding, so both stay in one unit);
- the optimizer is built on the model's own parameters (their identity
  survives sharding), with decay / no-decay groups;
- every rank draws the same *global* batch and trains on its slice, so the
  loss curve does not depend on the number of ranks;
- checkpoints are sharded: each rank writes its part with
  ``torch.distributed.checkpoint`` (``composable_shard.checkpoint``); one
  saved at one world size loads at another;
- elastic restarts: ``composable_shard.comm.elastic.init_process_group``
  joins a group that torchrun started again, ``latest_checkpoint`` finds
  where to resume, and the batch of a step depends only on the step.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import os
import resource
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # composable_shard from a checkout

from composable_shard import clip_grad_norm_, describe, fully_shard, plan  # noqa: E402
from composable_shard.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from composable_shard.comm.elastic import init_process_group  # noqa: E402
from composable_shard.planning import MemoryRecorder  # noqa: E402
from data import ByteCorpus, rank_slice  # noqa: E402
from gpt import GPT, Block, GPTConfig, param_groups  # noqa: E402

logger = logging.getLogger("train_gpt")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--steps", type=int, default=50, help="total steps, across resumes; also the LR schedule's length"
    )
    p.add_argument("--batch-size", type=int, default=16, help="GLOBAL batch, split over ranks")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=10, help="linear warm-up, then cosine to lr/10")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm; 0 disables")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    p.add_argument("--data-bytes", type=int, default=2_000_000, help="bytes of stdlib source to train on")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-dir", type=Path, default=None, help="write checkpoints under this directory")
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: only at the end)")
    p.add_argument("--resume", default=None,
                   help="checkpoint directory to resume from, or 'latest': the newest complete one in --save-dir, "
                        "if any (else start fresh)")
    p.add_argument("--plan", action="store_true", help="print rank 0's sharding plan (units, per-rank memory) first")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH",
                   help="with --plan: draw rank 0's planned memory over one step, with the memory measured at "
                        "each hook of the second step over it, to PATH (a .png; needs matplotlib)")
    args = p.parse_args(argv)
    if args.resume == "latest" and args.save_dir is None:
        p.error("--resume latest needs --save-dir")
    if args.plot is not None and not args.plan:
        p.error("--plot draws the plan: give --plan too")
    return args


# -- process group -------------------------------------------------------------


def init_distributed(device_type: str) -> tuple[int, int, torch.device]:
    """Join the process group torchrun described in the environment (also
    after torchrun's elastic agent restarted the group), or make a
    one-process group on this machine when started with plain ``python``."""
    if "RANK" not in os.environ:
        with socket.socket() as s:  # a free port for the one-process group
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


# -- model ---------------------------------------------------------------------


def build_model(args: argparse.Namespace, device: torch.device) -> GPT:
    config = GPTConfig(
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=args.dropout,
    )
    # Same seed on every rank: every rank starts from the same full model, then
    # keeps only its shard. (A model too big for one device would be built on
    # the meta device instead.)
    model = GPT(config, seed=args.seed).to(device)
    logger.info("model: %.2fM parameters, %s", model.num_params() / 1e6, config)
    for block in model.blocks:
        if args.activation_checkpointing:
            # Before fully_shard, so the recomputation sits inside the unit's hooks.
            from torch.distributed._composable import checkpoint

            checkpoint(block)
        fully_shard(block)
    fully_shard(model)  # the root: embeddings, ln_f and the tied lm_head
    logger.info(
        "applied fully_shard to %d blocks and the root (activation checkpointing %s)",
        len(model.blocks),
        "on" if args.activation_checkpointing else "off",
    )
    return model


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to ``args.lr``, then cosine decay to ``args.lr / 10`` at ``args.steps``."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr / 10 + 0.5 * (args.lr - args.lr / 10) * (1 + math.cos(math.pi * min(1.0, progress)))


# -- checkpoints ----------------------------------------------------------------


def save_step(model: GPT, optimizer: torch.optim.Optimizer, step: int, save_dir: Path) -> Path:
    """Sharded checkpoint of ``step`` (the number of steps done) at
    ``save_dir/step_NNNNNN``; a directory of that name is always complete
    (``save_checkpoint`` writes ``step_NNNNNN.partial`` and switches it into
    place), so a kill during a save leaves the previous checkpoints usable."""
    path = save_dir / f"step_{step:06d}"
    save_checkpoint(path, model, optimizer, extra_state={"step": step})
    logger.info("saved %s", path)
    return path


def resume(model: GPT, optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> int:
    """Load ``--resume`` (a directory, or ``latest``: the newest complete
    checkpoint in ``--save-dir``) into the model and optimizer, at any world
    size; returns the number of steps already done (0: starting fresh)."""
    path = latest_checkpoint(args.save_dir) if args.resume == "latest" else Path(args.resume)
    if path is None:
        logger.info("no complete checkpoint under %s yet: starting fresh", args.save_dir)
        return 0
    extra = load_checkpoint(path, model, optimizer)
    if "step" not in extra:
        raise ValueError(f"--resume {path}: the checkpoint records no step (not saved by this script). Pass another.")
    logger.info("resumed from %s at step %d", path, extra["step"])
    return int(extra["step"])


# -- memory --------------------------------------------------------------------


def memory_report(device: torch.device) -> str:
    if device.type == "cuda":
        return f"mem {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MB peak allocated"
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    rss_mb = rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return f"rss {rss_mb:.0f} MB (peak {peak_mb:.0f} MB)"


# -- training ------------------------------------------------------------------


def train(args: argparse.Namespace) -> None:
    rank, world_size, device = init_distributed(args.device)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
    )
    logger.info("world size %d on %s (%s)", world_size, device, dist.get_backend())
    corpus = ByteCorpus.from_stdlib(args.data_bytes)
    # Made before the model: the measured memory then counts the model state, as the plan does.
    recorder = MemoryRecorder(device) if args.plot is not None else None
    model = build_model(args, device)
    if args.plan:
        plan = describe(model, optimizer="adamw")  # what fully_shard allocated, on every rank
        if rank == 0:
            print(plan, flush=True)
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))

    start_step = resume(model, optimizer, args) if args.resume is not None else 0

    # The second step is recorded: the optimizer state exists by then, as the plan assumes.
    recorded_step, record = min(start_step + 1, args.steps - 1), None
    tokens_per_step = args.batch_size * args.block_size  # global
    t_last, step_last = time.perf_counter(), start_step
    for step in range(start_step, args.steps):
        # The batch depends only on (seed, step): resuming continues the same stream.
        generator = torch.Generator().manual_seed(args.seed + step)
        x, y = corpus.get_batch("train", args.batch_size, args.block_size, generator)  # (B, T) global
        x = rank_slice(x, rank, world_size).to(device)  # (B / world_size, T)
        y = rank_slice(y, rank, world_size).to(device)

        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        with recorder.record() if recorder is not None and step == recorded_step else contextlib.nullcontext() as sampled:
            _, loss = model(x, y)
            loss.backward()
            grad_norm = clip_grad_norm_(model, args.grad_clip) if args.grad_clip > 0 else None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        record = sampled if sampled is not None else record

        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            # The mean over ranks of their slices' losses is the global batch's loss.
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            global_loss = global_loss.item() / world_size  # a host-device sync point
            elapsed = time.perf_counter() - t_last
            tokens_per_s = tokens_per_step * (done - step_last) / elapsed
            logger.info(
                "step %4d/%d | loss %.4f | lr %.2e | grad norm %s | %.0f tok/s | %s",
                done,
                args.steps,
                global_loss,
                lr_at(step, args),
                "-" if grad_norm is None else f"{grad_norm.item():.3f}",
                tokens_per_s,
                memory_report(device),
            )
            t_last, step_last = time.perf_counter(), done
        if args.save_dir is not None and args.save_every > 0 and done % args.save_every == 0:
            save_step(model, optimizer, done, args.save_dir)

    if args.save_dir is not None and (args.save_every <= 0 or args.steps % args.save_every != 0):
        if args.steps > start_step:
            save_step(model, optimizer, args.steps, args.save_dir)
    if args.plot is not None and rank == 0:
        plot_memory(args, world_size, device, record)


def plot_memory(args: argparse.Namespace, world_size: int, device: torch.device, record: object) -> None:
    """Rank 0's plan (activations measured at this batch on a meta copy of
    the model) drawn with the memory measured over one step."""
    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    with torch.device("meta"):
        meta = GPT(config, seed=args.seed)
    planned = plan(meta, world_size=world_size, policy={Block}, device=device.type,
                   input_shape=(args.batch_size // world_size, args.block_size))
    planned.plot(str(args.plot), measured=record)
    logger.info("memory over one step drawn to %s (plan's peak %.1f MiB)", args.plot, planned.rank_bytes["total"] / 2**20)


def main() -> None:
    train(parse_args())
    # The model is gone with train's frame, but its units are reference cycles
    # that hold the process group: collect them first, so that
    # destroy_process_group really ends it (gloo's and the store's threads;
    # a process that exits with them still running can abort at exit).
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
