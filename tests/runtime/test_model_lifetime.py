"""A sharded model lives as long as the user's references to it: once the last
one is gone and the garbage collector ran (a unit and its module refer to each
other), the model, its unit states and its flat parameters are freed, after
training steps as before any; and a process group used by nothing else then
ends at ``destroy_process_group`` (its threads stop), so a script exits with
no communication thread still running."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import torch

from composable_shard import fully_shard
from composable_shard.runtime.state import unit_states_under

from tests.support.harness_pool import run_distributed
from tests.support.models import TinyGPT, batch, lm_loss

ROOT = Path(__file__).resolve().parents[2]


def _model_freed_after(rank: int, world_size: int, steps: int) -> bool:
    model = TinyGPT()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    del block  # the loop's last block: a reference of ours
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = batch(step)
        per_rank = x.shape[0] // world_size
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        lm_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
    alive = [weakref.ref(model)]
    for _, state in unit_states_under(model):
        alive.append(weakref.ref(state))
        alive += [weakref.ref(handle.unsharded_flat_param) for handle in state.handles]
    del model, optimizer, state
    gc.collect()
    return all(ref() is None for ref in alive)


def test_a_sharded_model_is_freed_with_its_last_reference() -> None:
    for steps in (0, 2):
        assert run_distributed(_model_freed_after, 2, steps) == [True, True], f"after {steps} steps"


_SCRIPT = """
import gc, os, socket, sys
import torch, torch.distributed as dist
from composable_shard import fully_shard

def threads():
    return sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task"))

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
before = set(threads())
dist.init_process_group("gloo")
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
fully_shard(model[0])
fully_shard(model)
model(torch.ones(2, 4)).sum().backward()
del model
gc.collect()
dist.destroy_process_group()
print(sorted(set(threads()) - before))
"""


def _output_lines(script: str) -> list[str]:
    """Run ``script`` in a fresh process (the test workers' own group must
    stay up) and return its stdout lines, less the "[Gloo] Rank 0 is
    connected ..." lines gloo of torch 2.9 prints per group."""
    completed = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return [line for line in completed.stdout.strip().splitlines() if not line.startswith("[Gloo]")]


def test_destroy_process_group_ends_the_group_of_a_freed_model() -> None:
    lines = _output_lines(_SCRIPT)
    assert lines[-1] == "[]", f"threads left running: {lines}"


_HYBRID_SCRIPT = """
import gc, os, socket, weakref
import importlib
import torch, torch.distributed as dist
from composable_shard import ShardingStrategy, fully_shard

def threads():
    return sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task"))

def start():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo")

def train_once():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard(model, strategy=ShardingStrategy.HYBRID_SHARD)
    model(torch.ones(2, 4)).sum().backward()
    return model

cache = importlib.import_module("composable_shard.entry")._HYBRID_GROUPS_CACHE
before = set(threads())
start()
train_once()
made = [weakref.ref(group) for groups in cache.values() for group in groups]
print("cached", len(cache), len(made))
gc.collect()
dist.destroy_process_group()
gc.collect()
print("after destroy", len(cache), sum(ref() is not None for ref in made))
start()  # a second job in the same process makes its own groups
train_once()
print("second job", len(cache), all(ref() is None for ref in made))
gc.collect()
dist.destroy_process_group()
gc.collect()
print(sorted(set(threads()) - before))
"""


def test_destroy_process_group_drops_the_hybrid_groups_made_for_it() -> None:
    lines = _output_lines(_HYBRID_SCRIPT)
    assert lines[:3] == ["cached 1 2", "after destroy 0 0", "second job 1 True"], lines
    assert lines[-1] == "[]", f"threads left running: {lines}"
