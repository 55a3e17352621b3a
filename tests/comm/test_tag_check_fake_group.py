"""comm.tag_check: the tag exchange beside a message-path collective runs
where peers could disagree (a gloo group of two ranks: one extra all-gather
of the tags) and not in PyTorch's fake process group, where one process
stands for every rank (the exchange could detect nothing and was half of a
simulated step's collectives)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from composable_shard.comm import process_group, tag_check, tags

from tests.support.harness_pool import run_distributed

ROOT = Path(__file__).resolve().parents[2]


class _Key:
    """Stands for a flat parameter: what a tag is registered under."""


def _backend_all_gathers_of_a_tagged_collective() -> tuple[int, bool]:
    """(process_group.all_gather_into calls a tagged CPU collective makes on
    the default group, whether the group counts as having peers)."""
    calls = []
    original = process_group.all_gather_into

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return original(*args, **kwargs)

    key = _Key()
    tags.register(key, 7, "unit 'probe'")
    shard = torch.ones(3)
    output = torch.empty(3 * torch.distributed.get_world_size())
    process_group.all_gather_into = spy  # type: ignore[assignment]
    try:
        with tags.collective_of(key):
            work = tag_check.checked(
                lambda: original(output, shard, group=None, async_op=True), shard, None, async_op=True
            )
        work.wait()
    finally:
        process_group.all_gather_into = original  # type: ignore[assignment]
    return len(calls), tag_check._peers_can_differ(None)


def _on_gloo(rank: int, world_size: int) -> tuple[int, bool]:
    return _backend_all_gathers_of_a_tagged_collective()


def test_gloo_group_exchanges_the_tag_beside_the_collective() -> None:
    for spy_calls, has_peers in run_distributed(_on_gloo, 2):  # type: ignore[misc]
        assert has_peers is True
        assert spy_calls == 1  # the tags' all-gather; the collective itself called the original


# Run in a process of its own (the fake group replaces the default group).
_FAKE_GROUP = """
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from composable_shard.comm import process_group, tag_check, tags
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
calls = []
original = process_group.all_gather_into
process_group.all_gather_into = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
key = type("Key", (), {})()
tags.register(key, 7, "unit 'probe'")
shard, output = torch.ones(3), torch.empty(24)
with tags.collective_of(key):
    work = tag_check.checked(lambda: original(output, shard, group=None, async_op=True), shard, None, async_op=True)
work.wait()
print("RESULT", len(calls), tag_check._peers_can_differ(None))
dist.destroy_process_group()
"""


def test_fake_group_skips_the_tag_exchange() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    completed = subprocess.run(
        [sys.executable, "-c", _FAKE_GROUP], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    result = next(line for line in completed.stdout.splitlines() if line.startswith("RESULT"))
    assert result.split()[1:] == ["0", "False"]
