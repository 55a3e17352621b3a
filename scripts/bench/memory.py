"""Owns: the memory pass — one mode in a fresh set of processes, its memory
after building and its peak over ``--memory-steps`` steps, relative to the
level before it was built (CPU: RSS and its high-water mark; CUDA: allocated
tensor memory).

Knows nothing of: how the modes wrap the model, timing, the printed table
(it writes ``memory_{mode}_{repeat}_rank{r}.json`` for ``report.py``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from data import ByteCorpus

from .peers import runs_on
from .plot import recorded, recorder_for
from .processes import init_worker
from .training import barrier, build_run, next_batch, synchronize, train_step


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


def own_shared_memory_correction_mb(mode: str, device: torch.device) -> float:
    """What to add to composable_shard's RSS on CPU so that every page of its
    shared-memory slots is counted once, for the rank that owns it.

    Shared-memory collectives keep their slots in /dev/shm. RSS counts the
    pages this rank touched through its mappings, its peers' included: those
    are replaced by this rank's own slots."""
    if mode != "composable_shard" or device.type != "cpu":
        return 0.0
    from composable_shard.comm import transport

    return (transport.process_shared_bytes() - transport.process_mapped_bytes()) / 2**20


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

    # Building the first optimizer imports torch._dynamo (about 220 modules,
    # 28 MB of RSS on torch 2.13), inside whichever mode builds one first:
    # --optimizer muon builds its optimizer before sharding, so that code
    # landed below the shards and counted 21 MB against composable_shard.
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 2))])


def memory_worker(rank: int, args: argparse.Namespace, port: int, out_dir: str, mode: str, repeat: int) -> None:
    device = init_worker(rank, args, port)
    corpus = ByteCorpus.from_stdlib(args.data_bytes)
    import_every_mode()
    barrier(args, device)
    synchronize(device)
    reset_peak_memory(device)
    start_mb, _ = memory_now(device)
    result: dict[str, float | None] = {"after_build_mb": None, "peak_increase_mb": None}
    recorder = recorder_for(args, mode, rank, device) if repeat == 0 else None  # --plot
    samples: list = []
    if runs_on(mode, rank):
        run = build_run(mode, args, device)
        synchronize(device)
        result["after_build_mb"] = memory_now(device)[0] - start_mb
        for step in range(args.memory_steps):
            with recorded(recorder, step == args.memory_steps - 1, samples):
                train_step(run, *next_batch(run, corpus, args, device), args, device)
        synchronize(device)
        result["peak_increase_mb"] = memory_now(device)[1] - start_mb + own_shared_memory_correction_mb(mode, device)
    if samples:
        Path(out_dir, "plot_samples.json").write_text(json.dumps(samples))
    Path(out_dir, f"memory_{mode}_{repeat}_rank{rank}.json").write_text(json.dumps(result))
    barrier(args, device)
    dist.destroy_process_group()
