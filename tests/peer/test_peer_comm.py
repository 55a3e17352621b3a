"""Ports of FSDP2's test_fully_shard_comm.py scenarios that are about what
backward does, not about its internals (see tests/peer/SCENARIOS.md), in
parity with one process: two forwards before one backward, with every
activation-checkpointing form; two backwards through different branches
of one forward (``retain_graph``); units holding a submodule that never runs;
``unshard_params`` before the first forward."""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.utils.checkpoint import checkpoint

from composable_shard import ShardingStrategy, fully_shard, unshard_params

from tests.support.harness_pool import run_distributed
from tests.support.models import MLP, TwoHeads
from tests.support.parity import Parity, assert_resharded, compare_full
from tests.support.peer_parity import float_batch, local_slice, mean_square, train_in_parity

STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)


class _CheckpointedMLP(MLP):
    def __init__(self, dim: int, use_reentrant: bool) -> None:
        super().__init__(dim)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=self.use_reentrant)


def _stack(form: str | None) -> nn.Module:
    if form in ("reentrant", "non-reentrant"):
        return nn.Sequential(*[_CheckpointedMLP(8, form == "reentrant") for _ in range(3)])
    model = nn.Sequential(*[MLP(8) for _ in range(3)])
    if form == "composable":
        for mlp in model:
            composable_checkpoint(mlp)
    return model


def _two_forwards(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    half = x.shape[0] // 2
    return torch.cat([model(x[:half]), model(x[half:])])


def _two_forwards_one_backward(rank: int, world_size: int) -> None:
    for strategy in STRATEGIES:
        for form in (None, "reentrant", "non-reentrant", "composable"):

            def shard(model: nn.Module) -> None:
                for mlp in model:
                    fully_shard(mlp, strategy=strategy)
                fully_shard(model, strategy=strategy)

            # Inputs that require grad: the reentrant form needs one to record a graph.
            train_in_parity(
                functools.partial(_stack, form),
                shard,
                dim=8,
                forward=_two_forwards,
                make_batch=lambda step: float_batch(step, 8).requires_grad_(),
                when=f"{strategy.name} {form}",
            )


def test_two_forwards_before_one_backward_match_reference() -> None:
    run_distributed(_two_forwards_one_backward, 2)


class _ModuleWithUnusedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unused_lin = nn.Linear(1, 1)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def _branches_and_unused_submodules(rank: int, world_size: int) -> None:
    for strategy in STRATEGIES:
        # Two backwards through one forward: the second branch first, keeping
        # the graph, then the first; the shared trunk gets both gradients.
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 12), TwoHeads())
        reference = copy.deepcopy(model)
        for unit in (model[0], model[1].lin1, model[1].lin2, model):
            fully_shard(unit, strategy=strategy)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
        parity = Parity(build=lambda: model, shard=lambda m: None, reference_optimizer=reference_optimizer)
        for step in range(3):
            inputs = float_batch(step, 12)
            for module, x in ((reference, inputs), (model, local_slice(inputs))):
                first, second = module(x)
                mean_square(second).backward(retain_graph=True)
                if module is model:
                    assert_resharded(model)
                mean_square(first).backward()
            assert_resharded(model)
            compare_full(model, reference, parity, f"{strategy.name} step {step} after both branches", grads=True)
            for opt in (optimizer, reference_optimizer):
                opt.step()
                opt.zero_grad()

        # Units whose submodule never runs forward.
        def shard(model: nn.Module) -> None:
            fully_shard(model[0], strategy=strategy)
            fully_shard(model[1], strategy=strategy)
            fully_shard(model, strategy=strategy)

        def build() -> nn.Module:
            return nn.Sequential(_ModuleWithUnusedLinear(), _ModuleWithUnusedLinear(), nn.Linear(8, 8))

        train_in_parity(build, shard, dim=8, when=f"{strategy.name} unused submodule")


def test_branches_backpropagated_separately_and_unused_submodules_match_reference() -> None:
    run_distributed(_branches_and_unused_submodules, 2)


def _unshard_params_before_the_first_forward(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    reference = copy.deepcopy(model)
    for unit in (*model, model):
        fully_shard(unit)
    with unshard_params(model, writeback=False):
        for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param, expected, msg=lambda m: f"{name}: {m}")
    assert_resharded(model)
    output: Any = model(torch.ones(2, 4))
    torch.testing.assert_close(output, reference(torch.ones(2, 4)))


def test_unshard_params_before_the_first_forward_shows_full_values() -> None:
    run_distributed(_unshard_params_before_the_first_forward, 2)
