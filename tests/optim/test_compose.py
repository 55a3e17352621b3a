"""Owner-stepped optimizers composed with what training loops do, each
against one process on the global batch step by step: gradient accumulation
(``no_sync`` and ``set_requires_gradient_sync``), clipping before the step,
a parameter whose gradient is None on every rank, bf16 mixed precision with
fp32 reduction, and one optimizer per parameter stepped in backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from composable_shard import (
    MixedPrecision,
    ShardingStrategy,
    clip_grad_norm_,
    no_sync,
    set_requires_gradient_sync,
    unshard_params,
)

from tests.support.harness_pool import run_distributed
from tests.support.mixed_precision import BF16, FP32, PrecisionCase, by_policy, run_mixed_precision_parity
from tests.support.models import TinyGPT, batch, lm_loss
from tests.support.optimizers import NewtonSchulzSGD, RowNormalizedSGD
from tests.support.parity import Parity, run_parity, shard_manually

ATOL, RTOL = 2e-6, 1e-5


def _accumulate_then_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int, world_size: int,
                          how: str) -> None:
    """Two micro-batches, the first without gradient sync, then clip and step."""
    inputs, targets = batch(step, global_batch=16)
    halves = [(inputs[:8], targets[:8]), (inputs[8:], targets[8:])]
    for micro, (x, y) in enumerate(halves):
        local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
        last = micro == len(halves) - 1
        if how == "no_sync" and not last:
            with no_sync(model):
                lm_loss(model(x[local]), y[local]).backward()
        else:
            set_requires_gradient_sync(model, last or how != "requires_gradient_sync")
            lm_loss(model(x[local]), y[local]).backward()
    clip_grad_norm_(model, 0.5)
    optimizer.step()
    optimizer.zero_grad()


def _reference_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    inputs, targets = batch(step, global_batch=16)
    for x, y in ((inputs[:8], targets[:8]), (inputs[8:], targets[8:])):
        lm_loss(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    optimizer.zero_grad()


def _compare(model: nn.Module, reference: nn.Module, when: str) -> None:
    expected = dict(reference.named_parameters())
    with unshard_params(model, writeback=False):
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, expected[name], atol=ATOL, rtol=RTOL, msg=lambda m: f"{when}, {name}: {m}")


def _accumulation_and_clipping(rank: int, world_size: int) -> None:
    for how in ("no_sync", "requires_gradient_sync"):
        for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD):
            torch.manual_seed(0)
            model = TinyGPT()
            reference = copy.deepcopy(model)
            shard_manually(strategy)(model)
            optimizer, reference_optimizer = NewtonSchulzSGD(model.parameters()), NewtonSchulzSGD(reference.parameters())
            for step in range(3):
                _accumulate_then_step(model, optimizer, step, rank, world_size, how)
                _reference_step(reference, reference_optimizer, step)
                _compare(model, reference, f"{how}, {strategy.name}, step {step}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_accumulation_and_clipping_before_the_owner_step(world_size: int) -> None:
    run_distributed(_accumulation_and_clipping, world_size)


class _WithUnused(TinyGPT):
    """A TinyGPT with a layer its forward never uses: its gradient is None
    on every rank, and one process's optimizer skips it."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(16, 16)


def _unused_parameter(rank: int, world_size: int) -> None:
    run_parity(Parity(build=_WithUnused, shard=shard_manually(ShardingStrategy.FULL_SHARD),
                      make_optimizer=lambda m: RowNormalizedSGD(m.parameters())))


def test_a_parameter_without_gradient_on_every_rank_is_skipped_as_in_one_process() -> None:
    run_distributed(_unused_parameter, 2)


def _bf16_mixed_precision(rank: int, world_size: int) -> None:
    mixed = MixedPrecision(param_dtype=BF16, reduce_dtype=FP32)
    for name, make in (("newton_schulz", lambda m: NewtonSchulzSGD(m.parameters())),
                       ("adafactor", lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2))):
        run_mixed_precision_parity(
            PrecisionCase(name=f"bf16 params, fp32 reduction, {name}", build=TinyGPT, shard=by_policy(mixed_precision=mixed),
                          make_optimizer=make),
            rank, world_size,
        )


@pytest.mark.parametrize("world_size", [2, 4])
def test_bf16_mixed_precision_with_an_owner_stepped_optimizer(world_size: int) -> None:
    run_distributed(_bf16_mixed_precision, world_size)


def _optimizer_in_backward(rank: int, world_size: int) -> None:
    """One owner-stepped optimizer per parameter, stepped in its
    post-accumulate-grad hook (after the reduction), against one process
    stepping the same optimizers after its backward."""
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    shard_manually(ShardingStrategy.FULL_SHARD)(model)
    reference_optimizers = {p: NewtonSchulzSGD([p]) for p in reference.parameters()}
    optimizers = {p: NewtonSchulzSGD([p]) for p in model.parameters()}

    def step_in_backward(param: torch.Tensor) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad()

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(step_in_backward)
    for step in range(2):
        inputs, targets = batch(step)
        local = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
        lm_loss(model(inputs[local]), targets[local]).backward()
        lm_loss(reference(inputs), targets).backward()
        for optimizer in reference_optimizers.values():
            optimizer.step()
            optimizer.zero_grad()
        _compare(model, reference, f"optimizer in backward, step {step}")


def test_owner_stepped_optimizers_in_backward() -> None:
    run_distributed(_optimizer_in_backward, 4)
