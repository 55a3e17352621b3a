"""Owns: ``--plot PATH`` — composable_shard's memory measured at every hook
of one step on rank 0 (``composable_shard.plan.MemoryRecorder``, made when
the bench resets its memory peak, so it counts what the bench's peak
counts), kept as JSON, and drawn in the parent over the plan of the same
model (activations at the bench's batch).

Knows nothing of: how the passes and trials run (they call
``recorder_for``, ``recorded`` and ``samples_of``), the search.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any, Iterator

import torch

MODE = "composable_shard"


def recorder_for(args: argparse.Namespace, mode: str, rank: int, device: torch.device) -> Any:
    """A recorder on rank 0 of composable_shard when plotting, else None."""
    if getattr(args, "plot", None) is None or mode != MODE or rank != 0:
        return None
    from composable_shard.planning import MemoryRecorder

    return MemoryRecorder(device)


@contextlib.contextmanager
def recorded(recorder: Any, last: bool, into: list) -> Iterator[None]:
    """Record the step run inside when ``recorder`` is given and it is the
    ``last``; its samples are appended to ``into``."""
    if recorder is None or not last:
        yield
        return
    with recorder.record() as record:
        yield
    into.extend(samples_of(record))


def samples_of(record: Any) -> list[list]:
    return [[s.label, s.bytes, s.runtime_bytes] for s in record.samples]


def draw(args: argparse.Namespace, n_layer: int, samples: list[list], path: str) -> None:
    """The plan of composable_shard at ``n_layer`` blocks, with ``samples``
    over it, to ``path``."""
    import composable_shard as cs
    from composable_shard.planning.measured import MemoryRecord, MemorySample
    from gpt import GPT, Block, GPTConfig

    config = GPTConfig(block_size=args.block_size, n_layer=n_layer, n_head=args.n_head, n_embd=args.n_embd)
    with torch.device("meta"):
        model = GPT(config, seed=args.seed)
    kwargs: dict = {}
    if args.mixed_precision == "bf16":
        reduce = torch.bfloat16 if args.reduce_dtype == "bf16" else torch.float32
        kwargs["mixed_precision"] = cs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    planned = cs.plan(
        model, world_size=args.world_size, policy={Block}, device=args.device, optimizer="adamw",
        input_shape=(args.batch_size // args.world_size, args.block_size),
        optimizer_in_backward=bool(getattr(args, "optimizer_in_backward", False)), **kwargs,
    )
    kind = "allocated" if args.device == "cuda" else "RSS"
    record = MemoryRecord(kind, [MemorySample(label, count, owned) for label, count, owned in samples])
    title = (f"composable_shard, {n_layer} x {args.n_embd} GPT, rank 0 of {args.world_size}"
             + (", optimizer in backward" if getattr(args, "optimizer_in_backward", False) else "")
             + f": plan vs measured {kind} (rise since the bench's reset)")
    planned.plot(path, measured=record, title=title)
    print(f"memory over one step drawn to {path} (plan's peak {planned.rank_bytes['total'] / 2**20:,.1f} MiB, "
          f"measured at the hooks up to {max((s[1] for s in samples), default=0) / 2**20:,.1f} MiB)")
