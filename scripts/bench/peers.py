"""Owns: the modes (``--modes``): how each one wraps the model every mode
starts from, under ``--mixed-precision`` and ``--cpu-offload``, and where
each one runs.

Knows nothing of: processes, timing, memory, the table (they read ``PEERS``).

Adding a peer is one builder function and one ``PEERS`` entry; the table
shows the modes in ``PEERS``' order.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from gpt import Block

from .models import base_model, init_module, is_deferred, make_optimizer

Builder = Callable[[argparse.Namespace, torch.device], tuple[nn.Module, torch.optim.Optimizer]]


def bf16_enabled(args: argparse.Namespace) -> bool:
    return args.mixed_precision == "bf16"


def reduce_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.reduce_dtype == "bf16" else torch.float32


def build_composable_shard(
    args: argparse.Namespace, device: torch.device, *, small_unit_groups: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer]:
    from composable_shard import CPUOffload, MixedPrecision, ShardingStrategy, SmallUnitGroups, fully_shard

    kwargs: dict = {"device_id": device if device.type == "cuda" else None}
    if getattr(args, "strategy", "FULL_SHARD") != "FULL_SHARD":
        kwargs["strategy"] = ShardingStrategy[args.strategy]
    if bf16_enabled(args):
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype(args))
    if args.cpu_offload:
        kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    if is_deferred(args):  # each unit materialised on its own, then sharded
        kwargs["param_init_fn"] = init_module
    model = base_model(args, device)
    # Muon checks at construction that its parameters are 2-D: build it while they are.
    optimizer = make_optimizer(model, args) if getattr(args, "optimizer", "adamw") == "muon" else None
    # Runs of small blocks as one unit each ([Note: groups of small units]), or a unit per block.
    policy = SmallUnitGroups({Block}) if small_unit_groups else {Block}
    if getattr(args, "layout_budget", None) is not None:
        # One call: the plan chooses each unit's layout for the budget (the root's too).
        fully_shard(model, policy=policy, memory_budget=int(args.layout_budget * 2**20), **kwargs)
    elif small_unit_groups:
        fully_shard(model, policy=policy, **kwargs)
    else:
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    return model, optimizer or make_optimizer(model, args)


def build_composable_shard_unbucketed(
    args: argparse.Namespace, device: torch.device
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """composable_shard with every flat parameter gathered and reduced
    alone ([Note: coalesced reductions] and [Note: coalesced all-gathers]
    off): the bucket sizes are read when a flat parameter reserves shared
    memory and when the tree initialises, at its first forward, run here
    (no grad, so nothing changes) while they are 0."""
    from composable_shard import comm

    saved = comm.REDUCE_BUCKET_BYTES, comm.GATHER_BUCKET_BYTES
    comm.REDUCE_BUCKET_BYTES = comm.GATHER_BUCKET_BYTES = 0
    try:
        model, optimizer = build_composable_shard(args, device)
        with torch.no_grad():
            model(torch.zeros(1, 1, dtype=torch.long, device=device))
    finally:
        comm.REDUCE_BUCKET_BYTES, comm.GATHER_BUCKET_BYTES = saved
    return model, optimizer


def build_composable_shard_small_groups(
    args: argparse.Namespace, device: torch.device
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """composable_shard with runs of small blocks grouped into one unit
    each (``SmallUnitGroups``); large blocks stay units of their own."""
    return build_composable_shard(args, device, small_unit_groups=True)


def build_composable_shard_no_trim(
    args: argparse.Namespace, device: torch.device
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """composable_shard without the heap trims of CPU backwards ([Note:
    trimming the host heap in backward]): the switch is read when the tree
    initialises, at its first forward, run here (no grad, so nothing
    changes) while it says 0."""
    from composable_shard.runtime.host_memory import ENV_SWITCH

    saved = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "0"
    try:
        model, optimizer = build_composable_shard(args, device)
        with torch.no_grad():
            model(torch.zeros(1, 1, dtype=torch.long, device=device))
    finally:
        if saved is None:
            os.environ.pop(ENV_SWITCH)
        else:
            os.environ[ENV_SWITCH] = saved
    return model, optimizer


def build_composable_shard_no_publish(
    args: argparse.Namespace, device: torch.device
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """composable_shard with every all-gather through the slots' rounds, none
    from published shards ([Note: all-gathers from published shards]): the
    knob is read as each flat parameter is built, here while it says 0."""
    from composable_shard.comm import shared_memory

    saved = shared_memory.PUBLISHED_BYTES
    shared_memory.PUBLISHED_BYTES = 0
    try:
        return build_composable_shard(args, device)
    finally:
        shared_memory.PUBLISHED_BYTES = saved


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
        # Deferred: FSDP1 calls it on every module of a unit still on meta, unit by unit.
        param_init_fn=functools.partial(init_module, device=device) if is_deferred(args) else None,
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
    if is_deferred(args):  # FSDP2's documented way: shard on meta, then storage for the shards only
        model.to_empty(device=device)
        for module in model.modules():
            init_module(module)
    return model, make_optimizer(model, args)


def build_ddp(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_materialized(args, device), device_ids=[device] if device.type == "cuda" else None)
    return model, make_optimizer(model, args)


def _materialized(args: argparse.Namespace, device: torch.device) -> nn.Module:
    """The base model with real storage: unsharded modes hold it whole."""
    model = base_model(args, device)
    if is_deferred(args):
        for module in model.modules():
            init_module(module, device)
    return model


def build_unwrapped(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _materialized(args, device)
    return model, make_optimizer(model, args)


@dataclass(frozen=True)
class Peer:
    """One mode. ``build``: its model and optimizer in one rank (every rank
    calls it, in the same order: builders may use collectives);
    ``simulated``: offered under ``--simulate-world-size``; ``autocast``: it
    has no mixed-precision setting of its own, so bf16 runs its forward under
    ``torch.autocast``; ``rank0_only``: only rank 0 trains it (on the global batch);
    ``loss_compared``: its loss must match the reference's."""

    build: Builder
    simulated: bool = True
    autocast: bool = False
    rank0_only: bool = False
    loss_compared: bool = True


def build_composable_shard_per_param_step(
    args: argparse.Namespace, device: torch.device
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """composable_shard with its optimizer stepping each parameter alone
    ([Note: the flat step] off for it)."""
    from composable_shard.optim import set_flat_step

    model, optimizer = build_composable_shard(args, device)
    set_flat_step(optimizer, False)
    return model, optimizer


PEERS: dict[str, Peer] = {
    "composable_shard": Peer(build_composable_shard),
    # The same with each parameter stepped alone by the optimizer (before the flat step).
    "cs_per_param_step": Peer(build_composable_shard_per_param_step),
    # The same with every gradient reduced in a collective of its own (before coalescing).
    "cs_unbucketed": Peer(build_composable_shard_unbucketed),
    # The same with runs of small blocks grouped into one unit each.
    "cs_small_groups": Peer(build_composable_shard_small_groups),
    # The same without the heap trims in backward (the trims' cost in time).
    "cs_no_trim": Peer(build_composable_shard_no_trim),
    # The same with every all-gather through rounds (before published shards).
    "cs_no_publish": Peer(build_composable_shard_no_publish),
    "fsdp1": Peer(build_fsdp1),
    "fsdp2": Peer(build_fsdp2),
    "ddp": Peer(build_ddp, simulated=False, autocast=True),
    "local": Peer(build_unwrapped, simulated=False, autocast=True, loss_compared=False),
    "single": Peer(build_unwrapped, autocast=True, rank0_only=True),
}
MODES = tuple(PEERS)
SIMULATED_MODES = tuple(mode for mode, peer in PEERS.items() if peer.simulated)
# --config largest: the sharded modes (whose limit is the point) and DDP (on request).
LARGEST_MODES = ("composable_shard", "fsdp1", "fsdp2", "ddp")


def autocast_for(mode: str, args: argparse.Namespace, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 for the modes without a mixed-precision setting of their own."""
    if bf16_enabled(args) and PEERS[mode].autocast:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def runs_on(mode: str, rank: int) -> bool:
    return not PEERS[mode].rank0_only or rank == 0
