"""Ports of FSDP2's test_fully_shard_autograd.py scenarios (see
tests/peer/SCENARIOS.md): gradients reach every unit, in parity with one
process, when some forward output or some unit takes no part in the loss,
and when units pass activations to each other inside lists, tuples,
namedtuples and dicts."""

from __future__ import annotations

import collections
from typing import Any

import torch
import torch.nn as nn

from composable_shard import ShardingStrategy, fully_shard

from tests.support.harness_pool import run_distributed
from tests.support.models import TwoHeads
from tests.support.peer_parity import mean_square, train_in_parity

DIM = 12
STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)


class _StepCounter:
    """A loss that uses both outputs for the first ``both_for`` calls, then
    only the first (the second output's unit still ran forward)."""

    def __init__(self, both_for: int) -> None:
        self.calls = 0
        self.both_for = both_for

    def __call__(self, outputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        step = self.calls // 2  # reference and sharded model per step
        self.calls += 1
        first, second = outputs
        return (first * second).mean() if step < self.both_for else first.mean()


def _unused_outputs_and_modules(rank: int, world_size: int) -> None:
    for strategy in STRATEGIES:
        # An output of the root's own linear (lin2) left out of the loss.
        def shard_lin1(model: nn.Module) -> None:
            fully_shard(model.lin1, strategy=strategy)
            fully_shard(model, strategy=strategy)

        train_in_parity(TwoHeads, shard_lin1, dim=DIM, steps=5, loss=_StepCounter(both_for=2), when=f"unused output {strategy.name}")

        # A unit that never runs forward.
        def shard_both(model: nn.Module) -> None:
            fully_shard(model.lin1, strategy=strategy)
            fully_shard(model.lin2, strategy=strategy)
            fully_shard(model, strategy=strategy)

        model, _ = train_in_parity(
            lambda: TwoHeads(use_second=False), shard_both, dim=DIM, steps=3, loss=lambda out: out.mean(), when=f"unused unit {strategy.name}"
        )
        assert all(p.grad is None or not p.grad.count_nonzero() for p in model.lin2.parameters())


def test_unused_forward_output_and_unused_unit_match_reference() -> None:
    run_distributed(_unused_outputs_and_modules, 2)


_Pair = collections.namedtuple("_Pair", ["x", "y"])


class ToContainer(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        return {"list": lambda: [x], "tuple": lambda: (x,), "dict": lambda: {"x": x}, "namedtuple": lambda: _Pair(x, torch.ones_like(x))}[self.kind]()


class ContainerMLP(nn.Module):
    """Takes and returns the activation inside the same kind of container."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(DIM, DIM)
        self.lin2 = nn.Linear(DIM, DIM)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin2(torch.relu(self.lin1(x))))

    def forward(self, packed: Any) -> Any:
        if isinstance(packed, dict):
            return {"x": self._forward(packed["x"])}
        if isinstance(packed, _Pair):
            return _Pair(self._forward(packed.x), packed.y)
        return type(packed)([self._forward(packed[0])])


class FromContainer(nn.Module):
    def forward(self, packed: Any) -> torch.Tensor:
        return packed["x"] if isinstance(packed, dict) else packed[0]


def _containers_between_units(rank: int, world_size: int) -> None:
    for kind in ("list", "tuple", "dict", "namedtuple"):

        def build() -> nn.Module:
            return nn.Sequential(ToContainer(kind), ContainerMLP(), ContainerMLP(), ContainerMLP(), FromContainer())

        def shard(model: nn.Module) -> None:
            for module in model:  # parameterless units included, as FSDP2's test does
                fully_shard(module)
            fully_shard(model)

        train_in_parity(build, shard, dim=DIM, steps=3, loss=mean_square, when=kind)


def test_activations_in_containers_between_units_match_reference() -> None:
    run_distributed(_containers_between_units, 2)
