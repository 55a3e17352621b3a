"""Owns: the benchmark's worker processes — spawning one set (one process
per rank, or one for ``--simulate-world-size``), each one's process group
(gloo on CPU, NCCL on CUDA, PyTorch's fake group when simulated), its
threads and device, and the fixed malloc thresholds of the timing pass.

Knows nothing of: the modes, what the workers measure.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
from typing import Callable
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for one set of processes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker: Callable[..., None], args: argparse.Namespace, *extra: object) -> None:
    """Runs ``worker(rank, args, port, *extra)`` in ``args.nprocs`` fresh processes."""
    mp.spawn(worker, args=(args, free_port(), *extra), nprocs=args.nprocs, join=True)


def spawn_collecting(worker: Callable[..., None], args: argparse.Namespace) -> dict:
    """``spawn``s ``worker(rank, args, port, out)`` and returns what the
    workers put in ``out`` (a shared dict)."""
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(worker, args, out)
        return dict(out)


def fixed_malloc_thresholds(enabled: bool) -> contextlib.AbstractContextManager:
    """Processes spawned inside start with glibc's mmap and trim thresholds
    fixed (read from the environment at process start), so no mode changes
    where the next mode's buffers come from (see the package docstring)."""
    if not enabled:
        return contextlib.nullcontext()
    names = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    return mock.patch.dict(os.environ, {name: os.environ.get(name, str(256 * 2**20)) for name in names})
