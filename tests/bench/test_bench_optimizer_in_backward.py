"""``scripts/bench.py --optimizer-in-backward``: composable_shard, FSDP1
and FSDP2, each with one AdamW per parameter stepped in backward (their
hooks; FSDP1's ``_in_backward_optimizers``), train in parity with the
unwrapped model stepped after backward on the global batch, and leave no
gradient behind."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.support.harness_pool import run_distributed

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT / "scripts", ROOT / "examples"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

MODES = ("composable_shard", "fsdp1", "fsdp2")


def _args(in_backward: bool) -> argparse.Namespace:
    return argparse.Namespace(
        config="gpt", n_layer=2, n_embd=32, n_head=2, block_size=16, batch_size=4, seed=1337, lr=1e-2,
        weight_decay=0.1, mixed_precision="none", reduce_dtype="bf16", cpu_offload=False,
        activation_checkpointing=False, optimizer_in_backward=in_backward, simulated=False, world_size=2,
    )


def _train_every_mode(rank: int, world_size: int) -> dict[str, object]:
    for path in (ROOT / "scripts", ROOT / "examples"):  # a warm worker may predate this module's import
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    from bench.training import build_run, next_batch, train_step
    from data import ByteCorpus

    corpus = ByteCorpus.from_stdlib(50_000)
    device = torch.device("cpu")
    result: dict[str, object] = {}
    for mode in (*MODES, "single"):
        args = _args(in_backward=mode != "single")  # the reference steps after backward
        run = build_run(mode, args, device)
        for _ in range(3):
            train_step(run, *next_batch(run, corpus, args, device), args, device)
        losses = torch.stack(run.losses)
        if mode != "single":  # each rank's slice: the global batch's loss is the mean
            dist.all_reduce(losses)
            losses /= world_size
            result[f"{mode} grads left"] = sum(p.grad is not None for p in run.model.parameters())
        result[mode] = losses.tolist()
    return result


def test_every_sharded_mode_steps_in_backward_in_parity_with_the_usual_loop() -> None:
    for result in run_distributed(_train_every_mode, 2, timeout=240):
        reference = result["single"]  # type: ignore[index]
        for mode in MODES:
            torch.testing.assert_close(
                torch.tensor(result[mode]), torch.tensor(reference), rtol=1e-5, atol=0, msg=lambda m: f"{mode}: {m}"  # type: ignore[index]
            )
            assert result[f"{mode} grads left"] == 0, mode  # type: ignore[index]
        assert len(set(reference)) == 3  # the steps changed the model
