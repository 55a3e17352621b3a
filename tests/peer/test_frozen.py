"""Ports of FSDP2's test_fully_shard_frozen.py scenarios (see
tests/peer/SCENARIOS.md), in parity with one process: only biases trained
(frozen and trainable parameters in one unit, with and without activation
checkpointing; only the trainable part is reduced); frozen and trainable
units interleaved, each its own root, with a forward under ``no_grad``
between steps; frozen and trainable units run several times per forward,
some of those runs under ``no_grad``. Freezing or unfreezing after
``fully_shard`` is not covered here (see the table)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable import checkpoint

from composable_shard import ShardingStrategy, fully_shard
from composable_shard.runtime.state import unit_states_under

from tests.support.comm_spies import CollectiveSpy, with_reductions_alone
from tests.support.harness_pool import run_distributed
from tests.support.models import MLP
from tests.support.parity import Parity, assert_resharded, compare_full
from tests.support.peer_parity import float_batch, local_slice, train_in_parity

STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)


def _biases_only() -> nn.Module:
    model = nn.Sequential(*[MLP(16) for _ in range(3)])
    for name, param in model.named_parameters():
        if "bias" not in name:
            param.requires_grad_(False)
    return model


@with_reductions_alone  # counts reductions per flat parameter
def _train_biases_only(rank: int, world_size: int) -> None:
    for strategy in STRATEGIES:
        for use_checkpoint in (False, True):

            def shard(model: nn.Module) -> None:
                for mlp in model:
                    if use_checkpoint:
                        checkpoint(mlp)
                    fully_shard(mlp, strategy=strategy)
                fully_shard(model, strategy=strategy)

            spy = CollectiveSpy()
            with spy.watching():
                model, _ = train_in_parity(_biases_only, shard, dim=16, when=f"{strategy.name} checkpoint={use_checkpoint}")
            trainable = {h.layout.shard_numel for _, s in unit_states_under(model) for h in s.trainable_handles}
            frozen = {h.layout.shard_numel for _, s in unit_states_under(model) for h in s.handles if not h.layout.requires_grad}
            reduced = {numel for name, numel in spy.sizes if name == "reduce_scatter"}
            assert reduced and reduced <= trainable and not reduced & frozen, (reduced, trainable, frozen)


def test_training_only_biases_reduces_only_them_and_matches_reference() -> None:
    run_distributed(_train_biases_only, 2)


def _interleaved_frozen_roots_with_a_no_grad_forward(rank: int, world_size: int) -> None:
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for index in range(6):
            linear = nn.Linear(16, 16)
            linear.requires_grad_(index % 2 == 1)  # frozen, trainable, frozen, ...
            layers += [linear, nn.ReLU()]
        model = nn.Sequential(*layers)
        reference = copy.deepcopy(model)
        for module in model:
            if isinstance(module, nn.Linear):
                fully_shard(module, strategy=strategy)  # every linear its own root
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(trainable, lr=1e-2)
        reference_optimizer = torch.optim.Adam([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
        parity = Parity(build=lambda: model, shard=lambda m: None, reference_optimizer=reference_optimizer)
        for step in range(3):
            inputs = float_batch(step, 16)
            if step == 1:
                with torch.no_grad():
                    expected, got = reference(inputs), model(local_slice(inputs))
                torch.testing.assert_close(got, local_slice(expected), atol=2e-6, rtol=1e-5)
                continue
            reference(inputs).sum().div(inputs.shape[0]).backward()
            local = local_slice(inputs)
            model(local).sum().div(local.shape[0]).backward()
            assert_resharded(model)
            compare_full(model, reference, parity, f"{strategy.name} step {step}", grads=True)
            for opt in (optimizer, reference_optimizer):
                opt.step()
                opt.zero_grad(set_to_none=step % 2 == 0)


def test_interleaved_frozen_roots_with_a_no_grad_forward_match_reference() -> None:
    run_distributed(_interleaved_frozen_roots_with_a_no_grad_forward, 2)


class _MultiForwardMixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer_0 = nn.Linear(5, 5)
        self.layer_no_grad = nn.Linear(5, 5)
        self.layer_with_grad = nn.Linear(5, 5)
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(F.relu(self.layer_with_grad(x)))
            with torch.no_grad():  # the same units again, without autograd
                x += F.relu(self.layer_with_grad(x))
        return x


def _multi_forward_mixed_requires_grad(rank: int, world_size: int) -> None:
    for strategy in STRATEGIES:

        def shard(model: nn.Module) -> None:
            for module in model.children():
                fully_shard(module, strategy=strategy)
            fully_shard(model, strategy=strategy)

        train_in_parity(_MultiForwardMixed, shard, dim=5, steps=4, when=strategy.name)


def test_frozen_and_trainable_units_run_several_times_per_forward_match_reference() -> None:
    run_distributed(_multi_forward_mixed_requires_grad, 2)
